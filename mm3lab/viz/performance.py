"""Pictures and tables of committed benchmark results (``benchmarks/results/<gpu>.json``).

Everything here reads the JSON the benchmarks write; nothing is timed, so the
results notebook runs anywhere and shows the GPU's numbers.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from matplotlib.figure import Figure

from ..constants import DEFAULT_TOPK, HEAD_DIM, INDEX_HEAD_DIM, MAX_CONTEXT, NUM_KV_HEADS, NUM_Q_HEADS

RESULTS_ENV = "MM3LAB_RESULTS"
"""Environment variable naming a results file, or a folder of them, for :func:`load_results`."""

RESULTS_SUBDIR = Path("benchmarks") / "results"
"""Where a checkout keeps its results (the benchmarks write ``benchmarks/results/<gpu>.json``)."""


def results_path(path: str | Path | None = None) -> Path:
    """The results file :func:`load_results` reads.

    ``path`` (a file, or a folder whose first ``*.json`` is taken); else ``$MM3LAB_RESULTS``
    (the same); else ``benchmarks/results`` in the working directory or the nearest parent
    holding one (a checkout: the notebooks run in ``notebooks/``). An installed package
    ships no results: pass the path or set the variable.
    """
    if path is None:
        path = os.environ.get(RESULTS_ENV) or None
    if path is None:
        cwd = Path.cwd().resolve()
        found = [d / RESULTS_SUBDIR for d in (cwd, *cwd.parents) if (d / RESULTS_SUBDIR).is_dir()]
        if not found:
            raise FileNotFoundError(
                f"no {RESULTS_SUBDIR} here or above {cwd}; pass the results path or set {RESULTS_ENV}"
            )
        path = found[0]
    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("*.json"))
        if not files:
            raise FileNotFoundError(f"no benchmark results in {path}; run python3 -m benchmarks on a GPU")
        path = files[0]
    return path


def load_results(path: str | Path | None = None) -> dict:
    """The results file: ``{"meta": {...}, "records": [...]}``, found by :func:`results_path`."""
    return json.loads(results_path(path).read_text())


def records(results: dict, name: str, baseline: str | None = None) -> list[dict]:
    """Records of one benchmark (optionally one baseline), in file order."""
    return [r for r in results["records"] if r["name"] == name and (baseline is None or r["baseline"] == baseline)]


def _shape_text(shape: dict, keys=None) -> str:
    keys = keys or list(shape)
    return " ".join(f"{k}={shape[k]}" for k in keys if k in shape)


def summary_table(results: dict) -> str:
    """One line per record: time, baseline, speedup, achieved bandwidth (rounded; deterministic text)."""
    meta = results["meta"]
    lines = [
        f"GPU {meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, "
        f"copy bandwidth {meta['copy_TBps']:.2f} TB/s",
        f"{'benchmark':<32} {'shape':<44} {'us':>9} {'baseline':<24} {'base us':>9} {'speedup':>8} {'% copy bw':>9}",
    ]
    for r in results["records"]:
        if r["name"].startswith(("copy_", "launch_")):
            continue
        base = r["baseline"] or "-"
        base_us = f"{1e3 * r['baseline_ms']:.1f}" if r["baseline_ms"] is not None else "-"
        speed = f"{r['speedup']:.1f}x" if r["speedup"] is not None else "-"
        frac = f"{100 * r['fraction_of_copy_bw']:.0f}%" if r["fraction_of_copy_bw"] is not None else "-"
        lines.append(
            f"{r['name']:<32} {_shape_text(r['shape'])[:44]:<44} {1e3 * r['ms']:>9.1f} "
            f"{base:<24} {base_us:>9} {speed:>8} {frac:>9}"
        )
    return "\n".join(lines)


def plot_roofline(results: dict):
    """Achieved bandwidth of every bandwidth-bound record against the measured copy bandwidth.

    One bar per (benchmark, shape): its CUDA-graph replay where measured, else its eager call
    (validation off where both exist); the label says which. ``None`` without a copy bandwidth.
    """
    copy = results["meta"].get("copy_TBps")
    if not copy:
        return None
    uniq: dict = {}
    rank = {"graph": 0, "eager": 1, "unknown": 2}
    for r in results["records"]:
        if not r.get("achieved_TBps") or r["name"].startswith(("copy_", "launch_")):
            continue
        key = (r["name"], json.dumps(r["shape"], sort_keys=True))
        score = (rank.get(mode_of(r), 3), r.get("validation") is True)
        if key not in uniq or score < uniq[key][0]:
            uniq[key] = (score, r)
    uniq = [r for _, r in uniq.values()]
    if not uniq:
        return None
    fig = Figure(figsize=(9, max(3, 0.32 * len(uniq) + 1)))
    ax = fig.add_subplot()
    labels = [
        f"{r['name']}  {_shape_text(r['shape'], ['batch', 'rows', 'tokens', 'chunk', 'layout'])} ({mode_of(r)})"
        for r in uniq
    ]
    values = [r["achieved_TBps"] for r in uniq]
    ax.barh(range(len(uniq)), values, height=0.7, color="tab:blue")
    for y, v in enumerate(values):  # small bandwidths stay readable: log axis, value printed at the bar
        ax.text(v, y, f" {v / copy:.0%}", va="center", fontsize=8)
    ax.set_xscale("log")
    ax.axvline(copy, color="tab:red", linestyle="--", label=f"copy bandwidth {copy:.2f} TB/s")
    ax.set_yticks(range(len(uniq)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("achieved TB/s on the bytes the kernel must move (log)")
    ax.set_title(f"Bandwidth against the copy roofline ({results['meta'].get('gpu', '?')})")
    ax.legend(loc="lower right")
    fig.tight_layout()
    return fig


def plot_decode_times(results: dict):
    """Attention decode time per batch: mm3lab sparse, naive gather + SDPA, dense SDPA over the full context."""
    fig = Figure(figsize=(7, 4))
    ax = fig.add_subplot()
    ours = [r for r in records(results, "attention_decode", "naive_gather_sdpa") if r["shape"].get("layout") == "dense"]
    dense = {r["shape"]["batch"]: r["baseline_ms"] for r in records(results, "attention_decode", "dense_sdpa")}
    batches = [r["shape"]["batch"] for r in ours]
    width = 0.27
    xs = range(len(batches))
    ax.bar([x - width for x in xs], [1e3 * r["ms"] for r in ours], width, label="mm3lab sparse_attention")
    ax.bar(list(xs), [1e3 * r["baseline_ms"] for r in ours], width, label="gather + SDPA")
    ax.bar(
        [x + width for x in xs],
        [1e3 * dense.get(b, float("nan")) for b in batches],
        width,
        label="dense SDPA (full context)",
    )
    ax.set_xticks(list(xs), [f"batch {b}" for b in batches])
    ax.set_yscale("log")
    ax.set_ylabel("microseconds (log)")
    ctx_len = ours[0]["shape"]["context"] if ours else 0
    ax.set_title(f"Decode attention at {ctx_len // 1024}K context, top-k 16")
    ax.legend()
    fig.tight_layout()
    return fig


def plot_speedups(results: dict):
    """Speedup over each record's baseline (log scale)."""
    rows = [r for r in results["records"] if r["speedup"] is not None]
    fig = Figure(figsize=(9, max(3, 0.3 * len(rows) + 1)))
    ax = fig.add_subplot()
    labels = [
        f"{r['name']} vs {r['baseline']}  {_shape_text(r['shape'], ['batch', 'rows', 'tokens', 'chunk', 'layout'])}"
        for r in rows
    ]
    ax.barh(
        range(len(rows)),
        [r["speedup"] for r in rows],
        color=["tab:green" if r["speedup"] >= 1 else "tab:red" for r in rows],
    )
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("speedup over the baseline (log)")
    ax.set_title("mm3lab kernels against baselines measured in the same run")
    fig.tight_layout()
    return fig


