"""Entry point: ``python3 -m benchmarks`` (see the package docstring)."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

import mm3lab

from . import suites
from .common import Context, measure_copy_bandwidth, write_results

GOALS = {
    "host_overhead_us": 15.0,  # eager (validation on) minus graph replay, per entry point
    "sparse_attention_b1_us": 25.0,  # eager, validation on, batch 1, 128K
    "msa_decode_vs_dense": 2.0,  # eager speedup over dense SDPA at batch 16 and 64, 128K
}


def goals(records: list) -> list[dict]:
    """The issue's goals, checked against this run's records (eager = validation on)."""
    eager, graph, rows = {}, {}, []
    for r in records:
        key = (r["name"], tuple(sorted((k, str(v)) for k, v in r["shape"].items())))
        if r.get("mode") == "eager" and r.get("validation") is True:
            eager.setdefault(key, r)
            if r["name"] == "msa_decode" and r.get("baseline") == "dense_sdpa" and r["shape"].get("batch") in (16, 64):
                rows.append({"goal": f"msa_decode eager >= {GOALS['msa_decode_vs_dense']}x dense SDPA",
                             "shape": r["shape"], "value": r["speedup"],
                             "met": r["speedup"] is not None and r["speedup"] >= GOALS["msa_decode_vs_dense"]})
            if r["name"] == "sparse_attention" and r["shape"].get("batch") == 1 and r.get("baseline") == "dense_sdpa":
                us = r["ms"] * 1e3
                rows.append({"goal": f"sparse_attention batch 1 eager <= {GOALS['sparse_attention_b1_us']} us",
                             "shape": r["shape"], "value": round(us, 2), "met": us <= GOALS["sparse_attention_b1_us"]})
        elif r.get("mode") == "graph":
            graph.setdefault(key, r)
    for key, r in eager.items():
        if key in graph:
            us = (r["ms"] - graph[key]["ms"]) * 1e3
            rows.append({"goal": f"{r['name']}: eager - graph <= {GOALS['host_overhead_us']} us", "shape": r["shape"],
                         "value": round(us, 2), "met": us <= GOALS["host_overhead_us"]})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m benchmarks", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="one shape per suite")
    parser.add_argument("--only", nargs="*", choices=sorted(suites.SUITES), help="run only these suites")
    parser.add_argument("--out", default=None, help="results file (default benchmarks/results/<gpu>.json)")
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny shapes on the CPU, every suite's code path, no GPU and no committed results")
    parser.add_argument("--backend", default=None, choices=("triton", "interpret", "torch"),
                        help="mm3lab backend for the run (dry run default: torch)")
    parser.add_argument("--calls", type=int, default=None, help="calls per sample (default 20; dry run 2)")
    parser.add_argument("--samples", type=int, default=None, help="samples per measurement (default 10; dry run 2)")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("the benchmarks need a CUDA GPU (or --dry-run for a CPU smoke run)", file=sys.stderr)
        return 2
    backend = args.backend or ("torch" if args.dry_run else None)
    if backend is not None:
        mm3lab.set_backend(backend)

    torch.manual_seed(0)
    started = time.time()
    if args.dry_run:
        ctx = Context(device="cpu", gpu="cpu-dry-run", copy_TBps=None, quick=True, dry_run=True,
                      calls=args.calls or 2, samples=args.samples or 2, shapes=suites.dry_run_shapes())
        out = Path(args.out) if args.out else Path(tempfile.gettempdir()) / f"mm3lab-bench-dry-run-{os.getpid()}.json"
    else:
        gpu = torch.cuda.get_device_name(0)
        copy = measure_copy_bandwidth()
        ctx = Context(device="cuda", gpu=gpu, copy_TBps=copy, quick=args.quick, calls=args.calls or 20,
                      samples=args.samples or 10, shapes=suites.model_shapes(args.quick))
        ctx.add("copy_bandwidth", {"bytes": 2 << 30}, 2 * (2 << 30) / (copy * 1e12) * 1e3, None, None, 2 * (2 << 30),
                mode="eager", cv=None, samples=None, validation=None, fallback=None)
        out = Path(args.out) if args.out else None
    floor = suites.run_launch_overhead(ctx)
    names = args.only or list(suites.SUITES)
    failures = {}
    for name in names:
        t0 = time.time()
        print(f"[{time.time() - started:6.1f}s] {name}", file=sys.stderr, flush=True)
        fn = getattr(suites, suites.SUITES[name])
        try:
            fn(ctx)
        except Exception as exc:  # noqa: BLE001 (a suite's failure is recorded, the others still run)
            failures[name] = f"{type(exc).__name__}: {exc}"
            print(f"{name} failed: {failures[name]}", file=sys.stderr)
        if ctx.cuda:
            torch.cuda.empty_cache()
        print(f"         {name}: {time.time() - t0:.1f}s", file=sys.stderr, flush=True)
    checked = goals(ctx.records)
    path = write_results(
        ctx, path=out,
        meta={"mm3lab": mm3lab.__version__, "seconds": round(time.time() - started, 1), "failures": failures,
              "quick": args.quick, "dry_run": args.dry_run, "backend": mm3lab.get_backend(),
              "calls_per_sample": ctx.calls, "samples": ctx.samples, "launch_floor_ms": floor,
              "skipped": ctx.notes, "goals": checked},
    )
    copy = "-" if ctx.copy_TBps is None else f"{ctx.copy_TBps:.3f} TB/s"
    print(f"copy bandwidth {copy}; results in {path}")
    print(f"{'name':<22}{'shape':<44}{'mode':<6}{'val':>4}{'ms':>11}{'cv':>6}{'baseline':>16}{'base ms':>11}"
          f"{'speedup':>9}")
    for r in ctx.records:
        shape = ",".join(f"{k}={v}" for k, v in r["shape"].items())[:42]
        val = {True: "on", False: "off"}.get(r.get("validation"), "-")
        print(f"{r['name'][:21]:<22}{shape:<44}{r.get('mode') or '-':<6}{val:>4}{r['ms']:>11.4f}"
              f"{(r.get('cv') or 0):>6.2f}{r['baseline'] or '-'!s:>16}{(r['baseline_ms'] or 0):>11.4f}"
              f"{(r['speedup'] or 0):>9.2f}")
    for g in checked:
        print(f"goal {'met ' if g['met'] else 'MISS'} {g['goal']}: {g['value']} ({g['shape']})")
    for note in ctx.notes:
        print(f"skipped: {note}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
