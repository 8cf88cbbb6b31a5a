"""Triton kernels: GQA-packed sparse paged attention with a split over pages.

One program of :func:`_sparse_attention_fwd` handles one (row ``n``, KV head ``h``,
split ``s``). It loads the ``G = Hq / Hkv`` query heads of the group as one tile
``[G_PAD, D_PAD]`` and walks its share of the row's pages ``BLOCK_N`` tokens at a
time: every selected K and V page is read from memory once and serves the whole
group through ``tl.dot`` (``[G_PAD, D] x [D, BLOCK_N]``), with an online softmax.

Small batches have few (row, head) pairs, so the row's pages are split into
``num_splits`` contiguous ranges run by different programs; each writes its
partial output (normalized) and log-sum-exp, and :func:`_merge_rows` combines
them: ``lse = logsumexp_s(lse_s)``, ``out = sum_s exp(lse_s - lse) * out_s``.
With one split the first kernel writes the final output directly. Who merges:
eagerly, the last program of each (row, KV head) to finish (it counts arrivals on a
per-stream counter, :func:`merge_counters`), which saves a launch and its host time
(an unchecked batch-1 call: 24.5 -> 19.5 us on an H100, ``benchmarks.eager_ab``); in a CUDA
graph, where a launch costs no host time, a second launch, :func:`_merge_splits`, one program
per (row, query head), which spreads the merge over more SMs. Both sum the splits in the same
order: the same bits.

The layout does not appear here: a page id reaches K through ``k_cache`` and V
through ``v_cache`` in both layouts (SPEC section 4), so dense and packed caches
differ only in the page ids of the table.

The device helpers (the online-softmax update, one step over a row's pages, a
whole row, the final normalization) also serve the tiled kernel (``tiled.py``).
Groups of runtime values that travel together between them (a head's K/V views
and strides, the FP8 scale views, a row's page ids and stride, the softmax state)
are passed as tuples.
"""

from __future__ import annotations

import functools
import math
import threading

import torch
import triton
import triton.language as tl

from .. import _pdl, _replay, backend
from .._fit import fitting
from .._grid import next_power_of_2
from .._valcheck import signal_done
from ..constants import PAGE_SIZE
from .checks import readable_pages

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
_LN2 = tl.constexpr(LN2)  # usable inside kernels


