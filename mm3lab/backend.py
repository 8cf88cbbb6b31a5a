"""How mm3lab kernels run: decided once, in this one place.

Three backends exist:

``"triton"``
    Compiled Triton kernels on a CUDA GPU. The default when PyTorch sees a GPU.
``"interpret"``
    The same Triton kernels run by Triton's interpreter on the CPU
    (``TRITON_INTERPRET=1``). The default without a GPU. Slow (about a
    millisecond per program) but it executes the real kernel code, so CPU tests
    exercise exactly what the GPU runs. bf16 arithmetic is not exact there:
    use fp32 or fp16 on this backend.
``"torch"``
    The pure-PyTorch reference of every step (``mm3lab.reference``), on any
    device.

Choose with the environment variable ``MM3LAB_BACKEND`` (read when mm3lab is
first imported) or at run time with :func:`set_backend` / :func:`use_backend`.
Triton decides between compiling and interpreting when a ``@triton.jit``
function is *defined*, so this module sets ``TRITON_INTERPRET`` before any
mm3lab kernel module imports Triton. Consequently ``"interpret"`` can only be
selected at run time if it was in force at import (always true on a machine
without a GPU), and ``"triton"`` only on a GPU with the interpreter off.

With the ``"triton"`` backend, CPU tensors are handled by the PyTorch path:
the compiled kernels need CUDA memory.
"""

from __future__ import annotations

import contextlib
import os
import platform
import sys

import torch

BACKENDS = ("triton", "interpret", "torch")
ENV_VAR = "MM3LAB_BACKEND"

_CUDA = torch.cuda.is_available()


def _initial_backend() -> str:
    requested = os.environ.get(ENV_VAR, "").strip().lower()
    if requested and requested not in BACKENDS:
        raise ValueError(f"{ENV_VAR}={requested!r}: expected one of {', '.join(BACKENDS)}")
    if not requested:
        requested = "triton" if _CUDA else "interpret"
    if requested == "triton" and not _CUDA:
        raise RuntimeError(
            f"{ENV_VAR}=triton needs a CUDA GPU and PyTorch sees none; "
            "use 'interpret' (Triton's interpreter) or 'torch'"
        )
    if requested == "interpret" or not _CUDA:
        # Without a GPU the interpreter is the only way a Triton kernel can run.
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(
                "triton was imported before mm3lab with TRITON_INTERPRET unset; "
                "import mm3lab first or set TRITON_INTERPRET=1"
            )
        os.environ["TRITON_INTERPRET"] = "1"
    return requested


_backend = _initial_backend()
INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
"""True when Triton kernels in this process are run by the interpreter."""


def get_backend() -> str:
    """The backend in force: ``"triton"``, ``"interpret"`` or ``"torch"``."""
    return _backend


def available_backends() -> tuple[str, ...]:
    """The backends :func:`set_backend` accepts in this process."""
    return ("interpret", "torch") if INTERPRETER else ("triton", "torch")


def set_backend(name: str) -> None:
    """Select the backend for every later call (see the module docstring)."""
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"backend: expected one of {', '.join(BACKENDS)}, got {name!r}")
    if name not in available_backends():
        why = (
            "Triton kernels in this process are interpreted (no GPU, or MM3LAB_BACKEND=interpret at import)"
            if INTERPRETER
            else "the interpreter was off when mm3lab was imported; set MM3LAB_BACKEND=interpret before importing"
        )
        raise ValueError(f"backend {name!r} is not available here: {why}")
    _backend = name


@contextlib.contextmanager
def use_backend(name: str):
    """Context manager: run the enclosed calls on backend ``name``."""
    previous = _backend
    set_backend(name)
    try:
        yield
    finally:
        set_backend(previous)


def use_kernel(*tensors: torch.Tensor) -> bool:
    """Whether a call on these tensors runs the Triton kernel (else the PyTorch path)."""
    if _backend == "torch":
        return False
    if _backend == "triton":
        return all(t.is_cuda for t in tensors)
    return True


def info() -> dict:
    """Versions, device and backend, as ``mm3lab info`` prints them."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:  # pragma: no cover - triton is a dependency
        triton_version = None
    from . import __version__

    return {
        "mm3lab": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda_available": _CUDA,
        "device": torch.cuda.get_device_name(0) if _CUDA else f"cpu ({platform.machine()}, {os.cpu_count()} cores)",
        "backend": _backend,
        "triton_interpreter": INTERPRETER,
        "available_backends": list(available_backends()),
    }
