"""Argument checks of the sparse block table entry points, shared by the kernel path and the reference.

Structural checks (ranks, shapes, dtypes, devices, ``out`` buffers) always run.
Value checks (a block id past the block table, a position the table cannot
hold, a request id out of range) read tensor contents and run only while
``mm3lab.validation_enabled()``; they cost one small launch and one host read in
all (:mod:`mm3lab._valcheck`); the detailed message is computed only for a bad call.
"""

from __future__ import annotations

import torch

from .._checks import (
    BLOCK_PAGE_STRIDES,  # noqa: F401  (re-exported)
    blocks_used_decode,
    blocks_used_prefill,
    check_decode_rows,
    check_index,
    check_out,
    check_same_device,
    prefill_row_checks,
    seq_lens_check,
    table_entry_check,
    validation_enabled,
)
from .._checks import check_block_page_stride as _check_stride
from .._checks import raise_first as _raise_first
from .._checks import value_checks as _value_checks
from .._valcheck import Segment
from ..constants import PAGES_PER_SPARSE_BLOCK, SPARSE_BLOCK_SIZE


def _check_outputs(out, h: int, n: int, k: int, device) -> None:
    if out is None:
        return
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise TypeError("out: expected a pair (sparse_bt, sparse_ctx) of int32 tensors")
    sparse_bt, sparse_ctx = out
    for i, t in enumerate(out):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"out[{i}]: expected an int32 tensor (out is a pair of buffers), got {type(t).__name__}")
    check_out("out[0] (sparse_bt)", sparse_bt, (h, n, k * PAGES_PER_SPARSE_BLOCK), torch.int32, device)
    check_out("out[1] (sparse_ctx)", sparse_ctx, (h, n), torch.int32, device)


def _check_common(topk_idx, block_table, block_page_stride, out):
    check_index("topk_idx", topk_idx, ndim=3)
    check_index("block_table", block_table, ndim=2)
    _check_stride(block_page_stride)
    h, n, k = topk_idx.shape
    _check_outputs(out, h, n, k, topk_idx.device)
    return h, n, k


def _topk_past_table(topk_idx: torch.Tensor, width: int):
    """An id at or past the block table's width, reported as (head, row)."""
    h, n, k = topk_idx.shape
    mask = (topk_idx >= width).reshape(h * n, k)

    def message(flat: int) -> str:
        head, row = divmod(flat, n)
        ids = topk_idx[head, row].tolist()
        bad = next(b for b in ids if b >= width)
        return (
            f"topk_idx: head {head}, row {row} selects block {bad}, past the block table's {width} blocks (row {ids})"
        )

    return mask, message


def _physical_id_range(block_page_stride: int) -> tuple[int, int]:
    """``(bottom, top)``: the physical block ids whose page ids ``id * stride + j`` fit int32."""
    return -(2**31) // block_page_stride, (2**31 - PAGES_PER_SPARSE_BLOCK) // block_page_stride


def _page_overflow(block_table, blocks_used, block_page_stride: int):
    """A table entry that a row reads whose page ids do not fit int32 (see :func:`_physical_id_range`)."""
    bottom, top = _physical_id_range(block_page_stride)
    return table_entry_check(
        block_table,
        blocks_used,
        (block_table > top) | (block_table < bottom),
        lambda phys: (
            f"is physical block {phys}, whose page ids (x {block_page_stride}) do not fit int32: "
            f"physical ids must lie in [{bottom}, {top}]"
        ),
    )


def check_decode(topk_idx, block_table, seq_lens, decode_query_len, block_page_stride, out) -> None:
    """Validate ``build_sparse_block_table_decode``'s arguments (see its docstring)."""
    _h, n, k = _check_common(topk_idx, block_table, block_page_stride, out)
    b, m = block_table.shape
    check_decode_rows("topk_idx", n, seq_lens, decode_query_len, b)
    check_same_device(topk_idx=topk_idx, block_table=block_table, seq_lens=seq_lens)
    check_decode_values(topk_idx, block_table, seq_lens, block_page_stride)


def check_decode_values(topk_idx, block_table, seq_lens, block_page_stride) -> None:
    """The value checks of :func:`check_decode` (while validation is on)."""
    _h, n, k = topk_idx.shape
    m = block_table.shape[1]
    if not validation_enabled() or n == 0:
        return
    capacity = m * SPARSE_BLOCK_SIZE
    bottom, top = _physical_id_range(block_page_stride)
    segments = [
        Segment("all", seq_lens, hi=capacity),
        Segment("all", topk_idx, hi=m - 1) if k else None,
        Segment("len", block_table, lo=bottom, hi=top, aux=seq_lens, unit=SPARSE_BLOCK_SIZE) if m else None,
    ]

    def detail() -> None:
        checks = [seq_lens_check(seq_lens, m)]
        if k:
            checks.append(_topk_past_table(topk_idx, m))
        if m:
            checks.append(_page_overflow(block_table, blocks_used_decode(seq_lens, m), block_page_stride))
        _raise_first(checks)

    _value_checks(segments, detail)


def check_prefill(topk_idx, block_table, query_req_id, query_abs_pos, block_page_stride, out) -> None:
    """Validate ``build_sparse_block_table_prefill``'s arguments (see its docstring)."""
    _h, n, k = _check_common(topk_idx, block_table, block_page_stride, out)
    b, m = block_table.shape
    check_index("query_req_id", query_req_id, shape=(n,))
    check_index("query_abs_pos", query_abs_pos, shape=(n,))
    check_same_device(
        topk_idx=topk_idx, block_table=block_table, query_req_id=query_req_id, query_abs_pos=query_abs_pos
    )
    if not validation_enabled() or n == 0:
        return
    capacity = m * SPARSE_BLOCK_SIZE
    bottom, top = _physical_id_range(block_page_stride)
    segments = [
        Segment("live", query_req_id, lo=0, hi=b - 1, aux=query_abs_pos),
        Segment("all", query_abs_pos, hi=capacity - 1),
        Segment("all", topk_idx, hi=m - 1) if k else None,
        Segment("gather", block_table, lo=bottom, hi=top, aux=query_req_id, pos=query_abs_pos, unit=SPARSE_BLOCK_SIZE)
        if m
        else None,
    ]

    def detail() -> None:
        pos = query_abs_pos.to(torch.int64)
        req = query_req_id.to(torch.int64)
        checks = prefill_row_checks(query_req_id, query_abs_pos, b, m)
        if k:
            checks.append(_topk_past_table(topk_idx, m))
        if m:
            checks.append(_page_overflow(block_table, blocks_used_prefill(req, pos, b, m), block_page_stride))
        _raise_first(checks)

    _value_checks(segments, detail)
