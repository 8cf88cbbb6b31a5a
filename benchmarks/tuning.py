"""The indexer's scoring launch across its tuning knobs (suites ``indexer_tuning``, ``indexer_prefill_tuning``).

At batch 64 and 128K context (the dry run: tiny shapes), with bf16 and with FP8 index keys,
the scoring kernel (:func:`mm3lab.indexer.kernel.index_scores_kernel`, the launch that reads
every index key) runs with each number of key tiles in flight in its compiled decode loop
(``num_stages``) and each orientation of its dot (``lanes_x_tokens``: query lanes as the
MMA's rows; ``tokens_x_lanes``: the key tile's 128 tokens as the rows). Each configuration
is a CUDA-graph replay over rotating buffer sets (cold L2), median and cv, recorded as
``indexer_scores_config`` with ``shape.num_stages``, ``shape.orientation`` and
``shape.default`` (the configuration the kernel picks by itself). The baseline of every
record is the default configuration measured in the same run, so ``speedup`` above 1 names
a setting that beats the default.

``indexer_prefill_tuning``: the prefill scoring launch of one 4096-token chunk at 32K context
(the prefill suite's shape) with 8 warps (the default) and with 4, bf16 and FP8 keys. Compiled
for sm_90 with 4 warps, the prefill tile of 64 query vectors takes all 255 registers a thread
may have and spills (904 B of stack for bf16 keys, 640 B for FP8); with 8 warps it spills
24 B and none (``tests/gpu_compile.py --verbose``). The first run of this suite (4 warps then the
default) made 8 warps the default: 1.46x faster with bf16 keys, 1.22x with FP8 keys. Records
``indexer_prefill_config`` with ``shape.num_warps`` and ``shape.default``, against the default
measured in the same run.
"""

from __future__ import annotations

import torch

import mm3lab
from mm3lab.constants import SPARSE_BLOCK_SIZE
from mm3lab.fp8 import FP8_DTYPE
from mm3lab.indexer.kernel import DEFAULT_STAGES, index_scores_kernel

from .common import Context, num_sets
from .fp8 import GridProblem, _elt, _fill, _free, _time

STAGES_TRIED = (2, 3, 4, 5, 6)
ORIENTATIONS = {
    "lanes_x_tokens": (False, False),
    "tokens_x_lanes": (True, False),
    "tokens_x_lanes_paired": (True, True),
}
"""Orientation -> (``tok_m``, ``pair_parts``); paired: an FP8 query's hi and lo parts in one dot."""


def run_indexer_tuning(ctx: Context) -> None:
    """Every (num_stages, orientation) of the scoring launch, bf16 and FP8 keys; see the module docstring."""
    s = ctx.shapes
    batch, context = (64, 131072) if ctx.cuda else (2, 300)
    for dtype in (s.dtype_name, "fp8"):
        if ctx.out_of_time(f"indexer tuning {dtype}"):
            continue
        p = GridProblem(ctx, batch, context, 1, dtype)
        outs = [torch.empty(s.hkv, batch, p.m, device=ctx.device) for _ in p.sets]

        def fns(num_stages, tok_m, pair, p=p, outs=outs):
            return [
                lambda st=st, out=out: index_scores_kernel(
                    st["index_q"],
                    p.index_cache,
                    st["block_table"],
                    st["seq_lens"],
                    st["seq_lens"],
                    1,
                    False,
                    0,
                    1,
                    True,
                    out,
                    index_scale=p.index_scale,
                    num_stages=num_stages,
                    tok_m=tok_m,
                    pair_parts=pair,
                )
                for st, out in zip(p.sets, outs, strict=True)
            ]

        fp8 = dtype == "fp8"
        default_stages = DEFAULT_STAGES["fp8" if fp8 else "bf16"]
        stages = STAGES_TRIED if ctx.cuda else (2, default_stages)
        default = (fp8, fp8)  # the kernel's own choice: tokens x lanes, paired, for FP8 keys
        base = _time(ctx, fns(default_stages, *default))  # (a graph on the GPU, eager on the CPU)
        for orientation, knobs in ORIENTATIONS.items():
            if knobs[1] and not fp8:
                continue  # (pairing splits an FP8 query; bf16 has one part)
            for num_stages in stages:
                is_default = num_stages == default_stages and knobs == default
                t = base if is_default else _time(ctx, fns(num_stages, *knobs))
                shape = {
                    "batch": batch,
                    "context": context,
                    "dtype": dtype,
                    "index_heads": s.hkv,
                    "index_dim": s.di,
                    "num_stages": num_stages,
                    "orientation": orientation,
                    "default": is_default,
                }
                ctx.add(
                    "indexer_scores_config",
                    shape,
                    t.ms,
                    "default_config",
                    base.ms,
                    p.indexer_bytes(),
                    **t.fields(),
                    validation=None if t.mode == "graph" else False,
                    fallback=None,
                )
        del p, outs
        _free(ctx)


