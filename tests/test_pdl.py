"""Programmatic dependent launch (``mm3lab._pdl``): when the step's kernels use it, and that it changes no result."""

from __future__ import annotations

import pytest
import torch

import mm3lab
from mm3lab import _pdl, _replay, backend
from mm3lab.msa import synthetic_layer
from mm3lab.testing import plan_sizes


@pytest.mark.parametrize(
    "interpreted,device,capability,enabled,want",
    [
        (False, "cuda", (9, 0), True, True),
        (False, "cuda", (10, 0), True, True),
        (False, "cuda", (8, 9), True, False),  # Ada: no griddepcontrol
        (False, "cuda", (9, 0), False, False),  # switched off
        (True, "cuda", (9, 0), True, False),  # interpreted kernels never wait
        (False, "cpu", (9, 0), True, False),
    ],
)
def test_pdl_only_where_the_gpu_has_it(monkeypatch, interpreted, device, capability, enabled, want):
    monkeypatch.setattr(backend, "INTERPRETER", interpreted)
    monkeypatch.setattr(backend, "capability", lambda _device: capability)
    monkeypatch.setattr(_pdl, "ENABLED", enabled)
    dev = torch.device(device, 0) if device == "cuda" else torch.device(device)
    assert _pdl.enabled(dev) is want
    # the attribute never goes without the wait compiled in, nor the wait without the attribute
    assert _pdl.options(dev) == ({"PDL": True, "launch_pdl": True} if want else {"PDL": False})


def _step(layer, pdl: bool, **kw):
    """One planned decode step's output with PDL on or off (a fresh plan, recorded launches off)."""
    kv, ic = layer.cache.kv.clone(), layer.index_cache.clone()
    cache = mm3lab.page16_views(kv, "packed")
    plan = mm3lab.MSADecodePlan(cache[0], cache[1], ic, **plan_sizes(layer), **kw)
    previous = _pdl.ENABLED
    _pdl.ENABLED = pdl
    try:
        out = plan.run(
            layer.q, layer.key, layer.value, layer.index_q, layer.index_k, cache[0], cache[1], ic,
            layer.block_table, layer.seq_lens,
        ).clone()  # fmt: skip
    finally:
        _pdl.ENABLED = previous
    return out, kv, ic


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("batch,graph", [(1, False), (1, True), (3, True)])
def test_pdl_steps_are_bit_identical(monkeypatch, batch, graph):
    if not _pdl.enabled(torch.device("cuda")):
        pytest.skip("this GPU has no programmatic dependent launch")
    monkeypatch.setattr(_replay, "ENABLED", False)  # (each run launches through Triton, with the flag it reads)
    layer = synthetic_layer(
        3000, batch=batch, num_kv_heads=2, group_size=8, head_dim=64, index_dim=32, dtype=torch.bfloat16,
        device="cuda", layout="packed",
    )  # fmt: skip
    with_pdl = _step(layer, True, topk=4, graph=graph)
    without = _step(layer, False, topk=4, graph=graph)
    for a, b in zip(with_pdl, without, strict=True):
        assert torch.equal(a, b)
    want = mm3lab.msa_decode(
        layer.q,
        layer.key,
        layer.value,
        layer.index_q,
        layer.index_k,
        *mm3lab.page16_views(without[1], "packed"),
        without[2],
        layer.block_table,
        layer.seq_lens,
        topk=4,
    )  # fmt: skip  (the caches already hold this step's tokens: inserting them again changes nothing)
    assert torch.equal(with_pdl[0], want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_pdl_kernels_are_compiled_with_the_attribute(monkeypatch):
    if not _pdl.enabled(torch.device("cuda")):
        pytest.skip("this GPU has no programmatic dependent launch")
    from mm3lab.attention.kernel import _sparse_attention_fwd

    monkeypatch.setattr(_replay, "ENABLED", False)
    layer = synthetic_layer(
        700, batch=1, num_kv_heads=2, group_size=8, head_dim=64, index_dim=32, dtype=torch.bfloat16, device="cuda"
    )
    _step(layer, True, topk=2)
    compiled = [k for cache in _sparse_attention_fwd.device_caches.values() for k in cache[0].values()]
    assert any(k.metadata.launch_pdl for k in compiled)


def test_switched_restores_the_setting_even_on_error():
    before = _pdl.ENABLED
    with pytest.raises(KeyError), _pdl.switched(not before):
        assert _pdl.ENABLED is (not before)
        raise KeyError
    assert _pdl.ENABLED is before


def test_a_recording_made_under_the_other_setting_is_not_replayed():
    inputs, caches = {"q": torch.zeros(4, 8)}, (torch.zeros(2, 3),)
    with _pdl.switched(True):
        rec = _replay.Recording(inputs, caches)
        assert rec.matches(inputs, caches)
    with _pdl.switched(False):
        assert not rec.matches(inputs, caches)  # (its launches carry the PDL attribute: recorded again)
        assert _replay.Recording(inputs, caches).matches(inputs, caches)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_memo_keys_hold_the_setting(monkeypatch):
    monkeypatch.setattr(_replay, "supported", lambda: True)
    monkeypatch.setattr(backend, "get_backend", lambda: "triton")
    per_call, caches = (torch.zeros(4, 8, device="cuda"),), (torch.zeros(2, 3, device="cuda"),)
    with _pdl.switched(True):
        on = _replay.Memo.key(per_call, caches, (1.0,))
    with _pdl.switched(False):
        off = _replay.Memo.key(per_call, caches, (1.0,))
    assert on is not None and off is not None and on.cheap != off.cheap
