"""SPEC section 8: plans. Bit-identical to the one-shot functions, shapes fixed, graphs on CUDA."""

from __future__ import annotations

import pytest
import torch

import mm3lab
from mm3lab.index_cache import token_slots
from mm3lab.msa import decode_query_rows, synthetic_layer
from mm3lab.rows import rows_and_slots
from mm3lab.testing import plan_sizes, small_msa_layer

DT = torch.float32  # the interpreter's bf16 arithmetic is inexact; fp32 runs the kernels everywhere


def _clone_caches(layer):
    kv = layer.cache.kv.clone()
    views = mm3lab.page16_views(kv)
    return kv, views[0], views[1], layer.index_cache.clone()


def _caches(layer):
    """The layer's ``(k_cache, v_cache, index_cache)``: what a plan is built on and run with."""
    return layer.cache.k_cache, layer.cache.v_cache, layer.index_cache


def _decode_plan(layer, **kw):
    """An ``MSADecodePlan`` sized for ``layer``; ``kw`` adds to or overrides its sizes."""
    sizes = {**plan_sizes(layer), "decode_query_len": layer.decode_query_len}
    return mm3lab.MSADecodePlan(*_caches(layer), **{**sizes, **kw})


def _prefill_plan(layer, num_tokens, **kw):
    """An ``MSAPrefillPlan`` of ``num_tokens`` rows sized for ``layer``; ``kw`` adds to or overrides its sizes."""
    return mm3lab.MSAPrefillPlan(*_caches(layer), num_tokens=num_tokens, **{**plan_sizes(layer), **kw})


def _run_args(layer, k_cache=None, v_cache=None, index_cache=None, seq_lens=None):
    return (
        layer.q,
        layer.key,
        layer.value,
        layer.index_q,
        layer.index_k,
        layer.cache.k_cache if k_cache is None else k_cache,
        layer.cache.v_cache if v_cache is None else v_cache,
        layer.index_cache if index_cache is None else index_cache,
        layer.block_table,
        layer.seq_lens if seq_lens is None else seq_lens,
    )


@pytest.mark.parametrize("layout,dql,topk", [("packed", 1, 2), ("dense", 2, 3)])
def test_decode_plan_is_bit_identical_to_msa_decode(device, layout, dql, topk):
    layer = small_msa_layer(device, layout=layout, dql=dql)
    kv, kc, vc, ic = _clone_caches(layer)
    want = mm3lab.msa_decode(*_run_args(layer, kc, vc, ic), decode_query_len=dql, topk=topk)
    plan = _decode_plan(layer, topk=topk)
    assert plan.uses_kernels
    got = plan.run(*_run_args(layer))
    assert torch.equal(got, want)
    assert torch.equal(layer.cache.kv, kv) and torch.equal(layer.index_cache, ic)  # same cache writes
    req, pos = decode_query_rows(layer.seq_lens, dql)
    assert torch.equal(plan.req, req) and torch.equal(plan.pos, pos)
    assert torch.equal(plan.slots, token_slots(layer.block_table, req, pos))


def test_decode_plan_follows_seq_lens_without_replanning(device):
    layer = small_msa_layer(device, batch=3, context=400)
    plan = _decode_plan(layer, topk=2)
    for lens in ([400, 437, 474], [129, 1, 300], [0, 200, 0]):  # 0: a padded request (row position -1)
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
        _, kc, vc, ic = _clone_caches(layer)
        want = mm3lab.msa_decode(*_run_args(layer, kc, vc, ic, seq_lens), topk=2)
        got = plan.run(*_run_args(layer, seq_lens=seq_lens))
        assert torch.equal(got, want), lens
        assert torch.equal(plan.pos, torch.tensor([p - 1 if p else -1 for p in lens], dtype=torch.int32, device=device))


