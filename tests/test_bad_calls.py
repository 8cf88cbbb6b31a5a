"""Every public entry point x its bad calls (SPEC section 7: validate, then write).

Each case builds fresh, valid arguments on the test device, spoils one of them,
and checks that the call raises the expected ``ValueError`` / ``TypeError``, that
the message names the spoiled argument, and that every buffer the caller passed
(caches, ``out=``) is bit-identical afterwards (compared as bytes, so NaN-safe).

The table is generated: every tensor argument gets ``None``, a wrong dtype, a
wrong rank and a tensor on another device; every integer argument gets a
``bool``, a ``float``, ``None`` and out-of-range values (int64 extremes
included); then hand-written value cases follow (ids past a table, seq_lens
the table cannot hold, NaN-filled and aliased buffers, ``out=(buf, None)``, ...).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

import mm3lab
from mm3lab import reference
from mm3lab.compat import vllm

I64_MAX, I64_MIN = 2**63 - 1, -(2**63)

# --- valid arguments ------------------------------------------------------------------------


def _layer(device, *, nan_caches=False, layout="dense"):
    """A decode batch of 2 requests (200 and 300 tokens) over a 6-block cache, 1 KV head, D = Di = 16."""
    g = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device)

    cache = mm3lab.allocate_kv_cache(6, 1, 16, layout, device=device, fill=float("nan") if nan_caches else 0.0)
    index_cache = torch.full((6, 128, 16), float("nan") if nan_caches else 0.0, device=device)
    return {
        "q": randn(2, 16, 16),
        "key": randn(2, 1, 16),
        "value": randn(2, 1, 16),
        "index_q": randn(2, 1, 16),
        "index_k": randn(2, 16),
        "k_cache": cache.k_cache,
        "v_cache": cache.v_cache,
        "index_cache": index_cache,
        "block_table": torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32, device=device),
        "seq_lens": torch.tensor([200, 300], dtype=torch.int32, device=device),
        "query_req_id": torch.tensor([0, 1], dtype=torch.int32, device=device),
        "query_abs_pos": torch.tensor([199, 299], dtype=torch.int32, device=device),
        "topk_idx": torch.tensor([[[1, 0], [2, 0]]], dtype=torch.int32, device=device),
        "scores": randn(3, 5),
    }


@dataclasses.dataclass
class Entry:
    """One public entry point: how to call it and which of its arguments are the caller's buffers."""

    name: str
    fn: Callable
    args: tuple  # names taken from _layer, passed positionally
    kwargs: dict  # fixed extra keyword arguments (plain values)
    buffers: tuple = ()  # names of the arguments a rejected call must leave bit-identical
    ints: dict = dataclasses.field(default_factory=dict)  # int keyword -> (minimum, maximum or None)


def _with_twins(entry: Entry, *twins: str) -> list[Entry]:
    """``entry`` and its twins, called the same way: ``"reference"`` (the same name in
    :mod:`mm3lab.reference`) and ``"vllm"`` (``minimax_m3_<name>`` in :mod:`mm3lab.compat.vllm`)."""
    fns = {"reference": lambda name: getattr(reference, name), "vllm": lambda name: getattr(vllm, "minimax_m3_" + name)}
    return [entry] + [dataclasses.replace(entry, name=f"{t}.{entry.name}", fn=fns[t](entry.name)) for t in twins]


MSA_KW = {"topk": 2, "decode_query_len": 1, "init_blocks": 0, "local_blocks": 1}
CACHES = ("k_cache", "v_cache", "index_cache")

