"""The widgets' redraw machinery (mm3lab.widgets._live) and the index-cache widget."""

from __future__ import annotations

import matplotlib
import pytest

matplotlib.use("Agg")

from matplotlib.figure import Figure

from mm3lab import backend
from mm3lab.viz import index_cache as vi

ipywidgets = pytest.importorskip("ipywidgets")


def test_live_view_caches_settles_and_shows_a_picture():
    from mm3lab.widgets._live import LABEL_WIDTH, LiveView

    calls = []

    def draw(n: int):
        calls.append(backend.get_backend())
        print(f"n = {n}")
        fig = Figure(figsize=(2, 1))
        fig.add_subplot().plot([0, n])
        return fig

    w = LiveView(draw, n=ipywidgets.IntSlider(value=1, min=0, max=5, description="n"))
    assert isinstance(w, ipywidgets.interactive)
    slider = w.children[0]
    assert slider.continuous_update is False and slider.style.description_width == LABEL_WIDTH
    first = w.result
    assert isinstance(first, Figure) and w.text == "n = 1\n"
    slider.value = 2
    assert w.result is not first and len(calls) == 2
    slider.value = 1
    assert w.result is first and len(calls) == 2  # from the cache, not recomputed
    if backend.get_backend() == "interpret":
        assert set(calls) == {"torch"}  # redraws use the reference while the kernels are interpreted
    bundle = w._repr_mimebundle_()
    assert bundle["image/png"] and "application/vnd.jupyter.widget-view+json" in bundle


def test_live_view_reports_an_error_and_keeps_working():
    from mm3lab.widgets._live import LiveView

    def draw(n: int):
        if n == 3:
            raise ValueError("three is not allowed")
        return Figure()

    w = LiveView(draw, n=ipywidgets.IntSlider(value=1, min=0, max=5))
    w.children[0].value = 3
    assert w.result is None and "ValueError: three is not allowed" in w.text
    w.children[0].value = 4
    assert isinstance(w.result, Figure)


def test_index_fill_and_its_widget(capsys):
    fig = vi.show_index_fill(130, 2, request=0)
    out = capsys.readouterr().out
    assert "request 0: prefill 130 tokens, then 2 decode steps -> 132 tokens" in out
    assert "prefill    130 slot(s): 384-511 (block 3), 0-1 (block 0)" in out  # logical 0 -> 3, logical 1 -> 0
    assert isinstance(fig, Figure)
    with pytest.raises(ValueError, match="at most 384"):
        vi.show_index_fill(380, 8)
    from mm3lab.widgets.index_cache import index_cache_widget

    w = index_cache_widget()
    controls = {c.description: c for c in w.children if getattr(c, "description", "")}
    assert set(controls) == {"prefill", "decode steps", "request"}
    controls["request"].value = 1
    assert "request 1: prefill 200" in w.text
    controls["prefill"].value = 376
    controls["decode steps"].value = 8
    assert isinstance(w.result, Figure) and controls["prefill"].max == 376  # every setting fits the blocks
