"""Repeated one-shot ``msa_decode`` calls of one shape (``mm3lab.msa.recorded``): from the second call
on they run through an internal plan, and from the third replay its recorded launches (GPU). Every
call is bit-identical to the normal path, returns its own new output, and nothing keeps the
caller's tensors alive. On the CPU the plan path runs with normal launches (the interpreter has no
compiled launchers to record), which checks the bookkeeping."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import mm3lab
from mm3lab import _replay
from mm3lab.msa import recorded, synthetic_layer


@pytest.fixture
def cpu_applies(monkeypatch):
    """Let the recorded path apply to CPU tensors too (it is for GPUs; the bookkeeping is the same)."""
    real = recorded.applies

    def applies(args):
        return recorded.ENABLED and not args.return_intermediates and args.q.shape[0] < 1024 or real(args)

    monkeypatch.setattr(recorded, "applies", applies)
    monkeypatch.setattr(recorded._local, "shapes", None, raising=False)


SMALL = {"num_kv_heads": 2, "group_size": 4, "head_dim": 64, "index_dim": 64}
"""A small synthetic layer's heads and dims (shared with ``test_plan_replay``)."""


def _layer(device, seed=0, dql=1, batch=2, context=700):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return synthetic_layer(context, batch=batch, decode_query_len=dql, dtype=dtype, device=device, seed=seed, **SMALL)


def _caches(layer):
    """A copy of the layer's caches: ``(kv, k_cache, v_cache, index_cache)``."""
    kv = layer.cache.kv.clone()
    k, v = mm3lab.page16_views(kv)
    return kv, k, v, layer.index_cache.clone()


def _step_inputs(layer, step):
    g = torch.Generator(device=layer.q.device).manual_seed(100 + step)
    return [
        torch.randn(t.shape, generator=g, device=t.device).to(t.dtype)
        for t in (layer.q, layer.key, layer.value, layer.index_q, layer.index_k)
    ]


def _call(layer, x, caches, seq_lens):
    _, k, v, ic = caches
    return mm3lab.msa_decode(*x, k, v, ic, layer.block_table, seq_lens, decode_query_len=layer.decode_query_len, topk=4)


def _both(layer, x, a, b, seq_lens, step):
    """One step on the recorded path (twin caches ``a``) and on the normal path (twin caches ``b``), equal:
    ``(recorded output, normal output)``."""
    got = _call(layer, x, a, seq_lens)
    recorded.ENABLED = False
    try:
        want = _call(layer, x, b, seq_lens)
    finally:
        recorded.ENABLED = True
    assert torch.equal(got, want), step
    assert torch.equal(a[0], b[0]) and torch.equal(a[3], b[3]), step
    return got, want


def _run_both(layer, steps, device):
    """Each step on the recorded path (twin caches a) and on the normal path (twin caches b)."""
    a, b = _caches(layer), _caches(layer)
    outs = []
    seq_lens = layer.seq_lens.clone()
    for step in range(steps):
        got, want = _both(layer, _step_inputs(layer, step), a, b, seq_lens, step)
        outs.append((got, want.clone()))
        seq_lens = seq_lens + layer.decode_query_len  # the next step's tokens
    for step, (got, want) in enumerate(outs):  # every call returned its own output
        assert torch.equal(got, want), f"step {step}'s output was overwritten"
    return a


@pytest.mark.parametrize("dql", [1, 3])
def test_repeated_calls_equal_the_normal_path_on_cpu(cpu_applies, dql):
    layer = _layer("cpu", dql=dql)
    _run_both(layer, 4, "cpu")
    (shape,) = recorded._local.shapes.values()
    assert shape.plan is not None and shape.usable


def test_first_call_of_a_shape_takes_the_normal_path(cpu_applies):
    layer = _layer("cpu")
    caches = _caches(layer)
    _call(layer, _step_inputs(layer, 0), caches, layer.seq_lens)
    (shape,) = recorded._local.shapes.values()
    assert shape.plan is None  # seen once: no plan built for a single call


def test_shapes_are_kept_least_recently_used(cpu_applies, monkeypatch):
    monkeypatch.setattr(recorded, "MAX_SHAPES", 2)
    layers = [_layer("cpu", batch=b) for b in (1, 2, 3)]
    for layer in layers:
        _call(layer, _step_inputs(layer, 0), _caches(layer), layer.seq_lens)
    assert len(recorded._local.shapes) == 2
    assert [key[7][0][0] for key in recorded._local.shapes] == [2, 3]  # block_table rows: batch 1 dropped
    recorded.clear()
    assert not recorded._shapes()


