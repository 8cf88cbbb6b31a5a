"""Sparse prefill and speculative decode: the tiled kernel against the per-token kernel and the baselines.

``attention_prefill`` (suite of the same name): one ``chunk``-token chunk at the end of a
``context``-token request (on the GPU 4096 at 32K; bf16, 64 query / 4 KV heads, head dim
128, top-k 16), three selection workloads (``shape.selection``, drawn by
``mm3lab.viz.prefill.selection_scores``):

``random``
    an independent random selection per token (plus its own local block);
``tile``
    one selection per 128-query tile, shared by its rows (plus the local block);
``synthetic``
    sink + needle + recency scores plus content noise that drifts smoothly along the
    chunk and a little per-token jitter (the structure of ``mm3lab.synthetic``'s patterns).

``ms`` is mm3lab's ``sparse_attention`` as a user calls it: eager with the default
dispatch (validation on and off), and as a CUDA-graph replay of the kernel the dispatch
chose (``algorithm`` in the record; ``neighbour_share`` describes the selection). One
record per mode and baseline, the baseline in the same mode: ``flex_attention`` (compiled, block mask from
``mm3lab.interop.flex.block_mask``; its build time apart, ``mask_build_ms``),
``per_token_kernel`` (``algorithm="rows"``, the previous prefill path, validation
off) and ``dense_sdpa``: causal SDPA over the whole ``context`` (FlashAttention),
the FLOP-rate yardstick; its ``baseline_ms`` is that time scaled to the chunk's rows
by FLOPs (``dense_whole_ms`` is the measured time). ``attended_TFLOPs`` counts useful
FLOPs only (``4 * D`` per attended (query head, token) pair); ``flops_ratio`` is it
over the baseline's FLOP rate (dense: its full causal FLOPs).

``spec_decode``: speculative-decode rows (``q_len`` = 2 / 4 / 8 draft tokens per
request, each with its own selection: ``random`` per row or ``shared`` by a request's
rows) at batch 16 / 64, 128K: the tiled kernel (``ms``) against the per-row kernel
(``baseline = "per_token_kernel"``), eager (validation off) and graph. ``speedup`` > 1
means the tiled kernel is faster; ``default_algorithm`` is what ``sparse_attention``
runs for that row count (``mm3lab.attention.choose_algorithm``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import mm3lab
from mm3lab.attention import choose_algorithm, tiled
from mm3lab.constants import SPARSE_BLOCK_SIZE
from mm3lab.testing import relative_error
from mm3lab.viz.prefill import SELECTIONS, selection_scores

from .common import Context, num_sets
from .suites import DecodeProblem, _elt, _flex_fn, _free, _ours, _shapes, _theirs, _try, fallback_reason

PREFILL_ORDER = ("synthetic", "tile", "random")
"""The order the suite runs the selections in (the realistic one first, should the budget run out)."""


def prefill_problem(ctx: Context, kind: str, chunk: int, context: int, seed: int = 1) -> dict:
    """Cache, tables and inputs of one chunk, K/V also as a plain sequence (FlexAttention, SDPA), and
    several query sets (cold L2: calls rotate over them)."""
    s = _shapes(ctx)
    dev, dt = ctx.device, s.dtype
    g = torch.Generator(device=dev).manual_seed(seed)
    nblocks = context // SPARSE_BLOCK_SIZE
    cache = mm3lab.allocate_kv_cache(nblocks, s.hkv, s.d, "dense", dtype=dt, device=dev)
    block_table = torch.randperm(nblocks, generator=g, device=dev).view(1, nblocks).to(torch.int32)
    key = torch.randn(1, context, s.hkv, s.d, generator=g, device=dev, dtype=dt)
    value = torch.randn(1, context, s.hkv, s.d, generator=g, device=dev, dtype=dt)
    tok = torch.arange(context, device=dev)
    slots = block_table[0, tok // SPARSE_BLOCK_SIZE].long() * SPARSE_BLOCK_SIZE + tok % SPARSE_BLOCK_SIZE
    mm3lab.write_kv_page16(key[0], value[0], cache.k_cache, cache.v_cache, slots)
    pos = torch.arange(context - chunk, context, dtype=torch.int32, device=dev)
    req = torch.zeros(chunk, dtype=torch.int32, device=dev)
    scores = selection_scores(kind, chunk, context, hkv=s.hkv, seed=seed, device=dev)
    topk_idx = scores.topk(min(s.topk, nblocks), dim=-1).indices.to(torch.int32).contiguous()
    with mm3lab.validation(False):
        sbt, sctx = mm3lab.build_sparse_block_table_prefill(
            topk_idx, block_table, req, pos, block_page_stride=cache.block_page_stride
        )
    q_bytes = 2 * chunk * s.hq * s.d * _elt(dt)  # q and out
    nq = num_sets(q_bytes + 2 * context * s.hkv * s.d * _elt(dt)) if ctx.cuda else 2
    qs = [torch.randn(chunk, s.hq, s.d, generator=g, device=dev, dtype=dt) for _ in range(nq)]
    return {
        "cache": cache,
        "block_table": block_table,
        "key": key,
        "value": value,
        "pos": pos,
        "req": req,
        "topk_idx": topk_idx,
        "sparse_bt": sbt,
        "sparse_ctx": sctx,
        "qs": qs,
        "seq_lens": [context],
    }


def tile_density(topk_idx: torch.Tensor, pos: torch.Tensor, tile: int = SPARSE_BLOCK_SIZE) -> float:
    """Mean over (KV head, query tile) of the fraction of the tile's causally reachable blocks that
    some row of the tile selects (FlexAttention's block-mask density; 1 = every block is visited)."""
    hkv, n, _ = topk_idx.shape
    nblocks = int(pos.max()) // SPARSE_BLOCK_SIZE + 1
    sel = torch.zeros(hkv, n, nblocks + 1, dtype=torch.bool, device=topk_idx.device)
    sel.scatter_(2, torch.where(topk_idx >= 0, topk_idx, nblocks).long(), True)
    tiles = max(1, n // tile)
    tile = min(tile, n)
    touched = sel[:, : tiles * tile, :nblocks].reshape(hkv, tiles, tile, nblocks).any(2).sum(-1).float()
    reach = (pos[: tiles * tile].reshape(tiles, tile).max(1).values // SPARSE_BLOCK_SIZE + 1).float()
    return float((touched / reach).mean())


def _dense_whole(ctx: Context, context: int) -> dict:
    """Causal SDPA over the whole ``context`` (GQA), eager and graph: ``{mode: Timing}``."""
    s = _shapes(ctx)
    g = torch.Generator(device=ctx.device).manual_seed(11)
    qd = torch.randn(1, s.hq, context, s.d, generator=g, device=ctx.device, dtype=s.dtype)
    kd = torch.randn(1, s.hkv, context, s.d, generator=g, device=ctx.device, dtype=s.dtype)
    vd = torch.randn_like(kd)

    def fn():
        return F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True)

    return _theirs(ctx, [fn], f"dense_sdpa causal {context}")


def run_prefill(ctx: Context, selections=PREFILL_ORDER) -> None:
    """Append ``attention_prefill`` records (one per selection x mode x validation x baseline)."""
    s = _shapes(ctx)
    context, chunk = s.prefill_context, s.prefill_chunk
    dense = _dense_whole(ctx, context)
    _free(ctx)
    for kind in selections:
        if kind not in SELECTIONS:
            raise ValueError(f"selection: expected one of {SELECTIONS}, got {kind!r}")
        if ctx.out_of_time(f"selection {kind}"):
            continue
        _prefill_one(ctx, kind, chunk, context, dense)
        _free(ctx)


def _prefill_one(ctx: Context, kind: str, chunk: int, context: int, dense: dict) -> None:
    from mm3lab.interop import flex

    s = _shapes(ctx)
    group, scale = s.hq // s.hkv, s.d**-0.5
    p = prefill_problem(ctx, kind, chunk, context)
    kc, vc, sbt, sctx = p["cache"].k_cache, p["cache"].v_cache, p["sparse_bt"], p["sparse_ctx"]
    share = float(tiled.neighbour_share(sbt, sctx))
    algorithm = choose_algorithm(chunk)
    fns = [lambda q=q: mm3lab.sparse_attention(q, kc, vc, sbt, sctx, scale) for q in p["qs"]]
    fixed = [lambda q=q: mm3lab.sparse_attention(q, kc, vc, sbt, sctx, scale, algorithm=algorithm) for q in p["qs"]]
    rows = [lambda q=q: mm3lab.sparse_attention(q, kc, vc, sbt, sctx, scale, algorithm="rows") for q in p["qs"]]
    with mm3lab.validation(False):
        out = fns[0]().clone()
        fallback = fallback_reason()
        rows_err = relative_error(rows[0](), out)
    ours = _ours(ctx, fns, f"prefill {kind}", graph=False)
    if ctx.cuda:
        with mm3lab.validation(False):
            ours[("graph", None)] = _try(ctx, f"prefill {kind} graph", lambda: ctx.graph(fixed))
    with mm3lab.validation(False):
        theirs = {"per_token_kernel": _theirs(ctx, rows, f"per-token kernel {kind}")}
    extra = {"per_token_kernel": {"baseline_rel_error": round(rows_err, 5), "baseline_validation": False}}

    def build_mask():
        return flex.block_mask(p["topk_idx"], p["req"], p["pos"], p["seq_lens"], num_q_heads=s.hq)

    mask = _try(ctx, f"flex block mask {kind}", build_mask)
    if mask is not None:
        mask_t = _try(ctx, f"flex block mask {kind} timing", lambda: ctx.eager(build_mask))
        kf = flex.pack_kv(p["key"], p["seq_lens"])
        vf = flex.pack_kv(p["value"], p["seq_lens"])
        qf = [q.transpose(0, 1).unsqueeze(0).contiguous() for q in p["qs"]]
        fn = _flex_fn(ctx)
        ffns = [lambda q=q: fn(q, kf, vf, block_mask=mask, scale=scale, enable_gqa=True) for q in qf]
        flex_out = _try(ctx, f"flex_attention {kind}", lambda: ffns[0]()[0].transpose(0, 1))
        if flex_out is not None:
            err = relative_error(flex_out, out)
            theirs["flex_attention"] = _theirs(ctx, ffns, f"flex_attention {kind}")
            extra["flex_attention"] = {
                "baseline_rel_error": round(err, 5),
                "mask_build_ms": None if mask_t is None else round(mask_t.ms, 6),
            }
            if err > 2e-2:
                ctx.notes.append(f"attention_prefill: flex_attention {kind} differs (relative error {err:.3g})")
    theirs["dense_sdpa"] = dense
    attended = int(sctx.sum()) * group
    useful = 4 * attended * s.d
    whole = 4 * s.hq * s.d * context * (context + 1) / 2  # causal SDPA over the whole context
    chunk_dense = 4 * s.hq * s.d * sum(range(context - chunk + 1, context + 1))  # the chunk's rows, dense
    shape = {
        "chunk": chunk,
        "context": context,
        "selection": kind,
        "q_heads": s.hq,
        "kv_heads": s.hkv,
        "head_dim": s.d,
        "topk": s.topk,
        "dtype": s.dtype_name,
        "tile_density": round(tile_density(p["topk_idx"], p["pos"]), 3),
    }
    common = {"algorithm": algorithm, "neighbour_share": round(share, 3), "fallback": fallback}
    for (mode, validation), t in ours.items():
        if t is None:
            continue
        tflops = useful / (t.ms * 1e-3) / 1e12
        for base, times in theirs.items():
            bt = times.get(mode)
            if bt is None:
                continue
            if base == "dense_sdpa":
                base_ms, base_rate = bt.ms * chunk_dense / whole, whole / (bt.ms * 1e-3) / 1e12
                more = {
                    "dense_whole_ms": round(bt.ms, 6),
                    "dense_scope": "causal SDPA over the whole context, "
                    "baseline_ms scaled to the chunk's rows by FLOPs",
                }
            else:
                base_ms, base_rate, more = bt.ms, useful / (bt.ms * 1e-3) / 1e12, {}
            ctx.add(
                "attention_prefill",
                shape,
                t.ms,
                base,
                base_ms,
                None,
                **t.fields(),
                validation=validation,
                baseline_cv=round(bt.cv, 4),
                attended_TFLOPs=round(tflops, 3),
                baseline_TFLOPs=round(base_rate, 3),
                flops_ratio=round(tflops / base_rate, 3),
                **common,
                **extra.get(base, {}),
                **more,
            )


def run_spec_decode(ctx: Context) -> None:
    """Speculative decode: the tiled kernel against the per-row kernel at ``q_len`` rows per request."""
    s = _shapes(ctx)
    for batch in s.spec_batches:
        if ctx.out_of_time(f"batch {batch}"):
            continue
        p = DecodeProblem(ctx, batch, s.decode_context, index=False)
        p.sets = None
        for q_len in s.spec_q_lens:
            for selection in ("shared", "random"):
                if ctx.out_of_time(f"batch {batch} q_len {q_len} {selection}"):
                    continue
                _spec_one(ctx, p, q_len, selection)
        del p
        _free(ctx)


def _spec_one(ctx: Context, p: DecodeProblem, q_len: int, selection: str) -> None:
    s = _shapes(ctx)
    scale = s.d**-0.5
    kc, vc = p.cache.k_cache, p.cache.v_cache
    sets = p.new_sets(ctx, q_len=q_len, selection=selection)

    def calls(algorithm):
        return [
            lambda st=st: mm3lab.sparse_attention(
                st["q"], kc, vc, st["sparse_bt"], st["sparse_ctx"], scale, algorithm=algorithm
            )
            for st in sets
        ]

    tiled_fns, rows_fns = calls("tiled"), calls("rows")
    with mm3lab.validation(False):
        err = relative_error(tiled_fns[0](), rows_fns[0]())
        fallback = fallback_reason()
        ours = _ours(ctx, tiled_fns, f"spec tiled b{p.batch} q{q_len} {selection}", validation=False)
        if ("eager", None) in ours:
            ours[("eager", False)] = ours.pop(("eager", None))
        theirs = {"per_token_kernel": _theirs(ctx, rows_fns, f"spec rows b{p.batch} q{q_len} {selection}")}
    n_rows = p.batch * q_len
    shape = {
        "batch": p.batch,
        "context": p.context,
        "q_len": q_len,
        "selection": selection,
        "q_heads": s.hq,
        "kv_heads": s.hkv,
        "head_dim": s.d,
        "topk": s.topk,
        "dtype": s.dtype_name,
    }
    share = float(tiled.neighbour_share(sets[0]["sparse_bt"], sets[0]["sparse_ctx"]))
    ctx.compare(
        "spec_decode_attention",
        shape,
        ours,
        theirs,
        p.attended_bytes_of(sets[0]),
        fallback,
        algorithm="tiled",
        default_algorithm=choose_algorithm(n_rows),
        neighbour_share=round(share, 3),
        rel_err_vs_rows=round(err, 6),
    )


__all__ = ["PREFILL_ORDER", "prefill_problem", "run_prefill", "run_spec_decode", "tile_density"]
