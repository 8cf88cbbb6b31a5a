#!/usr/bin/env python3
"""Set up mm3lab's environment (once) and run one of its jobs.

    python3 run.py tour        # set up, then execute every notebook to HTML + PNG
    python3 run.py test        # set up, then the whole test suite (unit tests + nbval)
    python3 run.py lab         # set up, then JupyterLab on notebooks/
    python3 run.py info        # set up, then print versions, device and backend
    python3 run.py test-gpu    # on a GPU machine: the GPU tests with the system Python
    python3 run.py test-browser  # set up (+ Playwright, Chromium), then every notebook in JupyterLab in Chromium

The environment is a virtual environment in ``.venv`` next to this file, made
with the standard library's ``venv`` and filled by pip from ``pyproject.toml``
(through ``constraints.txt``). It is reused while those files are unchanged
and refreshed when they change. Only Python 3.10+ and pip are needed.
``test-gpu`` makes no environment: GPU machines bring their own CUDA PyTorch.
``test-browser`` also installs the ``browser`` extra (Playwright) and, where
``/usr/bin/chromium`` is missing and we are root, Debian's ``chromium`` package
(Playwright's own browser download is not used). Screenshots go to
``browser-screenshots/``; extra arguments go to ``tests/browser/check_notebooks.py``.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
STAMP = VENV / ".mm3lab-installed"
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
PY = BIN / ("python.exe" if os.name == "nt" else "python")

NBVAL_CELL_TIMEOUT_S = 120  # the slowest cell takes well under a minute; past this the cell fails
PYTEST_ARGS = [
    "-q",
    "-n",
    "2",
    "--dist",
    "loadfile",
    "--nbval",
    "--nbval-current-env",
    "--nbval-sanitize-with",
    "tests/nbval_sanitize.cfg",
    f"--nbval-cell-timeout={NBVAL_CELL_TIMEOUT_S}",
    "tests",
    "notebooks",
]
CHROMIUM = Path("/usr/bin/chromium")
BROWSER_STAMP = VENV / ".mm3lab-browser-installed"
GPU_PYTEST_ARGS = ["-q", "-m", "gpu", "-p", "no:cacheprovider", "tests"]


def _fingerprint() -> str:
    h = hashlib.sha256()
    for name in ("pyproject.toml", "constraints.txt"):
        h.update((ROOT / name).read_bytes())
    return h.hexdigest()


def _run(cmd: list, **kwargs) -> None:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, cwd=ROOT, **kwargs)


def ensure_env() -> None:
    """Create ``.venv`` if missing; (re)install mm3lab and its test extras if out of date."""
    if not PY.exists():
        print(f"creating a virtual environment in {VENV.name}/", flush=True)
        venv.EnvBuilder(with_pip=True, clear=True).create(VENV)
    if STAMP.exists() and STAMP.read_text() == _fingerprint():
        return
    pip = [PY, "-m", "pip", "--disable-pip-version-check", "install", "-q"]
    # torch first, pinned: otherwise a resolver may pick a much larger CUDA build.
    _run(pip + ["-c", "constraints.txt", "torch", "triton"])
    _run(pip + ["-c", "constraints.txt", "-e", ".[test]"])
    STAMP.write_text(_fingerprint())


def ensure_browser() -> None:
    """Playwright in ``.venv`` (the ``browser`` extra) and a system Chromium for it to drive."""
    if not (BROWSER_STAMP.exists() and BROWSER_STAMP.read_text() == _fingerprint()):
        _run(
            [
                PY,
                "-m",
                "pip",
                "--disable-pip-version-check",
                "install",
                "-q",
                "-c",
                "constraints.txt",
                "-e",
                ".[test,browser]",
            ]
        )
        BROWSER_STAMP.write_text(_fingerprint())
    if not CHROMIUM.exists():
        if not (hasattr(os, "geteuid") and os.geteuid() == 0):
            raise SystemExit(
                f"{CHROMIUM} is missing: install Debian's chromium package "
                "(sudo apt-get install -y chromium) and run again"
            )
        _run(["apt-get", "update"])
        _run(["apt-get", "install", "-y", "chromium"], env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"))


def main(argv: list[str]) -> int:
    job, rest = (argv[0], argv[1:]) if argv else ("help", [])
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if job in ("help", "-h", "--help"):
        print(__doc__)
        return 0
    if job == "test-gpu":
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        cmd = [sys.executable, "-m", "pytest", *GPU_PYTEST_ARGS, *rest]
        return subprocess.run(cmd, check=False, cwd=ROOT, env=env).returncode
    ensure_env()
    if job == "test":
        env.setdefault("MPLBACKEND", "Agg")
        return subprocess.run([PY, "-m", "pytest", *PYTEST_ARGS, *rest], check=False, cwd=ROOT, env=env).returncode
    if job == "test-browser":
        ensure_browser()
        env.setdefault("OMP_NUM_THREADS", "1")
        cmd = [PY, "tests/browser/check_notebooks.py", "--chromium", CHROMIUM, *rest]
        return subprocess.run([str(c) for c in cmd], check=False, cwd=ROOT, env=env).returncode
    if job in ("tour", "lab", "info", "explain"):
        return subprocess.run([BIN / "mm3lab", job, *rest], check=False, cwd=ROOT, env=env).returncode
    print(f"unknown job {job!r}\n{__doc__}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
