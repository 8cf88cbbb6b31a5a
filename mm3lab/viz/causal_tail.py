"""Pictures of the sparse block table's causal tail (SPEC section 3).

* :func:`plot_causal_tail`: the query's own block as its 8 pages of 16 tokens,
  the tokens the query may see (``<= p``) filled, the rest not;
* :func:`plot_sparse_row`: one row of page ids (full blocks in selection order,
  the tail last, zeros after), the ``ctx`` boundary, and the attended-token
  strip over the sequence;
* :func:`plot_spec_decode_rows`: the ``decode_query_len`` rows of one request
  side by side (their positions differ by one token, their tails may not);
* :func:`plot_prefill_chunk`: consecutive tokens of a prefill chunk, one row each:
  the mask they attend, a staircase inside the shared tail block;
* :func:`tail_first_reads`: what the kernel would read if the tail came first;
* :func:`show_causal_tail`: prints :func:`mm3lab.explain.explain_sparse_block_table`
  and returns the matching figure (the widget's callback).

Every function returns a :class:`matplotlib.figure.Figure` made without pyplot
(nothing to close; Jupyter shows a returned figure once). Rows and ``ctx`` come
from :mod:`mm3lab.block_table.reference`, the code the kernel is tested against.
Patches a reader should notice carry a ``gid`` (``"page-full"``, ``"page-tail"``,
``"page-unused"``, ``"ctx"``, ``"token-attended"``, ``"token-tail"``,
``"token-skipped"``, ``"token-future"``, ``"query"``, ``"visible"``, ``"hidden"``)
so tests can find them.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from ..block_table.checks import BLOCK_PAGE_STRIDES
from ..block_table.reference import attended_tokens, decode_positions, plan_sparse_row, sparse_block_table_row
from ..constants import PAGE_SIZE, PAGES_PER_SPARSE_BLOCK, SPARSE_BLOCK_SIZE

DEMO_BLOCK_TABLE_ROW = (7, 2, 9, 4, 11, 0, 5, 3)
"""Physical blocks of a demo request's 8 logical blocks (1024 tokens), used when none is given."""

TAIL_COLOR = "#ff7f0e"
SKIPPED_COLOR = "#d4d4d4"
UNUSED_COLOR = "#f2f2f2"
FUTURE_COLOR = "white"
_FULL_COLORS = ("#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f")
_MAX_LABELLED_CELLS = 48
_ZOOM_MARGIN = 12


def full_color(block: int) -> str:
    """The colour of logical block ``block`` when it is attended as a full block."""
    return _FULL_COLORS[block % len(_FULL_COLORS)]


def parse_topk(text: str | Sequence[int]) -> list[int]:
    """``"3, 0 2 -1"`` -> ``[3, 0, 2, -1]`` (a list of ints passes through)."""
    if not isinstance(text, str):
        return [int(b) for b in text]
    parts = [t for t in re.split(r"[,\s\[\]]+", text.strip()) if t]
    try:
        values = [int(t) for t in parts]
    except ValueError:
        raise ValueError(f"topk: expected integers separated by spaces or commas, got {text!r}") from None
    if not values:
        raise ValueError("topk: expected at least one block id")
    return values


def _check_stride(block_page_stride: int) -> None:
    if block_page_stride not in BLOCK_PAGE_STRIDES:
        raise ValueError(f"block_page_stride: expected 8 or 16, got {block_page_stride!r}")


def _table(block_table_row) -> list[int]:
    return list(DEMO_BLOCK_TABLE_ROW if block_table_row is None else (int(b) for b in block_table_row))


def _check_fits(p: int, table: list[int], name: str = "p") -> None:
    if p >= len(table) * SPARSE_BLOCK_SIZE:
        raise ValueError(
            f"{name}: position {p} needs block {p // SPARSE_BLOCK_SIZE}, but the block table row "
            f"has {len(table)} blocks ({len(table) * SPARSE_BLOCK_SIZE} tokens)"
        )


def _rows_of(topk, count: int) -> list[list[int]]:
    if isinstance(topk, str) or not topk or not isinstance(topk[0], (list, tuple)):
        return [parse_topk(topk)] * count
    rows = [parse_topk(r) for r in topk]
    if len(rows) != count:
        raise ValueError(f"topk: expected one selection or {count}, got {len(rows)}")
    return rows


