"""Timing, bandwidth and result records shared by every benchmark suite.

The method (every suite follows it; ``METHOD`` is written into the results file):

* **Two modes, side by side.** ``eager``: the function called from Python, as a
  notebook, a script or a serving loop without graphs calls it; host work (argument
  checks, allocations, launches) counts. ``graph``: the same calls captured in a CUDA
  graph and replayed; only device time counts. Every record says which (``mode``).
* **Many calls per sample.** A sample times ``calls`` back-to-back calls between two
  CUDA events and divides; ``samples`` samples give the median and the coefficient of
  variation (``cv`` = standard deviation / median).
* **Cold L2.** Calls rotate over several buffer sets (inputs, and for small problems
  whole caches) whose total size is several times the L2 cache, so that a call does not
  read what the previous one left in L2.
* **Validation on and off.** Eager calls of mm3lab entry points are timed with value
  checks on (the default) and off (``validation`` in the record).
* **Host time.** Eager records also carry ``host_ms``: the CPU time per call of the
  Python loop (no sync inside), what the stacked host-versus-device bars draw.

``bench(fn)`` and ``bench_graph(fn)`` keep their old meaning (a median in ms of one
callable, eager and graph) for suites that time a plain function.
"""

from __future__ import annotations

import dataclasses
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"

ROTATE_BYTES = 256 << 20
"""Buffer sets rotate until they hold this much (about 5x the H200's 50 MB L2)."""
MAX_SETS = 8

METHOD = (
    "eager = Python calls, graph = CUDA-graph replay; median over samples of many calls each "
    "(cv = std/median); calls rotate over buffer sets of >= 256 MB in all (cold L2); eager mm3lab "
    "entry points timed with validation on and off; baselines (dense SDPA, gather + SDPA, compiled "
    "FlexAttention, PyTorch ops) measured in the same run on the same inputs"
)


def num_sets(bytes_per_set: int, *, minimum: int = 2) -> int:
    """How many buffer sets make a cold-L2 rotation: enough to reach ``ROTATE_BYTES``, at most ``MAX_SETS``."""
    if bytes_per_set <= 0:
        return minimum
    return max(1 if bytes_per_set >= ROTATE_BYTES else minimum, min(MAX_SETS, math.ceil(ROTATE_BYTES / bytes_per_set)))


@dataclasses.dataclass
class Timing:
    """One measured function: median ms per call, its cv, the samples, the mode, host ms per call (eager)."""

    ms: float
    cv: float
    samples: int
    mode: str
    host_ms: float | None = None
    calls: int | None = None

    def fields(self) -> dict:
        out = {"mode": self.mode, "cv": round(self.cv, 4), "samples": self.samples}
        if self.calls is not None:
            out["calls"] = self.calls
        if self.host_ms is not None:
            out["host_ms"] = round(self.host_ms, 6)
        return out


def _stats(times: list[float]) -> tuple[float, float]:
    med = statistics.median(times)
    cv = statistics.pstdev(times) / med if med > 0 and len(times) > 1 else 0.0
    return med, cv


def _rotation(fns) -> list[Callable[[], object]]:
    if callable(fns):
        return [fns]
    fns = list(fns)
    if not fns:
        raise ValueError("nothing to time")
    return fns


def _cuda(device) -> bool:
    return torch.device(device).type == "cuda" if device is not None else torch.cuda.is_available()


def _calls_for(fns, calls: int, cuda: bool, max_sample_ms: float | None) -> int:
    """``calls``, cut so that one sample of a slow function stays near ``max_sample_ms`` (at least 1)."""
    if max_sample_ms is None or calls <= 1:
        return calls
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fns[0]()
    if cuda:
        torch.cuda.synchronize()
    one = (time.perf_counter() - t0) * 1e3
    return max(1, min(calls, int(max_sample_ms / max(one, 1e-6))))


