"""The first launch of a planned MSA step: rows and slots, index-cache insert and KV write in one kernel.

A step starts by placing its new tokens: each row's request and position (the row rule,
:mod:`mm3lab.rows`), its page-128 slot, its index key in the index cache and its K/V in the
page-16 views (SPEC 2, steps 0-1). Three launches did that, each of tiny programs:
:func:`mm3lab.rows.rows_and_slots`, the index-cache insert and the KV write. At batch 1 each
costs about as much as its launch, and an eager step pays the host time of all three.
:func:`step_insert_kernel` runs one program per row through the same device functions
(:func:`mm3lab.rows.row_slots_store`, :func:`mm3lab.index_cache.kernel.index_rows_store`,
:func:`mm3lab.layout.kernel.kv_row_store`), so what it writes (``req``, ``pos``, ``slots``,
both caches and their FP8 scales) is bit-identical to the three launches
(``tests/test_msa_insert.py``). The plans (:mod:`mm3lab.plan`) launch it; the one-shot layer
keeps the three entry points, which are the steps a reader follows one by one.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .. import _pdl, backend
from .._grid import next_power_of_2
from ..constants import PAGE_SIZE, SPARSE_BLOCK_SIZE
from ..index_cache.kernel import index_rows_store
from ..layout.kernel import kv_row_store
from ..rows import row_launch_args, row_slots_store


@triton.jit
def _step_insert(
    seq_lens_ptr,  # decode: [B] seq_lens (prefill: unused)
    bt_ptr,  # [B, M] block_table
    stride_bb,
    stride_bm,
    req_ptr,  # [N] request per row: written (decode) or read (prefill)
    stride_r,
    pos_ptr,  # [N] position per row: written (decode) or read (prefill)
    stride_p,
    slot_ptr,  # [N] int64 slots, written
    B,
    M,
    DQL,
    index_k_ptr,  # [N, Di]
    stride_ikn,
    stride_ikd,
    icache_ptr,  # [num_blocks, 128, Di]
    stride_icb,
    stride_ict,
    Di,
    index_capacity,
    iscale_ptr,  # [num_blocks, 128] float32 (INDEX_QUANT only)
    stride_isb,
    key_ptr,  # [N, H, D]
    value_ptr,
    k_cache_ptr,  # page-16 views
    v_cache_ptr,
    kv_capacity,
    stride_kn,
    stride_kh,
    stride_kd,
    stride_vn,
    stride_vh,
    stride_vd,
    stride_kcp,
    stride_kcr,
    stride_kch,
    stride_vcp,
    stride_vcr,
    stride_vch,
    ks_ptr,  # [pages, 16, H] float32 scale views (KV_QUANT only)
    vs_ptr,
    stride_ksp,
    stride_ksr,
    stride_ksh,
    stride_vsp,
    stride_vsr,
    stride_vsh,
    PREFILL: tl.constexpr,
    INDEX_QUANT: tl.constexpr,
    KV_QUANT: tl.constexpr,
    INTERPRETED: tl.constexpr,
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DI: tl.constexpr,
    BLOCK_PAGE_STRIDE: tl.constexpr,
    SPARSE_BLOCK: tl.constexpr,
    PAGE: tl.constexpr,
    PDL: tl.constexpr,
):
    _pdl.wait_previous(PDL)
    n = tl.program_id(0).to(tl.int64)
    row = n + tl.arange(0, 1)  # the row as a one-lane vector, as the row and index device functions take rows
    ok = row >= 0  # (every lane: the grid is the rows)
    slot = row_slots_store(
        row, ok, (seq_lens_ptr, req_ptr, stride_r, pos_ptr, stride_p), (bt_ptr, stride_bb, stride_bm), slot_ptr,
        B, M, DQL, PREFILL, SPARSE_BLOCK,
    )  # fmt: skip
    index_rows_store(
        index_k_ptr, stride_ikn, stride_ikd, icache_ptr, stride_icb, stride_ict, row, ok, slot,
        tl.arange(0, BLOCK_DI), Di, index_capacity, iscale_ptr, stride_isb, INTERPRETED, INDEX_QUANT, SPARSE_BLOCK,
    )  # fmt: skip
    kv_row_store(
        n,
        tl.max(slot, 0),
        (key_ptr, value_ptr, stride_kn, stride_kh, stride_kd, stride_vn, stride_vh, stride_vd),
        (k_cache_ptr, v_cache_ptr, kv_capacity, stride_kcp, stride_kcr, stride_kch, stride_vcp, stride_vcr, stride_vch),
        (ks_ptr, vs_ptr, stride_ksp, stride_ksr, stride_ksh, stride_vsp, stride_vsr, stride_vsh),
        KV_QUANT, INTERPRETED, H, D, BLOCK_H, BLOCK_D, BLOCK_PAGE_STRIDE, SPARSE_BLOCK, PAGE,
    )  # fmt: skip


def step_insert_kernel(
    block_table,
    req,
    pos,
    slots,
    index_k,
    index_cache,
    key,
    value,
    k_cache,
    v_cache,
    block_page_stride: int,
    *,
    seq_lens=None,
    decode_query_len: int = 1,
    index_scale=None,
    k_scale=None,
    v_scale=None,
) -> None:
    """Rows, slots, index-cache insert and KV write of ``N`` rows in one launch (arguments already validated).

    Decode: pass ``seq_lens [B]``; ``req`` / ``pos [N]`` are written. Prefill: ``seq_lens=None``;
    ``req`` / ``pos`` (``query_req_id`` / ``query_abs_pos``) are read. ``slots [N]`` int64 contiguous
    is written. Scales as the inserts take them (an FP8 index cache: ``index_scale``; an FP8 KV
    cache: ``k_scale`` / ``v_scale``). Writes exactly what :func:`mm3lab.rows.rows_and_slots`,
    the index-cache insert and the KV write write, in that order.
    """
    n = slots.shape[0]
    if n == 0:
        return
    if block_table.numel() == 0:  # (no table to read: the three launches, whose first takes a PyTorch path)
        _three_launches(
            block_table, req, pos, slots, index_k, index_cache, key, value, k_cache, v_cache, block_page_stride,
            seq_lens, decode_query_len, index_scale, k_scale, v_scale,
        )  # fmt: skip
        return
    prefill = seq_lens is None
    _, h, d = key.shape
    di = index_k.shape[1]
    iq, kq = index_scale is not None, k_scale is not None
    iscale = index_scale if iq else slots
    ks, vs = (k_scale, v_scale) if kq else (slots.view(1, 1, -1), slots.view(1, 1, -1))
    _step_insert[(n,)](
        *row_launch_args(block_table, req, pos, slots, seq_lens, decode_query_len),
        index_k,
        *index_k.stride(),
        index_cache,
        index_cache.stride(0),
        index_cache.stride(1),
        di,
        index_cache.shape[0] * SPARSE_BLOCK_SIZE,
        iscale,
        index_scale.stride(0) if iq else 0,
        key,
        value,
        k_cache,
        v_cache,
        (k_cache.shape[0] // block_page_stride) * SPARSE_BLOCK_SIZE,
        *key.stride(),
        *value.stride(),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        ks,
        vs,
        *ks.stride(),
        *vs.stride(),
        PREFILL=prefill,
        INDEX_QUANT=iq,
        KV_QUANT=kq,
        INTERPRETED=backend.INTERPRETER,
        H=h,
        D=d,
        BLOCK_H=next_power_of_2(h),
        BLOCK_D=next_power_of_2(d),
        BLOCK_DI=next_power_of_2(di),
        BLOCK_PAGE_STRIDE=block_page_stride,
        SPARSE_BLOCK=SPARSE_BLOCK_SIZE,
        PAGE=PAGE_SIZE,
        num_warps=4,
        **_pdl.options(key.device),
    )


def _three_launches(
    block_table, req, pos, slots, index_k, index_cache, key, value, k_cache, v_cache, block_page_stride,
    seq_lens, decode_query_len, index_scale, k_scale, v_scale,
):  # fmt: skip
    """The same writes as :func:`step_insert_kernel`, by the three entry kernels one after another."""
    from ..index_cache.kernel import insert_index_cache_kernel
    from ..layout.kernel import write_kv_page16_kernel
    from ..rows import rows_and_slots

    rows_and_slots(block_table, req, pos, slots, seq_lens=seq_lens, decode_query_len=decode_query_len)
    insert_index_cache_kernel(index_k, index_cache, slots, index_scale)
    write_kv_page16_kernel(key, value, k_cache, v_cache, slots, block_page_stride, k_scale, v_scale)


__all__ = ["step_insert_kernel"]