# ----------------------------------------------------------------------------
# the query's own block
# ----------------------------------------------------------------------------


def plot_causal_tail(p: int) -> Figure:
    """The query's own block ``self_blk = p // 128`` as 8 pages of 16 tokens.

    Tokens ``<= p`` (the first ``p % 128 + 1``) are the ones the query may see:
    whole pages, then one partial page. Those are exactly the tokens the tail
    block contributes to ``ctx``.
    """
    if p < 0:
        raise ValueError(f"p: a padded row (p = {p}) has no block; expected p >= 0")
    sb, off = divmod(p, SPARSE_BLOCK_SIZE)
    fig = Figure(figsize=(8.0, 3.4), layout="constrained")
    ax = fig.add_subplot()
    for t in range(SPARSE_BLOCK_SIZE):
        page, row = divmod(t, PAGE_SIZE)
        seen = t <= off
        ax.add_patch(
            Rectangle(
                (row, page),
                1,
                1,
                facecolor=TAIL_COLOR if seen else FUTURE_COLOR,
                edgecolor="white" if seen else "#bbbbbb",
                hatch=None if seen else "///",
                linewidth=0.6,
                gid="visible" if seen else "hidden",
            )
        )
    q_page, q_row = divmod(off, PAGE_SIZE)
    ax.add_patch(Rectangle((q_row, q_page), 1, 1, fill=False, edgecolor="black", linewidth=2.0, gid="query"))
    ax.text(q_row + 0.5, q_page + 0.5, "q", ha="center", va="center", fontsize=8, fontweight="bold")
    ax.set_xlim(0, PAGE_SIZE)
    ax.set_ylim(PAGES_PER_SPARSE_BLOCK, 0)
    ax.set_xticks(np.arange(PAGE_SIZE) + 0.5, [str(r) for r in range(PAGE_SIZE)], fontsize=7)
    ax.set_yticks(
        np.arange(PAGES_PER_SPARSE_BLOCK) + 0.5,
        [f"page {j}: {sb * SPARSE_BLOCK_SIZE + j * PAGE_SIZE}.." for j in range(PAGES_PER_SPARSE_BLOCK)],
        fontsize=7,
    )
    ax.set_xlabel("row within the page (token % 16)")
    ax.set_aspect("equal")
    full_pages, partial = divmod(off + 1, PAGE_SIZE)
    detail = f"{full_pages} whole pages" + (f" + {partial} tokens of page {full_pages}" if partial else "")
    ax.set_title(
        f"p = {p}: self_blk = {sb}, p % 128 = {off}; the query sees {off + 1} of 128 tokens ({detail})", fontsize=9
    )
    ax.legend(
        handles=[
            Patch(facecolor=TAIL_COLOR, label="visible (<= p)"),
            Patch(facecolor="white", hatch="///", edgecolor="#bbbbbb", label="after p (masked)"),
        ],
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        fontsize=7,
        frameon=False,
    )
    return fig


# ----------------------------------------------------------------------------
# one row: pages and tokens
# ----------------------------------------------------------------------------


def _draw_pages(ax, y: float, blk: list[int], table: list[int], p: int, stride: int, labels: bool) -> int:
    """One row of K * 8 page cells at height ``y``; returns ``ctx``."""
    plan = plan_sparse_row(blk, p, table_width=len(table))
    row, ctx = sparse_block_table_row(blk, table, p, stride)
    for i, page_id in enumerate(row):
        slot = i // PAGES_PER_SPARSE_BLOCK
        if slot < len(plan.blocks):
            b = plan.blocks[slot]
            tail = b == plan.tail
            color, gid = (TAIL_COLOR, "page-tail") if tail else (full_color(b), "page-full")
        else:
            color, gid = UNUSED_COLOR, "page-unused"
        ax.add_patch(Rectangle((i, y), 1, 0.8, facecolor=color, edgecolor="white", linewidth=0.8, gid=gid))
        if labels:
            ax.text(
                i + 0.5,
                y + 0.4,
                str(page_id),
                ha="center",
                va="center",
                fontsize=8 if page_id < 100 else 7,
                color="black" if gid != "page-full" else "white",
                in_layout=False,  # inside its cell: constrained layout need not measure it on every redraw
            )
    for slot, b in enumerate(plan.blocks):
        name = f"tail: block {b}" if b == plan.tail else f"block {b}"
        name = f"{name} -> phys {table[b]}" if labels else ("tail " if b == plan.tail else "") + str(b)
        ax.text(
            (slot + 0.5) * PAGES_PER_SPARSE_BLOCK,
            y - 0.12,
            name,
            ha="center",
            va="bottom",
            fontsize=7,
            gid="block-label",
        )
    x = ctx / PAGE_SIZE  # ctx in pages: the attention kernel reads tokens [0, ctx) of this row
    ax.plot([x, x], [y, y + 0.95], color="black", linewidth=2, gid="ctx")  # below the block labels, not across
    return ctx


