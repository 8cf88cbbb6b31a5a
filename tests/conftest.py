"""Shared fixtures: devices, backends, hypothesis profiles.

* ``device``: ``"cpu"`` always, plus ``"cuda"`` (marked ``gpu``) where a GPU is present.
  On CPU, kernels run in Triton's interpreter; on CUDA, compiled.
* ``-m gpu`` selects only the CUDA cases: that is the GPU test run.
* Hypothesis: profile ``ci`` (default) keeps CPU runs bounded; ``MM3LAB_HYPOTHESIS=thorough``
  runs more examples.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

import mm3lab  # noqa: F401  (sets the backend before triton is imported)

HAS_CUDA = torch.cuda.is_available()

settings.register_profile(
    "ci",
    max_examples=int(os.environ.get("MM3LAB_HYPOTHESIS_EXAMPLES", "60")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True,
)
settings.register_profile("thorough", max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("MM3LAB_HYPOTHESIS", "ci"))

LONGEST_FIRST = (
    "tests/test_gpu_compile.py",
    "tests/test_gpu_compile_other_gpus.py",
    "tests/test_fp8_attention.py",
    "tests/test_notebook_conditions.py",
    "tests/test_attention_fused_checks.py",
    "tests/test_benchmarks_smoke.py",
    "tests/test_attention_tiled.py",
)
"""Test files that take the most time, in that order (their compiles, interpreted kernels and notebook
reruns take minutes on a 2-core machine). They are collected first, so that pytest-xdist's
``--dist loadfile --no-loadscope-reorder`` (``run.py``) hands them out first and the remaining files
fill in beside them, rather than a worker starting a long file when the other has nothing left."""


def pytest_collection_modifyitems(config, items):
    """The files of :data:`LONGEST_FIRST` first, in its order; every other item keeps its place."""
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]),
]


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    """Run a test on the CPU (interpreted kernels) and, where present, the GPU (compiled)."""
    return request.param


@pytest.fixture
def kernel_backend():
    """The backend whose kernels run on this machine: 'triton' on a GPU, 'interpret' without."""
    return "interpret" if mm3lab.backend.INTERPRETER else "triton"


@pytest.fixture
def draw_widget():
    """``draw_widget(w)`` draws widget ``w`` (``w.update()``) and returns its labelled controls by
    description and the figure it drew."""

    def draw(w):
        w.update()
        return {c.description: c for c in w.children if getattr(c, "description", "")}, w.result

    return draw


@pytest.fixture(autouse=True)
def _fresh_call_memos():
    """Each test starts with no kept call shapes (``mm3lab._replay.Memo``): a test that changes a
    module-level setting deciding launches must not replay a call shape recorded by another test."""
    from mm3lab import _replay

    _replay.clear_memos()
