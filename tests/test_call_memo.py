"""Repeated one-shot calls of one shape (``mm3lab._replay.Memo``): the structural checks run once per
call shape and later calls replay the recorded launches with their own tensors in place (GPU: the
interpreter has no compiled launchers to record). Every call is bit-identical to the normal path,
returns its own new output, still runs its value checks, and a new shape, strides, alignment or
cache takes the normal path (and is kept in turn). On the CPU the memo never applies (its key is
``None``), which the bookkeeping tests check along with its least-recently-used order."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import mm3lab
from mm3lab import _replay
from mm3lab.attention import _MEMO as ATTENTION_MEMO
from mm3lab.block_table import _MEMO as TABLE_MEMO

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
HKV, G, D, TOPK = 2, 8, 64, 4


@pytest.fixture
def normal_path():
    """A context manager that runs the enclosed calls with the memo off (the normal path)."""

    class Off:
        def __enter__(self):
            _replay.ENABLED = False

        def __exit__(self, *exc):
            _replay.ENABLED = True

    yield Off()
    _replay.ENABLED = True


def _problem(rows=3, layout="dense", dtype=torch.bfloat16, seed=0, fp8=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    blocks = 12
    cache = mm3lab.allocate_kv_cache(blocks, HKV, D, layout, dtype=torch.float8_e4m3fn if fp8 else dtype, device="cuda")
    if fp8:
        kv = torch.randn(cache.kv.shape, generator=g, device="cuda")
        cache.kv.copy_(kv.to(torch.float8_e4m3fn))
        cache.k_scale.uniform_(0.5, 2.0, generator=g)
        cache.v_scale.uniform_(0.5, 2.0, generator=g)
    else:
        cache.kv.normal_(generator=g)
    stride = cache.block_page_stride
    topk = torch.stack([torch.randperm(blocks, generator=g, device="cuda")[:TOPK] for _ in range(HKV * rows)])
    topk = topk.view(HKV, rows, TOPK).to(torch.int32)
    bt = torch.arange(blocks, device="cuda", dtype=torch.int32).repeat(rows, 1)
    seq_lens = torch.full((rows,), blocks * 128 - 5, dtype=torch.int32, device="cuda")
    sbt, sctx = mm3lab.build_sparse_block_table_decode(topk, bt, seq_lens, block_page_stride=stride)
    return cache, topk, bt, seq_lens, sbt, sctx


def _q(rows, seed, dtype=torch.bfloat16, how="plain"):
    g = torch.Generator(device="cuda").manual_seed(seed)
    if how == "strided":
        return torch.randn(rows, HKV * G, 2 * D, generator=g, device="cuda").to(dtype)[..., :D]
    if how == "misaligned":
        flat = torch.randn(rows * HKV * G * D + 1, generator=g, device="cuda").to(dtype)
        return flat[1:].view(rows, HKV * G, D)
    return torch.randn(rows, HKV * G, D, generator=g, device="cuda").to(dtype)


def test_the_memo_never_applies_to_cpu_tensors():
    q = torch.zeros(1, 4, 8)
    assert _replay.Memo.key((q,), (), (None,)) is None


@pytest.fixture
def memo_on_cpu(monkeypatch):
    """Let the memos key CPU calls on every backend (they key only compiled-kernel GPU calls): the first
    call of a shape then takes the recording path, which on the CPU records nothing."""
    real = _replay.Memo.key

    def key(per_call, caches, scalars):
        got = real(per_call, caches, scalars)
        if got is not None or not all(isinstance(t, torch.Tensor) for t in per_call[:1]):
            return got
        cheap = ("cpu", tuple(scalars), tuple(t is None for t in per_call))
        return _replay.CallKey(cheap, tuple(t for t in per_call if t is not None))

    monkeypatch.setattr(_replay.Memo, "key", staticmethod(key))
    monkeypatch.setattr(_replay, "supported", lambda: True)


@pytest.mark.parametrize("backend", ["interpret", "torch"])
def test_a_recorded_first_call_returns_what_the_call_computed(memo_on_cpu, backend):
    """The first call of a shape returns its entry point's own result on every path (a PyTorch path
    returns a log-sum-exp of its own, not the buffer the recording path allocated), and a shape that
    recorded nothing takes the normal path from then on."""
    if backend == "interpret" and not mm3lab.backend.INTERPRETER:
        pytest.skip("the interpreter backend is the CPU's")
    from mm3lab import reference

    g = torch.Generator().manual_seed(0)
    cache = mm3lab.allocate_kv_cache(4, 2, 16, "packed", device="cpu")
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=g))
    topk = torch.tensor([[[0, 1], [2, 3]], [[1, 2], [3, 0]]], dtype=torch.int32)
    bt = torch.arange(4, dtype=torch.int32).repeat(2, 1)
    seq_lens = torch.tensor([500, 400], dtype=torch.int32)
    stride = cache.block_page_stride
    with mm3lab.use_backend(backend):
        for _ in range(3):
            sbt, sctx = mm3lab.build_sparse_block_table_decode(topk, bt, seq_lens, block_page_stride=stride)
            want = reference.build_sparse_block_table_decode(topk, bt, seq_lens, block_page_stride=stride)
            assert torch.equal(sbt, want[0]) and torch.equal(sctx, want[1])
            q = torch.randn(2, 4, 16, generator=g)
            out, lse = mm3lab.sparse_attention(q, cache.k_cache, cache.v_cache, sbt, sctx, return_lse=True)
            ref_out, ref_lse = reference.sparse_attention(q, cache.k_cache, cache.v_cache, sbt, sctx, return_lse=True)
            torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    for memo in (ATTENTION_MEMO, TABLE_MEMO):
        (entry,) = memo._entries().values()
        assert entry.recording is None


def test_the_memo_keeps_its_newest_call_shapes(monkeypatch):
    memo = _replay.Memo("test")
    monkeypatch.setattr(memo, "size", 2)

    def key(name: str, rows: int = 3) -> _replay.CallKey:  # (a new tensor each time: its metadata is the key)
        return _replay.CallKey(("stream", name), (torch.zeros(rows, 4),))

    for name in ("a", "b", "c"):
        memo.put(key(name), None, name.upper())
    assert memo.get(key("a")) is None and memo.get(key("b")).info == "B" and memo.get(key("c")).info == "C"
    memo.get(key("b"))  # now the newest
    memo.put(key("d"), "D")
    assert memo.get(key("c")) is None and memo.get(key("b")).info == "B"
    assert memo.get(None) is None
    memo.clear()
    assert memo.get(key("b")) is None


def test_a_memo_key_compares_tensor_metadata_and_scalars():
    """A kept shape is found again by a call whose tensors are new but have its metadata and whose
    other parts are equal, and by no other; each kept shape gets its own token."""
    memo = _replay.Memo("test")
    kept = _replay.CallKey(("stream", 1), (torch.zeros(3, 4), torch.zeros(2, dtype=torch.int32)))
    memo.put(kept, None, "kept")
    assert kept.token is not None and kept.stream == "stream"
    same = _replay.CallKey(("stream", 1), (torch.ones(3, 4), torch.ones(2, dtype=torch.int32)))
    assert memo.get(same).info == "kept" and same.token == kept.token
    others = [
        (("stream", 2), (torch.zeros(3, 4), torch.zeros(2, dtype=torch.int32))),  # a scalar
        (("other", 1), (torch.zeros(3, 4), torch.zeros(2, dtype=torch.int32))),  # the stream
        (("stream", 1), (torch.zeros(4, 3), torch.zeros(2, dtype=torch.int32))),  # a shape
        (("stream", 1), (torch.zeros(4, 3).t(), torch.zeros(2, dtype=torch.int32))),  # strides
        (("stream", 1), (torch.zeros(3, 4), torch.zeros(2, dtype=torch.int64))),  # a dtype
        (("stream", 1), (torch.zeros(3, 4, requires_grad=True), torch.zeros(2, dtype=torch.int32))),
    ]
    for cheap, tensors in others:
        assert memo.get(_replay.CallKey(cheap, tensors)) is None, cheap
    other = _replay.CallKey(("stream", 2), (torch.zeros(3, 4), torch.zeros(2, dtype=torch.int32)))
    memo.put(other, None, "other")
    assert other.token != kept.token


def test_a_kept_call_shape_keeps_no_tensor_alive():
    memo = _replay.Memo("test")
    t = torch.zeros(3, 4)
    alive = weakref.ref(t)
    memo.put(_replay.CallKey(("stream",), (t,)), None)
    del t
    gc.collect()
    assert alive() is None and len(memo._entries()) == 1


def test_the_python_tensor_guard_matches_pytorchs(monkeypatch):
    """Where PyTorch has no compiled tensor guard, the memo reads the same metadata in Python."""
    a, b = torch.zeros(3, 4), torch.zeros(2, dtype=torch.int32)
    variants = [(torch.ones(3, 4), b), (torch.zeros(4, 3), b), (torch.zeros(4, 3).t(), b), (a, b.long()), (a[:, :2], b)]
    compiled = _replay.tensor_guard((a, b))
    monkeypatch.setattr(_replay, "COMPILED_GUARDS", False)  # (the benchmarks' switch)
    assert isinstance(_replay.tensor_guard((a, b)), _replay._MetaGuard)
    monkeypatch.setattr(_replay, "COMPILED_GUARDS", True)
    monkeypatch.setattr(_replay, "_TensorGuards", None)
    python = _replay.tensor_guard((a, b))
    assert isinstance(python, _replay._MetaGuard)
    for tensors in variants:
        assert compiled.check(*tensors) == python.check(*tensors)
    assert [python.check(*t) for t in variants] == [True, False, False, False, False]


def test_a_scalar_of_another_type_keeps_the_memo_out(monkeypatch):
    monkeypatch.setattr(_replay, "supported", lambda: True)
    monkeypatch.setattr(mm3lab.backend, "get_backend", lambda: "triton")
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(_replay, "current_stream", lambda device: 0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    q = torch.zeros(2, 4)
    assert _replay.Memo.key((q,), (), (1.0, "rows", None, True)) is not None
    assert _replay.Memo.key((q,), (), (torch.tensor(1.0),)) is None
    assert _replay.Memo.key((q,), (), ((1, 2),)) is None
    assert _replay.Memo.key((q, "not a tensor"), (), ()) is None

    class Pointer:  # (has a tensor's address method, is not one)
        def data_ptr(self):
            return 0

    for per_call, caches in [((q, Pointer()), ()), ((q,), (q, Pointer())), ((q,), ([1, 2],)), (([1, 2], q), ())]:
        assert _replay.Memo.key(per_call, caches, ()) is None
    key = _replay.Memo.key((q, None), (None, q), (True,))  # (absent optional tensors are part of the key)
    assert key.cheap[-4:] == (q.data_ptr() % 16, None, None, q.data_ptr()) and key.tensors == (q, q)


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["dense", "packed"])
@pytest.mark.parametrize("return_lse", [False, True])
@pytest.mark.parametrize("fp8", [False, True])
def test_repeated_attention_calls_replay_bit_identical(normal_path, layout, return_lse, fp8):
    assert _replay.supported(), "recorded launches are verified for this Triton; the test expects them on"
    ATTENTION_MEMO.clear()
    cache, _, _, _, sbt, sctx = _problem(layout=layout, fp8=fp8)
    scales = {"k_scale": cache.k_scale, "v_scale": cache.v_scale} if fp8 else {}
    outs = []
    for step, how in enumerate(["plain", "plain", "plain", "strided", "strided", "misaligned", "misaligned", "plain"]):
        q = _q(sbt.shape[1], step, how=how)
        got = mm3lab.sparse_attention(q, cache.k_cache, cache.v_cache, sbt, sctx, return_lse=return_lse, **scales)
        with normal_path:
            want = mm3lab.sparse_attention(q, cache.k_cache, cache.v_cache, sbt, sctx, return_lse=return_lse, **scales)
        got, want = (got, want) if return_lse else ((got,), (want,))
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b), (step, how)
        outs.append((got[0], want[0].clone()))
    assert len({id(o) for o, _ in outs}) == len(outs)
    for step, (got, want) in enumerate(outs):  # each call returned its own output
        assert torch.equal(got, want), f"step {step}'s output was overwritten"
    entries = ATTENTION_MEMO._entries()
    assert all(e.recording is not None for e in entries.values())
    assert sum(e.recording.replays for e in entries.values()) == 5  # 8 calls, 3 call shapes


@needs_gpu
@pytest.mark.gpu
def test_a_replayed_attention_call_still_checks_values_and_a_new_cache_is_a_new_shape(normal_path):
    ATTENTION_MEMO.clear()
    cache, _, _, _, sbt, sctx = _problem()
    q = _q(sbt.shape[1], 0)
    for _ in range(3):
        mm3lab.sparse_attention(q, cache.k_cache, cache.v_cache, sbt, sctx)
    bad = sbt.clone()
    bad[1, 2, 0] = cache.k_cache.shape[0]  # a page past the cache
    with pytest.raises(ValueError, match=r"sparse_bt: \(head 1, row 2\) entry 0"):
        mm3lab.sparse_attention(q, cache.k_cache, cache.v_cache, bad, sctx)
    too_long = sctx.clone()
    too_long[0, 1] = sbt.shape[2] * 16 + 1
    with pytest.raises(ValueError, match=r"sparse_ctx: \(head 0, row 1\)"):
        mm3lab.sparse_attention(q, cache.k_cache, cache.v_cache, sbt, too_long)
    other, *_ = _problem(seed=1)  # same shapes, another cache
    got = mm3lab.sparse_attention(q, other.k_cache, other.v_cache, sbt, sctx)
    with normal_path:
        want = mm3lab.sparse_attention(q, other.k_cache, other.v_cache, sbt, sctx)
    assert torch.equal(got, want)
    assert len(ATTENTION_MEMO._entries()) == 2


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["dense", "packed"])
def test_repeated_block_table_calls_replay_bit_identical(normal_path, layout):
    TABLE_MEMO.clear()
    cache, topk, bt, seq_lens, _, _ = _problem(rows=4, layout=layout)
    stride = cache.block_page_stride
    outs = []
    for step in range(5):
        g = torch.Generator(device="cuda").manual_seed(step)
        sel = torch.randint(0, bt.shape[1], topk.shape, generator=g, device="cuda", dtype=torch.int32)
        lens = seq_lens - torch.randint(0, 300, seq_lens.shape, generator=g, device="cuda", dtype=torch.int32)
        got = mm3lab.build_sparse_block_table_decode(sel, bt, lens, block_page_stride=stride)
        with normal_path:
            want = mm3lab.build_sparse_block_table_decode(sel, bt, lens, block_page_stride=stride)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), step
        outs.append((got, [t.clone() for t in want]))
    for step, (got, want) in enumerate(outs):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"step {step} overwritten"
    (entry,) = TABLE_MEMO._entries().values()
    assert entry.recording is not None and entry.recording.replays == 5  # (_problem built the first table)
    sel[0, 0, 0] = bt.shape[1]  # a block past the table, on a replayed call shape
    with pytest.raises(ValueError, match="topk_idx"):
        mm3lab.build_sparse_block_table_decode(sel, bt, lens, block_page_stride=stride)


@needs_gpu
@pytest.mark.gpu
def test_caller_owned_outputs_are_part_of_the_call_shape(normal_path):
    TABLE_MEMO.clear()
    ATTENTION_MEMO.clear()
    cache, topk, bt, seq_lens, sbt, sctx = _problem(rows=4)
    stride = cache.block_page_stride
    bufs = [(torch.empty_like(sbt), torch.empty_like(sctx)) for _ in range(2)]
    outs = [torch.empty(sbt.shape[1], HKV * G, D, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    for step in range(6):
        o = bufs[step % 2]
        got = mm3lab.build_sparse_block_table_decode(topk, bt, seq_lens, block_page_stride=stride, out=o)
        assert got[0] is o[0] and got[1] is o[1]
        assert torch.equal(o[0], sbt) and torch.equal(o[1], sctx), step
        q = _q(sbt.shape[1], step)
        res = mm3lab.sparse_attention(q, cache.k_cache, cache.v_cache, sbt, sctx, out=outs[step % 2])
        assert res is outs[step % 2]
        with normal_path:
            want = mm3lab.sparse_attention(q, cache.k_cache, cache.v_cache, sbt, sctx)
        assert torch.equal(res, want), step
    assert sum(e.recording.replays for e in TABLE_MEMO._entries().values()) == 5  # (both buffers: one shape)
    assert sum(e.recording.replays for e in ATTENTION_MEMO._entries().values()) == 5


@needs_gpu
@pytest.mark.gpu
def test_an_explicitly_tiled_attention_call_is_replayed(normal_path):
    """The tiled pre-pass allocates its tables and fills them in its own launch (no PyTorch fill), so an
    explicitly tiled call records like any other: later calls of the shape replay the pre-pass and the
    tiled launch (the recording keeps the tables, reused in stream order), exact."""
    ATTENTION_MEMO.clear()
    cache, _, _, _, sbt, sctx = _problem(rows=24, seed=0)
    for step in range(4):
        q = _q(sbt.shape[1], step)
        got = mm3lab.sparse_attention(q, cache.k_cache, cache.v_cache, sbt, sctx, algorithm="tiled")
        with normal_path:
            want = mm3lab.sparse_attention(q, cache.k_cache, cache.v_cache, sbt, sctx, algorithm="tiled")
        assert torch.equal(got, want), step
    (entry,) = ATTENTION_MEMO._entries().values()
    assert entry.recording is not None and entry.recording.replays == 3


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_a_call_inside_a_graph_capture_launches_normally_and_never_replays(monkeypatch, fp8):
    """A call shape kept by eager calls, then called inside ``torch.cuda.graph``: the capture gets the normal
    launches (the separate split merge), not a replay of the eager recording, whose own-merge launch counts
    arrivals on the eager stream's counters; the graph's replays give the eager call's bits."""
    ATTENTION_MEMO.clear()
    cache, _, _, _, sbt, sctx = _problem(rows=1, fp8=fp8)
    scales = {"k_scale": cache.k_scale, "v_scale": cache.v_scale} if fp8 else {}
    q = _q(1, 0)
    # the eager calls on the stream the capture then uses, validation off as a capture needs it: the
    # same key eagerly and in the capture, so only the capture itself keeps the recording out
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with mm3lab.validation(False), torch.cuda.stream(stream):
        for _ in range(2):  # recorded, then replayed
            want = mm3lab.sparse_attention(q, cache.k_cache, cache.v_cache, sbt, sctx, **scales)
    torch.cuda.current_stream().wait_stream(stream)
    assert next(iter(ATTENTION_MEMO._entries().values())).recording.replays == 1
    replays_in_capture = []
    original = _replay.Recording.replay

    def replay(self, *args, **kwargs):
        replays_in_capture.append(torch.cuda.is_current_stream_capturing())
        return original(self, *args, **kwargs)

    monkeypatch.setattr(_replay.Recording, "replay", replay)
    merges = []
    real_counters = mm3lab.attention.kernel.merge_counters
    monkeypatch.setattr(
        mm3lab.attention.kernel, "merge_counters", lambda device: merges.append(real_counters(device)) or merges[-1]
    )
    graph = torch.cuda.CUDAGraph()
    with mm3lab.validation(False), torch.cuda.graph(graph, stream=stream):
        got = mm3lab.sparse_attention(q, cache.k_cache, cache.v_cache, sbt, sctx, **scales)
    graph.replay()
    torch.cuda.synchronize()
    assert not any(replays_in_capture)
    assert merges and all(m is None for m in merges)  # (the capture asked for counters and got none)
    assert torch.equal(got, want)