def _token_segments(blk: list[int], p: int, table_width: int, span_blocks: int):
    """``(start, stop, kind, block)`` over tokens ``[0, span_blocks * 128)``."""
    plan = plan_sparse_row(blk, p, table_width=table_width)
    segments = []
    for b in range(span_blocks):
        lo, hi = b * SPARSE_BLOCK_SIZE, (b + 1) * SPARSE_BLOCK_SIZE
        cut = min(max(p + 1, lo), hi)  # tokens [lo, cut) are causal for p
        if b in plan.blocks:
            kind = "token-tail" if b == plan.tail else "token-attended"
        else:
            kind = "token-skipped"
        if cut > lo:
            segments.append((lo, cut, kind, b))
        if hi > cut:
            segments.append((cut, hi, "token-future", b))
    return segments


def _draw_tokens(ax, y: float, blk: list[int], p: int, table_width: int, span_blocks: int, height: float = 0.8):
    for lo, hi, kind, b in _token_segments(blk, p, table_width, span_blocks):
        style = {
            "token-attended": {"facecolor": full_color(b)},
            "token-tail": {"facecolor": TAIL_COLOR},
            "token-skipped": {"facecolor": SKIPPED_COLOR},
            "token-future": {"facecolor": FUTURE_COLOR, "hatch": "///", "edgecolor": "#bbbbbb"},
        }[kind]
        style.setdefault("edgecolor", "white")
        ax.add_patch(Rectangle((lo, y), hi - lo, height, linewidth=0.8, gid=kind, **style))
    if p >= 0:
        ax.plot([p + 0.5], [y + height / 2], marker="v", color="black", markersize=6, gid="query")


def _token_axis(ax, span_blocks: int) -> None:
    ax.set_xlim(0, span_blocks * SPARSE_BLOCK_SIZE)
    ticks = [b * SPARSE_BLOCK_SIZE for b in range(span_blocks + 1)]
    ax.set_xticks(ticks, [str(t) for t in ticks], fontsize=7)
    for t in ticks:
        ax.axvline(t, color="black", linewidth=0.5)
    ax.set_xlabel("token position (block boundaries every 128)", fontsize=8)


_TOKEN_LEGEND = [
    Patch(facecolor=_FULL_COLORS[0], label="attended, full block"),
    Patch(facecolor=_FULL_COLORS[1], label="attended, another full block"),
    Patch(facecolor=TAIL_COLOR, label="attended, tail block"),
    Patch(facecolor=SKIPPED_COLOR, label="not selected"),
    Patch(facecolor="white", hatch="///", edgecolor="#bbbbbb", label="after p"),
]