ENTRIES = [
    Entry(
        "msa_decode",
        mm3lab.msa_decode,
        ("q", "key", "value", "index_q", "index_k", "k_cache", "v_cache", "index_cache", "block_table", "seq_lens"),
        MSA_KW,
        CACHES,
        {"topk": (1, None), "decode_query_len": (1, None), "init_blocks": (0, None), "local_blocks": (0, None)},
    ),
    Entry(
        "msa_prefill",
        mm3lab.msa_prefill,
        (
            "q",
            "key",
            "value",
            "index_q",
            "index_k",
            "k_cache",
            "v_cache",
            "index_cache",
            "block_table",
            "query_req_id",
            "query_abs_pos",
        ),
        {"topk": 2, "init_blocks": 0, "local_blocks": 1},
        CACHES,
        {"topk": (1, None), "init_blocks": (0, None), "local_blocks": (0, None)},
    ),
    Entry(
        "dense_decode",
        mm3lab.dense_decode,
        ("q", "key", "value", "k_cache", "v_cache", "block_table", "seq_lens"),
        {"decode_query_len": 1},
        ("k_cache", "v_cache"),
        {"decode_query_len": (1, None)},
    ),
    Entry(
        "dense_prefill",
        mm3lab.dense_prefill,
        ("q", "key", "value", "k_cache", "v_cache", "block_table", "query_req_id", "query_abs_pos"),
        {},
        ("k_cache", "v_cache"),
    ),
    Entry(
        "write_kv_page16",
        mm3lab.write_kv_page16,
        ("key", "value", "k_cache", "v_cache", "query_abs_pos"),
        {},
        ("k_cache", "v_cache"),
    ),
    *_with_twins(
        Entry(
            "insert_index_cache",
            mm3lab.insert_index_cache,
            ("index_k", "index_cache", "query_abs_pos"),
            {},
            ("index_cache",),
        ),
        "reference",
        "vllm",
    ),
    *_with_twins(
        Entry("token_slots", mm3lab.token_slots, ("block_table", "query_req_id", "query_abs_pos"), {}), "reference"
    ),
    *_with_twins(
        Entry(
            "index_topk_decode",
            mm3lab.index_topk_decode,
            ("index_q", "index_cache", "block_table", "seq_lens"),
            {"topk": 2, "decode_query_len": 1, "init_blocks": 0, "local_blocks": 1},
            (),
            {"topk": (1, None), "decode_query_len": (1, None), "init_blocks": (0, None), "local_blocks": (0, None)},
        ),
        "reference",
    ),
    Entry(
        "index_topk_block_table_prefill",
        mm3lab.index_topk_block_table_prefill,
        ("index_q", "index_cache", "block_table", "query_req_id", "query_abs_pos"),
        {"topk": 2, "init_blocks": 0, "local_blocks": 1, "block_page_stride": 8},
        (),
        {"topk": (1, None), "init_blocks": (0, None), "local_blocks": (0, None)},
    ),
    Entry(
        "index_scores_prefill",
        mm3lab.index_scores_prefill,
        ("index_q", "index_cache", "block_table", "query_req_id", "query_abs_pos"),
        {"init_blocks": 0, "local_blocks": 1},
        (),
        {"init_blocks": (0, None), "local_blocks": (0, None)},
    ),
    Entry(
        "reference.build_sparse_block_table_prefill",
        reference.build_sparse_block_table_prefill,
        ("topk_idx", "block_table", "query_req_id", "query_abs_pos"),
        {"block_page_stride": 8},
    ),
    *_with_twins(
        Entry(
            "build_sparse_block_table_decode",
            mm3lab.build_sparse_block_table_decode,
            ("topk_idx", "block_table", "seq_lens"),
            {"decode_query_len": 1, "block_page_stride": 8},
            (),
            {"decode_query_len": (1, None)},
        ),
        "vllm",
    ),
    *_with_twins(
        Entry("topk_blocks", mm3lab.topk_blocks, ("scores",), {"topk": 2}, (), {"topk": (1, None)}), "reference"
    ),
    *_with_twins(
        Entry("rebase_block_table_to_page16", mm3lab.rebase_block_table_to_page16, ("block_table",), {}), "vllm"
    ),
    Entry("rebase_slot_mapping_to_page16", mm3lab.rebase_slot_mapping_to_page16, ("query_abs_pos",), {}),
    Entry("sides_are_packed", mm3lab.sides_are_packed, ("k_cache", "v_cache"), {}),
    *_with_twins(
        Entry("sparse_block_page_stride", mm3lab.sparse_block_page_stride, ("k_cache", "v_cache"), {}), "vllm"
    ),
]
ENTRY = {e.name: e for e in ENTRIES}

