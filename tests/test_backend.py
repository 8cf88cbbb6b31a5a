"""mm3lab.backend: one place decides how kernels run (compiled Triton, interpreter, PyTorch)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import mm3lab
from mm3lab import backend, reference
from mm3lab.layout import kernel as layout_kernel
from mm3lab.layout import reference as layout_reference
from mm3lab.testing import assert_equal_int

HAS_CUDA = torch.cuda.is_available()


def test_get_backend_is_a_known_backend():
    assert mm3lab.get_backend() in backend.BACKENDS
    assert mm3lab.get_backend() == backend.get_backend()
    assert set(backend.available_backends()) <= set(backend.BACKENDS)
    assert "torch" in backend.available_backends()
    assert mm3lab.get_backend() in backend.available_backends()


def test_default_backend_matches_the_machine():
    if os.environ.get(backend.ENV_VAR):
        pytest.skip(f"{backend.ENV_VAR} is set for this run")
    assert mm3lab.get_backend() == ("triton" if HAS_CUDA else "interpret")


@pytest.mark.skipif(HAS_CUDA, reason="checks the CPU-only set-up")
def test_interpreter_is_on_without_a_gpu():
    assert os.environ.get("TRITON_INTERPRET") == "1"
    assert backend.INTERPRETER
    assert backend.available_backends() == ("interpret", "torch")


def test_set_and_use_backend_restore():
    before = mm3lab.get_backend()
    with mm3lab.use_backend("torch"):
        assert mm3lab.get_backend() == "torch"
        assert not backend.use_kernel(torch.zeros(1))
    assert mm3lab.get_backend() == before
    with pytest.raises(RuntimeError):
        with mm3lab.use_backend("torch"):
            raise RuntimeError("inside")
    assert mm3lab.get_backend() == before
    mm3lab.set_backend("torch")
    try:
        assert mm3lab.get_backend() == "torch"
    finally:
        mm3lab.set_backend(before)


@pytest.mark.parametrize("name", ["cuda", "TORCH", "", "numpy"])
def test_bad_backend_names_raise(name):
    before = mm3lab.get_backend()
    with pytest.raises(ValueError, match="backend"):
        mm3lab.set_backend(name)
    assert mm3lab.get_backend() == before


def test_unavailable_backend_raises_clearly():
    missing = "triton" if backend.INTERPRETER else "interpret"
    with pytest.raises(ValueError, match=f"backend '{missing}' is not available"):
        mm3lab.set_backend(missing)


def test_info_keys():
    data = mm3lab.info()
    for key in (
        "mm3lab",
        "python",
        "torch",
        "triton",
        "cuda_available",
        "device",
        "backend",
        "triton_interpreter",
        "available_backends",
        "compute_capability",
        "shared_memory_per_program",
        "fp8_kernels",
    ):
        assert key in data, key
    assert data["backend"] == mm3lab.get_backend()
    assert data["cuda_available"] is HAS_CUDA
    assert data["mm3lab"] == mm3lab.__version__
    assert data["triton_interpreter"] is backend.INTERPRETER


def test_use_kernel_rules(kernel_backend):
    cpu = torch.zeros(1)
    with mm3lab.use_backend(kernel_backend):
        # compiled Triton needs CUDA memory: CPU tensors take the PyTorch path there
        assert backend.use_kernel(cpu) is (kernel_backend == "interpret")
        if HAS_CUDA:
            assert backend.use_kernel(cpu.cuda())
    with mm3lab.use_backend("torch"):
        assert not backend.use_kernel(cpu)


def _write_case(device):
    cache = mm3lab.allocate_kv_cache(2, 2, 8, "packed", device=device, fill=0.0)
    key = torch.arange(4 * 2 * 8, dtype=torch.float32, device=device).reshape(4, 2, 8)
    slots = torch.tensor([0, 130, -1, 255], device=device)
    return cache, key, slots


def test_torch_backend_routes_write_kv_through_the_reference(device, monkeypatch):
    calls = {"kernel": 0, "reference": 0}

    def no_kernel(*args, **kwargs):
        calls["kernel"] += 1
        raise AssertionError("the Triton kernel ran on the torch backend")

    real_reference = layout_reference.write_kv_page16

    def spy(*args, **kwargs):
        calls["reference"] += 1
        return real_reference(*args, **kwargs)

    monkeypatch.setattr(layout_kernel, "write_kv_page16_kernel", no_kernel)
    monkeypatch.setattr(layout_reference, "write_kv_page16", spy)
    cache, key, slots = _write_case(device)
    with mm3lab.use_backend("torch"):
        mm3lab.write_kv_page16(key, key + 1, cache.k_cache, cache.v_cache, slots)
    assert calls == {"kernel": 0, "reference": 1}


def test_kernel_backend_runs_the_kernel_and_agrees(device, kernel_backend, monkeypatch):
    calls = []
    real_kernel = layout_kernel.write_kv_page16_kernel
    monkeypatch.setattr(layout_kernel, "write_kv_page16_kernel", lambda *a: calls.append(1) or real_kernel(*a))
    results = {}
    for name in (kernel_backend, "torch"):
        cache, key, slots = _write_case(device)
        with mm3lab.use_backend(name):
            mm3lab.write_kv_page16(key, key + 1, cache.k_cache, cache.v_cache, slots)
        results[name] = cache.kv
    # compiled Triton takes CUDA tensors only; CPU tensors go to the PyTorch path there
    expected = [1] if (kernel_backend == "interpret" or device == "cuda") else []
    assert calls == expected, "the kernel path did not dispatch as documented"
    assert_equal_int(results[kernel_backend].view(torch.int32), results["torch"].view(torch.int32), "kv")
    # and the reference module agrees with both
    cache, key, slots = _write_case(device)
    reference.write_kv_page16(key, key + 1, cache.k_cache, cache.v_cache, slots)
    assert torch.equal(cache.kv, results["torch"])


def _python(code: str, backend_value: str | None):
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    if backend_value is None:
        env.pop(backend.ENV_VAR, None)
    else:
        env[backend.ENV_VAR] = backend_value
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_env_var_selects_the_torch_backend():
    out = _python("import mm3lab; print(mm3lab.get_backend())", "torch")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "torch"


def test_env_var_bad_value_fails_clearly():
    out = _python("import mm3lab", "fast")
    assert out.returncode != 0
    assert "MM3LAB_BACKEND='fast'" in out.stderr
    assert "triton, interpret, torch" in out.stderr


@pytest.mark.skipif(HAS_CUDA, reason="checks the CPU-only set-up")
def test_env_var_triton_without_a_gpu_fails_clearly():
    out = _python("import mm3lab", "triton")
    assert out.returncode != 0
    assert "needs a CUDA GPU" in out.stderr


# --- no silent fallbacks (SPEC 7) -------------------------------------------------------------


def test_fallbacks_are_recorded_and_logged_once(device, kernel_backend, caplog):
    topk_idx = torch.full((1, 2, 513), -1, dtype=torch.int32, device=device)
    topk_idx[:, :, 0] = 0
    block_table = torch.tensor([[3]], dtype=torch.int32, device=device)
    seq_lens = torch.tensor([2], dtype=torch.int32, device=device)
    want = "cpu-tensors" if kernel_backend == "triton" and device == "cpu" else "topk-over-512"
    name = "build_sparse_block_table_decode"
    caplog.set_level("INFO", logger="mm3lab")
    with mm3lab.use_backend(kernel_backend):
        with backend.record_fallbacks() as taken:
            first = mm3lab.build_sparse_block_table_decode(topk_idx, block_table, seq_lens, 2)
            mm3lab.build_sparse_block_table_decode(topk_idx, block_table, seq_lens, 2)
        assert taken == {name: want}
    assert backend.fallbacks_taken()[name] == want
    assert want in backend.FALLBACK_RULES
    assert_equal_int(first[1], reference.build_sparse_block_table_decode(topk_idx, block_table, seq_lens, 2)[1])
    logged = [r for r in caplog.records if r.name == "mm3lab" and name in r.getMessage()]
    assert len(logged) <= 1  # once per process: an earlier test may already have logged it
    with mm3lab.use_backend("torch"), backend.record_fallbacks() as taken:
        mm3lab.build_sparse_block_table_decode(topk_idx, block_table, seq_lens, 2)
    assert taken == {}  # choosing the PyTorch backend is not a fallback


def test_bf16_in_the_interpreter_is_a_named_fallback():
    if not backend.INTERPRETER:
        pytest.skip("only the interpreter falls back for bfloat16")
    scores = torch.randn(3, 40).to(torch.bfloat16)
    with backend.record_fallbacks() as taken:
        got = mm3lab.topk_blocks(scores, 4)
    assert taken == {"topk_blocks": "bf16-interpreter"}
    assert_equal_int(got, reference.topk_blocks(scores, 4))


def test_fallback_rules_are_listed_by_info():
    data = mm3lab.info()
    assert len(data["fallback_rules"]) == len(backend.FALLBACK_RULES)
    for name, line in zip(backend.FALLBACK_RULES, data["fallback_rules"], strict=True):
        assert line.startswith(name + ": ")
    with pytest.raises(ValueError, match="fallback rule"):
        backend.fallback_taken("sparse_attention", "no-such-rule")


def test_fallbacks_taken_reset_reports_only_what_came_after():
    if not backend.INTERPRETER:
        pytest.skip("the bfloat16 rule applies to the interpreter only")
    scores = torch.randn(2, 20).to(torch.bfloat16)
    mm3lab.topk_blocks(scores, 3)
    assert backend.fallbacks_taken(reset=True)["topk_blocks"] == "bf16-interpreter"
    assert backend.fallbacks_taken() == {}
    mm3lab.topk_blocks(scores.float(), 3)  # the kernel: nothing taken
    assert backend.fallbacks_taken() == {}
    mm3lab.topk_blocks(scores, 3)
    assert backend.fallbacks_taken() == {"topk_blocks": "bf16-interpreter"}


def test_benchmark_records_name_the_fallbacks_since_the_last_record():
    if not backend.INTERPRETER:
        pytest.skip("the bfloat16 rule applies to the interpreter only")
    from benchmarks.common import fallback_reason

    fallback_reason()  # forget what earlier tests took
    assert fallback_reason() is None
    mm3lab.topk_blocks(torch.randn(2, 20).to(torch.bfloat16), 3)
    assert fallback_reason() == "topk_blocks: bf16-interpreter"
    assert fallback_reason() is None


def test_a_plan_on_the_pytorch_path_names_its_rule():
    if not backend.INTERPRETER:
        pytest.skip("the bfloat16 rule applies to the interpreter only")
    from mm3lab.msa import synthetic_layer
    from mm3lab.testing import plan_sizes

    layer = synthetic_layer(200, dtype=torch.bfloat16)
    with backend.record_fallbacks() as taken:
        plan = mm3lab.MSADecodePlan(layer.cache.k_cache, layer.cache.v_cache, layer.index_cache, **plan_sizes(layer))
    assert not plan.uses_kernels
    assert taken == {"MSADecodePlan": "bf16-interpreter"}


def test_launch_arithmetic_matches_tritons():
    """``mm3lab._grid`` replaces Triton's constexpr functions on the host: the same value for every input."""
    import triton

    from mm3lab._grid import cdiv, next_power_of_2

    values = [*range(0, 4100), 2**31 - 1, 2**31, 2**31 + 1, 2**40 + 3]
    for n in values:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
    for x in values[::7]:
        for y in (1, 2, 3, 16, 128, 1000):
            assert cdiv(x, y) == triton.cdiv(x, y), (x, y)


