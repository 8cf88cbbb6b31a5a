"""Argument checks of ``insert_index_cache``, shared by the kernel path and the reference.

Structural checks (ranks, the 128-token block, head dim, dtype, slot vector
length, a contiguous head dim, one device) always run. The value check (a slot
past the cache) reads ``slot_mapping`` (one small launch and one host read,
:mod:`mm3lab._valcheck`) and runs while validation is on; with it
off, such a slot is skipped by both paths, so nothing is ever written outside
the cache.
"""

from __future__ import annotations

import torch

from .._checks import (
    FLOAT_DTYPES,
    check_index,
    check_last_dim_contiguous,
    check_same_device,
    check_slots_inside,
    check_tensor,
    raise_first,
    validation_enabled,
    value_checks,
)
from .._checks import dtype_name as _dtype_name
from .._valcheck import Segment
from ..constants import SPARSE_BLOCK_SIZE
from ..fp8 import FP8_DTYPE

MAX_SLOT_BLOCK = 2**63 // SPARSE_BLOCK_SIZE
"""Physical block ids below this have int64 slots ``block * 128 + offset``."""


def check_index_cache(index_cache) -> None:
    """``index_cache``: ``[num_blocks, 128, Di]``, float (or FP8), contiguous head dim."""
    check_tensor("index_cache", index_cache, ndim=3, dtypes=(*FLOAT_DTYPES, FP8_DTYPE))
    if index_cache.shape[1] != SPARSE_BLOCK_SIZE:
        raise ValueError(
            f"index_cache: dimension 1 must hold the {SPARSE_BLOCK_SIZE} tokens of a block, "
            f"got shape {tuple(index_cache.shape)}"
        )
    check_last_dim_contiguous("index_cache", index_cache)


def index_cache_slots(index_cache: torch.Tensor) -> int:
    """Slots (tokens) the cache holds: ``num_blocks * 128``."""
    return index_cache.shape[0] * SPARSE_BLOCK_SIZE


# --- FP8 index cache (SPEC section 9) ---


def check_index_scale(index_cache, index_scale) -> None:
    """``index_scale``: ``[num_blocks, 128]`` float32 on the cache's device for an FP8 cache, else ``None``."""
    if index_cache.dtype != FP8_DTYPE:
        if index_scale is not None:
            raise ValueError(
                f"index_scale: only an FP8 (float8_e4m3fn) index cache has scales; index_cache is "
                f"{_dtype_name(index_cache.dtype)}, pass index_scale=None"
            )
        return
    if index_scale is None:
        raise ValueError(
            "index_scale: an FP8 index cache needs its per-token scales (mm3lab.allocate_index_scale), got None"
        )
    check_tensor("index_scale", index_scale, shape=(index_cache.shape[0], SPARSE_BLOCK_SIZE), dtypes=(torch.float32,))
    check_last_dim_contiguous("index_scale", index_scale)
    check_same_device(index_cache=index_cache, index_scale=index_scale)


def check_insert_index_cache(index_k, index_cache, slot_mapping, index_scale=None) -> None:
    """Validate ``insert_index_cache``'s arguments (see its docstring); raise before anything is written."""
    check_index_cache(index_cache)
    check_index_scale(index_cache, index_scale)
    di = index_cache.shape[2]
    check_tensor("index_k", index_k, ndim=2, dtypes=FLOAT_DTYPES)
    n = index_k.shape[0]
    if index_k.shape[1] != di:
        raise ValueError(
            f"index_k: head dim {index_k.shape[1]} does not match index_cache's head dim {di} "
            f"(index_k {tuple(index_k.shape)}, index_cache {tuple(index_cache.shape)})"
        )
    if index_k.dtype != index_cache.dtype and index_cache.dtype != FP8_DTYPE:  # FP8: any float key, quantized
        raise TypeError(
            f"index_k: dtype {_dtype_name(index_k.dtype)} differs from index_cache's {_dtype_name(index_cache.dtype)}"
        )
    check_index("slot_mapping", slot_mapping, ndim=1)
    if slot_mapping.shape[0] != n:
        raise ValueError(f"slot_mapping: expected one slot per index_k row ({n}), got {slot_mapping.shape[0]}")
    check_same_device(index_cache=index_cache, index_k=index_k, slot_mapping=slot_mapping)
    check_slots_inside(slot_mapping, index_cache_slots(index_cache), "the index cache")


def check_token_slots(block_table, query_req_id, query_abs_pos) -> None:
    """Validate ``token_slots``: every live token's request and block inside the block table."""
    check_index("block_table", block_table, ndim=2)
    check_index("query_abs_pos", query_abs_pos, ndim=1)
    check_index("query_req_id", query_req_id, shape=(query_abs_pos.shape[0],))
    check_same_device(block_table=block_table, query_req_id=query_req_id, query_abs_pos=query_abs_pos)
    if not validation_enabled():  # (the value checks synchronize with the device)
        return
    b, m = block_table.shape
    segments = [
        Segment("live", query_req_id, lo=0, hi=b - 1, aux=query_abs_pos),
        Segment("live", query_abs_pos, hi=m * SPARSE_BLOCK_SIZE - 1, aux=query_abs_pos),
        Segment(
            "gather_last",
            block_table,
            lo=0,
            hi=MAX_SLOT_BLOCK - 1,
            aux=query_req_id,
            pos=query_abs_pos,
            unit=SPARSE_BLOCK_SIZE,
        )
        if m
        else None,
    ]
    value_checks(segments, lambda: _token_slots_detail(block_table, query_req_id, query_abs_pos))


def _token_slots_detail(block_table, query_req_id, query_abs_pos) -> None:
    b, m = block_table.shape
    pos = query_abs_pos.to(torch.int64)
    req = query_req_id.to(torch.int64)
    live = pos >= 0
    bad_req = live & ((req < 0) | (req >= b))
    bad_pos = live & (pos >= m * SPARSE_BLOCK_SIZE)
    ok = live & ~bad_req & ~bad_pos
    physical = torch.zeros_like(pos)
    if b and m and pos.numel():
        physical = block_table.to(torch.int64)[torch.where(ok, req, 0), torch.where(ok, pos // SPARSE_BLOCK_SIZE, 0)]
    bad_block = ok & ((physical < 0) | (physical >= MAX_SLOT_BLOCK))
    raise_first(
        [
            (
                bad_req,
                lambda row: (
                    f"query_req_id: row {row} has request {int(req[row])}, outside the block table's "
                    f"{b} requests [0, {b})"
                ),
            ),
            (
                bad_pos,
                lambda row: (
                    f"query_abs_pos: row {row} has position {int(pos[row])}, past the block table's "
                    f"{m} blocks = {m * SPARSE_BLOCK_SIZE} tokens"
                ),
            ),
            (
                bad_block,
                lambda row: (
                    f"block_table: row {row} (request {int(req[row])}, logical block "
                    f"{int(pos[row]) // SPARSE_BLOCK_SIZE}) maps to physical block {int(physical[row])}, "
                    f"outside [0, {MAX_SLOT_BLOCK}) (a slot must be an int64)"
                ),
            ),
        ]
    )
