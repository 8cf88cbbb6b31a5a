"""Index-cache widget: choose a request's prefill length, the decode steps and the request; the slots
fill through the shared block table (:func:`mm3lab.viz.index_cache.show_index_fill` is the callback)."""

from __future__ import annotations

import ipywidgets as widgets

from ..constants import SPARSE_BLOCK_SIZE
from ..viz.index_cache import DEMO_BLOCK_TABLE, show_index_fill
from ._live import LiveView


def _show(prefill_len: int, decode_steps: int, request: int):
    try:
        return show_index_fill(prefill_len, decode_steps, request)
    except ValueError as err:  # more tokens than the request's blocks hold: say so, keep going
        print(f"cannot fill: {err}")
        return None


def index_cache_widget(prefill_len: int = 200, decode_steps: int = 3, request: int = 0) -> LiveView:
    """A :class:`~mm3lab.widgets._live.LiveView` with controls ``prefill``, ``decode steps``, ``request``.

    Each change reruns the fill (prefill, then decode steps) through
    :func:`mm3lab.insert_index_cache`, prints where the request's tokens went and draws
    the cache; the last figure is ``widget.result``.
    """
    capacity = len(DEMO_BLOCK_TABLE[0]) * SPARSE_BLOCK_SIZE
    controls = {
        "prefill_len": widgets.IntSlider(value=prefill_len, min=0, max=capacity - 8, description="prefill"),
        "decode_steps": widgets.IntSlider(value=decode_steps, min=0, max=8, description="decode steps"),
        "request": widgets.ToggleButtons(
            options=list(range(len(DEMO_BLOCK_TABLE))), value=request, description="request"
        ),
    }
    return LiveView(_show, **controls)


__all__ = ["index_cache_widget"]