def plot_sparse_row(
    topk, block_table_row: Sequence[int] | None = None, p: int = 0, block_page_stride: int = PAGES_PER_SPARSE_BLOCK
) -> Figure:
    """One sparse block table row: its ``K * 8`` page ids and the tokens it attends.

    Top: the row as the attention kernel sees it, one cell per page id, full blocks
    in selection order, the tail block last, zeros after; the black bar is ``ctx``
    (in pages: the kernel reads tokens ``[0, ctx)`` of the row, so only the last
    page can be partial). Bottom: the same tokens on the sequence, ``p`` marked.

    Args:
        topk: ``[K]`` selected logical blocks (a list, or text such as ``"1 0 -1"``).
        block_table_row: ``[M]`` physical block of each logical block (default
            :data:`DEMO_BLOCK_TABLE_ROW`).
        p: the query's absolute position.
        block_page_stride: 8 (dense planes) or 16 (packed sides).
    """
    blk = parse_topk(topk)
    table = _table(block_table_row)
    _check_stride(block_page_stride)
    _check_fits(p, table)
    plan = plan_sparse_row(blk, p, table_width=len(table))
    width = len(blk) * PAGES_PER_SPARSE_BLOCK
    fig = Figure(figsize=(10.0, 3.6), layout="constrained")
    ax_row, ax_tok = fig.subplots(2, 1, gridspec_kw={"height_ratios": [1.0, 0.9]})
    ctx = _draw_pages(ax_row, 0.1, blk, table, p, block_page_stride, labels=width <= _MAX_LABELLED_CELLS)
    ax_row.set_xlim(0, width)
    ax_row.set_ylim(1.2, -0.5)
    ax_row.set_yticks([])
    ax_row.set_xticks(range(0, width + 1, PAGES_PER_SPARSE_BLOCK))
    pages, rest = divmod(ctx, PAGE_SIZE)
    ax_row.set_xlabel(
        f"entry of the sparse_bt row (width topk * 8 = {width}); black bar: ctx = {ctx} tokens "
        f"= {pages} whole pages" + (f" + {rest} tokens of the next" if rest else ""),
        fontsize=8,
    )
    where = "padded row" if plan.self_blk is None else f"self_blk = {plan.self_blk}"
    ax_row.set_title(
        f"topk = {blk}, p = {p} ({where}), block_page_stride = {block_page_stride}: ctx = {ctx}", fontsize=9
    )
    span = max([max(p, 0) // SPARSE_BLOCK_SIZE + 1] + [b + 1 for b in blk if 0 <= b < len(table)])
    _draw_tokens(ax_tok, 0.0, blk, p, len(table), span)
    _token_axis(ax_tok, span)
    ax_tok.set_ylim(-0.1, 0.9)
    ax_tok.set_yticks([])
    ax_tok.legend(
        handles=_TOKEN_LEGEND, loc="upper center", bbox_to_anchor=(0.5, -0.45), ncol=5, fontsize=7, frameon=False
    )
    return fig


# ----------------------------------------------------------------------------
# several rows: speculative decode, prefill
# ----------------------------------------------------------------------------


def plot_spec_decode_rows(
    topk,
    block_table_row: Sequence[int] | None = None,
    seq_len: int = 129,
    decode_query_len: int = 3,
    block_page_stride: int = PAGES_PER_SPARSE_BLOCK,
) -> Figure:
    """The ``decode_query_len`` rows of one request, side by side.

    Row ``i`` is at ``p = seq_len - dql + i``. Left: each row's page ids and ``ctx``
    bar; right: each row's tokens around its tail. Rows on both sides of a block
    boundary have different tails; rows with ``p < 0`` are padded (all zeros).

    Args:
        topk: ``[K]`` shared by every row (list or text), or ``[dql][K]``.
        block_table_row: ``[M]`` (default :data:`DEMO_BLOCK_TABLE_ROW`).
        seq_len: the request's tokens, its decode queries included.
        decode_query_len: rows of the request.
        block_page_stride: 8 or 16.
    """
    table = _table(block_table_row)
    _check_stride(block_page_stride)
    if decode_query_len < 1:
        raise ValueError(f"decode_query_len: expected >= 1, got {decode_query_len}")
    _check_fits(seq_len - 1, table, "seq_len")
    rows = _rows_of(topk, decode_query_len)
    positions = decode_positions(seq_len, decode_query_len)
    width = len(rows[0]) * PAGES_PER_SPARSE_BLOCK
    fig = Figure(figsize=(11.0, 1.8 + 0.9 * decode_query_len), layout="constrained")
    ax_row, ax_tok = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.25, 1.0]})
    labels = width <= _MAX_LABELLED_CELLS
    live = [q for q in positions if q >= 0]
    hi_blk = max(live, default=0) // SPARSE_BLOCK_SIZE + 1
    ctxs = []
    for i, (blk, q) in enumerate(zip(rows, positions, strict=False)):
        y = 1.3 * i
        ctxs.append(_draw_pages(ax_row, y + 0.3, blk, table, q, block_page_stride, labels=labels))
        _draw_tokens(ax_tok, y + 0.3, blk, q, len(table), hi_blk)
    ax_row.set_xlim(0, width)
    ax_row.set_ylim(1.3 * decode_query_len, -0.2)
    ax_row.set_yticks(
        [1.3 * i + 0.7 for i in range(decode_query_len)],
        [f"row {i}: p = {q}\nctx = {c}" for i, (q, c) in enumerate(zip(positions, ctxs, strict=False))],
        fontsize=7,
    )
    ax_row.set_xticks(range(0, width + 1, PAGES_PER_SPARSE_BLOCK))
    ax_row.set_xlabel("sparse_bt entries; black bar: ctx", fontsize=8)
    shared = len(set(map(tuple, rows))) == 1
    ax_row.set_title(
        f"seq_len = {seq_len}, decode_query_len = {decode_query_len}: "
        + (f"every row selects {rows[0]}" if shared else "one selection per row"),
        fontsize=9,
    )
    # Zoom on the rows' positions: one token is wide enough to see, block boundaries drawn.
    lo = max(min(live, default=0) - _ZOOM_MARGIN, 0)
    hi = max(live, default=0) + _ZOOM_MARGIN
    for b in range(-(-lo // SPARSE_BLOCK_SIZE), hi // SPARSE_BLOCK_SIZE + 1):  # boundaries inside the view
        ax_tok.axvline(b * SPARSE_BLOCK_SIZE, color="black", linewidth=1.2)
        ax_tok.text(b * SPARSE_BLOCK_SIZE + 0.5, -0.15, f"block {b}", fontsize=7, va="bottom")
    ax_tok.set_xlim(lo, hi)
    ax_tok.set_ylim(1.3 * decode_query_len, -0.5)
    ax_tok.set_yticks([])
    ax_tok.set_xlabel("token position (zoomed on the rows' positions)", fontsize=8)
    ax_tok.set_title("tokens around each row's p (triangle): tail orange, full blocks coloured", fontsize=9)
    return fig


def prefill_mask(topk, block_table_row: Sequence[int] | None, start: int, length: int) -> np.ndarray:
    """``[length, span]`` codes of the tokens each chunk row attends: 0 after p, 1 not selected,
    2 full block, 3 tail block (``span`` = tokens up to the chunk's last block)."""
    table = _table(block_table_row)
    rows = _rows_of(topk, length)
    span = (start + length - 1) // SPARSE_BLOCK_SIZE + 1
    code = {"token-future": 0, "token-skipped": 1, "token-attended": 2, "token-tail": 3}
    mask = np.zeros((length, span * SPARSE_BLOCK_SIZE), dtype=np.int8)
    for i, blk in enumerate(rows):
        for lo, hi, kind, _ in _token_segments(blk, start + i, len(table), span):
            mask[i, lo:hi] = code[kind]
    return mask


def plot_prefill_chunk(
    topk, block_table_row: Sequence[int] | None = None, start: int = 120, length: int = 16
) -> Figure:
    """Consecutive prefill tokens ``p = start .. start + length - 1``, one row each.

    Left: the tokens each row attends (its mask: full blocks whole, the tail up to
    ``p``), a staircase inside the tail block, which consecutive tokens share until
    ``p`` crosses a block boundary. Right: each row's ``ctx``. Neither depends on
    ``block_page_stride`` (8 or 16 changes page ids only), so the function takes none.

    Args:
        topk: ``[K]`` shared by every row (list or text), or ``[length][K]``.
        block_table_row: ``[M]`` (default :data:`DEMO_BLOCK_TABLE_ROW`).
        start, length: the chunk's first position and number of tokens.
    """
    table = _table(block_table_row)
    if start < 0 or length < 1:
        raise ValueError(f"start, length: expected start >= 0 and length >= 1, got {start}, {length}")
    _check_fits(start + length - 1, table, "start + length - 1")
    rows = _rows_of(topk, length)
    mask = prefill_mask(rows, table, start, length)
    ctxs = [plan_sparse_row(blk, start + i, table_width=len(table)).ctx for i, blk in enumerate(rows)]
    fig = Figure(figsize=(11.0, 1.6 + 0.16 * length), layout="constrained")
    ax_mask, ax_ctx = fig.subplots(1, 2, gridspec_kw={"width_ratios": [3.0, 1.0]})
    cmap = ListedColormap([FUTURE_COLOR, SKIPPED_COLOR, _FULL_COLORS[0], TAIL_COLOR])
    ax_mask.imshow(
        mask,
        cmap=cmap,
        vmin=0,
        vmax=3,
        aspect="auto",
        interpolation="nearest",
        extent=(0, mask.shape[1], start + length - 0.5, start - 0.5),
    )
    span = mask.shape[1] // SPARSE_BLOCK_SIZE
    _token_axis(ax_mask, span)
    ax_mask.set_ylabel("query position p", fontsize=8)
    shared = len(set(map(tuple, rows))) == 1
    ax_mask.set_title(
        f"prefill chunk p = {start}..{start + length - 1}, "
        + (f"every row selects {rows[0]}" if shared else "one selection per row")
        + ": tokens attended",
        fontsize=9,
    )
    ax_mask.legend(
        handles=_TOKEN_LEGEND, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=4, fontsize=7, frameon=False
    )
    ps = np.arange(start, start + length)
    ax_ctx.plot(ctxs, ps, marker="o", markersize=3, color="black", gid="ctx")
    ax_ctx.set_ylim(start + length - 0.5, start - 0.5)
    ax_ctx.set_xlabel("ctx (tokens attended)", fontsize=8)
    ax_ctx.set_title("ctx per row", fontsize=9)
    ax_ctx.grid(True, linewidth=0.3)
    return fig


def tail_first_reads(topk, p: int) -> dict:
    """What a page list with the tail block *first* would make the attention kernel read.

    The kernel reads the first ``ctx`` tokens of the row's pages. With the tail last
    those are exactly the attended tokens. With the tail first, the tail's tokens
    after ``p`` land in the middle of the list and are read, while the same number
    of the last full block's tokens fall past ``ctx`` and are missed.

    Returns:
        ``{"ctx", "future_read", "missed"}``: token counts (0 and 0 with the tail last).
    """
    blk = parse_topk(topk)
    plan = plan_sparse_row(blk, p)
    if plan.tail is None:
        return {"ctx": plan.ctx, "future_read": 0, "missed": 0}
    order = (plan.tail,) + plan.full
    listed = [b * SPARSE_BLOCK_SIZE + t for b in order for t in range(SPARSE_BLOCK_SIZE)][: plan.ctx]
    causal = set(attended_tokens(blk, p))
    future_read = sum(1 for t in listed if t > p)
    missed = len(causal - set(listed))
    return {"ctx": plan.ctx, "future_read": future_read, "missed": missed}


# ----------------------------------------------------------------------------
# the widget's callback
# ----------------------------------------------------------------------------


def show_causal_tail(
    position: int = 300,
    topk="2 0 1 -1",
    decode_query_len: int = 1,
    block_page_stride: int = PAGES_PER_SPARSE_BLOCK,
    block_table_row: Sequence[int] | None = None,
) -> Figure:
    """Print the rows' text explanation and return their picture (the causal-tail widget's callback).

    ``position`` is the last query's ``p`` (so ``seq_len = position + 1``); with
    ``decode_query_len > 1`` the request's earlier rows sit just before it and
    share the selection ``topk``.
    """
    from .._checks import check_int
    from ..explain import explain_sparse_block_table

    check_int("position", position, minimum=0)
    blk = parse_topk(topk)
    table = _table(block_table_row)
    print(explain_sparse_block_table(blk, table, position + 1, block_page_stride, decode_query_len))
    if decode_query_len == 1:
        return plot_sparse_row(blk, table, position, block_page_stride)
    return plot_spec_decode_rows(blk, table, position + 1, decode_query_len, block_page_stride)


__all__ = [
    "DEMO_BLOCK_TABLE_ROW",
    "full_color",
    "parse_topk",
    "plot_causal_tail",
    "plot_prefill_chunk",
    "plot_sparse_row",
    "plot_spec_decode_rows",
    "prefill_mask",
    "show_causal_tail",
    "tail_first_reads",
]
