#!/usr/bin/env python3
"""Set up mm3lab's environment (once) and run one of its jobs.

    python3 run.py tour        # set up, then execute every notebook to HTML + PNG
    python3 run.py test        # set up, then the whole test suite (unit tests + nbval)
    python3 run.py lab         # set up, then JupyterLab on notebooks/
    python3 run.py info        # set up, then print versions, device and backend
    python3 run.py test-gpu    # on a GPU machine: the GPU tests with the system Python
    python3 run.py test-browser  # set up (+ Playwright, Chromium), then every notebook in JupyterLab in Chromium
    python3 run.py test-newest   # the suite again (unit tests + nbval) in .venv-newest, newest Triton tested

The environment is a virtual environment in ``.venv`` next to this file, made
with the standard library's ``venv`` and filled by pip from ``pyproject.toml``
(through ``constraints.txt``). It is reused while those files are unchanged
and refreshed when they change. Only Python 3.10+ and pip are needed. Where
pip's torch at the pinned version is a build that pins its own Triton (the CUDA
builds on PyPI: torch 2.13.0 wants triton 3.7.1), that Triton replaces the
pinned one, with a note; the constraints used are in ``.venv/constraints.txt``.
``test-newest`` makes a second one, ``.venv-newest``, through ``constraints-newest.txt``
(the newest Triton the suite is run with; ``constraints.txt`` pins the oldest supported).
``test-gpu`` makes no environment: GPU machines bring their own CUDA PyTorch.
``test-browser`` also installs the ``browser`` extra (Playwright) and, where
``/usr/bin/chromium`` is missing and we are root, Debian's ``chromium`` package
(Playwright's own browser download is not used). Screenshots go to
``browser-screenshots/``; extra arguments go to ``tests/browser/check_notebooks.py``.
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
VENV_NEWEST = ROOT / ".venv-newest"


def _bin(venv_dir: Path) -> Path:
    return venv_dir / ("Scripts" if os.name == "nt" else "bin")


def _python(venv_dir: Path) -> Path:
    return _bin(venv_dir) / ("python.exe" if os.name == "nt" else "python")


BIN = _bin(VENV)
PY = _python(VENV)

NBVAL_CELL_TIMEOUT_S = 120  # the slowest cell takes well under a minute; past this the cell fails
PYTEST_ARGS = [
    "-q",
    "-n",
    "2",
    "--dist",
    "loadfile",
    "--no-loadscope-reorder",  # files in collection order, the longest first (tests/conftest.py)
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
# the suite again with the newest Triton, but for the notebook-condition reruns and the compile checks for
# other GPUs than the H100 / H200 (sm_90 is compiled by both): those stay with `test`
NEWEST_PYTEST_ARGS = [*PYTEST_ARGS, "-m", "not notebook_conditions and not other_gpus"]
GPU_PYTEST_ARGS = ["-q", "-m", "gpu", "-p", "no:cacheprovider", "tests"]


def _fingerprint(constraints: str = "constraints.txt") -> str:
    h = hashlib.sha256()
    for name in ("pyproject.toml", constraints):
        h.update((ROOT / name).read_bytes())
    return h.hexdigest()


def _run(cmd: list, **kwargs) -> None:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, cwd=ROOT, **kwargs)


def _pins(constraints: Path) -> dict[str, str]:
    """``name -> version`` of the ``name==version`` lines of a constraints file."""
    pins = {}
    for line in constraints.read_text().splitlines():
        line = line.split("#")[0].strip()
        if "==" in line:
            name, version = line.split("==")
            pins[name.strip().lower()] = version.strip()
    return pins


_TORCH_TRITON = """
import importlib.metadata as m, re
for r in m.requires("torch") or []:
    pin = re.match(r"triton\\s*==\\s*([^;\\s]+)", r)
    try:
        if pin and m.version("triton") == pin.group(1):
            print(pin.group(1))
    except m.PackageNotFoundError:
        pass
"""
"""Prints the Triton version the installed torch pins and pulled in (a PyPI CUDA build does: torch 2.13.0
wants triton 3.7.1), or nothing (a CPU build names no Triton)."""


TRITON_PLATFORMS = {"linux": ("x86_64", "aarch64", "arm64")}
"""Where Triton publishes wheels (``sys.platform`` -> machines): without one, nothing installs."""


def check_platform(system: str = sys.platform, machine: str = platform.machine()) -> None:
    """Exit with directions, before anything is installed, on a machine Triton has no wheel for."""
    if machine.lower() in TRITON_PLATFORMS.get(system, ()):
        return
    sys.exit(
        f"mm3lab needs Triton, whose wheels are for Linux on x86_64 and aarch64 only; this machine is "
        f"{system} on {machine}, where pip cannot install it.\n"
        "Run mm3lab on Linux: in WSL2 on Windows, or in a Linux container (Docker on a Mac runs aarch64 Linux), "
        "for example\n"
        '  docker run --rm -it -v "$PWD":/mm3lab -w /mm3lab python:3.12 python3 run.py tour'
    )


def ensure_env(venv_dir: Path = VENV, constraints: str = "constraints.txt") -> Path:
    """Create ``venv_dir`` if missing; (re)install mm3lab and its test extras through ``constraints``
    if out of date. Returns the environment's Python.

    torch goes first, at its pinned version (otherwise a resolver may pick a much larger CUDA
    build). Where that torch is a build that pins its own Triton (the CUDA builds on PyPI), that
    Triton is kept and replaces the constraints' pin, which cannot be installed beside it; the
    constraints actually used are written to ``venv_dir/constraints.txt``.
    """
    check_platform()
    py, stamp, used = _python(venv_dir), venv_dir / ".mm3lab-installed", venv_dir / "constraints.txt"
    if not py.exists():
        print(f"creating a virtual environment in {venv_dir.name}/", flush=True)
        venv.EnvBuilder(with_pip=True, clear=True).create(venv_dir)
    if stamp.exists() and stamp.read_text() == _fingerprint(constraints) and used.exists():
        return py
    pip = [py, "-m", "pip", "--disable-pip-version-check", "install", "-q"]
    pins = _pins(ROOT / constraints)
    _run(pip + [f"torch=={pins['torch']}"])
    probe = subprocess.run([py, "-c", _TORCH_TRITON], capture_output=True, text=True, check=True)
    torch_triton = probe.stdout.strip()
    if torch_triton and torch_triton != pins.get("triton"):
        print(
            f"note: this torch {pins['torch']} build requires triton {torch_triton}; using it instead of "
            f"the triton {pins.get('triton')} that {constraints} pins",
            flush=True,
        )
        pins["triton"] = torch_triton
    used.write_text("".join(f"{name}=={version}\n" for name, version in pins.items()))
    _run(pip + ["-c", used, "triton"])
    _run(pip + ["-c", used, "-e", ".[test]"])
    stamp.write_text(_fingerprint(constraints))
    return py


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
                VENV / "constraints.txt",
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
    newest = job == "test-newest"  # the suite with the newest Triton tested (see NEWEST_PYTEST_ARGS)
    py = ensure_env(VENV_NEWEST, "constraints-newest.txt") if newest else ensure_env()
    if job in ("test", "test-newest"):
        env.setdefault("MPLBACKEND", "Agg")
        args = NEWEST_PYTEST_ARGS if newest else PYTEST_ARGS
        return subprocess.run([py, "-m", "pytest", *args, *rest], check=False, cwd=ROOT, env=env).returncode
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