def time_eager(
    fns, *, calls: int = 20, samples: int = 10, warmup: int = 3, device=None, max_sample_ms: float | None = None
) -> Timing:
    """Eager time per call: ``samples`` samples of ``calls`` calls, rotating over ``fns`` (buffer sets).

    On a GPU a sample is timed with CUDA events (the device is idle before it starts);
    on the CPU with ``time.perf_counter``. ``host_ms`` is the host's time to issue the calls.
    ``max_sample_ms``: fewer calls per sample for a slow function (one call over this bound: one call).
    """
    fns = _rotation(fns)
    cuda = _cuda(device)
    for i in range(max(warmup, len(fns))):
        fns[i % len(fns)]()
    calls = _calls_for(fns, calls, cuda, max_sample_ms)
    if cuda:
        torch.cuda.synchronize()
    times, host = [], []
    k = 0
    for _ in range(samples):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        for _ in range(calls):
            fns[k % len(fns)]()
            k += 1
        t1 = time.perf_counter()
        if cuda:
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / calls)
        else:
            times.append((t1 - t0) * 1e3 / calls)
        host.append((t1 - t0) * 1e3 / calls)
    ms, cv = _stats(times)
    return Timing(ms, cv, samples, "eager", statistics.median(host), calls)


def time_graph(
    fns, *, calls: int = 20, samples: int = 10, warmup: int = 3, max_sample_ms: float | None = None
) -> Timing:
    """CUDA-graph replay time per call: ``calls`` calls (rotating over ``fns``) captured in one graph,
    replayed ``samples`` times. Run with validation off (value checks sync, which capture forbids)."""
    fns = _rotation(fns)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(max(warmup, len(fns))):
            fns[i % len(fns)]()
        calls = _calls_for(fns, calls, True, max_sample_ms)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fns[i % len(fns)]()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(samples):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    del graph
    ms, cv = _stats(times)
    return Timing(ms, cv, samples, "graph", None, calls)


def time_replay(replay: Callable[[], object], *, calls: int = 20, samples: int = 10) -> Timing:
    """Time a callable that itself replays a CUDA graph (a plan with ``graph=True``), eager loop."""
    t = time_eager(replay, calls=calls, samples=samples, device="cuda")
    return Timing(t.ms, t.cv, t.samples, "graph", t.host_ms, t.calls)


