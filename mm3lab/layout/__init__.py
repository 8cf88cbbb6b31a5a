"""Page-16 KV layouts (SPEC section 4).

The KV cache is allocated as page-128 blocks with logical shape
``[num_blocks, 2, 128, H, D]`` (side 0 = K, side 1 = V). Two memory orders of
that one logical tensor exist, and the sparse attention kernel reads either
through a pair of page-16 views ``k_cache, v_cache`` of shape ``[pages, 16, H, D]``:

``"dense"`` (dense planes, side-major memory)
    All K blocks, then all V blocks. ``k_cache`` is the K plane seen as
    ``[num_blocks * 8, 16, H, D]`` and ``v_cache`` the V plane; page id
    ``block * 8 + j`` reaches K and V. ``block_page_stride = 8``.
``"packed"`` (packed sides, block-major memory)
    Each block holds its 8 K pages then its 8 V pages. ``k_cache`` is the
    whole memory seen as ``[num_blocks * 16, 16, H, D]``, ``v_cache`` the same
    view starting 8 pages later, so page id ``block * 16 + j`` reaches the K
    page ``16 * block + j`` through ``k_cache`` and the V page
    ``16 * block + 8 + j`` through ``v_cache``. ``block_page_stride = 16``, and
    ``v_cache.shape[0] == k_cache.shape[0] - 8`` is how the layout is recognized.

Nothing here copies: every view shares memory with the page-128 tensor.
"""

from __future__ import annotations

import torch

from .. import backend
from ..constants import PAGE16_SIDES_PER_BLOCK, SPARSE_BLOCK_SIZE
from . import reference
from .checks import check_rebase_block_table, check_rebase_slots, check_write_kv
from .views import (
    DENSE_STRIDE,
    LAYOUTS,
    PACKED_STRIDE,
    PagedKVCache,
    PageLocation,
    allocate_kv_cache,
    check_kv_scales,
    check_kv_views,
    kv_cache_layout,
    layout_block_page_stride,
    locate_page,
    num_cache_blocks,
    page16_views,
    page_ids_of_block,
    sides_are_packed,
    slot_to_page,
    sparse_block_page_stride,
)

__all__ = [
    "DENSE_STRIDE",
    "LAYOUTS",
    "PACKED_STRIDE",
    "PageLocation",
    "PagedKVCache",
    "allocate_kv_cache",
    "check_kv_scales",
    "check_kv_views",
    "kv_cache_layout",
    "layout_block_page_stride",
    "locate_page",
    "num_cache_blocks",
    "page16_views",
    "page_ids_of_block",
    "rebase_block_table_to_page16",
    "rebase_slot_mapping_to_page16",
    "sides_are_packed",
    "slot_to_page",
    "sparse_block_page_stride",
    "write_kv_page16",
]


def rebase_block_table_to_page16(block_table: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Elementwise ``block_table * 2`` (``[-1, 0, 3] -> [-2, 0, 6]``).

    A kernel that hard-codes 8 pages per block emits ``b' * 8 + j``; given the
    rebased ids ``b' = 2 * b`` it emits ``16 * b + j``, the packed page ids.

    Args:
        block_table: int32/int64 tensor of any shape, e.g. ``[B, M]``.
        out: optional buffer of the same shape and dtype (may be ``block_table`` itself).
    """
    check_rebase_block_table(block_table, out)
    if out is None:
        return (block_table * PAGE16_SIDES_PER_BLOCK).contiguous()
    return torch.mul(block_table, PAGE16_SIDES_PER_BLOCK, out=out)


def rebase_slot_mapping_to_page16(slots: torch.Tensor) -> torch.Tensor:
    """Double only the block part of each slot: ``s + (max(s, 0) // 128) * 128``.

    ``[-1, 0, 127, 128, 129, 255, 256] -> [-1, 0, 127, 256, 257, 383, 512]``;
    negative (padding) slots pass through unchanged. The rebased slot is the
    token's row in the packed views seen as flat token lists,
    ``k_cache.flatten(0, 1)[s']`` and ``v_cache.flatten(0, 1)[s']``, which is
    what a page-16 writer that computes ``page = s' // 16, row = s' % 16``
    (8 pages per block hard-coded) needs to write into the packed layout.

    Args:
        slots: int32/int64 tensor of page-128 slots, any shape (usually ``[N]``).
    """
    check_rebase_slots(slots)
    block = torch.div(slots.clamp(min=0), SPARSE_BLOCK_SIZE, rounding_mode="floor")
    return (slots + block * SPARSE_BLOCK_SIZE).contiguous()


def write_kv_page16(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write K/V of ``N`` tokens into page-16 views of either layout, in place.

    Slot ``block * 128 + off`` goes to page ``block * block_page_stride + off // 16``,
    row ``off % 16``: K through ``k_cache``, V through ``v_cache``. A negative slot
    is padding (nothing written). A slot past the cache is never written, and
    while validation is on it raises ``ValueError`` before anything is written.
    If two tokens name the same slot, which one lands there is unspecified.

    Args:
        key, value: ``[N, H, D]`` in the cache's dtype (any float dtype for an FP8 cache).
        k_cache, v_cache: page-16 views ``[pages, 16, H, D]`` (dense or packed).
        slot_mapping: ``[N]`` int32/int64 page-128 slots, distinct where not negative (two tokens
            with one slot: which write lands is unspecified on a GPU; not checked).
        k_scale, v_scale: FP8 caches only (``PagedKVCache.k_scale`` / ``.v_scale``, ``[pages, 16, H]``
            float32): each (token, KV head) vector is quantized, ``scale = amax(|x|) / 448`` (1 for
            zeros), stored ``x / scale`` in e4m3 (SPEC section 9); kernel and reference store the same bits.
    """
    check_write_kv(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    _write_checked(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def _write_checked(key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """:func:`write_kv_page16` after its checks, for a caller that made them (the MSA layer)."""
    # (checked views: the packed layout's V view is 8 pages shorter, the dense one's is not)
    block_page_stride = PACKED_STRIDE if v_cache.shape[0] != k_cache.shape[0] else DENSE_STRIDE
    if key.shape[0] == 0:
        return
    if backend.use_kernel(key, k_cache, entry_point="write_kv_page16"):
        from .kernel import write_kv_page16_kernel

        if k_scale is not None and backend.INTERPRETER:
            key, value = key.float(), value.float()  # exact; the interpreter's bfloat16 arithmetic is not
        write_kv_page16_kernel(key, value, k_cache, v_cache, slot_mapping, block_page_stride, k_scale, v_scale)
    else:
        reference.write_kv_page16(key, value, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)
