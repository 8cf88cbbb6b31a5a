"""Sparse prefill: the tiled kernel against the per-token kernel, FlexAttention and dense SDPA.

One 4096-token chunk at the end of a 32K-token request (bf16, 64 query / 4 KV
heads, head dim 128, top-k 16), three selection workloads (``shape.selection``):

``random``
    an independent random selection per token (plus its own local block);
``tile``
    one selection per 128-query tile, shared by its rows (plus the local block);
``synthetic``
    sink + needle + recency scores plus content noise that drifts smoothly along the
    chunk and a little per-token jitter, the structure of ``mm3lab.synthetic``'s
    patterns: block 0, two needle blocks per head and the blocks just before each
    token win for every token; the rest is shared by neighbours and drifts.

Every record times mm3lab's default dispatch (``ms``) against one baseline
(``baseline_ms``): ``flex_attention`` (compiled, with a block mask from
``mm3lab.interop.flex.block_mask``; the mask build is timed separately in
``mask_build_ms``), ``dense_sdpa`` (causal SDPA over the whole 32K sequence: the
FLOP-rate yardstick) and ``per_token_kernel`` (``sparse_attention(algorithm="rows")``,
the previous prefill path). ``attended_TFLOPs`` counts useful FLOPs only
(``4 * D`` per attended (query head, token) pair); ``flops_ratio`` is it over dense
SDPA's FLOP rate.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import mm3lab
from mm3lab.attention import tiled
from mm3lab.constants import HEAD_DIM, NUM_KV_HEADS, NUM_Q_HEADS, SPARSE_BLOCK_SIZE
from mm3lab.testing import relative_error
from mm3lab.viz.prefill import SELECTIONS, selection_scores

from .common import Context, bench

TOPK = 16
DT = torch.bfloat16


def prefill_problem(kind: str, chunk: int = 4096, context: int = 32 * 1024, device="cuda", seed: int = 1):
    """Cache, tables and inputs of one chunk; K/V also as plain sequences (for FlexAttention and SDPA)."""
    g = torch.Generator().manual_seed(seed)
    nblocks = context // SPARSE_BLOCK_SIZE
    cache = mm3lab.allocate_kv_cache(nblocks, NUM_KV_HEADS, HEAD_DIM, "dense", dtype=DT, device=device)
    block_table = torch.randperm(nblocks, generator=g).view(1, nblocks).to(torch.int32).to(device)
    key = torch.randn(1, context, NUM_KV_HEADS, HEAD_DIM, device=device, dtype=DT)
    value = torch.randn_like(key)
    s = torch.arange(context, device=device)
    slots = block_table[0, s // SPARSE_BLOCK_SIZE].long() * SPARSE_BLOCK_SIZE + s % SPARSE_BLOCK_SIZE
    mm3lab.write_kv_page16(key[0], value[0], cache.k_cache, cache.v_cache, slots)
    pos = torch.arange(context - chunk, context, dtype=torch.int32, device=device)
    req = torch.zeros(chunk, dtype=torch.int32, device=device)
    topk_idx = selection_scores(kind, chunk, context, seed=seed, device=device).topk(TOPK, dim=-1).indices
    topk_idx = topk_idx.to(torch.int32).contiguous()
    sbt, sctx = mm3lab.build_sparse_block_table_prefill(topk_idx, block_table, req, pos)
    q = torch.randn(chunk, NUM_Q_HEADS, HEAD_DIM, dtype=DT, device=device)
    return {"cache": cache, "block_table": block_table, "key": key, "value": value, "pos": pos, "req": req,
            "topk_idx": topk_idx, "sparse_bt": sbt, "sparse_ctx": sctx, "q": q, "seq_lens": [context]}


def tile_density(topk_idx: torch.Tensor, pos: torch.Tensor, tile: int = SPARSE_BLOCK_SIZE) -> float:
    """Mean over (KV head, query tile) of the fraction of the tile's causally reachable blocks that
    some row of the tile selects (FlexAttention's block-mask density; 1 = every block is visited)."""
    hkv, n, _ = topk_idx.shape
    nblocks = int(pos.max()) // SPARSE_BLOCK_SIZE + 1
    sel = torch.zeros(hkv, n, nblocks + 1, dtype=torch.bool, device=topk_idx.device)
    sel.scatter_(2, torch.where(topk_idx >= 0, topk_idx, nblocks).long(), True)
    tiles = n // tile
    touched = sel[:, : tiles * tile, :nblocks].reshape(hkv, tiles, tile, nblocks).any(2).sum(-1).float()
    reach = (pos[: tiles * tile].reshape(tiles, tile).max(1).values // SPARSE_BLOCK_SIZE + 1).float()
    return float((touched / reach).mean())


def _dense_sdpa_rate(context: int) -> tuple[float, float]:
    """Causal SDPA over the whole sequence: ``(ms, TFLOP/s)``."""
    qd = torch.randn(1, NUM_Q_HEADS, context, HEAD_DIM, dtype=DT, device="cuda")
    kd = torch.randn(1, NUM_KV_HEADS, context, HEAD_DIM, dtype=DT, device="cuda")
    vd = torch.randn_like(kd)
    ms = bench(lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True))
    return ms, 4 * NUM_Q_HEADS * HEAD_DIM * context * (context + 1) / 2 / (ms * 1e-3) / 1e12


def _prefill_records(ctx: Context, kind: str, chunk: int, context: int, dense: tuple[float, float], flex_fn) -> None:
    from mm3lab.interop import flex

    p = prefill_problem(kind, chunk, context)
    args = (p["q"], p["cache"].k_cache, p["cache"].v_cache, p["sparse_bt"], p["sparse_ctx"])
    share = float(tiled.neighbour_share(p["sparse_bt"], p["sparse_ctx"]))
    with mm3lab.validation(False):
        out = mm3lab.sparse_attention(*args)
        ms = bench(lambda: mm3lab.sparse_attention(*args))
        rows_ms = bench(lambda: mm3lab.sparse_attention(*args, algorithm="rows"))
        rows_err = relative_error(mm3lab.sparse_attention(*args, algorithm="rows"), out)
    ms_validation_on = bench(lambda: mm3lab.sparse_attention(*args))

    def build_mask():
        return flex.block_mask(p["topk_idx"], p["req"], p["pos"], p["seq_lens"], num_q_heads=NUM_Q_HEADS)

    mask = build_mask()
    mask_ms = bench(build_mask)
    qf = p["q"].transpose(0, 1).unsqueeze(0)
    kf = flex.pack_kv(p["key"], p["seq_lens"])
    vf = flex.pack_kv(p["value"], p["seq_lens"])
    flex_out = flex_fn(qf, kf, vf, block_mask=mask, enable_gqa=True)[0].transpose(0, 1)
    flex_err = relative_error(flex_out, out)
    flex_ms = bench(lambda: flex_fn(qf, kf, vf, block_mask=mask, enable_gqa=True))
    attended = int(p["sparse_ctx"].sum()) * (NUM_Q_HEADS // NUM_KV_HEADS)
    useful = 4 * attended * HEAD_DIM
    tflops = useful / (ms * 1e-3) / 1e12
    dense_ms, dense_tflops = dense
    shape = {"chunk": chunk, "context": context, "q_heads": NUM_Q_HEADS, "kv_heads": NUM_KV_HEADS,
             "head_dim": HEAD_DIM, "topk": TOPK, "dtype": "bf16", "selection": kind,
             "tile_density": round(tile_density(p["topk_idx"], p["pos"]), 3)}
    common = {"mode": "eager", "validation": False, "fallback": None, "cv": None, "samples": None,
              "algorithm": mm3lab.attention.choose_algorithm(chunk, share=share), "neighbour_share": round(share, 3),
              "attended_TFLOPs": round(tflops, 2),
              "flops_ratio": round(tflops / dense_tflops, 3), "ms_validation_on": round(ms_validation_on, 6)}
    ctx.add("attention_prefill", shape, ms, "flex_attention", flex_ms, None, mask_build_ms=round(mask_ms, 6),
            baseline_rel_error=round(flex_err, 5), baseline_TFLOPs=round(useful / (flex_ms * 1e-3) / 1e12, 2),
            **common)
    ctx.add("attention_prefill", shape, ms, "dense_sdpa", dense_ms, None, baseline_TFLOPs=round(dense_tflops, 2),
            **common)
    ctx.add("attention_prefill", shape, ms, "per_token_kernel", rows_ms, None, baseline_rel_error=round(rows_err, 5),
            baseline_TFLOPs=round(useful / (rows_ms * 1e-3) / 1e12, 2), **common)


def run_prefill(ctx: Context, selections=SELECTIONS) -> None:
    """Append ``attention_prefill`` records (one per selection x baseline)."""
    from torch.nn.attention.flex_attention import flex_attention

    context = 32 * 1024
    chunk = 4096 if not ctx.quick else 1024
    flex_fn = torch.compile(flex_attention, dynamic=False)
    dense = _dense_sdpa_rate(context)
    torch.cuda.empty_cache()
    for kind in selections:
        _prefill_records(ctx, kind, chunk, context, dense, flex_fn)
        torch.cuda.empty_cache()


__all__ = ["SELECTIONS", "prefill_problem", "run_prefill", "selection_scores", "tile_density"]
