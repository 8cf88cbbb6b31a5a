"""Every Triton kernel the package launches compiles for the GPUs people run it on, on any machine.

CPU runs execute the kernels in Triton's interpreter, which accepts some programs that the
GPU compiler rejects. ``tests/gpu_compile.py`` compiles each kernel specialization that the
public entry points launch, at the model's shapes, into a real binary for one architecture
(no GPU needed), and checks that it fits the shared memory that architecture gives a program.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "gpu_compile.py"


def _nvidia_backend() -> str | None:
    """Why sm_90 binaries cannot be built here, or None when they can."""
    import triton

    try:
        from triton.backends import backends
    except ImportError:  # pragma: no cover - every supported Triton has it
        return "this Triton has no backend registry"
    if "nvidia" not in backends:
        return "this Triton build has no NVIDIA backend"
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        return "this Triton build carries no ptxas"
    return None


def _run(*args: str) -> str:
    why = _nvidia_backend()
    if why:
        pytest.skip(why)
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "MM3LAB_BACKEND")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800
    )
    report = done.stdout + done.stderr
    assert done.returncode == 0, report
    return report


def test_the_check_catches_what_the_interpreter_accepts():
    """An 8 x 8 ``tl.dot`` runs in the interpreter and fails for sm_90; 16 x 16 compiles."""
    assert "failed for B=[8], compiled for B=[16]" in _run("--self-test")


def check_compiles(arch: int, dtypes: tuple) -> None:
    """Every specialization compiles for ``sm_{arch}`` and fits its shared memory (``dtypes``: all when empty)."""
    report = _run("--arch", str(arch), *(("--dtypes", *dtypes) if dtypes else ()))
    assert f"sm_{arch}" in report and "specializations compiled" in report, report
    assert "FAILED" not in report and "NOT COVERED" not in report, report


def test_every_kernel_compiles_for_sm_90():
    """H100 / H200, every dtype: the GPU the results are measured on (the other GPUs:
    ``test_gpu_compile_other_gpus.py``, a file of its own so that the two run side by side)."""
    check_compiles(90, ())
