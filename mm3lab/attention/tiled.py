"""Tiled sparse prefill attention: a tile of query rows walks the union of its pages once.

The per-row kernel (``kernel.py``) runs one program per (row, KV head) and reads
every selected page again for every row. In a prefill chunk neighbouring rows
select mostly the same blocks (the local block, sinks, needles), so this kernel
gives one program a *tile* of ``T`` consecutive rows and the ``G`` query heads of
one KV head, ``M = T * G`` query vectors, and walks the union of the pages those
rows use, loading each page's K and V once for the whole tile.

Exactness for any input ``sparse_attention`` accepts (no block structure is
assumed; a page list is just a list of pages):

* a pre-pass (:func:`tile_unions`, PyTorch on the device, no host sync) lists per
  (KV head, tile) the distinct readable pages that its rows use (the first
  ``ceil(ctx / 16)`` entries of each row), sorted, ``-1`` padded, with their count
  and the tile's total number of used (row, page) entries;
* for each step of ``PAGES`` union pages the kernel compares them with the rows'
  own page lists and gets, per (row, token), the number of times the row attends
  that token: whole pages count once per occurrence, the row's last page only its
  first ``ctx % 16`` tokens. A token attended ``w`` times enters the softmax with
  the score ``s + log(w)`` (weight ``w``), and ``w = 0`` masks it. So disjoint
  selections, ``ctx`` 0, padded rows, repeated pages and tails mid-page all come
  out exactly as in the page-walking reference.

When a tile's rows share little (union close to the sum of the rows' pages, as
with independent random selections), walking the union costs ``T`` times the
tensor-core work of the per-row kernel for the same bytes. Such a tile switches,
inside the same program, to walking each row's own page list (the per-row
algorithm, with the per-row kernel's own steps): the rule is
``union_pages > row_mode_factor * row_pages``. Both walks share the per-row
kernel's online-softmax update.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .. import backend
from .._grid import next_power_of_2
from ..constants import PAGE_SIZE
from .checks import readable_pages
from .kernel import LOG2E, _attend_row, _finish, _online_softmax

ROW_MODE_FACTOR = 0.5
"""A tile walks its rows one by one when its union has more than this fraction of its rows' pages."""


def tile_unions(sparse_bt: torch.Tensor, sparse_ctx: torch.Tensor, num_pages: int, tile_rows: int):
    """Per (KV head, tile of ``tile_rows`` rows): the distinct readable pages its rows use.

    Returns ``(union [Hkv, tiles, tile_rows * W] int32 sorted, -1 padded,
    count [Hkv, tiles] int32, row_pages [Hkv, tiles] int32)`` where ``row_pages`` is
    the number of used (row, page) entries of the tile. Runs on the tables' device
    without reading anything back to the host.
    """
    hkv, n, width = sparse_bt.shape
    tiles = max(1, math.ceil(n / tile_rows))
    ctx = sparse_ctx.clamp(0, width * PAGE_SIZE).to(torch.int32)
    used_pages = (ctx + PAGE_SIZE - 1) // PAGE_SIZE
    used = torch.arange(width, device=sparse_bt.device, dtype=torch.int32) < used_pages.unsqueeze(-1)
    used &= (sparse_bt >= 0) & (sparse_bt < num_pages)  # a page outside the cache is never read
    big = torch.iinfo(torch.int32).max  # sorts after every readable page
    vals = torch.where(used, sparse_bt.to(torch.int32), big)
    pad = tiles * tile_rows - n
    if pad:
        vals = torch.cat([vals, vals.new_full((hkv, pad, width), big)], dim=1)
        used = torch.cat([used, used.new_zeros(hkv, pad, width)], dim=1)
    ordered = vals.view(hkv, tiles, tile_rows * width).sort(dim=-1).values
    first = torch.ones_like(ordered, dtype=torch.bool)
    first[..., 1:] = ordered[..., 1:] != ordered[..., :-1]
    first &= ordered != big
    slot = torch.cumsum(first, dim=-1, dtype=torch.int32) - 1  # where each first occurrence goes
    count = slot[..., -1] + 1
    dump = tile_rows * width  # duplicates are written to a column that is dropped
    union = torch.full((hkv, tiles, dump + 1), -1, dtype=torch.int32, device=sparse_bt.device)
    union.scatter_(-1, torch.where(first, slot, dump).long(), ordered)
    union = union[..., :dump].contiguous()
    row_pages = used.view(hkv, tiles, tile_rows * width).sum(-1, dtype=torch.int32)
    return union, count.to(torch.int32).contiguous(), row_pages


