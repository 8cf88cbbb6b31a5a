"""Timing, bandwidth and result records shared by every benchmark suite.

Times are medians from ``triton.testing.do_bench`` (CUDA events around the
call; the L2 cache is flushed between repetitions), or from CUDA-graph replay
for launch-bound kernels. Every record is compared with a baseline measured in
the same process, on the same inputs.
"""

from __future__ import annotations

import dataclasses
import json
import platform
from pathlib import Path
from typing import Callable

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"


@dataclasses.dataclass
class Context:
    """What every suite needs: the device, the measured copy bandwidth, the records so far."""

    device: str
    gpu: str
    copy_TBps: float
    quick: bool
    records: list = dataclasses.field(default_factory=list)

    def add(
        self,
        name: str,
        shape: dict,
        ms: float,
        baseline: str | None,
        baseline_ms: float | None,
        bytes_moved: int | None,
        **extra,
    ) -> dict:
        achieved = (bytes_moved / (ms * 1e-3) / 1e12) if (bytes_moved and ms) else None
        record = {
            "name": name,
            "gpu": self.gpu,
            "torch": torch.__version__,
            "triton": _triton_version(),
            "shape": shape,
            "ms": round(ms, 6),
            "baseline": baseline,
            "baseline_ms": None if baseline_ms is None else round(baseline_ms, 6),
            "speedup": None if baseline_ms is None else round(baseline_ms / ms, 3),
            "bytes": bytes_moved,
            "achieved_TBps": None if achieved is None else round(achieved, 4),
            "fraction_of_copy_bw": None if achieved is None else round(achieved / self.copy_TBps, 4),
        }
        record.update(extra)
        self.records.append(record)
        return record


def _triton_version() -> str:
    import triton

    return triton.__version__


def bench(fn: Callable[[], object], *, warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median time of ``fn()`` in milliseconds (CUDA events, L2 flushed between runs)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def bench_graph(fn: Callable[[], object], *, replays: int = 200, repeats: int = 5) -> float:
    """Median time of one ``fn()`` replayed from a captured CUDA graph, in milliseconds.

    For launch-bound kernels: graph replay removes the host's launch overhead,
    which is how a serving engine runs them.
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(replays):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / replays)
    times.sort()
    return times[len(times) // 2]


def measure_copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in TB/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src), rep_ms=200)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / (ms * 1e-3) / 1e12


def write_results(ctx: Context, path: Path | None = None, meta: dict | None = None) -> Path:
    """Write ``{"meta": ..., "records": [...]}``; returns the path."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    slug = ctx.gpu.lower().replace("nvidia ", "").replace(" ", "-")
    path = path or RESULTS_DIR / f"{slug}.json"
    payload = {
        "meta": {
            "gpu": ctx.gpu,
            "torch": torch.__version__,
            "triton": _triton_version(),
            "python": platform.python_version(),
            "cuda": torch.version.cuda,
            "copy_TBps": round(ctx.copy_TBps, 4),
            **(meta or {}),
        },
        "records": ctx.records,
    }
    path.write_text(json.dumps(payload, indent=1) + "\n")
    return path
