"""mm3lab._checks.PassedChecks: a repeated call shape skips structural checks that read nothing else."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import mm3lab
from mm3lab._checks import PassedChecks
from mm3lab.msa import layer as msa_layer
from mm3lab.testing import small_msa_layer


def _key(*tensors, scalars=()):
    return PassedChecks.key(tensors, scalars)


def test_every_piece_of_metadata_is_in_the_key():
    t = torch.zeros(4, 6)
    base = _key(t, None, scalars=(16, 0.5))
    assert base == _key(t, None, scalars=(16, 0.5))
    other_storage = torch.zeros(4, 6)
    variants = [
        _key(other_storage, None, scalars=(16, 0.5)),  # address
        _key(t[1:], None, scalars=(16, 0.5)),  # address and shape
        _key(t.view(6, 4), None, scalars=(16, 0.5)),  # shape
        _key(t.t(), None, scalars=(16, 0.5)),  # shape and strides
        _key(t.as_strided((4, 6), (1, 4)), None, scalars=(16, 0.5)),  # strides alone
        _key(t.view(torch.int32), None, scalars=(16, 0.5)),  # dtype alone
        _key(torch.nn.Parameter(t), None, scalars=(16, 0.5)),  # type
        _key(t, t, scalars=(16, 0.5)),  # an absent tensor given
        _key(t, None, scalars=(17, 0.5)),  # a scalar's value
        _key(t, None, scalars=(16.0, 0.5)),  # a scalar's type (16 == 16.0)
        _key(t, None, scalars=(True, 0.5)),  # bool against int (True == 1)
    ]
    assert base not in variants
    assert len(set(variants)) == len(variants)
    assert _key(t, None, scalars=(16, float("nan"))) != _key(t, None, scalars=(16, float("nan")))  # NaN: never equal


def test_a_key_is_hashed_once_and_finds_its_equals_in_any_table():
    """The key keeps its hash (the layer looks it up in several tables), and equal keys meet in a dict,
    also inside a tuple (the kept value checks and the recorded steps key on ``(key, ...)``)."""
    t = torch.zeros(4, 6)
    a, b = _key(t, None, scalars=(16, 0.5)), _key(t, None, scalars=(16, 0.5))
    assert a is not b and a == b and hash(a) == hash(b) == hash(a.value)
    table = {(a, "stream"): 1}
    assert table.get((b, "stream")) == 1 and table.get((_key(t, None, scalars=(17, 0.5)), "stream")) is None
    assert a != a.value and a != None  # noqa: E711  (only another key can be equal)


@pytest.mark.parametrize("bad", [[1, 2], 3, "q", torch.zeros(2).numpy()])
def test_a_non_tensor_gives_no_key(bad):
    assert _key(torch.zeros(2), bad) is None
    assert _key(torch.zeros(2), scalars=([16],)) is None  # unhashable scalar


def test_the_oldest_keys_go_and_no_tensor_is_kept():
    passed = PassedChecks()
    t = torch.zeros(3)
    ref = weakref.ref(t)
    keys = [_key(t, scalars=(i,)) for i in range(passed.size + 3)]
    for i, key in enumerate(keys):
        passed.add(key, i)
    assert passed.get(keys[0]) is None and passed.get(keys[2]) is None
    assert passed.get(keys[-1]) == len(keys) - 1
    assert passed.get(None, "default") == "default"
    del t, keys
    gc.collect()
    assert ref() is None


def test_a_repeated_layer_call_skips_its_structural_checks(monkeypatch):
    """The second identical call runs the indexer's checks (values included) but not the others."""
    calls = []
    for name in ("_check_query", "_check_index_step", "_check_inserts"):
        original = getattr(msa_layer, name)
        monkeypatch.setattr(msa_layer, name, lambda *a, _f=original, _n=name, **k: calls.append(_n) or _f(*a, **k))
    msa_layer._PASSED.clear()
    layer = small_msa_layer()
    first = mm3lab.msa_decode(**layer.inputs())
    assert calls == ["_check_query", "_check_index_step", "_check_inserts"]
    second = mm3lab.msa_decode(**layer.inputs())
    assert calls == ["_check_query", "_check_index_step", "_check_inserts"]  # none again
    torch.testing.assert_close(second, first, rtol=0, atol=0)
    with pytest.raises(ValueError, match="seq_lens"):  # value checks still run on a remembered shape
        mm3lab.msa_decode(**{**layer.inputs(), "seq_lens": layer.seq_lens + 10_000})
    monkeypatch.setattr(msa_layer._PASSED, "size", 0)  # size 0: every call is checked in full
    msa_layer._PASSED.clear()
    mm3lab.msa_decode(**layer.inputs())
    mm3lab.msa_decode(**layer.inputs())
    assert calls.count("_check_inserts") == 3
