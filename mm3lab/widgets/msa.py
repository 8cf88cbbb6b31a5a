"""MSA widget: choose top-k, context length, layout and pattern; one MSA decode step reruns and
redraws (:func:`mm3lab.viz.msa.show_msa` is the callback)."""

from __future__ import annotations

import ipywidgets as widgets

from ..layout.views import LAYOUTS
from ..synthetic import PATTERNS
from ..viz.msa import show_msa
from ._live import LiveView


def _show(topk: int, context_len: int, layout: str, pattern: str):
    fig = show_msa(topk, context_len, layout, pattern)
    return fig


def msa_widget(
    topk: int = 4, context_len: int = 2048, layout: str = "packed", pattern: str = "needle", max_context: int = 8192
) -> LiveView:
    """A :class:`~mm3lab.widgets._live.LiveView` (``ipywidgets.interactive``, redrawn in place) with
    controls ``topk``, ``context_len``, ``layout``, ``pattern``.

    Each change builds the synthetic layer, runs :func:`mm3lab.msa_decode` and the dense
    baseline, prints what was selected and kept, and draws it; the last figure is
    ``widget.result``. Updates run when a slider is released.
    """
    controls = {
        "topk": widgets.IntSlider(value=topk, min=1, max=32, description="top-k", continuous_update=False),
        "context_len": widgets.IntSlider(
            value=context_len, min=128, max=max_context, step=128, description="context", continuous_update=False
        ),
        "layout": widgets.ToggleButtons(options=list(LAYOUTS), value=layout, description="layout"),
        "pattern": widgets.Dropdown(options=list(PATTERNS), value=pattern, description="pattern"),
    }
    return LiveView(_show, **controls)


__all__ = ["msa_widget"]
