"""One function per kernel family; each appends records to the Context.

Shapes are the model's decode shapes (SPEC section 1): 64 query heads, 4 KV
heads, head dim 128, bf16, top-k 16, 128-token blocks.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton


import mm3lab
from mm3lab.testing import relative_error
from mm3lab.constants import HEAD_DIM, INDEX_HEAD_DIM, NUM_KV_HEADS, NUM_Q_HEADS, SPARSE_BLOCK_SIZE

from . import baselines
from .common import Context, bench, bench_graph
from .prefill import run_prefill  # noqa: F401  (a suite, named in SUITES)

TOPK = 16
DT = torch.bfloat16


@triton.jit
def _empty_kernel(x_ptr):
    pass


def _decode_problem(batch: int, context: int, *, hkv=NUM_KV_HEADS, topk=TOPK, device="cuda", seed=0):
    """Requests of ``context`` tokens each, their own blocks, and a random selection that includes the tail."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    blocks_per_req = math.ceil(context / SPARSE_BLOCK_SIZE)
    block_table = torch.randperm(batch * blocks_per_req, generator=g).view(batch, blocks_per_req).to(torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    self_blk = (context - 1) // SPARSE_BLOCK_SIZE
    scores = torch.rand(hkv, batch, blocks_per_req, generator=g)
    scores[..., self_blk] = 2.0  # the forced local block
    topk_idx = scores.topk(min(topk, blocks_per_req), dim=-1).indices.to(torch.int32)
    return (
        topk_idx.to(device),
        block_table.to(device),
        seq_lens.to(device),
        batch * blocks_per_req,
    )


def run_launch_overhead(ctx: Context) -> dict:
    """The floor every launch-bound kernel is compared with: an empty Triton kernel, per launch
    in a CUDA graph of many, and through do_bench (one launch from Python per timing)."""
    x = torch.empty(1, device="cuda")
    fn = lambda: _empty_kernel[(1,)](x)  # noqa: E731
    floor = {"graph": bench_graph(fn), "do_bench": bench(fn)}
    ctx.add("launch_empty_triton", {"grid": 1}, floor["graph"], None, None, None,
            note="empty Triton kernel, 200 launches per CUDA graph, time per launch")
    ctx.add("launch_empty_triton_eager", {"grid": 1}, floor["do_bench"], None, None, None,
            note="do_bench of an empty Triton kernel")
    return floor


def run_block_table(ctx: Context, floor: dict) -> None:
    rows_list = [1, 64, 256, 1024, 4096] if not ctx.quick else [256]
    for rows in rows_list:
        topk_idx, block_table, seq_lens, _ = _decode_problem(rows, 128 * 1024, hkv=NUM_KV_HEADS)
        out = (
            torch.empty(NUM_KV_HEADS, rows, TOPK * 8, dtype=torch.int32, device="cuda"),
            torch.empty(NUM_KV_HEADS, rows, dtype=torch.int32, device="cuda"),
        )
        fn = lambda: mm3lab.build_sparse_block_table_decode(topk_idx, block_table, seq_lens, out=out)  # noqa: E731
        with mm3lab.validation(False):
            ms = bench_graph(fn)
            ms_eager = bench(fn)
        ref = lambda: baselines.torch_block_table_decode(topk_idx, block_table, seq_lens)  # noqa: E731
        got = fn()
        want = ref()
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), "block table differs from the baseline"
        base_ms = bench_graph(ref, replays=20)
        nbytes = topk_idx.numel() * 4 + rows * TOPK * 4 + out[0].numel() * 4 + out[1].numel() * 4
        shape = {"rows": rows, "kv_heads": NUM_KV_HEADS, "topk": TOPK, "context": 128 * 1024}
        ctx.add("block_table_decode", shape, ms, "torch_ops", base_ms, nbytes,
                vs_empty_launch=round(ms / floor["graph"], 3), ms_do_bench=round(ms_eager, 6),
                do_bench_vs_empty_launch=round(ms_eager / floor["do_bench"], 3))


def _kv_for(batch, context, layout, device="cuda"):
    blocks = batch * math.ceil(context / SPARSE_BLOCK_SIZE)
    cache = mm3lab.allocate_kv_cache(blocks, NUM_KV_HEADS, HEAD_DIM, layout, dtype=DT, device=device)
    cache.kv.normal_()
    return cache


