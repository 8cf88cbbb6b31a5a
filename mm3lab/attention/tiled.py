"""Tiled sparse prefill attention: a tile of query rows walks the union of its pages once.

The per-row kernel (``kernel.py``) runs one program per (row, KV head) and reads
every selected page again for every row. In a prefill chunk neighbouring rows
select mostly the same blocks (the local block, sinks, needles), so this kernel
gives one program a *tile* of ``T`` consecutive rows and the ``G`` query heads of
one KV head, ``M = T * G`` query vectors, and walks the union of the pages those
rows use, loading each page's K and V once for the whole tile.

Exactness for any input ``sparse_attention`` accepts (no block structure is
assumed; a page list is just a list of pages):

* a pre-pass (:func:`tile_unions_kernel`, one launch, no host sync; :func:`tile_unions`
  is its PyTorch form) lists per (KV head, tile) the distinct readable pages that its
  rows use (the first ``ceil(ctx / 16)`` entries of each row), ``-1`` padded, with their
  count and the tile's total number of used (row, page) entries, and per union page how
  many times each row reads it whole, how many of its leading tokens some row reads, and
  whether every row of the tile reads it whole exactly once (a *plain* page);
* the union comes in three parts, each in page order: plain pages whose aligned group of
  ``PAGES`` ids (``id // PAGES``) are all plain here, the other plain pages, the rest.
  The kernel walks the plain pages first in whole steps of ``PAGES`` pages with no masks
  and no weights (*lean* steps); from Hopper on, a step of the first part, ``PAGES``
  consecutive ids, reads its K and V as one block each (tensor descriptors) instead of
  gathering rows page by page. A tile whose rows share their selection has nearly all its
  pages in the first part: the partial tail page and the pages of the tail block before it
  go to the later parts, and no longer shift the blocks after them off their alignment.
  Measured on an H100 (4096-token chunk at 32K, every tile walking its union, graph;
  ``tiled-variants-2026-12-07-b.json``): on the tile-shared chunk 0.794 ms with block steps,
  1.066 ms with lean steps gathered, 0.873 ms with every step testing whether it is plain (the
  walk before lean steps); on the synthetic chunk 1.427 / 1.711 / 1.408 ms. So lean steps run
  where block steps do, and nowhere else by default; the default launch (the rule) took
  0.826 ms on the tile-shared chunk, 0.897 ms before (run k). 8-row tiles of 8 pages per step
  stayed slower (0.870 ms);
* for each remaining step of ``PAGES`` union pages the kernel gets, per (row, token), the number
  of times the row attends that token: the whole-page counts, plus one for the first
  ``ctx % 16`` tokens of the page a row's tail ends in. A token attended ``w`` times
  enters the softmax with the score ``s + log(w)`` (weight ``w``), and ``w = 0`` masks
  it. A step whose pages are all plain skips the weights: they are all 1. So disjoint
  selections, ``ctx`` 0, padded rows, repeated pages and tails mid-page all come out
  exactly as in the page-walking reference.

When a tile's rows share little (union close to the sum of the rows' pages, as
with independent random selections), walking the union costs ``T`` times the
tensor-core work of the per-row kernel for the same bytes. Such a tile walks each
row's own page list instead (the per-row algorithm, with the per-row kernel's own
steps): the rule is ``union_pages > row_mode_factor * row_pages``. Both walks share
the per-row kernel's online-softmax update. The choice is made on the device, in
two launches of the same kernel: the first runs the pre-pass (each program its own
tile's, so no launch of its own) and the union walks, the second the row walks, one
program per (row, KV head) as in the per-row kernel, each program skipping the rows of
the tiles that walk their union. (One launch that compiles both walks ran slower code,
0.90 against 0.87 ms and 1.52 against 1.43 ms on an H100, where every tile walked its
union. Row walks of one program per tile, its rows in turn, took 3.107 against 3.080 ms
and 3.131 against 3.142 ms on independent random selections in two rounds on an H100, and
0.948 of the per-row kernel's speed against 0.970 in whole benchmark runs. Taking the row walks
from a list, which the first launch writes and a few programs per SM drain through a counter, so that
the second launch starts no programs for the tiles that walk their union, lost on every selection:
0.919 against 0.905 ms on the tile-shared one, 3.188 against 3.091 ms on the random one. Where every
tile walks its union, the rule's two launches cost about 33 us over ``mode="union"`` on an H100: about
16 us in the first launch's code (0.887 / 0.888 against 0.871 / 0.890 ms, two rounds) and about 25 us for
the second launch, whose programs all skip. Compiling the first launch's union walk outside a branch,
a tile the rule sends to its rows walking no page, lost: 0.911 / 0.925 against 0.904 / 0.923 ms on
the tile-shared chunk, 1.469 / 1.471 against 1.458 / 1.459 ms on the synthetic one and 3.106 against
3.089 ms on the random one.)

With value checks (``check``), a small launch of :data:`CHECKERS` programs queued just before the
attention checks every ctx and every used page id of the call, then tells the host, which need not
wait for the attention (it never reads outside the cache). The checks can also run in the first
programs of the attention launch itself (``check_launch="inside"``, one launch fewer), but the
attention compiled with them ran slower in every program: on an H100 (4096-token chunk at 32K,
eager, checks on), 0.907 / 0.920 ms apart against 0.922 / 0.933 ms inside on the tile-shared
selection, 1.461 / 1.464 against 1.559 / 1.559 ms on the synthetic one (two rounds), where the
attention alone takes 0.894 and 1.434 ms as a graph.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .. import backend
from .._combine import maximum as _running_max
from .._combine import minimum as _running_min
from .._fit import fitting
from .._grid import next_power_of_2
from .._valcheck import signal_done_of
from ..constants import PAGE_SIZE
from .checks import readable_pages
from .kernel import LOG2E, _attend_row, _clamp_ctx, _empty_state, _finish, _online_softmax

TILE_QUERY_VECTORS, TILE_PAGES, TILE_WARPS, TILE_STAGES = 64, 4, 4, 2
"""The tile's default shape: query vectors per program, union pages per step, warps, pipeline stages
(see :func:`tiled_config`)."""

PREPASS_MAX_ENTRIES = 8192
"""The tile heuristic keeps the pre-pass's per-tile sort at most this long where the group allows
(the model's 4-row tiles of 128-page lists sort 512 entries)."""

CHECKERS = 128
"""With value checks, at most this many programs run them (and then signal the host): the whole check
launch (``check_launch="apart"``), or the first programs of the attention launch (``"inside"``)."""

CHECK_LAUNCH = "apart"
"""Where a checked launch's value checks run: ``"apart"`` (a small launch of their own, before the attention)
or ``"inside"`` (the first programs of the attention launch); see :func:`tiled_attention_kernel`."""

ROW_MODE_FACTOR = 0.5
"""A tile walks its rows one by one when its union has more than this fraction of its rows' pages."""

ROW_PROGRAMS = True
"""The tiles that walk their rows do it with one program per (row, KV head), not one per tile."""

BLOCK_STEPS = True
"""Lean steps of consecutive page ids read K and V as blocks where the device and caches allow it."""

PREPASS_BY_RULE = True
"""The fused pre-pass of the rule's union-walk launch writes a tile that walks its rows its count and
row pages only (nothing reads its other tables); ``False``: every tile's whole tables. The same bits;
on independent random selections (every tile walks its rows) 3.103 / 3.040 ms against 3.142 / 3.079 ms
in two rounds on an H100 (graph; ``tiled-variants-2026-12-07.json``, run h), no change on the others."""


def tile_unions(
    sparse_bt: torch.Tensor, sparse_ctx: torch.Tensor, num_pages: int, tile_rows: int, step_pages: int = TILE_PAGES
):
    """The pre-pass in PyTorch (the readable form of :func:`tile_unions_kernel`, which the tiled kernel
    runs): per (KV head, tile of ``tile_rows`` rows), the distinct readable pages its rows use, and
    how its rows use each of them.

    Returns ``(union, count, row_pages, whole, live, plain, lean)``, with ``U = tile_rows * W``:

    * ``union [Hkv, tiles, U]`` int32: the tile's distinct readable used pages, ``-1`` padded, in three
      parts, each in page order: the plain pages (below) whose aligned group of ``step_pages`` page ids
      (``id // step_pages``) are all plain pages of the tile (so a multiple of ``step_pages`` of them, in
      runs of consecutive ids, which the kernel may read a step at a time as one block), the other
      plain pages, then the rest;
    * ``count [Hkv, tiles]`` int32: how many; ``row_pages [Hkv, tiles]`` int32: the tile's used
      (row, page) entries (the first ``ceil(ctx / 16)`` of each row, pages in the cache);
    * ``whole [Hkv, tiles, U, tile_rows]`` int32: how many of row ``r``'s entries are union page
      ``u`` read whole (every entry but a tail that ends mid-page);
    * ``live [Hkv, tiles, U]`` int32: how many leading tokens of page ``u`` some row reads (16, or
      the longest tail ending in it); ``plain [Hkv, tiles, U]`` int32: 1 where every row of the tile
      reads page ``u`` whole exactly once (no mask needed), else 0; ``lean [Hkv, tiles, 2]`` int32: the
      lengths of the first part and of the first two (the plain pages, which the kernel walks first,
      without masks).

    Runs on the tables' device without reading anything back to the host.
    """
    hkv, n, width = sparse_bt.shape
    tiles = max(1, math.ceil(n / tile_rows))
    dev = sparse_bt.device
    ctx = sparse_ctx.clamp(0, width * PAGE_SIZE).to(torch.int32)
    slot = torch.arange(width, device=dev, dtype=torch.int32)
    tokens = (ctx.unsqueeze(-1) - slot * PAGE_SIZE).clamp(0, PAGE_SIZE)  # tokens of each entry the row reads
    used = (tokens > 0) & (sparse_bt >= 0) & (sparse_bt < num_pages)  # a page outside the cache is never read
    big = torch.iinfo(torch.int32).max  # sorts after every readable page
    vals = torch.where(used, sparse_bt.to(torch.int32), big)
    pad = tiles * tile_rows - n
    if pad:
        vals = torch.cat([vals, vals.new_full((hkv, pad, width), big)], dim=1)
        used = torch.cat([used, used.new_zeros(hkv, pad, width)], dim=1)
        tokens = torch.cat([tokens, tokens.new_zeros(hkv, pad, width)], dim=1)
    flat = vals.view(hkv, tiles, tile_rows * width)
    used = used.view(hkv, tiles, -1)
    tokens = torch.where(used, tokens.view(hkv, tiles, -1), 0)
    ordered = flat.sort(dim=-1).values
    first = torch.ones_like(ordered, dtype=torch.bool)
    first[..., 1:] = ordered[..., 1:] != ordered[..., :-1]
    first &= ordered != big
    at = torch.cumsum(first, dim=-1, dtype=torch.int32) - 1  # where each first occurrence goes
    count = at[..., -1] + 1
    u = tile_rows * width  # duplicates and unused entries go to a column that is dropped
    union = torch.full((hkv, tiles, u + 1), big, dtype=torch.int32, device=dev)
    union.scatter_(-1, torch.where(first, at, u).long(), ordered)
    union = union[..., :u].contiguous()  # sorted, ``big`` past the count
    # each entry's place in its tile's union, then counts per (union page, row) and per union page
    where = torch.where(used, torch.searchsorted(union, flat).clamp_(max=u - 1), u)
    row = torch.arange(tile_rows, device=dev).repeat_interleave(width)
    whole_e = used & (tokens == PAGE_SIZE)
    cell = torch.where(whole_e, where * tile_rows + row, u * tile_rows)
    whole = torch.zeros(hkv, tiles, (u + 1) * tile_rows, dtype=torch.int32, device=dev)
    whole.scatter_add_(-1, cell, torch.ones_like(cell, dtype=torch.int32))
    whole = whole[..., : u * tile_rows].reshape(hkv, tiles, u, tile_rows)
    live = torch.zeros(hkv, tiles, u + 1, dtype=torch.int32, device=dev)
    live.scatter_reduce_(-1, where, tokens, "amax")
    tail = torch.zeros(hkv, tiles, u + 1, dtype=torch.int32, device=dev)
    tail.scatter_add_(-1, where, (used & ~whole_e).to(torch.int32))
    plain = (whole == 1).all(-1) & (tail[..., :u] == 0)
    live = live[..., :u]
    # plain pages whose aligned group of ``step_pages`` ids are all plain here (a run the kernel can read
    # as one block), then the other plain pages, then the rest (each in page order), then the padding
    slot_u = torch.arange(u, device=dev)
    group = torch.where(union == big, -1, union // step_pages)  # sorted: a group's pages are neighbours
    starts = torch.ones_like(plain)
    starts[..., 1:] = group[..., 1:] != group[..., :-1]
    seg = torch.cumsum(starts, dim=-1) - 1
    per_seg = torch.zeros_like(seg).scatter_add_(-1, seg, plain.long())
    full = plain & (per_seg.gather(-1, seg) == step_pages)
    tier = torch.where(full, 0, torch.where(plain, 1, torch.where(slot_u < count.unsqueeze(-1), 2, 3)))
    order = (tier * u + slot_u).argsort(dim=-1)
    union, live, plain = (x.gather(-1, order) for x in (union, live, plain.to(torch.int32)))
    whole = whole.gather(-2, order.unsqueeze(-1).expand_as(whole))
    union = torch.where(union == big, -1, union)
    row_pages = used.sum(-1, dtype=torch.int32)
    lean = torch.stack([full.sum(-1, dtype=torch.int32), plain.sum(-1, dtype=torch.int32)], dim=-1)
    return union, count.to(torch.int32).contiguous(), row_pages, whole, live.contiguous(), plain, lean


@triton.jit
def _walks_union(count, row_pages, row_mode_factor):
    """The rule: a tile walks its union (else its rows) when its union has at most ``row_mode_factor`` of
    its rows' pages. One expression for the pre-pass and both launches, which must agree on every tile."""
    return count.to(tl.float32) <= row_mode_factor * row_pages.to(tl.float32)


@triton.jit
def _tile_union(
    table,  # (bt_ptr, stride_bh, stride_bn, stride_bw, ctx_ptr, stride_ch, stride_cn, width)
    tables,  # (union_ptr [Hkv, tiles, U], count_ptr, rowpages_ptr, whole_ptr [Hkv, tiles, U, T], live_ptr, plain_ptr)
    tile,
    h,
    tiles,
    n_rows,
    num_pages,
    row_mode_factor,
    T: tl.constexpr,
    W_PAD: tl.constexpr,
    PAGE: tl.constexpr,
    KEY32: tl.constexpr,  # the sort keys fit in int32 (``num_pages * T * 32 < 2**31``): half the sort's work
    BY_RULE: tl.constexpr,  # only a tile that the rule sends to its union walk gets its union tables
    STEP: tl.constexpr,  # the union walk's pages per step (the union's first part: whole aligned groups of them)
):
    """The pre-pass of one (tile, KV head): sort the tile's used entries by (page, row, tokens), then
    count; returns the tile's ``(count, row_pages)``.

    The counts come from scans along the sorted entries (no atomics): entries of one union page, and of
    one (page, row), are neighbours, and ``at`` (an entry's union page) never decreases, so a running
    maximum restarts at every page. The last entry of each page (and of each (page, row)) stores its
    page's numbers; only ``whole``'s first ``count * T`` entries are zeroed first. Tables past ``count``
    are left as they are (the tiled kernel never reads them), but ``union``, which is ``-1`` there.
    With ``BY_RULE``, a tile that the rule (``count > row_mode_factor * row_pages``) sends to its row
    walks gets its count and row pages only: nothing reads its other tables."""
    bt_ptr, stride_bh, stride_bn, stride_bw, ctx_ptr, stride_ch, stride_cn, width = table
    union_ptr, count_ptr, rowpages_ptr, whole_ptr, live_ptr, plain_ptr, lean_ptr = tables
    u_len = T * width
    L: tl.constexpr = T * W_PAD
    o = tl.arange(0, L)
    t = o // W_PAD
    w = o % W_PAD
    n = tile * T + t
    row_ok = n < n_rows
    ctx = _clamp_ctx(tl.load(ctx_ptr + h * stride_ch + n * stride_cn, mask=row_ok, other=0), width, PAGE)
    tokens = tl.minimum(tl.maximum(ctx - w * PAGE, 0), PAGE)  # tokens of the entry the row reads
    used = row_ok & (w < width) & (tokens > 0)
    page = tl.load(
        bt_ptr + h.to(tl.int64) * stride_bh + n.to(tl.int64) * stride_bn + w * stride_bw, mask=used, other=-1
    )
    if KEY32:
        page = page.to(tl.int32)
        big: tl.constexpr = 2**31 - 1
    else:
        page = page.to(tl.int64)
        big: tl.constexpr = 2**62
    used = used & (page >= 0) & (page < num_pages)  # a page outside the cache is never read
    # key: page, then row, then the entry's tokens (1 .. PAGE, in 5 bits); unused entries sort last
    key = tl.sort(tl.where(used, (page * T + t) * 32 + tokens, big))
    valid = key != big
    pg = key // (32 * T)
    pr = key // 32  # (page, row)
    prev = tl.gather(key, tl.maximum(o - 1, 0), 0) // 32
    first_page = valid & ((o == 0) | (prev // T != pg))
    first_pr = valid & ((o == 0) | (prev != pr))
    count = tl.sum(first_page.to(tl.int32), 0)
    base = h.to(tl.int64) * tiles + tile
    row_pages = tl.sum(used.to(tl.int32), 0)
    tl.store(count_ptr + base, count)
    tl.store(rowpages_ptr + base, row_pages)
    if BY_RULE:
        tables_needed = _walks_union(count, row_pages, row_mode_factor)
    else:
        tables_needed = True
    if tables_needed:
        sorted_entries = (key, valid, pg, pr, first_page, first_pr, count)
        _union_tables(sorted_entries, tables, base, u_len, T, L, PAGE, big, STEP)
    return count, row_pages


@triton.jit
def _union_tables(
    sorted_entries,
    tables,
    base,
    u_len,
    T: tl.constexpr,
    L: tl.constexpr,
    PAGE: tl.constexpr,
    big: tl.constexpr,
    STEP: tl.constexpr,
):
    """The union tables of one (tile, KV head) from its sorted entries (the rest of :func:`_tile_union`)."""
    key, valid, pg, pr, first_page, first_pr, count = sorted_entries
    union_ptr, _, _, whole_ptr, live_ptr, plain_ptr, lean_ptr = tables
    o = tl.arange(0, L)
    at = tl.cumsum(first_page.to(tl.int32), 0) - 1
    tok = (key % 32).to(tl.int32)
    row = (pr % T).to(tl.int32)
    whole_e = valid & (tok == PAGE)
    nxt = tl.gather(key, tl.minimum(o + 1, L - 1), 0)
    end = (o == L - 1) | (nxt == big)
    last_page = valid & (end | (nxt // (32 * T) != pg))
    last_pr = valid & (end | (nxt // 32 != pr))
    ones_w = whole_e.to(tl.int32)
    ones_r = first_pr.to(tl.int32)
    cw = tl.cumsum(ones_w, 0)  # whole entries so far
    cr = tl.cumsum(ones_r, 0)  # distinct (page, row) pairs so far
    # running maxima of values marked at a segment's first entry: that segment's start
    w_pr = cw - tl.associative_scan(tl.where(first_pr, cw - ones_w, 0), 0, _running_max)
    first_at = tl.associative_scan(tl.where(first_page, o, 0), 0, _running_max)
    w_page = cw - tl.associative_scan(tl.where(first_page, cw - ones_w, 0), 0, _running_max)
    r_page = cr - tl.associative_scan(tl.where(first_page, cr - ones_r, 0), 0, _running_max)
    # the page's most-read tokens: ``at`` never decreases, so the running max of at * 64 + tokens is per page
    live = tl.associative_scan(tl.where(valid, at * 64 + tok, -1), 0, _running_max) - at * 64
    # plain: T distinct rows, each with one whole entry and nothing else (known at the page's last entry)
    plain = (o - first_at + 1 == T) & (w_page == T) & (r_page == T)
    # the union's order (see tile_unions): plain pages of whole aligned groups of STEP ids, the other plain
    # pages, the rest; a group's entries are neighbours, as a page's are
    plain_last = (last_page & plain).to(tl.int32)
    grp = pg // STEP
    first_grp = valid & ((o == 0) | (tl.gather(key, tl.maximum(o - 1, 0), 0) // (32 * T) // STEP != grp))
    last_grp = valid & (end | (nxt // (32 * T) // STEP != grp))
    cp = tl.cumsum(plain_last, 0)
    grp_plain = cp - tl.associative_scan(tl.where(first_grp, cp - plain_last, 0), 0, _running_max)
    # each entry's group total, and page position, from the group's / page's last entry (the next one at or after it)
    grp_end = tl.associative_scan(tl.where(last_grp, o, L - 1), 0, _running_min, reverse=True)
    full = plain & (tl.gather(grp_plain, grp_end, 0) == STEP)
    tier0 = (last_page & full).to(tl.int32)
    tier1 = (last_page & plain & ~full).to(tl.int32)
    tier2 = (last_page & ~plain).to(tl.int32)
    n0 = tl.sum(tier0, 0)
    n1 = tl.sum(tier1, 0)
    pos = tl.where(
        full, tl.cumsum(tier0, 0) - 1, tl.where(plain, n0 + tl.cumsum(tier1, 0) - 1, n0 + n1 + tl.cumsum(tier2, 0) - 1)
    )
    seg_end = tl.associative_scan(tl.where(last_page, o, L - 1), 0, _running_min, reverse=True)
    pos_e = tl.gather(pos, seg_end, 0)
    tl.store(lean_ptr + base * 2, n0)
    tl.store(lean_ptr + base * 2 + 1, n0 + n1)
    tl.store(union_ptr + base * u_len + pos, pg.to(tl.int32), mask=last_page)
    tl.store(union_ptr + base * u_len + o, -1, mask=(o >= count) & (o < u_len))
    tl.store(live_ptr + base * u_len + pos, live, mask=last_page)
    tl.store(plain_ptr + base * u_len + pos, plain.to(tl.int32), mask=last_page)
    whole_row = whole_ptr + base * u_len * T
    z = 0
    while z < count * T:  # zero the counts the tiled kernel reads, then set the used ones
        tl.store(whole_row + z + o, 0, mask=z + o < count * T)
        z += L
    tl.debug_barrier()
    tl.store(whole_row + pos_e * T + row, w_pr, mask=last_pr)


@triton.jit
def _check_tables(
    table,  # (bt_ptr, stride_bh, stride_bn, stride_bw, ctx_ptr, stride_ch, stride_cn, width)
    check,  # (flags_ptr, page_mod, page_mod_limit), as kernel._check_row's
    pid,
    checkers,
    n_rows,
    hkv,
    num_pages,
    W_PAD: tl.constexpr,
    ROWS: tl.constexpr,  # rows per chunk
    PAGE: tl.constexpr,
):
    """Checker ``pid`` of ``checkers``: the value checks of every ``checkers``-th chunk of (KV head, row)
    rows. Sets ``flags[0]`` where a row's ctx is outside ``[0, W * 16]`` and ``flags[1]`` where a used page
    id (the first ``ceil(ctx / 16)`` of the row, ctx clamped as the attention clamps it) is outside the
    cache or breaks the layout's rule (``id mod page_mod >= page_mod_limit``): the per-row kernel's checks."""
    bt_ptr, stride_bh, stride_bn, stride_bw, ctx_ptr, stride_ch, stride_cn, width = table
    flags_ptr, page_mod, page_mod_limit = check
    offs_r = tl.arange(0, ROWS)
    offs_w = tl.arange(0, W_PAD)
    chunks = (hkv * n_rows + ROWS - 1) // ROWS
    bad_ctx = tl.zeros([ROWS], dtype=tl.int32)
    bad_page = tl.zeros([ROWS, W_PAD], dtype=tl.int32)
    c = pid
    while c < chunks:  # (a while loop: its step is not a compile-time constant)
        r = c * ROWS + offs_r
        ok = r < hkv * n_rows
        h = (r // n_rows).to(tl.int64)
        n = (r % n_rows).to(tl.int64)
        raw = tl.load(ctx_ptr + h * stride_ch + n * stride_cn, mask=ok, other=0).to(tl.int64)
        bad_ctx += (ok & ((raw < 0) | (raw > width * PAGE))).to(tl.int32)
        pages = (_clamp_ctx(raw, width, PAGE) + PAGE - 1) // PAGE
        used = ok[:, None] & (offs_w[None, :] < pages[:, None])
        ids = tl.load(
            bt_ptr + (h * stride_bh + n * stride_bn)[:, None] + offs_w[None, :] * stride_bw, mask=used, other=0
        ).to(tl.int64)
        outside = (ids < 0) | (ids >= num_pages) | ((ids % page_mod + page_mod) % page_mod >= page_mod_limit)
        bad_page += (used & outside).to(tl.int32)
        c += checkers
    tl.store(flags_ptr, 1, mask=tl.sum(bad_ctx, 0) > 0)
    tl.store(flags_ptr + 1, 1, mask=tl.sum(tl.sum(bad_page, 1), 0) > 0)


@triton.jit
def _tiled_check(
    bt_ptr,
    ctx_ptr,
    flags_ptr,
    launches_ptr,
    done_ptr,
    page_mod,
    page_mod_limit,
    n_rows,
    hkv,
    num_pages,
    width,
    stride_bh,
    stride_bn,
    stride_bw,
    stride_ch,
    stride_cn,
    W_PAD: tl.constexpr,
    CHECK_ROWS: tl.constexpr,
    PAGE: tl.constexpr,
):
    """The tiled launch's value checks as a launch of their own (``check_launch="apart"``): every program
    a checker (:func:`_check_tables`), then the signal to the host."""
    table = (bt_ptr, stride_bh, stride_bn, stride_bw, ctx_ptr, stride_ch, stride_cn, width)
    pid, checkers = tl.program_id(0), tl.num_programs(0)
    _check_tables(
        table, (flags_ptr, page_mod, page_mod_limit), pid, checkers, n_rows, hkv, num_pages, W_PAD, CHECK_ROWS, PAGE
    )
    signal_done_of(launches_ptr, done_ptr, checkers)


@triton.jit
def _tile_unions_fwd(
    bt_ptr,
    ctx_ptr,
    union_ptr,
    count_ptr,
    rowpages_ptr,
    whole_ptr,
    live_ptr,
    plain_ptr,
    lean_ptr,
    n_rows,
    width,
    num_pages,
    stride_bh,
    stride_bn,
    stride_bw,
    stride_ch,
    stride_cn,
    T: tl.constexpr,
    W_PAD: tl.constexpr,
    PAGE: tl.constexpr,
    KEY32: tl.constexpr,
    STEP: tl.constexpr,
):
    """One program per (tile, KV head): :func:`_tile_union`."""
    table = (bt_ptr, stride_bh, stride_bn, stride_bw, ctx_ptr, stride_ch, stride_cn, width)
    tables = (union_ptr, count_ptr, rowpages_ptr, whole_ptr, live_ptr, plain_ptr, lean_ptr)
    tile, h, tiles = tl.program_id(0), tl.program_id(1), tl.num_programs(0)
    _tile_union(table, tables, tile, h, tiles, n_rows, num_pages, 0.0, T, W_PAD, PAGE, KEY32, False, STEP)


def tile_unions_kernel(
    sparse_bt: torch.Tensor, sparse_ctx: torch.Tensor, num_pages: int, tile_rows: int, step_pages: int = TILE_PAGES
):
    """:func:`tile_unions` in one Triton launch: the same ``union``, ``count`` and ``row_pages``, and the same
    ``whole``, ``live`` and ``plain`` for the first ``count`` union pages of each tile (past them they are
    unspecified: nothing reads them).

    The sort keys are int32 where every key fits (``num_pages * tile_rows * 32 < 2**31``, 1M pages of the
    4-row tiles), else int64; four warps sort up to 512 entries, eight more. Measured on an H100 (4096-token
    chunk at 32K, graph): 0.055 ms, where int64 keys, eight warps, atomics into zero-filled tables took 0.118 ms."""
    hkv, n, width = sparse_bt.shape
    tables = _empty_tables(sparse_bt, tile_rows)
    union, count, row_pages = tables[:3]
    tiles = union.shape[1]
    if width == 0 or n == 0:
        union.fill_(-1)
        for table in (count, row_pages, tables[6]):
            table.zero_()
        return tables
    _tile_unions_fwd[(tiles, hkv)](
        sparse_bt,
        sparse_ctx,
        *tables,
        n,
        width,
        num_pages,
        *sparse_bt.stride(),
        *sparse_ctx.stride(),
        T=tile_rows,
        W_PAD=next_power_of_2(width),
        PAGE=PAGE_SIZE,
        KEY32=_key32(num_pages, tile_rows),
        STEP=step_pages,
        num_warps=4 if tile_rows * next_power_of_2(width) <= 512 else 8,
    )
    return tables


def _empty_tables(sparse_bt: torch.Tensor, tile_rows: int) -> tuple:
    """The pre-pass's tables (as :func:`tile_unions` returns them), allocated, not filled."""
    hkv, n, width = sparse_bt.shape
    tiles = max(1, math.ceil(n / tile_rows))
    u = tile_rows * width
    new = lambda *shape: torch.empty(*shape, dtype=torch.int32, device=sparse_bt.device)  # noqa: E731
    return (
        new(hkv, tiles, u),
        new(hkv, tiles),
        new(hkv, tiles),
        new(hkv, tiles, u, tile_rows),
        *(new(hkv, tiles, u) for _ in range(2)),
        new(hkv, tiles, 2),
    )


def _key32(num_pages: int, tile_rows: int) -> bool:
    """Whether the pre-pass's sort keys (page, row, tokens) fit in int32."""
    return num_pages * tile_rows * 32 < 2**31 - 1


def neighbour_share(sparse_bt: torch.Tensor, sparse_ctx: torch.Tensor) -> torch.Tensor:
    """How much consecutive rows share: the fraction of rows' used 128-token slots (``W / 8`` per row)
    whose first page also starts a used slot of the previous row (same KV head). A 0-dim float32
    tensor on the tables' device: about ``1 / topk`` for independent random selections, near 1 when
    neighbours select the same blocks. Cheap (``[Hkv, N, topk, topk]`` comparisons); it describes a
    selection (the benchmarks record it); the kernels choose per tile on the device instead.
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
    union,  # (the tile's union pages, their count, whole-page counts [U, T], live tokens, plain flags)
    start,
    tail,  # (page, tokens) [T] each: the page a row's tail ends in mid-page (-1: none), and its tokens there
    qk_scale,
    state,  # (m_i, l_i, acc), as in kernel._attend_step
    T: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    PAGES: tl.constexpr,
    PAGE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PLAIN_STEPS: tl.constexpr,
):
    """One online-softmax step of the whole tile over union pages ``start .. start + PAGES - 1``."""
    BLOCK_N: tl.constexpr = PAGES * PAGE
    k_head, v_head, num_pages, stride_kp, stride_kr, stride_vp, stride_vr = cache
    union_row, count, whole_tile, live_row, plain_row = union
    tail_page, tail_len = tail
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < D
    offs_p = tl.arange(0, PAGES)
    p_ok = start + offs_p < count
    # every row attends every token of the step once (pages the tile shares whole): no weights
    plain = tl.min(tl.load(plain_row + start + offs_p, mask=p_ok, other=0), 0) == 1
    plain = plain & PLAIN_STEPS

    tok = tl.arange(0, BLOCK_N)
    at = start + tok // PAGE
    page = tl.load(union_row + at, mask=at < count, other=-1).to(tl.int64)
    live = tl.load(live_row + at, mask=at < count, other=0)  # tokens of the page some row reads
    ok = (page >= 0) & (page < num_pages) & (tok % PAGE < live)  # tokens nobody attends are never read
    row = (tok % PAGE).to(tl.int64)
    kv_mask = ok[:, None] & d_ok[None, :]
    k = tl.load(k_head + (page * stride_kp + row * stride_kr)[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [M, BLOCK_N]
    if not plain:
        # per (row, union page): whole occurrences (pre-pass), and the tokens of a tail ending mid-page
        offs_t = tl.arange(0, T)
        upage = tl.load(union_row + start + offs_p, mask=p_ok, other=-1)  # [PAGES]
        full = tl.load(
            whole_tile + (start + offs_p)[None, :] * T + offs_t[:, None],
            mask=(offs_t[:, None] < T) & p_ok[None, :],
            other=0,
        )  # [T, PAGES]
        part = tl.where(upage[None, :] == tail_page[:, None], tail_len[:, None], 0)  # [T, PAGES]
        r = tl.arange(0, PAGE)
        w3 = full[:, :, None] + (r[None, None, :] < part[:, :, None]).to(tl.int32)  # [T, PAGES, PAGE]
        # a token attended w times enters with weight w (score + log2 w); w = 0 masks it
        lw3 = tl.where(w3 > 0, tl.log2(tl.maximum(w3, 1).to(tl.float32)), float("-inf"))
        lw = tl.reshape(tl.broadcast_to(lw3[:, None, :, :], [T, GP, PAGES, PAGE]), [T * GP, BLOCK_N])
        scores = tl.where(lw > float("-inf"), scores + lw, float("-inf"))
    m_i, l_i, acc = state
    p, alpha, m_i, l_i = _online_softmax(scores, m_i, l_i)
    v = tl.load(v_head + (page * stride_vp + row * stride_vr)[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_i, l_i, acc


@triton.jit
def _page_rows(rows, D: tl.constexpr, D_PAD: tl.constexpr):
    """Load ``[N, D_PAD]`` from ``rows`` (``[N, 1]`` pointers to the first element of each row), zeros past
    ``D``; no mask along the rows."""
    offs_d = tl.arange(0, D_PAD)
    if D == D_PAD:
        x = tl.load(rows + offs_d[None, :])
    else:
        x = tl.load(rows + offs_d[None, :], mask=(offs_d < D)[None, :], other=0.0)
    return x


@triton.jit
def _lean_step(
    q,
    cache,
    union_row,
    start,
    qk_scale,
    state,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    PAGES: tl.constexpr,
    PAGE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """:func:`_tile_step` over ``PAGES`` plain union pages (every row of the tile reads each of them whole,
    once; all in the cache): the same arithmetic, without masks or weights."""
    BLOCK_N: tl.constexpr = PAGES * PAGE
    k_head, v_head, _, stride_kp, stride_kr, stride_vp, stride_vr = cache
    tok = tl.arange(0, BLOCK_N)
    page = tl.load(union_row + start + tok // PAGE).to(tl.int64)
    row = (tok % PAGE).to(tl.int64)
    k = _page_rows(k_head + (page * stride_kp + row * stride_kr)[:, None], D, D_PAD)
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    m_i, l_i, acc = state
    p, alpha, m_i, l_i = _online_softmax(scores, m_i, l_i)
    v = _page_rows(v_head + (page * stride_vp + row * stride_vr)[:, None], D, D_PAD)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_i, l_i, acc


@triton.jit
def _block_step(
    q,
    descs,  # (K, V) tensor descriptors of the caches as [pages * PAGE, Hkv * D], blocks [PAGES * PAGE, D]
    h,
    union_row,
    start,
    qk_scale,
    state,
    D: tl.constexpr,
    PAGE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """:func:`_lean_step` over ``PAGES`` plain union pages of consecutive ids: K and V each read as one
    block (a tensor-memory-accelerator copy on Hopper) from the step's first page."""
    k_desc, v_desc = descs
    first = tl.load(union_row + start) * PAGE
    k = k_desc.load([first, h * D])
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    m_i, l_i, acc = state
    p, alpha, m_i, l_i = _online_softmax(scores, m_i, l_i)
    v = v_desc.load([first, h * D])
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
    page_use,  # the tile's (whole [U, T], live [U], plain [U]) of tile_unions
    lean,  # the tile's (pages in whole aligned groups, plain pages): the union's first parts
    descs,  # BLOCKS: the caches' tensor descriptors (see _block_step)
    PLAIN_STEPS: tl.constexpr,
    LEAN: tl.constexpr,
    BLOCKS: tl.constexpr,
    T: tl.constexpr,
    GP: tl.constexpr,
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
    union = (union_row, count) + page_use
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
    # each row's tail page, when its tail ends mid-page (the pre-pass counts only whole pages)
    offs_t = tl.arange(0, T)
    n_t = row0 + offs_t
    t_ok = n_t < n_rows
    ctx_t = _clamp_ctx(tl.load(ctx_ptr + h * stride_ch + n_t * stride_cn, mask=t_ok, other=0), width, PAGE)
    tail_len = ctx_t % PAGE
    has_tail = t_ok & (tail_len > 0)
    tail_page = tl.load(
        bt_ptr + h.to(tl.int64) * stride_bh + n_t.to(tl.int64) * stride_bn + (ctx_t // PAGE) * stride_bw,
        mask=has_tail,
        other=-1,
    ).to(tl.int32)
    tail = (tl.where(has_tail, tail_page, -1), tail_len)

    state = _empty_state(M, D_PAD)
    # the union's plain pages first, in whole steps without masks (with BLOCKS, the steps of whole aligned
    # groups read as blocks), then the rest
    n_full, n_plain = lean
    block_end = 0
    lean_end = 0
    if PLAIN_STEPS and LEAN:
        if BLOCKS:
            block_end = n_full
        lean_end = block_end + ((n_plain - block_end) // PAGES) * PAGES
    if INTERPRETED:  # the same steps as the range() loops below (see kernel._attend_row); no blocks
        start = 0
        while start < lean_end:
            state = _lean_step(q, cache, union_row, start, qk_scale, state, D, D_PAD, PAGES, PAGE, DOT_PRECISION)
            start += PAGES
        while start < count:
            state = _tile_step(
                q, cache, union, start, tail, qk_scale, state, T, GP, D, D_PAD, PAGES, PAGE, DOT_PRECISION, PLAIN_STEPS
            )
            start += PAGES
    else:
        if BLOCKS:
            for start in range(0, block_end, PAGES):
                state = _block_step(q, descs, h, union_row, start, qk_scale, state, D, PAGE, DOT_PRECISION)
        for start in range(block_end, lean_end, PAGES):
            state = _lean_step(q, cache, union_row, start, qk_scale, state, D, D_PAD, PAGES, PAGE, DOT_PRECISION)
        for start in range(lean_end, count, PAGES):
            state = _tile_step(
                q, cache, union, start, tail, qk_scale, state, T, GP, D, D_PAD, PAGES, PAGE, DOT_PRECISION, PLAIN_STEPS
            )
    _store_rows(outs, n_m, heads, m_ok, state, D, D_PAD, WRITE_LSE)


@triton.jit
def _walk_rows(
    query,
    cache,
    table,
    outs,
    tile,  # as in _walk_union
    ROWS: tl.constexpr,
    GP16: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    ROW_BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """Rows ``row0 .. row0 + ROWS - 1`` (the tile's, or one) each walk their own page list (the per-row
    algorithm), one after the other."""
    q_ptr, stride_qn, stride_qh, stride_qd, qk_scale = query
    bt_ptr, stride_bh, stride_bn, stride_bw, ctx_ptr, stride_ch, stride_cn, width = table
    h, row0, n_rows, group, _, _ = tile
    no_scales = (cache[0], cache[1], 0, 0, 0, 0)  # never read: the step runs with FP8 off
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < D
    offs_g = tl.arange(0, GP16)
    g_ok = offs_g < group
    heads = h * group + offs_g
    for t in range(ROWS):
        n = row0 + t
        if n < n_rows:
            q = tl.load(
                q_ptr + n.to(tl.int64) * stride_qn + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=g_ok[:, None] & d_ok[None, :],
                other=0.0,
            )
            ctx = _clamp_ctx(tl.load(ctx_ptr + h * stride_ch + n * stride_cn), width, PAGE)
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
    whole_ptr,
    live_ptr,
    plain_ptr,
    lean_ptr,
    k_desc,
    v_desc,  # BLOCKS: tensor descriptors of the caches (see _block_step); else unused
    o_ptr,
    lse_ptr,
    flags_ptr,  # CHECK: [2] int32 value-check flags (see _check_tables)
    launches_ptr,
    done_ptr,  # CHECK: the launch counter and the done word (see mm3lab._valcheck.signal_done)
    page_mod,
    page_mod_limit,
    checkers,  # CHECK: the programs that run the checks (the first ones)
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
    stride_ut,  # union (and live, plain) strides (head, tile); entries contiguous
    stride_wh,
    stride_wt,  # whole-page count strides (head, tile); [U, T] contiguous
    stride_on,
    stride_oh,
    stride_ln,
    stride_lh,
    group,
    T: tl.constexpr,  # rows per tile
    GP: tl.constexpr,  # group padded to a power of two (T * GP >= 16)
    GP16: tl.constexpr,  # max(16, GP): tl.dot's M in row mode
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    PAGES: tl.constexpr,  # union pages per tile step
    ROW_BLOCK_N: tl.constexpr,  # tokens per step in row mode
    PAGE: tl.constexpr,
    MODE: tl.constexpr,  # 1: the union walk, 2: row by row, 3 / 4: the tiles that the rule sends to 1 / 2
    WALK_ROWS: tl.constexpr,  # rows per program: T, or (MODE 2 / 4 only) 1, a program per row (grid (tiles * T, Hkv))
    PLAIN_STEPS: tl.constexpr,  # skip the weights in steps whose pages every row reads whole, once
    LEAN: tl.constexpr,  # PLAIN_STEPS: walk the whole steps of the union's plain pages first, without masks
    BLOCKS: tl.constexpr,  # LEAN: read the steps of whole aligned page groups as blocks (k_desc, v_desc)
    FUSED: tl.constexpr,  # each program runs its tile's pre-pass itself (_tile_union), no pre-pass launch
    W_PAD: tl.constexpr,  # FUSED: the table width padded to a power of two
    KEY32: tl.constexpr,  # FUSED: int32 sort keys (see _tile_union)
    BY_RULE: tl.constexpr,  # FUSED, MODE 3: the pre-pass gives the tiles the rule sends to rows their counts only
    CHECK: tl.constexpr,  # the first programs run the call's value checks and signal the host
    CHECK_ROWS: tl.constexpr,  # CHECK: rows per checked chunk
    WRITE_LSE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    h = tl.program_id(1)
    k_head = k_ptr + h.to(tl.int64) * stride_kh
    v_head = v_ptr + h.to(tl.int64) * stride_vh
    if WALK_ROWS == 1:  # this program walks one row of its tile
        row0 = tl.program_id(0)
        tile = row0 // T
    else:
        tile = tl.program_id(0)
        row0 = tile * T

    tiles = (n_rows + T - 1) // T
    table = (bt_ptr, stride_bh, stride_bn, stride_bw, ctx_ptr, stride_ch, stride_cn, width)
    if CHECK:
        # The call's value checks, shared by the first programs (the first to start), which then signal
        # the host: it need not wait for the rest of the launch, which never reads outside the cache.
        pid = h * tl.num_programs(0) + tl.program_id(0)
        if pid < checkers:
            check = (flags_ptr, page_mod, page_mod_limit)
            _check_tables(table, check, pid, checkers, n_rows, tl.num_programs(1), num_pages, W_PAD, CHECK_ROWS, PAGE)
            signal_done_of(launches_ptr, done_ptr, checkers)
    if FUSED:  # this program's own pre-pass, read back below by the same program (after a barrier)
        tables = (union_ptr, count_ptr, rowpages_ptr, whole_ptr, live_ptr, plain_ptr, lean_ptr)
        # (the launch of the rule's union walks writes a row-walking tile's count and row pages only)
        count, row_pages = _tile_union(
            table, tables, tile, h, tiles, n_rows, num_pages, row_mode_factor, T, W_PAD, PAGE, KEY32, BY_RULE, PAGES
        )
        tl.debug_barrier()
    else:
        count = tl.load(count_ptr + h * tiles + tile)
        row_pages = tl.load(rowpages_ptr + h * tiles + tile)
    if MODE == 1:
        walk_union = True
        walk_rows = False
    elif MODE == 2:
        walk_union = False
        walk_rows = True
    else:  # the rule; each launch takes its own tiles (one launch with both walks compiles slower code)
        by_union = _walks_union(count, row_pages, row_mode_factor)
        if MODE == 3:
            walk_union = by_union
            walk_rows = False
        else:
            walk_union = False
            walk_rows = not by_union

    query = (q_ptr, stride_qn, stride_qh, stride_qd, qk_scale)
    cache = (k_head, v_head, num_pages, stride_kp, stride_kr, stride_vp, stride_vr)
    outs = (o_ptr, stride_on, stride_oh, lse_ptr, stride_ln, stride_lh)
    union_row = union_ptr + h.to(tl.int64) * stride_uh + tile.to(tl.int64) * stride_ut
    rows = (h, row0, n_rows, group, union_row, count)
    if walk_union:
        at_tile = h.to(tl.int64) * stride_uh + tile.to(tl.int64) * stride_ut
        page_use = (
            whole_ptr + h.to(tl.int64) * stride_wh + tile.to(tl.int64) * stride_wt,
            live_ptr + at_tile,
            plain_ptr + at_tile,
        )
        _walk_union(
            query,
            cache,
            table,
            outs,
            rows,
            page_use,
            (tl.load(lean_ptr + (h * tiles + tile) * 2), tl.load(lean_ptr + (h * tiles + tile) * 2 + 1)),
            (k_desc, v_desc),
            PLAIN_STEPS,
            LEAN,
            BLOCKS,
            T,
            GP,
            D,
            D_PAD,
            PAGES,
            PAGE,
            WRITE_LSE,
            DOT_PRECISION,
            INTERPRETED,
        )
    if walk_rows:
        _walk_rows(
            query,
            cache,
            table,
            outs,
            rows,
            WALK_ROWS,
            GP16,
            D,
            D_PAD,
            ROW_BLOCK_N,
            PAGE,
            WRITE_LSE,
            DOT_PRECISION,
            INTERPRETED,
        )


def blocks_enabled(device: torch.device) -> bool:
    """Whether ``device`` can read a block step's K and V as blocks: CUDA, compute capability 9.0 (Hopper)
    or newer. (A module-level function: the offline compile check enables them for CPU tensors.)"""
    return device.type == "cuda" and backend.capability(device) >= (9, 0)


def _block_descriptors(k_cache, v_cache, pages: int, wanted: bool):
    """The caches' tensor descriptors for the block steps (see :func:`_block_step`), or ``None`` where they
    are not wanted or cannot be used: the interpreter, a device before Hopper, a cache that is not a
    contiguous ``[pages, 16, Hkv, D]``, a head dim that is not a power of two from 16 to 256, rows of a
    size the copy engine cannot take."""
    if not wanted or backend.INTERPRETER or not blocks_enabled(k_cache.device):
        return None
    if k_cache.dim() != 4 or v_cache.dim() != 4:
        return None
    _, page, hkv, d = k_cache.shape
    usable = (
        all(c.is_contiguous() and c.data_ptr() % 16 == 0 for c in (k_cache, v_cache))
        and d == next_power_of_2(d)
        and 16 <= d <= 256  # (a copy's block is at most 256 elements along each dim)
        and (hkv * d * k_cache.element_size()) % 16 == 0
        and pages * page <= 256
    )
    if not usable:
        return None
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:  # a Triton without host-side descriptors
        return None
    block = [pages * page, d]
    return tuple(TensorDescriptor.from_tensor(c.view(-1, hkv * d), block) for c in (k_cache, v_cache))


def tiled_config(n_rows: int, hq: int, hkv: int, d: int, width: int, device: torch.device) -> dict:
    """Host heuristic for the tile: ``QUERY_VECTORS`` query vectors (``T * G``) per program.

    ``T = QUERY_VECTORS / G_pad`` rows (4 for the model's group of 16), halved while the
    pre-pass would sort more than ``PREPASS_MAX_ENTRIES`` entries per tile (``T * W_pad``: rows of
    very wide page lists), never fewer than ``tl.dot``'s 16 query vectors; ``PAGES`` union
    pages per step; ``WARPS`` warps. Measured
    on an H200 at the model's shapes (4096-token chunk at 32K, top-k 16, bf16, graph replay),
    64 query vectors, 4 pages (64 tokens) per step and 4 warps beat 128 / 256 query vectors,
    2 / 8 / 16 pages, 8 warps and 3 stages on the tile-shared and the synthetic selections
    (0.96 and 1.65 ms, against 1.08 and 2.19 ms for the best 128-vector setting). A sweep on an
    H100 (24 settings: 64 / 128 query vectors, 2 / 4 / 8 pages, 4 / 8 warps, 2 / 3 stages) kept this
    setting first on both selections (0.90 and 1.60 ms; next 0.95 ms, 128 vectors and 2 pages, and
    1.93 ms, 64 vectors and 2 pages), and loading each step's V tile with its K tile lost (0.96 and 1.68 ms).
    """
    group = hq // hkv
    gp = next_power_of_2(group)
    t = max(1, TILE_QUERY_VECTORS // gp)
    w_pad = next_power_of_2(max(width, 1))
    while t > 1 and t * w_pad > PREPASS_MAX_ENTRIES:
        t //= 2
    t = max(t, next_power_of_2(math.ceil(16 / gp)))  # tl.dot needs M >= 16
    return {"T": t, "PAGES": TILE_PAGES, "num_warps": TILE_WARPS, "num_stages": TILE_STAGES}


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
    plain_steps: bool = True,
    lean_steps: bool | None = None,
    block_steps: bool | None = None,
    prepass: str | None = None,
    check=None,
    check_launch: str | None = None,
    row_block_n: int | None = None,
    row_programs: bool | None = None,
    row_num_stages: int | None = None,
) -> None:
    """Launch the pre-pass and the tiled kernel. Arguments are already validated.

    Args:
        mode: ``"auto"`` (each tile by the rule ``union <= row_mode_factor * row_pages``, two launches),
            ``"union"`` (every tile walks its union) or ``"rows"`` (every tile walks row by row).
        tile_rows, pages_per_step, num_warps, num_stages: override :func:`tiled_config` (tests, tuning).
        row_block_n: tokens per step of a tile that walks its rows one by one (tuning).
        row_programs: the launch of the tiles that walk their rows runs one program per (row, KV head)
            (``True``) or per (tile, KV head); default :data:`ROW_PROGRAMS`.
        row_num_stages: that launch's pipeline depth (default: as ``num_stages``).
        plain_steps: skip the per-token weights in steps whose pages every row of the tile reads whole,
            once (the result is the same; tests and tuning turn it off).
        lean_steps: with ``plain_steps``, the whole steps of a tile's plain pages (its union's first) run
            first, in a loop with no masks and no weights; ``False``: every step tests whether it is plain
            (the same steps; bit-identical in the interpreter, within rounding compiled). Default: where
            block steps run (below). Gathered page by page, lean steps were the slower on an H100 (every
            tile walking its union, graph: 1.066 / 1.711 ms against 0.873 / 1.408 ms on the tile-shared
            and synthetic chunks), read as blocks the faster on the tile-shared one (0.794 ms).
        block_steps: with lean steps, a lean step of consecutive page ids reads its K and V as
            one block each (tensor descriptors; CUDA devices of compute capability 9 and up, contiguous
            caches, a head dim that is a power of two from 16 to 256); default :data:`BLOCK_STEPS`.
        prepass: ``"fused"`` (each program of the tiled kernel runs its tile's :func:`tile_unions_kernel`
            itself: one launch), ``"kernel"`` (:func:`tile_unions_kernel`, a launch of its own) or
            ``"torch"`` (:func:`tile_unions`): the same tables, so the same bits. Default: fused, compiled;
            PyTorch under the interpreter (a named fallback, ``tile-prepass-interpreter``, as its sort is
            slow there).
        check: ``None``, or ``(fused, page_mod, page_mod_limit)`` as ``sparse_attention_kernel``'s: the
            call's value checks (every ctx and every used page id) run on the device, shared by up to
            :data:`CHECKERS` programs, which set the flags and then say that they are all set, so that
            the host need not wait for the attention; needs ``W > 0``.
        check_launch: with ``check``, ``"apart"`` (the checks are a small launch of their own, queued
            just before the attention, which is compiled without them) or ``"inside"`` (the first
            programs of the attention launch run them); default :data:`CHECK_LAUNCH`, apart. The same
            flags either way. Apart is the faster on a GPU: the attention compiled with the checks
            inside ran slower in every program, not only in the checkers (numbers in the module docstring).
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
    if prepass is None:
        prepass = "fused"
        if backend.INTERPRETER:
            prepass = "torch"
            backend.fallback_taken("sparse_attention", "tile-prepass-interpreter")
    fused = prepass == "fused" and width > 0
    if check is not None and width == 0:
        raise ValueError("check: needs a table of some columns (W > 0)")
    check_launch = check_launch or CHECK_LAUNCH
    if check_launch not in ("apart", "inside"):
        raise ValueError(f"check_launch: expected 'apart' or 'inside', got {check_launch!r}")
    apart = check is not None and check_launch == "apart"
    if check is not None:
        (flags, launches, done), page_mod, page_mod_limit = check
    else:  # (never read without CHECK)
        flags = launches = done = sparse_bt
        page_mod = page_mod_limit = 1
    if fused:
        tables = _empty_tables(sparse_bt, t)  # the tiled kernel fills them, each program its tile's
    else:
        prepass_fn = {"kernel": tile_unions_kernel, "torch": tile_unions, "fused": tile_unions_kernel}[prepass]
        # union, count, row_pages, whole, live, plain, lean
        tables = prepass_fn(sparse_bt, sparse_ctx, num_pages, t, pages)
    union, whole = tables[0], tables[3]
    tiles = union.shape[1]
    d_pad = max(16, next_power_of_2(d))
    if row_block_n is None:
        row_block_n = 128 if d_pad <= 128 else 64
        if backend.INTERPRETER:
            row_block_n *= 2
    lse_arg = lse if lse is not None else out
    # block steps where asked for (and lean steps not refused); no descriptors (host work) where no tile
    # walks its union
    blocks = (BLOCK_STEPS if block_steps is None else block_steps) and lean_steps is not False
    descs = _block_descriptors(k_cache, v_cache, pages, blocks and plain_steps and mode != "rows")
    lean_steps = descs is not None if lean_steps is None else lean_steps
    # the configured pipeline depth, or (not given) the tile's default, coming down to 1 where it does not fit
    depths = (num_stages,) if num_stages else range(cfg["num_stages"], 0, -1)
    args = (
        q,
        k_cache,
        v_cache,
        sparse_bt,
        sparse_ctx,
        *tables,
        *(descs or (k_cache, v_cache)),
        out,
        lse_arg,
        flags,
        launches,
        done,
        page_mod,
        page_mod_limit,
        min(tiles * hkv, CHECKERS),
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
        whole.stride(0),
        whole.stride(1),
        out.stride(0),
        out.stride(1),
        hq if lse is None else lse.stride(0),
        1 if lse is None else lse.stride(1),
        group,
    )
    w_pad = next_power_of_2(max(width, 1))
    constexprs = dict(
        T=t,
        GP=gp,
        GP16=max(16, gp),
        D=d,
        D_PAD=d_pad,
        PAGES=pages,
        ROW_BLOCK_N=row_block_n,
        PAGE=PAGE_SIZE,
        PLAIN_STEPS=plain_steps,
        LEAN=lean_steps,
        BLOCKS=descs is not None,
        W_PAD=w_pad,
        KEY32=_key32(num_pages, t),
        CHECK_ROWS=max(1, 2048 // w_pad),
        WRITE_LSE=lse is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        INTERPRETED=backend.INTERPRETER,
        num_warps=num_warps or cfg["num_warps"],
    )
    if apart:  # the checks first, in a launch of their own (the host waits for them, not for the attention)
        check_rows = max(1, 4096 // w_pad)
        checkers = max(1, min(CHECKERS, triton.cdiv(hkv * n_rows, check_rows)))
        _tiled_check[(checkers,)](
            sparse_bt,
            sparse_ctx,
            flags,
            launches,
            done,
            page_mod,
            page_mod_limit,
            n_rows,
            hkv,
            num_pages,
            width,
            *sparse_bt.stride(),
            *sparse_ctx.stride(),
            W_PAD=w_pad,
            CHECK_ROWS=check_rows,
            PAGE=PAGE_SIZE,
            num_warps=4,
        )
    # "auto": one launch for the tiles that walk their union (it runs the fused pre-pass, and the checks inside),
    # then one for the tiles that walk their rows (it reads the pre-pass's counts and skips the others)
    # (a launch of row programs never runs the pre-pass: a tile's programs would all write its tables)
    modes = {"union": (1,), "rows": (2,), "auto": (3, 4)}[mode]
    row_programs = ROW_PROGRAMS if row_programs is None else row_programs
    row_depths = (row_num_stages,) if row_num_stages else depths
    for i, launch_mode in enumerate(modes):
        first = i == 0
        row_launch = launch_mode in (2, 4)
        per_row = row_programs and row_launch
        fitting(_tiled_fwd, "num_stages", row_depths if row_launch else depths)[(tiles * t if per_row else tiles, hkv)](
            *args,
            MODE=launch_mode,
            WALK_ROWS=1 if per_row else t,
            FUSED=fused and first and not per_row,
            BY_RULE=PREPASS_BY_RULE and launch_mode == 3,
            CHECK=check is not None and first and not apart,
            **constexprs,
        )


__all__ = [
    "CHECK_LAUNCH",
    "BLOCK_STEPS",
    "PREPASS_BY_RULE",
    "ROW_MODE_FACTOR",
    "ROW_PROGRAMS",
    "neighbour_share",
    "tile_unions",
    "tile_unions_kernel",
    "tiled_attention_kernel",
    "tiled_config",
]
