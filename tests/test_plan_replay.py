"""Recorded launches (``mm3lab._replay``): an eager plan's later runs call the recorded kernels
directly, bit-identical to launching them normally, and record anew whenever an input's strides
or alignment, or a cache, changes. GPU only: the interpreter has no compiled launchers."""

from __future__ import annotations

import pytest
import torch
from test_msa_recorded import _caches
from test_msa_recorded import _layer as _small_layer

import mm3lab
from mm3lab import _replay

pytestmark = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _layer(batch=2, context=700, dql=1, seed=0):
    return _small_layer("cuda", seed=seed, dql=dql, batch=batch, context=context)


def _plan(k, v, ic, layer):
    return mm3lab.MSADecodePlan(
        k,
        v,
        ic,
        batch=layer.block_table.shape[0],
        max_blocks=layer.block_table.shape[1],
        num_q_heads=layer.q.shape[1],
        decode_query_len=layer.decode_query_len,
        topk=4,
    )


def _inputs(layer, step, how="plain"):
    g = torch.Generator(device="cuda").manual_seed(100 + step)
    shapes = [t.shape for t in (layer.q, layer.key, layer.value, layer.index_q, layer.index_k)]
    out = []
    for shape in shapes:
        if how == "strided":  # the last dim contiguous, the others not: new strides
            t = torch.randn(*shape[:-1], 2 * shape[-1], generator=g, device="cuda").to(torch.bfloat16)[..., : shape[-1]]
        elif how == "misaligned":  # 2 bytes past a 16-byte boundary: a new alignment
            flat = torch.randn(torch.Size(shape).numel() + 1, generator=g, device="cuda").to(torch.bfloat16)
            t = flat[1:].view(shape)
        else:
            t = torch.randn(*shape, generator=g, device="cuda").to(torch.bfloat16)
        out.append(t)
    return out


@needs_gpu
@pytest.mark.parametrize("dql", [1, 3])
def test_replayed_runs_equal_normal_launches_and_rerecord_on_new_strides_alignment_or_cache(dql):
    assert _replay.supported(), "recorded launches are verified for this Triton; the test expects them on"
    layer = _layer(dql=dql)
    kv_a, ka, va, ica = _caches(layer)
    kv_b, kb, vb, icb = _caches(layer)
    plan_a, plan_b = _plan(ka, va, ica, layer), _plan(kb, vb, icb, layer)
    steps = ["plain", "plain", "plain", "strided", "strided", "misaligned", "misaligned", "plain"]
    records = []
    for step, how in enumerate(steps):
        x = _inputs(layer, step, how)
        got = plan_a.run(*x, ka, va, ica, layer.block_table, layer.seq_lens).clone()
        records.append(plan_a._recording)
        _replay.ENABLED = False
        try:
            want = plan_b.run(*x, kb, vb, icb, layer.block_table, layer.seq_lens).clone()
        finally:
            _replay.ENABLED = True
        assert plan_b._recording is None
        assert torch.equal(got, want), (step, how)
        assert torch.equal(kv_a, kv_b) and torch.equal(ica, icb), (step, how)  # the same cache writes
    # one recording per kind of input, replayed while the kind stays
    assert records[0] is records[1] is records[2] and records[3] is records[4] and records[5] is records[6]
    assert len({id(r) for r in records}) == 4 and records[0].replays == 2 and records[3].replays == 1
    assert len(records[0].launches) >= 4  # rows, slots and both inserts, scores, top-k + table, attention
    # a different cache (same shape) is a new recording, and still the same answer
    kv_c, kc, vc, icc = _caches(layer)
    kv_c.copy_(kv_a)
    icc.copy_(ica)
    x = _inputs(layer, 99)
    got = plan_a.run(*x, kc, vc, icc, layer.block_table, layer.seq_lens).clone()
    assert plan_a._recording is not records[-1]
    want = plan_b.run(*x, kb, vb, icb, layer.block_table, layer.seq_lens)
    assert torch.equal(got, want)


