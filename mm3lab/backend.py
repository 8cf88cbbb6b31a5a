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

No silent fallbacks (SPEC 7): a call on a kernel backend that runs the PyTorch path
instead names its rule (:data:`FALLBACK_RULES`), logs it once per entry point through
the ``"mm3lab"`` logger (level INFO), and is remembered: :func:`fallbacks_taken` for the
whole process, :func:`record_fallbacks` for a block of code (the benchmarks mark their
records with it). ``mm3lab info`` lists the rules. Choosing the ``"torch"`` backend is
not a fallback.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import platform
import sys

import torch

BACKENDS = ("triton", "interpret", "torch")
ENV_VAR = "MM3LAB_BACKEND"

logger = logging.getLogger("mm3lab")

FALLBACK_RULES = {
    "cpu-tensors": "backend 'triton' with CPU tensors: the PyTorch path (compiled kernels need CUDA memory)",
    "bf16-interpreter": "bfloat16 under Triton's interpreter: the PyTorch path (its bf16 arithmetic is not exact)",
    "fp32-wide-index-heads": "float32 index queries with more than 16 index heads, compiled: the PyTorch scoring path "
    "(float32 score tiles stay at 16 lanes)",
    "topk-over-512": "topk > 512 in the sparse block table: the PyTorch path "
    "(the kernel holds a row's ids in registers)",
    "tile-prepass-interpreter": "the tiled prefill's pre-pass under Triton's interpreter: the PyTorch pre-pass "
    "(the same tables; the interpreter's sort is slow); the attention itself stays the kernel",
    "fp8-unsupported-gpu": "an FP8 cache on a GPU without FP8 (compute capability below 8.9: A100, RTX 30xx, A10, "
    "A40): the PyTorch path, which dequantizes (Triton has no float8_e4m3fn there)",
}
"""Every rule by which a kernel entry point runs PyTorch instead (SPEC 7): name -> what and why."""

_fallbacks: dict[str, str] = {}
_logged: set[tuple[str, str]] = set()
_recorders: list[dict[str, str]] = []

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


def use_kernel(*tensors: torch.Tensor, entry_point: str | None = None, fallback: str | None = None) -> bool:
    """Whether a call on these tensors runs the Triton kernel (else the PyTorch path).

    ``fallback``: a :data:`FALLBACK_RULES` name the caller found to apply (or None). On a kernel
    backend, a fallback of ``entry_point`` is recorded and logged (:func:`fallback_taken`).
    """
    if _backend == "torch":
        return False
    if _backend == "triton" and not all(t.is_cuda for t in tensors):
        fallback = "cpu-tensors"
    elif fallback is None and _backend == "triton":
        fallback = fp8_unsupported(*tensors)
    if fallback is None:
        return True
    if entry_point is not None:
        fallback_taken(entry_point, fallback)
    return False


FP8_CAPABILITY = (8, 9)
"""The first CUDA compute capability with float8_e4m3fn (Ada; Hopper is 9.0): Triton compiles FP8 from here up."""


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def capability(device: torch.device) -> tuple[int, int]:
    """The CUDA compute capability of a GPU ``device`` (cached)."""
    return _capability(_index(device))


def fp8_unsupported(*tensors: torch.Tensor) -> str | None:
    """``"fp8-unsupported-gpu"`` when one of ``tensors`` is a float8_e4m3fn CUDA tensor on a GPU below
    :data:`FP8_CAPABILITY`, else None."""
    for t in tensors:
        if t.dtype == torch.float8_e4m3fn and t.is_cuda and _capability(_index(t.device)) < FP8_CAPABILITY:
            return "fp8-unsupported-gpu"
    return None


@functools.cache
def _shared_memory(index: int) -> int:
    from triton.runtime import driver

    return int(driver.active.utils.get_device_properties(index)["max_shared_mem"])


def shared_memory_per_program(device: torch.device) -> int | None:
    """Bytes of shared memory one compiled program may use on ``device`` (the opt-in limit a launch is checked
    against: 227 KiB on an H100/H200, 163 KiB on an A100, 99 KiB on RTX 30xx/40xx, A10, L4, L40S); ``None``
    where kernels are interpreted or the device is no GPU (no limit)."""
    if INTERPRETER or device.type != "cuda":
        return None
    return _shared_memory(_index(device))


def bf16_interpreted(dtype: torch.dtype) -> str | None:
    """``"bf16-interpreter"`` when ``dtype`` is bfloat16 and kernels are interpreted, else None."""
    return "bf16-interpreter" if INTERPRETER and dtype == torch.bfloat16 else None


def fallback_taken(entry_point: str, rule: str) -> None:
    """Note that ``entry_point`` ran the PyTorch path by ``rule``; logged once per (entry point, rule)."""
    if rule not in FALLBACK_RULES:
        raise ValueError(f"fallback rule: expected one of {', '.join(FALLBACK_RULES)}, got {rule!r}")
    for record in _recorders:
        record.setdefault(entry_point, rule)
    _fallbacks[entry_point] = rule
    if (entry_point, rule) in _logged:
        return
    _logged.add((entry_point, rule))
    logger.info("mm3lab.%s runs the PyTorch path: %s", entry_point, FALLBACK_RULES[rule])


def fallbacks_taken(reset: bool = False) -> dict[str, str]:
    """Entry point -> rule name of the PyTorch fallbacks taken in this process (the latest rule of each).

    ``reset=True`` also forgets them, so the next call reports only what was taken after this one
    (the benchmarks mark each record this way). The log lines stay once per process.
    """
    taken = dict(_fallbacks)
    if reset:
        _fallbacks.clear()
    return taken


@contextlib.contextmanager
def record_fallbacks():
    """Context manager yielding a dict filled with the fallbacks (entry point -> rule) taken inside it."""
    record: dict[str, str] = {}
    _recorders.append(record)
    try:
        yield record
    finally:
        _recorders.remove(record)


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
        "compute_capability": ".".join(map(str, _capability(0))) if _CUDA else None,
        "shared_memory_per_program": shared_memory_per_program(torch.device("cuda", 0)) if _CUDA else None,
        "fp8_kernels": (_capability(0) >= FP8_CAPABILITY) if _CUDA else INTERPRETER,
        "backend": _backend,
        "triton_interpreter": INTERPRETER,
        "available_backends": list(available_backends()),
        "fallback_rules": [f"{name}: {text}" for name, text in FALLBACK_RULES.items()],
        "fallbacks_taken": fallbacks_taken(),
    }
