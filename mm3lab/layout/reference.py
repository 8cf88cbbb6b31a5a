"""Pure-PyTorch reference of the page-16 layout operations, written as loops.

These read like SPEC section 4 and are the specification the vectorized and
Triton paths are tested against.
"""

from __future__ import annotations

import torch

from .._twin import twin_of
from ..constants import PAGE16_SIDES_PER_BLOCK, PAGE_SIZE, SPARSE_BLOCK_SIZE
from ..fp8 import quantize
from .checks import cache_slots, check_rebase_block_table, check_rebase_slots, check_write_kv


@twin_of("mm3lab.layout")
def rebase_block_table_to_page16(block_table, out):
    """Every block id ``b`` becomes ``2 * b`` (negative ids too).

    Args:
        block_table: int tensor of any shape, e.g. ``[B, M]``.
        out: optional int buffer of the same shape and dtype.
    """
    check_rebase_block_table(block_table, out)
    flat_in = block_table.reshape(-1).tolist()
    result = torch.tensor([b * PAGE16_SIDES_PER_BLOCK for b in flat_in], dtype=block_table.dtype)
    result = result.reshape(block_table.shape).to(block_table.device)
    if out is None:
        return result
    out.copy_(result)
    return out


@twin_of("mm3lab.layout")
def rebase_slot_mapping_to_page16(slots):
    """Slot ``s = block * 128 + off`` becomes ``2 * block * 128 + off``; negative slots stay.

    Args:
        slots: int tensor ``[N]`` (any shape) of page-128 slots.
    """
    check_rebase_slots(slots)
    rebased = []
    for s in slots.reshape(-1).tolist():
        block = max(s, 0) // SPARSE_BLOCK_SIZE
        rebased.append(s + block * SPARSE_BLOCK_SIZE)
    return torch.tensor(rebased, dtype=slots.dtype).reshape(slots.shape).to(slots.device)


@twin_of("mm3lab.layout")
def write_kv_page16(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale):
    """Write each token's K and V to its page-16 slot, in place.

    Args:
        key, value: ``[N, H, D]``.
        k_cache, v_cache: page-16 views ``[pages, 16, H, D]`` (dense or packed).
        slot_mapping: ``[N]``; slot ``block * 128 + off``, negative = padding.
        k_scale, v_scale: FP8 caches only: ``[pages, 16, H]`` scale views; each (token, head)
            vector is stored as ``x / scale``, ``scale = amax(|x|) / 448`` (1 for zeros), SPEC section 9.
    """
    block_page_stride = check_write_kv(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    capacity = cache_slots(k_cache, block_page_stride)
    for n, slot in enumerate(slot_mapping.tolist()):
        if slot < 0 or slot >= capacity:  # padding; past the cache is never written
            continue
        block, off = divmod(slot, SPARSE_BLOCK_SIZE)
        page = block * block_page_stride + off // PAGE_SIZE
        row = off % PAGE_SIZE
        if k_scale is None:
            k_cache[page, row] = key[n]
            v_cache[page, row] = value[n]
        else:
            k_cache[page, row], k_scale[page, row] = quantize(key[n])
            v_cache[page, row], v_scale[page, row] = quantize(value[n])
