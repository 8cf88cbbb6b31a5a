"""Layout widget: choose the layout, a block and the number of KV heads; the memory map
and the page-id table redraw (:func:`mm3lab.viz.layout.show_layout` is the callback)."""

from __future__ import annotations

import ipywidgets as widgets

from ..constants import NUM_KV_HEADS
from ..layout.views import LAYOUTS
from ..viz.layout import show_layout
from ._live import LiveView


def _show(layout: str, block: int, num_kv_heads: int, num_blocks: int):
    fig = show_layout(layout, block, num_kv_heads, num_blocks)
    return fig


def layout_widget(
    num_blocks: int = 4, layout: str = "packed", block: int = 0, num_kv_heads: int = NUM_KV_HEADS
) -> LiveView:
    """A :class:`~mm3lab.widgets._live.LiveView` (``ipywidgets.interactive``, redrawn in place) with
    controls ``layout``, ``block``, ``num_kv_heads``.

    Each change prints the block's page-id table and draws its memory map; the
    last figure is ``widget.result``.
    """
    controls = {
        "layout": widgets.ToggleButtons(options=list(LAYOUTS), value=layout, description="layout"),
        "block": widgets.IntSlider(value=block, min=0, max=num_blocks - 1, description="block"),
        "num_kv_heads": widgets.IntSlider(value=num_kv_heads, min=1, max=8, description="KV heads"),
        "num_blocks": widgets.fixed(num_blocks),
    }
    return LiveView(_show, **controls)


__all__ = ["layout_widget"]
