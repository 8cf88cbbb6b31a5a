"""Triton kernel of the sparse block table (SPEC section 3): one program per (row, head).

The per-row logic is the device function :func:`emit_sparse_block_table_row`,
meant to be called by any kernel that holds a row of selected blocks in
registers (for instance a fused "top-k -> sparse block table" kernel)::

    ctx = emit_sparse_block_table_row(
        blk,          # [K_BLOCK] int, the selected logical block ids; lanes >= K ignored, negative = padding
        p,            # scalar int, the query's absolute position; negative = padded row
        bt_row_ptr,   # pointer to the request's block_table row (int32 or int64)
        bt_stride_m,  # element stride of that row
        bt_width,     # M, the block table's width: ids >= M are never read
        out_row_ptr,  # pointer to the row's K * 8 contiguous int32 outputs
        K,            # selected slots per row
        K_BLOCK=...,  # constexpr power of 2 >= K
        BLOCK_PAGE_STRIDE=8 or 16, SPARSE_BLOCK=128, PAGES=8,   # constexprs (mm3lab.constants)
    )                 # -> sparse_ctx of the row, scalar int32 (the caller stores it)

It writes every one of the row's ``K * 8`` entries (used pages, then zeros),
keeps the first occurrence of a repeated block, drops ids that are negative,
past the table or after the query's block, and puts the causal tail block
(``p // 128``) last, exactly as :func:`mm3lab.block_table.reference.sparse_block_table_row`.

The whole row lives in registers: a ``[K_BLOCK]`` vector of ids, a
``[K_BLOCK, K_BLOCK]`` comparison for duplicates and output slots (K is 16 in
MiniMax-M3), and a ``[K_BLOCK, 8]`` tile of page ids. No atomics, no loops: the
same grid for every step, which is what CUDA-graph capture needs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import backend
from .._grid import next_power_of_2
from .._valcheck import signal_done
from ..constants import PAGES_PER_SPARSE_BLOCK, SPARSE_BLOCK_SIZE
from ..rows import row_request_position

# Triton's own sum combiner, which the interpreter reduces with numpy (tl.sum, a device
# function itself, costs the interpreter far more per call); a plain one where it is absent.
_add = getattr(tl.standard, "_sum_combine", None)
if _add is None:  # pragma: no cover - depends on the Triton version

    @triton.jit
    def _add(a, b):
        return a + b


@triton.jit
def emit_sparse_block_table_row(
    blk,  # [K_BLOCK] selected logical block ids (lanes >= K ignored; negative = padding)
    p,  # scalar: the query's absolute position, negative = padded row
    bt_row_ptr,  # the request's block_table row
    bt_stride_m,  # element stride of that row
    bt_width,  # M: block ids >= M are never read
    out_row_ptr,  # [K * PAGES] int32 output row (contiguous)
    K,  # selected slots per row
    K_BLOCK: tl.constexpr,  # power of 2 >= K
    BLOCK_PAGE_STRIDE: tl.constexpr,  # page ids per physical block: 8 dense, 16 packed
    SPARSE_BLOCK: tl.constexpr,  # 128 tokens per block
    PAGES: tl.constexpr,  # 8 pages per block
):
    slots = tl.arange(0, K_BLOCK)
    pages = tl.arange(0, PAGES)
    p = p.to(tl.int64)
    self_blk = tl.where(p >= 0, p // SPARSE_BLOCK, -1)  # -1 on a padded row: nothing is valid
    tail_len = p + 1 - self_blk * SPARSE_BLOCK  # causal_len - self_blk * 128 (used only with a tail)
    limit = tl.minimum(self_blk + 1, bt_width)  # valid ids: 0 <= b < limit (causal and inside the table)
    b = blk.to(tl.int64)
    valid = (b >= 0) & (b < limit) & (slots < K)
    # A block named by an earlier valid slot is a duplicate: the first occurrence is kept.
    earlier = slots[None, :] < slots[:, None]  # [slot, other]: other comes before slot
    dup = tl.reduce(((b[:, None] == b[None, :]) & earlier & valid[None, :]).to(tl.int32), 1, _add)
    keep = valid & (dup == 0)
    is_tail = keep & (b == self_blk)
    is_full = keep & (b != self_blk)
    # Output slot: full blocks in selection order, then the tail (after every full block).
    out_slot = tl.reduce((is_full[None, :] & (earlier | is_tail[:, None])).to(tl.int32), 1, _add)
    n_used = tl.reduce(keep.to(tl.int32), 0, _add)
    # ctx: 128 tokens per full block plus the tail's causal_len - self_blk * 128.
    ctx = tl.reduce(tl.where(is_tail, tail_len, tl.where(keep, SPARSE_BLOCK, 0)), 0, _add)
    physical = tl.load(bt_row_ptr + tl.where(keep, b, 0) * bt_stride_m, mask=keep, other=0).to(tl.int64)
    page_ids = physical[:, None] * BLOCK_PAGE_STRIDE + pages[None, :]
    # A page id past int32 is past every cache (views hold < 2**31 pages): -1, never read, never wrapped.
    page_ids = tl.where((page_ids >= -(2**31)) & (page_ids < 2**31), page_ids, -1).to(tl.int32)
    tl.store(out_row_ptr + out_slot[:, None] * PAGES + pages[None, :], page_ids, mask=keep[:, None])
    # Every entry past the used pages is 0 (disjoint from the slots written above).
    unused = (slots >= n_used) & (slots < K)
    zeros = tl.full([K_BLOCK, PAGES], 0, tl.int32)
    tl.store(out_row_ptr + slots[:, None] * PAGES + pages[None, :], zeros, mask=unused[:, None])
    return ctx.to(tl.int32)


@triton.jit
def _check_decode_row(
    flags_ptr,  # [3] int32: set to 1 where a seq_len (0), a selected id (1) or a used table entry (2) is bad
    n,
    h,
    req,
    blk,  # [K_BLOCK] the row's selected ids (lanes >= K hold -1)
    seq_lens_ptr,
    stride_r,
    bt_row,  # the request's block-table row
    stride_bm,
    M,
    DQL,
    id_bottom,
    id_top,  # a used table entry must lie in [id_bottom, id_top] (its page ids fit int32)
    SPARSE_BLOCK: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """The value checks of ``build_sparse_block_table_decode`` (SPEC 7), folded into its launch: every
    program checks its row's selected ids (``< M``) and its request's ``seq_len`` (``<= M * 128``); the
    request's first row, head 0, checks the ``ceil(seq_len / 128)`` table entries the request uses."""
    sl = tl.load(seq_lens_ptr + req * stride_r).to(tl.int64)
    tl.store(flags_ptr, 1, mask=sl > M * SPARSE_BLOCK)
    nbad_ids = tl.sum((blk.to(tl.int64) > M - 1).to(tl.int32), axis=0)
    tl.store(flags_ptr + 1, 1, mask=nbad_ids > 0)
    lens = tl.minimum(tl.maximum(sl, 0), M * SPARSE_BLOCK)
    used = (lens + SPARSE_BLOCK - 1) // SPARSE_BLOCK
    used = tl.where((h == 0) & (n % DQL == 0), used, 0)  # one program per request scans its row
    offs = tl.arange(0, 128)
    nbad = tl.zeros([128], dtype=tl.int32)
    c0 = used * 0
    if INTERPRETED:  # (the interpreter cannot run range() with runtime bounds)
        while c0 < used:
            nbad += _bad_entries(bt_row, stride_bm, c0 + offs, used, id_bottom, id_top)
            c0 += 128
    else:
        for c0 in range(0, used, 128):
            nbad += _bad_entries(bt_row, stride_bm, c0 + offs, used, id_bottom, id_top)
    tl.store(flags_ptr + 2, 1, mask=tl.sum(nbad, axis=0) > 0)