def _first(found: list[dict], **shape) -> dict | None:
    for r in found:
        if all(r["shape"].get(k) == v for k, v in shape.items()):
            return r
    return None


GATHER_SPEEDUP_GOAL = 15.0
"""Attention decode at batch 64: the speedup over gather + SDPA the benchmark issue asks for."""


def goals(results: dict) -> list[dict]:
    """The benchmark goals, each with the measured value and whether it is met (None: not measured)."""
    copy = results["meta"].get("copy_TBps")
    empty = _first(records(results, "launch_empty_triton"))
    out = []

    def goal(text, value, target, higher=True, unit=""):
        met = None if value is None else (value >= target if higher else value <= target)
        out.append({"goal": text, "value": value, "target": target, "met": met, "unit": unit})

    bt = _first(records(results, "block_table_decode", "torch_ops"), rows=256)
    goal("block table, 256 rows: speedup over the PyTorch ops", bt and bt["speedup"], 20.0, unit="x")
    goal(
        "block table, 256 rows: time / empty Triton launch (CUDA graph)",
        bt and empty and round(bt["ms"] / empty["ms"], 3),
        1.5,
        higher=False,
        unit="x",
    )
    eager = _first(records(results, "launch_empty_triton_eager"))
    goal(
        "block table, 256 rows: time / empty Triton launch (do_bench)",
        bt and eager and bt.get("ms_do_bench") and round(bt["ms_do_bench"] / eager["ms"], 3),
        1.5,
        higher=False,
        unit="x",
    )
    a64 = _first(records(results, "attention_decode", "naive_gather_sdpa"), batch=64, layout="dense")
    goal("attention decode, batch 64, 128K: fraction of copy bandwidth", a64 and a64["fraction_of_copy_bw"], 0.6)
    d64 = _first(records(results, "attention_decode", "dense_sdpa"), batch=64)
    goal("attention decode, batch 64: speedup over dense SDPA", d64 and d64["speedup"], 40.0, unit="x")
    goal(
        "attention decode, batch 64: speedup over gather + SDPA", a64 and a64["speedup"], GATHER_SPEEDUP_GOAL, unit="x"
    )
    a1 = _first(records(results, "attention_decode", "naive_gather_sdpa"), batch=1)
    text = "attention decode, batch 1: time / (empty launch + bytes at copy bandwidth)"
    launch = eager or empty  # the floor: an empty launch as do_bench times it
    if a1 and launch and copy:
        floor_ms = launch["ms"] + a1["bytes"] / (copy * 1e12) * 1e3
        goal(text, round(a1.get("ms_graph", a1["ms"]) / floor_ms, 3), 3.0, higher=False, unit="x")
    else:
        goal(text, None, 3.0, higher=False)
    i64 = _first(records(results, "indexer_decode"), batch=64)
    goal("indexer decode, batch 64, 128K: fraction of copy bandwidth", i64 and i64["fraction_of_copy_bw"], 0.5)
    t64 = _first(records(results, "topk", "torch.topk"), rows=64)
    goal("top-k, 64 rows of 8192: speedup over torch.topk", t64 and t64["speedup"], 5.0, unit="x")
    f64 = _first(records(results, "indexer_decode_fused_block_table"), batch=64)
    goal("fused indexer + block table, batch 64: speedup over the two launches", f64 and f64["speedup"], 1.0, unit="x")
    for f in records(results, "topk_fused_block_table"):
        goal(
            f"fused top-k + block table from scores, batch {f['shape']['batch']}, {f['shape']['width']} blocks: "
            "speedup over the two launches",
            f["speedup"],
            1.0,
            unit="x",
        )
    pre = _first(records(results, "attention_prefill"))
    goal("attention prefill, 32K: attended FLOP/s / dense SDPA FLOP/s", pre and pre.get("flops_ratio"), 0.5)
    return out


def goals_report(results: dict) -> str:
    """One line per goal: measured value, target, met / missed (and by how much).

    A results file that carries its own goals (``meta["goals"]``, checked by the benchmark run
    itself, eager with validation on) is reported from those; an older file from :func:`goals`.
    """
    checked = results["meta"].get("goals")
    if checked is not None:
        if not checked:
            return "the benchmark run checked no goals (none of their records were measured)"
        lines = []
        for g in checked:
            verdict = "met " if g.get("met") else "MISS"
            value = g.get("value")
            value = "not measured" if value is None else f"{value:.3g}"
            lines.append(f"[{verdict}] {g['goal']} ({short_shape(g.get('shape') or {})}): {value}")
        return "\n".join(lines)
    lines = []
    for g in goals(results):
        if g["value"] is None:
            lines.append(f"[ -- ] {g['goal']}: not measured")
            continue
        verdict = "met " if g["met"] else "MISS"
        line = f"[{verdict}] {g['goal']}: {g['value']:.3g}{g['unit']} (goal {g['target']:g}{g['unit']})"
        if not g["met"]:
            line += f", {g['value'] / g['target']:.2f} of the goal"
        lines.append(line)
    return "\n".join(lines)


