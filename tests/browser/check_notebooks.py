"""Open every notebook in JupyterLab in a real (headless) Chromium, run it, and use its widgets.

Run through ``python3 run.py test-browser``, which installs what this needs; by hand::

    python tests/browser/check_notebooks.py [--chromium /usr/bin/chromium] [--screenshots DIR] [NOTEBOOK ...]

For each notebook it checks, in this order:

1. opened before anything runs (untrusted), no widget shows as ``interactive(children=...)`` text;
2. after "run all cells": no error output, no browser console error or page error;
3. every widget output renders as a widget (no "Error displaying widget");
4. every control of every :class:`mm3lab.widgets._live.LiveView`, moved to two values (a slider
   dragged with the mouse and released, a toggle button clicked, a dropdown option chosen, a
   text box edited and Enter pressed), changes the figure's image, and the output stops
   changing within ``--settle-limit`` seconds (default 5.0) of the release (a failure past it);
   the settle goal ``--settle`` (default 1.0 s) is reported: how many moves met it, and which not;
5. the figure never disappears during a redraw (a MutationObserver counts the images in the
   widget's output after every change).

Exit status 0 when every check passed. On a failure, full-page screenshots of the failing
notebooks are written to the screenshots folder and its path is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"

# JavaScript run in the page. JupyterLab is started with expose_app_in_browser, so
# window.jupyterapp is the application; its current widget is the open notebook.
JS_NOTEBOOK_STATE = """() => {
  const panel = window.jupyterapp.shell.currentWidget;
  if (!panel || !panel.content || !panel.sessionContext) return null;
  const kernel = panel.sessionContext.session && panel.sessionContext.session.kernel;
  const cells = panel.content.widgets.map(c => ({
    type: c.model.type,
    count: c.model.type === 'code' ? c.model.executionCount : null,
    outputs: c.model.type === 'code' ? c.model.outputs.toJSON() : [],
  }));
  return {kernel: kernel ? kernel.status : null, cells: cells};
}"""

JS_WATCH = """(index) => {
  const view = document.querySelectorAll('.mm3lab-live')[index];
  const out = view.querySelector('.mm3lab-live-output');
  const state = {last: performance.now(), vanished: 0, changes: 0};
  window.__mm3labWatch = state;
  if (window.__mm3labObserver) window.__mm3labObserver.disconnect();
  const observer = new MutationObserver(() => {
    state.last = performance.now();
    state.changes += 1;
    if (out.querySelectorAll('img').length === 0) state.vanished += 1;
  });
  observer.observe(out, {childList: true, subtree: true, attributes: true, characterData: true});
  window.__mm3labObserver = observer;
}"""

JS_VIEW_IMAGE = """(index) => {
  const view = document.querySelectorAll('.mm3lab-live')[index];
  const img = view.querySelector('.mm3lab-live-output img');
  return img ? img.getAttribute('src') : null;
}"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Lab:
    """JupyterLab on a free port with a token, in throw-away settings, workspace and notebook folders.

    The notebooks are copies in ``tmp/work/notebooks`` (the checkout is on ``PYTHONPATH``), and
    autosave is off, so a run never writes to the checkout's notebooks.
    """

    def __init__(self, root: Path, tmp: Path, notebooks=()):
        self.port, self.token = free_port(), secrets.token_hex(16)
        work = tmp / "work"
        (work / "notebooks").mkdir(parents=True)
        for nb in notebooks:
            shutil.copy(nb, work / "notebooks" / Path(nb).name)
        settings = tmp / "settings" / "@jupyterlab" / "docmanager-extension"
        settings.mkdir(parents=True)
        (settings / "plugin.jupyterlab-settings").write_text(json.dumps({"autosave": False}))
        env = dict(
            os.environ,
            PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""),
            JUPYTER_CONFIG_DIR=str(tmp / "config"),
            JUPYTERLAB_WORKSPACES_DIR=str(tmp / "workspaces"),
            JUPYTERLAB_SETTINGS_DIR=str(tmp / "settings"),
            JUPYTER_RUNTIME_DIR=str(tmp / "runtime"),
            PYTHONUNBUFFERED="1",
            # the notebooks run from copies outside the checkout: point 06 at the checkout's results
            MM3LAB_RESULTS=os.environ.get("MM3LAB_RESULTS", str(root / "benchmarks" / "results")),
        )
        root = work
        env.pop("MPLBACKEND", None)  # the kernel uses the inline backend, as a reader's would
        cmd = [
            sys.executable,
            "-m",
            "jupyter",
            "lab",
            "--no-browser",
            f"--port={self.port}",
            "--ip=127.0.0.1",
            f"--IdentityProvider.token={self.token}",
            f"--ServerApp.root_dir={root}",
            "--LabApp.expose_app_in_browser=True",
            "--LabApp.news_url=None",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        ]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            cmd.append("--allow-root")
        self.log = open(tmp / "jupyterlab.log", "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            cmd, cwd=root, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"JupyterLab exited with {self.proc.returncode}; log: {tmp / 'jupyterlab.log'}")
            try:
                with urllib.request.urlopen(f"{self.url}/api/status?token={self.token}", timeout=2):
                    return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError("JupyterLab did not start within 120 s")

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.log.close()


class Checker:
    def __init__(self, context, lab: Lab, settle: float, run_timeout: float, settle_limit: float = 5.0):
        self.context, self.lab, self.settle, self.run_timeout = context, lab, settle, run_timeout
        self.settle_limit = settle_limit
        self.failures: list[str] = []
        self.settles: list[tuple[str, float]] = []  # (notebook: control, seconds) of every move
        self.timings: list[str] = []

    def fail(self, nb: str, what: str):
        self.failures.append(f"{nb}: {what}")
        print(f"  FAIL {what}", flush=True)

    def state(self, page):
        return page.evaluate(JS_NOTEBOOK_STATE)

    def wait_for_kernel(self, page, timeout: float = 120):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = self.state(page)
            if st and st["kernel"] == "idle":
                return st
            time.sleep(0.25)
        raise TimeoutError("the kernel did not become idle")

    def run_all(self, page):
        page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
        deadline = time.monotonic() + self.run_timeout
        time.sleep(0.5)
        while time.monotonic() < deadline:
            st = self.state(page)
            code = [c for c in st["cells"] if c["type"] == "code"]
            if st["kernel"] == "idle" and all(c["count"] is not None for c in code):
                return st
            time.sleep(0.5)
        raise TimeoutError(f"run all cells did not finish within {self.run_timeout:.0f} s")

    def check_notebook(self, path: Path, shots: Path) -> bool:
        name = path.name
        before = len(self.failures)
        console: list[str] = []
        page = self.context.new_page()
        page.on("console", lambda m: console.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: console.append(f"page error: {e}"))
        rel = f"notebooks/{path.name}"
        t0 = time.monotonic()
        try:
            page.goto(f"{self.lab.url}/lab/tree/{rel}?token={self.lab.token}&reset", wait_until="load")
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
            st = self.wait_for_kernel(page)
            page.wait_for_timeout(500)
            stored = sum(1 for c in st["cells"] for o in c["outputs"] if WIDGET_MIME in o.get("data", {}))
            raw = page.locator(".jp-OutputArea-output", has_text="interactive(children=").count()
            if raw:
                self.fail(name, f"{raw} widget output(s) show as interactive(children=...) text before running")
            page.screenshot(path=str(shots / f"{path.stem}-opened.png"), full_page=True)

            st = self.run_all(page)
            t_run = time.monotonic() - t0
            page.wait_for_timeout(1000)
            for i, cell in enumerate(st["cells"]):
                for out in cell["outputs"]:
                    if out.get("output_type") == "error":
                        self.fail(name, f"cell {i}: error output {out.get('ename')}: {out.get('evalue')}")
            widgets_expected = sum(1 for c in st["cells"] for o in c["outputs"] if WIDGET_MIME in o.get("data", {}))
            broken = page.locator(".jp-OutputArea-output", has_text="Error displaying widget").count()
            raw = page.locator(".jp-OutputArea-output", has_text="interactive(children=").count()
            # any widget class counts (interactive views, boxes, single controls), one per output
            rendered = page.locator(".jp-OutputArea-output", has=page.locator(".jupyter-widgets")).count()
            if broken or raw or rendered < widgets_expected:
                self.fail(
                    name,
                    f"{widgets_expected} widget outputs, {rendered} rendered as widgets, "
                    f"{broken} 'Error displaying widget', {raw} shown as text",
                )
            views = page.locator(".mm3lab-live").count()
            moved = self.check_controls(page, name, views)
            page.screenshot(path=str(shots / f"{path.stem}-after.png"), full_page=True)
            for msg in console:
                self.fail(name, f"browser console error: {msg[:300]}")
            self.timings.append(
                f"{name}: opened and ran in {t_run:.1f} s ({stored} stored widget outputs); "
                f"{views} live views, {moved} control moves checked; "
                f"{time.monotonic() - t0:.1f} s in all"
            )
            print("  " + self.timings[-1], flush=True)
        except Exception as err:  # noqa: BLE001 (any failure is reported, the next notebook still runs)
            self.fail(name, f"{type(err).__name__}: {err}")
            try:
                page.screenshot(path=str(shots / f"{path.stem}-failure.png"), full_page=True)
            except Exception:  # noqa: BLE001, S110
                pass
        finally:
            try:  # shut the kernel down so that the next notebook has the CPU
                page.evaluate("() => window.jupyterapp.shell.currentWidget.sessionContext.shutdown()")
                page.wait_for_timeout(300)
            except Exception:  # noqa: BLE001, S110
                pass
            page.close()
        return len(self.failures) == before

    # --- moving the controls ----------------------------------------------------------------

    def _controls(self, view):
        out = []
        for kind, selector in (
            ("slider", ".widget-slider"),
            ("toggle", ".widget-toggle-buttons"),
            ("dropdown", ".widget-dropdown"),
            ("text", ".widget-text"),
        ):
            loc = view.locator(selector)
            for j in range(loc.count()):
                out.append((kind, loc.nth(j)))
        return out

    def _moves(self, page, kind, control):
        """Two actions that each set the control to a new value (callables), with labels."""
        if kind == "slider":
            track = control.locator(".noUi-target, .slider").first
            handle = control.locator(".noUi-handle").first

            def drag(frac):
                def go():
                    box, hb = track.bounding_box(), handle.bounding_box()
                    page.mouse.move(hb["x"] + hb["width"] / 2, hb["y"] + hb["height"] / 2)
                    page.mouse.down()
                    page.mouse.move(box["x"] + frac * box["width"], hb["y"] + hb["height"] / 2, steps=8)
                    page.mouse.up()

                return go

            # targets on the far side of the handle, then back past it, so that a slider with
            # only two values (0 and 1) really moves both times
            box, hb = track.bounding_box(), handle.bounding_box()
            now = (hb["x"] + hb["width"] / 2 - box["x"]) / max(box["width"], 1.0)
            first, second = (0.9, 0.3) if now < 0.5 else (0.1, 0.7)
            return [(f"drag to {first:.0%}", drag(first)), (f"drag to {second:.0%}", drag(second))]
        if kind == "toggle":
            buttons = control.locator("button")
            labels = [buttons.nth(i).inner_text() for i in range(buttons.count())]
            classes = [buttons.nth(i).get_attribute("class") or "" for i in range(buttons.count())]
            active = [i for i, c in enumerate(classes) if "mod-active" in c]
            others = [i for i in range(len(labels)) if i not in active]
            order = (others + active)[:2] if len(others) < 2 else others[:2]
            return [(f"click {labels[i]!r}", (lambda i=i: buttons.nth(i).click())) for i in order]
        if kind == "dropdown":
            select = control.locator("select")
            options = select.locator("option")
            values = [options.nth(i).get_attribute("value") for i in range(options.count())]
            current = select.input_value()
            others = [v for v in values if v != current]
            order = (others + [current])[:2] if len(others) < 2 else others[:2]
            return [(f"choose {v!r}", (lambda v=v: select.select_option(v))) for v in order]
        box = control.locator("input")
        current = box.input_value()

        def edit(text):
            def go():
                box.fill(text)
                box.press("Enter")

            return go

        return [
            ("edit", edit(current.rsplit(" ", 1)[0] if " " in current else current + " 0")),
            ("edit back", edit(current)),
        ]

    def check_controls(self, page, name: str, views: int) -> int:
        moved = 0
        for index in range(views):
            view = page.locator(".mm3lab-live").nth(index)
            view.scroll_into_view_if_needed()
            for kind, control in self._controls(view):
                label = control.locator(".widget-label").first
                desc = label.inner_text() if label.count() else kind
                for what, action in self._moves(page, kind, control):
                    src = page.evaluate(JS_VIEW_IMAGE, index)
                    page.evaluate(JS_WATCH, index)
                    released = page.evaluate("() => performance.now()")
                    action()
                    self._wait_quiet(page, 15.0)
                    watch = page.evaluate("() => window.__mm3labWatch")
                    after = page.evaluate(JS_VIEW_IMAGE, index)
                    settle = max(0.0, (watch["last"] - released) / 1000.0)
                    tag = f"view {index} control {desc!r} {what}"
                    moved += 1
                    if after is None or after == src:
                        self.fail(name, f"{tag}: the figure did not change")
                    if watch["vanished"]:
                        self.fail(name, f"{tag}: the figure disappeared during the redraw")
                    self.settles.append((f"{name}: {tag}", settle))
                    if settle > self.settle_limit:
                        self.fail(name, f"{tag}: settled {settle:.2f} s after release (limit {self.settle_limit} s)")
                    else:
                        goal = "" if settle <= self.settle else f" (over the {self.settle} s goal)"
                        print(f"    {tag}: settled in {settle:.2f} s{goal}", flush=True)
        return moved

    def _wait_quiet(self, page, limit: float, quiet: float = 0.8):
        """Wait for the output to change, then until it has not changed for ``quiet`` seconds."""
        deadline = time.monotonic() + limit
        page.wait_for_timeout(150)
        while time.monotonic() < deadline:
            watch = page.evaluate(
                "() => ({since: (performance.now() - window.__mm3labWatch.last) / 1000,"
                " changes: window.__mm3labWatch.changes})"
            )
            if watch["changes"] and watch["since"] >= quiet:
                return
            page.wait_for_timeout(100)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("notebooks", nargs="*", type=Path)
    ap.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    ap.add_argument("--screenshots", type=Path, default=ROOT / "browser-screenshots")
    ap.add_argument("--settle", type=float, default=1.0, help="goal: seconds from release to a settled figure")
    ap.add_argument("--settle-limit", type=float, default=5.0, help="a move that settles later than this fails")
    ap.add_argument("--run-timeout", type=float, default=300.0, help="seconds for one notebook's cells")
    args = ap.parse_args(argv)
    from playwright.sync_api import sync_playwright

    notebooks = args.notebooks or sorted((ROOT / "notebooks").glob("*.ipynb"))
    shots = args.screenshots.resolve()
    shutil.rmtree(shots, ignore_errors=True)
    shots.mkdir(parents=True)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mm3lab-browser-") as tmp:
        tmp = Path(tmp)
        lab = Lab(ROOT, tmp, notebooks)
        try:
            with sync_playwright() as pw:
                context = pw.chromium.launch_persistent_context(
                    str(tmp / "chromium-profile"),
                    executable_path=args.chromium,
                    headless=True,
                    args=CHROMIUM_FLAGS,
                    viewport={"width": 1400, "height": 1000},
                )
                checker = Checker(context, lab, args.settle, args.run_timeout, args.settle_limit)
                failed = []
                for nb in notebooks:
                    print(f"{nb.name}", flush=True)
                    if not checker.check_notebook(nb, shots):
                        failed.append(nb.name)
                context.close()
        finally:
            lab.stop()
    took = time.monotonic() - t0
    slow = [(what, t) for what, t in checker.settles if t > args.settle]
    times = sorted(t for _, t in checker.settles)
    if times:
        print(
            f"settle goal {args.settle} s: {len(times) - len(slow)} of {len(times)} moves within it; "
            f"median {times[len(times) // 2]:.2f} s, slowest {times[-1]:.2f} s"
        )
        for what, t in slow:
            print(f"  over the goal: {what}: {t:.2f} s")
    print(json.dumps({"seconds": round(took, 1), "notebooks": len(notebooks), "failures": len(checker.failures)}))
    if checker.failures:
        print(f"\n{len(checker.failures)} failure(s) in {', '.join(failed)}:")
        for f in checker.failures:
            print(f"  {f}")
        print(f"screenshots: {shots}")
        return 1
    print(f"browser check passed: {len(notebooks)} notebooks in {took:.0f} s (screenshots: {shots})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
