"""Entry point: ``python3 -m benchmarks`` (see the package docstring)."""

from __future__ import annotations

import argparse
import sys
import time

import torch

import mm3lab

from . import suites
from .common import Context, measure_copy_bandwidth, write_results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m benchmarks", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="one shape per suite")
    parser.add_argument("--only", nargs="*", choices=sorted(suites.SUITES), help="run only these suites")
    parser.add_argument("--out", default=None, help="results file (default benchmarks/results/<gpu>.json)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("the benchmarks need a CUDA GPU", file=sys.stderr)
        return 2
    from tqdm.auto import tqdm

    torch.manual_seed(0)
    gpu = torch.cuda.get_device_name(0)
    copy = measure_copy_bandwidth()
    ctx = Context(device="cuda", gpu=gpu, copy_TBps=copy, quick=args.quick)
    ctx.add("copy_bandwidth", {"bytes": 2 << 30}, 2 * (2 << 30) / (copy * 1e12) * 1e3, None, None, 2 * (2 << 30))
    floor = suites.run_launch_overhead(ctx)
    names = args.only or list(suites.SUITES)
    started = time.time()
    failures = {}
    bar = tqdm(names, desc="benchmarks", unit="suite")
    for name in bar:
        bar.set_postfix_str(name)
        fn = getattr(suites, suites.SUITES[name])
        try:
            fn(ctx, floor) if name == "block_table" else fn(ctx)
        except Exception as exc:  # a suite's failure is recorded, the others still run
            failures[name] = f"{type(exc).__name__}: {exc}"
            print(f"{name} failed: {failures[name]}", file=sys.stderr)
        torch.cuda.empty_cache()
    path = write_results(
        ctx,
        path=None if args.out is None else __import__("pathlib").Path(args.out),
        meta={"mm3lab": mm3lab.__version__, "seconds": round(time.time() - started, 1), "failures": failures,
              "quick": args.quick},
    )
    print(f"copy bandwidth {copy:.3f} TB/s; results in {path}")
    print(f"{'name':<34}{'shape':<58}{'ms':>10}{'baseline':>26}{'speedup':>9}{'TB/s':>8}{'%copy':>7}")
    for r in ctx.records:
        shape = ",".join(f"{k}={v}" for k, v in r["shape"].items())[:56]
        print(
            f"{r['name']:<34}{shape:<58}{r['ms']:>10.4f}{str(r['baseline'] or '-'):>26}"
            f"{(r['speedup'] or 0):>9.2f}{(r['achieved_TBps'] or 0):>8.3f}{100 * (r['fraction_of_copy_bw'] or 0):>6.1f}%"
        )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