class _FakeCudaTensor:
    """What :func:`mm3lab.backend.fp8_unsupported` reads of a tensor, for a GPU this machine may not have."""

    def __init__(self, dtype):
        self.dtype, self.is_cuda, self.device = dtype, True, torch.device("cuda", 0)


@pytest.mark.parametrize(
    "capability, dtype, rule",
    [
        ((8, 0), torch.float8_e4m3fn, "fp8-unsupported-gpu"),  # A100
        ((8, 6), torch.float8_e4m3fn, "fp8-unsupported-gpu"),  # RTX 30xx, A10, A40
        ((8, 9), torch.float8_e4m3fn, None),  # RTX 40xx, L4, L40S
        ((9, 0), torch.float8_e4m3fn, None),  # H100, H200
        ((8, 0), torch.bfloat16, None),
    ],
)
def test_fp8_caches_take_the_pytorch_path_below_capability_8_9(monkeypatch, capability, dtype, rule):
    monkeypatch.setattr(backend, "_capability", lambda index: capability)
    assert backend.fp8_unsupported(torch.zeros(1), _FakeCudaTensor(dtype)) == rule
    assert backend.fp8_unsupported(torch.zeros(1, dtype=torch.float8_e4m3fn)) is None  # CPU: the interpreter's
    assert "fp8-unsupported-gpu" in backend.FALLBACK_RULES