def limits(results: dict) -> list[str]:
    """What bounds the kernels whose goals are missed, computed from the records (no timing here)."""
    copy = results["meta"].get("copy_TBps") or float("nan")
    empty = _first(records(results, "launch_empty_triton"))
    eager = _first(records(results, "launch_empty_triton_eager"))
    out = []
    tables = records(results, "block_table_decode", "torch_ops")
    one, r256 = _first(tables, rows=1), _first(tables, rows=256)
    if one and r256 and empty:
        out.append(
            f"block table: one row already takes {one['ms'] * 1e3:.2f} us per launch in a CUDA graph, "
            f"{one['ms'] / empty['ms']:.1f}x an empty kernel ({empty['ms'] * 1e3:.2f} us), at "
            f"{100 * (one['fraction_of_copy_bw'] or 0):.2f}% of copy bandwidth: the fixed cost is the chain of "
            f"dependent global loads and stores (ids, then the block table, then the output), not row work; "
            f"255 more rows add {(r256['ms'] - one['ms']) * 1e3:.2f} us."
        )
        if r256.get("ms_do_bench") and eager:
            out.append(
                f"block table under do_bench: {r256['ms_do_bench'] * 1e3:.2f} us against an empty launch's "
                f"{eager['ms'] * 1e3:.2f} us; the difference ({(r256['ms_do_bench'] - eager['ms']) * 1e3:.2f} us) "
                "is the kernel's own work plus the host time of its Python wrapper before the launch."
            )
    a64 = _first(records(results, "attention_decode", "naive_gather_sdpa"), batch=64, layout="dense")
    if a64 and a64["speedup"] and a64["speedup"] < GATHER_SPEEDUP_GOAL and a64["fraction_of_copy_bw"]:
        need_ms = a64["baseline_ms"] / GATHER_SPEEDUP_GOAL
        out.append(
            f"attention decode, batch 64: {GATHER_SPEEDUP_GOAL:g}x over the gather + SDPA path measured here "
            f"({a64['baseline_ms']:.2f} ms) means {need_ms * 1e3:.0f} us, "
            f"{a64['fraction_of_copy_bw'] * a64['ms'] / need_ms:.0%} of copy bandwidth on the selected bytes; "
            f"the kernel reads them at {a64['fraction_of_copy_bw']:.0%} ({a64['ms'] * 1e3:.0f} us)."
        )
    a1 = _first(records(results, "attention_decode", "naive_gather_sdpa"), batch=1)
    if a1 and a1.get("ms_graph"):
        out.append(
            f"attention decode, batch 1: {a1['ms_graph'] * 1e3:.2f} us as a CUDA-graph replay, "
            f"{a1['ms'] * 1e3:.1f} us through do_bench: at one row the Python launch path, not the GPU, sets the "
            "eager time."
        )
    pre = _first(records(results, "attention_prefill"))
    if pre and pre.get("attended_TFLOPs") and "mode" not in pre:  # the per-row kernel's records (before tiling)
        sh = pre["shape"]
        group = sh["q_heads"] // sh["kv_heads"]
        flops = pre["attended_TFLOPs"] * 1e12 * pre["ms"] * 1e-3
        rows_tokens = flops / (4 * sh["head_dim"] * group)  # attended (row, KV head, token) triples
        loaded = rows_tokens * sh["head_dim"] * 2 * 2  # K and V, bf16, once per row
        intensity = flops / loaded
        out.append(
            f"attention prefill: every (token, KV head) row loads its own selected K/V, "
            f"{loaded / 1e9:.1f} GB in {pre['ms']:.2f} ms = {loaded / (pre['ms'] * 1e-3) / 1e12:.1f} TB/s "
            f"({loaded / (pre['ms'] * 1e-3) / 1e12 / copy:.2f}x copy bandwidth, so mostly from L2) at "
            f"{intensity:.0f} FLOP per byte (the {group} query heads of a group): "
            f"{pre['attended_TFLOPs']:.0f} TFLOP/s. Dense SDPA reuses each K/V tile across many queries and "
            f"reaches {pre['baseline_TFLOPs']:.0f}; closing the gap needs rows that share selected blocks to "
            "share their loads."
        )
    fused = records(results, "topk_fused_block_table")
    f64 = _first(records(results, "indexer_decode_fused_block_table"), batch=64)
    if fused and f64:
        parts = ", ".join(
            f"{f['ms'] * 1e3:.1f} vs {f['baseline_ms'] * 1e3:.1f} us at {f['shape']['width']} blocks" for f in fused
        )
        out.append(
            f"fused top-k + block table: from scores, {parts}: the launch saved is worth about one empty launch, "
            "and the fused program emits its rows' tables one after another; inside the whole indexer "
            f"({f64['ms'] * 1e3:.0f} us at batch 64) the difference is "
            f"{abs(f64['ms'] - f64['baseline_ms']) * 1e3:.1f} us."
        )
    return out


# ----------------------------------------------------------------------------------------------
# Records with a mode (benchmarks' record schema: mode, cv, samples, validation, fallback).
# Every function below degrades gracefully: a record family that is absent gives None (plots)
# or a line saying so (text), never an error, so the notebook runs on any results file.
# ----------------------------------------------------------------------------------------------

MODES = ("graph", "eager")
MODE_TEXT = {"graph": "CUDA-graph replay", "eager": "eager call", "unknown": "call of unrecorded mode"}
STAGES = ("insert", "indexer_scores", "topk", "block_table", "attention")
"""The stages of one MSA decode step, in order (``msa_decode_stage`` records' ``shape.stage``)."""
STAGE_COLORS = {
    "insert": "tab:gray",
    "indexer_scores": "tab:orange",
    "topk": "tab:purple",
    "block_table": "tab:brown",
    "topk_block_table": "tab:pink",
    "attention": "tab:blue",
}


def copy_text(results: dict) -> str:
    """The measured copy bandwidth, or a note that the file has none (a CPU dry run)."""
    copy = results["meta"].get("copy_TBps")
    return f"{copy:.2f} TB/s" if copy else "not measured"


def meta_text(results: dict) -> str:
    """Where the results come from: GPU, versions, copy bandwidth, modes, suites that failed or were skipped."""
    meta = results["meta"]
    modes = sorted({mode_of(r) for r in results["records"]})
    lines = [
        (
            f"GPU: {meta.get('gpu', '?')}  torch {meta.get('torch', '?')}  triton {meta.get('triton', '?')}  "
            f"CUDA {meta.get('cuda') or '-'}"
        ),
        f"measured copy bandwidth: {copy_text(results)}",
        f"{len(results['records'])} records; modes in this file: {', '.join(modes) or '-'}",
    ]
    if meta.get("samples") and meta.get("calls_per_sample"):
        lines.append(f"each time: median of {meta['samples']} samples of {meta['calls_per_sample']} calls")
    for name, why in sorted((meta.get("failures") or {}).items()):
        lines.append(f"suite {name} failed in this run: {str(why)[:120]}")
    for name in sorted(meta.get("stale") or {}):
        lines.append(stale_note(results, name))
    return "\n".join(lines)