# the argument name a message must carry when that argument is spoiled (positional name -> public name)
PUBLIC_NAME = {
    ("rebase_slot_mapping_to_page16", "query_abs_pos"): "slots",
    ("write_kv_page16", "query_abs_pos"): "slot_mapping",
    ("insert_index_cache", "query_abs_pos"): "slot_mapping",
    ("reference.insert_index_cache", "query_abs_pos"): "slot_mapping",
    ("vllm.insert_index_cache", "query_abs_pos"): "slot_mapping",
}


# arguments of any rank
ANY_RANK = {
    ("topk_blocks", "scores"),
    ("reference.topk_blocks", "scores"),
    ("rebase_block_table_to_page16", "block_table"),
    ("vllm.rebase_block_table_to_page16", "block_table"),
    ("rebase_slot_mapping_to_page16", "query_abs_pos"),
}


@dataclasses.dataclass
class Case:
    entry: str
    label: str
    spoil: Callable  # (args dict, kwargs dict, device) -> None, edits in place
    exc: type
    names: str  # the message must contain this argument name
    nan_caches: bool = False

    @property
    def id(self) -> str:
        return f"{self.entry}-{self.label}"


def _other_device(device: str) -> str:
    return "meta" if device == "cpu" else "cpu"


def _set(name, make):
    def spoil(a, kw, device):
        target = a if name in a else kw
        target[name] = make(target.get(name), device)

    return spoil


def _generated() -> list[Case]:
    cases = []
    for e in ENTRIES:
        for arg in e.args:
            shown = PUBLIC_NAME.get((e.name, arg), arg)
            cases += [
                Case(e.name, f"{arg}-None", _set(arg, lambda t, d: None), TypeError, shown),
                Case(e.name, f"{arg}-list", _set(arg, lambda t, d: t.tolist()), TypeError, shown),
                Case(
                    e.name,
                    f"{arg}-dtype",
                    _set(arg, lambda t, d: t.to(torch.float32) if not t.dtype.is_floating_point else t.to(torch.int32)),
                    TypeError,
                    shown,
                ),
            ]
            if (e.name, arg) not in ANY_RANK:
                cases.append(Case(e.name, f"{arg}-rank", _set(arg, lambda t, d: t.unsqueeze(0)), ValueError, shown))
            if len(e.args) > 1 and arg != e.args[0]:
                cases.append(
                    Case(e.name, f"{arg}-device", _set(arg, lambda t, d: t.to(_other_device(d))), ValueError, shown)
                )
        for name, (lo, _hi) in e.ints.items():
            cases += [
                Case(e.name, f"{name}-bool", _set(name, lambda v, d: True), TypeError, name),
                Case(e.name, f"{name}-float", _set(name, lambda v, d: float(v)), TypeError, name),
                Case(e.name, f"{name}-None", _set(name, lambda v, d: None), TypeError, name),
                Case(e.name, f"{name}-tensor", _set(name, lambda v, d: torch.tensor(v)), TypeError, name),
                Case(e.name, f"{name}-below", _set(name, lambda v, d, lo=lo: lo - 1), ValueError, name),
                Case(e.name, f"{name}-int64min", _set(name, lambda v, d: I64_MIN), ValueError, name),
            ]
    return cases


def _t(values, dtype=torch.int32):
    return lambda t, d: torch.tensor(values, dtype=dtype, device=d)


def _v(name, values, dtype=torch.int32):
    """Spoil: argument ``name`` becomes ``torch.tensor(values)`` on the device."""
    return _set(name, _t(values, dtype))


