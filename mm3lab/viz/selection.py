"""Pictures of block selection (SPEC section 2, steps 2-3).

* :func:`plot_score_heatmap`: raw block scores, query rows x blocks, with the blocks the
  indexer chose marked, the forced blocks outlined and the planted block (if any) shown;
* :func:`plot_pattern_gallery`: the heatmaps of several patterns side by side;
* :func:`plot_query_scores`: one query row as bars (chosen blocks coloured, forced ones
  hatched, rank on top) and :func:`selection_text`, the same row as a table;
* :func:`plot_forcing_effect` / :func:`forcing_text`: one query with and without
  init/local forcing: which blocks forcing brings in and which it pushes out;
* :func:`plot_mass_curve`: the share of a full softmax's attention mass the chosen
  blocks hold at each top-k, next to the best any selector could do;
* :func:`agreement_text`: whether two selections (kernel and reference) pick the same
  blocks, and whether their scores agree within a stated tolerance;
* :func:`show_selection`: prints the table and returns heatmap + row, the widget's callback.

Every function returns a :class:`matplotlib.figure.Figure` made without pyplot (nothing
to close; Jupyter shows a returned figure once). Scores and selections come from
:mod:`mm3lab.indexer.analysis`, which runs the real entry points. Artists a reader
should notice carry a ``gid`` (``"selected"``, ``"forced"``, ``"needle"``,
``"query-row"``, ``"bar-selected"``, ``"bar-other"``, ``"added"``, ``"dropped"``,
``"indexer"``, ``"oracle"``) so tests can find them.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import matplotlib
import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from ..constants import SPARSE_BLOCK_SIZE
from ..indexer.analysis import MassCurve, Selection, attention_mass_captured, default_positions, select_for_sequence

SELECTED_COLOR = "#d62728"
FORCED_COLOR = "#ff7f0e"
OTHER_COLOR = "#c7c7c7"
NEEDLE_COLOR = "white"
_CMAP = matplotlib.colormaps["viridis"].with_extremes(bad="#f4f4f4")
DEMO_SEQ_LEN = 2048
"""Tokens of the demo sequences (16 blocks)."""


def _row_of(selection: Selection, position: int) -> int:
    pos = selection.positions.tolist()
    if position not in pos:
        raise ValueError(f"position: {position} is not a query row of this selection (rows at {pos[:4]}...)")
    return pos.index(position)


def _finite_scores(scores: np.ndarray) -> np.ndarray:
    """Scores as drawn: non-candidates (-inf) and NaN masked (drawn in the "bad" colour)."""
    return np.ma.masked_invalid(scores)


# --- the heatmap ------------------------------------------------------------------------------


def _draw_heatmap(
    ax, selection: Selection, head: int, needle_block: int | None, title: str | None, query_position: int | None = None
) -> None:
    scores = selection.scores[head].numpy()  # [T, nb]
    t, nb = scores.shape
    image = ax.imshow(
        _finite_scores(scores),
        aspect="auto",
        interpolation="nearest",
        cmap=_CMAP,
        extent=(-0.5, nb - 0.5, t - 0.5, -0.5),
    )
    chosen = selection.selected_mask()[head].numpy()
    rows, blocks = np.nonzero(chosen)
    ax.scatter(blocks, rows, s=9, c=SELECTED_COLOR, marker="o", linewidths=0, gid="selected", zorder=3)
    forced = selection.forced_mask().numpy()
    f_rows, f_blocks = np.nonzero(forced)
    ax.scatter(
        f_blocks,
        f_rows,
        s=30,
        facecolors="none",
        edgecolors=FORCED_COLOR,
        marker="s",
        linewidths=0.8,
        gid="forced",
        zorder=2,
    )
    if needle_block is not None:
        ax.axvline(needle_block, color=NEEDLE_COLOR, linestyle="--", linewidth=1.0, gid="needle")
    if query_position is not None:
        ax.axhline(_row_of(selection, query_position), color="black", linewidth=1.2, gid="query-row")
    ticks = np.linspace(0, t - 1, num=min(t, 5)).round().astype(int)
    ax.set_yticks(ticks, [str(int(selection.positions[i])) for i in ticks])
    ax.set_xticks(range(0, nb, max(1, nb // 8)))
    ax.set_xlabel("block")
    ax.set_ylabel("query position")
    ax.set_title(title or f"head {head}: top-{selection.topk}", fontsize=10)
    return image


def plot_score_heatmap(
    selection: Selection,
    head: int = 0,
    *,
    needle_block: int | None = None,
    title: str | None = None,
    query_position: int | None = None,
) -> Figure:
    """Raw block scores of every query row (rows) and block (columns) for one index head.

    Red dots: the blocks the indexer chose. Orange squares: forced blocks (init and the
    local block, which every query gets). Grey: blocks after the query's own block (not
    candidates). A dashed white line marks ``needle_block``; a black line ``query_position``.
    """
    fig = Figure(figsize=(6.0, 4.2), layout="constrained")
    ax = fig.add_subplot()
    image = _draw_heatmap(ax, selection, head, needle_block, title, query_position)
    fig.colorbar(image, ax=ax, label="block score (max index_q . index_k)")
    ax.legend(
        handles=[
            Patch(color=SELECTED_COLOR, label="selected"),
            Patch(facecolor="none", edgecolor=FORCED_COLOR, label="forced"),
        ],
        loc="lower left",
        fontsize=8,
        framealpha=0.8,
    )
    return fig


def plot_pattern_gallery(items: Sequence[tuple[object, Selection]], head: int = 0) -> Figure:
    """``items``: ``(sequence, selection)`` pairs; one heatmap each, side by side."""
    fig = Figure(figsize=(3.4 * len(items), 3.6), layout="constrained")
    axes = fig.subplots(1, len(items), squeeze=False)[0]
    for ax, (seq, selection) in zip(axes, items, strict=False):
        _draw_heatmap(ax, selection, head, seq.needle_block, f"{seq.pattern} (head {head}, top-{selection.topk})")
        ax.tick_params(labelsize=10)
        ax.xaxis.label.set_fontsize(11)
        ax.yaxis.label.set_fontsize(11)
        ax.title.set_fontsize(11)
    return fig


# --- one query row ----------------------------------------------------------------------------


def selection_text(selection: Selection, position: int, head: int = 0) -> str:
    """One query row as a table: every candidate block, its raw and forced score, its rank."""
    row = _row_of(selection, position)
    valid = position // SPARSE_BLOCK_SIZE + 1
    ids = [b for b in selection.topk_idx[head, row].tolist() if b >= 0]
    rank = {b: i + 1 for i, b in enumerate(ids)}
    forced = selection.forced_mask()[row].tolist()
    lines = [
        (
            f"query at p={position} (block {position // SPARSE_BLOCK_SIZE}), head {head}: {valid} candidate "
            f"blocks, top-{selection.topk} = {ids}"
        ),
        "block  raw score  ranked as    rank",
    ]
    for b in range(valid):
        raw = float(selection.scores[head, row, b])
        ranked = float(selection.forced[head, row, b])
        shown = (
            "forced 1e30"
            if ranked == float(np.float32(1e30))
            else ("forced 1e29" if ranked == float(np.float32(1e29)) else f"{ranked:9.2f}")
        )
        mark = str(rank[b]) if b in rank else "-"
        note = " (forced)" if forced[b] else ""
        lines.append(f"{b:5d}  {raw:9.2f}  {shown:>11s}  {mark:>4s}{note}")
    return "\n".join(lines)


def _draw_row(ax, selection: Selection, row: int, head: int, title: str) -> None:
    position = int(selection.positions[row])
    valid = position // SPARSE_BLOCK_SIZE + 1
    raw = selection.scores[head, row, :valid].numpy().astype(float)
    finite = raw[np.isfinite(raw)]
    floor = min(0.0, finite.min() - 1.0) if finite.size else 0.0  # bars start at 0 unless scores go below
    heights = np.where(np.isfinite(raw), raw, floor)
    ids = [b for b in selection.topk_idx[head, row].tolist() if b >= 0]
    forced = selection.forced_mask()[row].numpy()
    for b in range(valid):
        picked = b in ids
        ax.bar(
            b,
            heights[b] - floor,
            bottom=floor,
            color=SELECTED_COLOR if picked else OTHER_COLOR,
            hatch="//" if forced[b] else None,
            edgecolor=FORCED_COLOR if forced[b] else "none",
            gid="bar-selected" if picked else "bar-other",
        )
        if picked:
            ax.text(b, heights[b], str(ids.index(b) + 1), ha="center", va="bottom", fontsize=8)
    ax.set_xlim(-0.6, max(valid, 1) - 0.4)
    ax.set_xlabel("block (candidates up to the query's own)")
    ax.set_ylabel("raw block score")
    ax.set_title(title, fontsize=10)


def plot_query_scores(selection: Selection, position: int, head: int = 0) -> Figure:
    """One query row: a bar per candidate block, chosen ones red with their rank, forced ones hatched."""
    fig = Figure(figsize=(6.0, 3.0), layout="constrained")
    ax = fig.add_subplot()
    _draw_row(
        ax,
        selection,
        _row_of(selection, position),
        head,
        f"p={position}, head {head}: top-{selection.topk} (numbers: rank)",
    )
    ax.legend(
        handles=[
            Patch(color=SELECTED_COLOR, label="selected"),
            Patch(color=OTHER_COLOR, label="not selected"),
            Patch(facecolor="white", edgecolor=FORCED_COLOR, hatch="//", label="forced"),
        ],
        fontsize=8,
        loc="best",
    )
    return fig


# --- forcing ----------------------------------------------------------------------------------


def _with_and_without(seq, position: int, topk: int, init_blocks: int, local_blocks: int):
    plain = select_for_sequence(seq, topk, 0, 0, positions=[position])
    forced = select_for_sequence(seq, topk, init_blocks, local_blocks, positions=[position])
    return plain, forced


def forcing_text(seq, position: int, topk: int = 4, init_blocks: int = 1, local_blocks: int = 1, head: int = 0) -> str:
    """What init/local forcing changes for one query: the chosen blocks without and with it."""
    plain, forced = _with_and_without(seq, position, topk, init_blocks, local_blocks)
    a = [b for b in plain.topk_idx[head, 0].tolist() if b >= 0]
    b = [x for x in forced.topk_idx[head, 0].tolist() if x >= 0]
    added = [x for x in b if x not in a]
    dropped = [x for x in a if x not in b]
    return "\n".join(
        [
            f"{seq.pattern}, query at p={position}, head {head}, top-{topk}",
            f"  {'no forcing (init 0, local 0):':34s} {a}",
            f"  {f'forcing (init {init_blocks}, local {local_blocks}):':34s} {b}",
            f"  brought in by forcing: {added or 'nothing'}; pushed out: {dropped or 'nothing'}",
        ]
    )


def plot_forcing_effect(
    seq, position: int, topk: int = 4, init_blocks: int = 1, local_blocks: int = 1, head: int = 0
) -> Figure:
    """One query's scores twice: chosen without forcing (left) and with ``init_blocks`` /
    ``local_blocks`` forcing (right). Blocks forcing brings in are outlined green, blocks it
    pushes out black."""
    plain, forced = _with_and_without(seq, position, topk, init_blocks, local_blocks)
    fig = Figure(figsize=(10.0, 3.0), layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    _draw_row(axes[0], plain, 0, head, f"no forcing: top-{topk}")
    _draw_row(axes[1], forced, 0, head, f"init_blocks={init_blocks}, local_blocks={local_blocks}: top-{topk}")
    a = {b for b in plain.topk_idx[head, 0].tolist() if b >= 0}
    b = {x for x in forced.topk_idx[head, 0].tolist() if x >= 0}
    top = axes[1].get_ylim()[1]
    bottom = axes[1].get_ylim()[0]
    for blk in sorted(b - a):
        axes[1].add_patch(
            Rectangle(
                (blk - 0.45, bottom), 0.9, top - bottom, fill=False, edgecolor="#2ca02c", linewidth=2, gid="added"
            )
        )
    for blk in sorted(a - b):
        axes[1].add_patch(
            Rectangle(
                (blk - 0.45, bottom),
                0.9,
                top - bottom,
                fill=False,
                edgecolor="black",
                linewidth=1.5,
                linestyle="--",
                gid="dropped",
            )
        )
    fig.suptitle(f"{seq.pattern}: query at p={position}, head {head}", fontsize=10)
    return fig


# --- attention mass ---------------------------------------------------------------------------


def plot_mass_curve(curves: MassCurve | Sequence[MassCurve]) -> Figure:
    """Mean share of the full softmax's attention mass on the selected blocks, per top-k.

    Solid: the indexer's blocks. Dashed: the ``topk`` blocks holding the most attention
    (an upper bound for any selector of that many blocks).
    """
    curves = [curves] if isinstance(curves, MassCurve) else list(curves)
    fig = Figure(figsize=(6.0, 3.6), layout="constrained")
    ax = fig.add_subplot()
    for i, c in enumerate(curves):
        color = f"C{i}"
        ax.plot(c.topks, c.indexer, marker="o", color=color, label=f"{c.pattern}: indexer", gid="indexer")
        ax.plot(
            c.topks, c.oracle, linestyle="--", color=color, alpha=0.7, label=f"{c.pattern}: best possible", gid="oracle"
        )
    ax.set_xscale("log", base=2)
    ax.set_xticks(curves[0].topks, [str(k) for k in curves[0].topks])
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("top-k (blocks selected)")
    ax.set_ylabel("attention mass captured")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2, loc="lower right")
    return fig


def mass_text(curves: MassCurve | Sequence[MassCurve]) -> str:
    """The curves as a table, rounded to 2 decimals (machine-independent: the values differ by ~1e-5 across CPUs)."""
    curves = [curves] if isinstance(curves, MassCurve) else list(curves)
    head = "pattern   " + "".join(f"  k={k:<5d}" for k in curves[0].topks)
    lines = [head]
    for c in curves:
        lines.append(f"{c.pattern:9s} " + "".join(f"  {x:7.2f}" for x in c.indexer) + "   (indexer)")
        lines.append(f"{'':9s} " + "".join(f"  {x:7.2f}" for x in c.oracle) + "   (best possible)")
    return "\n".join(lines)


SCORE_TOLERANCE = 1e-4
"""Absolute difference allowed between two computations of the same fp32 block score. The
scores of the demo sequences are below 100, where fp32 spacing is under 1e-5; the order of
the additions (CPU, BLAS, thread count, GPU) moves a score by a few of those."""


def agreement_text(selection: Selection, reference: Selection, atol: float = SCORE_TOLERANCE) -> str:
    """Two lines: the top-k ids compared exactly, the scores against ``atol``.

    A printed difference would depend on the machine; the comparison does not. Scores that
    are ``-inf`` in both (masked blocks) agree.
    """
    same_ids = bool(np.array_equal(np.asarray(selection.topk_idx), np.asarray(reference.topk_idx)))
    a = np.asarray(selection.scores, dtype=np.float64)
    b = np.asarray(reference.scores, dtype=np.float64)
    close = a.shape == b.shape
    if close:
        with np.errstate(invalid="ignore"):  # -inf - -inf is NaN: both masked, handled beside it
            close = bool(np.all((np.isneginf(a) & np.isneginf(b)) | (np.abs(a - b) <= atol)))
    return f"kernel == reference (top-k ids): {same_ids}\nscores agree with the reference within {atol:g}: {close}"


# --- the widget's callback --------------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def demo_sequence(pattern: str, seq_len: int = DEMO_SEQ_LEN, seed: int = 0):
    """The demo sequence of a pattern (cached: the widget redraws often)."""
    from ..synthetic import make_sequence

    return make_sequence(pattern, seq_len, seed=seed)


def show_selection(
    pattern: str = "needle",
    topk: int = 4,
    init_blocks: int = 0,
    local_blocks: int = 1,
    query_position: int = DEMO_SEQ_LEN - 1,
    head: int = 0,
    seq_len: int = DEMO_SEQ_LEN,
    seed: int = 0,
    rows: int = 32,
) -> Figure:
    """Print one query row's selection and its captured attention mass; return heatmap + row.

    The heatmap's rows are ``rows`` positions spread over the sequence plus ``query_position``.
    """
    from .._checks import check_int

    check_int("topk", topk, minimum=1)
    check_int("init_blocks", init_blocks, minimum=0)
    check_int("local_blocks", local_blocks, minimum=0)
    check_int("query_position", query_position, minimum=0)
    check_int("head", head, minimum=0)
    seq = demo_sequence(pattern, seq_len, seed)
    if not 0 <= query_position < seq.seq_len:
        raise ValueError(f"query_position: expected 0 <= query_position < {seq.seq_len}, got {query_position}")
    positions = sorted(set(default_positions(seq.seq_len, rows).tolist()) | {int(query_position)})
    selection = select_for_sequence(seq, topk, init_blocks, local_blocks, positions)
    mass = attention_mass_captured(seq, selection)  # [Hq, T]
    row = positions.index(int(query_position))
    group = seq.num_q_heads // seq.num_kv_heads
    print(selection_text(selection, int(query_position), head))
    print(
        f"attention mass on the selected blocks (query heads {head * group}..{head * group + group - 1}): "
        f"{float(mass[head * group : (head + 1) * group, row].mean()):.3f}; all rows and heads: "
        f"{float(mass.mean()):.3f}"
    )
    fig = Figure(figsize=(11.0, 3.8), layout="constrained")
    axes = fig.subplots(1, 2, width_ratios=[1.0, 1.3])
    _draw_heatmap(axes[0], selection, head, seq.needle_block, f"{pattern}: scores and top-{topk}", int(query_position))
    _draw_row(axes[1], selection, row, head, f"p={query_position}, head {head} (numbers: rank)")
    return fig


__all__ = [
    "DEMO_SEQ_LEN",
    "demo_sequence",
    "forcing_text",
    "mass_text",
    "plot_forcing_effect",
    "plot_mass_curve",
    "plot_pattern_gallery",
    "plot_query_scores",
    "plot_score_heatmap",
    "selection_text",
    "show_selection",
]
