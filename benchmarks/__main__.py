"""Entry point: ``python3 -m benchmarks`` (see the package docstring)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch

import mm3lab
from mm3lab import _pdl

from . import suites
from .common import Context, measure_copy_bandwidth, merge_payloads, results_path, write_results

GOALS = {
    "host_overhead_us": 15.0,  # issue 14: eager (validation on) minus graph replay, per entry point
    "sparse_attention_b1_us": 25.0,  # issue 14: eager, validation on, batch 1, 128K
    "msa_decode_vs_dense": 2.0,  # issue 14: eager speedup over dense SDPA at batch 16 and 64, 128K
    "prefill_vs_flex_shared": 1.2,  # issue 15: tile / synthetic selections, over FlexAttention
    "prefill_dense_rate": 0.5,  # issue 15: tile / synthetic, useful FLOP rate over dense SDPA's
    "prefill_vs_flex_random": 10.0,  # issue 15: random selections, over FlexAttention
    "prefill_random_ms": 3.03,  # issue 15: random selections, no slower than the per-token kernel's old time
    "indexer_bf16_copy_bw": 0.9,  # issue 16: bf16 scoring at batch 64, 128K, share of copy bandwidth (graph)
    "indexer_fp8_copy_bw": 0.85,  # issue 16: FP8 scoring (keys and scales read), same shape
    "step_fp8_vs_dense": 8.0,  # issue 16: the whole MSA step, FP8 index + FP8 KV, batch 64, 128K (graph)
    "step_b1_vs_dense": 1.0,  # issue 16: the FP8 step at batch 1 from 8K context up (graph)
}

ENTRY_POINTS = (
    "sparse_attention",
    "attention_prefill",
    "block_table_decode",
    "indexer_decode",
    "topk",
    "index_cache_insert",
    "msa_decode",
    "msa_decode_plan",
)
"""Record names of mm3lab entry points (the host-overhead goal pairs their eager and graph records)."""


def _key(r) -> tuple:
    return r["name"], tuple(sorted((k, str(v)) for k, v in r["shape"].items()))


def goals(records: list) -> list[dict]:
    """Issues 14, 15 and 16's goals, checked against the records (eager = validation on, the default)."""
    eager, graph, rows = {}, {}, []

    def row(goal, r, value, met):
        rows.append({"goal": goal, "shape": r["shape"], "value": value, "met": bool(met)})

    for r in records:
        if r["name"] not in ENTRY_POINTS:
            continue
        shape, base = r["shape"], r.get("baseline")
        if r.get("mode") == "graph":
            graph.setdefault(_key(r), r)
            continue
        if r.get("mode") != "eager" or r.get("validation") is not True:
            continue
        eager.setdefault(_key(r), r)
        if r["name"] == "msa_decode" and base == "dense_sdpa" and shape.get("batch") in (16, 64):
            g = GOALS["msa_decode_vs_dense"]
            row(f"msa_decode eager >= {g}x dense SDPA", r, r["speedup"], r["speedup"] is not None and r["speedup"] >= g)
        if r["name"] == "sparse_attention" and shape.get("batch") == 1 and base == "dense_sdpa":
            us, g = r["ms"] * 1e3, GOALS["sparse_attention_b1_us"]
            row(f"sparse_attention batch 1 eager <= {g} us", r, round(us, 2), us <= g)
        if r["name"] == "attention_prefill":
            sel, speed = shape.get("selection"), r.get("speedup")
            if sel in ("tile", "synthetic") and base == "flex_attention":
                g = GOALS["prefill_vs_flex_shared"]
                row(f"prefill ({sel}) >= {g}x FlexAttention", r, speed, speed is not None and speed >= g)
            if sel in ("tile", "synthetic") and base == "dense_sdpa":
                g, ratio = GOALS["prefill_dense_rate"], r.get("flops_ratio")
                row(f"prefill ({sel}) >= {g:.0%} of dense SDPA's FLOP rate", r, ratio, ratio is not None and ratio >= g)
            if sel == "random" and base == "flex_attention":
                g = GOALS["prefill_vs_flex_random"]
                row(f"prefill (random) >= {g}x FlexAttention", r, speed, speed is not None and speed >= g)
                g = GOALS["prefill_random_ms"]
                row(f"prefill (random) <= {g} ms", r, round(r["ms"], 4), r["ms"] <= g)
    for r in records:  # the fp8 decode grid (graph replays, query length 1)
        shape = r["shape"]
        if r.get("suite") != "fp8" or shape.get("q_len") != 1 or r.get("mode") != "graph":
            continue
        cell, dtype, speed = (shape.get("batch"), shape.get("context")), shape.get("dtype"), r.get("speedup")
        if r["name"] == "indexer_decode_grid" and cell == (64, 131072):
            g = GOALS[f"indexer_{dtype}_copy_bw"]
            frac = r.get("fraction_of_copy_bw")
            row(f"{dtype} indexer >= {g:.0%} of copy bandwidth", r, frac, frac is not None and frac >= g)
        if r["name"] == "msa_decode_grid" and shape.get("stage") == "step" and dtype == "fp8":
            if cell == (64, 131072):
                g = GOALS["step_fp8_vs_dense"]
                row(f"FP8 MSA step >= {g}x dense SDPA", r, speed, speed is not None and speed >= g)
            if cell[0] == 1 and cell[1] >= 8192:
                g = GOALS["step_b1_vs_dense"]
                row(f"FP8 MSA step at batch 1 > {g}x dense SDPA", r, speed, speed is not None and speed > g)
    for key, r in eager.items():
        if key in graph:
            us = (r["ms"] - graph[key]["ms"]) * 1e3
            g = GOALS["host_overhead_us"]
            row(f"{r['name']}: eager - graph <= {g} us", r, round(us, 2), us <= g)
    return rows


