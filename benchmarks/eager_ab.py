"""The eager path's host-time measures, each on and off, alternating in one process: ``python3 -m benchmarks.eager_ab``.

Eager times on a GPU host drift within a run (the first seconds of a process, other work on the
host), so one measurement of each variant, one after the other, can differ by more than what a
measure saves. Here every arm is measured once per round, the arms in the same order each round,
over several rounds, and the record gives each arm's per-round medians and the median of those.
The arms, at 128K context, batch 1 and 16 (the model's shapes, bf16; calls rotate over four input
sets, as in the ``attention_decode`` and ``msa_decode`` suites):

``sparse_attention``
    ``own``: split attention merged by its last split (the default eager path); ``launch``: merged
    by a launch of its own (``mm3lab.attention.kernel.OWN_MERGE = False``, what a CUDA graph runs);
    ``python guard``: the call memo's kept shapes compared by a Python read of the tensors' metadata
    (``mm3lab._replay.COMPILED_GUARDS = False``).
``msa_decode``
    ``own+kept``: the default; ``own``: the value check's launch built anew every call
    (``mm3lab._valcheck.KNOWN_CHECKS = 0``); ``launch``: that and the merge launch.
``index_topk_decode``
    ``memo``: the default (a repeated call shape replays its launches, the scores launch checking the
    call's values itself); ``check launch``: the value checks in a launch of their own, the replayed
    launches queued while it runs (``mm3lab.indexer.FUSED_CHECKS = False``); ``after``: that, queued
    after the check's flags are read (``mm3lab._replay.QUEUE_DURING_CHECKS = False``); ``normal``:
    every call checked and launched through Triton (``mm3lab._replay.ENABLED = False``).
``insert_index_cache``
    each request's decode token's index key inserted at its slot; ``memo``: the default (a replayed
    insert checks its own slots in its one launch); ``gated``: a check
    launch and the insert gated on its flags, queued while the check runs
    (``mm3lab.index_cache.SELF_CHECK = False``); ``after``: that, queued after the flags are read;
    ``normal``: every call checked and launched through Triton; ``python guard`` as above. (An insert of up to
    8192 keys of 128 dims checks its own slots: :data:`mm3lab.index_cache.kernel.CHECK_READS`.)

Validation on and off (``msa_decode``'s ``own`` only on: the kept check launches are a validation
path), ``mode: "eager"``, and each entry point's CUDA-graph replay once (``mode: "graph"``). The
call memos and recorded steps are cleared before every arm. ``--dry-run``: tiny shapes on the CPU
(the code path only).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import mm3lab
from mm3lab import _replay, _valcheck, index_cache, indexer
from mm3lab.attention import kernel as attn_kernel
from mm3lab.msa import recorded

from . import suites
from .common import Context, _triton_version, write_side_results

ARMS = {
    "sparse_attention": {"own": (True, True), "launch": (False, True), "python guard": (True, True, True, True, False)},
    "msa_decode": {"own+kept": (True, True), "own": (True, False), "launch": (False, False)},
    "index_topk_decode": {
        "memo": (True, True),
        "check launch": (True, True, True, True, True, True, False),
        "after": (True, True, True, False, True, True, False),
        "normal": (True, True, False),
    },
    "insert_index_cache": {
        "memo": (True, True),
        "gated": (True, True, True, True, True, False),
        "after": (True, True, True, False, True, False),
        "normal": (True, True, False),
        "python guard": (True, True, True, True, False),
    },
}
"""Entry point -> arm -> (own merge, kept check launches[, call memos and recorded launches on[, replays
queued during their checks[, compiled tensor guards[, an insert checking its own slots[, decode scores
checking the indexer's values]]]]]])."""


def _arm(
    own_merge: bool,
    kept_checks: bool,
    replay: bool = True,
    queue: bool = True,
    compiled_guards: bool = True,
    self_check: bool = True,
    fused_checks: bool = True,
) -> None:
    attn_kernel.OWN_MERGE = own_merge
    _valcheck.KNOWN_CHECKS = 16 if kept_checks else 0
    _replay.ENABLED = replay
    _replay.QUEUE_DURING_CHECKS = queue
    _replay.COMPILED_GUARDS = compiled_guards
    index_cache.SELF_CHECK = self_check
    indexer.FUSED_CHECKS = fused_checks
    _replay.clear_memos()
    recorded.clear()


def _calls(ctx: Context, p: suites.DecodeProblem) -> dict:
    """Each entry point's calls over the problem's input sets."""
    kc, vc, topk = p.cache.k_cache, p.cache.v_cache, ctx.shapes.topk
    return {
        "sparse_attention": [
            lambda st=st: mm3lab.sparse_attention(st["q"], kc, vc, st["sparse_bt"], st["sparse_ctx"]) for st in p.sets
        ],
        "msa_decode": [lambda st=st: mm3lab.msa_decode(*p.msa_args(st), topk=topk) for st in p.sets],
        "index_topk_decode": [
            lambda st=st: mm3lab.index_topk_decode(
                st["index_q"], p.index_cache, st["block_table"], st["seq_lens"], topk
            )
            for st in p.sets
        ],
        "insert_index_cache": [
            lambda st=st, slots=slots: mm3lab.insert_index_cache(st["index_k"], p.index_cache, slots)
            for st, slots in zip(p.sets, [_decode_slots(p, st) for st in p.sets], strict=True)
        ],
    }


def _decode_slots(p: suites.DecodeProblem, st: dict) -> torch.Tensor:
    """The slot of each request's decode token (its last position) in the set's block table."""
    last = p.context - 1
    return st["block_table"][:, last // 128].long() * 128 + last % 128


def _one_batch(ctx: Context, batch: int, context: int, rounds: int, runs: dict, records: list, entries) -> None:
    calls = _calls(ctx, suites.DecodeProblem(ctx, batch, context))
    for _ in range(rounds):
        for entry, arms in ARMS.items():
            if entry not in entries:
                continue
            for arm, how in arms.items():
                _arm(*how)
                for validation in (True, False):
                    if entry == "msa_decode" and arm == "own" and not validation:
                        continue
                    with mm3lab.validation(validation):
                        t = ctx.eager(calls[entry])
                    runs.setdefault((entry, batch, arm, validation), []).append(round(t.ms * 1e3, 2))
    _arm(True, True)
    for entry, fns in calls.items():
        if entry not in entries:
            continue
        with mm3lab.validation(False):
            t = ctx.graph(fns)
        if t is not None:
            records.append(
                {"entry": entry, "batch": batch, "context": context, "mode": "graph", "us": round(t.ms * 1e3, 2)}
            )


def run(ctx: Context, batches, context: int, rounds: int, entries=tuple(ARMS)) -> list[dict]:
    runs: dict = {}
    records = []
    for batch in batches:
        _one_batch(ctx, batch, context, rounds, runs, records, entries)
        if ctx.cuda:
            torch.cuda.empty_cache()
    for (entry, batch, arm, validation), times in runs.items():
        records.append(
            {
                "entry": entry,
                "batch": batch,
                "context": context,
                "mode": "eager",
                "arm": arm,
                "validation": validation,
                "us": statistics.median(times),
                "rounds_us": times,
            }
        )
    return records


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="results file (default benchmarks/results/eager-ab/<gpu>.json)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--entries", nargs="+", choices=list(ARMS), default=list(ARMS), help="entry points to time")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU, no results kept")
    args = parser.parse_args(argv)
    if args.dry_run:
        mm3lab.set_backend("torch")  # (the code path in seconds; the arms launch nothing on the CPU)
        ctx = Context("cpu", "cpu-dry-run", None, True, True, calls=2, samples=2, shapes=suites.dry_run_shapes())
        batches, context = (1,), 300
    elif torch.cuda.is_available():
        gpu = torch.cuda.get_device_name(0)
        ctx = Context("cuda", gpu, None, False, calls=50, samples=9, shapes=suites.model_shapes(False))
        batches, context = (1, 16), 131072
    else:
        print("needs a CUDA GPU (or --dry-run)", file=sys.stderr)
        return 2
    started = time.time()
    records = run(ctx, batches, context, args.rounds, args.entries)
    meta = {
        "gpu": ctx.gpu,
        "torch": torch.__version__,
        "triton": _triton_version(),
        "method": "eager: median over rounds of each arm's median per call (calls per sample x samples, "
        "rotating over input sets); graph: one CUDA-graph replay measurement",
        "calls_per_sample": ctx.calls,
        "samples": ctx.samples,
        "rounds": args.rounds,
        "seconds": round(time.time() - started, 1),
    }
    for r in records:
        print(r)
    if not args.dry_run:
        write_side_results("eager-ab", ctx.gpu, args.out, meta, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