@triton.jit
def _bad_entries(bt_row, stride_bm, cols, used, id_bottom, id_top):
    live = cols < used
    ids = tl.load(bt_row + cols * stride_bm, mask=live, other=0).to(tl.int64)
    return (live & ((ids < id_bottom) | (ids > id_top))).to(tl.int32)


@triton.jit(do_not_specialize=["id_bottom", "id_top"])
def _build_sparse_block_table(
    topk_ptr,  # [H, N, K] int32/int64, any strides
    stride_th,
    stride_tn,
    stride_tk,
    bt_ptr,  # [B, M] int32/int64 block_table
    stride_bb,
    stride_bm,
    B,
    M,
    req_ptr,  # prefill: [N] query_req_id; decode: [B] seq_lens
    stride_r,
    pos_ptr,  # prefill: [N] query_abs_pos; decode: unused
    stride_p,
    out_bt_ptr,  # [H, N, K * PAGES] int32, contiguous
    out_ctx_ptr,  # [H, N] int32, contiguous
    N,
    K,
    DQL,  # decode_query_len (decode only)
    flags_ptr,  # CHECK: [3] int32 value-check flags (decode; see _check_decode_row)
    count_ptr,
    done_ptr,  # CHECK: the launch counter and the done word (see mm3lab._valcheck.signal_done)
    id_bottom,
    id_top,
    backup_bt_ptr,
    backup_ctx_ptr,  # BACKUP: where each row's old sparse_bt / sparse_ctx entries are copied before it is written
    PREFILL: tl.constexpr,
    K_BLOCK: tl.constexpr,
    BLOCK_PAGE_STRIDE: tl.constexpr,
    SPARSE_BLOCK: tl.constexpr,
    PAGES: tl.constexpr,
    CHECK: tl.constexpr,
    BACKUP: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    req, p = row_request_position(n, n < N, req_ptr, stride_r, pos_ptr, stride_p, B, DQL, PREFILL)
    slots = tl.arange(0, K_BLOCK)
    blk = tl.load(topk_ptr + h * stride_th + n * stride_tn + slots * stride_tk, mask=slots < K, other=-1)
    row = h * N + n
    bt_row = bt_ptr + req * stride_bb
    out_row = out_bt_ptr + row * (K * PAGES)
    if CHECK:
        _check_decode_row(
            flags_ptr,
            n,
            h,
            req,
            blk,
            req_ptr,
            stride_r,
            bt_row,
            stride_bm,
            M,
            DQL,
            id_bottom,
            id_top,
            SPARSE_BLOCK,
            INTERPRETED,
        )
        signal_done(count_ptr, done_ptr)  # (the flags are final: the host need not wait for the table)
    if BACKUP:  # the caller's buffers: keep what this row overwrites, for a call its checks reject
        cols = tl.arange(0, K_BLOCK * PAGES)
        keep = cols < K * PAGES
        tl.store(backup_bt_ptr + row * (K * PAGES) + cols, tl.load(out_row + cols, mask=keep), mask=keep)
        tl.store(backup_ctx_ptr + row, tl.load(out_ctx_ptr + row))
    ctx = emit_sparse_block_table_row(
        blk, p, bt_row, stride_bm, M, out_row, K, K_BLOCK, BLOCK_PAGE_STRIDE, SPARSE_BLOCK, PAGES
    )
    tl.store(out_ctx_ptr + row, ctx)


def _launch(
    topk_idx, block_table, req, pos, dql, prefill, block_page_stride, sparse_bt, sparse_ctx, check=None
) -> None:
    h, n, k = topk_idx.shape
    b, m = block_table.shape
    if h == 0 or n == 0:
        return
    if block_table.numel() == 0:  # never read (every row is padded or has nothing valid); give it memory anyway
        block_table = torch.zeros(1, 1, dtype=block_table.dtype, device=block_table.device)
    k_block = max(1, next_power_of_2(k))
    backup = None
    if check is None:  # (the flags, counter, done word and backups are never touched without CHECK / BACKUP)
        checks = (sparse_ctx, sparse_ctx, sparse_ctx, 0, 0, sparse_ctx, sparse_ctx)
    else:
        (flags, count, done), id_bottom, id_top, *rest = check
        backup = rest[0] if rest else None
        checks = (flags, count, done, id_bottom, id_top, *(backup if backup is not None else (sparse_ctx, sparse_ctx)))
    _build_sparse_block_table[(n, h)](
        topk_idx,
        *topk_idx.stride(),
        block_table,
        *block_table.stride(),
        b,
        m,
        req,
        req.stride(0),
        pos,
        pos.stride(0),
        sparse_bt,
        sparse_ctx,
        n,
        k,
        dql,
        *checks,
        PREFILL=prefill,
        K_BLOCK=k_block,
        BLOCK_PAGE_STRIDE=block_page_stride,
        SPARSE_BLOCK=SPARSE_BLOCK_SIZE,
        PAGES=PAGES_PER_SPARSE_BLOCK,
        CHECK=check is not None,
        BACKUP=backup is not None,
        INTERPRETED=backend.INTERPRETER,
        num_warps=1 if k_block <= 32 else 4,
    )


def build_sparse_block_table_decode_kernel(
    topk_idx, block_table, seq_lens, decode_query_len, block_page_stride, sparse_bt, sparse_ctx, *, check=None
) -> None:
    """Launch the decode table into ``sparse_bt``/``sparse_ctx`` (arguments already validated).

    ``check``: ``None``, or ``(fused, id_bottom, id_top[, backup])`` with ``fused`` a
    :class:`mm3lab._valcheck.Fused` (or any ``(flags, count, done)``): the launch also runs the call's
    value checks (:func:`_check_decode_row`), setting ``flags[0]`` (a ``seq_len`` past the row),
    ``flags[1]`` (a selected id ``>= M``) and ``flags[2]`` (a used table entry outside
    ``[id_bottom, id_top]``) of the int32 ``flags`` to 1, and ``done[0]`` to 1 once every program has
    checked (``count[0]``: zero before, zero after); the table it builds is the same. ``backup``:
    ``None`` or ``(bt, ctx)`` buffers of the outputs' shapes, into which every row's old output
    entries are copied before they are written (a caller's ``out=``, restored if the flags are set).
    """
    _launch(
        topk_idx,
        block_table,
        seq_lens,
        seq_lens,
        decode_query_len,
        False,
        block_page_stride,
        sparse_bt,
        sparse_ctx,
        check,
    )


def build_sparse_block_table_prefill_kernel(
    topk_idx, block_table, query_req_id, query_abs_pos, block_page_stride, sparse_bt, sparse_ctx
) -> None:
    """Launch the prefill table into ``sparse_bt``/``sparse_ctx`` (arguments already validated)."""
    _launch(topk_idx, block_table, query_req_id, query_abs_pos, 1, True, block_page_stride, sparse_bt, sparse_ctx)


__all__ = [
    "build_sparse_block_table_decode_kernel",
    "build_sparse_block_table_prefill_kernel",
    "emit_sparse_block_table_row",
]