SUITE_WEIGHTS = {
    "attention_decode": 3.0,
    "attention_prefill": 4.0,
    "spec_decode": 1.0,
    "block_table": 1.0,
    "indexer_decode": 1.0,
    "topk": 0.5,
    "index_cache": 0.5,
    "msa_decode": 2.0,
    "msa_decode_stages": 3.0,
    "indexer_tuning": 1.0,
    "indexer_prefill_tuning": 0.5,
}
"""Relative share of ``--budget`` per suite (a suite not listed: 1). A suite past its share starts no new shape."""

DEFAULT_BUDGET_S = 480.0
"""The default run's time budget on a GPU (every suite; a suite with its own cap keeps it)."""


def _cells(specs) -> tuple | None:
    """``--cells`` as ``((batch, context), ...)``; ``None`` where not given."""
    if not specs:
        return None
    cells = []
    for spec in specs:
        parts = spec.lower().split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise SystemExit(f"--cells: expected BATCHxCONTEXT values such as 1x8192, got {spec!r}")
        cells.append((int(parts[0]), int(parts[1])))
    return tuple(cells)


def _suite_fn(name: str):
    fn = suites.SUITES[name]
    return getattr(suites, fn) if isinstance(fn, str) else fn


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m benchmarks",
        description=sys.modules[__package__].__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="one shape per suite")
    parser.add_argument("--only", nargs="*", choices=sorted(suites.SUITES), help="run only these suites")
    parser.add_argument("--out", default=None, help="results file (default benchmarks/results/<gpu>.json)")
    parser.add_argument(
        "--fresh",
        action="store_true",
        help="overwrite the results file (default: keep the records of suites not run now)",
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=None,
        help=f"seconds for the run's suites, shared by weight (GPU default {DEFAULT_BUDGET_S:.0f}; 0 = none)",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="tiny shapes on the CPU, every suite's code path, no GPU and no committed results",
    )
    parser.add_argument(
        "--backend",
        default=None,
        choices=("triton", "interpret", "torch"),
        help="mm3lab backend for the run (dry run default: torch)",
    )
    parser.add_argument(
        "--cells",
        nargs="+",
        metavar="BxC",
        default=None,
        help="the fp8 grid's (batch, context) cells, e.g. 1x8192 1x32768 (default: its own list, goals first)",
    )
    parser.add_argument("--calls", type=int, default=None, help="calls per sample (default 20; dry run 2)")
    parser.add_argument("--samples", type=int, default=None, help="samples per measurement (default 10; dry run 2)")
    parser.add_argument(
        "--merge",
        nargs="+",
        metavar="FILE",
        default=None,
        help="merge results files (later files win per suite) into --out; runs nothing, no GPU",
    )
    parser.add_argument(
        "--mark-stale",
        nargs="*",
        metavar="SUITE=WHY",
        help="with --merge: note that a suite's records no longer describe the code, and why (cleared when the "
        "suite runs again)",
    )
    args = parser.parse_args(argv)
    if args.mark_stale and not args.merge:
        parser.error("--mark-stale goes with --merge")
    if args.merge:
        return _merge_files(args.merge, args.out, dict(_stale_arg(parser, a) for a in args.mark_stale or ()))
    if not args.dry_run and not torch.cuda.is_available():
        print("the benchmarks need a CUDA GPU (or --dry-run for a CPU smoke run)", file=sys.stderr)
        return 2
    backend = args.backend or ("torch" if args.dry_run else None)
    if backend is not None:
        mm3lab.set_backend(backend)

    torch.manual_seed(0)
    started = time.time()
    if args.dry_run:
        ctx = Context(
            device="cpu",
            gpu="cpu-dry-run",
            copy_TBps=None,
            quick=True,
            dry_run=True,
            calls=args.calls or 2,
            samples=args.samples or 2,
            shapes=suites.dry_run_shapes(),
        )
        out = Path(args.out) if args.out else Path(tempfile.gettempdir()) / f"mm3lab-bench-dry-run-{os.getpid()}.json"
        budget = args.budget or None
    else:
        gpu = torch.cuda.get_device_name(0)
        ctx = Context(
            device="cuda",
            gpu=gpu,
            copy_TBps=None,
            quick=args.quick,
            cells=_cells(args.cells),
            calls=args.calls or 20,
            samples=args.samples or 10,
            shapes=suites.model_shapes(args.quick),
        )
        out = Path(args.out) if args.out else results_path(gpu)
        budget = DEFAULT_BUDGET_S if args.budget is None else (args.budget or None)
    names = args.only or list(suites.SUITES)
    failures, seconds = {}, {}
    run_id = f"{time.strftime('%Y-%m-%dT%H:%M:%S', time.gmtime(started))}-{os.getpid()}-{uuid.uuid4().hex[:8]}"

    def save(final: bool) -> Path:
        meta = {
            "mm3lab": mm3lab.__version__,
            "seconds": round(time.time() - started, 1),
            "failures": failures,
            "quick": args.quick,
            "dry_run": args.dry_run,
            "backend": mm3lab.get_backend(),
            "calls_per_sample": ctx.calls,
            "samples": ctx.samples,
            "max_sample_ms": ctx.max_sample_ms,
            "launch_floor_ms": floor,
            "skipped": ctx.notes,
            "suites": [n for n in names if n in seconds],
            "suite_seconds": seconds,
            "budget_s": budget,
            "complete": final,
            "runs": [
                {
                    "id": run_id,
                    "suites": [n for n in names if n in seconds],
                    "seconds": round(time.time() - started, 1),
                    "pdl": _pdl.enabled(torch.device(ctx.device)),  # the step's kernels launched with PDL
                }
            ],
        }
        return write_results(ctx, path=out, meta=meta, merge=not args.fresh, finalize=_check_goals)

    ctx.suite = "setup"
    if ctx.cuda:
        ctx.copy_TBps = copy = measure_copy_bandwidth()
        ctx.add(
            "copy_bandwidth",
            {"bytes": 2 << 30},
            2 * (2 << 30) / (copy * 1e12) * 1e3,
            None,
            None,
            2 * (2 << 30),
            mode="eager",
            cv=None,
            samples=None,
            validation=None,
            fallback=None,
        )
    floor = suites.run_launch_overhead(ctx)
    for i, name in enumerate(names):
        t0 = time.time()
        ctx.suite = name
        if budget is not None:
            left = budget - (t0 - started)
            weights = [SUITE_WEIGHTS.get(n, 1.0) for n in names[i:]]
            ctx.deadline = t0 + max(0.0, left) * weights[0] / sum(weights)
        print(f"[{t0 - started:6.1f}s] {name}", file=sys.stderr, flush=True)
        n_notes = len(ctx.notes)
        try:
            _suite_fn(name)(ctx)
        except Exception as exc:  # noqa: BLE001 (a suite's failure is recorded, the others still run)
            failures[name] = f"{type(exc).__name__}: {exc}"
            print(f"{name} failed: {failures[name]}", file=sys.stderr)
            if ctx.cuda:
                torch.cuda.synchronize()
        if ctx.cuda:
            torch.cuda.empty_cache()
        ctx.notes[n_notes:] = [n if n.startswith(f"{name}:") else f"{name}: {n}" for n in ctx.notes[n_notes:]]
        seconds[name] = round(time.time() - t0, 1)
        print(f"         {name}: {seconds[name]:.1f}s", file=sys.stderr, flush=True)
        path = save(final=False)  # after every suite: a run cut short keeps what it measured
    ctx.suite = None
    path = save(final=True)
    payload = json.loads(Path(path).read_text())
    copy = "-" if ctx.copy_TBps is None else f"{ctx.copy_TBps:.3f} TB/s"
    print(f"copy bandwidth {copy}; results in {path}")
    _print_table(ctx.records)
    print(
        "seconds per suite: "
        + ", ".join(f"{k} {v}" for k, v in seconds.items())
        + f"; total {time.time() - started:.1f}"
    )
    _print_goals(payload["meta"]["goals"])
    for note in ctx.notes:
        print(f"skipped: {note}")
    return 1 if failures else 0


