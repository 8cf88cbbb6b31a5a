"""Block-selection widget: choose the pattern, top-k, init/local blocks and the query position;
the score heatmap and the query's row redraw (:func:`mm3lab.viz.selection.show_selection` is the
callback)."""

from __future__ import annotations

import ipywidgets as widgets

from ..constants import SPARSE_BLOCK_SIZE
from ..synthetic import PATTERNS
from ..viz.selection import DEMO_SEQ_LEN, show_selection
from ._live import LiveView


def _show(pattern: str, topk: int, init_blocks: int, local_blocks: int, query_position: int, head: int, seq_len: int):
    fig = show_selection(pattern, topk, init_blocks, local_blocks, query_position, head, seq_len)
    return fig


def selection_widget(
    pattern: str = "needle",
    topk: int = 4,
    init_blocks: int = 0,
    local_blocks: int = 1,
    query_position: int | None = None,
    head: int = 0,
    seq_len: int = DEMO_SEQ_LEN,
    num_kv_heads: int = 4,
) -> LiveView:
    """A :class:`~mm3lab.widgets._live.LiveView` (``ipywidgets.interactive``, redrawn in place) with
    controls ``pattern``, ``topk``, ``init_blocks``,
    ``local_blocks``, ``query_position`` and ``head``.

    Each change prints the query row's table and captured attention mass and draws the
    heatmap and the row; the last figure is ``widget.result``.
    """
    blocks = -(-seq_len // SPARSE_BLOCK_SIZE)
    query_position = seq_len - 1 if query_position is None else query_position
    controls = {
        "pattern": widgets.Dropdown(options=list(PATTERNS), value=pattern, description="pattern"),
        "topk": widgets.IntSlider(value=topk, min=1, max=blocks, description="top-k"),
        "init_blocks": widgets.IntSlider(value=init_blocks, min=0, max=4, description="init blocks"),
        "local_blocks": widgets.IntSlider(value=local_blocks, min=0, max=4, description="local blocks"),
        "query_position": widgets.IntSlider(
            value=query_position, min=0, max=seq_len - 1, step=1, description="query p", continuous_update=False
        ),
        "head": widgets.IntSlider(value=head, min=0, max=num_kv_heads - 1, description="head"),
        "seq_len": widgets.fixed(seq_len),
    }
    return LiveView(_show, **controls)


__all__ = ["selection_widget"]
