"""The tiled prefill kernel's settings side by side: ``python3 -m benchmarks.tiled_variants``.

One 4096-token chunk at 32K context (the ``attention_prefill`` suite's problem: bf16, 64 query /
4 KV heads, head dim 128, top-k 16) for each selection (``random``, ``tile``, ``synthetic``), and
``mm3lab.attention.tiled.tiled_attention_kernel`` launched directly (validation off) with each arm,
timed as a CUDA-graph replay over rotating input sets (cold L2), median and cv:

``default``
    what ``sparse_attention`` runs from 1024 rows: the fused pre-pass, the rule (``mode="auto"``,
    two launches), the default tile;
``prepass_kernel``
    the pre-pass as a launch of its own (``prepass="kernel"``);
``union`` / ``rows``
    every tile walks its union / its rows (``mode``);
``row_tile_programs``
    the tiles that walk their rows do it with a program per tile (``row_programs=False``), not per row;
``factor_<f>``
    the rule's ``row_mode_factor`` (the default: :data:`mm3lab.attention.tiled.ROW_MODE_FACTOR`);
``mixed_steps`` / ``gathered_steps``
    every tile walks its union, with every step testing whether its pages are plain (no loop of lean
    steps first; ``lean_steps=False``) / with the lean steps gathering K and V page by page (no block
    reads; ``block_steps=False``): the same steps as ``union``, within rounding;
``t<T>_w<warps>_p<pages>_s<stages>`` (``union_`` prefixed: every tile walks its union)
    other tile shapes (rows per tile, warps, union pages per step, pipeline stages);
``row_s<stages>``, ``row_bn<tokens>_s<stages>``, ``row_tile_bn<tokens>_s<stages>``
    the launch of the tiles that walk their rows with another pipeline depth (``row_num_stages``) and
    tokens per step (``row_block_n``), ``row_tile_`` with a program per tile (``row_programs=False``).
    Where every tile walks its union, that launch's programs only read their tile's choice and exit,
    as many at a time as registers and shared memory let share an SM: compiled for sm_90, the default
    takes 200 registers a thread (2 programs per SM), 64-token steps 128 (one stage) or 138 (two);
``per_row``
    the per-row kernel (``sparse_attention(..., algorithm="rows")``), the previous prefill path.

Each record has the arm's output's largest difference from the default arm's (``max_abs_vs_default``;
0 for the arms that must give the same bits: the pre-pass and the rule only choose how the same
steps run). ``--arms A B``: the default and those arms only; ``--rounds N``: every arm N times, the
arms in turn (an A/B in one process). ``--dry-run``: tiny shapes on the CPU (the code path only,
eager timings).
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time

import torch

import mm3lab
from mm3lab.attention import tiled

from . import suites
from .common import Context, _triton_version, write_side_results
from .prefill import prefill_problem

SELECTIONS = ("tile", "synthetic", "random")

ARMS = {
    "default": {},
    "prepass_kernel": {"prepass": "kernel"},
    "union": {"mode": "union"},
    "rows": {"mode": "rows"},
    "row_tile_programs": {"row_programs": False},
    "factor_0.7": {"row_mode_factor": 0.7},
    "factor_0.9": {"row_mode_factor": 0.9},
    "t8_w8_p4_s2": {"tile_rows": 8, "num_warps": 8, "pages_per_step": 4, "num_stages": 2},
    "t4_w4_p2_s2": {"tile_rows": 4, "num_warps": 4, "pages_per_step": 2, "num_stages": 2},
    "t4_w4_p4_s3": {"tile_rows": 4, "num_warps": 4, "pages_per_step": 4, "num_stages": 3},
    "mixed_steps": {"mode": "union", "lean_steps": False},
    "gathered_steps": {"mode": "union", "block_steps": False, "lean_steps": True},
    "union_t8_w8_p8_s2": {"mode": "union", "tile_rows": 8, "num_warps": 8, "pages_per_step": 8, "num_stages": 2},
    "union_t8_w8_p4_s2": {"mode": "union", "tile_rows": 8, "num_warps": 8, "pages_per_step": 4, "num_stages": 2},
    "union_t4_w4_p8_s2": {"mode": "union", "tile_rows": 4, "num_warps": 4, "pages_per_step": 8, "num_stages": 2},
    "union_t4_w4_p4_s3": {"mode": "union", "tile_rows": 4, "num_warps": 4, "pages_per_step": 4, "num_stages": 3},
    "t8_w8_p8_s2": {"tile_rows": 8, "num_warps": 8, "pages_per_step": 8, "num_stages": 2},
    "row_s1": {"row_num_stages": 1},
    "row_s3": {"row_num_stages": 3},
    "row_bn64_s1": {"row_block_n": 64, "row_num_stages": 1},
    "row_bn64_s2": {"row_block_n": 64, "row_num_stages": 2},
    "row_tile_bn64_s1": {"row_programs": False, "row_block_n": 64, "row_num_stages": 1},
    "row_tile_bn64_s2": {"row_programs": False, "row_block_n": 64, "row_num_stages": 2},
}
"""Arm -> ``tiled_attention_kernel`` keyword arguments."""

SAME_BITS = ("prepass_kernel", "row_tile_programs", "factor_0.7", "factor_0.9")
"""Arms whose output must equal the default's bit for bit (where every tile walks as in the default)."""