def test_return_intermediates_and_a_disabled_path_take_the_normal_path(cpu_applies):
    layer = _layer("cpu")
    caches = _caches(layer)
    x = _step_inputs(layer, 0)
    for _ in range(3):
        _, k, v, ic = caches
        mm3lab.msa_decode(*x, k, v, ic, layer.block_table, layer.seq_lens, topk=4, return_intermediates=True)
    assert not recorded._local.shapes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dql", [1, 3])
def test_repeated_calls_replay_bit_identical_on_gpu(dql):
    recorded._local.shapes = None
    layer = _layer("cuda", dql=dql)
    _run_both(layer, 5, "cuda")
    (shape,) = recorded._local.shapes.values()
    assert shape.recording is not None and shape.recording.replays == 3  # call 2 records, calls 3 to 5 replay


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_new_caches_and_new_strides_on_gpu():
    """New caches of the same shape are put in place (no new recording); new input strides record anew."""
    recorded._local.shapes = None
    layer = _layer("cuda")
    for _ in range(3):
        _run_both(layer, 3, "cuda")  # fresh twin caches each time, same shapes
    (shape,) = recorded._local.shapes.values()
    rec = shape.recording
    assert rec is not None and rec.replays == 7
    x = [torch.cat([t, t], -1)[..., : t.shape[-1]] for t in _step_inputs(layer, 9)]  # new strides
    a = _caches(layer)
    got = _call(layer, x, a, layer.seq_lens)
    recorded.ENABLED = False
    try:
        want = _call(layer, x, _caches(layer), layer.seq_lens)
    finally:
        recorded.ENABLED = True
    assert torch.equal(got, want)
    assert shape.recording is not rec  # recorded anew for the new strides


def _fresh_step(device):
    """A small layer on ``device`` (skipped without a GPU), no kept shapes: ``(layer, caches, step 0's inputs)``."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    recorded._local.shapes = None
    layer = _layer(device)
    return layer, _caches(layer), _step_inputs(layer, 0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_repeated_call_checks_the_values_of_each_call(cpu_applies, device):
    """Calls with the same tensors (a known call: its value check launched from kept arguments on a
    GPU) still check the values each call holds: a seq_len changed in place past the block table is
    rejected with its message before any cache write, and the call after it, fixed, runs as before."""
    layer, caches, x = _fresh_step(device)
    seq_lens = layer.seq_lens.clone()
    with mm3lab.validation(True):
        want = [_call(layer, x, caches, seq_lens) for _ in range(4)][-1]
        kv, index_cache = caches[0].clone(), caches[3].clone()
        seq_lens[1] = layer.block_table.shape[1] * 128 + 1
        with pytest.raises(ValueError, match="seq_lens: request 1"):
            _call(layer, x, caches, seq_lens)
        assert torch.equal(caches[0], kv) and torch.equal(caches[3], index_cache)  # nothing written
        seq_lens.copy_(layer.seq_lens)
        assert torch.equal(_call(layer, x, caches, seq_lens), want)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_nothing_keeps_the_callers_tensors_alive(cpu_applies, device):
    layer, caches, x = _fresh_step(device)
    for _ in range(4):
        out = _call(layer, x, caches, layer.seq_lens)
    (shape,) = recorded._local.shapes.values()
    assert shape.plan is not None
    refs = [weakref.ref(t) for t in (*caches, *x, out)]
    del caches, x, out
    gc.collect()
    assert all(r() is None for r in refs), "a recorded step kept a caller's tensor alive"


@pytest.mark.parametrize("bad", ["key", "value", "scale"])
def test_a_bad_argument_after_repeated_calls_gets_its_own_error(cpu_applies, bad):
    """The recorded path is looked up before the inserts' checks: an argument only they reject (a list
    for a tensor, an unhashable scale) must still get their error, not the lookup's."""
    layer = _layer("cpu")
    caches = _caches(layer)
    x = _step_inputs(layer, 0)
    for _ in range(3):  # the shape is planned
        _call(layer, x, caches, layer.seq_lens)
    _, k, v, ic = caches
    args = dict(zip(("q", "key", "value", "index_q", "index_k"), x, strict=True))
    kwargs = {"topk": 4}
    if bad == "scale":
        kwargs["scale"] = [0.125]
    else:
        args[bad] = args[bad].tolist()
    with pytest.raises(TypeError, match=bad):
        mm3lab.msa_decode(*args.values(), k, v, ic, layer.block_table, layer.seq_lens, **kwargs)


