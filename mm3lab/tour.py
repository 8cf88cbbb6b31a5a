"""``mm3lab tour``: execute every notebook headless and write it as HTML, figures as PNG.

Output layout (``out_dir``)::

    index.html                      links to every notebook
    01_block_selection.html         the executed notebook
    01_block_selection/figure-03-1.png   every PNG output: cell 3, first image
    ...

Waiting for the kernel. The client waits on its ZeroMQ sockets through asyncio, which
wakes when the socket's file descriptor becomes readable. That descriptor is edge-triggered:
it signals once when ZeroMQ has news for the socket, and any operation on the socket,
including a send, takes that news in and clears the signal. While a widget cell runs, the
notebook client sends widget state back to the kernel on the shell socket, through a plain
(blocking) twin of the asyncio socket, so asyncio is never told. When the kernel's reply has
just arrived, that send swallows its wake-up: the reply sits unread in the socket until the
wait times out, and the cell costs its whole timeout although the kernel answered at once.
The tour's client closes both gaps:

* after every send it reads the socket's state once more, which wakes a waiting receive
  when a message is already there (the cause, removed);
* it waits in slices of :data:`POLL_SLICE_S` and re-reads the socket after each, so any
  other missed wake-up costs at most one slice (the bound).

Every cell also has a timeout (:data:`CELL_TIMEOUT_S`, larger than the slowest cell), and a
timeout stops the tour with the notebook, the cell and what to do (:class:`TourError`). A
failure of the notebook client itself is named with the place it was raised, never reported
as a timeout. SIGINT or SIGTERM shuts the running kernel down (nbclient's answer) and stops
the tour (:class:`TourInterrupted`); without that, nbclient's answer looks like a kernel
that died mid-cell and a stress run would go on.
"""

from __future__ import annotations

import base64
import functools
import html
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from queue import Empty

import zmq
from jupyter_client.asynchronous import AsyncKernelClient
from jupyter_client.channels import AsyncZMQSocketChannel
from jupyter_client.manager import AsyncKernelManager
from traitlets import DottedObjectName, Type

PACKAGE_ROOT = Path(__file__).resolve().parent

CELL_TIMEOUT_S = 120
"""Seconds a cell may run before the tour stops; the slowest cell takes well under a minute."""
IOPUB_TIMEOUT_S = 10
"""Seconds to wait for a cell's last output after its reply (the kernel sends them first)."""
POLL_SLICE_S = 0.5
"""Longest wait on a socket before its state is read again (the cost of a missed wake-up)."""


class TourError(RuntimeError):
    """A notebook of the tour failed or timed out; the message names the notebook and cell."""


class TourInterrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived while a notebook ran: its kernel was shut down and the tour stops."""


def find_notebooks_dir() -> Path:
    """The ``notebooks/`` folder of the checkout this package runs from."""
    candidates = [PACKAGE_ROOT.parent / "notebooks", Path.cwd() / "notebooks"]
    for c in candidates:
        if c.is_dir() and any(c.glob("*.ipynb")):
            return c
    raise FileNotFoundError(
        "no notebooks/ folder found next to the package or in the current folder; "
        "run from a clone of mm3lab or pass --notebooks DIR"
    )


# --- a kernel client that cannot lose a reply --------------------------------------------------


class SlicedPollChannel(AsyncZMQSocketChannel):
    """A channel that cannot leave a message unread: see the module doc.

    ``send`` re-reads the socket's state after sending; ``get_msg`` waits in slices and
    re-reads the socket after each. Class counters: ``woken_after_send`` counts sends after
    which a message was already waiting for a pending receive (each one a wake-up the
    stock client may lose), ``late_wakeups`` the messages found only when a slice ended.
    """

    late_wakeups = 0
    woken_after_send = 0

    def send(self, msg: dict) -> None:
        super().send(msg)
        # pyzmq's asyncio socket schedules its waiting receives when its state is read
        events = self.socket.get(zmq.EVENTS)
        if events & zmq.POLLIN and getattr(self.socket, "_recv_futures", None):
            type(self).woken_after_send += 1

    async def get_msg(self, timeout: float | None = None) -> dict:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = POLL_SLICE_S if deadline is None else min(POLL_SLICE_S, deadline - time.monotonic())
            if left <= 0:
                raise Empty
            wait_ms = max(1, int(left * 1000))
            start = time.monotonic()
            if await self.socket.poll(wait_ms):
                if time.monotonic() - start >= wait_ms / 1000:
                    type(self).late_wakeups += 1
                return await self._recv()


class TourKernelClient(AsyncKernelClient):
    """The asynchronous kernel client with :class:`SlicedPollChannel` for shell, IOPub and control."""

    shell_channel_class = Type(SlicedPollChannel)
    iopub_channel_class = Type(SlicedPollChannel)
    control_channel_class = Type(SlicedPollChannel)


class TourKernelManager(AsyncKernelManager):
    """The asynchronous kernel manager whose clients are :class:`TourKernelClient`.

    ``client()`` builds its client with ``client_factory``; the asynchronous manager gives
    that trait a fixed default, so setting ``client_class`` alone would not change it.
    """

    client_class = DottedObjectName("mm3lab.tour.TourKernelClient")
    client_factory = Type(TourKernelClient, klass=AsyncKernelClient, config=True)


# --- executing one notebook ------------------------------------------------------------------


@dataclass
class NotebookRun:
    """One notebook's execution: wall time (kernel start to shutdown) and each code cell's time."""

    name: str
    seconds: float
    cell_seconds: dict[int, float] = field(default_factory=dict)
    channel: str = ""
    """Class of the shell channel the notebook client used (``SlicedPollChannel`` unless stock)."""
    error: str = ""
    """Why the run failed (a :class:`TourError` message; only in a stress run, which goes on)."""

    @property
    def slowest_cell(self) -> tuple[int, float]:
        return max(self.cell_seconds.items(), key=lambda kv: kv[1], default=(-1, 0.0))


def _what_to_do(path: Path, timeout: int) -> str:
    return (
        f"run it again with `python3 run.py tour --only {path.stem}`; if that cell needs longer on "
        f"this machine, pass --timeout SECONDS (now {timeout}); if it recurs, report the output of "
        f"`python3 run.py tour --repeat 5 --only {path.stem}`"
    )


@functools.cache
def _client_class():
    """nbclient's ``NotebookClient`` that remembers a SIGINT / SIGTERM.

    nbclient answers those signals by shutting the kernel down and does not stop: the cell
    then fails as if the kernel had died. The tour records the signal (``client.interrupted``),
    shuts the kernel down the same way, and stops instead of going on to the next notebook.
    """
    import asyncio
    import atexit
    import contextlib
    import signal

    from nbclient import NotebookClient

    class TourNotebookClient(NotebookClient):
        interrupted = ""

        @contextlib.asynccontextmanager
        async def async_setup_kernel(self, **kwargs):
            async with super().async_setup_kernel(**kwargs):
                loop = asyncio.get_event_loop()
                with contextlib.suppress(NotImplementedError, RuntimeError):  # no signals here: nothing to record
                    for sig in (signal.SIGINT, signal.SIGTERM):
                        loop.add_signal_handler(sig, self._on_signal, sig)
                yield

        def _on_signal(self, sig) -> None:
            self.interrupted = signal.Signals(sig).name
            self._async_cleanup_kernel_future = asyncio.ensure_future(self._async_cleanup_kernel())
            atexit.unregister(self._cleanup_kernel)

    return TourNotebookClient


def _where(current: dict) -> str:
    if current["cell"] is None:
        return "while starting the kernel"
    return f"at cell {current['cell']} (waited {time.monotonic() - current['start']:.0f} s)"


def _origin(e: BaseException) -> str:
    frames = traceback.extract_tb(e.__traceback__)
    if not frames:
        return "an unknown place"
    f = frames[-1]
    return f"{Path(f.filename).name}:{f.lineno} in {f.name}"


def execute_notebook(path: Path, timeout: int = CELL_TIMEOUT_S, sliced_poll: bool = True):
    """Execute the notebook at ``path`` in its folder; return ``(notebook, NotebookRun)``.

    Raises :class:`TourError` naming the notebook and cell when a cell times out, raises
    or the kernel dies. ``sliced_poll=False`` uses the stock client (for comparison only).
    """
    import nbformat

    nb = nbformat.read(path, as_version=4)
    run = NotebookRun(path.stem, 0.0)
    current = {"cell": None, "start": 0.0}

    def on_start(cell, cell_index):
        current["cell"], current["start"] = cell_index, time.monotonic()
        if not run.channel and client.kc is not None:
            run.channel = type(client.kc.shell_channel).__name__

    def on_executed(cell, cell_index, execute_reply):
        run.cell_seconds[cell_index] = time.monotonic() - current["start"]

    extra = {"kernel_manager_class": TourKernelManager} if sliced_poll else {}
    client = _client_class()(
        nb,
        timeout=timeout,
        iopub_timeout=IOPUB_TIMEOUT_S,
        raise_on_iopub_timeout=True,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
        on_cell_start=on_start,
        on_cell_executed=on_executed,
        **extra,
    )
    t0 = time.monotonic()
    try:
        client.execute()
    except (Exception, KeyboardInterrupt) as e:
        if not client.interrupted:  # after a signal: whatever the kernel's shutdown made the client raise
            _raise_tour_error(e, path, current, timeout)
    if client.interrupted:
        raise TourInterrupted(
            f"{path.name}: {client.interrupted} {_where(current)}: the kernel was shut down and the tour stops"
        ) from None
    run.seconds = time.monotonic() - t0
    return nb, run


def _raise_tour_error(e: BaseException, path: Path, current: dict, timeout: int):
    """Raise the :class:`TourError` that says what stopped the notebook (``e`` itself if it is not an error)."""
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

    if not isinstance(e, Exception):
        raise e
    if isinstance(e, CellExecutionError):
        raise TourError(f"{path.name}: cell {current['cell']} raised an error:\n{e}") from None
    if isinstance(e, (CellTimeoutError, DeadKernelError)):
        reason = "the kernel died" if isinstance(e, DeadKernelError) else f"no reply within {timeout} s"
        raise TourError(f"{path.name}: stopped {_where(current)}: {reason}. {_what_to_do(path, timeout)}") from None
    if isinstance(e, AssertionError) and current["cell"] is None:
        # nbclient asserts when the kernel's first reply (kernel_info) does not come in time
        raise TourError(
            f"{path.name}: stopped {_where(current)}: no reply within {timeout} s. {_what_to_do(path, timeout)}"
        ) from None
    traceback.print_exception(e, file=sys.stderr)
    raise TourError(
        f"{path.name}: stopped {_where(current)}: the notebook client failed ({type(e).__name__}: {e}; "
        f"raised at {_origin(e)}; traceback above). {_what_to_do(path, timeout)}"
    ) from None


def _figures(nb) -> list[tuple[str, bytes]]:
    figures = []
    for i, cell in enumerate(nb.cells):
        n = 0
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            if "image/png" in data:
                n += 1
                figures.append((f"figure-{i:02d}-{n}.png", base64.b64decode(data["image/png"])))
    return figures


def _select(notebooks_dir: Path | None, only: list[str] | None) -> tuple[Path, list[Path]]:
    nb_dir = notebooks_dir or find_notebooks_dir()
    paths = sorted(nb_dir.glob("*.ipynb"))
    if only:
        paths = [p for p in paths if any(s in p.name for s in only)]
    if not paths:
        raise FileNotFoundError(f"no notebooks to run in {nb_dir}")
    return nb_dir, paths


class _inline_backend:
    """Figures as inline PNG in the kernels (they inherit this environment)."""

    def __enter__(self):
        self.backup = os.environ.get("MPLBACKEND")
        os.environ.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")

    def __exit__(self, *exc):
        if self.backup is None:
            os.environ.pop("MPLBACKEND", None)


def run_tour(
    notebooks_dir: Path | None = None,
    out_dir: Path = Path("mm3lab-tour"),
    only: list[str] | None = None,
    timeout: int = CELL_TIMEOUT_S,
    progress: bool = True,
    runs: list[NotebookRun] | None = None,
) -> Path:
    """Execute the notebooks on the default backend; return the output folder.

    ``timeout`` is the limit per cell in seconds; ``runs``, if given, receives one
    :class:`NotebookRun` per notebook.
    """
    from nbconvert import HTMLExporter
    from tqdm.auto import tqdm

    _, paths = _select(notebooks_dir, only)
    out_dir.mkdir(parents=True, exist_ok=True)
    exporter = HTMLExporter()
    rows = []
    with _inline_backend():
        bar = tqdm(paths, desc="tour", unit="notebook", disable=not progress)
        for path in bar:
            bar.set_postfix_str(path.name)
            nb, run = execute_notebook(path, timeout=timeout)
            if runs is not None:
                runs.append(run)
            body, _ = exporter.from_notebook_node(nb)
            (out_dir / f"{path.stem}.html").write_text(body, encoding="utf-8")
            figs = _figures(nb)
            if figs:
                fig_dir = out_dir / path.stem
                fig_dir.mkdir(exist_ok=True)
                for name, data in figs:
                    (fig_dir / name).write_bytes(data)
            rows.append((path.stem, len(figs)))
    items = "\n".join(
        f'<li><a href="{html.escape(stem)}.html">{html.escape(stem)}</a> ({n} figures)</li>' for stem, n in rows
    )
    (out_dir / "index.html").write_text(
        f"<!doctype html><title>mm3lab tour</title><h1>mm3lab tour</h1><ul>\n{items}\n</ul>\n", encoding="utf-8"
    )
    return out_dir


# --- the stress run ---------------------------------------------------------------------------


def repeat_tour(
    repeat: int,
    notebooks_dir: Path | None = None,
    only: list[str] | None = None,
    timeout: int = CELL_TIMEOUT_S,
    sliced_poll: bool = True,
    echo=print,
) -> list[list[NotebookRun]]:
    """Execute the notebooks ``repeat`` times (no HTML); echo one line per tour; return the runs.

    A notebook that fails is recorded (``NotebookRun.error``) and echoed, and the run goes on:
    a stress run counts failures instead of stopping at the first.
    """
    _, paths = _select(notebooks_dir, only)
    tours = []
    with _inline_backend():
        for i in range(repeat):
            t0 = time.monotonic()
            runs = []
            for p in paths:
                start = time.monotonic()
                try:
                    runs.append(execute_notebook(p, timeout=timeout, sliced_poll=sliced_poll)[1])
                except TourError as e:  # recorded and reported; the stress run goes on
                    runs.append(NotebookRun(p.stem, time.monotonic() - start, error=str(e)))
                    echo(f"tour {i + 1}/{repeat}: FAILED: {e}")
                except TourInterrupted:  # the tours so far, then stop
                    if tours:
                        echo(repeat_report(tours))
                    raise
            tours.append(runs)
            name, (cell, s) = max(((r.name, r.slowest_cell) for r in runs), key=lambda x: x[1][1])
            failed = sum(bool(r.error) for t in tours for r in t)
            echo(
                f"tour {i + 1}/{repeat}: {time.monotonic() - t0:.1f} s; longest cell {s:.1f} s ({name} cell {cell}); "
                f"late wake-ups so far {SlicedPollChannel.late_wakeups}, "
                f"replies waiting after a send {SlicedPollChannel.woken_after_send}; shell channel {runs[0].channel}; "
                f"failed runs so far {failed}; load {_load()}"
            )
    return tours


def _load() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:  # pragma: no cover - not on every platform
        return "n/a"


def repeat_report(tours: list[list[NotebookRun]]) -> str:
    """Per notebook min / median / max seconds, tour totals, and the longest single cell."""
    names = [r.name for r in tours[0]]
    lines = [
        f"{len(tours)} tours; seconds per notebook (kernel start to shutdown)",
        f"{'notebook':28s} {'min':>7} {'median':>7} {'max':>7}  longest cell",
    ]
    for k, name in enumerate(names):
        secs = [t[k].seconds for t in tours]
        cell, s = max((t[k].slowest_cell for t in tours), key=lambda x: x[1])
        lines.append(
            f"{name:28s} {min(secs):7.1f} {statistics.median(secs):7.1f} {max(secs):7.1f}  {s:.1f} s (cell {cell})"
        )
    totals = [sum(r.seconds for r in t) for t in tours]
    lines.append(f"{'whole tour':28s} {min(totals):7.1f} {statistics.median(totals):7.1f} {max(totals):7.1f}")
    worst = max((r.slowest_cell[1], r.name, r.slowest_cell[0]) for t in tours for r in t)
    lines.append(
        f"longest single cell wait: {worst[0]:.1f} s ({worst[1]} cell {worst[2]}); "
        f"late wake-ups caught by the sliced poll: {SlicedPollChannel.late_wakeups}; "
        f"replies waiting after a send (woken at once): {SlicedPollChannel.woken_after_send}"
    )
    failures = [(i + 1, r) for i, t in enumerate(tours) for r in t if r.error]
    lines.append(f"failed notebook runs: {len(failures)} of {sum(len(t) for t in tours)}")
    lines.extend(f"  tour {i}: {r.error}" for i, r in failures)
    return "\n".join(lines)