def run_attention_decode(ctx: Context) -> None:
    context = 128 * 1024
    batches = [1, 16, 64] if not ctx.quick else [16]
    scale = HEAD_DIM**-0.5
    for batch in batches:
        topk_idx, block_table, seq_lens, _ = _decode_problem(batch, context)
        for layout in ("dense", "packed") if batch == 64 else ("dense",):
            cache = _kv_for(batch, context, layout)
            stride = cache.block_page_stride
            sbt, sctx = mm3lab.build_sparse_block_table_decode(topk_idx, block_table, seq_lens, block_page_stride=stride)
            q = torch.randn(batch, NUM_Q_HEADS, HEAD_DIM, dtype=DT, device="cuda")
            fn = lambda: mm3lab.sparse_attention(q, cache.k_cache, cache.v_cache, sbt, sctx, scale)  # noqa: E731
            with mm3lab.validation(False):
                out = fn()
                ms = bench(fn)
                ms_graph = bench_graph(fn, replays=50)
            ref_out = baselines.naive_sparse_attention(q, cache.k_cache, cache.v_cache, sbt, sctx, scale)
            err = relative_error(out.float(), ref_out.float())
            assert err < 2e-2, f"attention differs from the naive path: relative error {err:.3e}"
            tokens = int(sctx.sum())
            nbytes = tokens * HEAD_DIM * 2 * 2 + q.numel() * 2 * 2 + sbt.numel() * 4
            shape = {"batch": batch, "context": context, "layout": layout, "q_heads": NUM_Q_HEADS,
                     "kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM, "topk": TOPK, "dtype": "bf16"}
            naive_ms = bench(lambda: baselines.naive_sparse_attention(q, cache.k_cache, cache.v_cache, sbt, sctx, scale))
            ctx.add("attention_decode", shape, ms, "naive_gather_sdpa", naive_ms, nbytes,
                    ms_graph=round(ms_graph, 6), rel_err_vs_naive=round(err, 6))
            if layout == "dense":
                # dense SDPA over the whole context, K/V contiguous per request
                kd = torch.randn(batch, NUM_KV_HEADS, context, HEAD_DIM, dtype=DT, device="cuda")
                vd = torch.randn_like(kd)
                qd = q.view(batch, NUM_Q_HEADS, 1, HEAD_DIM)
                dense_ms = bench(lambda: baselines.dense_sdpa_decode(qd, kd, vd))
                ctx.add("attention_decode", shape, ms, "dense_sdpa", dense_ms, nbytes,
                        ms_graph=round(ms_graph, 6), dense_bytes=kd.numel() * 2 * 2)
                del kd, vd
            del cache
            torch.cuda.empty_cache()


def run_attention_prefill(ctx: Context) -> None:
    context = 32 * 1024
    chunk = 4096 if not ctx.quick else 1024
    g = torch.Generator().manual_seed(1)
    nblocks = context // SPARSE_BLOCK_SIZE
    cache = _kv_for(1, context, "dense")
    block_table = torch.randperm(nblocks, generator=g).view(1, nblocks).to(torch.int32).cuda()
    pos = torch.arange(context - chunk, context, dtype=torch.int32, device="cuda")
    req = torch.zeros(chunk, dtype=torch.int32, device="cuda")
    self_blk = pos.long() // SPARSE_BLOCK_SIZE
    scores = torch.rand(NUM_KV_HEADS, chunk, nblocks, generator=g).cuda()
    scores = scores.masked_fill(torch.arange(nblocks, device="cuda") > self_blk.view(1, -1, 1), -1.0)
    scores.scatter_(2, self_blk.view(1, -1, 1).expand(NUM_KV_HEADS, -1, 1), 2.0)
    topk_idx = scores.topk(TOPK, dim=-1).indices.to(torch.int32)
    sbt, sctx = mm3lab.build_sparse_block_table_prefill(topk_idx, block_table, req, pos)
    q = torch.randn(chunk, NUM_Q_HEADS, HEAD_DIM, dtype=DT, device="cuda")
    with mm3lab.validation(False):
        ms = bench(lambda: mm3lab.sparse_attention(q, cache.k_cache, cache.v_cache, sbt, sctx))
    attended = int(sctx.sum()) * (NUM_Q_HEADS // NUM_KV_HEADS)
    flops = 4 * attended * HEAD_DIM
    # dense causal SDPA over the full 32K context
    qd = torch.randn(1, NUM_Q_HEADS, context, HEAD_DIM, dtype=DT, device="cuda")
    kd = torch.randn(1, NUM_KV_HEADS, context, HEAD_DIM, dtype=DT, device="cuda")
    vd = torch.randn_like(kd)
    dense_ms = bench(lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True))
    dense_flops = 4 * NUM_Q_HEADS * HEAD_DIM * context * (context + 1) / 2
    shape = {"chunk": chunk, "context": context, "q_heads": NUM_Q_HEADS, "kv_heads": NUM_KV_HEADS,
             "head_dim": HEAD_DIM, "topk": TOPK, "dtype": "bf16"}
    tflops = flops / (ms * 1e-3) / 1e12
    dense_tflops = dense_flops / (dense_ms * 1e-3) / 1e12
    ctx.add("attention_prefill", shape, ms, "dense_sdpa_causal_32k", dense_ms, None,
            attended_TFLOPs=round(tflops, 2), baseline_TFLOPs=round(dense_tflops, 2),
            flops_ratio=round(tflops / dense_tflops, 3))
    del cache, qd, kd, vd
    torch.cuda.empty_cache()


def _index_problem(batch, context, device="cuda", seed=2):
    g = torch.Generator().manual_seed(seed)
    blocks_per_req = math.ceil(context / SPARSE_BLOCK_SIZE)
    index_cache = torch.randn(batch * blocks_per_req, SPARSE_BLOCK_SIZE, INDEX_HEAD_DIM, generator=g).to(DT).to(device)
    block_table = torch.randperm(batch * blocks_per_req, generator=g).view(batch, blocks_per_req).to(torch.int32).to(device)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    index_q = torch.randn(batch, NUM_KV_HEADS, INDEX_HEAD_DIM, generator=g).to(DT).to(device)
    return index_q, index_cache, block_table, seq_lens, blocks_per_req


def run_indexer_decode(ctx: Context) -> None:
    context = 128 * 1024
    for batch in [1, 16, 64] if not ctx.quick else [64]:
        index_q, index_cache, block_table, seq_lens, nb = _index_problem(batch, context)
        fn = lambda: mm3lab.index_topk_decode(index_q, index_cache, block_table, seq_lens, TOPK)  # noqa: E731
        with mm3lab.validation(False):
            topk_idx = fn()
            ms = bench(fn)
        base = lambda: baselines.torch_index_scores(index_q, index_cache, block_table, seq_lens, nb).topk(TOPK, dim=-1)  # noqa: E731
        base_ms = bench(base)
        nbytes = batch * context * INDEX_HEAD_DIM * 2
        shape = {"batch": batch, "context": context, "index_heads": NUM_KV_HEADS, "index_dim": INDEX_HEAD_DIM,
                 "topk": TOPK, "dtype": "bf16"}
        ctx.add("indexer_decode", shape, ms, "torch_einsum_amax_topk", base_ms, nbytes)
        # fused top-k + block table against the two launches apart
        if hasattr(mm3lab, "index_topk_block_table_decode"):
            fused = lambda: mm3lab.index_topk_block_table_decode(index_q, index_cache, block_table, seq_lens, TOPK)  # noqa: E731
            apart = lambda: mm3lab.build_sparse_block_table_decode(fn(), block_table, seq_lens)  # noqa: E731
            with mm3lab.validation(False):
                f_out = fused()
                a_out = apart()
                assert torch.equal(f_out[1], a_out[0]) and torch.equal(f_out[2], a_out[1])
                fused_ms = bench(fused)
                apart_ms = bench(apart)
            ctx.add("indexer_decode_fused_block_table", shape, fused_ms, "indexer_then_block_table", apart_ms, nbytes)
        del index_cache
        torch.cuda.empty_cache()


def run_indexer_prefill(ctx: Context) -> None:
    context = 32 * 1024
    chunk = 2048 if not ctx.quick else 512
    index_q, index_cache, block_table, _, nb = _index_problem(1, context)
    g = torch.Generator().manual_seed(3)
    index_q = torch.randn(chunk, NUM_KV_HEADS, INDEX_HEAD_DIM, generator=g).to(DT).cuda()
    pos = torch.arange(context - chunk, context, dtype=torch.int32, device="cuda")
    req = torch.zeros(chunk, dtype=torch.int32, device="cuda")
    with mm3lab.validation(False):
        ms = bench(lambda: mm3lab.index_topk_prefill(index_q, index_cache, block_table, req, pos, TOPK))
    keys = index_cache[block_table[0].long()].reshape(-1, INDEX_HEAD_DIM)  # [S, Di]

    def base():
        dots = torch.einsum("nhd,sd->hns", index_q, keys).float()
        dots = dots.masked_fill(torch.arange(context, device="cuda") > pos.view(1, -1, 1), float("-inf"))
        return dots.view(NUM_KV_HEADS, chunk, nb, SPARSE_BLOCK_SIZE).amax(-1).topk(TOPK, dim=-1)

    base_ms = bench(base)
    flops = 2 * chunk * NUM_KV_HEADS * INDEX_HEAD_DIM * context
    shape = {"chunk": chunk, "context": context, "index_heads": NUM_KV_HEADS, "index_dim": INDEX_HEAD_DIM,
             "topk": TOPK, "dtype": "bf16"}
    ctx.add("indexer_prefill", shape, ms, "torch_einsum_amax_topk", base_ms, context * INDEX_HEAD_DIM * 2,
            score_TFLOPs=round(flops / (ms * 1e-3) / 1e12, 2))


def run_topk(ctx: Context) -> None:
    """Top-16 of 8192-wide score rows (1M tokens): CUDA-graph replay (the kernel is launch-bound
    at few rows), do_bench alongside; the whole-row selection (no group pre-selection) for comparison."""
    from mm3lab.indexer.kernel import topk_kernel

    for rows in [4, 64, 256, 1024] if not ctx.quick else [64]:
        scores = torch.randn(rows, 8192, device="cuda")
        out = torch.empty(1, rows, TOPK, dtype=torch.int32, device="cuda")
        rows3 = scores.view(1, rows, 8192)
        fn = lambda: topk_kernel(rows3, TOPK, out)  # noqa: E731
        whole = lambda: topk_kernel(rows3, TOPK, out, group=1)  # noqa: E731
        base = lambda: torch.topk(scores, TOPK, dim=-1)  # noqa: E731
        fn()
        assert torch.equal(out[0].long(), base().indices), "top-k differs from torch.topk"
        ms, base_ms = bench_graph(fn), bench_graph(base)
        ctx.add("topk", {"rows": rows, "width": 8192, "k": TOPK}, ms, "torch.topk", base_ms, scores.numel() * 4,
                timing="cuda_graph", ms_whole_row=round(bench_graph(whole), 6),
                ms_do_bench=round(bench(fn), 6), baseline_ms_do_bench=round(bench(base), 6))
    # top-k fused with the sparse block table against top-k then the block-table launch, from the
    # same decode scores (the scoring launch left out, so the saved launch is visible)
    for batch, context in [(64, 128 * 1024), (16, 1024 * 1024)] if not ctx.quick else [(64, 128 * 1024)]:
        _, block_table, seq_lens, _ = _decode_problem(batch, context)
        width = block_table.shape[1]
        scores = torch.randn(NUM_KV_HEADS, batch, width, device="cuda")
        idx = torch.empty(NUM_KV_HEADS, batch, TOPK, dtype=torch.int32, device="cuda")
        sbt = torch.empty(NUM_KV_HEADS, batch, TOPK * 8, dtype=torch.int32, device="cuda")
        sctx = torch.empty(NUM_KV_HEADS, batch, dtype=torch.int32, device="cuda")
        rows = dict(positions=1, req=seq_lens, batch=batch)
        fused = lambda: topk_kernel(scores, TOPK, idx, block_table=block_table, sparse_bt=sbt, sparse_ctx=sctx, **rows)  # noqa: E731

        def apart():
            topk_kernel(scores, TOPK, idx, **rows)
            return mm3lab.build_sparse_block_table_decode(idx, block_table, seq_lens)

        with mm3lab.validation(False):
            want = apart()
            fused()
            assert torch.equal(sbt, want[0]) and torch.equal(sctx, want[1]), "fused top-k + block table differs"
            ms, base_ms = bench_graph(fused), bench_graph(apart)
        ctx.add("topk_fused_block_table", {"batch": batch, "kv_heads": NUM_KV_HEADS, "width": width, "k": TOPK},
                ms, "topk_then_block_table", base_ms, scores.numel() * 4, timing="cuda_graph")


def run_index_cache(ctx: Context) -> None:
    for tokens in [16, 4096] if not ctx.quick else [4096]:
        num_blocks = 4096
        cache = torch.zeros(num_blocks, SPARSE_BLOCK_SIZE, INDEX_HEAD_DIM, dtype=DT, device="cuda")
        keys = torch.randn(tokens, INDEX_HEAD_DIM, dtype=DT, device="cuda")
        slots = torch.randperm(num_blocks * SPARSE_BLOCK_SIZE, device="cuda")[:tokens].to(torch.int64)
        with mm3lab.validation(False):
            ms = bench_graph(lambda: mm3lab.insert_index_cache(keys, cache, slots))
        base_ms = bench_graph(lambda: cache.view(-1, INDEX_HEAD_DIM).index_copy_(0, slots, keys))
        ctx.add("index_cache_insert", {"tokens": tokens, "index_dim": INDEX_HEAD_DIM, "dtype": "bf16"}, ms,
                "torch_index_copy", base_ms, tokens * INDEX_HEAD_DIM * 2 * 2 + tokens * 8)


def run_msa_decode(ctx: Context) -> None:
    msa = getattr(mm3lab, "msa_decode", None)
    if msa is None:
        return
    ctx_len = 128 * 1024
    for batch in [16, 64] if not ctx.quick else [16]:
        index_q, index_cache, block_table, seq_lens, nb = _index_problem(batch, ctx_len)
        cache = _kv_for(batch, ctx_len, "dense")
        q = torch.randn(batch, NUM_Q_HEADS, HEAD_DIM, dtype=DT, device="cuda")
        k = torch.randn(batch, NUM_KV_HEADS, HEAD_DIM, dtype=DT, device="cuda")
        v = torch.randn_like(k)
        index_k = torch.randn(batch, INDEX_HEAD_DIM, dtype=DT, device="cuda")
        kwargs = dict(q=q, key=k, value=v, index_q=index_q, index_k=index_k, k_cache=cache.k_cache, v_cache=cache.v_cache,
                      index_cache=index_cache, block_table=block_table, seq_lens=seq_lens)
        with mm3lab.validation(False):
            ms = bench(lambda: msa(**kwargs))
            # as a serving engine runs a layer: captured in a CUDA graph (no host work per step)
            ms_graph = bench_graph(lambda: msa(**kwargs), replays=20)
        kd = torch.randn(batch, NUM_KV_HEADS, ctx_len, HEAD_DIM, dtype=DT, device="cuda")
        vd = torch.randn_like(kd)
        dense_ms = bench(lambda: baselines.dense_sdpa_decode(q.view(batch, NUM_Q_HEADS, 1, HEAD_DIM), kd, vd))
        nbytes = batch * (ctx_len * INDEX_HEAD_DIM * 2 + NUM_KV_HEADS * TOPK * SPARSE_BLOCK_SIZE * HEAD_DIM * 2 * 2)
        ctx.add("msa_decode", {"batch": batch, "context": ctx_len, "dtype": "bf16", "topk": TOPK}, ms,
                "dense_sdpa", dense_ms, nbytes, ms_graph=round(ms_graph, 6),
                speedup_graph=round(dense_ms / ms_graph, 3))
        del cache, kd, vd, index_cache
        torch.cuda.empty_cache()


SUITES = {
    "block_table": "run_block_table",
    "index_cache": "run_index_cache",
    "indexer_decode": "run_indexer_decode",
    "indexer_prefill": "run_indexer_prefill",
    "topk": "run_topk",
    "attention_decode": "run_attention_decode",
    "attention_prefill": "run_attention_prefill",
    "msa_decode": "run_msa_decode",
    "prefill": "run_prefill",
}

__all__ = ["SUITES"]
