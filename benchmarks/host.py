"""mm3lab's own host time per eager call, measured without a GPU: ``python3 -m benchmarks.host``.

An eager call on a GPU costs host work (argument checks, launch configuration, allocations,
Triton's launches, the value checks' host read) before and besides the device work. This
suite measures the part that is mm3lab's own Python: the entry points run their compiled-kernel
host paths on CPU tensors at the model's shapes, with every Triton launch stubbed out
(:mod:`benchmarks.offline`). Not included: Triton's launch itself, and the value checks' launch
and host read (on a GPU; with validation on, CPU tensors run the value checks as PyTorch ops
instead). The GPU results' eager records hold the whole host time per call (``host_ms``).
Those calls take the normal path (no replays); then ``msa_decode`` takes the recorded path a
repeated call takes on a GPU (``path: "recorded"``: its launches recorded as they are made and
replayed through a launcher that returns at once, :func:`benchmarks.offline.install_recordings`),
and ``sparse_attention`` and the decode block table the replayed path of a repeated call shape
(``path: "replayed"``, :class:`mm3lab._replay.Memo`), validation off.

The records (``benchmarks/results/host/cpu.json``) give the median microseconds per call over
samples of many calls, with the coefficient of variation, ``mode: "host"``, validation on and
off, and for the MSA layer the repeated-shape check memo (``mm3lab._checks.PassedChecks``) on
and off, and on its recorded path the known calls (``mm3lab.msa.recorded.KNOWN_CALLS``) on and
off, all from one run on one machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

from benchmarks import offline  # (first: mm3lab takes its compiled-kernel paths, on CPU tensors)

# isort: split
import torch

import mm3lab
from benchmarks.common import RESULTS_DIR, _stats
from mm3lab import _replay
from mm3lab.msa import layer as msa_layer

RESULTS = RESULTS_DIR / "host" / "cpu.json"  # (its own folder: the GPU results are the *.json beside it)
SHAPES = ((1, 131072), (16, 131072))  # (batch, context), bf16


def _time(fn, calls: int, samples: int) -> tuple[float, float]:
    """Median microseconds per call over ``samples`` samples of ``calls`` calls, and its cv."""
    fn()
    times = []
    for _ in range(samples):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return _stats(times)


def _entry_points(layer: dict) -> dict:
    """Each entry point's call on the layer's tensors."""
    n = layer["q"].shape[0]
    sparse_bt = torch.zeros(offline.HKV, n, offline.TOPK * 8, dtype=torch.int32)
    sparse_ctx = torch.full((offline.HKV, n), offline.TOPK * 128, dtype=torch.int32)
    selection = (layer["index_q"], layer["index_cache"], layer["block_table"], layer["seq_lens"])
    return {
        "sparse_attention": lambda: mm3lab.sparse_attention(
            layer["q"], layer["k_cache"], layer["v_cache"], sparse_bt, sparse_ctx
        ),
        "index_topk_decode": lambda: mm3lab.index_topk_decode(*selection, offline.TOPK),
        "index_topk_block_table_decode": lambda: mm3lab.index_topk_block_table_decode(*selection, offline.TOPK),
        "msa_decode": lambda: mm3lab.msa_decode(**layer),
    }


def run(calls: int, samples: int) -> list[dict]:
    records = []
    for batch, context in SHAPES:
        layer = offline.model_layer(torch.bfloat16, "packed", False, batch=batch, context=context)
        for name, fn in _entry_points(layer).items():
            for validation in (True, False):
                memo = (True, False) if name == "msa_decode" else (True,)
                for passed_checks in memo:
                    msa_layer._PASSED.clear()
                    msa_layer._PASSED.size = type(msa_layer._PASSED).size if passed_checks else 0
                    with mm3lab.validation(validation):
                        us, cv = _time(fn, calls, samples)
                    record = {
                        "name": name,
                        "shape": {"batch": batch, "context": context, "dtype": "bf16"},
                        "mode": "host",
                        "validation": validation,
                        "us": round(us, 1),
                        "cv": round(cv, 4),
                        "calls": calls,
                        "samples": samples,
                    }
                    if name == "msa_decode":
                        record["passed_checks"] = passed_checks
                    records.append(record)
                    print(
                        f"{name:30s} batch {batch:3d}  validation {'on ' if validation else 'off'}"
                        f"{'' if len(memo) == 1 else '  memo ' + ('on ' if passed_checks else 'off')}"
                        f"  {us:7.1f} us  cv {cv:.3f}",
                        flush=True,
                    )
        msa_layer._PASSED.size = type(msa_layer._PASSED).size
    records += run_recorded(calls, samples)
    return records


def run_recorded(calls: int, samples: int) -> list[dict]:
    """``msa_decode``'s recorded path (what a repeated call takes on a GPU, :mod:`mm3lab.msa.recorded`),
    validation off, with its known calls kept and not (``known_calls``; :data:`~mm3lab.msa.recorded.KNOWN_CALLS`)."""
    from mm3lab.msa import recorded

    offline.install_recordings()
    records, default = [], recorded.KNOWN_CALLS
    for batch, context in SHAPES:
        layer = offline.model_layer(torch.bfloat16, "packed", False, batch=batch, context=context)
        for known in (True, False):
            recorded.clear()
            recorded.KNOWN_CALLS = default if known else 0
            with mm3lab.validation(False):
                for _ in range(2):  # (the first call of a shape takes the normal path, the second records)
                    mm3lab.msa_decode(**layer)
                us, cv = _time(lambda layer=layer: mm3lab.msa_decode(**layer), calls, samples)
            (shape,) = recorded._shapes().values()
            assert shape.recording is not None, "the recorded path did not record"
            records.append(
                {
                    "name": "msa_decode",
                    "shape": {"batch": batch, "context": context, "dtype": "bf16"},
                    "mode": "host",
                    "path": "recorded",
                    "validation": False,
                    "passed_checks": True,
                    "known_calls": known,
                    "us": round(us, 1),
                    "cv": round(cv, 4),
                    "calls": calls,
                    "samples": samples,
                }
            )
            print(
                f"{'msa_decode (recorded path)':30s} batch {batch:3d}  validation off  known calls "
                f"{'on ' if known else 'off'}  {us:7.1f} us  cv {cv:.3f}",
                flush=True,
            )
    recorded.KNOWN_CALLS = default
    return records + run_replayed(calls, samples)


def run_replayed(calls: int, samples: int) -> list[dict]:
    """The replayed path of a repeated call shape (:class:`mm3lab._replay.Memo`, what a repeated call takes
    on a GPU) of ``sparse_attention`` and of the decode block table (into caller-owned buffers, as a
    decode loop calls it), validation off: the key, the lookup, the outputs and the replay's launches."""
    records = []
    for batch, context in SHAPES:
        layer = offline.model_layer(torch.bfloat16, "packed", False, batch=batch, context=context)
        entry = _entry_points(layer)
        n = layer["q"].shape[0]
        topk_idx = torch.zeros(offline.HKV, n, offline.TOPK, dtype=torch.int32)
        table = (topk_idx, layer["block_table"], layer["seq_lens"])
        stride = mm3lab.sparse_block_page_stride(layer["k_cache"], layer["v_cache"])
        out = mm3lab.build_sparse_block_table_decode(*table, block_page_stride=stride)

        def table_call(table=table, stride=stride, out=out):
            return mm3lab.build_sparse_block_table_decode(*table, block_page_stride=stride, out=out)

        calls_of = {"sparse_attention": entry["sparse_attention"], "build_sparse_block_table_decode": table_call}
        for name, fn in calls_of.items():
            _replay.clear_memos()
            with mm3lab.validation(False), offline.memo_keys_cpu_calls():
                us, cv = _time(fn, calls, samples)  # (its first call records; the others replay)
            (memo,) = [m for m in _replay._MEMOS if m.name == name]
            assert [e.recording is not None for e in memo._entries().values()] == [True], f"{name} did not replay"
            records.append(
                {
                    "name": name,
                    "shape": {"batch": batch, "context": context, "dtype": "bf16"},
                    "mode": "host",
                    "path": "replayed",
                    "validation": False,
                    "us": round(us, 1),
                    "cv": round(cv, 4),
                    "calls": calls,
                    "samples": samples,
                }
            )
            print(f"{name + ' (replayed)':30s} batch {batch:3d}  validation off  {us:7.1f} us  cv {cv:.3f}", flush=True)
    return records


def main() -> int:
    parser = argparse.ArgumentParser(description="mm3lab's own host time per eager call (launches stubbed)")
    parser.add_argument("--calls", type=int, default=200, help="calls per sample")
    parser.add_argument("--samples", type=int, default=7)
    parser.add_argument("--out", default=str(RESULTS), help="results file")
    args = parser.parse_args()
    offline.install(lambda *args, grid, warmup, **kwargs: None)
    import triton

    payload = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "method": __doc__.split("\n\n")[1].replace("\n", " "),
        "records": run(args.calls, args.samples),
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(payload, f, indent=1)
        f.write("\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
