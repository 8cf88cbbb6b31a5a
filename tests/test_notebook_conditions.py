"""The notebook checks (nbval) under conditions that differ from the developer's machine.

A checked output must not depend on the thread count or on torch's matmul settings. Each
case runs nbval over every notebook in a subprocess whose kernels inherit the condition:

* ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS`` set the thread count of torch's CPU kernels;
* torch's settings come from an IPython startup file (a temporary ``IPYTHONDIR``), so
  the kernel applies them before the notebook's first cell: ``deterministic`` is
  ``torch.use_deterministic_algorithms(True)`` with fp32 matmuls at ``"highest"``
  precision; ``default`` changes nothing.

Two runs cover both values of both factors (1 thread + deterministic, 2 threads +
default), which keeps the file to about two notebook runs on a 2-core CI machine. The
startup file writes what it applied, and the test checks that every kernel applied it.

Deselect with ``-m "not notebook_conditions"`` for a quick run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CELL_TIMEOUT_S = 120

STARTUP = """\
import json, os
import torch
mode = os.environ["MM3LAB_TORCH_MODE"]
if mode == "deterministic":
    torch.use_deterministic_algorithms(True)
    torch.set_float32_matmul_precision("highest")
with open(os.environ["MM3LAB_CONDITIONS_LOG"], "a") as f:
    f.write(json.dumps({"mode": mode, "threads": torch.get_num_threads(),
                        "deterministic": torch.are_deterministic_algorithms_enabled()}) + "\\n")
"""

CONDITIONS = [("1", "deterministic"), ("2", "default")]


@pytest.mark.notebook_conditions
@pytest.mark.parametrize(("threads", "mode"), CONDITIONS, ids=[f"threads{t}-{m}" for t, m in CONDITIONS])
def test_notebooks_pass_under_condition(tmp_path, threads, mode):
    startup = tmp_path / "ipython" / "profile_default" / "startup"
    startup.mkdir(parents=True)
    (startup / "00-condition.py").write_text(STARTUP)
    log = tmp_path / "applied.jsonl"
    env = dict(
        os.environ,
        OMP_NUM_THREADS=threads,
        MKL_NUM_THREADS=threads,
        MM3LAB_TORCH_MODE=mode,
        MM3LAB_CONDITIONS_LOG=str(log),
        IPYTHONDIR=str(tmp_path / "ipython"),
        MPLBACKEND="Agg",
        PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:xdist",
        "--nbval",
        "--nbval-current-env",
        "--nbval-sanitize-with",
        "tests/nbval_sanitize.cfg",
        f"--nbval-cell-timeout={CELL_TIMEOUT_S}",
        "notebooks",
    ]
    proc = subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, (
        f"nbval failed with OMP_NUM_THREADS={threads} and torch {mode}: a checked output depends on the "
        f"machine (round it, or print a comparison against a tolerance):\n{proc.stdout[-6000:]}{proc.stderr[-2000:]}"
    )
    applied = [json.loads(line) for line in log.read_text().splitlines()]
    notebooks = sorted((ROOT / "notebooks").glob("*.ipynb"))
    assert len(applied) == len(notebooks), applied  # one kernel per notebook, each under the condition
    assert all(a["threads"] == int(threads) and a["deterministic"] == (mode == "deterministic") for a in applied)
