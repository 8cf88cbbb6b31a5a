"""SPEC section 9 in the MSA layer: msa_decode / msa_prefill and the plans over FP8 caches.

The layer's FP8 keywords (``index_scale``, ``k_scale``, ``v_scale``) reach the insert, the
KV write, the indexer and the attention; every one is checked before anything is written.
The kernels (interpreted here) are compared with the PyTorch path on the same FP8 caches:
the same cache bits, the same selection (the needle pattern has no near ties), and the
output within :data:`mm3lab.fp8.ATTENTION_FP8_DEQUANT_ATOL`.
"""

from __future__ import annotations

import pytest
import torch

import mm3lab
from mm3lab.fp8 import ATTENTION_FP8_DEQUANT_ATOL, FP8_DTYPE, quantize
from mm3lab.testing import plan_sizes, small_msa_layer

DT = torch.float32  # the interpreter's bf16 arithmetic is inexact


def _layer(device, **kw):
    return small_msa_layer(device, index_dim=32, **kw)


def _fp8_caches(layer, index=True, kv=True):
    """FP8 copies of the layer's caches (history quantized by the SPEC 9 rule); None where kept as is."""
    c = layer.cache
    out = {"k_cache": c.k_cache, "v_cache": c.v_cache, "index_cache": layer.index_cache}
    if kv:
        c8 = mm3lab.allocate_kv_cache(
            c.num_blocks, c.num_kv_heads, c.head_dim, c.layout, dtype=FP8_DTYPE, device=c.kv.device, fill=0.0
        )
        vals, scale = quantize(c.kv)
        c8.kv.copy_(vals)
        c8.scale.copy_(scale)
        out.update(k_cache=c8.k_cache, v_cache=c8.v_cache, k_scale=c8.k_scale, v_scale=c8.v_scale, _kv=c8)
    if index:
        ic = mm3lab.allocate_index_cache(
            layer.index_cache.shape[0],
            layer.index_cache.shape[2],
            dtype=FP8_DTYPE,
            device=layer.index_cache.device,
            fill=0.0,
        )
        isc = mm3lab.allocate_index_scale(ic.shape[0], device=ic.device)
        vals, scale = quantize(layer.index_cache)
        ic.copy_(vals)
        isc.copy_(scale)
        out.update(index_cache=ic, index_scale=isc)
    return out


def _clone(caches):
    out = {}
    for k, v in caches.items():
        if k == "_kv":
            continue
        out[k] = v
    if "_kv" in caches:
        c8 = caches["_kv"]
        kv, scale = c8.kv.clone(), c8.scale.clone()
        views = mm3lab.page16_views(kv)
        sviews = mm3lab.page16_views(scale.unsqueeze(-1))
        out.update(k_cache=views[0], v_cache=views[1], k_scale=sviews[0].squeeze(-1), v_scale=sviews[1].squeeze(-1))
    if "index_scale" in caches:
        out.update(index_cache=caches["index_cache"].clone(), index_scale=caches["index_scale"].clone())
    return out


def _inputs(layer, caches):
    args = {
        "q": layer.q,
        "key": layer.key,
        "value": layer.value,
        "index_q": layer.index_q,
        "index_k": layer.index_k,
        "block_table": layer.block_table,
        "seq_lens": layer.seq_lens,
        "decode_query_len": layer.decode_query_len,
    }
    args.update({k: v for k, v in caches.items() if not k.startswith("_")})
    return args


def _cache_args(caches):
    """``(k_cache, v_cache, index_cache)`` of :func:`_fp8_caches` / :func:`_clone`."""
    return caches["k_cache"], caches["v_cache"], caches["index_cache"]


def _scales(caches) -> dict:
    return {k: caches[k] for k in ("index_scale", "k_scale", "v_scale")}


def _bits(t):
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t


