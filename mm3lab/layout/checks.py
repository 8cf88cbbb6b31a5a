"""Argument checks of the layout entry points, shared by the kernel path and the reference."""

from __future__ import annotations

import torch

from .._checks import check_index, check_out, check_same_device, check_tensor, first_bad_row, validation_enabled
from ..constants import SPARSE_BLOCK_SIZE
from .views import check_kv_views


def check_rebase_block_table(block_table, out) -> None:
    check_index("block_table", block_table)
    check_out("out", out, block_table.shape, block_table.dtype, block_table.device)


def check_write_kv(key, value, k_cache, v_cache, slot_mapping) -> int:
    """Validate ``write_kv_page16``'s arguments; return the views' ``block_page_stride``."""
    block_page_stride = check_kv_views(k_cache, v_cache)
    _, _, h, d = k_cache.shape
    check_tensor("key", key, ndim=3)
    n = key.shape[0]
    check_tensor("key", key, shape=(n, h, d), dtypes=(k_cache.dtype,))
    check_tensor("value", value, shape=(n, h, d), dtypes=(k_cache.dtype,))
    check_index("slot_mapping", slot_mapping, shape=(n,))
    check_same_device(k_cache=k_cache, key=key, value=value, slot_mapping=slot_mapping)
    if validation_enabled() and n:
        capacity = (k_cache.shape[0] // block_page_stride) * SPARSE_BLOCK_SIZE
        row = first_bad_row(slot_mapping >= capacity)
        if row is not None:
            raise ValueError(
                f"slot_mapping: row {row} has slot {int(slot_mapping[row])}, past the cache's "
                f"{capacity} slots ({capacity // SPARSE_BLOCK_SIZE} blocks)"
            )
    return block_page_stride


def cache_slots(k_cache: torch.Tensor, block_page_stride: int) -> int:
    """Slots (tokens) the cache behind these views holds."""
    return (k_cache.shape[0] // block_page_stride) * SPARSE_BLOCK_SIZE
