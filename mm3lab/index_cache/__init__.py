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

from .. import _replay, _valcheck, backend
from .._checks import FLOAT_DTYPES, check_device, check_int, check_slots_inside, validation_enabled
from ..constants import SPARSE_BLOCK_SIZE
from ..fp8 import FP8_DTYPE
from ..rows import row_slots
from . import reference
from .checks import check_index_cache, check_insert_index_cache, check_token_slots, index_cache_slots

__all__ = [
    "allocate_index_cache",
    "allocate_index_scale",
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
    """A ``[num_blocks, 128, index_dim]`` index cache (``fill=None`` leaves memory uninitialized).

    ``dtype=torch.float8_e4m3fn`` gives the FP8 keys of SPEC section 9; their per-token
    float32 scales are a separate ``[num_blocks, 128]`` tensor, :func:`allocate_index_scale`,
    passed as ``index_scale=`` to the insert and to every indexer entry point.
    """
    check_int("num_blocks", num_blocks, minimum=1)
    check_int("index_dim", index_dim, minimum=1)
    if dtype not in FLOAT_DTYPES and dtype != FP8_DTYPE:
        raise TypeError(f"dtype: expected float32, float16, bfloat16 or float8_e4m3fn, got {dtype}")
    device = check_device("device", device)
    cache = torch.empty(num_blocks, SPARSE_BLOCK_SIZE, index_dim, dtype=dtype, device=device)
    if fill is not None:
        cache.fill_(fill)
    return cache


def allocate_index_scale(num_blocks: int, *, device="cpu", fill: float = 1.0) -> torch.Tensor:
    """The per-token float32 scales ``[num_blocks, 128]`` of an FP8 index cache (SPEC section 9)."""
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
        raise ValueError(f"num_blocks: expected a positive int, got {num_blocks!r}")
    return torch.full((num_blocks, SPARSE_BLOCK_SIZE), float(fill), dtype=torch.float32, device=device)


def insert_index_cache(
    index_k: torch.Tensor,
    index_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    index_scale: torch.Tensor | None = None,
) -> None:
    """Scatter ``N`` index keys into the index cache by slot, in place, in one launch.

    An FP8 cache (``float8_e4m3fn``) quantizes on the way in (SPEC section 9): each key
    is stored as ``k / scale`` with ``scale = amax(|k|) / 448`` (1 for a zero key), and
    the scale goes to ``index_scale[block, offset]``. The kernel and the reference store
    the same bits.

    Slot ``block * 128 + offset`` is row ``offset`` of block ``block``. A negative
    slot is padding (nothing written). A slot past the cache is never written;
    while validation is on it raises ``ValueError`` (naming ``slot_mapping`` and the
    row) before anything is written, so a rejected call leaves the cache bit-identical.

    Args:
        index_k: ``[N, Di]`` float32/float16/bfloat16 in the cache's dtype (any of them for an
            FP8 cache); any strides.
        index_cache: ``[num_blocks, 128, Di]``, contiguous head dim (last dimension).
        slot_mapping: ``[N]`` int32/int64 slots, distinct where not negative (a repeated slot: which
            key lands is unspecified on a GPU; not checked).
        index_scale: ``[num_blocks, 128]`` float32 scales, required for an FP8 cache, ``None`` otherwise.
    Raises:
        TypeError: a non-tensor, float slots, a dtype that differs from the cache's.
        ValueError: wrong ranks, a dimension 1 other than 128, a head-dim mismatch, a
            slot vector of the wrong length, a non-contiguous cache head dim, tensors on
            different devices; with validation on, a slot ``>= num_blocks * 128``.
    """
    # A repeated call shape on a GPU: checked once, its launch replayed; the slots checked every call.
    # An insert of up to a few thousand keys checks its slots itself: one launch, which writes nothing
    # when a slot is past the cache, and one wait for its flag. Without that launch (zero-copy off, or
    # more keys) a small replayed insert is gated (it reads the check launch's flags and writes nothing
    # when one is set), so it is queued while the check runs; a rejected call writes nothing either way.
    validate = validation_enabled()

    def gated() -> bool:  # (asked after the checks: index_k is a tensor)
        return validate and index_k.shape[0] <= GATED_TOKENS

    def tensors() -> dict:  # (the call's tensors by name, as its recordings take them)
        return dict(index_k=index_k, index_cache=index_cache, slot_mapping=slot_mapping, index_scale=index_scale)

    key = _MEMO.key((index_k, slot_mapping), (index_cache, index_scale), (validate,))
    entry = _MEMO.get(key)
    if entry is not None and entry.recording is not None and entry.info is not None:
        # a kept checking launch: it checks the slots itself, and writes nothing where one is past the cache
        detail = lambda: check_slots_inside(slot_mapping, index_cache_slots(index_cache), "the index cache")  # noqa: E731
        _valcheck.replay_kept(entry, tensors(), index_k.device, key.stream, detail)
        return
    if entry is None and key is not None and validate and index_k.dim() == 2:
        from .kernel import checks_in_launch

        fused = _valcheck.fused_flags(index_k.device)
        if SELF_CHECK and fused is not None and checks_in_launch(*index_k.shape, index_scale is not None):
            # one launch that checks its slots before it writes: the replays' value checks run inside it
            check_insert_index_cache(index_k, index_cache, slot_mapping, index_scale)
            launch = lambda: _insert_checked(index_k, index_cache, slot_mapping, index_scale, check=fused)  # noqa: E731
            _valcheck.keep_checked(_MEMO, key, launch, tensors(), index_k.device, fused)
            return
    _replay.memo_call(
        _MEMO,
        key,
        check=lambda: check_insert_index_cache(index_k, index_cache, slot_mapping, index_scale),
        check_values=lambda replay: check_slots_inside(
            slot_mapping,
            index_cache_slots(index_cache),
            "the index cache",
            key=(key.token, slot_mapping.data_ptr()),
            then=replay if gated() else None,
        ),
        tensors=tensors,
        launch=lambda named: _insert_checked(
            index_k,
            index_cache,
            slot_mapping,
            index_scale,
            _valcheck.gate(index_k.device) if named and gated() else None,
        ),
        result=lambda named: None,
        entry=entry,  # (looked up above)
    )


SELF_CHECK = True
"""An insert of up to :data:`.kernel.CHECK_READS` slot reads (8192 keys of 128 dims), with validation on
and zero-copy flags, checks its own slots in its one launch (:func:`.kernel.checks_in_launch`); ``False``:
a check launch, then the insert (gated on its flags where it has at most :data:`GATED_TOKENS` keys;
benchmarks compare both)."""

GATED_TOKENS = 32
"""The most keys a replayed, checked insert gates on its check's flags (one program of the kernel).
Every program of a gated launch reads the flags from pinned host memory, a bus read each, and with
many programs those reads cost far more than the wait they save: gated, a 4096-key insert (128
programs) took 0.50 ms on an H100 where checking first and then inserting takes 0.03 ms. Above
this, the insert waits for the host's read of the flags."""

_MEMO = _replay.Memo("insert_index_cache")
"""Repeated call shapes of :func:`insert_index_cache` (:class:`mm3lab._replay.Memo`)."""


def _insert_checked(index_k, index_cache, slot_mapping, index_scale=None, gate=None, check=None) -> None:
    """:func:`insert_index_cache` after its checks, for a caller that made them (the MSA layer);
    ``gate``: the value-check flags the kernel's launch reads first (:func:`mm3lab._valcheck.gate`);
    ``check``: the launch checks the slots itself (see :func:`.kernel.insert_index_cache_kernel`)."""
    if index_k.shape[0] == 0:
        return
    if not backend.use_kernel(index_k, index_cache, slot_mapping, entry_point="insert_index_cache"):
        reference.insert_index_cache(index_k, index_cache, slot_mapping, index_scale=index_scale)
        return
    from .kernel import insert_index_cache_kernel

    if index_scale is not None and backend.INTERPRETER and index_k.dtype == torch.bfloat16:
        index_k = index_k.float()  # (the interpreter's bfloat16 arithmetic is inexact; the value is the same)
    insert_index_cache_kernel(index_k, index_cache, slot_mapping, index_scale, gate, check)


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
    return row_slots(block_table, query_req_id, query_abs_pos)
