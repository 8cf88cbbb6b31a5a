"""Pure-PyTorch reference of the index cache insert (SPEC section 2, step 1), written as loops.

The index cache holds ONE index-key vector per token (it is shared by every
index head), in page-128 blocks ``[num_blocks, 128, Di]`` addressed by the same
block table as the KV cache. Token ``p`` of request ``r`` lives at slot::

    slot = block_table[r, p // 128] * 128 + p % 128

that is row ``slot % 128`` of block ``slot // 128``. A negative slot is padding:
nothing is written.
"""

from __future__ import annotations

import torch

from .._twin import twin_of
from ..constants import SPARSE_BLOCK_SIZE
from ..fp8 import quantize
from .checks import check_insert_index_cache, check_token_slots, index_cache_slots


@twin_of("mm3lab.index_cache")
def insert_index_cache(index_k, index_cache, slot_mapping, index_scale):
    """Write each token's index key to its slot, in place.

    Args:
        index_k: ``[N, Di]`` index keys, the cache's dtype (any float dtype for an FP8 cache).
        index_cache: ``[num_blocks, 128, Di]``.
        slot_mapping: ``[N]`` int32/int64 slots ``block * 128 + offset``; negative = padding.
        index_scale: ``[num_blocks, 128]`` float32 for an FP8 cache (SPEC section 9): the key is
            stored as ``k / scale`` in e4m3 with ``scale = amax(|k|) / 448`` (1 for a zero key).
    """
    check_insert_index_cache(index_k, index_cache, slot_mapping, index_scale)
    capacity = index_cache_slots(index_cache)
    for n, slot in enumerate(slot_mapping.tolist()):
        if slot < 0 or slot >= capacity:  # padding; a slot past the cache is never written
            continue
        block, offset = divmod(slot, SPARSE_BLOCK_SIZE)
        if index_scale is None:
            index_cache[block, offset] = index_k[n]
        else:
            values, scale = quantize(index_k[n])
            index_cache[block, offset] = values
            index_scale[block, offset] = scale


def token_slots(block_table: torch.Tensor, query_req_id: torch.Tensor, query_abs_pos: torch.Tensor) -> torch.Tensor:
    """The slot of every token: ``block_table[r, p // 128] * 128 + p % 128``, ``-1`` where ``p < 0``.

    Args:
        block_table: ``[B, M]`` logical -> physical block of each request.
        query_req_id: ``[N]`` request of each token.
        query_abs_pos: ``[N]`` absolute position of each token (negative = padding).
    Returns:
        ``[N]`` int64 slots, the same for the index cache and the page-128 KV cache.
    """
    check_token_slots(block_table, query_req_id, query_abs_pos)
    table = block_table.tolist()
    b, m = block_table.shape
    slots = []
    for r, p in zip(query_req_id.tolist(), query_abs_pos.tolist(), strict=True):
        # with validation off, a request or block outside the table is padding (never a wrap to row -1)
        if p < 0 or not 0 <= r < b or p // SPARSE_BLOCK_SIZE >= m:
            slots.append(-1)
            continue
        slot = table[r][p // SPARSE_BLOCK_SIZE] * SPARSE_BLOCK_SIZE + p % SPARSE_BLOCK_SIZE
        slots.append(slot if slot < 2**63 else -1)  # past int64: past every cache, never wrapped
    return torch.tensor(slots, dtype=torch.int64, device=block_table.device)


__all__ = ["insert_index_cache", "token_slots"]
