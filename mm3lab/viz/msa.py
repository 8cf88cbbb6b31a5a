"""Pictures of one MSA layer step (SPEC sections 2-5) and of its cost.

* :func:`plot_block_scores`: the indexer's block scores of one query row, per KV
  head, the selected blocks coloured by rank and the forced local block marked;
* :func:`plot_sparse_table`: the row's sparse block table, one strip of page ids
  per KV head, coloured by the logical block each page belongs to, cut at ``ctx``;
* :func:`plot_attention_mass`: the dense attention weight of every token, with the
  selected blocks shaded: what the selection keeps and what it drops;
* :func:`plot_topk_sweep`: sparse-versus-dense output error and mass kept as top-k grows;
* :func:`plot_cost_model`: tokens and bytes read per query, dense versus sparse, to 1M;
* :func:`plot_msa_demo` / :func:`show_msa`: the summary the MSA widget redraws;
* text twins whose output a notebook can check: :func:`layer_summary`,
  :func:`step_summary`, :func:`sweep_table`.

Every function returns a :class:`matplotlib.figure.Figure` made without pyplot
(nothing to close). Patches a reader should notice carry a ``gid``
(``"selected"``, ``"forced"``, ``"not-selected"``, ``"page"``, ``"page-unused"``,
``"ctx"``, ``"selected-block"``) so tests can find them.
"""

from __future__ import annotations

import matplotlib.colors as mcolors
import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from ..constants import PAGE_SIZE, PAGES_PER_SPARSE_BLOCK, SPARSE_BLOCK_SIZE
from ..cost import cost_curve

SELECTED_COLOR = "#1f77b4"
FORCED_COLOR = "#ff7f0e"
OTHER_COLOR = "#c7c7c7"
UNUSED_COLOR = "#f2f2f2"
DENSE_COLOR = "#d62728"
SPARSE_COLOR = "#1f77b4"
_BLOCK_COLORS = tuple(c for i, c in enumerate(mcolors.TABLEAU_COLORS.values()) if i != 1) + (
    "#aec7e8",
    "#98df8a",
    "#c5b0d5",
    "#c49c94",
    "#f7b6d2",
    "#dbdb8d",
    "#9edae5",
)  # orange is kept for the query's own block


def _np(t):
    return t.detach().float().cpu().numpy() if hasattr(t, "detach") else np.asarray(t)


def _check_row(row: int, n: int) -> int:
    if not isinstance(row, int) or not 0 <= row < n:
        raise ValueError(f"row: expected 0 <= row < {n}, got {row!r}")
    return row


# ----------------------------------------------------------------------------
# the step, picture by picture
# ----------------------------------------------------------------------------


def plot_block_scores(step, row: int = 0, title: str | None = None) -> Figure:
    """Block scores of query row ``row`` for every KV head; the top-k blocks highlighted.

    Bars are the raw scores (``max`` of ``index_q . index_k`` over each block's visible
    tokens); a selected block is blue with its rank above it, the forced local block
    (the query's own, rank 1 whatever its score) orange, the others grey.

    Args:
        step: an :class:`mm3lab.msa.MSAStep` (``scores [H, N, M]``, ``topk_idx [H, N, K]``).
        row: the query row.
    """
    hkv, n, m = step.scores.shape
    _check_row(row, n)
    p = int(step.query_abs_pos[row])
    self_blk = p // SPARSE_BLOCK_SIZE
    fig = Figure(figsize=(10, 1.3 + 1.5 * hkv), layout="constrained")
    axes = fig.subplots(hkv, 1, sharex=True, squeeze=False)[:, 0]
    scores = _np(step.scores[:, row])
    topk = step.topk_idx[:, row].tolist()
    for h, ax in enumerate(axes):
        rank = {b: i + 1 for i, b in enumerate(topk[h]) if b >= 0}
        finite = scores[h][np.isfinite(scores[h])]
        floor = float(finite.min()) - 1 if finite.size else 0.0
        for b in range(min(m, self_blk + 1)):
            value = scores[h, b] if np.isfinite(scores[h, b]) else floor
            if b in rank:
                color, gid = (FORCED_COLOR, "forced") if b == self_blk else (SELECTED_COLOR, "selected")
            else:
                color, gid = OTHER_COLOR, "not-selected"
            ax.add_patch(Rectangle((b - 0.4, min(0, value)), 0.8, abs(value), color=color, gid=gid))
            if b in rank and (len(rank) <= 24 or rank[b] <= 3):
                ax.text(b, max(0, value), str(rank[b]), ha="center", va="bottom", fontsize=7)
        lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
        ax.set_ylim(min(0, lo) * 1.1, max(0, hi) * 1.2 + 1e-6)
        ax.set_xlim(-0.6, m - 0.4)
        ax.set_ylabel(f"head {h}\nscore")
        ax.axvline(self_blk + 0.5, color="black", lw=0.8, ls=":")
    axes[-1].set_xlabel(
        f"logical block (128 tokens each; blocks after the query's block {self_blk} are not candidates)"
    )
    fig.legend(
        handles=[
            Patch(color=FORCED_COLOR, label="forced local block"),
            Patch(color=SELECTED_COLOR, label="selected"),
            Patch(color=OTHER_COLOR, label="not selected"),
        ],
        loc="outside upper right",
        ncols=3,
        fontsize=8,
    )
    fig.suptitle(
        title or f"indexer block scores, row {row} (p = {p}), top-{len(topk[0])} numbered by rank",
        fontsize=10,
        x=0.01,
        ha="left",
    )
    return fig