def test_prefill_plan_is_bit_identical_with_padded_rows(device):
    layer = small_msa_layer(device, batch=2, context=260)
    req = torch.tensor([0, 0, 1, 1, 0], dtype=torch.int32, device=device)
    pos = torch.tensor([255, 258, 100, -1, 259], dtype=torch.int32, device=device)
    n = req.shape[0]
    g = torch.Generator().manual_seed(3)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=DT)

    q, key, value = rnd(n, 4, 16), rnd(n, 2, 16), rnd(n, 2, 16)
    index_q, index_k = rnd(n, 2, 16), rnd(n, 16)
    _, kc, vc, ic = _clone_caches(layer)
    want = mm3lab.msa_prefill(q, key, value, index_q, index_k, kc, vc, ic, layer.block_table, req, pos, topk=2)
    plan = _prefill_plan(layer, n, topk=2)
    got = plan.run(q, key, value, index_q, index_k, *_caches(layer), layer.block_table, req, pos)
    assert torch.equal(got, want)
    assert torch.equal(plan.slots, token_slots(layer.block_table, req, pos))
    assert int(plan.slots[3]) == -1 and bool((plan.topk_idx[:, 3] == -1).all())


def test_wrong_shape_dtype_or_cache_after_planning_is_rejected(device):
    layer = small_msa_layer(device)
    plan = _decode_plan(layer, topk=2)
    args = list(_run_args(layer))
    with pytest.raises(ValueError, match="q: the MSADecodePlan was planned for shape"):
        plan.run(layer.q[:1], *args[1:])
    with pytest.raises(TypeError, match="seq_lens: .*planned for dtype int32"):
        plan.run(*args[:-1], layer.seq_lens.long())
    with pytest.raises(ValueError, match="block_table: .*planned for shape"):
        plan.run(*args[:8], layer.block_table[:, :-1], args[9])
    other = mm3lab.allocate_kv_cache(layer.cache.kv.shape[0] + 1, 2, 16, "packed", dtype=DT, device=device)
    with pytest.raises(ValueError, match="k_cache: .*planned for a cache of shape"):
        plan.run(*args[:5], other.k_cache, other.v_cache, *args[7:])


def test_value_checks_run_while_validation_is_on(device):
    layer = small_msa_layer(device)
    plan = _decode_plan(layer, topk=2)
    too_long = torch.tensor([10_000, 300], dtype=torch.int32, device=device)
    before = layer.cache.kv.clone()
    with pytest.raises(ValueError, match="seq_lens"):
        plan.run(*_run_args(layer, seq_lens=too_long))
    assert torch.equal(layer.cache.kv, before)


def _kept_plan_checks() -> int:
    """How many of this thread's kept value-check launches are a plan's (mm3lab._valcheck.flags_known)."""
    from mm3lab import _valcheck

    known = getattr(_valcheck._buffers, "known", None) or {}
    return sum(1 for k in known if any(isinstance(part, tuple) and part[:1] == ("plan",) for part in k))


@pytest.mark.parametrize("prefill", [False, True])
def test_repeated_runs_check_their_values_every_run(device, prefill):
    """A run with the tensors of an earlier run (addresses and strides) launches that run's kept value
    check on a GPU, which still reads the values: an entry made bad in place between runs raises and
    writes nothing, twice, and the next good run equals the one-shot function."""
    layer = small_msa_layer(device, batch=2, context=260)
    if prefill:
        req = torch.tensor([0, 0, 1, 1, 0], dtype=torch.int32, device=device)
        pos = torch.tensor([255, 258, 100, -1, 259], dtype=torch.int32, device=device)
        g = torch.Generator().manual_seed(5)
        q, key, value, index_q = (torch.randn(5, h, 16, generator=g).to(device) for h in (4, 2, 2, 2))
        index_k = torch.randn(5, 16, generator=g).to(device)
        plan = _prefill_plan(layer, 5, topk=2)
        head, rows = (q, key, value, index_q, index_k), (req, pos)
        one_shot = mm3lab.msa_prefill
    else:
        plan = _decode_plan(layer, topk=2)
        head, rows = _run_args(layer)[:5], (layer.seq_lens.clone(),)
        one_shot = mm3lab.msa_decode
    table = layer.block_table.clone()
    before = _kept_plan_checks()
    for _ in range(3):
        plan.run(*head, *_caches(layer), table, *rows)
    if device == "cuda":
        assert _kept_plan_checks() == before + 1  # (kept by the first run, launched again by the others)
    good = table.clone()
    table[0, 1] = layer.index_cache.shape[0] + 5  # past both caches, in place (row 0 reads block 1)
    kv, index_cache = layer.cache.kv.clone(), layer.index_cache.clone()
    for _ in range(2):  # (twice: the flags are clear again after a rejected run)
        with pytest.raises(ValueError, match="block_table"):
            plan.run(*head, *_caches(layer), table, *rows)
        assert torch.equal(layer.cache.kv, kv) and torch.equal(layer.index_cache, index_cache)
    table.copy_(good)
    _, kc, vc, ic = _clone_caches(layer)
    want = one_shot(*head, kc, vc, ic, table, *rows, topk=2)
    assert torch.equal(plan.run(*head, *_caches(layer), table, *rows), want)