@pytest.mark.parametrize("index,kv", [(True, True), (True, False), (False, True)], ids=["both", "index", "kv"])
@pytest.mark.parametrize("layout,dql", [("packed", 1), ("dense", 2)])
def test_msa_decode_fp8_kernels_match_torch_path(index, kv, layout, dql):
    layer = _layer("cpu", dql=dql, layout=layout)
    base = _fp8_caches(layer, index=index, kv=kv)
    runs = []
    for name in ("kernels", "torch"):
        caches = _clone(base)
        with mm3lab.use_backend(mm3lab.get_backend() if name == "kernels" else "torch"):
            out, step = mm3lab.msa_decode(**_inputs(layer, caches), topk=3, return_intermediates=True)
        runs.append((out, step, caches))
    (out_k, step_k, ck), (out_t, step_t, ct) = runs
    for name in ck:  # the inserts stored the same bits
        assert torch.equal(_bits(ck[name]), _bits(ct[name])), name
    assert torch.equal(step_k.topk_idx, step_t.topk_idx)
    assert torch.equal(step_k.sparse_bt, step_t.sparse_bt) and torch.equal(step_k.sparse_ctx, step_t.sparse_ctx)
    assert (out_k.float() - out_t.float()).abs().max().item() <= ATTENTION_FP8_DEQUANT_ATOL


def test_msa_decode_fp8_stays_near_full_precision():
    """FP8 caches against the float32 step: the needle pattern selects the same blocks."""
    layer = _layer("cpu", dql=1)
    want, step32 = mm3lab.msa_decode(
        **_inputs(layer, _fp8_caches(layer, False, False)), topk=3, return_intermediates=True
    )
    layer = _layer("cpu", dql=1)
    got, step8 = mm3lab.msa_decode(**_inputs(layer, _fp8_caches(layer)), topk=3, return_intermediates=True)
    assert torch.equal(step8.topk_idx, step32.topk_idx)
    assert (got - want).abs().max().item() <= mm3lab.fp8.ATTENTION_FP8_ATOL


def test_msa_prefill_fp8_kernels_match_torch_path():
    layer = _layer("cpu", dql=1, batch=1, context=260)
    base = _fp8_caches(layer)
    req = torch.zeros(4, dtype=torch.int32)
    pos = torch.tensor([256, 257, 258, -1], dtype=torch.int32)  # a padded row
    q = torch.cat([layer.q.repeat(3, 1, 1), layer.q[:1]])
    key = layer.key.repeat(4, 1, 1)
    value = layer.value.repeat(4, 1, 1)
    index_q = layer.index_q.repeat(4, 1, 1)
    index_k = layer.index_k.repeat(4, 1)
    outs = []
    for name in ("kernels", "torch"):
        caches = {k: v for k, v in _clone(base).items()}
        with mm3lab.use_backend(mm3lab.get_backend() if name == "kernels" else "torch"):
            out, step = mm3lab.msa_prefill(
                q,
                key,
                value,
                index_q,
                index_k,
                block_table=layer.block_table,
                query_req_id=req,
                query_abs_pos=pos,
                topk=2,
                return_intermediates=True,
                **caches,
            )
        outs.append((out, step))
    assert torch.equal(outs[0][1].topk_idx, outs[1][1].topk_idx)
    assert (outs[0][0][:3] - outs[1][0][:3]).abs().max().item() <= ATTENTION_FP8_DEQUANT_ATOL


@pytest.mark.parametrize("drop", ["index_scale", "k_scale", "v_scale"])
def test_missing_scale_is_rejected_before_any_write(drop):
    layer = _layer("cpu")
    caches = _clone(_fp8_caches(layer))
    before = {k: _bits(v).clone() for k, v in caches.items()}
    caches[drop] = None
    with pytest.raises(ValueError, match=drop):
        mm3lab.msa_decode(**_inputs(layer, caches), topk=2)
    for k, v in caches.items():
        if v is not None:
            assert torch.equal(_bits(v), before[k]), k