def _calls(p: dict, outs: list, arm: str) -> list:
    """The arm's calls, one per input set (the tiled arms write into ``outs``)."""
    kc, vc, sbt, sctx = p["cache"].k_cache, p["cache"].v_cache, p["sparse_bt"], p["sparse_ctx"]
    if arm == "per_row":
        return [lambda q=q: mm3lab.sparse_attention(q, kc, vc, sbt, sctx, algorithm="rows") for q in p["qs"]]
    kw, scale = ARMS[arm], p["qs"][0].shape[-1] ** -0.5
    return [
        lambda q=q, o=o: tiled.tiled_attention_kernel(q, kc, vc, sbt, sctx, scale, o, None, **kw)
        for q, o in zip(p["qs"], outs, strict=True)
    ]


def run(ctx: Context, selections=SELECTIONS, arms=None, rounds: int = 1) -> list[dict]:
    """Each selection's arms (the per-row kernel last), ``rounds`` times in turn; the first arm's output is
    the one the others are compared with (``default`` first where it is among them)."""
    s = ctx.shapes
    arms = arms or list(ARMS)
    records = []
    for kind in selections:
        p = prefill_problem(ctx, kind, s.prefill_chunk, s.prefill_context)
        outs = [torch.empty_like(q) for q in p["qs"]]
        default = None
        for round_, name in itertools.product(range(rounds), [*arms, "per_row"]):
            fns = _calls(p, outs, name)
            with mm3lab.validation(False):
                got = fns[0]()
                got = (outs[0] if got is None else got).clone()
                if default is None:
                    default = got
                timing = ctx.graph(fns) if ctx.cuda else ctx.eager(fns)
            records.append(
                {
                    "selection": kind,
                    "arm": name,
                    "round": round_,
                    "kwargs": ARMS.get(name, {"algorithm": "rows"}),
                    "mode": "graph" if ctx.cuda else "eager",
                    "ms": round(timing.ms, 5),
                    "cv": round(timing.cv, 4),
                    "max_abs_vs_default": float((got.float() - default.float()).abs().max()),
                }
            )
            print(records[-1], flush=True)
        del p, outs
        if ctx.cuda:
            torch.cuda.empty_cache()
    return records


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="results file (default benchmarks/results/tiled-variants/<gpu>.json)")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU, no results kept")
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), help="arms to time (default: all; default first)")
    parser.add_argument("--rounds", type=int, default=1, help="times each arm is measured, the arms in turn")
    parser.add_argument("--selections", nargs="+", choices=SELECTIONS, help="selections to time (default: all)")
    args = parser.parse_args(argv)
    if args.dry_run:
        ctx = Context("cpu", "cpu-dry-run", None, True, True, calls=1, samples=1, shapes=suites.dry_run_shapes())
        selections, arms = ("tile",), ["default", "union"]
    elif torch.cuda.is_available():
        ctx = Context("cuda", torch.cuda.get_device_name(0), None, False, calls=20, samples=9)
        ctx.shapes = suites.model_shapes(False)
        selections, arms = SELECTIONS, None
    else:
        print("needs a CUDA GPU (or --dry-run)", file=sys.stderr)
        return 2
    started = time.time()
    if args.arms:
        arms = ["default", *(a for a in args.arms if a != "default")]
    if args.selections:
        selections = tuple(args.selections)
    records = run(ctx, selections, arms, args.rounds)
    for r in records:
        if r["arm"] in SAME_BITS and r["max_abs_vs_default"] != 0:
            print(f"note: {r['arm']} ({r['selection']}) differs from the default", file=sys.stderr)
    meta = {
        "gpu": ctx.gpu,
        "torch": torch.__version__,
        "triton": _triton_version(),
        "method": "CUDA-graph replay of tiled_attention_kernel (validation off), calls rotating over input "
        "sets (cold L2), median over samples and cv",
        "calls_per_sample": ctx.calls,
        "samples": ctx.samples,
        "seconds": round(time.time() - started, 1),
    }
    if not args.dry_run:
        write_side_results("tiled-variants", ctx.gpu, args.out, meta, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