def stale_note(results: dict, suite: str) -> str:
    """A line saying that ``suite``'s records predate a change to the code they time ("" when current)."""
    why = (results["meta"].get("stale") or {}).get(suite)
    return f"suite {suite} is stale: {why}" if why else ""


def mode_of(record: dict) -> str:
    """``"graph"`` or ``"eager"``; ``"unknown"`` for records written before the schema had a mode."""
    return record.get("mode") or "unknown"


def fmt_us(ms: float | None) -> str:
    """A time in microseconds (milliseconds from 1000 us), rounded for display."""
    if ms is None:
        return "-"
    us = 1e3 * ms
    return f"{us:.1f} us" if us < 1000 else f"{us / 1e3:.2f} ms"


def timed(record: dict) -> str:
    """``"12.3 us (graph)"``: every time shown carries its mode."""
    return f"{fmt_us(record['ms'])} ({mode_of(record)})"


_SHORT = {
    "batch": "b",
    "context": "ctx",
    "q_len": "q",
    "rows": "rows",
    "layout": "",
    "stage": "",
    "selection": "",
    "index_dtype": "idx",
    "kv_dtype": "kv",
    "width": "w",
    "tokens": "tok",
    "chunk": "chunk",
}


def short_shape(shape: dict) -> str:
    """A compact shape: ``b=16 ctx=128K q=1 packed``; keys not listed in ``_SHORT`` are left out."""
    parts = []
    for key, short in _SHORT.items():
        if key not in shape:
            continue
        value = shape[key]
        if key == "context" and isinstance(value, int) and value >= 1024:
            value = f"{value // 1024}K"
        parts.append(f"{short}={value}" if short else str(value))
    return " ".join(parts)


def _same(shape: dict, **want) -> bool:
    return all(shape.get(k) == v for k, v in want.items())


def mode_table(results: dict, width: int = 100) -> str:
    """The summary table with a mode and a cv column, at most ``width`` characters a line."""
    meta = results["meta"]
    head = (
        f"{'benchmark':<20} {'shape':<22} {'mode':<5} {'time':>9} {'cv':>4} {'baseline':<14} {'base':>9} {'speedup':>7}"
    )
    title = (
        f"{meta.get('gpu', '?')}: copy bandwidth {copy_text(results)}; "
        "mode: graph = CUDA-graph replay, eager = a plain call, ? = not recorded"
    )
    lines = [title, head]
    for r in results["records"]:
        if r["name"].startswith(("copy_", "launch_")) or r["name"] == "msa_decode_stage":  # stages: see above
            continue
        cv = f"{100 * r['cv']:.0f}%" if r.get("cv") is not None else "-"
        speed = f"{r['speedup']:.1f}x" if r.get("speedup") is not None else "-"
        line = (
            f"{r['name'][:20]:<20} {short_shape(r['shape'])[:22]:<22} "
            f"{mode_of(r).replace('unknown', '?'):<5} {fmt_us(r['ms']):>9} "
            f"{cv:>4} {(r.get('baseline') or '-')[:14]:<14} {fmt_us(r.get('baseline_ms')):>9} {speed:>7}"
        )
        lines.append(line[:width])
    return "\n".join(lines)


# --- one MSA decode step, stage by stage --------------------------------------------------------


def stage_shapes(results: dict) -> list[tuple[int, int]]:
    """The (batch, context) pairs that have ``msa_decode_stage`` records, sorted."""
    return sorted({(r["shape"].get("batch"), r["shape"].get("context")) for r in records(results, "msa_decode_stage")})


STEP_STAGES = ("insert", "indexer_scores", "topk_block_table", "attention")
"""The launches a planned decode step runs (top-k and block table fused in one launch)."""


def _stage_bytes(record: dict) -> int | None:
    """The bytes a stage must move: the record's own, else counted at MiniMax-M3's sizes (bf16 shapes only)."""
    if record.get("bytes"):
        return record["bytes"]
    sh = record["shape"]
    if sh.get("dtype", "bf16") != "bf16" or "batch" not in sh or "context" not in sh:
        return None
    counted = {
        name: nbytes for name, nbytes, _ in real_size_stages(sh["context"], sh["batch"], sh.get("topk", DEFAULT_TOPK))
    }
    counted["topk_block_table"] = counted["topk"] + counted["block_table"]
    return counted.get(sh.get("stage"))


def stage_breakdown(results: dict, batch: int, context: int, mode: str = "graph") -> dict | None:
    """The stages of one MSA decode step at (``batch``, ``context``) in ``mode``, and the whole step.

    Returns ``None`` without stage records at that shape, else a dict: ``stages`` (list of
    ``(stage, record)`` in pipeline order: :data:`STEP_STAGES` where the fused launch was
    measured, else the separate top-k and block-table launches), ``sum_ms``, ``total``
    (``{mode: record}`` of the planned step measured whole, ``stage = "total"``), ``step``
    (``{mode: record}`` of the one-shot ``msa_decode`` at that shape, eager with validation
    off preferred), ``checked`` (its eager record with validation on), ``fused`` and
    ``unfused_ms`` (top-k + block table as two launches), where measured.
    """
    found, total = {}, {}
    for r in records(results, "msa_decode_stage"):
        sh = r["shape"]
        if not _same(sh, batch=batch, context=context):
            continue
        if sh.get("stage") == "total":
            total.setdefault(mode_of(r), r)
        elif mode_of(r) == mode:
            found.setdefault(sh.get("stage"), r)
    order = STEP_STAGES if "topk_block_table" in found else STAGES
    stages = [(s, found[s]) for s in order if s in found]
    if not stages:
        return None
    step, checked = {}, None
    for r in records(results, "msa_decode"):
        if not _same(r["shape"], batch=batch, context=context):
            continue
        m = mode_of(r)
        if r.get("validation") is True:
            checked = checked or r
            step.setdefault(m, r)
        elif m not in step or step[m].get("validation") is True:
            step[m] = r
    unfused = [found[s]["ms"] for s in ("topk", "block_table") if s in found]
    return {
        "batch": batch,
        "context": context,
        "mode": mode,
        "stages": stages,
        "sum_ms": sum(r["ms"] for _, r in stages),
        "total": total,
        "step": step,
        "checked": checked,
        "fused": found.get("topk_block_table"),
        "unfused_ms": sum(unfused) if len(unfused) == 2 else None,
    }