@triton.jit
def _online_softmax(scores, m_i, l_i):
    """One block of the online softmax: ``(p, alpha, m_new, l_new)``.

    ``scores`` ``[M, BLOCK_N]`` are base 2 with ``-inf`` where masked; ``m_i`` is the running max
    (base 2) and ``l_i`` the running sum of ``exp2(score - m_i)``, both ``[M]`` float32. The caller
    folds the block's values in: ``acc = acc * alpha[:, None] + p @ v``.
    """
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: avoid -inf - -inf
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(scores - m_ref[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _clamp_ctx(ctx, width, PAGE: tl.constexpr):
    """A row's attended tokens as int32, clamped to ``0 .. width * PAGE`` in int64 first: an int64
    ``sparse_ctx`` past int32 is clamped, never truncated (SPEC 7)."""
    return tl.minimum(tl.maximum(ctx.to(tl.int64), 0), width * PAGE).to(tl.int32)


@triton.jit
def _finish(state):
    """The normalized output and the natural-log LSE of a state (zeros and ``-inf`` where nothing was seen)."""
    m_i, l_i, acc = state
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i * _LN2 + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    return out, lse


@triton.jit
def _attend_step(
    q,  # [GROUP_PAD, D_PAD] query tile of the group
    cache,  # (k_head, v_head, num_pages, stride_kp, stride_kr, stride_vp, stride_vr): this KV head's K / V views
    scales,  # (ks_head, vs_head, stride_ksp, stride_ksr, stride_vsp, stride_vsr): read only when FP8
    bt_row,  # (this row's page ids, their stride)
    start,
    tok_hi,  # tokens start .. start + BLOCK_N - 1 of the row, those < tok_hi are live
    qk_scale,
    state,  # (m_i, l_i, acc): running max (base 2), running sum, unnormalized output, all float32
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP8: tl.constexpr,
):
    """One step of the online softmax over ``BLOCK_N`` tokens (``BLOCK_N / 16`` whole pages)."""
    bt_ptr, stride_bw = bt_row
    tok = start + tl.arange(0, BLOCK_N)
    in_ctx = tok < tok_hi
    page = tl.load(bt_ptr + (tok // PAGE) * stride_bw, mask=in_ctx, other=0).to(tl.int64)
    ok = in_ctx & (page >= 0) & (page < cache[2])  # a page outside the cache is never read
    return _attend_pages(
        q, cache, scales, page, ok, ok, tok % PAGE, qk_scale, state, D, D_PAD, DOT_PRECISION, FP8, False
    )


@triton.jit
def _attend_pages(
    q,
    cache,
    scales,  # as in _attend_step
    page,  # [BLOCK_N] int64 page id of each token of the step
    live,  # [BLOCK_N] the tokens whose K / V rows are read: their page is inside the cache
    ok,  # [BLOCK_N] the tokens attended (a subset of live)
    row,  # [BLOCK_N] each token's row in its page
    qk_scale,
    state,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP8: tl.constexpr,
    ZERO_DEAD: tl.constexpr,  # live may exceed ok: zero the values read for tokens not attended
):
    """The step of :func:`_attend_step` on page ids already loaded.

    FP8 K/V: the e4m3 keys are widened to q's dtype (exact) and the K scale multiplies each
    score column in float32; the values are dequantized (times their scale) in float32, then
    rounded to q's dtype for the second dot.
    """
    k_head, v_head, num_pages, stride_kp, stride_kr, stride_vp, stride_vr = cache
    ks_head, vs_head, stride_ksp, stride_ksr, stride_vsp, stride_vsr = scales
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < D
    row = row.to(tl.int64)
    kv_mask = live[:, None] & d_ok[None, :]
    k = tl.load(k_head + (page * stride_kp + row * stride_kr)[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    # 16-bit and FP8 K/V: every load of the step is issued before the first dot waits on K. (Float32
    # K and V tiles of 128 tokens together would not fit 99 KiB of shared memory: V after the dot.)
    EARLY_V: tl.constexpr = k.dtype.primitive_bitwidth <= 16
    if EARLY_V:
        v = tl.load(v_head + (page * stride_vp + row * stride_vr)[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    if FP8:
        k_sc = tl.load(ks_head + page * stride_ksp + row * stride_ksr, mask=live, other=0.0)
        v_sc = tl.load(vs_head + page * stride_vsp + row * stride_vsr, mask=live, other=0.0)
        k = k.to(q.dtype)
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [GROUP_PAD, BLOCK_N]
    if FP8:
        scores = scores * k_sc[None, :]
    scores = tl.where(ok[None, :], scores, float("-inf"))
    m_i, l_i, acc = state
    p, alpha, m_i, l_i = _online_softmax(scores, m_i, l_i)
    if not EARLY_V:
        v = tl.load(v_head + (page * stride_vp + row * stride_vr)[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    if FP8:
        v = (v.to(tl.float32) * v_sc[:, None]).to(q.dtype)
    if ZERO_DEAD:  # (a row read past the context may hold anything, NaN too: p is 0 there, but 0 * NaN is not)
        v = tl.where(ok[:, None], v, tl.zeros_like(v))
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_i, l_i, acc


@triton.jit
def _empty_state(M: tl.constexpr, D_PAD: tl.constexpr):
    """The online-softmax state before any token: running max ``-inf``, sum 0, output 0 (float32)."""
    return (
        tl.full([M], float("-inf"), dtype=tl.float32),
        tl.zeros([M], dtype=tl.float32),
        tl.zeros([M, D_PAD], dtype=tl.float32),
    )


@triton.jit
def _attend_row(
    q,  # [M, D_PAD] query tile: the query heads of one row that share a KV head
    cache,
    scales,
    bt_row,  # as in _attend_step
    tok_lo,
    tok_hi,  # the row's tokens tok_lo .. tok_hi - 1
    qk_scale,
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP8: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """The online-softmax state of ``q`` over a range of one row's page list, ``BLOCK_N`` tokens a step."""
    M: tl.constexpr = q.shape[0]
    D_PAD: tl.constexpr = q.shape[1]
    state = _empty_state(M, D_PAD)
    # Both loops run the same steps: the interpreter cannot run range() with runtime bounds (a while
    # loop it can), and the compiled range() loop is the one the compiler pipelines.
    if INTERPRETED:
        start = tok_lo
        while start < tok_hi:
            state = _attend_step(
                q, cache, scales, bt_row, start, tok_hi, qk_scale, state, D, D_PAD, BLOCK_N, PAGE, DOT_PRECISION, FP8
            )
            start += BLOCK_N
    else:
        for start in range(tok_lo, tok_hi, BLOCK_N):
            state = _attend_step(
                q, cache, scales, bt_row, start, tok_hi, qk_scale, state, D, D_PAD, BLOCK_N, PAGE, DOT_PRECISION, FP8
            )
    return state


@triton.jit
def _check_row(
    flags_ptr,  # [2] int32: set to 1 where a ctx (flag 0) or a used page id (flag 1) is bad
    raw_ctx,  # the row's sparse_ctx as stored
    first_split,  # this program checks the ctx (one program per row does)
    bt_row,  # (this row's page ids, their stride)
    tok_lo,
    tok_hi,  # the tokens this program attends: pages tok_lo // PAGE .. ceil(tok_hi / PAGE) - 1
    width,
    num_pages,
    page_mod,
    page_mod_limit,  # a used page id p needs 0 <= p < num_pages and p mod page_mod < page_mod_limit
    PAGE: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """The value checks of ``sparse_attention`` (SPEC 7) on the entries this program reads, folded into
    the attention launch: over all programs, every ctx and every used page id (the pages
    ``0 .. ceil(ctx / 16) - 1`` of the row, ctx clamped as the attention clamps it) is checked."""
    raw = raw_ctx.to(tl.int64)
    bad_ctx = (raw < 0) | (raw > width * PAGE)
    tl.store(flags_ptr, 1, mask=bad_ctx & first_split)
    bt_ptr, stride_bw = bt_row
    page_lo = tok_lo // PAGE
    page_hi = (tok_hi + PAGE - 1) // PAGE
    offs = tl.arange(0, 64)
    nbad = tl.zeros([64], dtype=tl.int32)
    p0 = page_lo
    # (a while loop in the interpreter, which cannot run range() with runtime bounds)
    if INTERPRETED:
        while p0 < page_hi:
            nbad += _bad_pages(bt_ptr, stride_bw, p0 + offs, page_hi, num_pages, page_mod, page_mod_limit)
            p0 += 64
    else:
        for p0 in range(page_lo, page_hi, 64):
            nbad += _bad_pages(bt_ptr, stride_bw, p0 + offs, page_hi, num_pages, page_mod, page_mod_limit)
    tl.store(flags_ptr + 1, 1, mask=tl.sum(nbad, axis=0) > 0)


@triton.jit
def _bad_pages(bt_ptr, stride_bw, pages, page_hi, num_pages, page_mod, page_mod_limit):
    used = pages < page_hi
    ids = tl.load(bt_ptr + pages * stride_bw, mask=used, other=0).to(tl.int64)
    outside = (ids < 0) | (ids >= num_pages) | ((ids % page_mod + page_mod) % page_mod >= page_mod_limit)
    return (used & outside).to(tl.int32)


@triton.jit
def _merge_chunk(part_o, part_lse, stride_ps, s0, num_splits, mask, head_ok, m_ref, acc, total, S_CHUNK: tl.constexpr):
    """Splits ``s0 .. s0 + S_CHUNK - 1`` (those below ``num_splits``) folded into ``(acc, total)``, one
    after the other: every load of the chunk is independent, the sums run in split order."""
    parts = ()
    weights = ()
    for i in tl.static_range(S_CHUNK):
        # (the split test as a vector from the start: a scalar bool & a vector mask is no mask on newer Triton)
        ok = head_ok & ((tl.zeros_like(m_ref).to(tl.int32) + s0 + i) < num_splits)
        lse_s = tl.load(part_lse + (s0 + i), mask=ok, other=float("-inf"), cache_modifier=".cg")
        part = tl.load(part_o + (s0 + i) * stride_ps, mask=mask & ok[:, None], other=0.0, cache_modifier=".cg")
        parts = parts + (part,)
        weights = weights + (tl.exp(lse_s - m_ref),)  # 0 for empty and missing splits
    for i in tl.static_range(S_CHUNK):  # (every load above is issued before the first sum needs one)
        acc = acc + parts[i] * weights[i][:, None]
        total = total + weights[i]
    return acc, total


@triton.jit
def _merge_rows(
    part_o,  # [M, D_PAD] pointers: split 0's partial output of M heads (split stride stride_ps)
    part_lse,  # [M] pointers: split 0's partial log-sum-exp of those heads (split stride 1)
    stride_ps,
    num_splits,
    mask,  # [M, D_PAD] the live (head, dim) entries
    S_PAD: tl.constexpr,  # >= num_splits, a power of two
    S_CHUNK: tl.constexpr,  # splits whose loads are issued together
    INTERPRETED: tl.constexpr,
):
    """The split partials of ``M`` heads merged: ``(out [M, D_PAD] float32, lse [M])`` with
    ``lse = logsumexp_s(lse_s)`` and ``out = sum_s exp(lse_s - lse) * out_s`` (zeros and ``-inf`` where
    every split is empty). Each entry's sums run in split order whatever ``M`` and ``S_CHUNK`` are,
    so the merge inside the attention launch and the separate merge launch agree bit for bit."""
    offs_s = tl.arange(0, S_PAD)
    head_ok = tl.max(mask.to(tl.int32), 1) > 0
    all_lse = tl.load(
        part_lse[:, None] + offs_s[None, :],
        mask=head_ok[:, None] & (offs_s[None, :] < num_splits),
        other=float("-inf"),
        cache_modifier=".cg",
    )
    m = tl.max(all_lse, 1)
    m_ref = tl.where(m == float("-inf"), 0.0, m)
    acc = tl.zeros(part_o.shape, dtype=tl.float32)
    total = tl.zeros(m_ref.shape, dtype=tl.float32)
    # (a while loop in the interpreter, which cannot run range() with runtime bounds)
    if INTERPRETED:
        s0 = 0
        while s0 < num_splits:
            acc, total = _merge_chunk(
                part_o, part_lse, stride_ps, s0, num_splits, mask, head_ok, m_ref, acc, total, S_CHUNK
            )
            s0 += S_CHUNK
    else:
        for s0 in range(0, num_splits, S_CHUNK):
            acc, total = _merge_chunk(
                part_o, part_lse, stride_ps, s0, num_splits, mask, head_ok, m_ref, acc, total, S_CHUNK
            )
    seen = total > 0
    out = acc / tl.where(seen, total, 1.0)[:, None]
    lse = tl.where(seen, m_ref + tl.log(tl.where(seen, total, 1.0)), float("-inf"))
    return out, lse


@triton.jit(do_not_specialize=["page_mod", "page_mod_limit"])
def _sparse_attention_fwd(
    q_ptr,  # [N, Hq, D] queries
    k_ptr,  # [pages_k, 16, Hkv, D] page-16 K view
    v_ptr,  # [pages_v, 16, Hkv, D] page-16 V view
    bt_ptr,  # [Hkv, N, W] page ids
    ctx_ptr,  # [Hkv, N] tokens per row
    o_ptr,  # [N, Hq, D] output (one split) or [N, Hq, S, D] float32 partial outputs
    lse_ptr,  # [N, Hq] float32 (one split) or [N, Hq, S] float32 partial log-sum-exp
    num_pages,  # page ids in [0, num_pages) are inside both views
    width,  # W, page ids per row
    pages_per_split,  # a multiple of BLOCK_N // PAGE
    qk_scale,  # softmax scale * log2(e): scores are kept in base 2
    stride_qn,
    stride_qh,
    stride_qd,
    stride_kp,
    stride_kr,
    stride_kh,  # k_cache strides (page, row, head); head dim contiguous
    stride_vp,
    stride_vr,
    stride_vh,
    stride_bh,
    stride_bn,
    stride_bw,
    stride_ch,
    stride_cn,
    stride_on,
    stride_oh,
    stride_os,  # output strides (row, head, split); head dim contiguous
    stride_ln,
    stride_lh,  # lse strides (row, head); split stride 1
    group,  # query heads per KV head (a runtime value: every group size up to 16 shares one compiled kernel)
    ks_ptr,
    vs_ptr,  # FP8: [pages, 16, Hkv] float32 scale views (unused otherwise)
    stride_ksp,
    stride_ksr,
    stride_ksh,
    stride_vsp,
    stride_vsr,
    stride_vsh,
    flags_ptr,  # CHECK: [2] int32 value-check flags (see _check_row)
    count_ptr,
    done_ptr,  # CHECK: the launch counter and the done word (see mm3lab._valcheck.signal_done)
    page_mod,
    page_mod_limit,
    merge_ptr,  # MERGE: [>= N * Hkv] int32 arrival counters (zero before, zero after)
    fo_ptr,  # MERGE: [N, Hq, D] the output, and the lse [N, Hq] (written when FINAL_LSE)
    flse_ptr,
    stride_fon,
    stride_foh,
    stride_fln,
    stride_flh,
    GROUP_PAD: tl.constexpr,  # >= 16 and a power of two (tl.dot's M)
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,  # tokens per step, a multiple of PAGE
    PAGE: tl.constexpr,
    ONE_SPLIT: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERPRETED: tl.constexpr,
    FP8: tl.constexpr,
    CHECK: tl.constexpr,
    PDL: tl.constexpr,
    ONE_STEP: tl.constexpr,  # pages_per_split * PAGE == BLOCK_N: a program attends one step
    MERGE: tl.constexpr,  # the last split of each (row, KV head) to finish merges them (merge_counters)
    FINAL_LSE: tl.constexpr,  # MERGE: write the merged lse too
    S_PAD: tl.constexpr,  # MERGE: >= the number of splits, a power of two
):
    _pdl.wait_previous(PDL)
    n = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)

    bt_row = (bt_ptr + h.to(tl.int64) * stride_bh + n.to(tl.int64) * stride_bn, stride_bw)
    if ONE_STEP:
        # The step's page ids are loaded before the ctx arrives (every id in the table, read only where
        # it is inside the cache), so that the K / V loads need not wait for two loads in a row.
        tok = s * BLOCK_N + tl.arange(0, BLOCK_N)
        in_table = tok < width * PAGE
        page = tl.load(bt_row[0] + (tok // PAGE) * stride_bw, mask=in_table, other=-1).to(tl.int64)
        live = in_table & (page >= 0) & (page < num_pages)
    raw_ctx = tl.load(ctx_ptr + h * stride_ch + n * stride_cn)
    ctx = _clamp_ctx(raw_ctx, width, PAGE)
    tok_lo = s * pages_per_split * PAGE
    tok_hi = tl.minimum(tok_lo + pages_per_split * PAGE, ctx)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, D_PAD)
    heads = h * group + offs_g
    g_ok = offs_g < group
    d_ok = offs_d < D
    q = tl.load(
        q_ptr + n.to(tl.int64) * stride_qn + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=g_ok[:, None] & d_ok[None, :],
        other=0.0,
    )

    if CHECK:
        _check_row(
            flags_ptr,
            raw_ctx,
            s == 0,
            bt_row,
            tok_lo,
            tok_hi,
            width,
            num_pages,
            page_mod,
            page_mod_limit,
            PAGE,
            INTERPRETED,
        )
        # (the flags are final once every program is past here: the host need not wait for the attention)
        signal_done(count_ptr, done_ptr)
    k_head = k_ptr + h.to(tl.int64) * stride_kh
    v_head = v_ptr + h.to(tl.int64) * stride_vh
    cache = (k_head, v_head, num_pages, stride_kp, stride_kr, stride_vp, stride_vr)
    ks_head = ks_ptr + h.to(tl.int64) * stride_ksh
    vs_head = vs_ptr + h.to(tl.int64) * stride_vsh
    scales = (ks_head, vs_head, stride_ksp, stride_ksr, stride_vsp, stride_vsr)
    if ONE_STEP:
        ok = live & (tok < tok_hi)
        state = _attend_pages(
            q, cache, scales, page, live, ok, tok % PAGE, qk_scale, _empty_state(GROUP_PAD, D_PAD), D, D_PAD,
            DOT_PRECISION, FP8, True,
        )  # fmt: skip
    else:
        state = _attend_row(
            q, cache, scales, bt_row, tok_lo, tok_hi, qk_scale, D, BLOCK_N, PAGE, DOT_PRECISION, FP8, INTERPRETED
        )
    out, lse = _finish(state)
    o_off = n.to(tl.int64) * stride_on + heads[:, None] * stride_oh + offs_d[None, :]
    l_off = n.to(tl.int64) * stride_ln + heads * stride_lh
    if ONE_SPLIT:
        tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
        if WRITE_LSE:
            tl.store(lse_ptr + l_off, lse, mask=g_ok)
    else:
        tl.store(o_ptr + o_off + s * stride_os, out, mask=g_ok[:, None] & d_ok[None, :])
        tl.store(lse_ptr + l_off + s, lse, mask=g_ok)
        if MERGE:
            # The last of the row's splits to get here merges them (a barrier first, so that every
            # thread's stores are made before this program counts as arrived; acquire/release on the
            # counter orders them before that program's loads, which bypass L1).
            tl.debug_barrier()
            counter = merge_ptr + n * tl.num_programs(1) + h
            ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if ticket == tl.num_programs(2) - 1:
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # (zero again for the next launch)
                mask = g_ok[:, None] & d_ok[None, :]
                out, lse = _merge_rows(
                    o_ptr + o_off, lse_ptr + l_off, stride_os, tl.num_programs(2), mask, S_PAD, 4, INTERPRETED
                )
                f_off = n.to(tl.int64) * stride_fon + heads[:, None] * stride_foh + offs_d[None, :]
                tl.store(fo_ptr + f_off, out.to(fo_ptr.dtype.element_ty), mask=mask)
                if FINAL_LSE:
                    tl.store(flse_ptr + n.to(tl.int64) * stride_fln + heads * stride_flh, lse, mask=g_ok)


_FWD = fitting(_sparse_attention_fwd, "num_stages", (2, 1))
"""The per-row kernel launched with 2 pipeline stages, or 1 where 2 do not fit the GPU's shared memory
(float32 tiles at head dim 128 take 144 KiB at 2 stages: more than RTX 30xx/40xx, A10, L4, L40S give)."""


@triton.jit
def _merge_splits(
    part_o_ptr,  # [N, Hq, S, D] float32 partial outputs (each normalized by its own sum)
    part_lse_ptr,  # [N, Hq, S] float32 partial log-sum-exp, -inf for an empty split
    o_ptr,  # [N, Hq, D] output
    lse_ptr,  # [N, Hq] float32 (written when WRITE_LSE)
    num_splits,
    stride_pn,
    stride_ph,
    stride_ps,  # part_o strides; head dim contiguous
    stride_qn,
    stride_qh,  # part_lse strides (row, head); split stride 1
    stride_on,
    stride_oh,  # output strides; head dim contiguous
    stride_ln,
    stride_lh,  # lse strides
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    S_PAD: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    PDL: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """One program per (row, query head): :func:`_merge_rows` of that head."""
    _pdl.wait_previous(PDL)
    n = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) + tl.arange(0, 1)
    offs_d = tl.arange(0, D_PAD)
    mask = (heads[:, None] >= 0) & (offs_d[None, :] < D)
    part_o = part_o_ptr + n * stride_pn + heads[:, None] * stride_ph + offs_d[None, :]
    part_lse = part_lse_ptr + n * stride_qn + heads * stride_qh
    out, lse = _merge_rows(part_o, part_lse, stride_ps, num_splits, mask, S_PAD, S_PAD, INTERPRETED)
    tl.store(
        o_ptr + n * stride_on + heads[:, None] * stride_oh + offs_d[None, :], out.to(o_ptr.dtype.element_ty), mask=mask
    )
    if WRITE_LSE:
        tl.store(lse_ptr + n * stride_ln + heads * stride_lh, lse)


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _device_programs(device: torch.device) -> int:
    """Programs that fill the device once: one per SM on a GPU, a handful in the interpreter."""
    if backend.INTERPRETER or device.type != "cuda":
        return 4
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def launch_config(n_rows: int, hq: int, hkv: int, d: int, width: int, device: torch.device, fp8: bool = False) -> dict:
    """Host heuristic for tile sizes and the split over pages (no autotuning).

    ``BLOCK_N`` tokens per step: 128 (64 for head dims past 128; twice that in the
    interpreter, whose cost is per step rather than per element). Splits: as many as
    it takes for ``n_rows * hkv * num_splits`` programs to cover every SM once, never
    more than one split per step of pages. Measured on an H200 with the model's
    shapes (64 query heads, 4 KV heads, D 128, top-k 16, bf16): at batch 64 one split
    and 128-token steps read the 268 MB of selected K/V at about 3.3 TB/s; more splits
    only add merge traffic once the (row, head) pairs fill the GPU.

    FP8 K/V (``fp8``), compiled: where even 64-token steps, one split each, leave no program
    waiting for an SM (batch 1 at the model's shapes: 4 pairs x 32 steps on 132 SMs), those
    steps, twice the splits of 128-token steps. The dequantizing step is the program's
    latency there; measured on an H100 at batch 1 (top-k 16,
    graph replays of attention + merge): 6.49 us against 6.93 us with 128-token steps, where bf16
    keeps 128 (5.92 us against 6.87 us). In the ``fp8`` benchmark suite's step (PDL, after the
    top-k) the attention stage gained less: 6.95 against 7.09 us at 8K, in two runs on one H100.
    """
    d_pad = max(16, next_power_of_2(d))
    block_n = 128 if d_pad <= 128 else 64
    if backend.INTERPRETER and device.type != "cuda":
        block_n *= 2
    programs = _device_programs(device)
    pairs = max(1, n_rows * hkv)
    steps = max(1, math.ceil(width / (block_n // PAGE_SIZE)))
    half = max(1, math.ceil(width / (64 // PAGE_SIZE)))
    if fp8 and block_n == 128 and not backend.INTERPRETER and pairs * half <= programs:
        block_n, steps = 64, half
    splits = max(1, min(steps, math.ceil(programs / pairs), 64))
    return {"BLOCK_N": block_n, "num_splits": splits}


def num_splits(n_rows: int, hq: int, hkv: int, d: int, width: int, device: torch.device, fp8: bool = False) -> int:
    """Splits :func:`sparse_attention_kernel` launches with its default heuristic (1: no partials)."""
    cfg = launch_config(n_rows, hq, hkv, d, width, device, fp8)
    pages_per_step = cfg["BLOCK_N"] // PAGE_SIZE
    steps = max(1, math.ceil(width / pages_per_step))
    splits = max(1, min(cfg["num_splits"], steps))
    pages_per_split = math.ceil(steps / splits) * pages_per_step
    return max(1, math.ceil(width / pages_per_split)) if width else 1


def sparse_attention_kernel(
    q,
    k_cache,
    v_cache,
    sparse_bt,
    sparse_ctx,
    scale: float,
    out,
    lse,
    k_scale=None,
    v_scale=None,
    *,
    num_splits: int | None = None,
    block_n: int | None = None,
    workspace=None,
    check=None,
    merge: str | None = None,
) -> None:
    """Launch the attention (and, with several splits, the merge). Arguments are already validated.

    Args:
        q: ``[N, Hq, D]``; k_cache, v_cache: page-16 views; sparse_bt ``[Hkv, N, W]``; sparse_ctx ``[Hkv, N]``.
        out: ``[N, Hq, D]`` contiguous, q's dtype (written).
        lse: ``[N, Hq]`` float32 contiguous, or ``None``.
        num_splits, block_n: override the heuristic of :func:`launch_config` (tests use this).
        workspace: optional ``(part_o [N, Hq, S, D] float32, part_lse [N, Hq, S] float32)`` for the
            split partials (``S`` = :func:`num_splits`), so that a plan's call allocates nothing.
        check: ``None``, or ``(fused, page_mod, page_mod_limit)`` with ``fused`` a
            :class:`mm3lab._valcheck.Fused` (or any ``(flags, count, done)``): the attention launch also
            runs the call's value checks (:func:`_check_row`), setting ``flags[0]`` (a ctx outside
            ``[0, W * 16]``) and ``flags[1]`` (a used page id outside the cache, or with
            ``id mod page_mod >= page_mod_limit``) of the int32 ``flags`` to 1, and sets ``done[0]`` to
            1 once every program has checked (``count[0]``: zero before, zero after); nothing else changes.
        merge: with several splits, who merges them: ``"own"`` (the attention launch: the last split of
            each (row, KV head) to finish, :func:`merge_counters`), ``"launch"`` (a second launch,
            :func:`_merge_splits`, one program per (row, query head)) or ``None`` (``"own"`` where
            it applies: outside CUDA-graph capture, at most :data:`MERGE_COUNTERS` pairs). Both give
            the same bits.
    """
    n_rows, hq, d = q.shape
    hkv, _, width = sparse_bt.shape
    group = hq // hkv
    cfg = launch_config(n_rows, hq, hkv, d, width, q.device, k_scale is not None)
    block_n = block_n or cfg["BLOCK_N"]
    pages_per_step = block_n // PAGE_SIZE
    steps = max(1, math.ceil(width / pages_per_step))
    splits = max(1, min(num_splits or cfg["num_splits"], steps))
    pages_per_split = math.ceil(steps / splits) * pages_per_step
    splits = max(1, math.ceil(width / pages_per_split)) if width else 1
    d_pad = max(16, next_power_of_2(d))
    common = dict(
        GROUP_PAD=max(16, next_power_of_2(group)),
        D=d,
        D_PAD=d_pad,
        BLOCK_N=block_n,
        PAGE=PAGE_SIZE,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        INTERPRETED=backend.INTERPRETER,
        FP8=k_scale is not None,
        num_warps=4,
        **_pdl.options(q.device),
    )
    ks, vs = (k_scale, v_scale) if k_scale is not None else (sparse_bt, sparse_bt)  # never read without FP8
    if check is not None:
        (flags, count, done), page_mod, page_mod_limit = check
    else:  # (never read without CHECK)
        flags = count = done = sparse_bt
        page_mod = page_mod_limit = 1
    if merge not in (None, "own", "launch"):
        raise ValueError(f"merge: expected None, 'own' or 'launch', got {merge!r}")
    counters = None
    if splits > 1 and (merge == "own" or (merge is None and OWN_MERGE)) and n_rows * hkv <= MERGE_COUNTERS:
        counters = merge_counters(q.device)  # (None while a CUDA graph is captured)
    if merge == "own" and splits > 1 and counters is None:
        raise ValueError(
            f"merge='own': needs at most {MERGE_COUNTERS} (row, KV head) pairs and no CUDA-graph capture "
            f"(got {n_rows * hkv} pairs)"
        )
    common.update(CHECK=check is not None, ONE_STEP=pages_per_split == pages_per_step)
    checks = (flags, count, done, page_mod, page_mod_limit)
    args = (
        readable_pages(k_cache, v_cache),
        width,
        pages_per_split,
        scale * LOG2E,
        *q.stride(),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        *sparse_bt.stride(),
        *sparse_ctx.stride(),
    )
    grid = (n_rows, hkv, splits)
    if splits == 1:
        lse_arg = lse if lse is not None else out  # never written when WRITE_LSE is off
        _FWD[grid](
            q,
            k_cache,
            v_cache,
            sparse_bt,
            sparse_ctx,
            out,
            lse_arg,
            *args,
            out.stride(0),
            out.stride(1),
            0,
            hq if lse is None else lse.stride(0),
            1 if lse is None else lse.stride(1),
            group,
            ks,
            vs,
            *ks.stride(),
            *vs.stride(),
            *checks,
            sparse_bt,  # (no merge: the merge arguments are never read)
            out,
            out,
            0,
            0,
            0,
            0,
            ONE_SPLIT=True,
            WRITE_LSE=lse is not None,
            MERGE=False,
            FINAL_LSE=False,
            S_PAD=1,
            **common,
        )
        return
    if workspace is not None and tuple(workspace[0].shape) == (n_rows, hq, splits, d):
        part_o, part_lse = workspace
    else:
        part_o = torch.empty(n_rows, hq, splits, d, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(n_rows, hq, splits, dtype=torch.float32, device=q.device)
    _FWD[grid](
        q,
        k_cache,
        v_cache,
        sparse_bt,
        sparse_ctx,
        part_o,
        part_lse,
        *args,
        part_o.stride(0),
        part_o.stride(1),
        part_o.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        group,
        ks,
        vs,
        *ks.stride(),
        *vs.stride(),
        *checks,
        sparse_bt if counters is None else counters,
        out,
        part_lse if lse is None else lse,
        out.stride(0),
        out.stride(1),
        0 if lse is None else lse.stride(0),
        0 if lse is None else lse.stride(1),
        ONE_SPLIT=False,
        WRITE_LSE=True,
        MERGE=counters is not None,
        FINAL_LSE=lse is not None,
        S_PAD=max(2, next_power_of_2(splits)),
        **common,
    )
    if counters is not None:
        return
    _merge_splits[(n_rows, hq)](
        part_o,
        part_lse,
        out,
        lse if lse is not None else part_lse,
        splits,
        part_o.stride(0),
        part_o.stride(1),
        part_o.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        out.stride(0),
        out.stride(1),
        hq if lse is None else lse.stride(0),
        1 if lse is None else lse.stride(1),
        D=d,
        D_PAD=d_pad,
        S_PAD=max(2, next_power_of_2(splits)),
        WRITE_LSE=lse is not None,
        INTERPRETED=backend.INTERPRETER,
        num_warps=4,
        **_pdl.options(q.device),
    )


MERGE_COUNTERS = 1024
"""Arrival counters per stream: a launch of at most this many (row, KV head) pairs merges its own splits."""

OWN_MERGE = True
"""``merge=None`` lets the attention launch merge its own splits where it can; ``False``: always the merge
launch (the benchmarks compare both; a call already recorded keeps the launches it was recorded with)."""

_counters: dict = {}  # (device, stream or thread) -> int32 [MERGE_COUNTERS] zeros, kept for the process


def merge_counters(device: torch.device) -> torch.Tensor | None:
    """The arrival counters the attention launches on ``device``'s current stream count their splits
    with (``merge="own"``): int32 zeros, and zeros again after every such launch (its last program
    resets them). One buffer per CUDA stream (launches on one stream run in order; two streams may run
    at once) or, on the CPU, per thread; made once, outside any recording or capture, and kept (a
    recorded launch holds its address). ``None`` while a CUDA graph is being captured: a graph's
    replays could overlap the stream's own launches, so a captured call launches the merge."""
    if device.type == "cuda":
        if torch.cuda.is_current_stream_capturing():
            return None
        key = (
            device.index if device.index is not None else torch.cuda.current_device(),
            _replay.current_stream(device),
        )
    else:
        key = (str(device), threading.get_ident())
    buf = _counters.get(key)
    if buf is None:
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():  # (a buffer made once, not the call's own work: see _replay.record)
            buf = _counters[key] = torch.zeros(MERGE_COUNTERS, dtype=torch.int32, device=device)
    return buf


__all__ = ["MERGE_COUNTERS", "launch_config", "merge_counters", "num_splits", "sparse_attention_kernel"]