def plot_sparse_table(step, block_table, block_page_stride: int, row: int = 0) -> Figure:
    """The sparse block table row of every KV head: one cell per page id, coloured by logical block.

    Pages are drawn in attention order (the full blocks in selection order, the
    causal tail block last); the ``ctx`` line marks where attention stops, so only
    the tail's last page is partial. Unused entries (zeros) are pale.

    Args:
        step: an :class:`mm3lab.msa.MSAStep`.
        block_table: ``[B, M]`` the requests' block tables (to name each page's logical block).
        block_page_stride: 8 (dense planes) or 16 (packed sides).
        row: the query row.
    """
    hkv, n, width = step.sparse_bt.shape
    _check_row(row, n)
    r = int(step.query_req_id[row])
    logical_of = {int(phys): b for b, phys in enumerate(block_table[r].tolist())}
    pages = step.sparse_bt[:, row].tolist()
    ctx = step.sparse_ctx[:, row].tolist()
    self_blk = int(step.query_abs_pos[row]) // SPARSE_BLOCK_SIZE
    fig = Figure(figsize=(10, 0.9 + 0.7 * hkv), layout="constrained")
    ax = fig.subplots()
    for h in range(hkv):
        used = -(-ctx[h] // PAGE_SIZE)
        for i, page in enumerate(pages[h]):
            y = hkv - 1 - h
            if i < used:
                block = logical_of.get(page // block_page_stride, -1)
                color = FORCED_COLOR if block == self_blk else _BLOCK_COLORS[block % len(_BLOCK_COLORS)]
                ax.add_patch(Rectangle((i, y + 0.1), 0.95, 0.8, color=color, gid="page"))
                if i % PAGES_PER_SPARSE_BLOCK == 0:
                    ax.text(i + 0.3, y + 0.5, f"b{block}", fontsize=7, va="center", color="black")
                    ax.add_patch(Rectangle((i - 0.1, y), 0.2, 1.0, color="white", zorder=3))
            else:
                ax.add_patch(Rectangle((i, y + 0.1), 0.95, 0.8, color=UNUSED_COLOR, gid="page-unused"))
        x = ctx[h] / PAGE_SIZE
        ax.add_line(_vline(x, hkv - 1 - h))
        ax.text(x + 0.2, hkv - 1 - h + 0.5, f"ctx {ctx[h]}", fontsize=8, va="center")
    ax.set_xlim(0, width + 6)
    ax.set_ylim(0, hkv)
    ax.set_yticks([hkv - 0.5 - h for h in range(hkv)], [f"head {h}" for h in range(hkv)])
    ax.set_xlabel(f"entry of sparse_bt (one page id = {PAGE_SIZE} tokens; {PAGES_PER_SPARSE_BLOCK} per block)")
    ax.set_title(
        f"sparse block table, row {row}: blocks labelled by logical id, the query's block (orange) last",
        fontsize=10,
        loc="left",
    )
    return fig


def _vline(x, y):
    from matplotlib.lines import Line2D

    return Line2D([x, x], [y, y + 1], color="black", lw=1.5, gid="ctx")


def plot_attention_mass(demo, row: int = 0, heads=None) -> Figure:
    """Dense attention weight of every visible token (mean over the query heads of each KV head).

    The selected blocks are shaded; the title of each panel gives the share of the
    weight inside them (what MSA keeps).

    Args:
        demo: an :class:`mm3lab.msa.MSADemo`.
        row: the query row; heads: KV heads to draw (default all).
    """
    step = demo.step
    hkv, n, _ = step.topk_idx.shape
    _check_row(row, n)
    heads = list(range(hkv)) if heads is None else list(heads)
    group = demo.weights.shape[1] // hkv
    p = int(step.query_abs_pos[row])
    fig = Figure(figsize=(10, 0.8 + 1.6 * len(heads)), layout="constrained")
    axes = fig.subplots(len(heads), 1, sharex=True, squeeze=False)[:, 0]
    for ax, h in zip(axes, heads, strict=False):
        blocks = {b for b in step.topk_idx[h, row].tolist() if b >= 0}
        kept = _plot_weight(ax, demo, row, h, group, blocks, p)
        ax.set_title(f"head {h}: {kept:.1%} of the attention weight is in the selected blocks", fontsize=9, loc="left")
        ax.set_ylabel("weight")
    axes[-1].set_xlabel("token position (shaded: selected blocks)")
    return fig


def _plot_weight(ax, demo, row: int, h: int, group: int, blocks, p: int) -> float:
    """KV head ``h``'s dense attention weight of query row ``row`` (the mean over its ``group`` query heads)
    at positions ``0..p``, the selected ``blocks`` shaded; returns the weight share the selection keeps."""
    heads = slice(h * group, (h + 1) * group)
    w = _np(demo.weights[row, heads].mean(0))[: p + 1]
    for b in sorted(blocks):
        ax.axvspan(
            b * SPARSE_BLOCK_SIZE,
            min((b + 1) * SPARSE_BLOCK_SIZE, p + 1),
            color=SELECTED_COLOR,
            alpha=0.15,
            lw=0,
            gid="selected-block",
        )
    ax.plot(np.arange(p + 1), w, color="black", lw=0.7)
    ax.set_xlim(0, p + 1)
    return float(demo.mass[row, heads].mean())


def plot_topk_sweep(sweeps: dict) -> Figure:
    """Error of the sparse output against dense attention, and attention mass kept, versus top-k.

    Args:
        sweeps: ``{label: rows}`` with rows from :func:`mm3lab.msa.topk_sweep` (e.g. one per pattern).
    """
    fig = Figure(figsize=(10, 3.4), layout="constrained")
    ax_err, ax_mass = fig.subplots(1, 2)
    floor = 1e-7
    # Patterns can share a curve (needle and sink often do): each gets its own marker, line style
    # and size, the earlier ones larger and below, so that a curve drawn over another stays visible.
    styles = [("o", "-", 9), ("s", "--", 7), ("^", "-.", 6), ("D", ":", 4), ("v", "-", 4)]
    for i, (label, rows) in enumerate(sweeps.items()):
        marker, line, size = styles[i % len(styles)]
        style = {
            "marker": marker,
            "linestyle": line,
            "markersize": size,
            "label": label,
            "zorder": 2 + i,
            "markerfacecolor": "none" if i % 2 == 0 else None,
        }
        k = [r["topk"] for r in rows]
        ax_err.plot(k, [max(r["error"], floor) for r in rows], **style)
        ax_mass.plot(k, [r["mass"] for r in rows], **style)
    ax_err.set_yscale("log")
    ax_err.set_xlabel("top-k (blocks per query and KV head)")
    ax_err.set_ylabel("||sparse - dense|| / ||dense||")
    ax_err.set_title("output error (all blocks selected: float rounding only)", fontsize=10, loc="left")
    ax_mass.set_xlabel("top-k")
    ax_mass.set_ylabel("share of dense attention weight")
    ax_mass.set_ylim(0, 1.05)
    ax_mass.set_title("attention mass kept by the selection", fontsize=10, loc="left")
    for ax in (ax_err, ax_mass):
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    ax_mass.legend(fontsize=8)
    return fig


def plot_cost_model(context_lens=None, batch: int = 1, **shape) -> Figure:
    """Tokens and bytes one decode step reads per layer, dense versus sparse, as the context grows.

    Args:
        context_lens: contexts to draw (default 1K .. 1M, powers of two).
        batch: query tokens per step (bytes scale with it).
        shape: :func:`mm3lab.cost.attention_cost` keywords (topk, num_kv_heads, head_dim, ...).
    """
    curve = cost_curve(context_lens, **shape)
    x = [c.context_len for c in curve]
    fig = Figure(figsize=(10, 3.6), layout="constrained")
    ax_tok, ax_bytes = fig.subplots(1, 2)
    ax_tok.plot(x, [c.dense_tokens for c in curve], color=DENSE_COLOR, marker="o", ms=3, label="dense")
    ax_tok.plot(
        x, [c.sparse_tokens for c in curve], color=SPARSE_COLOR, marker="o", ms=3, label="sparse (top-k blocks)"
    )
    ax_tok.set_ylabel("tokens attended per query and KV head")
    ax_tok.set_title("tokens read", fontsize=10, loc="left")
    mb = 1e6 / batch
    ax_bytes.plot(x, [c.dense_kv_bytes / mb for c in curve], color=DENSE_COLOR, marker="o", ms=3, label="dense K/V")
    ax_bytes.plot(
        x, [c.sparse_total_bytes / mb for c in curve], color=SPARSE_COLOR, marker="o", ms=3, label="sparse total"
    )
    ax_bytes.plot(x, [c.sparse_kv_bytes / mb for c in curve], color=SPARSE_COLOR, ls="--", label="sparse: selected K/V")
    ax_bytes.plot(x, [c.indexer_bytes / mb for c in curve], color="#2ca02c", ls=":", label="sparse: index keys")
    ax_bytes.set_ylabel(f"MB read per step (batch {batch})")
    last = curve[-1]
    ax_bytes.set_title(
        f"bytes read: {last.total_saving:.1f}x less at {last.context_len:,} tokens", fontsize=10, loc="left"
    )
    for ax in (ax_tok, ax_bytes):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context length (tokens)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return fig


# ----------------------------------------------------------------------------
# text twins and the widget's picture
# ----------------------------------------------------------------------------


def layer_summary(layer) -> str:
    """Shapes and lengths of a :class:`mm3lab.msa.SyntheticLayer` (deterministic text)."""
    n, hq, d = layer.q.shape
    return "\n".join(
        [
            f"pattern {layer.pattern}, layout {layer.cache.layout} (block_page_stride {layer.cache.block_page_stride})",
            (
                f"requests {layer.block_table.shape[0]}, seq_lens {layer.seq_lens.tolist()}, "
                f"decode_query_len {layer.decode_query_len}"
            ),
            (
                f"q [{n}, {hq}, {d}]  KV heads {layer.cache.num_kv_heads} (group {hq // layer.cache.num_kv_heads})  "
                f"index dim {layer.index_cache.shape[2]}"
            ),
            f"cache blocks {layer.cache.num_blocks}, block table row 0: {layer.block_table[0].tolist()[:12]}"
            + (" ..." if layer.block_table.shape[1] > 12 else ""),
        ]
    )


def step_summary(demo, row: int = 0) -> str:
    """What one row of a demo selected and kept, as rounded text."""
    step = demo.step
    hkv = step.topk_idx.shape[0]
    group = demo.weights.shape[1] // hkv
    lines = [f"row {row}: p = {int(step.query_abs_pos[row])}, top-{demo.topk}"]
    for h in range(hkv):
        blocks = [b for b in step.topk_idx[h, row].tolist() if b >= 0]
        kept = float(demo.mass[row, h * group : (h + 1) * group].mean())
        lines.append(f"  head {h}: blocks {blocks}  ctx {int(step.sparse_ctx[h, row])}  mass kept {kept:.3f}")
    lines.append(f"output error vs dense attention: {demo.error:.3f}")
    return "\n".join(lines)


def sweep_table(sweeps: dict) -> str:
    """``{label: rows}`` of :func:`mm3lab.msa.topk_sweep` as a table rounded to 2 decimals (machine-independent)."""
    lines = [f"{'pattern':<11} {'topk':>4} {'tokens':>7} {'error':>7} {'mass':>6}"]
    for label, rows in sweeps.items():
        for r in rows:
            lines.append(f"{label:<11} {r['topk']:>4} {r['tokens']:>7.0f} {r['error']:>7.2f} {r['mass']:>6.2f}")
    return "\n".join(lines)


def plot_msa_demo(demo, row: int = 0) -> Figure:
    """Scores and selection of head 0, then the attention weight of head 0 with the selected blocks shaded."""
    step = demo.step
    hkv, n, m = step.scores.shape
    _check_row(row, n)
    p = int(step.query_abs_pos[row])
    self_blk = p // SPARSE_BLOCK_SIZE
    group = demo.weights.shape[1] // hkv
    fig = Figure(figsize=(10, 4.2), layout="constrained")
    ax_s, ax_w = fig.subplots(2, 1)
    scores = _np(step.scores[0, row])
    chosen = {b for b in step.topk_idx[0, row].tolist() if b >= 0}
    for b in range(min(m, self_blk + 1)):
        value = scores[b] if np.isfinite(scores[b]) else 0.0
        if b in chosen:
            color, gid = (FORCED_COLOR, "forced") if b == self_blk else (SELECTED_COLOR, "selected")
        else:
            color, gid = OTHER_COLOR, "not-selected"
        ax_s.add_patch(Rectangle((b - 0.4, min(0, value)), 0.8, abs(value), color=color, gid=gid))
    finite = scores[np.isfinite(scores)]
    ax_s.set_xlim(-0.6, self_blk + 0.6)
    ax_s.set_ylim(min(0.0, float(finite.min())) * 1.1, max(0.0, float(finite.max())) * 1.1 + 1e-6)
    ax_s.set_xlabel("logical block")
    ax_s.set_ylabel("score")
    layer = demo.layer
    ax_s.set_title(
        f"{layer.pattern}, {layer.cache.layout} layout, context {p + 1}, top-{demo.topk}: head 0 block scores "
        f"(orange: forced local block)",
        fontsize=10,
        loc="left",
    )
    kept = _plot_weight(ax_w, demo, row, 0, group, chosen, p)
    ax_w.set_xlabel("token position (shaded: selected blocks)")
    ax_w.set_ylabel("dense weight")
    ax_w.set_title(
        f"head 0: {kept:.1%} of the attention weight kept; output error vs dense {demo.error:.3f}",
        fontsize=10,
        loc="left",
    )
    return fig


DEMO_LAYER = {
    "batch": 1,
    "num_kv_heads": 2,
    "group_size": 4,
    "head_dim": 64,
    "index_dim": 32,
    "attention_temperature": 1.0,
}
""":func:`mm3lab.msa.synthetic_layer` options of the demos: small shapes (a few seconds per redraw on
the CPU interpreter) and attention logits as large as the index scores (``attention_temperature``)."""


def show_msa(
    topk: int = 4, context_len: int = 2048, layout: str = "packed", pattern: str = "needle", seed: int = 0
) -> Figure:
    """Build a synthetic layer, run one MSA decode step and the dense baseline; print and draw the result.

    The widget's callback (:func:`mm3lab.widgets.msa.msa_widget`).
    """
    from .._checks import check_int
    from ..synthetic import synthetic_layer
    from .msa_demo import run_msa_demo

    check_int("topk", topk, minimum=1)
    check_int("context_len", context_len, minimum=1)
    layer = synthetic_layer(context_len, layout=layout, pattern=pattern, seed=seed, **DEMO_LAYER)
    demo = run_msa_demo(layer, topk)
    print(step_summary(demo))
    return plot_msa_demo(demo)


__all__ = [
    "DEMO_LAYER",
    "layer_summary",
    "plot_attention_mass",
    "plot_block_scores",
    "plot_cost_model",
    "plot_msa_demo",
    "plot_sparse_table",
    "plot_topk_sweep",
    "show_msa",
    "step_summary",
    "sweep_table",
]