def breakdown_text(results: dict, batch: int, context: int) -> str:
    """Where one step's time goes: each stage, their sum, the whole step in each mode, host overhead."""
    b = stage_breakdown(results, batch, context, "graph") or stage_breakdown(results, batch, context, "eager")
    if b is None:
        return f"no msa_decode_stage records at batch {batch}, context {context}"
    lines = [
        (
            f"MSA decode step, batch {batch}, {short_shape({'context': context})}: each launch alone, "
            f"as {MODE_TEXT[b['mode']]}s"
        )
    ]
    if stale_note(results, "msa_decode_stages"):
        lines.append("  " + stale_note(results, "msa_decode_stages"))
    for stage, r in b["stages"]:
        share = r["ms"] / b["sum_ms"] if b["sum_ms"] else 0.0
        nbytes, copy = _stage_bytes(r), results["meta"].get("copy_TBps")
        bw = ""
        if nbytes and copy and r["ms"]:
            bw = f", {nbytes / (r['ms'] * 1e-3) / 1e12 / copy:.0%} of copy bandwidth"
        lines.append(f"  {stage:<17} {timed(r):>20}  {share:>4.0%} of the launches{bw}")
    lines.append(f"  {'sum of launches':<17} {fmt_us(b['sum_ms']) + ' (' + b['mode'] + ')':>20}")
    if b["fused"] is not None and b["unfused_ms"] is not None:
        lines.append(f"  (top-k and block table as two launches instead: {fmt_us(b['unfused_ms'])} ({b['mode']}))")
    for m in MODES:
        r = b["total"].get(m)
        if r is not None:
            what = "plan.run, checks off" if m == "eager" else "the plan's launches in one graph"
            lines.append(f"  {'whole step':<17} {timed(r):>20}  {what}")
    for m in MODES:
        r = b["step"].get(m)
        if r is not None:
            what = "msa_decode" + (", checks off" if r.get("validation") is False else "")
            lines.append(f"  {'whole step':<17} {timed(r):>20}  {what}")
    if b["checked"] is not None and b["checked"] is not b["step"].get("eager"):
        lines.append(f"  {'whole step':<17} {timed(b['checked']):>20}  msa_decode, checks on")
    graph = b["total"].get("graph") or b["step"].get("graph")
    eager = b["total"].get("eager") or b["step"].get("eager")
    if graph is not None and b["mode"] == "graph":
        lines.append(
            f"  whole step (graph) - sum of launches = {fmt_us(graph['ms'] - b['sum_ms'])}: the gaps "
            "between kernels inside one replay"
        )
    if graph is not None and eager is not None:
        lines.append(
            f"  host overhead: eager - graph = {fmt_us(eager['ms'] - graph['ms'])}, the time Python and "
            "the launch path add before the GPU has work"
        )
    return "\n".join(lines)


def _whole_steps(b: dict) -> list[tuple[str, dict]]:
    """The whole step's measurements to mark next to the stacked launches: (label, record)."""
    out = []
    for m in MODES:
        r = b["total"].get(m) or b["step"].get(m)
        if r is not None:
            out.append((f"whole step, {MODE_TEXT[m]}" + (" (checks off)" if m == "eager" else ""), r))
    if b["checked"] is not None:
        out.append(("whole step, msa_decode eager call, checks on", b["checked"]))
    return out


_MARKERS = {"graph": ("o", "black"), "eager": ("s", "white")}


def plot_stage_breakdown(results: dict, mode: str = "graph") -> Figure | None:
    """Stacked bars per (batch, context): the step's launches, and the whole step measured in each mode.

    One panel per batch, each on its own linear time axis (a batch-64 step takes many times a
    batch-1 step, and a stacked bar on a log axis would misstate the shares).
    """
    shapes = [s for s in stage_shapes(results) if stage_breakdown(results, *s, mode)]
    if not shapes:
        return None
    batches = sorted({b for b, _ in shapes})
    heights = [sum(1 for b, _ in shapes if b == batch) for batch in batches]
    fig = Figure(figsize=(9.5, 0.5 * len(shapes) + 0.9 * len(batches) + 0.8), layout="constrained")
    axes = fig.subplots(len(batches), 1, squeeze=False, height_ratios=[h + 0.8 for h in heights])[:, 0]
    seen, handles = set(), {}
    for ax, batch in zip(axes, batches, strict=False):
        contexts = [c for b, c in shapes if b == batch]
        for y, context in enumerate(contexts):
            b = stage_breakdown(results, batch, context, mode)
            left = 0.0
            for stage, r in b["stages"]:
                us = 1e3 * r["ms"]
                bar = ax.barh(y, us, left=left, height=0.55, color=STAGE_COLORS[stage], edgecolor="white")
                handles.setdefault(f"{stage} ({mode})", bar)
                left += us
            for label, r in _whole_steps(b):
                marker, face = ("D", "tab:red") if "checks on" in label else _MARKERS.get(mode_of(r), ("x", "black"))
                (line,) = ax.plot(1e3 * r["ms"], y, marker, color="black", markerfacecolor=face, markersize=7)
                handles.setdefault(label, line)
                seen.add(label)
        ax.set_yticks(range(len(contexts)), [short_shape({"context": c}) for c in contexts], fontsize=8)
        ax.set_ylim(len(contexts) - 0.4, -0.6)
        ax.set_xlim(left=0)
        ax.set_ylabel(f"batch {batch}", fontsize=9)
        ax.tick_params(axis="x", labelsize=8)
    axes[-1].set_xlabel("microseconds: stacked bars = each launch timed alone; markers = the whole step")
    axes[0].set_title("Where one MSA decode step's time goes", loc="left")
    fig.legend(list(handles.values()), list(handles), loc="outside right upper", fontsize=8)
    return fig