def test_shared_memory_has_no_limit_off_a_gpu():
    assert backend.shared_memory_per_program(torch.device("cpu")) is None


class _FakeKernel:
    """A launchable that, like Triton, refuses a launch needing more shared memory than ``limit``
    (``per_stage`` bytes per ``num_stages``)."""

    __name__ = "_fake"

    def __init__(self, limit, per_stage=40_000):
        self.limit, self.per_stage, self.launched = limit, per_stage, []

    def __getitem__(self, grid):
        def launch(*args, num_stages, **kwargs):
            from triton.runtime.errors import OutOfResources

            if num_stages * self.per_stage > self.limit:
                raise OutOfResources(num_stages * self.per_stage, self.limit, "shared memory")
            self.launched.append(num_stages)

        return launch


@pytest.mark.parametrize("limit, depth", [(232448, 5), (166912, 4), (101376, 2), (60_000, 1)])
def test_a_launch_comes_down_to_the_depth_that_fits(monkeypatch, limit, depth):
    from mm3lab import _fit

    monkeypatch.setattr(_fit, "_chosen", {})
    kernel = _FakeKernel(limit)
    for _ in range(3):
        _fit.fitting(kernel, "num_stages", (5, 4, 3, 2, 1))[(1,)](torch.zeros(1), BLOCK=16)
    assert kernel.launched == [depth] * 3
    # remembered: later launches of that configuration go straight to it, others start again from the top
    assert _fit.chosen() == ({} if depth == 5 else {("_fake", "num_stages"): depth})
    if depth < 5:
        _fit.fitting(kernel, "num_stages", (5, 4, 3, 2, 1))[(1,)](torch.zeros(1, dtype=torch.float16), BLOCK=16)
        assert kernel.launched[-1] == depth and len(_fit.chosen()) == 1  # (chosen(): by kernel and option)


def test_a_launch_that_fits_at_no_depth_says_why(monkeypatch):
    from mm3lab import _fit

    monkeypatch.setattr(_fit, "_chosen", {})
    with pytest.raises(RuntimeError, match="needs 40000 B of shared memory even with num_stages=1"):
        _fit.fitting(_FakeKernel(30_000), "num_stages", (2, 1))[(1,)](torch.zeros(1))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_this_gpus_shared_memory_and_fp8_are_read():
    device = torch.device("cuda")
    assert backend.shared_memory_per_program(device) >= 48 * 1024
    fp8 = torch.zeros(1, dtype=torch.float8_e4m3fn, device=device)
    expected = None if torch.cuda.get_device_capability() >= backend.FP8_CAPABILITY else "fp8-unsupported-gpu"
    assert backend.fp8_unsupported(fp8) == expected