def _check_goals(payload: dict) -> None:
    payload["meta"]["goals"] = goals(payload["records"])


def _stale_arg(parser, text: str) -> tuple[str, str]:
    suite, sep, why = text.partition("=")
    if not sep or suite not in suites.SUITES or not why.strip():
        names = ", ".join(sorted(suites.SUITES))
        parser.error(f"--mark-stale: expected SUITE=WHY with a suite of {names}, got {text!r}")
    return suite, why.strip()


def _merge_files(paths, out, stale=None) -> int:
    merged = None
    for p in paths:
        payload = json.loads(Path(p).read_text())
        merged = merge_payloads(merged, payload)
    merged["meta"]["stale"] = {**(merged["meta"].get("stale") or {}), **(stale or {})}
    _check_goals(merged)
    target = Path(out) if out else results_path(merged["meta"]["gpu"])
    target.write_text(json.dumps(merged, indent=1) + "\n")
    print(f"merged {len(paths)} files, {len(merged['records'])} records, into {target}")
    _print_goals(merged["meta"]["goals"])
    return 0


def _print_table(records) -> None:
    print(
        f"{'name':<22}{'shape':<44}{'mode':<6}{'val':>4}{'ms':>11}{'cv':>6}{'baseline':>17}{'base ms':>11}"
        f"{'speedup':>9}"
    )
    for r in records:
        shape = ",".join(f"{k}={v}" for k, v in r["shape"].items())[:42]
        val = {True: "on", False: "off"}.get(r.get("validation"), "-")
        print(
            f"{r['name'][:21]:<22}{shape:<44}{r.get('mode') or '-':<6}{val:>4}{r['ms']:>11.4f}"
            f"{(r.get('cv') or 0):>6.2f}{r['baseline'] or '-'!s:>17}{(r['baseline_ms'] or 0):>11.4f}"
            f"{(r['speedup'] or 0):>9.2f}"
        )


def _print_goals(checked) -> None:
    met = sum(g["met"] for g in checked)
    print(f"goals: {met} of {len(checked)} met")
    for g in checked:
        print(f"goal {'met ' if g['met'] else 'MISS'} {g['goal']}: {g['value']} ({g['shape']})")


if __name__ == "__main__":
    sys.exit(main())