PREFILL_WARPS = (8, 4)
"""Warps per program tried for the prefill scoring launch; the first is the kernel's default."""


def run_indexer_prefill_tuning(ctx: Context) -> None:
    """The prefill scoring launch with each of :data:`PREFILL_WARPS`, bf16 and FP8 keys; see the module docstring."""
    s = ctx.shapes
    chunk, context = (4096, 32768) if ctx.cuda else (8, 300)
    dev = ctx.device
    blocks = -(-context // SPARSE_BLOCK_SIZE)
    for dtype in (s.dtype_name, "fp8"):
        if ctx.out_of_time(f"indexer prefill tuning {dtype}"):
            continue
        fp8 = dtype == "fp8"
        g = torch.Generator(device=dev).manual_seed(0)
        index_cache = mm3lab.allocate_index_cache(blocks, s.di, dtype=FP8_DTYPE if fp8 else s.dtype, device=dev)
        index_scale = mm3lab.allocate_index_scale(blocks, device=dev) if fp8 else None
        _fill(ctx, index_cache, index_scale, g)
        block_table = torch.randperm(blocks, generator=g, device=dev).view(1, blocks).to(torch.int32)
        req = torch.zeros(chunk, dtype=torch.int32, device=dev)
        pos = torch.arange(context - chunk, context, dtype=torch.int32, device=dev)
        q_bytes = chunk * s.hkv * s.di * _elt(s.dtype) + s.hkv * chunk * blocks * 4  # index_q and the scores
        sets = num_sets(q_bytes) if ctx.cuda else 2
        qs = [torch.randn(chunk, s.hkv, s.di, generator=g, device=dev, dtype=s.dtype) for _ in range(sets)]
        outs = [torch.empty(s.hkv, chunk, blocks, device=dev) for _ in range(sets)]

        rows = (block_table, req, pos)

        def fns(num_warps, qs=qs, outs=outs, index_cache=index_cache, index_scale=index_scale, rows=rows):
            return [
                lambda q=q, out=out: index_scores_kernel(
                    q, index_cache, *rows, 1, True, 0, 1, True, out, index_scale=index_scale, num_warps=num_warps
                )
                for q, out in zip(qs, outs, strict=True)
            ]

        base = _time(ctx, fns(PREFILL_WARPS[0]))
        for num_warps in PREFILL_WARPS:
            t = base if num_warps == PREFILL_WARPS[0] else _time(ctx, fns(num_warps))
            shape = {
                "chunk": chunk,
                "context": context,
                "dtype": dtype,
                "index_heads": s.hkv,
                "index_dim": s.di,
                "num_warps": num_warps,
                "default": num_warps == PREFILL_WARPS[0],
            }
            nbytes = index_cache.numel() * index_cache.element_size() + q_bytes
            ctx.add(
                "indexer_prefill_config",
                shape,
                t.ms,
                "default_config",
                base.ms,
                nbytes,
                **t.fields(),
                validation=None if t.mode == "graph" else False,
                fallback=None,
            )
        del qs, outs, index_cache, index_scale
        _free(ctx)