def test_a_recorded_tensor_descriptor_is_rebuilt_over_each_replays_input():
    """A launch argument that is a tensor descriptor (the tiled kernel's block steps read the caches through
    them) over the whole of an input is rebuilt over the replay's input; one over part of an input would go
    stale, so such a run is not recorded; one over no input stays as recorded."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    cache, other, unrelated = (torch.zeros(8, 16, 2, 32, dtype=torch.float16) for _ in range(3))
    inputs = {"q": torch.zeros(4, 8, 32, dtype=torch.float16), "k_cache": cache}
    whole = TensorDescriptor.from_tensor(cache.view(-1, 64), [64, 32])
    assert _replay.descriptor_over(whole, inputs) == "k_cache"
    assert _replay.descriptor_over(TensorDescriptor.from_tensor(cache[:4].view(-1, 64), [64, 32]), inputs) is False
    assert _replay.descriptor_over(TensorDescriptor.from_tensor(unrelated.view(-1, 64), [64, 32]), inputs) is None
    assert _replay.descriptor_over(7, inputs) is None and _replay.descriptor_over(cache, inputs) is None
    template = _replay._descriptor_template(whole)
    assert template.base is None and whole.base is not None  # (the recorded one is left as it was)
    values = [None, whole, 3]
    _replay._put_descriptors(values, ((1, "k_cache", template),), {"k_cache": other})
    put = values[1]
    assert put.base is other and put.base.data_ptr() != cache.data_ptr()
    assert (list(put.shape), list(put.strides), list(put.block_shape)) == ([128, 64], [64, 1], [64, 32])
    assert template.base is None  # (each replay rebuilds from the template)
