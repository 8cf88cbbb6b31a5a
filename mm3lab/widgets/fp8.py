"""FP8 selection widget: choose the pattern, the context length, the top-k and the key dtype drawn;
recall, mass captured and the blocks where bf16 and FP8 differ redraw
(:func:`mm3lab.viz.fp8.show_fp8_selection` is the callback)."""

from __future__ import annotations

import ipywidgets as widgets

from ..indexer.quality import KEY_DTYPES
from ..synthetic import PATTERNS
from ..viz.fp8 import WIDGET_CONTEXTS, show_fp8_selection
from ._live import LiveView


def _show(pattern: str, context: int, topk: int, dtype: str, head: int):
    return show_fp8_selection(pattern, context, topk, dtype, head)


def fp8_widget(
    pattern: str = "needle", context: int = 16384, topk: int = 16, dtype: str = "fp8", head: int = 0
) -> LiveView:
    """A :class:`~mm3lab.widgets._live.LiveView` with controls ``pattern``, ``context``, ``top-k``,
    ``dtype`` and ``head``.

    Each change prints top-k recall (FP8 against bf16), the mass captured by each, and
    the per-head count of differing blocks, and draws the chosen dtype's selection next
    to the differing blocks; the last figure is ``widget.result``.
    """
    controls = {
        "pattern": widgets.Dropdown(options=list(PATTERNS), value=pattern, description="pattern"),
        "context": widgets.Dropdown(
            options=[(f"{c // 1024}K", c) for c in WIDGET_CONTEXTS], value=context, description="context"
        ),
        "topk": widgets.IntSlider(value=topk, min=1, max=16, description="top-k"),
        "dtype": widgets.ToggleButtons(options=list(KEY_DTYPES), value=dtype, description="index keys"),
        "head": widgets.IntSlider(value=head, min=0, max=1, description="head"),
    }
    return LiveView(_show, **controls)


__all__ = ["fp8_widget"]