class _Relaunching(_replay.Recording):
    """A recording whose replay runs the shape's plan again with the call's tensors: the CPU has no compiled
    launchers to record, and everything around the replay (which call replays, with which tensors) is the GPU's."""

    def __init__(self, inputs):
        super().__init__(inputs, ())
        self._inputs = None  # (keeps none of the caller's tensors)
        self.launches = [None]
        self.seen = []

    def replay(self, inputs, device, stream=None):
        self.replays += 1
        self.seen.append({name: t.data_ptr() for name, t in inputs.items()})
        (shape,) = [s for s in recorded._local.shapes.values() if s.recording is self]
        plan = shape.plan
        plan.out = inputs["out"]
        try:
            plan._launch(inputs, tuple(inputs.get(name) for name in recorded._CACHES))
        finally:
            plan.out = None

    def release(self):
        pass


@pytest.fixture
def relaunching(cpu_applies, monkeypatch):
    """The recorded path on CPU tensors with :class:`_Relaunching` recordings; ``lookups`` counts the shape lookups."""

    def record(launch, inputs, caches):
        launch()
        return _Relaunching(inputs)

    lookups = []
    lookup = recorded.lookup
    monkeypatch.setattr(recorded._replay, "record", record)
    monkeypatch.setattr(recorded._replay, "current_stream", lambda device: 0)
    monkeypatch.setattr(recorded, "lookup", lambda args: lookups.append(1) or lookup(args))
    monkeypatch.setattr(recorded._local, "known", None, raising=False)
    return lookups


def _steps_both(layer, x, a, b, seq_lens, steps):
    """``steps`` calls with the same tensors (``seq_lens`` advanced in place): recorded path on caches ``a``,
    normal path on ``b``, equal every time."""
    for step in range(steps):
        _both(layer, x, a, b, seq_lens, step)
        seq_lens += layer.decode_query_len


def test_a_known_call_replays_without_a_lookup(relaunching):
    layer = _layer("cpu")
    a, b = _caches(layer), _caches(layer)
    x = _step_inputs(layer, 0)
    seq_lens = layer.seq_lens.clone()
    _steps_both(layer, x, a, b, seq_lens, 5)  # 1: normal path; 2: planned and recorded; 3 to 5: known
    (shape,) = recorded._local.shapes.values()
    rec = shape.recording
    assert isinstance(rec, _Relaunching) and rec.replays == 3
    assert len(relaunching) == 2  # (calls 1 and 2: first sight, then planned; calls 3 to 5 are known)
    want = {"q": x[0], "key": x[1], "value": x[2], "index_q": x[3], "index_k": x[4], "seq_lens": seq_lens}
    assert all(seen[name] == t.data_ptr() for seen in rec.seen for name, t in want.items())
    assert all(seen["k_cache"] == a[1].data_ptr() and seen["index_cache"] == a[3].data_ptr() for seen in rec.seen)


def test_a_known_call_looks_up_again_after_a_new_recording_or_a_dropped_shape(relaunching, monkeypatch):
    layer = _layer("cpu")
    a, b = _caches(layer), _caches(layer)
    x = _step_inputs(layer, 0)
    seq_lens = layer.seq_lens.clone()
    _steps_both(layer, x, a, b, seq_lens, 3)
    (shape,) = recorded._local.shapes.values()
    old = shape.recording
    shape.recording = _Relaunching({"q": x[0]})  # (as a call with other strides would have recorded)
    shape.recording.inputs_meta = old.inputs_meta
    _steps_both(layer, x, a, b, seq_lens, 2)
    assert old.replays == 1 and shape.recording.replays == 2 and len(relaunching) == 3  # looked up once more
    monkeypatch.setattr(recorded, "MAX_SHAPES", 1)
    other = _layer("cpu", batch=3)
    _call(other, _step_inputs(other, 0), _caches(other), other.seq_lens)  # a new shape pushes this one out
    assert shape.plan is None and shape.recording is None
    _steps_both(layer, x, a, b, seq_lens, 1)
    assert len(relaunching) == 5 and len(recorded._local.shapes) == 1  # (the other shape's, then this one seen anew)
