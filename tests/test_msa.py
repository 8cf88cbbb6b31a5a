"""The MSA layer in one call (SPEC section 2): msa_decode / msa_prefill, the dense baseline, the cost model.

The end-to-end check: the output of the whole step (inserts, indexer, top-k,
sparse block table, sparse attention) equals the dense-masked reference, i.e.
attention over the request's whole sequence restricted to the selected blocks,
computed from the step's own ``topk_idx``.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import mm3lab
from mm3lab import cost, msa, reference
from mm3lab.constants import DEFAULT_TOPK, PAGES_PER_SPARSE_BLOCK, SPARSE_BLOCK_SIZE
from mm3lab.testing import assert_close, assert_equal_int, assert_same, relative_error, run_paths

FP32 = dict(atol=2e-5, rtol=2e-5)
BF16 = dict(atol=2e-2, rtol=2e-2)


def small_layer(device="cpu", layout="packed", dql=1, pattern="needle", seed=0, **kw):
    shape = dict(batch=2, num_kv_heads=2, group_size=3, head_dim=32, index_dim=16)
    shape.update(kw)
    return msa.synthetic_layer(
        600, layout=layout, pattern=pattern, decode_query_len=dql, device=device, seed=seed, **shape
    )


def dense_masked(layer, topk_idx, req, pos):
    return reference.dense_masked_attention(
        layer.q.float(), layer.full_key.float(), layer.full_value.float(), topk_idx, req, pos
    )


def cache_of(layer, req, pos):
    """K, V and index key the caches hold for tokens (req, pos), read through the page-128 view."""
    physical = layer.block_table.long()[req.long(), pos.long() // SPARSE_BLOCK_SIZE]
    off = pos.long() % SPARSE_BLOCK_SIZE
    return layer.cache.kv[physical, 0, off], layer.cache.kv[physical, 1, off], layer.index_cache[physical, off]


# ----------------------------------------------------------------------------
# the MSA step
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["dense", "packed"])
@pytest.mark.parametrize("dql", [1, 3], ids=["decode", "spec_decode"])
def test_msa_decode_matches_dense_masked_reference(device, layout, dql):
    layer = small_layer(device, layout, dql)
    out, step = msa.msa_decode(**layer.inputs(), topk=3, return_intermediates=True)
    n, hq, d = layer.q.shape
    hkv = layer.cache.num_kv_heads
    assert out.shape == (n, hq, d) and out.dtype == layer.q.dtype
    assert step.topk_idx.shape == (hkv, n, 3)
    assert step.sparse_bt.shape == (hkv, n, 3 * PAGES_PER_SPARSE_BLOCK)
    assert step.scores.shape == (hkv, n, layer.block_table.shape[1])
    assert step.lse.shape == (n, hq)
    # the forced local block comes first and the ctx ends at the query (causal tail last)
    self_blk = step.query_abs_pos.long() // SPARSE_BLOCK_SIZE
    assert_equal_int(step.topk_idx[:, :, 0], self_blk.expand(hkv, -1), "local block first")
    tail = step.query_abs_pos.long() % SPARSE_BLOCK_SIZE + 1
    assert ((step.sparse_ctx.long() - tail) % SPARSE_BLOCK_SIZE == 0).all()
    # the new tokens are in both caches
    k, v, ik = cache_of(layer, step.query_req_id, step.query_abs_pos)
    assert torch.equal(k, layer.key) and torch.equal(v, layer.value) and torch.equal(ik, layer.index_k)
    expected = dense_masked(layer, step.topk_idx, step.query_req_id, step.query_abs_pos)
    assert_close(out, expected, **FP32, name="msa_decode vs dense-masked")


def test_msa_decode_kernels_match_torch_backend():
    """The whole step on the kernels (interpreted here) and on the PyTorch references: same integers, close floats."""
    results = []
    for name in ("kernels", "torch"):
        layer = small_layer(layout="dense", dql=2, seed=3)
        with mm3lab.use_backend(mm3lab.get_backend() if name == "kernels" else "torch"):
            out, step = msa.msa_decode(**layer.inputs(), topk=4, return_intermediates=True)
        results.append((layer, out, step))
    (la, oa, sa), (lb, ob, sb) = results
    for field in ("topk_idx", "sparse_bt", "sparse_ctx", "slot_mapping"):
        assert_equal_int(getattr(sa, field), getattr(sb, field), field)
    assert_close(sa.scores, sb.scores, atol=1e-4, rtol=1e-5, name="scores")
    assert_close(oa, ob, **FP32)
    assert torch.equal(la.cache.kv, lb.cache.kv) and torch.equal(la.index_cache, lb.index_cache)


def _layer_results(returned, args, kwargs):
    out, step = returned
    ints = (step.query_req_id, step.query_abs_pos, step.slot_mapping, step.topk_idx, step.sparse_bt, step.sparse_ctx)
    return out, step.lse, step.scores, ints


@pytest.mark.parametrize("mode,dql", [("decode", 1), ("decode", 3), ("prefill", 5)])
def test_msa_reference_twins_agree_with_the_kernel_path(device, mode, dql):
    """``mm3lab.reference.msa_decode`` / ``msa_prefill`` (the layer from the reference steps) on
    fresh caches give what the public entry points give on every path."""

    def inputs():
        layer = small_layer(device, "packed", dql=dql, seed=3)
        args = dict(layer.inputs(), topk=3, return_intermediates=True)
        if mode == "prefill":
            req, pos = msa.decode_query_rows(args.pop("seq_lens"), args.pop("decode_query_len"))
            args.update(query_req_id=req, query_abs_pos=pos)
        return (), args

    entry = msa.msa_decode if mode == "decode" else msa.msa_prefill
    got = run_paths(entry, inputs, result=_layer_results)
    for path in ("kernel", "torch"):
        out, lse, scores, ints = got[path]
        want_out, want_lse, want_scores, want_ints = got["reference"]
        assert_same(ints, want_ints, f"{mode} row, slot and selection integers: {path} vs reference")
        assert_same((out, lse, scores), (want_out, want_lse, want_scores), f"{mode} floats: {path}", **FP32)


def test_msa_prefill_rows_in_any_order_match_decode_rows(device):
    """A prefill chunk (the last 12 tokens of each request), rows shuffled, one padded row."""
    chunk = 12
    layer = small_layer(device, "packed", dql=chunk, seed=5)
    dec_out, dec_step = msa.msa_decode(**layer.inputs(), topk=3, return_intermediates=True)

    layer = small_layer(device, "packed", dql=chunk, seed=5)  # fresh caches: the chunk not yet written
    n = layer.q.shape[0]
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(1)).to(device)
    req, pos = msa.decode_query_rows(layer.seq_lens, chunk)

    def rows(t, pad):
        return torch.cat([t[perm], pad.to(t.dtype).unsqueeze(0)])

    args = layer.inputs()
    for name in ("q", "key", "value", "index_q", "index_k"):
        args[name] = rows(args[name], torch.ones_like(args[name][0]))
    del args["seq_lens"], args["decode_query_len"]
    pad_req, pad_pos = torch.tensor(0, device=device), torch.tensor(-1, device=device)
    out, step = msa.msa_prefill(
        **args, query_req_id=rows(req, pad_req), query_abs_pos=rows(pos, pad_pos), topk=3, return_intermediates=True
    )
    assert_equal_int(step.topk_idx[:, :n], dec_step.topk_idx[:, perm], "topk_idx")
    assert_equal_int(step.sparse_ctx[:, :n], dec_step.sparse_ctx[:, perm], "sparse_ctx")
    assert (step.topk_idx[:, n] == -1).all() and (step.sparse_ctx[:, n] == 0).all()
    assert_close(out[:n], dec_out[perm], **FP32)
    assert torch.equal(out[n].cpu(), torch.zeros_like(out[n]).cpu())
    assert step.slot_mapping[n] == -1


def test_dense_baseline_is_full_causal_attention(device):
    layer = small_layer(device, "dense", dql=2, seed=2)
    dense, dstep = msa.dense_decode(**layer.dense_inputs(), return_intermediates=True)
    assert dstep.scores is None
    m = layer.block_table.shape[1]
    hkv, n = layer.cache.num_kv_heads, layer.q.shape[0]
    every_block = torch.arange(m, device=device).expand(hkv, n, m)
    req, pos = msa.decode_query_rows(layer.seq_lens, 2)
    assert_close(dense, dense_masked(layer, every_block, req, pos), **FP32, name="dense vs dense-masked")
    # MSA with every block selected is dense attention
    sparse_all = msa.msa_decode(**layer.inputs(), topk=m)
    assert_close(sparse_all, dense, **FP32, name="msa(topk = all blocks) vs dense")
    # the prefill baseline on the same rows
    args = layer.dense_inputs()
    del args["seq_lens"], args["decode_query_len"]
    assert_close(msa.dense_prefill(**args, query_req_id=req, query_abs_pos=pos), dense, **FP32)


def test_model_defaults():
    import inspect

    for fn in (msa.msa_decode, msa.msa_prefill):
        params = inspect.signature(fn).parameters
        assert params["topk"].default == DEFAULT_TOPK == 16
        assert params["init_blocks"].default == 0 and params["local_blocks"].default == 1


# ----------------------------------------------------------------------------
# bad input: raised before anything is written
# ----------------------------------------------------------------------------


def _bad(layer, **changes):
    args = layer.inputs()
    for name, fn in changes.items():
        args[name] = fn(args[name])
    return args


BAD = [
    ("q head dim", dict(q=lambda t: t[..., :16]), ValueError, "head dim"),
    ("group does not divide", dict(q=lambda t: t[:, :5]), ValueError, "not a multiple"),
    ("q dtype", dict(q=lambda t: t.half()), TypeError, "q: dtype"),
    ("key shape", dict(key=lambda t: t[:, :1]), ValueError, "key"),
    ("value dtype", dict(value=lambda t: t.double()), TypeError, "value"),
    ("index_k head dim", dict(index_k=lambda t: t[:, :8]), ValueError, "index_k"),
    ("index_q heads", dict(index_q=lambda t: t[:, :1]), ValueError, "index_q"),
    ("seq_len past the table", dict(seq_lens=lambda t: t + 10_000), ValueError, "seq_lens"),
    ("rows", dict(q=lambda t: t[:1]), ValueError, "q"),
    ("views fit no layout", dict(v_cache=lambda t: t[:-16]), ValueError, "layout"),
]


@pytest.mark.parametrize("what,changes,error,match", BAD, ids=[b[0] for b in BAD])
def test_bad_input_raises_and_leaves_caches_untouched(what, changes, error, match):
    layer = small_layer(layout="dense")
    kv, index_cache = layer.cache.kv.clone(), layer.index_cache.clone()
    with pytest.raises(error, match=match):
        msa.msa_decode(**_bad(layer, **changes))
    assert torch.equal(layer.cache.kv, kv) and torch.equal(layer.index_cache, index_cache)


def test_bad_topk_and_forcing_raise_before_writes():
    layer = small_layer()
    kv = layer.cache.kv.clone()
    with pytest.raises(ValueError, match="topk"):
        msa.msa_decode(**layer.inputs(), topk=0)
    with pytest.raises((TypeError, ValueError), match="local_blocks"):
        msa.msa_decode(**layer.inputs(), local_blocks=-1)
    assert torch.equal(layer.cache.kv, kv)


def test_bad_prefill_rows_raise():
    layer = small_layer()
    args = layer.inputs()
    del args["seq_lens"], args["decode_query_len"]
    req, pos = msa.decode_query_rows(layer.seq_lens)
    with pytest.raises(ValueError, match="query_req_id"):
        msa.msa_prefill(**args, query_req_id=req + 5, query_abs_pos=pos)
    with pytest.raises(ValueError, match="query_abs_pos"):
        msa.msa_prefill(**args, query_req_id=req, query_abs_pos=pos + 100_000)


# ----------------------------------------------------------------------------
# what the selection keeps; the synthetic layer
# ----------------------------------------------------------------------------


def test_attention_weights_and_selected_mass():
    layer = small_layer(dql=2)
    req, pos = msa.decode_query_rows(layer.seq_lens, 2)
    w = msa.attention_weights(layer.q, layer.full_key, req, pos)
    n, hq, s = w.shape
    assert_close(w.sum(-1), torch.ones(n, hq), atol=1e-5, rtol=0)
    assert (w[0, :, int(pos[0]) + 1 :] == 0).all()  # causal
    hkv = layer.cache.num_kv_heads
    m = layer.block_table.shape[1]
    all_blocks = torch.arange(m).expand(hkv, n, m)
    assert_close(msa.selected_mass(w, all_blocks), torch.ones(n, hq), atol=1e-5, rtol=0)
    assert (msa.selected_mass(w, torch.full((hkv, n, 2), -1)) == 0).all()
    one = torch.full((hkv, n, 2), -1)
    one[:, :, 0] = 1
    one[:, :, 1] = 1  # a duplicate counts once
    expected = w[..., SPARSE_BLOCK_SIZE : 2 * SPARSE_BLOCK_SIZE].sum(-1)
    assert_close(msa.selected_mass(w, one), expected, atol=1e-6, rtol=0)


def test_selection_finds_the_needle():
    """With the needle pattern every head selects the needle block right after the forced local block."""
    layer = msa.synthetic_layer(2048, num_kv_heads=2, group_size=2, head_dim=32, index_dim=16, pattern="needle")
    out, step = msa.msa_decode(**layer.inputs(), topk=2, return_intermediates=True)
    needle = layer.sequences[0].needle_block
    assert step.topk_idx[:, 0, 1].tolist() == [needle, needle]
    w = msa.attention_weights(layer.q, layer.full_key, step.query_req_id, step.query_abs_pos)
    random_layer = msa.synthetic_layer(2048, num_kv_heads=2, group_size=2, head_dim=32, index_dim=16, pattern="random")
    _, random_step = msa.msa_decode(**random_layer.inputs(), topk=2, return_intermediates=True)
    w_random = msa.attention_weights(
        random_layer.q, random_layer.full_key, random_step.query_req_id, random_step.query_abs_pos
    )
    # two blocks of 16 keep far more of the attention when there is structure to find
    assert msa.selected_mass(w, step.topk_idx).min() > 2 * msa.selected_mass(w_random, random_step.topk_idx).max()


def test_synthetic_layer_is_seeded_and_filled():
    a = small_layer(seed=4, pattern="sink")
    b = small_layer(seed=4, pattern="sink")
    for name in ("q", "key", "index_q", "index_k", "full_key", "block_table"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert torch.equal(a.cache.kv, b.cache.kv)
    assert a.seq_lens.tolist() == [600, 637]
    req, pos = msa.decode_query_rows(a.seq_lens)
    k, _, ik = cache_of(a, req, pos)
    assert (k == 0).all() and (ik == 0).all()  # the step's own tokens are not in the caches yet
    k, v, _ = cache_of(a, req, pos - 1)
    assert torch.equal(k, a.full_key[req.long(), pos.long() - 1])
    with pytest.raises(ValueError, match="pattern"):
        msa.synthetic_layer(300, pattern="zigzag")


# ----------------------------------------------------------------------------
# the cost model
# ----------------------------------------------------------------------------


def test_sparse_tokens():
    assert cost.sparse_tokens(0) == 0
    assert cost.sparse_tokens(1000) == 1000
    assert cost.sparse_tokens(2048) == 2048
    assert cost.sparse_tokens(2049) == 15 * SPARSE_BLOCK_SIZE + 1  # 16 of 17 blocks, the tail has 1 token
    assert cost.sparse_tokens(1 << 20) == 16 * SPARSE_BLOCK_SIZE
    assert cost.sparse_tokens(300, topk=1) == 300 - 2 * SPARSE_BLOCK_SIZE  # only the tail block


def test_attention_cost_model_numbers():
    c = cost.attention_cost(131072)
    per_token = 4 * 128 * 2 * 2  # 4 KV heads, D 128, K and V, bf16
    assert c.dense_kv_bytes == 131072 * per_token
    assert c.sparse_kv_bytes == 2048 * per_token
    assert 64 * c.sparse_kv_bytes == 268_435_456  # batch 64 decode reads ~268 MB of K/V
    assert c.indexer_bytes == 131072 * 128 * 2
    assert c.table_bytes == 4 * 16 * 8 * 4
    assert math.isclose(c.kv_saving, 64.0)
    assert c.sparse_total_bytes == c.sparse_kv_bytes + c.indexer_bytes + c.table_bytes
    curve = cost.cost_curve()
    assert curve[-1].context_len == 1 << 20 and curve[0].context_len == 1024
    assert all(a.dense_kv_bytes < b.dense_kv_bytes for a, b in zip(curve, curve[1:], strict=False))
    assert {c.sparse_tokens for c in curve if c.context_len >= 2048} == {2048}
    assert math.isclose(cost.read_time_us(4.8e6, 4.8), 1.0)
    text = cost.cost_table([1024, 1 << 20])
    assert "1048576" in text and "saving" in text
    with pytest.raises(ValueError, match="context_len"):
        cost.attention_cost(-1)
    with pytest.raises(ValueError, match="topk"):
        cost.attention_cost(10, topk=0)


# ----------------------------------------------------------------------------
# the model's shapes on a GPU
# ----------------------------------------------------------------------------


def random_model_layer(context_len, batch, layout, dtype, device):
    """A decode step with the model's shapes on random data, built on the device (fast at 128K tokens)."""
    from mm3lab.constants import HEAD_DIM, INDEX_HEAD_DIM, NUM_KV_HEADS, NUM_Q_HEADS

    g = torch.Generator(device=device).manual_seed(0)
    hkv, hq, d, di = NUM_KV_HEADS, NUM_Q_HEADS, HEAD_DIM, INDEX_HEAD_DIM
    lens = [context_len + 37 * r for r in range(batch)]
    s_max = max(lens)
    m = -(-s_max // SPARSE_BLOCK_SIZE)
    num_blocks = batch * m + 2
    block_table = torch.randperm(num_blocks, device=device, generator=g)[: batch * m].view(batch, m).int()
    full_key = torch.randn(batch, s_max, hkv, d, device=device, generator=g).to(dtype)
    full_value = torch.randn(batch, s_max, hkv, d, device=device, generator=g).to(dtype)
    full_index_k = torch.randn(batch, s_max, di, device=device, generator=g).to(dtype)
    cache = mm3lab.allocate_kv_cache(num_blocks, hkv, d, layout, dtype=dtype, device=device, fill=0.0)
    index_cache = torch.zeros(num_blocks, SPARSE_BLOCK_SIZE, di, dtype=dtype, device=device)
    for r, length in enumerate(lens):  # the history: every token but the last
        pos = torch.arange(length - 1, device=device)
        physical = block_table.long()[r, pos // SPARSE_BLOCK_SIZE]
        cache.kv[physical, 0, pos % SPARSE_BLOCK_SIZE] = full_key[r, : length - 1]
        cache.kv[physical, 1, pos % SPARSE_BLOCK_SIZE] = full_value[r, : length - 1]
        index_cache[physical, pos % SPARSE_BLOCK_SIZE] = full_index_k[r, : length - 1]
    last = torch.tensor(lens, device=device) - 1
    rows = torch.arange(batch, device=device)
    return msa.SyntheticLayer(
        q=torch.randn(batch, hq, d, device=device, generator=g).to(dtype),
        key=full_key[rows, last],
        value=full_value[rows, last],
        index_q=torch.randn(batch, hkv, di, device=device, generator=g).to(dtype) / di**0.5,
        index_k=full_index_k[rows, last],
        cache=cache,
        index_cache=index_cache,
        block_table=block_table,
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        decode_query_len=1,
        full_key=full_key,
        full_value=full_value,
        sequences=(),
        pattern="random",
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("layout", ["packed", "dense"])
def test_msa_decode_model_shapes_128k_cuda(layout):
    """64 query heads, 4 KV heads, head dim 128, top-k 16, block 128, at 128K context, bf16."""
    layer = random_model_layer(131072, 2, layout, torch.bfloat16, "cuda")
    out, step = msa.msa_decode(**layer.inputs(), return_intermediates=True)
    assert step.topk_idx.shape == (4, 2, 16)
    assert (step.sparse_ctx <= 16 * SPARSE_BLOCK_SIZE).all() and (step.sparse_ctx > 15 * SPARSE_BLOCK_SIZE).all()
    expected = dense_masked(layer, step.topk_idx, step.query_req_id, step.query_abs_pos)
    assert relative_error(out, expected) < 1e-2
    assert_close(out, expected, atol=5e-3, rtol=2e-2, name="msa_decode 128K vs dense-masked")
    # the dense baseline against PyTorch SDPA over each whole sequence
    dense = msa.dense_decode(**layer.dense_inputs())
    for r in range(2):
        length = int(layer.seq_lens[r])
        q = layer.q[r : r + 1].transpose(0, 1).unsqueeze(0)  # [1, Hq, 1, D]
        k = layer.full_key[r, :length].transpose(0, 1).unsqueeze(0)  # [1, Hkv, S, D]
        v = layer.full_value[r, :length].transpose(0, 1).unsqueeze(0)
        sdpa = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=True)
        assert relative_error(dense[r], sdpa[0, :, 0]) < 1e-2
        assert_close(dense[r], sdpa[0, :, 0], atol=5e-3, rtol=2e-2, name="dense_decode vs SDPA")
