"""Causal-tail widget: move the query, edit its top-k row, change decode_query_len and the
layout stride; the row's pages, ``ctx`` and attended-token strip redraw
(:func:`mm3lab.viz.causal_tail.show_causal_tail` is the callback)."""

from __future__ import annotations

from collections.abc import Sequence

import ipywidgets as widgets

from ..block_table.checks import BLOCK_PAGE_STRIDES
from ..constants import SPARSE_BLOCK_SIZE
from ..viz.causal_tail import DEMO_BLOCK_TABLE_ROW, show_causal_tail
from ._live import LiveView


def _show(position: int, topk: str, decode_query_len: int, block_page_stride: int, block_table_row):
    try:
        fig = show_causal_tail(position, topk, decode_query_len, block_page_stride, block_table_row)
    except ValueError as err:  # a typo in the top-k box, an id past the table: say so, keep going
        print(f"cannot build this row: {err}")
        return None
    return fig


def causal_tail_widget(
    position: int = 300,
    topk: str = "2 0 1 -1",
    decode_query_len: int = 1,
    block_page_stride: int = 8,
    block_table_row: Sequence[int] = DEMO_BLOCK_TABLE_ROW,
) -> LiveView:
    """A :class:`~mm3lab.widgets._live.LiveView` (``ipywidgets.interactive``, redrawn in place) with
    controls ``position``, ``topk``, ``decode_query_len``, ``stride``.

    ``position`` is the last query's ``p``; ``topk`` a text box of block ids
    (``-1`` = padding). Each change prints the rows' explanation and draws them;
    the last figure is ``widget.result`` (``None`` when the input was rejected,
    with the reason printed).
    """
    table = tuple(int(b) for b in block_table_row)
    controls = {
        "position": widgets.IntSlider(
            value=position,
            min=0,
            max=len(table) * SPARSE_BLOCK_SIZE - 1,
            description="position p",
            continuous_update=False,
        ),
        "topk": widgets.Text(value=topk, description="top-k row", continuous_update=False),
        "decode_query_len": widgets.IntSlider(value=decode_query_len, min=1, max=4, description="dql"),
        "block_page_stride": widgets.ToggleButtons(
            options=list(BLOCK_PAGE_STRIDES), value=block_page_stride, description="stride"
        ),
        "block_table_row": widgets.fixed(table),
    }
    return LiveView(_show, **controls)


__all__ = ["causal_tail_widget"]