def test_bad_plans_are_rejected():
    layer = small_msa_layer("cpu")
    with pytest.raises(ValueError, match="not a multiple"):
        _decode_plan(layer, num_q_heads=3)
    with pytest.raises(TypeError, match="topk"):
        _decode_plan(layer, topk=2.0)
    with pytest.raises(TypeError, match="id_dtype"):
        _decode_plan(layer, id_dtype=torch.float32)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        _decode_plan(layer, graph=True)


def test_torch_backend_plan_calls_the_one_shot_path():
    layer = small_msa_layer("cpu")
    _, kc, vc, ic = _clone_caches(layer)
    with mm3lab.use_backend("torch"):
        plan = _decode_plan(layer, topk=2)
        assert not plan.uses_kernels
        got = plan.run(*_run_args(layer))
        want = mm3lab.msa_decode(*_run_args(layer, kc, vc, ic), topk=2)
        with pytest.raises(ValueError, match="stages"):
            plan.stages(*_run_args(layer))
    assert torch.equal(got, want)


def test_stages_reproduce_the_step(device):
    layer = small_msa_layer(device)
    plan = _decode_plan(layer, topk=2)
    want = plan.run(*_run_args(layer)).clone()
    stages = plan.stages(*_run_args(layer))
    assert list(stages) == ["insert", "indexer_scores", "topk", "block_table", "topk_block_table", "attention"]
    plan.out.zero_()
    for name in ("insert", "indexer_scores", "topk", "block_table", "attention"):
        stages[name]()
    assert torch.equal(plan.out, want)


@pytest.mark.parametrize("dql", [1, 3])
def test_rows_and_slots_match_the_torch_ops(device, dql):
    layer = small_msa_layer(device, batch=3, context=260)
    seq_lens = torch.tensor([1, 0, 260], dtype=torch.int32, device=device)
    n = 3 * dql
    req = torch.empty(n, dtype=torch.int32, device=device)
    pos = torch.empty(n, dtype=torch.int32, device=device)
    slots = torch.empty(n, dtype=torch.int64, device=device)
    rows_and_slots(layer.block_table, req, pos, slots, seq_lens=seq_lens, decode_query_len=dql)
    want_req, want_pos = decode_query_rows(seq_lens, dql)
    assert torch.equal(req, want_req) and torch.equal(pos, want_pos)
    assert torch.equal(slots, token_slots(layer.block_table, want_req, want_pos))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("index_dtype", [torch.float16, torch.bfloat16])
