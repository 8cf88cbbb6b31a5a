"""The indexer's scoring launch across its tuning knobs (suite ``indexer_tuning``).

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
"""

from __future__ import annotations

import torch

from mm3lab.indexer.kernel import DEFAULT_STAGES, index_scores_kernel

from .common import Context
from .fp8 import GridProblem, _free, _time

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
