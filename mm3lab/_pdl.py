"""Programmatic dependent launch (PDL): a kernel of the MSA step starts while the kernel before it ends.

On Hopper and later GPUs (compute capability 9.0 and up), a kernel launched with the PDL attribute
may be placed on the SMs before the kernel ahead of it on the stream has finished. Its programs
then stop at ``griddepcontrol.wait``, which returns once that kernel has completed and its writes
are visible. At batch 1 every kernel of a decode step is latency-bound, and a kernel's launch (its
programs put on the SMs, its arguments loaded) would otherwise start only after the previous kernel
has drained; with PDL it overlaps it. CUDA graphs keep the attribute as a programmatic edge.

The rule that keeps this exact: a kernel launched with PDL waits (:func:`wait_previous`) before it
reads or writes any tensor, so it sees everything every earlier kernel wrote, as without PDL. The
wait is the first statement of each such kernel; right after it, the kernel lets its own dependent
start (``griddepcontrol.launch_dependents``). That dependent's wait still returns only once this
whole kernel has finished.

The kernels that take part are the five launches of a planned step (the fused insert, the indexer
scores, the top-k with the sparse block table, the per-row attention and, in a CUDA graph, its split
merge; eager calls merge in the attention launch), which
the one-shot entry points launch too. :func:`options` gives their launch keywords: the ``PDL``
constexpr, which compiles the wait in, and Triton's ``launch_pdl``, which sets the attribute. They
go together, so a kernel launched with the attribute always waits. Set :data:`ENABLED` to ``False``
to launch without PDL (the benchmarks compare both; recorded launches follow the setting, since a
recording made under the other one is recorded again); results are the same bit for bit.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from . import backend

ENABLED = True
"""Launch the step's kernels with PDL where the GPU has it (:data:`CAPABILITY`); ``False``: never."""

CAPABILITY = (9, 0)
"""The first compute capability with programmatic dependent launch (Hopper)."""

if backend.INTERPRETER:  # (the interpreter never takes the PDL branch, and has no inline assembly)
    gdc_wait = gdc_launch_dependents = None
else:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


def enabled(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with PDL: :data:`ENABLED`, compiled, a GPU of :data:`CAPABILITY`."""
    if not ENABLED or backend.INTERPRETER or device.type != "cuda":
        return False
    return backend.capability(device) >= CAPABILITY


def options(device: torch.device) -> dict:
    """The launch keywords of a PDL kernel on ``device``: ``PDL`` (the constexpr of :func:`wait_previous`)
    and, where :func:`enabled`, Triton's ``launch_pdl``."""
    return {"PDL": True, "launch_pdl": True} if enabled(device) else {"PDL": False}


@contextlib.contextmanager
def switched(on: bool):
    """Context manager: :data:`ENABLED` set to ``on`` inside (a recording of launches made under the other
    setting is not replayed: those calls record again, :mod:`mm3lab._replay`)."""
    global ENABLED
    previous, ENABLED = ENABLED, bool(on)
    try:
        yield
    finally:
        ENABLED = previous


@triton.jit
def wait_previous(PDL: tl.constexpr):
    """Where ``PDL``: wait for the previous kernel on the stream, then let the next one launch (see the module)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


__all__ = ["CAPABILITY", "ENABLED", "enabled", "options", "switched", "wait_previous"]