@pytest.mark.parametrize("step", [mm3lab.msa_decode, mm3lab.reference.msa_decode])
def test_integer_queries_over_an_fp8_cache_are_rejected_before_any_write(step):
    """An FP8 KV cache takes queries of any float dtype, and only those: the layer's own check,
    since its steps do not repeat the attention entry point's checks."""
    layer = _layer("cpu")
    caches = _clone(_fp8_caches(layer))
    before = {k: _bits(v).clone() for k, v in caches.items()}
    args = _inputs(layer, caches)
    args["q"] = args["q"].to(torch.int32)
    with pytest.raises(TypeError, match="q"):
        step(**args, topk=2)
    for k, v in caches.items():
        assert torch.equal(_bits(v), before[k]), k


def test_scale_for_a_non_fp8_cache_is_rejected():
    layer = _layer("cpu")
    isc = mm3lab.allocate_index_scale(layer.index_cache.shape[0])
    with pytest.raises(ValueError, match="index_scale"):
        mm3lab.msa_decode(**_inputs(layer, _fp8_caches(layer, False, False)), index_scale=isc, topk=2)


def test_bad_scale_shape_is_rejected_before_any_write():
    layer = _layer("cpu")
    caches = _clone(_fp8_caches(layer))
    kv_before = _bits(caches["k_cache"]).clone()
    caches["index_scale"] = caches["index_scale"][:-1]
    with pytest.raises(ValueError, match="index_scale"):
        mm3lab.msa_decode(**_inputs(layer, caches), topk=2)
    assert torch.equal(_bits(caches["k_cache"]), kv_before)


def test_fp8_decode_plan_is_bit_identical_to_msa_decode():
    layer = _layer("cpu", dql=2)
    base = _fp8_caches(layer)
    one = _clone(base)
    want = mm3lab.msa_decode(**_inputs(layer, one), topk=3)
    two = _clone(base)
    caches = _cache_args(two)
    scales = _scales(two)
    plan = mm3lab.MSADecodePlan(*caches, **plan_sizes(layer), decode_query_len=2, topk=3, query_dtype=DT, **scales)
    assert plan.uses_kernels
    inputs = (layer.q, layer.key, layer.value, layer.index_q, layer.index_k)
    tables = (layer.block_table, layer.seq_lens)
    got = plan.run(*inputs, *caches, *tables, **scales)
    assert torch.equal(got, want)
    for name in one:
        assert torch.equal(_bits(one[name]), _bits(two[name])), name
    with pytest.raises(ValueError, match="k_scale"):
        plan.run(*inputs, *caches, *tables, **{**scales, "k_scale": None})
    with pytest.raises(TypeError, match="q"):
        plan.run(layer.q.half(), *inputs[1:], *caches, *tables, **scales)


def test_fp8_prefill_plan_is_bit_identical_to_msa_prefill():
    layer = _layer("cpu", batch=1, context=260)
    base = _fp8_caches(layer)
    req = torch.zeros(2, dtype=torch.int32)
    pos = torch.tensor([258, 259], dtype=torch.int32)
    args = (
        layer.q.repeat(2, 1, 1),
        layer.key.repeat(2, 1, 1),
        layer.value.repeat(2, 1, 1),
        layer.index_q.repeat(2, 1, 1),
        layer.index_k.repeat(2, 1),
    )
    one = _clone(base)
    want = mm3lab.msa_prefill(*args, block_table=layer.block_table, query_req_id=req, query_abs_pos=pos, topk=2, **one)
    two = _clone(base)
    scales = _scales(two)
    plan = mm3lab.MSAPrefillPlan(*_cache_args(two), num_tokens=2, **plan_sizes(layer), topk=2, query_dtype=DT, **scales)
    got = plan.run(*args, *_cache_args(two), layer.block_table, req, pos, **scales)
    assert torch.equal(got, want)


def test_plan_rejects_scales_it_was_not_planned_with():
    layer = _layer("cpu")
    caches = (layer.cache.k_cache, layer.cache.v_cache, layer.index_cache)
    with pytest.raises(ValueError, match="k_scale"):
        mm3lab.MSADecodePlan(*caches, **plan_sizes(layer), k_scale=torch.ones(1))
    with pytest.raises(TypeError, match="query_dtype"):
        mm3lab.MSADecodePlan(*caches, **plan_sizes(layer), query_dtype=torch.int32)
