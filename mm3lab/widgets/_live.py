"""The one widget class every notebook view uses: an ``ipywidgets.interactive`` that redraws in place.

``ipywidgets.interactive`` clears its output and then runs the callback, so the old
figure vanishes while the new one is computed and the page jumps. :class:`LiveView`
computes first (the callback's printed text is captured), then swaps the output in
one step: ``clear_output(wait=True)``, the figure, the text below it. It also

* keeps the last few results, so moving a control back to a value seen before
  redraws at once;
* runs the callback on the PyTorch reference backend (``mm3lab.reference``) while
  the session's backend is Triton's CPU interpreter: the interpreter takes seconds
  per redraw, the reference a fraction of one, and the tests check the kernels
  against the reference (integers exactly, floats within a stated tolerance). The
  notebooks' checked cells still run the kernels;
* sets ``continuous_update=False`` on every slider and text box (a redraw costs more
  than 0.2 s), so a drag runs one redraw, on release;
* gives every control the same label width, so the rows line up;
* holds garbage collection off during a redraw (a full collection walks the whole kernel
  heap), so that it runs after the new figure has been sent;
* adds the current figure as ``image/png`` to the widget's display data: a
  notebook opened untrusted or without a kernel shows that picture instead of the
  widget's text form.
"""

from __future__ import annotations

import base64
import contextlib
import gc
import io
from collections import OrderedDict
from collections.abc import Callable

import ipywidgets as widgets
from IPython.display import Image, clear_output, display
from matplotlib.figure import Figure

from .. import backend

LABEL_WIDTH = "7.5em"
CACHE_SIZE = 32


def control_style() -> dict:
    """The ``style`` every control gets: one label width, so labels and controls line up."""
    return {"description_width": LABEL_WIDTH}


def _settle(control: widgets.Widget) -> widgets.Widget:
    if hasattr(control, "continuous_update"):
        control.continuous_update = False
    if (
        isinstance(control, widgets.DOMWidget)
        and hasattr(control, "style")
        and hasattr(control.style, "description_width")
    ):
        control.style.description_width = LABEL_WIDTH
    if isinstance(control, widgets.ToggleButtons):
        control.style.button_width = "auto"
    return control


def figure_png(fig: Figure) -> bytes:
    """``fig`` as PNG bytes, at the figure's size (its constrained layout already fits the page).

    zlib level 1: about 10% more bytes than the default level 6, at half its encoding time.
    """
    buf = io.BytesIO()
    fig.savefig(buf, format="png", pil_kwargs={"compress_level": 1})
    return buf.getvalue()


@contextlib.contextmanager
def redraw_backend():
    """The backend a redraw runs on: the PyTorch reference instead of the CPU interpreter."""
    if backend.get_backend() == "interpret":
        with backend.use_backend("torch"):
            yield
    else:
        yield


class LiveView(widgets.interactive):
    """``ipywidgets.interactive`` that redraws in place, figure first, text after (see the module doc).

    ``f`` returns a :class:`~matplotlib.figure.Figure` (or ``None``) and may print;
    ``widget.result`` is the last figure, ``widget.text`` the last printed text.
    """

    def __init__(self, f: Callable, **controls):
        for control in controls.values():
            if isinstance(control, widgets.Widget):
                _settle(control)
        self.text = ""
        self._png = None
        self._cache: OrderedDict = OrderedDict()
        super().__init__(f, **controls)
        self.add_class("mm3lab-live")
        self.out.add_class("mm3lab-live-output")

    def _compute(self, kwargs: dict):
        key = tuple(sorted((k, repr(v)) for k, v in kwargs.items()))
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf), redraw_backend():
            result = self.f(**kwargs)
        png = figure_png(result) if isinstance(result, Figure) else None
        entry = (result, png, buf.getvalue())
        self._cache[key] = entry
        while len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return entry

    def update(self, *args):
        # A redraw allocates thousands of matplotlib objects, and a full garbage collection that
        # they trigger walks the whole kernel heap (0.1-0.3 s). Hold collection off until the
        # new figure has been sent, so that it runs after the picture changes, not before.
        collecting = gc.isenabled()
        gc.disable()
        try:
            self._update()
        finally:
            if collecting:
                gc.enable()

    def _update(self):
        self.kwargs = {w._kwarg: w.get_interact_value() for w in self.kwargs_widgets}
        try:
            result, png, text = self._compute(dict(self.kwargs))
        except Exception as err:  # noqa: BLE001 (shown in place of the figure, the widget keeps working)
            result, png, text = None, None, f"{type(err).__name__}: {err}\n"
        self.result, self.text, self._png = result, text, png
        with self.out:
            clear_output(wait=True)
            if png is not None:
                display(Image(data=png))
            elif result is not None:
                display(result)
            if text:  # one display message, sent at once (printed text waits for the stream's flush)
                display({"text/plain": text.rstrip("\n")}, raw=True)

    def _repr_mimebundle_(self, **kwargs):
        data = super()._repr_mimebundle_(**kwargs)
        if isinstance(data, tuple):  # (data, metadata)
            data = data[0]
        data = dict(data or {})
        if getattr(self, "_png", None):
            data["image/png"] = base64.b64encode(self._png).decode("ascii")
        return data


__all__ = ["LABEL_WIDTH", "LiveView", "control_style", "figure_png", "redraw_backend"]