def _zeros(name, *shape):
    """Spoil: argument ``name`` becomes ``torch.zeros(shape)`` (float32) on the device."""
    return _set(name, lambda t, d: torch.zeros(*shape, device=d))


def _nan(t, d):
    return torch.full_like(t, float("nan"))


MSA = ("msa_decode", "msa_prefill")
HAND: list[Case] = []
for entry in MSA + ("dense_decode", "dense_prefill"):
    HAND += [
        Case(entry, "scale-str", _set("scale", lambda v, d: "0.1"), TypeError, "scale"),
        Case(entry, "scale-tensor", _set("scale", lambda v, d: torch.tensor(0.1)), TypeError, "scale"),
        Case(entry, "scale-nan", _set("scale", lambda v, d: float("nan")), ValueError, "scale"),
        Case(entry, "scale-bool", _set("scale", lambda v, d: True), TypeError, "scale"),
        Case(entry, "q-rows", _set("q", lambda t, d: t[:1]), ValueError, "q"),
        Case(entry, "key-short", _set("key", lambda t, d: t[:1]), ValueError, "key"),
        Case(entry, "value-short", _set("value", lambda t, d: t[:1]), ValueError, "value"),
        Case(entry, "key-dtype16", _set("key", lambda t, d: t.half()), TypeError, "key"),
        Case(entry, "q-nan-caches-rank", _set("q", lambda t, d: t[0]), ValueError, "q", nan_caches=True),
        Case(entry, "block_table-huge", _v("block_table", [[0, 1, 2], [3, 4, 2**31 - 1]]), ValueError, "block_table"),
        Case(
            entry,
            "block_table-int64max",
            _v("block_table", [[0, 1, 2], [3, 4, I64_MAX]], torch.int64),
            ValueError,
            "block_table",
        ),
        Case(entry, "block_table-negative", _v("block_table", [[0, 1, 2], [3, -5, 5]]), ValueError, "block_table"),
        Case(
            entry,
            "block_table-past-cache-nan",
            _v("block_table", [[0, 1, 2], [3, 4, 6]]),
            ValueError,
            "block_table",
            nan_caches=True,
        ),
        Case(
            entry,
            "block_table-zero-width",
            lambda a, kw, d: a.update(block_table=a["block_table"][:, :0]),
            ValueError,
            "seq_lens" if "decode" in entry else "query_abs_pos",
        ),
        Case(entry, "v_cache-is-k_cache", lambda a, kw, d: a.update(v_cache=a["k_cache"]), ValueError, "v_cache"),
        Case(
            entry,
            "q-aliases-k_cache",
            lambda a, kw, d: a.update(key=a["k_cache"].view(-1, 1, 16)[:2]),
            ValueError,
            "key",
            nan_caches=True,
        ),
    ]
for entry in ("msa_decode", "dense_decode"):
    HAND += [
        Case(entry, "seq_lens-past-table", _v("seq_lens", [200, 385]), ValueError, "seq_lens"),
        Case(entry, "seq_lens-int64max", _v("seq_lens", [200, I64_MAX], torch.int64), ValueError, "seq_lens"),
        Case(entry, "seq_lens-2**31", _v("seq_lens", [200, 2**31], torch.int64), ValueError, "seq_lens"),
        Case(
            entry,
            "seq_lens-nan-caches",
            _v("seq_lens", [200, 2**40], torch.int64),
            ValueError,
            "seq_lens",
            nan_caches=True,
        ),
        Case(entry, "decode_query_len-2", _set("decode_query_len", lambda v, d: 2), ValueError, "q"),
        Case(entry, "decode_query_len-huge", _set("decode_query_len", lambda v, d: 2**62), ValueError, "q"),
    ]