def plot_stage_roofline(results: dict, batch: int | None = None, context: int | None = None) -> Figure | None:
    """Per stage: achieved bandwidth on the bytes it must move, against the copy bandwidth (the roofline)."""
    shapes = stage_shapes(results)
    copy = results["meta"].get("copy_TBps")
    if not shapes or not copy:
        return None
    batch, context = (batch, context) if batch is not None else shapes[-1]
    b = stage_breakdown(results, batch, context, "graph") or stage_breakdown(results, batch, context, "eager")
    rows = []
    for stage, r in b["stages"] if b else []:
        nbytes = _stage_bytes(r)
        if nbytes and r["ms"]:
            rows.append((stage, r, nbytes, nbytes / (r["ms"] * 1e-3) / 1e12))
    if not rows:
        return None
    fig = Figure(figsize=(8.0, 0.55 * len(rows) + 1.6), layout="constrained")
    ax = fig.add_subplot()
    for y, (stage, r, nbytes, tbps) in enumerate(rows):
        ax.barh(y, tbps, height=0.6, color=STAGE_COLORS[stage], edgecolor="black", linewidth=0.6)
        ax.text(
            max(tbps, copy * 0.01),
            y,
            f" {tbps / copy:.0%}  ({nbytes / 1e6:.2f} MB in {timed(r)})",
            va="center",
            fontsize=8,
        )
    ax.axvline(copy, color="tab:red", linestyle="--", label=f"copy bandwidth {copy:.2f} TB/s")
    ax.set_yticks(range(len(rows)), [s for s, *_ in rows])
    ax.invert_yaxis()
    ax.set_xlim(0, copy * 1.6)
    ax.set_xlabel("TB/s achieved on the bytes the stage must move")
    ax.set_title(f"Roofline per stage, batch {batch}, {short_shape({'context': context})}", loc="left")
    ax.legend(loc="lower right", fontsize=8)
    return fig


# --- eager against graph: host overhead per entry point ---------------------------------------


def host_device_rows(results: dict) -> list[dict]:
    """Entry points measured both ways at one shape: ``device`` = graph time, ``host`` = eager - graph.

    One row per (name, shape), the first baseline's records; validation-off eager
    records are preferred when both exist (host overhead without the value checks).
    """
    graph, eager = {}, {}
    for r in results["records"]:
        if r["name"].startswith(("copy_", "launch_")) or r["name"] == "msa_decode_stage":
            continue
        key = (r["name"], json.dumps(r["shape"], sort_keys=True))
        if mode_of(r) == "graph":
            graph.setdefault(key, r)
        elif key not in eager or (r.get("validation") is False and eager[key].get("validation") is not False):
            eager[key] = r
    out = []
    for key, g in graph.items():
        e = eager.get(key)
        if e is not None:
            out.append(
                {
                    "name": key[0],
                    "shape": g["shape"],
                    "device_ms": g["ms"],
                    "host_ms": max(e["ms"] - g["ms"], 0.0),
                    "eager_ms": e["ms"],
                    "validation": e.get("validation"),
                }
            )
    return out


