"""The row rule (SPEC 2): which request and position each query row stands for, said once.

Decode rows: row ``n = r * dql + i`` is query ``i`` of request ``r``, at position
``p = seq_lens[r] - dql + i``. Prefill rows carry their own ``query_req_id[n]`` and
``query_abs_pos[n]``. For both, a negative ``p`` is a padded row, and a request id
outside ``[0, B)`` makes the row padded too. A live row's page-128 slot is
``block_table[r, p // 128] * 128 + p % 128`` (SPEC 2.1).

* :func:`decode_rows`: the rule on the host (PyTorch); :func:`decode_query_rows` checks
  its arguments and returns the int32 rows the prefill entry points take;
* :func:`row_request_position`: the same rule inside a Triton kernel, and :func:`row_slots_store`
  with the slots too (the rows kernel below and the MSA step's fused insert,
  :mod:`mm3lab.msa.insert`, both run it; :func:`row_launch_args` gives their leading arguments);
* :func:`row_slots`: the slots of rows on the host;
* :func:`rows_and_slots`: rows and slots of one MSA step in a single launch, into
  caller-owned buffers (nothing allocated, so a CUDA graph can capture it); the values of
  :func:`decode_query_rows` and :func:`mm3lab.index_cache.token_slots`.

Kernels, checks and references all use one of these.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import backend
from ._checks import check_index, check_int
from ._grid import cdiv
from .constants import SPARSE_BLOCK_SIZE

__all__ = [
    "decode_query_rows",
    "decode_rows",
    "row_launch_args",
    "row_request_position",
    "row_slots",
    "row_slots_store",
    "rows_and_slots",
]

_BLOCK = 128


def decode_rows(seq_lens: torch.Tensor, decode_query_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(request [B * dql], p [B * dql])`` int64 of the decode rows, ``p`` as the rule gives it (no clamping)."""
    dql = decode_query_len
    rows = torch.arange(seq_lens.shape[0] * dql, device=seq_lens.device)
    req = rows // dql
    return req, seq_lens.long()[req] - dql + rows % dql