for entry in ("msa_prefill", "dense_prefill"):
    HAND += [
        Case(entry, "query_req_id-out", _v("query_req_id", [0, 2]), ValueError, "query_req_id"),
        Case(entry, "query_req_id-minus1", _v("query_req_id", [0, -1]), ValueError, "query_req_id"),
        Case(entry, "query_req_id-int64min", _v("query_req_id", [0, I64_MIN], torch.int64), ValueError, "query_req_id"),
        Case(entry, "query_abs_pos-past-table", _v("query_abs_pos", [199, 384]), ValueError, "query_abs_pos"),
        Case(
            entry,
            "query_abs_pos-int64max",
            _v("query_abs_pos", [199, I64_MAX], torch.int64),
            ValueError,
            "query_abs_pos",
        ),
        Case(entry, "query_req_id-short", _v("query_req_id", [0]), ValueError, "query_req_id"),
    ]
for entry in MSA:
    HAND += [
        Case(entry, "topk-huge", _set("topk", lambda v, d: 2**40), ValueError, "topk"),
        Case(entry, "topk-past-8192", _set("topk", lambda v, d: 8193), ValueError, "topk"),
        Case(entry, "index_k-None-nan", _set("index_k", lambda t, d: None), TypeError, "index_k", nan_caches=True),
        Case(entry, "index_k-short", _set("index_k", lambda t, d: t[:1]), ValueError, "index_k"),
        Case(entry, "index_k-dim", _set("index_k", lambda t, d: t[:, :8]), ValueError, "index_k"),
        Case(entry, "index_q-heads", _set("index_q", lambda t, d: t.expand(2, 2, 16)), ValueError, "index_q"),
        Case(entry, "index_cache-bigger", _zeros("index_cache", 7, 128, 16), ValueError, "index_cache"),
        Case(entry, "index_cache-smaller", _zeros("index_cache", 5, 128, 16), ValueError, "index_cache"),
        Case(entry, "index_cache-dtype", _set("index_cache", lambda t, d: t.half()), TypeError, "index_q"),
        Case(
            entry, "index_q-nan-ok-but-topk-None", _set("topk", lambda v, d: None), TypeError, "topk", nan_caches=True
        ),
    ]
