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

from ..constants import SPARSE_BLOCK_SIZE
from .checks import check_insert_index_cache, check_token_slots, index_cache_slots


def insert_index_cache(index_k: torch.Tensor, index_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write each token's index key to its slot, in place.

    Args:
        index_k: ``[N, Di]`` index keys, the cache's dtype.
        index_cache: ``[num_blocks, 128, Di]``.
        slot_mapping: ``[N]`` int32/int64 slots ``block * 128 + offset``; negative = padding.
    """
    check_insert_index_cache(index_k, index_cache, slot_mapping)
    capacity = index_cache_slots(index_cache)
    for n, slot in enumerate(slot_mapping.tolist()):
        if slot < 0 or slot >= capacity:  # padding; a slot past the cache is never written
            continue
        block, offset = divmod(slot, SPARSE_BLOCK_SIZE)
        index_cache[block, offset] = index_k[n]


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
    slots = []
    for r, p in zip(query_req_id.tolist(), query_abs_pos.tolist(), strict=False):
        if p < 0:
            slots.append(-1)
        else:
            slots.append(table[r][p // SPARSE_BLOCK_SIZE] * SPARSE_BLOCK_SIZE + p % SPARSE_BLOCK_SIZE)
    return torch.tensor(slots, dtype=torch.int64, device=block_table.device)


__all__ = ["insert_index_cache", "token_slots"]