def plot_host_device(results: dict, limit: int = 12) -> Figure | None:
    """Stacked bars: device time (graph replay) and host overhead (eager - graph) per entry point."""
    rows = host_device_rows(results)[:limit]
    if not rows:
        return None
    fig = Figure(figsize=(9.0, 0.42 * len(rows) + 1.6), layout="constrained")
    ax = fig.add_subplot()
    ys = range(len(rows))
    ax.barh(ys, [1e3 * r["device_ms"] for r in rows], height=0.6, color="tab:blue", label="device (graph replay)")
    ax.barh(
        ys,
        [1e3 * r["host_ms"] for r in rows],
        left=[1e3 * r["device_ms"] for r in rows],
        height=0.6,
        color="tab:orange",
        label="host overhead (eager - graph)",
    )
    ax.set_yticks(list(ys), [f"{r['name']} {short_shape(r['shape'])}" for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(left=0)
    ax.set_xlabel("microseconds per call")
    ax.set_title("Eager call = host overhead + device time", loc="left")
    ax.legend(loc="lower right", fontsize=8)
    return fig


# --- sparse speedup over dense, against context ------------------------------------------------


def speedup_series(results: dict, name: str = "msa_decode", baseline: str = "dense_sdpa") -> dict:
    """``{(batch, mode): [(context, speedup), ...]}`` for ``name`` against ``baseline``, contexts ascending."""
    out: dict = {}
    for r in records(results, name, baseline):
        if r.get("speedup") is None or "context" not in r["shape"]:
            continue
        out.setdefault((r["shape"].get("batch"), mode_of(r)), []).append((r["shape"]["context"], r["speedup"]))
    return {k: sorted(set(v)) for k, v in sorted(out.items(), key=lambda kv: (kv[0][1], kv[0][0] or 0))}


def plot_speedup_vs_context(results: dict) -> Figure | None:
    """Speedup of the sparse step (or sparse attention) over dense SDPA as the context grows, per batch and mode."""
    for name in ("msa_decode", "sparse_attention", "attention_decode"):
        series = speedup_series(results, name)
        if any(len(v) > 1 for v in series.values()) or (series and name == "attention_decode"):
            break
    if not series:
        return None
    fig = Figure(figsize=(7.5, 4.0), layout="constrained")
    ax = fig.add_subplot()
    for (batch, mode), pts in series.items():
        xs, ys = zip(*pts, strict=False)
        ax.plot(xs, ys, "o-" if mode == "graph" else "s--", label=f"batch {batch} ({mode})")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("speedup over dense SDPA (log)")
    ax.set_title(
        f"{name}: the sparse read stays ~{DEFAULT_TOPK} blocks while dense grows with context", loc="left", fontsize=10
    )
    ax.legend(fontsize=8)
    return fig


def plot_grid_heatmap(results: dict, name: str = "msa_decode_grid") -> Figure | None:
    """Speedup of the whole step over dense SDPA, batch x context, a panel per (index dtype, KV dtype, q_len)."""
    recs = [r for r in records(results, name) if r.get("speedup") is not None]
    recs = [r for r in recs if r["shape"].get("stage", "step") == "step"]  # the whole step, not its stages
    if not recs:
        return None
    modes = {mode_of(r) for r in recs}
    mode = "graph" if "graph" in modes else min(modes)
    recs = [r for r in recs if mode_of(r) == mode]
    panels = sorted(
        {
            (r["shape"].get("index_dtype", "bf16"), r["shape"].get("kv_dtype", "bf16"), r["shape"].get("q_len", 1))
            for r in recs
        },
        key=str,
    )[:4]
    fig = Figure(figsize=(4.2 * len(panels), 3.8), layout="constrained")
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (idt, kvt, q) in zip(axes, panels, strict=False):
        sub = [
            r
            for r in recs
            if (r["shape"].get("index_dtype", "bf16"), r["shape"].get("kv_dtype", "bf16"), r["shape"].get("q_len", 1))
            == (idt, kvt, q)
        ]
        batches = sorted({r["shape"]["batch"] for r in sub})
        contexts = sorted({r["shape"]["context"] for r in sub})
        grid = [[float("nan")] * len(contexts) for _ in batches]
        for r in sub:
            grid[batches.index(r["shape"]["batch"])][contexts.index(r["shape"]["context"])] = r["speedup"]
        image = ax.imshow(grid, cmap="viridis", aspect="auto")
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                if not math.isnan(v):
                    ax.text(j, i, f"{v:.1f}x", ha="center", va="center", fontsize=8, color="white")
        ax.set_xticks(range(len(contexts)), [short_shape({"context": c}).split("=")[1] for c in contexts])
        ax.set_yticks(range(len(batches)), [str(b) for b in batches])
        ax.set_xlabel("context")
        ax.set_ylabel("batch")
        ax.set_title(f"index {idt}, KV {kvt}, q_len {q} ({mode})", fontsize=9)
        fig.colorbar(image, ax=ax, shrink=0.8)
    fig.suptitle(f"{name}: speedup over dense SDPA", fontsize=10)
    return fig


def prefill_text(results: dict) -> str:
    """Prefill attention per selection pattern: time with its mode, attended TFLOP/s, the dense ratio."""
    recs = [r for r in records(results, "attention_prefill") if r.get("validation") is not True]
    if not recs:
        return "no attention_prefill records in this results file"
    lines = [f"{'selection':<10} {'shape':<22} {'time':>18} {'baseline':<22} {'TFLOP/s':>8} {'vs dense':>8}"]
    for r in recs:
        tf = f"{r['attended_TFLOPs']:.0f}" if r.get("attended_TFLOPs") is not None else "-"
        ratio = f"{r['flops_ratio']:.2f}" if r.get("flops_ratio") is not None else "-"
        shape = short_shape({k: v for k, v in r["shape"].items() if k != "selection"})
        lines.append(
            f"{r['shape'].get('selection', '-'):<10} {shape[:22]:<22} {timed(r):>18} "
            f"{(r.get('baseline') or '-')[:22]:<22} {tf:>8} {ratio:>8}"
        )
    return "\n".join(lines)


def tuning_text(results: dict) -> str:
    """The indexer's scoring launch in every measured configuration (``indexer_tuning`` suite): time
    with its mode, share of copy bandwidth and speedup over the kernel's default, per key dtype."""
    recs = records(results, "indexer_scores_config")
    if not recs:
        return "no indexer_scores_config records in this results file (python3 -m benchmarks --only indexer_tuning)"
    lines = []
    for dtype in sorted({r["shape"].get("dtype") for r in recs}):
        sub = [r for r in recs if r["shape"].get("dtype") == dtype]
        shape = short_shape({k: sub[0]["shape"][k] for k in ("batch", "context") if k in sub[0]["shape"]})
        lines.append(f"{dtype} index keys, {shape}: the scoring launch per configuration")
        for r in sorted(sub, key=lambda r: (r["shape"].get("orientation", ""), r["shape"].get("num_stages", 0))):
            frac = r.get("fraction_of_copy_bw")
            share = f"{frac:.0%} of copy bandwidth" if frac is not None else "-"
            speed = f"{r['speedup']:.2f}x the default" if r.get("speedup") is not None else ""
            mark = "  <- default" if r["shape"].get("default") else ""
            lines.append(
                f"  {r['shape'].get('orientation', '-'):<22} stages {r['shape'].get('num_stages', '-')}  "
                f"{timed(r):>18}  {share:>22}  {speed}{mark}"
            )
    return "\n".join(lines)


def _variant(r: dict) -> str:
    m = mode_of(r)
    if m == "eager":
        return {True: "eager, checks on", False: "eager, checks off"}.get(r.get("validation"), "eager")
    return m


def plan_text(results: dict) -> str:
    """One-shot ``msa_decode`` against ``MSADecodePlan.run`` at each measured shape, every time with its mode."""
    rows: dict = {}
    for name, who in (("msa_decode", "msa_decode (one-shot)"), ("msa_decode_plan", "MSADecodePlan.run")):
        for r in records(results, name):
            key = (r["shape"].get("batch"), r["shape"].get("context"))
            rows.setdefault(key, {}).setdefault((who, _variant(r)), r)
    rows = {k: v for k, v in rows.items() if any(who == "MSADecodePlan.run" for who, _ in v)}
    if not rows:
        return "no msa_decode_plan records in this results file (older benchmark run)"
    order = {"eager, checks on": 0, "eager, checks off": 1, "eager": 2, "graph": 3, "unknown": 4}
    lines = []
    for (batch, context), found in sorted(rows.items(), key=lambda kv: (kv[0][0] or 0, kv[0][1] or 0)):
        lines.append(f"batch {batch}, {short_shape({'context': context})}:")
        for (who, variant), r in sorted(found.items(), key=lambda kv: (order.get(kv[0][1], 5), kv[0][0])):
            note = " (its own graph=True replay)" if who == "MSADecodePlan.run" and variant == "graph" else ""
            lines.append(f"  {who:<22} {variant:<18} {fmt_us(r['ms']):>10}{note}")
    return "\n".join(lines)


def validation_text(results: dict) -> str:
    """What the value checks cost: eager records measured with validation on and off at one shape."""
    pairs: dict = {}
    for r in results["records"]:
        if mode_of(r) == "eager" and r.get("validation") is not None:
            key = (r["name"], json.dumps(r["shape"], sort_keys=True))
            pairs.setdefault(key, {}).setdefault(bool(r["validation"]), r)
    lines = []
    for (name, _), both in pairs.items():
        if True in both and False in both:
            on, off = both[True], both[False]
            lines.append(
                f"{name:<22} {short_shape(on['shape']):<22} checks on {fmt_us(on['ms']):>9}, off "
                f"{fmt_us(off['ms']):>9}: {fmt_us(on['ms'] - off['ms'])} (eager)"
            )
    return "\n".join(lines) if lines else "no eager records with validation on and off at the same shape"


# --- real sizes, from the cost model (nothing measured) ------------------------------------------


def real_size_stages(
    context: int = MAX_CONTEXT, batch: int = 1, topk: int = DEFAULT_TOPK, kv_bytes: int = 2, index_bytes: int = 2
) -> list[tuple[str, int, str]]:
    """Bytes each stage of one decode step must move at MiniMax-M3's sizes, per layer.

    ``(stage, bytes, what)`` for ``batch`` query tokens at ``context`` tokens each:
    64 query / 4 KV heads of 128 dims, 128-dim index keys, 128-token blocks, top-k 16.
    """
    from ..cost import attention_cost

    c = attention_cost(context, topk=topk, kv_bytes=kv_bytes, index_bytes=index_bytes)
    blocks = -(-context // 128)
    new_token = NUM_KV_HEADS * HEAD_DIM * 2 * kv_bytes + INDEX_HEAD_DIM * index_bytes
    return [
        ("insert", batch * new_token, "the new token's K, V and index key written"),
        (
            "indexer_scores",
            batch * (c.indexer_bytes + NUM_KV_HEADS * blocks * 4),
            f"{context} index keys read, {NUM_KV_HEADS} x {blocks} block scores written",
        ),
        ("topk", batch * NUM_KV_HEADS * (blocks * 4 + topk * 4), f"scores read, {topk} block ids per KV head"),
        ("block_table", batch * (NUM_KV_HEADS * topk * 4 + c.table_bytes), "ids read, page ids written"),
        (
            "attention",
            batch * (c.sparse_kv_bytes + NUM_Q_HEADS * HEAD_DIM * 2 * 2),
            f"K and V of {c.sparse_tokens} tokens per KV head read",
        ),
    ]


def real_size_text(context: int = MAX_CONTEXT, batch: int = 1, bandwidth_tbps: float | None = None) -> str:
    """:func:`real_size_stages` as text, with the time each would take at ``bandwidth_tbps``."""
    from ..cost import H200_TBPS

    bw = bandwidth_tbps or H200_TBPS
    rows = real_size_stages(context, batch)
    total = sum(b for _, b, _ in rows)
    title = (
        f"one decode step, one layer, batch {batch}, context {context} ({NUM_Q_HEADS}/{NUM_KV_HEADS} heads, "
        f"top-k {DEFAULT_TOPK}): bytes per stage, and the time at {bw:.2f} TB/s"
    )
    lines = [title]
    for stage, nbytes, what in rows:
        lines.append(f"  {stage:<15} {nbytes / 1e6:>9.3f} MB {nbytes / (bw * 1e12) * 1e6:>8.2f} us  {what}")
    lines.append(f"  {'total':<15} {total / 1e6:>9.3f} MB {total / (bw * 1e12) * 1e6:>8.2f} us")
    return "\n".join(lines)


def plot_real_size_stages(contexts=(8192, 131072, MAX_CONTEXT), batch: int = 1) -> Figure:
    """The pipeline of one decode step at MiniMax-M3's sizes: bytes each stage moves, per context length."""
    fig = Figure(figsize=(9.0, 0.8 * len(contexts) + 1.8), layout="constrained")
    ax = fig.add_subplot()
    seen = set()
    for y, context in enumerate(contexts):
        left = 0.0
        for stage, nbytes, _ in real_size_stages(context, batch):
            mb = nbytes / 1e6
            ax.barh(
                y,
                mb,
                left=left,
                height=0.55,
                color=STAGE_COLORS[stage],
                edgecolor="white",
                label=None if stage in seen else stage,
            )
            seen.add(stage)
            if mb / max(left + mb, 1e-9) > 0.08:
                ax.text(left + mb / 2, y, f"{mb:.2f}", ha="center", va="center", fontsize=8, color="white")
            left += mb
        ax.text(left, y, f"  {left:.2f} MB", va="center", fontsize=9)
    ax.set_yticks(range(len(contexts)), [short_shape({"context": c}) for c in contexts])
    ax.invert_yaxis()
    ax.set_xlim(0, ax.get_xlim()[1] * 1.15)
    ax.set_xlabel(
        f"MB moved per decode step and layer (batch {batch}, {NUM_Q_HEADS} query / {NUM_KV_HEADS} KV heads, "
        f"128-token blocks, top-k {DEFAULT_TOPK}, bf16)"
    )
    ax.set_title(
        "insert -> indexer scores -> top-k -> block table -> sparse attention: bytes per stage", loc="left", fontsize=10
    )
    ax.legend(loc="lower right", fontsize=8)
    return fig


# --- plan / run, worked on a small layer (runs anywhere; nothing is timed) ----------------------


def plan_demo(context_len: int = 1024, topk: int = 4, seed: int = 0) -> str:
    """A decode step as a one-shot call and as ``MSADecodePlan.run`` on a small synthetic layer.

    Shows what SPEC section 8 promises: the plan's output is bit-identical to the one-shot
    call; between runs only values change (here ``seq_lens`` grows by one token); a changed
    shape is an error, never a stale replay; ``graph=True`` needs CUDA. Returns text.
    """
    import torch

    from .. import msa
    from ..plan import MSADecodePlan
    from .msa import DEMO_LAYER

    layer = msa.synthetic_layer(context_len, pattern="needle", seed=seed, **DEMO_LAYER)
    inputs = layer.inputs()
    inputs.pop("decode_query_len")
    q = inputs["q"]
    plan = MSADecodePlan(
        inputs["k_cache"],
        inputs["v_cache"],
        inputs["index_cache"],
        batch=q.shape[0],
        max_blocks=inputs["block_table"].shape[1],
        num_q_heads=q.shape[1],
        topk=topk,
    )
    lines = [
        (
            f"plan: batch {plan.batch}, {plan.num_q_heads} query / {plan.num_kv_heads} KV heads, "
            f"block table width {plan.max_blocks}, top-k {plan.topk}"
        )
    ]
    one_shot = msa.msa_decode(**inputs, topk=topk)
    out = plan.run(**inputs)
    lines.append(
        f"run 1 (seq_len {int(inputs['seq_lens'][0])}): plan.run == msa_decode bit for bit: "
        f"{torch.equal(out, one_shot)}; output is the plan's buffer: {out.data_ptr() == plan.out.data_ptr()}"
    )
    grown = dict(inputs, seq_lens=inputs["seq_lens"] - 1)  # a value change: the same shapes, another length
    out = plan.run(**grown).clone()
    lines.append(
        f"run 2 (seq_len {int(grown['seq_lens'][0])}, only a value changed): equal to msa_decode: "
        f"{torch.equal(out, msa.msa_decode(**grown, topk=topk))}"
    )
    wrong = dict(inputs, q=torch.cat([q, q]))
    try:
        plan.run(**wrong)
        lines.append("run 3 (two rows): ran")
    except (ValueError, TypeError) as err:
        lines.append(f"run 3 (two rows instead of one): {type(err).__name__}: {str(err).splitlines()[0]}")
    try:
        MSADecodePlan(
            inputs["k_cache"],
            inputs["v_cache"],
            inputs["index_cache"],
            batch=1,
            max_blocks=plan.max_blocks,
            num_q_heads=plan.num_q_heads,
            topk=topk,
            graph=True,
        )
        lines.append("graph=True: captured")
    except (ValueError, TypeError, RuntimeError) as err:
        lines.append(f"graph=True here: {type(err).__name__}: {str(err).splitlines()[0]}")
    return "\n".join(lines)