HAND += [
    Case(
        "build_sparse_block_table_decode",
        "out-half",
        lambda a, kw, d: kw.update(out=(torch.zeros(1, 2, 16, dtype=torch.int32, device=d), None)),
        TypeError,
        "out",
    ),
    Case(
        "build_sparse_block_table_decode",
        "out-aliased",
        lambda a, kw, d: kw.update(out=(torch.zeros(1, 2, 16, dtype=torch.int32, device=d),) * 2),
        ValueError,
        "out",
    ),
    Case("build_sparse_block_table_decode", "out-list3", lambda a, kw, d: kw.update(out=[None] * 3), TypeError, "out"),
    Case(
        "build_sparse_block_table_decode",
        "topk_idx-past-table",
        _v("topk_idx", [[[3, 0], [2, 0]]]),
        ValueError,
        "topk_idx",
    ),
    Case(
        "build_sparse_block_table_decode",
        "topk_idx-int64max",
        _v("topk_idx", [[[I64_MAX, 0], [2, 0]]], torch.int64),
        ValueError,
        "topk_idx",
    ),
    Case(
        "build_sparse_block_table_decode",
        "block_table-page-overflow",
        _v("block_table", [[0, 1, 2], [3, 4, 2**28]]),
        ValueError,
        "block_table",
    ),
    Case(
        "build_sparse_block_table_decode",
        "stride-16-overflow",
        lambda a, kw, d: (
            kw.update(block_page_stride=16),
            a.update(block_table=torch.tensor([[0, 1, 2], [3, 4, 2**27]], device=d)),
        ),
        ValueError,
        "block_table",
    ),
    Case(
        "build_sparse_block_table_decode",
        "stride-bool",
        _set("block_page_stride", lambda v, d: True),
        TypeError,
        "block_page_stride",
    ),
    Case(
        "build_sparse_block_table_decode",
        "stride-float",
        _set("block_page_stride", lambda v, d: 8.0),
        TypeError,
        "block_page_stride",
    ),
    Case(
        "build_sparse_block_table_decode",
        "stride-12",
        _set("block_page_stride", lambda v, d: 12),
        ValueError,
        "block_page_stride",
    ),
    Case(
        "reference.build_sparse_block_table_prefill",
        "block_table-page-overflow",
        _v("block_table", [[0, 1, 2], [3, 4, 2**28]], torch.int64),
        ValueError,
        "block_table",
    ),
    Case("rebase_block_table_to_page16", "overflow-2**30", _v("block_table", [[0, 2**30]]), ValueError, "block_table"),
    Case(
        "rebase_block_table_to_page16",
        "overflow-negative",
        _v("block_table", [[0, -(2**30) - 1]]),
        ValueError,
        "block_table",
    ),
    Case(
        "rebase_block_table_to_page16",
        "overflow-int64",
        _v("block_table", [[0, 2**62]], torch.int64),
        ValueError,
        "block_table",
    ),
    Case(
        "vllm.rebase_block_table_to_page16",
        "overflow-2**30",
        _v("block_table", [[0, 2**30]]),
        ValueError,
        "block_table",
    ),
    Case("rebase_slot_mapping_to_page16", "overflow-2**30", _v("query_abs_pos", [0, 2**30]), ValueError, "slots"),
    Case(
        "rebase_slot_mapping_to_page16",
        "overflow-int64",
        _v("query_abs_pos", [0, 2**62], torch.int64),
        ValueError,
        "slots",
    ),
    Case(
        "rebase_block_table_to_page16",
        "out-int64",
        lambda a, kw, d: kw.update(out=torch.zeros(2, 3, dtype=torch.int64, device=d)),
        TypeError,
        "out",
    ),
    Case(
        "rebase_block_table_to_page16",
        "out-shape",
        lambda a, kw, d: kw.update(out=torch.zeros(3, 2, dtype=torch.int32, device=d)),
        ValueError,
        "out",
    ),
    Case(
        "token_slots",
        "slot-overflow",
        _v("block_table", [[0, 1, 2], [3, 4, 2**60]], torch.int64),
        ValueError,
        "block_table",
    ),
    Case(
        "reference.token_slots",
        "slot-overflow",
        _v("block_table", [[0, 1, 2], [3, 4, 2**60]], torch.int64),
        ValueError,
        "block_table",
    ),
    Case("token_slots", "request-minus1", _set("query_req_id", _t([0, -1])), ValueError, "query_req_id"),
    Case("reference.token_slots", "request-minus1", _set("query_req_id", _t([0, -1])), ValueError, "query_req_id"),
    Case("topk_blocks", "topk-huge", _set("topk", lambda v, d: 2**40), ValueError, "topk"),
    Case("topk_blocks", "scores-int", _set("scores", lambda t, d: t.long()), TypeError, "scores"),
    Case("topk_blocks", "scores-0d", _set("scores", lambda t, d: t[0, 0]), ValueError, "scores"),
    Case("reference.topk_blocks", "topk-huge", _set("topk", lambda v, d: 2**40), ValueError, "topk"),
    Case("sides_are_packed", "page-size", _zeros("v_cache", 48, 8, 1, 16), ValueError, "v_cache"),
    Case("sides_are_packed", "dtype", _set("v_cache", lambda t, d: t.half()), TypeError, "v_cache"),
    Case("sides_are_packed", "heads", _zeros("v_cache", 48, 16, 2, 16), ValueError, "v_cache"),
    Case("sparse_block_page_stride", "pages-40-48", _zeros("k_cache", 40, 16, 1, 16), ValueError, "k_cache"),
    Case("sparse_block_page_stride", "int-cache", _set("k_cache", lambda t, d: t.int()), TypeError, "k_cache"),
    Case("insert_index_cache", "slot-past", _set("query_abs_pos", _t([0, 6 * 128])), ValueError, "slot_mapping"),
    Case(
        "insert_index_cache",
        "slot-int64max",
        _set("query_abs_pos", _t([0, I64_MAX], torch.int64)),
        ValueError,
        "slot_mapping",
    ),
    Case(
        "write_kv_page16",
        "slot-int64max",
        _set("query_abs_pos", _t([0, I64_MAX], torch.int64)),
        ValueError,
        "slot_mapping",
    ),
    Case("write_kv_page16", "key-aliases-cache", lambda a, kw, d: a.update(key=a["k_cache"][0, :2]), ValueError, "key"),
]

