"""The compile check of ``test_gpu_compile.py`` for GPUs other than the H100 / H200 the results are
measured on (marker ``other_gpus``: ``test-newest`` leaves them to ``test``). A file of its own, so that
pytest-xdist runs it beside the sm_90 check, both first (``tests/conftest.py``)."""

from __future__ import annotations

import pytest
from test_gpu_compile import check_compiles

pytestmark = pytest.mark.other_gpus


@pytest.mark.parametrize(
    "arch, dtypes",
    [
        (89, ("fp32", "fp8")),  # RTX 40xx, L4, L40S: 99 KiB of shared memory per program; FP8 without wgmma
        (80, ("bf16", "fp32")),  # A100: no FP8 (those calls take the PyTorch path), 163 KiB per program
    ],
)
def test_every_kernel_compiles(arch, dtypes):
    check_compiles(arch, dtypes)