def bench(fn: Callable[[], object], *, warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median eager time of ``fn()`` in ms (many calls per sample; kept for suites that time one callable)."""
    if not torch.cuda.is_available():
        return time_eager(fn, calls=2, samples=3, warmup=1, device="cpu").ms
    return time_eager(fn, calls=20, samples=10, device="cuda").ms


def bench_graph(fn: Callable[[], object], *, replays: int = 200, repeats: int = 5) -> float:
    """Median time of one ``fn()`` replayed from a captured CUDA graph of ``replays`` calls, in ms."""
    return time_graph(fn, calls=replays, samples=repeats).ms


def fallback_reason() -> str | None:
    """The PyTorch fallbacks mm3lab took since the last call, ``"entry point: rule; ..."`` (``None`` if none).

    The rules are :data:`mm3lab.backend.FALLBACK_RULES` (SPEC 7); ``mm3lab info`` lists them.
    """
    from mm3lab import backend

    taken = backend.fallbacks_taken(reset=True)
    return "; ".join(f"{entry}: {rule}" for entry, rule in sorted(taken.items())) or None


def msa_args(st: dict, cache, index_cache: torch.Tensor) -> tuple:
    """The positional arguments of ``msa_decode`` / ``MSADecodePlan.run`` for one buffer set ``st``
    (its queries, new token, block table and lengths) over ``cache`` (a ``KVCache``) and ``index_cache``."""
    return (
        st["q"],
        st["key"],
        st["value"],
        st["index_q"],
        st["index_k"],
        cache.k_cache,
        cache.v_cache,
        index_cache,
        st["block_table"],
        st["seq_lens"],
    )


@dataclasses.dataclass
class Context:
    """What every suite needs: the device, the measured copy bandwidth, the records so far."""

    device: str
    gpu: str
    copy_TBps: float | None
    quick: bool
    dry_run: bool = False
    calls: int = 20
    samples: int = 10
    shapes: object = None
    records: list = dataclasses.field(default_factory=list)
    notes: list = dataclasses.field(default_factory=list)
    max_sample_ms: float | None = 25.0
    """A slow function gets fewer calls per sample (down to one), so that a sample stays near this."""
    suite: str | None = None
    """The suite now running: written into every record (``suite``), so that runs of some suites merge."""
    deadline: float | None = None
    """``time.time()`` past which the running suite starts no new shape (``out_of_time``)."""
    cells: tuple | None = None
    """``(batch, context)`` cells the ``fp8`` grid runs instead of its own list (``--cells``)."""

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def out_of_time(self, label: str) -> bool:
        """True (and a note) when the running suite's time share is spent: skip ``label``."""
        if self.deadline is None or time.time() < self.deadline:
            return False
        self.notes.append(f"{self.suite}: {label} skipped, the suite's time budget was spent")
        print(f"  out of time: {label} skipped", file=sys.stderr, flush=True)
        return True

    def eager(self, fns, **kw) -> Timing:
        kw.setdefault("calls", self.calls)
        kw.setdefault("samples", self.samples)
        kw.setdefault("max_sample_ms", self.max_sample_ms)
        return time_eager(fns, device=self.device, **kw)

    def graph(self, fns, **kw) -> Timing | None:
        """Graph time, or ``None`` where there are no CUDA graphs (the CPU dry run)."""
        if not self.cuda:
            return None
        kw.setdefault("calls", self.calls)
        kw.setdefault("samples", self.samples)
        kw.setdefault("max_sample_ms", self.max_sample_ms)
        return time_graph(fns, **kw)

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
        copy = self.copy_TBps
        record = {
            "suite": self.suite,
            "name": name,
            "gpu": self.gpu,
            "torch": torch.__version__,
            "triton": _triton_version(),
            "shape": shape,
            "ms": round(ms, 6),
            "baseline": baseline,
            "baseline_ms": None if baseline_ms is None else round(baseline_ms, 6),
            "speedup": None if not baseline_ms or not ms else round(baseline_ms / ms, 3),
            "bytes": bytes_moved,
            "achieved_TBps": None if achieved is None else round(achieved, 4),
            "fraction_of_copy_bw": None if achieved is None or not copy else round(achieved / copy, 4),
        }
        record.update(extra)
        self.records.append(record)
        return record

    def compare(
        self,
        name: str,
        shape: dict,
        ours: dict[tuple[str, bool | None], Timing | None],
        baselines: dict[str, dict[str, Timing | None]],
        bytes_moved: int | None = None,
        fallback: str | None = None,
        **extra,
    ) -> None:
        """One record per (mode, validation) of ``ours`` x baseline, baseline in the same mode.

        ``ours``: ``{(mode, validation): Timing}`` (validation ``None`` for graph mode);
        ``baselines``: ``{baseline name: {mode: Timing}}``; a missing time skips the record,
        and an entry point without baselines gets one record per mode with ``baseline = None``.
        """
        for (mode, validation), t in ours.items():
            if t is None:
                continue
            pairs = [(b, times.get(mode)) for b, times in baselines.items()] or [(None, None)]
            for base, bt in pairs:
                if base is not None and bt is None:
                    continue
                self.add(
                    name,
                    shape,
                    t.ms,
                    base,
                    None if bt is None else bt.ms,
                    bytes_moved,
                    **t.fields(),
                    validation=validation,
                    fallback=fallback,
                    **({} if bt is None else {"baseline_cv": round(bt.cv, 4)}),
                    **extra,
                )


def _triton_version() -> str:
    import triton

    return triton.__version__


def measure_copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in TB/s, counting bytes read plus bytes written."""
    buffers = [torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(2)]
    ms = time_eager(lambda: buffers[1].copy_(buffers[0]), calls=10, samples=10, device="cuda").ms
    buffers.clear()
    torch.cuda.empty_cache()
    return 2 * nbytes / (ms * 1e-3) / 1e12


def write_side_results(folder: str, gpu: str, out: str | None, meta: dict, records: list) -> Path:
    """Write a side study's ``{"meta", "records"}`` to ``out`` or ``benchmarks/results/<folder>/<gpu>.json``
    (a folder of its own: the suites' results are the ``*.json`` files of ``benchmarks/results`` itself)."""
    path = Path(out) if out else RESULTS_DIR / folder / f"{gpu.replace(' ', '-').lower()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "records": records}, indent=1) + "\n")
    print(f"wrote {path}")
    return path


def results_path(gpu: str) -> Path:
    """``benchmarks/results/<gpu>.json`` (``NVIDIA H200`` -> ``nvidia-h200.json``)."""
    slug = gpu.lower().replace("nvidia ", "nvidia-").replace(" ", "-")
    return RESULTS_DIR / f"{slug}.json"


def _previous(path: Path, gpu: str) -> dict | None:
    """The payload already at ``path`` if it was written by this method on this GPU, else ``None``."""
    try:
        payload = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    meta = payload.get("meta", {})
    if meta.get("method") != METHOD or meta.get("gpu") != gpu or not isinstance(payload.get("records"), list):
        return None
    return payload


def merge_payloads(old: dict | None, new: dict) -> dict:
    """``new`` over ``old``: records of the suites ``new`` ran replace ``old``'s; the rest are kept.

    ``meta``: ``new``'s, with ``suites`` / ``suite_seconds`` / ``failures`` / ``stale`` / ``skipped`` merged per suite
    (``skipped`` notes start with their suite's name) and ``runs`` listing every run's suites and seconds.
    """
    if old is None:
        return new
    ran = set(new["meta"].get("suites", [])) | {"setup"}  # every run measures the copy bandwidth and launch floor
    keep = [r for r in old["records"] if r.get("suite") not in ran]
    om, nm = old["meta"], dict(new["meta"])

    def per_suite(key):
        merged = {k: v for k, v in (om.get(key) or {}).items() if k not in ran}
        merged.update(nm.get(key) or {})
        return merged

    nm["suites"] = [s for s in om.get("suites", []) if s not in ran] + list(new["meta"].get("suites", []))
    if not any(r.get("suite") == "setup" for r in new["records"]):  # (no GPU: keep the old setup records)
        keep += [r for r in old["records"] if r.get("suite") == "setup"]
    nm["suite_seconds"] = per_suite("suite_seconds")
    nm["failures"] = per_suite("failures")
    nm["stale"] = per_suite("stale")  # a suite run again is current again
    nm["skipped"] = [n for n in om.get("skipped", []) if n.split(":", 1)[0] not in ran] + list(nm.get("skipped", []))
    ids = {r.get("id") for r in nm.get("runs", [])}  # a run saving after each suite replaces its own entry
    nm["runs"] = [r for r in om.get("runs", []) if r.get("id") is None or r.get("id") not in ids]
    nm["runs"] += list(new["meta"].get("runs", []))
    nm["seconds"] = round(sum(r.get("seconds", 0) for r in nm["runs"]), 1)
    return {"meta": nm, "records": keep + list(new["records"])}


def write_results(
    ctx: Context, path: Path | None = None, meta: dict | None = None, *, merge: bool = True, finalize=None
) -> Path:
    """Write ``{"meta": ..., "records": [...]}``; returns the path.

    ``merge``: an existing file of the same method and GPU keeps the records of suites this run did
    not run (a run of some suites adds to, or replaces part of, the file). ``finalize(payload)`` may
    add to the merged payload (the goal check over every record) before it is written.
    """
    path = Path(path or results_path(ctx.gpu))
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "meta": {
            "gpu": ctx.gpu,
            "torch": torch.__version__,
            "triton": _triton_version(),
            "python": platform.python_version(),
            "cuda": torch.version.cuda,
            "copy_TBps": None if ctx.copy_TBps is None else round(ctx.copy_TBps, 4),
            "method": METHOD,
            **(meta or {}),
        },
        "records": ctx.records,
    }
    if merge:
        payload = merge_payloads(_previous(path, ctx.gpu), payload)
    if finalize is not None:
        finalize(payload)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1) + "\n")
    tmp.replace(path)
    return path


def median_of(values: Sequence[float]) -> float:
    return statistics.median(values)
