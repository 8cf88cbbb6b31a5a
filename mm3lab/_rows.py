"""Rows and slots of one MSA step in a single launch (host-overhead helper of the MSA layer and plans).

For decode rows, ``n = r * dql + i`` sits at ``p = seq_lens[r] - dql + i`` (``-1`` when
negative: a padded row); for prefill rows ``(r, p)`` are given. Every live row
(``p >= 0``, ``0 <= r < B``, ``p // 128 < M``) gets the page-128 slot
``block_table[r, p // 128] * 128 + p % 128``, every other row ``-1``: the values of
:func:`mm3lab.msa.decode_query_rows` and :func:`mm3lab.index_cache.token_slots`, in
one launch instead of about fifteen small PyTorch ops, and into caller-owned buffers
(nothing is allocated, so it can be captured in a CUDA graph).

Arguments are validated by the callers; this module checks nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import backend
from .constants import SPARSE_BLOCK_SIZE

_BLOCK = 128


@triton.jit
def _rows_slots(
    seq_lens_ptr, bt_ptr, stride_bb, stride_bm,
    req_ptr, stride_r, pos_ptr, stride_p, slot_ptr,
    N, B, M, DQL,
    PREFILL: tl.constexpr, BLOCK: tl.constexpr, SPARSE_BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    if PREFILL:
        r = tl.load(req_ptr + offs * stride_r, mask=ok, other=0).to(tl.int64)
        p = tl.load(pos_ptr + offs * stride_p, mask=ok, other=-1).to(tl.int64)
    else:
        r = (offs // DQL).to(tl.int64)
        lens = tl.load(seq_lens_ptr + r, mask=ok, other=0).to(tl.int64)
        p = lens - DQL + (offs % DQL)
        p = tl.where(p < -1, -1, p)
        tl.store(req_ptr + offs * stride_r, r.to(req_ptr.dtype.element_ty), mask=ok)
        tl.store(pos_ptr + offs * stride_p, p.to(pos_ptr.dtype.element_ty), mask=ok)
    pc = tl.where(p < 0, 0, p)
    logical = pc // SPARSE_BLOCK
    live = ok & (p >= 0) & (r >= 0) & (r < B) & (logical < M)
    phys = tl.load(bt_ptr + tl.where(live, r, 0) * stride_bb + tl.where(live, logical, 0) * stride_bm,
                   mask=live, other=0).to(tl.int64)
    slot = tl.where(live, phys * SPARSE_BLOCK + pc % SPARSE_BLOCK, -1)
    tl.store(slot_ptr + offs, slot, mask=ok)


def _rows_slots_torch(seq_lens, block_table, req, pos, slots, dql, prefill) -> None:
    n = slots.shape[0]
    b, m = block_table.shape
    if not prefill:
        rows = torch.arange(n, device=slots.device)
        r = rows // dql
        p = (seq_lens.long()[r] - dql + rows % dql).clamp(min=-1)
        req.copy_(r)
        pos.copy_(p)
    r, p = req.long(), pos.long()
    logical = p.clamp(min=0) // SPARSE_BLOCK_SIZE
    live = (p >= 0) & (r >= 0) & (r < b) & (logical < m)
    if block_table.numel() == 0:
        slots.fill_(-1)
        return
    phys = block_table.long()[torch.where(live, r, 0), torch.where(live, logical, 0)]
    slots.copy_(torch.where(live, phys * SPARSE_BLOCK_SIZE + p.clamp(min=0) % SPARSE_BLOCK_SIZE, -1))


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
    ``req`` and ``pos`` are read. ``slots`` must be int64 and contiguous; ``req`` / ``pos`` may have any stride.
    """
    n = slots.shape[0]
    if n == 0:
        return
    prefill = seq_lens is None
    if not backend.use_kernel(block_table, req, pos, slots) or block_table.numel() == 0:
        _rows_slots_torch(seq_lens, block_table, req, pos, slots, decode_query_len, prefill)
        return
    b, m = block_table.shape
    _rows_slots[(triton.cdiv(n, _BLOCK),)](
        req if prefill else seq_lens, block_table, block_table.stride(0), block_table.stride(1),
        req, req.stride(0), pos, pos.stride(0), slots, n, b, m, decode_query_len,
        PREFILL=prefill, BLOCK=_BLOCK, SPARSE_BLOCK=SPARSE_BLOCK_SIZE,
    )


__all__ = ["rows_and_slots"]
