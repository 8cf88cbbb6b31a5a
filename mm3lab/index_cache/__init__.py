"""The index cache (SPEC section 2, step 1): one shared index key per token, in page-128 blocks.

MiniMax-M3's indexer scores blocks with ``index_q . index_k``, where each token
has ONE index key shared by all index heads (a key-only cache: there are no
index values). The cache is ``[num_blocks, 128, Di]`` and uses the request's
ordinary block table: token ``p`` of request ``r`` lives at slot
``block_table[r, p // 128] * 128 + p % 128`` (row ``slot % 128`` of block
``slot // 128``), exactly where its K and V live in the page-128 KV cache.

``reference.py`` is the loop that defines the insert; ``kernel.py`` the one-launch
Triton scatter. The insert only moves bits (no arithmetic), so every dtype,
bfloat16 included, is exact on every backend, the interpreter too.
"""

from __future__ import annotations

import torch

from .. import backend
from .._checks import FLOAT_DTYPES, check_int
from ..constants import SPARSE_BLOCK_SIZE
from . import reference
from .checks import check_index_cache, check_insert_index_cache, check_token_slots, index_cache_slots

__all__ = [
    "allocate_index_cache",
    "check_index_cache",
    "index_cache_slots",
    "insert_index_cache",
    "token_slots",
]


def allocate_index_cache(
    num_blocks: int,
    index_dim: int,
    *,
    dtype: torch.dtype = torch.float32,
    device="cpu",
    fill: float | None = None,
) -> torch.Tensor:
    """A ``[num_blocks, 128, index_dim]`` index cache (``fill=None`` leaves memory uninitialized)."""
    check_int("num_blocks", num_blocks, minimum=1)
    check_int("index_dim", index_dim, minimum=1)
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype: expected float32, float16 or bfloat16, got {dtype}")
    cache = torch.empty(num_blocks, SPARSE_BLOCK_SIZE, index_dim, dtype=dtype, device=device)
    if fill is not None:
        cache.fill_(fill)
    return cache


def insert_index_cache(index_k: torch.Tensor, index_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter ``N`` index keys into the index cache by slot, in place, in one launch.

    Slot ``block * 128 + offset`` is row ``offset`` of block ``block``. A negative
    slot is padding (nothing written). A slot past the cache is never written;
    while validation is on it raises ``ValueError`` (naming ``slot_mapping`` and the
    row) before anything is written, so a rejected call leaves the cache bit-identical.

    Args:
        index_k: ``[N, Di]`` float32/float16/bfloat16 in the cache's dtype; any strides.
        index_cache: ``[num_blocks, 128, Di]``, contiguous head dim (last dimension).
        slot_mapping: ``[N]`` int32/int64 slots.
    Raises:
        TypeError: a non-tensor, float slots, a dtype that differs from the cache's.
        ValueError: wrong ranks, a dimension 1 other than 128, a head-dim mismatch, a
            slot vector of the wrong length, a non-contiguous cache head dim, tensors on
            different devices; with validation on, a slot ``>= num_blocks * 128``.
    """
    check_insert_index_cache(index_k, index_cache, slot_mapping)
    if index_k.shape[0] == 0:
        return
    if not backend.use_kernel(index_k, index_cache, slot_mapping, entry_point="insert_index_cache"):
        reference.insert_index_cache(index_k, index_cache, slot_mapping)
        return
    from .kernel import insert_index_cache_kernel

    insert_index_cache_kernel(index_k, index_cache, slot_mapping)


def token_slots(block_table: torch.Tensor, query_req_id: torch.Tensor, query_abs_pos: torch.Tensor) -> torch.Tensor:
    """The page-128 slot of every token, ``block_table[r, p // 128] * 128 + p % 128`` (``-1`` where ``p < 0``).

    The same slot addresses the token in the index cache and in the KV cache:
    :func:`mm3lab.write_kv_page16` takes it as is, in either page-16 layout.

    Args:
        block_table: ``[B, M]`` int32/int64 logical -> physical block of each request.
        query_req_id: ``[N]`` int32/int64 request of each token.
        query_abs_pos: ``[N]`` int32/int64 absolute position of each token; negative = padding.
    Returns:
        ``[N]`` int64 slots.
    Raises:
        ValueError: a live token whose request or block is outside the block table (with
        validation off, such a token gets slot ``-1``: it is not written).
    """
    check_token_slots(block_table, query_req_id, query_abs_pos)
    pos = query_abs_pos.to(torch.int64)
    req = query_req_id.to(torch.int64)
    b, m = block_table.shape
    if pos.numel() == 0 or block_table.numel() == 0:  # every token is padding (checked)
        return torch.full_like(pos, -1)
    logical = pos // SPARSE_BLOCK_SIZE
    live = (pos >= 0) & (req >= 0) & (req < b) & (logical < m)
    physical = block_table.to(torch.int64)[torch.where(live, req, 0), torch.where(live, logical, 0)]
    return torch.where(live, physical * SPARSE_BLOCK_SIZE + pos % SPARSE_BLOCK_SIZE, -1)