def test_graph_plan_replays_with_changing_seq_lens_and_padded_rows(index_dtype):
    layer = synthetic_layer(
        700, batch=3, num_kv_heads=2, group_size=4, head_dim=64, index_dim=32, dtype=index_dtype, device="cuda"
    )
    plan = _decode_plan(layer, topk=3, graph=True)
    eager = _decode_plan(layer, topk=3)
    for step, lens in enumerate(([700, 737, 774], [129, 0, 500], [1, 737, 0], [700, 737, 774])):
        seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
        _, kc, vc, ic = _clone_caches(layer)
        want = mm3lab.msa_decode(*_run_args(layer, kc, vc, ic, seq_lens), topk=3)
        got = plan.run(*_run_args(layer, seq_lens=seq_lens.clone()))  # a fresh address every step
        assert torch.equal(got, want), lens
        assert torch.equal(eager.run(*_run_args(layer, seq_lens=seq_lens)), want)
        if step == 0:
            graph = plan._cuda_graph
    assert plan._cuda_graph is graph  # replayed, never re-captured
    # a new cache address re-captures instead of replaying into the old cache
    _kv, kc, vc, ic = _clone_caches(layer)
    out = plan.run(*_run_args(layer, kc, vc, ic)).clone()
    assert plan._cuda_graph is not graph
    assert torch.equal(out, mm3lab.msa_decode(*_run_args(layer), topk=3))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_plan_run_is_capturable_by_the_caller():
    layer = synthetic_layer(
        700, batch=2, num_kv_heads=2, group_size=4, head_dim=64, index_dim=32, dtype=torch.bfloat16, device="cuda"
    )
    plan = _decode_plan(layer, topk=3)
    want = plan.run(*_run_args(layer)).clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.run(*_run_args(layer))
    plan.out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(plan.out, want)


def _prefill_inputs(device, n, seed=3, hq=4, hkv=2, d=16, di=16):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=DT)

    return rnd(n, hq, d), rnd(n, hkv, d), rnd(n, hkv, d), rnd(n, hkv, di), rnd(n, di)


def test_prefill_plan_follows_positions_without_replanning(device):
    layer = small_msa_layer(device, batch=2, context=260)
    plan = _prefill_plan(layer, 4, topk=2)
    steps = ([0, 0, 1, 1], [10, 11, 200, 201]), ([1, 0, 0, 1], [-1, 130, 131, -5]), ([0, 1, 1, 1], [259, 0, 1, 2])
    for step, (req, pos) in enumerate(steps):
        req = torch.tensor(req, dtype=torch.int32, device=device)
        pos = torch.tensor(pos, dtype=torch.int32, device=device)
        args = _prefill_inputs(device, 4, seed=step)
        kv, kc, vc, ic = _clone_caches(layer)
        want = mm3lab.msa_prefill(*args, kc, vc, ic, layer.block_table, req, pos, topk=2)
        got = plan.run(*args, *_caches(layer), layer.block_table, req, pos)
        assert torch.equal(got, want), step
        assert torch.equal(layer.cache.kv, kv) and torch.equal(layer.index_cache, ic)  # the same cache writes
        padded = (pos < 0).nonzero().flatten()
        assert bool((plan.slots[padded] == -1).all()) and bool((got[padded] == 0).all())