def decode_query_rows(seq_lens: torch.Tensor, decode_query_len: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Request and position of every decode row (:func:`decode_rows`), as prefill rows take them.

    Args:
        seq_lens: ``[B]`` tokens per request, the decode queries included.
        decode_query_len: query tokens per request (``> 1`` for speculative decode).
    Returns:
        ``(query_req_id [B * dql], query_abs_pos [B * dql])`` int32; a padded row has ``p = -1``.
    """
    check_index("seq_lens", seq_lens, ndim=1)
    req, pos = decode_rows(seq_lens, check_int("decode_query_len", decode_query_len, minimum=1))
    return req.to(torch.int32), pos.clamp(min=-1).to(torch.int32)


@triton.jit
def row_request_position(n, live, req_ptr, stride_r, pos_ptr, stride_p, B, DQL, PREFILL: tl.constexpr):
    """``(request, p)`` int64 of rows ``n`` (scalar or vector) where ``live``; ``p = -1`` for a padded row.

    ``PREFILL``: ``req_ptr`` / ``pos_ptr`` are ``query_req_id`` / ``query_abs_pos``; else ``req_ptr`` is
    ``seq_lens`` and ``DQL`` the decode query length (``pos_ptr`` unused). A request id outside
    ``[0, B)`` gives ``p = -1`` and request 0 (a row that reads nothing). A decode ``p`` below ``-1``
    is returned as it is (negative: padded).
    """
    if PREFILL:
        req = tl.load(req_ptr + n * stride_r, mask=live, other=-1).to(tl.int64)
        p = tl.load(pos_ptr + n * stride_p, mask=live, other=-1).to(tl.int64)
    else:
        req = (n // DQL).to(tl.int64)
        p = tl.load(req_ptr + req * stride_r, mask=live, other=0).to(tl.int64) - DQL + n % DQL
    in_range = (req >= 0) & (req < B)
    p = tl.where(live & in_range, p, -1)
    req = tl.where(in_range, req, 0)
    return req, p


@triton.jit
def row_slots_store(
    offs,
    ok,
    rows,  # (seq_lens_ptr, req_ptr, stride_r, pos_ptr, stride_p): decode reads seq_lens and writes req / pos
    table,  # (bt_ptr, stride_bb, stride_bm)
    slot_ptr,
    B,
    M,
    DQL,
    PREFILL: tl.constexpr,
    SPARSE_BLOCK: tl.constexpr,
):
    """Rows ``offs`` (where ``ok``) of one step: store their slots (and, decode, their request and
    position) and return the slots, int64, ``-1`` for a padded row or one outside the table."""
    seq_lens_ptr, req_ptr, stride_r, pos_ptr, stride_p = rows
    bt_ptr, stride_bb, stride_bm = table
    if PREFILL:
        r, p = row_request_position(offs, ok, req_ptr, stride_r, pos_ptr, stride_p, B, DQL, True)
    else:
        r, p = row_request_position(offs, ok, seq_lens_ptr, 1, pos_ptr, stride_p, B, DQL, False)
        p = tl.where(p < 0, -1, p)
        tl.store(req_ptr + offs * stride_r, r.to(req_ptr.dtype.element_ty), mask=ok)
        tl.store(pos_ptr + offs * stride_p, p.to(pos_ptr.dtype.element_ty), mask=ok)
    pc = tl.where(p < 0, 0, p)
    logical = pc // SPARSE_BLOCK
    live = ok & (p >= 0) & (logical < M)
    phys = tl.load(bt_ptr + r * stride_bb + tl.where(live, logical, 0) * stride_bm, mask=live, other=0).to(tl.int64)
    slot = tl.where(live, phys * SPARSE_BLOCK + pc % SPARSE_BLOCK, -1)
    tl.store(slot_ptr + offs, slot, mask=ok)
    return slot


@triton.jit
def _rows_slots(
    seq_lens_ptr,
    bt_ptr,
    stride_bb,
    stride_bm,
    req_ptr,
    stride_r,
    pos_ptr,
    stride_p,
    slot_ptr,
    N,
    B,
    M,
    DQL,
    PREFILL: tl.constexpr,
    BLOCK: tl.constexpr,
    SPARSE_BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    row_slots_store(
        offs, offs < N, (seq_lens_ptr, req_ptr, stride_r, pos_ptr, stride_p), (bt_ptr, stride_bb, stride_bm), slot_ptr,
        B, M, DQL, PREFILL, SPARSE_BLOCK,
    )  # fmt: skip


def row_slots(block_table: torch.Tensor, req: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """``[N]`` int64 page-128 slots of rows ``(req, pos)`` on the host: ``block_table[r, p // 128] * 128 + p % 128``,
    ``-1`` for a padded row, a row outside the table, or a slot past int64 (past every cache: never wrapped)."""
    pos, req = pos.to(torch.int64), req.to(torch.int64)
    b, m = block_table.shape
    if pos.numel() == 0 or block_table.numel() == 0:
        return torch.full_like(pos, -1)
    logical = pos.clamp(min=0) // SPARSE_BLOCK_SIZE
    live = (pos >= 0) & (req >= 0) & (req < b) & (logical < m)
    physical = block_table.to(torch.int64)[torch.where(live, req, 0), torch.where(live, logical, 0)]
    live = live & (physical < 2**63 // SPARSE_BLOCK_SIZE)
    return torch.where(live, physical * SPARSE_BLOCK_SIZE + pos.clamp(min=0) % SPARSE_BLOCK_SIZE, -1)


def _rows_slots_torch(seq_lens, block_table, req, pos, slots, dql, prefill) -> None:
    if not prefill:
        r, p = decode_rows(seq_lens, dql)
        req.copy_(r)
        pos.copy_(p.clamp(min=-1))
    slots.copy_(row_slots(block_table, req, pos))


def row_launch_args(block_table, req, pos, slots, seq_lens, decode_query_len: int, *middle) -> tuple:
    """The leading arguments of a kernel that runs :func:`row_slots_store` (``_rows_slots`` and the MSA
    step's fused insert): the rows' tensors and strides, ``middle``, then ``B, M, DQL``."""
    rows = (req if seq_lens is None else seq_lens, block_table, *block_table.stride(), req, req.stride(0), pos)
    return (*rows, pos.stride(0), slots, *middle, *block_table.shape, decode_query_len)


def rows_and_slots(
    block_table: torch.Tensor,
    req: torch.Tensor,
    pos: torch.Tensor,
    slots: torch.Tensor,
    *,
    seq_lens: torch.Tensor | None = None,
    decode_query_len: int = 1,
) -> None:
    """Fill ``slots [N]`` int64 (and, for decode, ``req`` / ``pos [N]``) in one launch.

    Decode: pass ``seq_lens [B]``; ``req`` and ``pos`` are written. Prefill: ``seq_lens=None``;
    ``req`` and ``pos`` are read. ``slots`` must be int64 and contiguous; ``req`` / ``pos`` may have
    any stride. Arguments are validated by the callers (the MSA layer and plans); nothing is checked here.
    """
    n = slots.shape[0]
    if n == 0:
        return
    prefill = seq_lens is None
    if not backend.use_kernel(block_table, req, pos, slots) or block_table.numel() == 0:
        _rows_slots_torch(seq_lens, block_table, req, pos, slots, decode_query_len, prefill)
        return
    _rows_slots[(cdiv(n, _BLOCK),)](
        *row_launch_args(block_table, req, pos, slots, seq_lens, decode_query_len, n),
        PREFILL=prefill,
        BLOCK=_BLOCK,
        SPARSE_BLOCK=SPARSE_BLOCK_SIZE,
    )
