"""Pictures of what FP8 index keys do to the block selection (SPEC section 9).

Numbers come from :mod:`mm3lab.indexer.quality` (bf16 and FP8 keys scored in float64,
so the same on any CPU and thread count):

* :func:`plot_quality`: top-k set recall (FP8 against bf16) and attention mass captured
  as top-k varies, one panel per pattern, one line per context length;
* :func:`recall_text`: the same numbers as a table (rounded);
* :func:`plot_differing_blocks`: query rows x blocks, where the two selections agree
  and where they differ (bf16 only, FP8 only);
* :func:`differing_text`: how many (row, block) pairs differ, per head;
* :func:`show_fp8_selection`: prints the numbers of one (pattern, context, top-k) and
  draws the chosen dtype's selection next to the differing blocks; the widget's
  callback (:mod:`mm3lab.widgets.fp8`).

Every function returns a :class:`matplotlib.figure.Figure` made without pyplot. Artists
carry a ``gid`` (``"recall"``, ``"mass-bf16"``, ``"mass-fp8"``, ``"differ"``,
``"selected"``) so tests can find them.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from ..indexer.quality import KEY_DTYPES, FP8Comparison, QualityRow, compare, format_table, set_recall

DIFFER_COLORS = ("#f4f4f4", "#9ecae1", "#d62728", "#2ca02c")
"""Colours of :meth:`FP8Comparison.differing`'s codes: neither, both, bf16 only, FP8 only."""
DIFFER_LABELS = ("neither", "both", "bf16 only", "FP8 only")
WIDGET_CONTEXTS = (4096, 8192, 16384, 32768)
"""Context lengths the widget offers."""
WIDGET_ROWS = 32
"""Query rows scored per (pattern, context)."""


def _patterns(table: Sequence[QualityRow]) -> list[str]:
    return list(dict.fromkeys(r.pattern for r in table))


def _contexts(table: Sequence[QualityRow]) -> list[int]:
    return sorted({r.context for r in table})


def plot_quality(table: Sequence[QualityRow]) -> Figure:
    """Recall (top row) and mass captured (bottom row, bf16 solid, FP8 dashed) against top-k."""
    if not table:
        raise ValueError("table: empty; build it with mm3lab.indexer.quality.quality_table")
    patterns, contexts = _patterns(table), _contexts(table)
    fig = Figure(figsize=(3.2 * len(patterns), 5.6), layout="constrained")
    axes = fig.subplots(2, len(patterns), squeeze=False, sharex=True)
    colors = [f"C{i}" for i in range(len(contexts))]
    for col, pattern in enumerate(patterns):
        top, bottom = axes[0, col], axes[1, col]
        for color, context in zip(colors, contexts, strict=False):
            rows = sorted((r for r in table if r.pattern == pattern and r.context == context), key=lambda r: r.topk)
            ks = [r.topk for r in rows]
            label = f"{context // 1024}K"
            top.plot(ks, [r.recall for r in rows], "o-", color=color, label=label, gid="recall")
            bottom.plot(ks, [r.mass_bf16 for r in rows], "-", color=color, label=f"{label} bf16", gid="mass-bf16")
            bottom.plot(ks, [r.mass_fp8 for r in rows], "x--", color=color, label=f"{label} FP8", gid="mass-fp8")
        top.set_title(pattern)
        top.set_ylim(min(0.9, min(r.recall for r in table) - 0.01), 1.005)
        bottom.set_ylim(0, 1)
        bottom.set_xscale("log", base=2)
        topks = sorted({r.topk for r in table})
        bottom.set_xticks(topks, [str(k) for k in topks])
        bottom.set_xlabel("top-k (blocks)")
        if col == 0:
            top.set_ylabel("top-k recall, FP8 vs bf16")
            bottom.set_ylabel("attention mass captured")
    axes[0, -1].legend(title="context", fontsize=8)
    axes[1, -1].legend(fontsize=7, ncol=2)
    return fig


def recall_text(table: Sequence[QualityRow], topk: int | None = None) -> str:
    """The quality table (all top-k, or one), rounded to 3 decimals."""
    rows = [r for r in table if topk is None or r.topk == topk]
    if not rows:
        raise ValueError(f"topk: {topk} is not a top-k of this table")
    return format_table(rows)


def differing_text(cmp: FP8Comparison, topk: int | None = None) -> str:
    """Per head: (row, block) pairs selected by both, by bf16 only, by FP8 only, at ``topk``."""
    topk = cmp.topk if topk is None else topk
    codes = cmp.differing(topk)
    lines = [f"{cmp.pattern}, {cmp.context} tokens, top-{topk}, {codes.shape[1]} query rows"]
    lines.append("head  both  bf16 only  FP8 only  recall")
    rec = set_recall(cmp.topk_idx["fp8"][..., :topk], cmp.topk_idx["bf16"][..., :topk]).mean(-1)
    for h in range(codes.shape[0]):
        c = codes[h]
        lines.append(
            f"{h:4d}  {int((c == 1).sum()):4d}  {int((c == 2).sum()):9d}  {int((c == 3).sum()):8d}"
            f"  {float(rec[h]):6.3f}"
        )
    return "\n".join(lines)