def neighbour_share(sparse_bt: torch.Tensor, sparse_ctx: torch.Tensor) -> torch.Tensor:
    """How much consecutive rows share: the fraction of rows' used 128-token slots (``W / 8`` per row)
    whose first page also starts a used slot of the previous row (same KV head). A 0-dim float32
    tensor on the tables' device: about ``1 / topk`` for independent random selections, near 1 when
    neighbours select the same blocks. Cheap (``[Hkv, N, topk, topk]`` comparisons); a speed
    heuristic only, never a correctness condition.
    """
    _, n, width = sparse_bt.shape
    per = 8  # pages per 128-token slot (SPEC section 3)
    slots = max(1, width // per)
    if n < 2:
        return torch.zeros((), device=sparse_bt.device)
    first = sparse_bt[..., : slots * per : per]  # [Hkv, N, K]
    used = torch.arange(slots, device=sparse_bt.device) * (per * PAGE_SIZE) < sparse_ctx.unsqueeze(-1)
    cur, prev = first[:, 1:], first[:, :-1]
    cur_used, prev_used = used[:, 1:], used[:, :-1]
    hit = ((cur.unsqueeze(-1) == prev.unsqueeze(-2)) & prev_used.unsqueeze(-2)).any(-1) & cur_used
    return hit.sum().float() / cur_used.sum().clamp(min=1).float()


@triton.jit
def _tile_step(
    q,  # [T * GP, D_PAD] the tile's query vectors, row-major over (row, head)
    cache,  # (k_head, v_head, num_pages, stride_kp, stride_kr, stride_vp, stride_vr), as in kernel._attend_step
    union,  # (the tile's union pages, their count)
    start,
    slots,  # (bt_tile, full_slot, part_slot) [T, W_PAD]: page ids, whole-page and tail-token counts per slot
    qk_scale,
    state,  # (m_i, l_i, acc), as in kernel._attend_step
    T: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    PAGES: tl.constexpr,
    PAGE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One online-softmax step of the whole tile over union pages ``start .. start + PAGES - 1``."""
    BLOCK_N: tl.constexpr = PAGES * PAGE
    k_head, v_head, num_pages, stride_kp, stride_kr, stride_vp, stride_vr = cache
    union_row, count = union
    bt_tile, full_slot, part_slot = slots
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < D
    offs_p = tl.arange(0, PAGES)
    upage = tl.load(union_row + start + offs_p, mask=start + offs_p < count, other=-1)  # [PAGES]
    # per (row, union page): whole occurrences and tokens of the partial last page
    hit = bt_tile[:, :, None] == upage[None, None, :]  # [T, W_PAD, PAGES]
    full = tl.sum(tl.where(hit, full_slot[:, :, None], 0), 1)  # [T, PAGES]
    part = tl.sum(tl.where(hit, part_slot[:, :, None], 0), 1)  # [T, PAGES]
    r = tl.arange(0, PAGE)
    w3 = full[:, :, None] + (r[None, None, :] < part[:, :, None]).to(tl.int32)  # [T, PAGES, PAGE]
    weight = tl.reshape(tl.broadcast_to(w3[:, None, :, :], [T, GP, PAGES, PAGE]), [T * GP, BLOCK_N])
    tok_live = tl.reshape(tl.max(w3, 0), [BLOCK_N]) > 0  # some row of the tile attends the token

    tok = tl.arange(0, BLOCK_N)
    page = tl.load(union_row + start + tok // PAGE, mask=start + tok // PAGE < count, other=-1).to(tl.int64)
    ok = (page >= 0) & (page < num_pages) & tok_live  # rows nobody attends (e.g. past a tail) are never read
    row = (tok % PAGE).to(tl.int64)
    kv_mask = ok[:, None] & d_ok[None, :]
    k = tl.load(k_head + (page * stride_kp + row * stride_kr)[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [M, BLOCK_N]
    live = (weight > 0) & ok[None, :]
    scores = tl.where(live, scores + tl.log2(tl.maximum(weight, 1).to(tl.float32)), float("-inf"))
    m_i, l_i, acc = state
    p, alpha, m_i, l_i = _online_softmax(scores, m_i, l_i)
    v = tl.load(v_head + (page * stride_vp + row * stride_vr)[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_i, l_i, acc


@triton.jit
def _store_rows(outs, n, heads, ok, state, D: tl.constexpr, D_PAD: tl.constexpr, WRITE_LSE: tl.constexpr):
    """Write the normalized output (and LSE) of a state's query vectors: row ``n``, query head ``heads``
    (``[M]`` each, or one row for all), where ``ok``."""
    o_ptr, stride_on, stride_oh, lse_ptr, stride_ln, stride_lh = outs
    out, lse = _finish(state)
    offs_d = tl.arange(0, D_PAD)
    n = n.to(tl.int64)
    tl.store(
        o_ptr + (n * stride_on + heads * stride_oh)[:, None] + offs_d[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=ok[:, None] & (offs_d < D)[None, :],
    )
    if WRITE_LSE:
        tl.store(lse_ptr + n * stride_ln + heads * stride_lh, lse, mask=ok)


@triton.jit
def _walk_union(
    query,  # (q_ptr, stride_qn, stride_qh, stride_qd, qk_scale)
    cache,  # (k_head, v_head, num_pages, stride_kp, stride_kr, stride_vp, stride_vr)
    table,  # (bt_ptr, stride_bh, stride_bn, stride_bw, ctx_ptr, stride_ch, stride_cn, width)
    outs,  # (o_ptr, stride_on, stride_oh, lse_ptr, stride_ln, stride_lh)
    tile,  # (KV head h, first row row0, n_rows, group, the tile's union pages, their count)
    T: tl.constexpr,
    GP: tl.constexpr,
    W_PAD: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    PAGES: tl.constexpr,
    PAGE: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """The tile's ``T * G`` query vectors walk the union of the tile's pages once."""
    q_ptr, stride_qn, stride_qh, stride_qd, qk_scale = query
    bt_ptr, stride_bh, stride_bn, stride_bw, ctx_ptr, stride_ch, stride_cn, width = table
    h, row0, n_rows, group, union_row, count = tile
    union = (union_row, count)
    M: tl.constexpr = T * GP
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < D
    offs_m = tl.arange(0, M)
    t_m = offs_m // GP
    g_m = offs_m % GP
    n_m = row0 + t_m
    m_ok = (n_m < n_rows) & (g_m < group)
    heads = h * group + g_m
    q = tl.load(
        q_ptr + n_m.to(tl.int64)[:, None] * stride_qn + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=m_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    offs_t = tl.arange(0, T)
    n_t = row0 + offs_t
    t_ok = n_t < n_rows
    ctx_t = tl.load(ctx_ptr + h * stride_ch + n_t * stride_cn, mask=t_ok, other=0).to(tl.int32)
    ctx_t = tl.minimum(tl.maximum(ctx_t, 0), width * PAGE)
    offs_w = tl.arange(0, W_PAD)
    used = (offs_w[None, :] * PAGE < ctx_t[:, None]) & (offs_w[None, :] < width)
    bt_tile = tl.load(
        bt_ptr + h.to(tl.int64) * stride_bh + n_t.to(tl.int64)[:, None] * stride_bn + offs_w[None, :] * stride_bw,
        mask=used,
        other=-1,
    ).to(tl.int32)
    bt_tile = tl.where(used, bt_tile, -1)
    full_slot = ((offs_w[None, :] + 1) * PAGE <= ctx_t[:, None]).to(tl.int32)  # [T, W_PAD]
    part_slot = tl.where(used & (full_slot == 0), ctx_t[:, None] - offs_w[None, :] * PAGE, 0)
    slots = (bt_tile, full_slot, part_slot)

    state = (
        tl.full([M], float("-inf"), dtype=tl.float32),
        tl.zeros([M], dtype=tl.float32),
        tl.zeros([M, D_PAD], dtype=tl.float32),
    )
    if INTERPRETED:  # the same steps as the range() loop below (see kernel._attend_row)
        start = 0
        while start < count:
            state = _tile_step(
                q, cache, union, start, slots, qk_scale, state, T, GP, D, D_PAD, PAGES, PAGE, DOT_PRECISION
            )
            start += PAGES
    else:
        for start in range(0, count, PAGES):
            state = _tile_step(
                q, cache, union, start, slots, qk_scale, state, T, GP, D, D_PAD, PAGES, PAGE, DOT_PRECISION
            )
    _store_rows(outs, n_m, heads, m_ok, state, D, D_PAD, WRITE_LSE)


@triton.jit
def _walk_rows(
    query,
    cache,
    table,
    outs,
    tile,  # as in _walk_union
    T: tl.constexpr,
    GP16: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    ROW_BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """Each row of the tile walks its own page list (the per-row algorithm), one after the other."""
    q_ptr, stride_qn, stride_qh, stride_qd, qk_scale = query
    bt_ptr, stride_bh, stride_bn, stride_bw, ctx_ptr, stride_ch, stride_cn, width = table
    h, row0, n_rows, group, _, _ = tile
    no_scales = (cache[0], cache[1], 0, 0, 0, 0)  # never read: the step runs with FP8 off
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < D
    offs_g = tl.arange(0, GP16)
    g_ok = offs_g < group
    heads = h * group + offs_g
    for t in range(T):
        n = row0 + t
        if n < n_rows:
            q = tl.load(
                q_ptr + n.to(tl.int64) * stride_qn + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=g_ok[:, None] & d_ok[None, :],
                other=0.0,
            )
            ctx = tl.load(ctx_ptr + h * stride_ch + n * stride_cn).to(tl.int32)
            ctx = tl.minimum(tl.maximum(ctx, 0), width * PAGE)
            bt_row = (bt_ptr + h.to(tl.int64) * stride_bh + n.to(tl.int64) * stride_bn, stride_bw)
            state = _attend_row(
                q, cache, no_scales, bt_row, 0, ctx, qk_scale, D, ROW_BLOCK_N, PAGE, DOT_PRECISION, False, INTERPRETED
            )
            _store_rows(outs, n, heads, g_ok, state, D, D_PAD, WRITE_LSE)


@triton.jit
def _tiled_fwd(
    q_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    ctx_ptr,
    union_ptr,
    count_ptr,
    rowpages_ptr,
    o_ptr,
    lse_ptr,
    n_rows,
    num_pages,
    width,
    qk_scale,
    row_mode_factor,
    stride_qn,
    stride_qh,
    stride_qd,
    stride_kp,
    stride_kr,
    stride_kh,
    stride_vp,
    stride_vr,
    stride_vh,
    stride_bh,
    stride_bn,
    stride_bw,
    stride_ch,
    stride_cn,
    stride_uh,
    stride_ut,  # union strides (head, tile); entries contiguous
    stride_on,
    stride_oh,
    stride_ln,
    stride_lh,
    group,
    T: tl.constexpr,  # rows per tile
    GP: tl.constexpr,  # group padded to a power of two (T * GP >= 16)
    GP16: tl.constexpr,  # max(16, GP): tl.dot's M in row mode
    W_PAD: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    PAGES: tl.constexpr,  # union pages per tile step
    ROW_BLOCK_N: tl.constexpr,  # tokens per step in row mode
    PAGE: tl.constexpr,
    MODE: tl.constexpr,  # 0: per tile by the rule, 1: always the union walk, 2: always row by row
    WRITE_LSE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    tile = tl.program_id(0)
    h = tl.program_id(1)
    k_head = k_ptr + h.to(tl.int64) * stride_kh
    v_head = v_ptr + h.to(tl.int64) * stride_vh
    row0 = tile * T

    tiles = (n_rows + T - 1) // T
    count = tl.load(count_ptr + h * tiles + tile)
    row_pages = tl.load(rowpages_ptr + h * tiles + tile)
    if MODE == 1:
        walk_union = True
    elif MODE == 2:
        walk_union = False
    else:
        walk_union = count.to(tl.float32) <= row_mode_factor * row_pages.to(tl.float32)

    query = (q_ptr, stride_qn, stride_qh, stride_qd, qk_scale)
    cache = (k_head, v_head, num_pages, stride_kp, stride_kr, stride_vp, stride_vr)
    table = (bt_ptr, stride_bh, stride_bn, stride_bw, ctx_ptr, stride_ch, stride_cn, width)
    outs = (o_ptr, stride_on, stride_oh, lse_ptr, stride_ln, stride_lh)
    union_row = union_ptr + h.to(tl.int64) * stride_uh + tile.to(tl.int64) * stride_ut
    rows = (h, row0, n_rows, group, union_row, count)
    if walk_union:
        _walk_union(
            query, cache, table, outs, rows, T, GP, W_PAD, D, D_PAD, PAGES, PAGE, WRITE_LSE, DOT_PRECISION, INTERPRETED
        )
    else:
        _walk_rows(
            query, cache, table, outs, rows, T, GP16, D, D_PAD, ROW_BLOCK_N, PAGE, WRITE_LSE, DOT_PRECISION, INTERPRETED
        )


def tiled_config(n_rows: int, hq: int, hkv: int, d: int, width: int, device: torch.device) -> dict:
    """Host heuristic for the tile: about 64 query vectors (``T * G``) per program.

    ``T = 64 / G_pad`` rows (4 for the model's group of 16), fewer where the rows'
    page lists are wide enough that the ``[T, W, PAGES]`` comparison would not fit
    in registers, never fewer than ``tl.dot``'s 16 query vectors; ``PAGES = 4``
    union pages (64 tokens) per step; 4 warps. Measured on an H200 at the model's
    shapes (4096-token chunk at 32K, top-k 16, bf16), tiles of 4 rows with 4 warps
    beat 8 rows with 8 warps on every selection workload tried (2.24 against
    2.67 ms when each 128-query tile shares its selection).
    """
    group = hq // hkv
    gp = next_power_of_2(group)
    w_pad = max(2, next_power_of_2(max(width, 1)))
    pages = 4
    t = max(1, 64 // gp)
    while t > 1 and t * w_pad * pages > 8192 and t * gp > 16:
        t //= 2
    t = max(t, next_power_of_2(math.ceil(16 / gp)))  # tl.dot needs M >= 16
    return {"T": t, "PAGES": pages, "num_warps": 4, "num_stages": 2}


def tiled_attention_kernel(
    q,
    k_cache,
    v_cache,
    sparse_bt,
    sparse_ctx,
    scale: float,
    out,
    lse,
    *,
    mode: str = "auto",
    row_mode_factor: float = ROW_MODE_FACTOR,
    tile_rows: int | None = None,
    pages_per_step: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> None:
    """Launch the pre-pass and the tiled kernel. Arguments are already validated.

    Args:
        mode: ``"auto"`` (each tile by the rule ``union <= row_mode_factor * row_pages``),
            ``"union"`` (every tile walks its union) or ``"rows"`` (every tile walks row by row).
        tile_rows, pages_per_step, num_warps, num_stages: override :func:`tiled_config` (tests, tuning).
    """
    n_rows, hq, d = q.shape
    hkv, _, width = sparse_bt.shape
    group = hq // hkv
    cfg = tiled_config(n_rows, hq, hkv, d, width, q.device)
    t = tile_rows or cfg["T"]
    pages = pages_per_step or cfg["PAGES"]
    gp = next_power_of_2(group)
    if t * gp < 16:
        raise ValueError(f"tile_rows: {t} rows x group {gp} is below 16 query vectors (tl.dot's minimum)")
    num_pages = readable_pages(k_cache, v_cache)
    union, count, row_pages = tile_unions(sparse_bt, sparse_ctx, num_pages, t)
    tiles = union.shape[1]
    d_pad = max(16, next_power_of_2(d))
    row_block_n = 128 if d_pad <= 128 else 64
    if backend.INTERPRETER:
        row_block_n *= 2
    lse_arg = lse if lse is not None else out
    _tiled_fwd[(tiles, hkv)](
        q,
        k_cache,
        v_cache,
        sparse_bt,
        sparse_ctx,
        union,
        count,
        row_pages,
        out,
        lse_arg,
        n_rows,
        num_pages,
        width,
        scale * LOG2E,
        float(row_mode_factor),
        *q.stride(),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        *sparse_bt.stride(),
        *sparse_ctx.stride(),
        union.stride(0),
        union.stride(1),
        out.stride(0),
        out.stride(1),
        hq if lse is None else lse.stride(0),
        1 if lse is None else lse.stride(1),
        group,
        T=t,
        GP=gp,
        GP16=max(16, gp),
        W_PAD=max(2, next_power_of_2(max(width, 1))),
        D=d,
        D_PAD=d_pad,
        PAGES=pages,
        ROW_BLOCK_N=row_block_n,
        PAGE=PAGE_SIZE,
        MODE={"auto": 0, "union": 1, "rows": 2}[mode],
        WRITE_LSE=lse is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        INTERPRETED=backend.INTERPRETER,
        num_warps=num_warps or cfg["num_warps"],
        num_stages=num_stages or cfg["num_stages"],
    )


__all__ = ["ROW_MODE_FACTOR", "neighbour_share", "tile_unions", "tiled_attention_kernel", "tiled_config"]