def test_plan_kernel_choice_follows_the_one_shot_rule(device, monkeypatch):
    """From ``TILED_MIN_ROWS`` rows up the one-shot call may run the tiled kernel; the plan runs the same one
    (the threshold is lowered here so that the interpreter runs a small chunk)."""
    from mm3lab import attention

    monkeypatch.setattr(attention, "TILED_MIN_ROWS", 8)
    layer = small_msa_layer(device, batch=1, context=300)
    n = 16
    req = torch.zeros(n, dtype=torch.int32, device=device)
    pos = torch.arange(300 - n, 300, dtype=torch.int32, device=device)
    args = _prefill_inputs(device, n)
    _, kc, vc, ic = _clone_caches(layer)
    want = mm3lab.msa_prefill(*args, kc, vc, ic, layer.block_table, req, pos, topk=2)
    plan = _prefill_plan(layer, n, topk=2)
    assert plan.algorithm == "tiled"  # from the threshold up: the tiled kernel
    got = plan.run(*args, *_caches(layer), layer.block_table, req, pos)
    assert torch.equal(got, want)
    for algorithm in ("rows", "tiled"):
        fixed = _prefill_plan(layer, n, topk=2, algorithm=algorithm)
        _, kc, vc, ic = _clone_caches(layer)
        one = mm3lab.msa_prefill(*args, kc, vc, ic, layer.block_table, req, pos, topk=2)
        torch.testing.assert_close(
            fixed.run(*args, *_caches(layer), layer.block_table, req, pos), one, atol=1e-5, rtol=1e-5
        )
    with pytest.raises(ValueError, match="algorithm"):
        _prefill_plan(layer, n, topk=2, algorithm="fast")
    small = _decode_plan(layer, topk=2)
    assert small.algorithm == "rows"  # below the threshold: always the per-row kernel


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_automatic_kernel_choice_is_captured(monkeypatch):
    """From ``TILED_MIN_ROWS`` rows up an ``algorithm=None`` plan fixes the tiled kernel (which chooses per
    tile on the device), so a CUDA graph captures it, and its replay gives the eager run's bits."""
    from mm3lab import attention

    monkeypatch.setattr(attention, "TILED_MIN_ROWS", 8)
    layer = small_msa_layer("cuda", batch=1, context=300)
    n = 16
    req = torch.zeros(n, dtype=torch.int32, device="cuda")
    pos = torch.arange(300 - n, 300, dtype=torch.int32, device="cuda")
    args = _prefill_inputs("cuda", n)
    for algorithm, kernel in ((None, "tiled"), ("rows", "rows")):
        plan = _prefill_plan(layer, n, topk=2, algorithm=algorithm)
        assert plan.algorithm == kernel
        run_args = (*args, *_caches(layer), layer.block_table, req, pos)
        with mm3lab.validation(False):
            eager = plan.run(*run_args).clone()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                plan.run(*run_args)
        plan.out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(plan.out, eager)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graph_prefill_plan_replays_with_changing_positions_and_padded_rows():
    layer = synthetic_layer(
        700, batch=2, num_kv_heads=2, group_size=4, head_dim=64, index_dim=32, dtype=torch.bfloat16, device="cuda"
    )
    n = 6
    plan = _prefill_plan(layer, n, topk=3, graph=True)
    steps = (
        ([0, 0, 0, 1, 1, 1], [300, 301, 302, 640, 641, 642]),
        ([1, 1, 0, 0, 1, 0], [-1, 5, 6, -1, 129, 7]),
        ([0, 0, 0, 1, 1, 1], [300, 301, 302, 640, 641, 642]),
    )
    graph = None
    g = torch.Generator(device="cuda").manual_seed(0)
    for step, (req, pos) in enumerate(steps):
        req = torch.tensor(req, dtype=torch.int32, device="cuda")
        pos = torch.tensor(pos, dtype=torch.int32, device="cuda")
        args = [
            torch.randn(n, *shape, generator=g, device="cuda", dtype=torch.bfloat16)
            for shape in ((8, 64), (2, 64), (2, 64), (2, 32))
        ] + [torch.randn(n, 32, generator=g, device="cuda", dtype=torch.bfloat16)]
        _, kc, vc, ic = _clone_caches(layer)
        want = mm3lab.msa_prefill(*args, kc, vc, ic, layer.block_table, req, pos, topk=3)
        got = plan.run(*args, *_caches(layer), layer.block_table, req.clone(), pos.clone())
        assert torch.equal(got, want), step
        graph = graph or plan._cuda_graph
    assert plan._cuda_graph is graph  # replayed, never re-captured
    with pytest.raises(ValueError, match="planned for shape"):
        plan.run(*[a[:-1] for a in args], *_caches(layer), layer.block_table, req[:-1], pos[:-1])
    assert plan._cuda_graph is graph
    with pytest.raises(ValueError, match="planned on cuda"):
        plan.run(*[a.cpu() for a in args], *_caches(layer), layer.block_table, req, pos)
    assert _prefill_plan(layer, 4096, topk=3, graph=True).algorithm == "tiled"  # (capturable: chosen on the device)