def _draw_differing(ax, cmp: FP8Comparison, topk: int, head: int) -> None:
    codes = cmp.differing(topk)[head].numpy()
    ax.imshow(
        codes,
        aspect="auto",
        interpolation="nearest",
        cmap=ListedColormap(DIFFER_COLORS),
        vmin=-0.5,
        vmax=3.5,
        gid="differ",
    )
    ax.set_xlabel("logical block")
    ax.set_ylabel("query row")
    n_diff = int((codes >= 2).sum())
    ax.set_title(f"{cmp.pattern} {cmp.context // 1024}K, top-{topk}, head {head}: {n_diff} differ")
    ax.legend(
        handles=[Patch(color=c, label=lbl) for c, lbl in zip(DIFFER_COLORS[1:], DIFFER_LABELS[1:], strict=False)],
        loc="lower left",
        fontsize=7,
    )


def plot_differing_blocks(cmp: FP8Comparison, topk: int | None = None, head: int = 0) -> Figure:
    """Query rows x blocks of one head: selected by both, by bf16 only (red), by FP8 only (green)."""
    topk = cmp.topk if topk is None else topk
    fig = Figure(figsize=(6.4, 4.0), layout="constrained")
    _draw_differing(fig.subplots(), cmp, topk, head)
    return fig


@functools.lru_cache(maxsize=16)
def cached_compare(pattern: str, context: int, rows: int = WIDGET_ROWS, seed: int = 0) -> FP8Comparison:
    """:func:`mm3lab.indexer.quality.compare` at top-16, kept for redraws (smaller top-k are prefixes)."""
    return compare(pattern, int(context), 16, rows, seed)


def show_fp8_selection(
    pattern: str = "needle", context: int = 16384, topk: int = 16, dtype: str = "fp8", head: int = 0
) -> Figure:
    """Print recall and mass captured of one (pattern, context, top-k); draw ``dtype``'s selection and the
    blocks where bf16 and FP8 differ. The plain-function twin of :func:`mm3lab.widgets.fp8.fp8_widget`."""
    if dtype not in KEY_DTYPES:
        raise ValueError(f"dtype: expected one of {', '.join(KEY_DTYPES)}, got {dtype!r}")
    if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= 16:
        raise ValueError(f"topk: expected an int in [1, 16], got {topk!r}")
    cmp = cached_compare(pattern, int(context))
    print(f"top-{topk} recall (FP8 vs bf16): {cmp.recall(topk):.3f}")
    print(f"mass captured: bf16 {cmp.mass('bf16', topk):.3f}, FP8 {cmp.mass('fp8', topk):.3f}")
    print(differing_text(cmp, topk))
    # fixed margins (inches; what constrained layout finds for these two panels): the widget redraws
    # this figure on every move, and a layout engine would measure it in an extra pass each time
    width, height, bottom, top = 11.0, 4.0, 0.48, 0.26
    fig = Figure(figsize=(width, height))
    left, right = (
        fig.add_axes((x0 / width, bottom / height, 4.93 / width, (height - bottom - top) / height))
        for x0 in (0.51, 6.03)
    )
    mask = cmp.selection(dtype, topk).selected_mask()[head].numpy().astype(float)
    left.imshow(
        mask,
        aspect="auto",
        interpolation="nearest",
        cmap=ListedColormap(["#f4f4f4", "#d62728"]),
        vmin=0,
        vmax=1,
        gid="selected",
    )
    left.set_title(f"{dtype} index keys: top-{topk} blocks, head {head}")
    left.set_xlabel("logical block")
    left.set_ylabel("query row")
    _draw_differing(right, cmp, topk, head)
    return fig


def differing_counts(cmp: FP8Comparison, topk: int | None = None) -> np.ndarray:
    """``[4]`` counts of the codes (neither, both, bf16 only, FP8 only) over heads, rows and blocks."""
    codes = cmp.differing(cmp.topk if topk is None else topk)
    return np.bincount(codes.flatten().numpy().astype(np.int64), minlength=4)


__all__ = [
    "DIFFER_COLORS",
    "DIFFER_LABELS",
    "WIDGET_CONTEXTS",
    "cached_compare",
    "differing_counts",
    "differing_text",
    "plot_differing_blocks",
    "plot_quality",
    "recall_text",
    "show_fp8_selection",
]