def _prefill_rows(g, n, *, chunks: bool):
    """``(query_req_id, query_abs_pos, [q, key, value, index_q, index_k])`` of ``n`` prefill rows over two
    requests of 700 tokens: random distinct requests and positions (padded rows among them), or ``chunks``, each
    request's half of the rows at consecutive positions from a random start."""
    if chunks:
        req = torch.arange(n, device="cuda", dtype=torch.int32) // (n // 2)
        start = torch.randint(0, 700 - n // 2, (2,), generator=g, device="cuda", dtype=torch.int32)
        pos = start[req] + torch.arange(n, device="cuda", dtype=torch.int32) % (n // 2)
    else:  # distinct (request, position) pairs: two rows writing one slot leave which write lands unspecified
        pick = torch.randperm(2 * 701, generator=g, device="cuda")[:n].to(torch.int32)
        req, pos = pick // 701, pick % 701 - 1  # (position -1: a padded row, which writes nothing)
    x = [
        torch.randn(*shape, generator=g, device="cuda").to(torch.bfloat16)
        for shape in ((n, 8, 64), (n, 2, 64), (n, 2, 64), (n, 2, 64), (n, 64))
    ]
    return req, pos, x


@needs_gpu
def test_prefill_plan_replays_with_new_rows():
    layer = _layer(batch=2, context=700)
    n = 6
    kv_a, ka, va, ica = _caches(layer)
    kv_b, kb, vb, icb = _caches(layer)
    plans = [
        mm3lab.MSAPrefillPlan(
            k, v, ic, num_tokens=n, batch=2, max_blocks=layer.block_table.shape[1], num_q_heads=8, topk=4
        )
        for k, v, ic in ((ka, va, ica), (kb, vb, icb))
    ]
    g = torch.Generator(device="cuda").manual_seed(5)
    for step in range(4):
        req, pos, x = _prefill_rows(g, n, chunks=False)
        got = plans[0].run(*x, ka, va, ica, layer.block_table, req, pos).clone()
        _replay.ENABLED = False
        try:
            want = plans[1].run(*x, kb, vb, icb, layer.block_table, req, pos)
        finally:
            _replay.ENABLED = True
        assert torch.equal(got, want), step
        assert torch.equal(kv_a, kv_b) and torch.equal(ica, icb), step
    assert plans[0]._recording is not None and plans[0]._recording.replays == 3


@needs_gpu
@pytest.mark.parametrize("chunks", [True, False], ids=["chunks", "random-rows"])
def test_a_tiled_prefill_plan_is_replayed_and_stays_exact(chunks):
    """The tiled kernel's pre-pass fills its tables in its own launch (no PyTorch fill), so a tiled plan's
    run records like a per-row one, and its replays match the one-shot step."""
    layer = _layer(batch=2, context=700)
    n = 32
    kv_a, ka, va, ica = _caches(layer)
    kv_b, kb, vb, icb = _caches(layer)
    kw = dict(num_tokens=n, batch=2, max_blocks=layer.block_table.shape[1], num_q_heads=8, topk=4)
    tiled = mm3lab.MSAPrefillPlan(ka, va, ica, algorithm="tiled", **kw)
    g = torch.Generator(device="cuda").manual_seed(6)
    for step in range(4):
        req, pos, x = _prefill_rows(g, n, chunks=chunks)
        got = tiled.run(*x, ka, va, ica, layer.block_table, req, pos).clone()
        want = mm3lab.msa_prefill(*x, kb, vb, icb, layer.block_table, req, pos, topk=4)
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2, msg=lambda m, step=step: f"step {step}: {m}")
    assert tiled._recording is not None and tiled._recording.replays == 3


def test_a_run_with_device_work_besides_launches_is_not_recorded():
    """A PyTorch op that puts work on the device (a fill, a copy) would be left out of a replay."""
    rec = _replay.Recording({}, ())
    with _replay._DeviceWork(rec):
        torch.empty(4).view(2, 2).t()
    assert rec.ok
    with _replay._DeviceWork(rec):
        torch.zeros(4)
    assert not rec.ok and "zeros" in rec.reason


def test_no_recording_where_kernels_are_interpreted():
    if mm3lab.backend.INTERPRETER:
        assert not _replay.supported()


def test_a_run_with_one_tensor_as_two_inputs_is_not_recorded():
    """Its launch arguments could not say which input they were (CPU: only the bookkeeping runs)."""
    t, other = torch.zeros(2, 3), torch.zeros(2, 3)
    assert not _replay.Recording({"key": t, "value": t}, ()).ok
    assert _replay.Recording({"key": t, "value": other}, ()).ok


@needs_gpu
def test_a_plan_run_inside_the_callers_graph_capture_launches_normally(monkeypatch):
    """An eager plan whose runs are recorded, then run inside the caller's ``torch.cuda.graph``: the capture
    launches the step's kernels normally, never replaying the eager recording (its attention merges its
    own splits on the eager stream's counters, which a graph must not), and the graph gives the same bits."""
    layer = _layer(batch=1, context=3000)
    kv, k, v, ic = _caches(layer)
    plan = _plan(k, v, ic, layer)
    x = _inputs(layer, 0)
    kv0, ic0 = kv.clone(), ic.clone()
    for _ in range(2):
        kv.copy_(kv0)
        ic.copy_(ic0)
        want = plan.run(*x, k, v, ic, layer.block_table, layer.seq_lens).clone()
    assert plan._recording is not None and plan._recording.replays == 1
    seen = []
    original = _replay.Recording.replay
    monkeypatch.setattr(
        _replay.Recording,
        "replay",
        lambda self, *a, **kw: seen.append(torch.cuda.is_current_stream_capturing()) or original(self, *a, **kw),
    )
    kv.copy_(kv0)
    ic.copy_(ic0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = plan.run(*x, k, v, ic, layer.block_table, layer.seq_lens)
    kv.copy_(kv0)
    ic.copy_(ic0)
    graph.replay()
    torch.cuda.synchronize()
    assert not any(seen)
    assert torch.equal(out, want)
