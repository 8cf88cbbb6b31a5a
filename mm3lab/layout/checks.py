"""Argument checks of the layout entry points, shared by the kernel path and the reference."""

from __future__ import annotations

import torch

from .._checks import (
    check_index,
    check_no_alias,
    check_out,
    check_same_device,
    check_slots_inside,
    check_tensor,
    value_checks,
)
from .._valcheck import Segment
from ..constants import SPARSE_BLOCK_SIZE
from ..fp8 import FP8_DTYPE
from .views import check_kv_scales, check_kv_views


def _check_doubles(name: str, t: torch.Tensor) -> None:
    """Every value ``v`` of ``t`` has ``2 * v`` in ``t``'s dtype. Always runs (SPEC 7: a wrapped id is a
    wrong answer): one small launch and one host read."""
    if t.numel() == 0:
        return
    info = torch.iinfo(t.dtype)

    def detail() -> None:
        low, high = (int(v) for v in torch.stack(torch.aminmax(t)).tolist())
        if high > info.max // 2 or low < info.min // 2:
            bad = high if high > info.max // 2 else low
            raise ValueError(
                f"{name}: value {bad} doubled does not fit {str(t.dtype).replace('torch.', '')} "
                f"(values must lie in [{info.min // 2}, {info.max // 2}])"
            )

    value_checks([Segment("all", t, lo=info.min // 2, hi=info.max // 2)], detail)


def check_rebase_block_table(block_table, out) -> None:
    check_index("block_table", block_table)
    check_out("out", out, block_table.shape, block_table.dtype, block_table.device)
    _check_doubles("block_table", block_table)


def check_rebase_slots(slots) -> None:
    """``rebase_slot_mapping_to_page16``: a slot ``s`` becomes about ``2 s``; it must fit the dtype."""
    check_index("slots", slots)
    _check_doubles("slots", slots)


def check_write_kv(
    key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None, *, block_page_stride: int | None = None
) -> int:
    """Validate ``write_kv_page16``'s arguments; return the views' ``block_page_stride``.

    ``block_page_stride``: given by a caller that has checked the views and their scales
    (:func:`mm3lab.layout.views.check_kv_views`, ``check_kv_scales``), which are then not checked again.
    """
    if block_page_stride is None:
        block_page_stride = check_kv_views(k_cache, v_cache)
        check_kv_scales(k_cache, v_cache, k_scale, v_scale)  # FP8 (SPEC section 9)
    _, _, h, d = k_cache.shape
    check_tensor("key", key, ndim=3)
    n = key.shape[0]
    # an FP8 cache quantizes keys/values of any float dtype
    kv_dtypes = (torch.float32, torch.float16, torch.bfloat16) if k_cache.dtype == FP8_DTYPE else (k_cache.dtype,)
    check_tensor("key", key, shape=(n, h, d), dtypes=kv_dtypes)
    check_tensor("value", value, shape=(n, h, d), dtypes=kv_dtypes)
    check_index("slot_mapping", slot_mapping, shape=(n,))
    check_same_device(k_cache=k_cache, key=key, value=value, slot_mapping=slot_mapping)
    check_no_alias(k_cache=k_cache, v_cache=v_cache, inputs={"key": key, "value": value, "slot_mapping": slot_mapping})
    check_slots_inside(slot_mapping, cache_slots(k_cache, block_page_stride), "the cache")
    return block_page_stride


def cache_slots(k_cache: torch.Tensor, block_page_stride: int) -> int:
    """Slots (tokens) the cache behind these views holds."""
    return (k_cache.shape[0] // block_page_stride) * SPARSE_BLOCK_SIZE