CASES = _generated() + HAND


def _prepare(case: Case, device: str):
    e = ENTRY[case.entry]
    layer = _layer(device, nan_caches=case.nan_caches)
    args = {name: layer[name] for name in e.args}
    kwargs = dict(e.kwargs)
    case.spoil(args, kwargs, device)
    buffers = [args[name] for name in e.buffers if isinstance(args.get(name), torch.Tensor)]
    for value in kwargs.get("out") or () if isinstance(kwargs.get("out"), (tuple, list)) else [kwargs.get("out")]:
        if isinstance(value, torch.Tensor):
            buffers.append(value)
    return e, args, kwargs, buffers


def _snapshot(buffers) -> list[bytes]:
    out = []
    for t in buffers:
        if t.device.type == "meta":
            out.append(b"")
            continue
        base = t.detach().contiguous().cpu()
        out.append(base.view(torch.uint8).numpy().tobytes() if base.numel() else b"")
    return out


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_call_is_rejected_before_it_writes(case, device):
    e, args, kwargs, buffers = _prepare(case, device)
    before = _snapshot(buffers)
    with pytest.raises(case.exc) as info:
        e.fn(*args.values(), **kwargs)
    assert case.names in str(info.value), f"message does not name {case.names!r}: {info.value}"
    assert _snapshot(buffers) == before, "a rejected call changed a buffer it was given"


def test_the_table_is_large():
    assert len(CASES) >= 300


VALUE_CASES = [c for c in HAND if c.exc is ValueError]


@pytest.mark.parametrize("case", VALUE_CASES, ids=[c.id for c in VALUE_CASES])
def test_bad_value_found_by_the_check_kernel(case):
    """The same rejections when the fused value-check kernel (interpreted) does the checking on the CPU."""
    from mm3lab import _valcheck

    e, args, kwargs, buffers = _prepare(case, "cpu")
    before = _snapshot(buffers)
    with _valcheck.kernel_on_cpu(), pytest.raises(case.exc) as info:
        e.fn(*args.values(), **kwargs)
    assert case.names in str(info.value), f"message does not name {case.names!r}: {info.value}"
    assert _snapshot(buffers) == before, "a rejected call changed a buffer it was given"


LAYER_CASES = [c for c in CASES if c.entry in MSA]


@pytest.mark.parametrize("case", LAYER_CASES, ids=[c.id for c in LAYER_CASES])
def test_a_bad_layer_call_after_a_good_one_is_still_rejected(case):
    """The MSA layer skips the structural checks of a call shape that passed (``mm3lab._checks.PassedChecks``):
    a bad call right after a good one with the same caches and inputs still gets its own error, unwritten."""
    e = ENTRY[case.entry]
    layer = _layer("cpu", nan_caches=case.nan_caches)
    args = {name: layer[name] for name in e.args}
    kwargs = dict(e.kwargs)
    e.fn(*args.values(), **kwargs)  # passes: its call shape is remembered
    case.spoil(args, kwargs, "cpu")
    buffers = [args[name] for name in e.buffers if isinstance(args.get(name), torch.Tensor)]
    before = _snapshot(buffers)
    with pytest.raises(case.exc) as info:
        e.fn(*args.values(), **kwargs)
    assert case.names in str(info.value), f"message does not name {case.names!r}: {info.value}"
    assert _snapshot(buffers) == before, "a rejected call changed a buffer it was given"
