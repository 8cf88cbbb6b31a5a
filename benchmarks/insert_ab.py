"""A checked index-cache insert that checks its own slots against a check launch and then the insert,
in one process: ``python3 -m benchmarks.insert_ab``.

Eager times drift within a run, so the arms alternate over several rounds in one process, and each
record gives every arm's per-round medians and the median of those. For 16, 4096 and 8192 keys of
128 dims (bf16, an index cache of 8192 blocks, calls rotating over four input sets with random
distinct slots):

``self-check``
    the default: the insert's one launch checks its slots (every program reads every slot) and
    writes nothing where one is past the cache; the call waits for that launch's ``done`` word
    (:func:`mm3lab.index_cache.kernel.checks_in_launch`);
``check launch``
    a check launch of its own, then the insert (``mm3lab.index_cache.SELF_CHECK = False``; gated on
    the check's flags where it has at most :data:`mm3lab.index_cache.GATED_TOKENS` keys);
``unchecked``
    validation off.

Each token count's CUDA-graph replay once (``graph_us``). ``--dry-run``: tiny shapes on the CPU
(the code path only).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import mm3lab
from mm3lab import _replay, index_cache

from .common import _triton_version, time_eager, time_graph, write_side_results

ARMS = {"self-check": (True, True), "check launch": (False, True), "unchecked": (True, False)}
"""Arm -> (``SELF_CHECK``, validation)."""


def _arm(self_check: bool) -> None:
    index_cache.SELF_CHECK = self_check
    _replay.clear_memos()


def run(device: str, tokens=(16, 4096, 8192), rounds: int = 5, blocks: int = 8192, calls: int = 20, samples: int = 10):
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    cache = torch.zeros(blocks, 128, 128, dtype=dtype, device=dev)
    g = torch.Generator(device=dev).manual_seed(8)
    records = []
    try:
        for n in tokens:
            sets = [
                (
                    torch.randn(n, 128, generator=g, device=dev, dtype=dtype),
                    torch.randperm(blocks * 128, generator=g, device=dev)[:n],
                )
                for _ in range(4)
            ]
            fns = [lambda k=k, sl=sl: mm3lab.insert_index_cache(k, cache, sl) for k, sl in sets]
            runs = {arm: [] for arm in ARMS}
            for _ in range(rounds):
                for arm, (self_check, validation) in ARMS.items():
                    _arm(self_check)
                    with mm3lab.validation(validation):
                        runs[arm].append(time_eager(fns, calls=calls, samples=samples, device=dev).ms * 1e3)
            _arm(True)
            record = {"tokens": n, "index_dim": 128, "dtype": str(dtype).replace("torch.", ""), "mode": "eager"}
            record.update({arm: round(statistics.median(v), 2) for arm, v in runs.items()})
            record["rounds_us"] = {arm: [round(x, 2) for x in v] for arm, v in runs.items()}
            if cuda:
                with mm3lab.validation(False):
                    record["graph_us"] = round(time_graph(fns, calls=calls, samples=samples).ms * 1e3, 2)
            print(record, flush=True)
            records.append(record)
    finally:
        _arm(True)
    return records


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", help="results file (default benchmarks/results/insert-ab/<gpu>.json)")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU, no results kept")
    args = parser.parse_args(argv)
    started = time.time()
    if args.dry_run:
        run("cpu", tokens=(4, 40), rounds=1, blocks=2, calls=1, samples=1)
        return 0
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (or --dry-run)", file=sys.stderr)
        return 2
    records = run("cuda", rounds=args.rounds)
    meta = {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "triton": _triton_version(),
        "method": "eager calls rotating over four input sets, 20 calls a sample, median of 10 samples (CUDA "
        "events), the arms alternating over rounds in one process; the median of the rounds' medians; "
        "graph: one CUDA-graph replay measurement, validation off",
        "rounds": args.rounds,
        "seconds": round(time.time() - started, 1),
    }
    write_side_results("insert-ab", meta["gpu"], args.out, meta, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
