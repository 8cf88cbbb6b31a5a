"""Pictures and tables of committed benchmark results (``benchmarks/results/<gpu>.json``).

Everything here reads the JSON the benchmarks write; nothing is timed, so the
results notebook runs anywhere and shows the GPU's numbers.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import matplotlib.pyplot as plt

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
        f"GPU {meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, copy bandwidth {meta['copy_TBps']:.2f} TB/s",
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
            f"{r['name']:<32} {_shape_text(r['shape'])[:44]:<44} {1e3 * r['ms']:>9.1f} {base:<24} {base_us:>9} {speed:>8} {frac:>9}"
        )
    return "\n".join(lines)


def plot_roofline(results: dict):
    """Achieved bandwidth of every bandwidth-bound record against the measured copy bandwidth."""
    copy = results["meta"]["copy_TBps"]
    rows = [
        r
        for r in results["records"]
        if r["achieved_TBps"] is not None and not r["name"].startswith(("copy_", "launch_"))
        and r["baseline"] in (None, "naive_gather_sdpa", "torch_ops", "torch_einsum_amax_topk", "torch_index_copy", "torch.topk", "dense_sdpa")
    ]
    seen, uniq = set(), []
    for r in rows:
        key = (r["name"], json.dumps(r["shape"], sort_keys=True))
        if key not in seen:
            seen.add(key)
            uniq.append(r)
    fig, ax = plt.subplots(figsize=(9, max(3, 0.32 * len(uniq) + 1)))
    labels = [f"{r['name']}  {_shape_text(r['shape'], ['batch', 'rows', 'tokens', 'chunk', 'layout'])}" for r in uniq]
    values = [r["achieved_TBps"] for r in uniq]
    ax.barh(range(len(uniq)), values, color="tab:blue")
    ax.axvline(copy, color="tab:red", linestyle="--", label=f"copy bandwidth {copy:.2f} TB/s")
    ax.set_yticks(range(len(uniq)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("achieved TB/s on the bytes the kernel must move")
    ax.set_title(f"Bandwidth against the copy roofline ({results['meta']['gpu']})")
    ax.legend(loc="lower right")
    fig.tight_layout()
    return fig


def plot_decode_times(results: dict):
    """Attention decode time per batch: mm3lab sparse, naive gather + SDPA, dense SDPA over the full context."""
    fig, ax = plt.subplots(figsize=(7, 4))
    ours = [r for r in records(results, "attention_decode", "naive_gather_sdpa") if r["shape"].get("layout") == "dense"]
    dense = {r["shape"]["batch"]: r["baseline_ms"] for r in records(results, "attention_decode", "dense_sdpa")}
    batches = [r["shape"]["batch"] for r in ours]
    width = 0.27
    xs = range(len(batches))
    ax.bar([x - width for x in xs], [1e3 * r["ms"] for r in ours], width, label="mm3lab sparse_attention")
    ax.bar(list(xs), [1e3 * r["baseline_ms"] for r in ours], width, label="gather + SDPA")
    ax.bar([x + width for x in xs], [1e3 * dense.get(b, float("nan")) for b in batches], width, label="dense SDPA (full context)")
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
    fig, ax = plt.subplots(figsize=(9, max(3, 0.3 * len(rows) + 1)))
    labels = [f"{r['name']} vs {r['baseline']}  {_shape_text(r['shape'], ['batch', 'rows', 'tokens', 'chunk', 'layout'])}" for r in rows]
    ax.barh(range(len(rows)), [r["speedup"] for r in rows], color=["tab:green" if r["speedup"] >= 1 else "tab:red" for r in rows])
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
    copy = results["meta"]["copy_TBps"]
    empty = _first(records(results, "launch_empty_triton"))
    out = []

    def goal(text, value, target, higher=True, unit=""):
        met = None if value is None else (value >= target if higher else value <= target)
        out.append({"goal": text, "value": value, "target": target, "met": met, "unit": unit})

    bt = _first(records(results, "block_table_decode", "torch_ops"), rows=256)
    goal("block table, 256 rows: speedup over the PyTorch ops", bt and bt["speedup"], 20.0, unit="x")
    goal(
        "block table, 256 rows: time / empty Triton launch (CUDA graph)",
        bt and empty and round(bt["ms"] / empty["ms"], 3), 1.5, higher=False, unit="x",
    )
    eager = _first(records(results, "launch_empty_triton_eager"))
    goal(
        "block table, 256 rows: time / empty Triton launch (do_bench)",
        bt and eager and bt.get("ms_do_bench") and round(bt["ms_do_bench"] / eager["ms"], 3), 1.5,
        higher=False, unit="x",
    )
    a64 = _first(records(results, "attention_decode", "naive_gather_sdpa"), batch=64, layout="dense")
    goal("attention decode, batch 64, 128K: fraction of copy bandwidth", a64 and a64["fraction_of_copy_bw"], 0.6)
    d64 = _first(records(results, "attention_decode", "dense_sdpa"), batch=64)
    goal("attention decode, batch 64: speedup over dense SDPA", d64 and d64["speedup"], 40.0, unit="x")
    goal("attention decode, batch 64: speedup over gather + SDPA", a64 and a64["speedup"], GATHER_SPEEDUP_GOAL,
         unit="x")
    a1 = _first(records(results, "attention_decode", "naive_gather_sdpa"), batch=1)
    text = "attention decode, batch 1: time / (empty launch + bytes at copy bandwidth)"
    launch = eager or empty  # the floor: an empty launch as do_bench times it
    if a1 and launch:
        floor_ms = launch["ms"] + a1["bytes"] / (copy * 1e12) * 1e3
        goal(text, round(a1.get("ms_graph", a1["ms"]) / floor_ms, 3), 3.0, higher=False, unit="x")
    else:
        goal(text, None, 3.0, higher=False)
    i64 = _first(records(results, "indexer_decode"), batch=64)
    goal("indexer decode, batch 64, 128K: fraction of copy bandwidth", i64 and i64["fraction_of_copy_bw"], 0.5)
    t64 = _first(records(results, "topk", "torch.topk"), rows=64)
    goal("top-k, 64 rows of 8192: speedup over torch.topk", t64 and t64["speedup"], 5.0, unit="x")
    f64 = _first(records(results, "indexer_decode_fused_block_table"), batch=64)
    goal("fused indexer + block table, batch 64: speedup over the two launches", f64 and f64["speedup"], 1.0,
         unit="x")
    for f in records(results, "topk_fused_block_table"):
        goal(f"fused top-k + block table from scores, batch {f['shape']['batch']}, {f['shape']['width']} blocks: "
             "speedup over the two launches", f["speedup"], 1.0, unit="x")
    pre = _first(records(results, "attention_prefill"))
    goal("attention prefill, 32K: attended FLOP/s / dense SDPA FLOP/s", pre and pre.get("flops_ratio"), 0.5)
    return out


def goals_report(results: dict) -> str:
    """One line per goal: measured value, target, met / missed (and by how much)."""
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
    copy = results["meta"]["copy_TBps"]
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
    if pre and pre.get("attended_TFLOPs"):
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
        parts = ", ".join(f"{f['ms'] * 1e3:.1f} vs {f['baseline_ms'] * 1e3:.1f} us at {f['shape']['width']} blocks"
                          for f in fused)
        out.append(
            f"fused top-k + block table: from scores, {parts}: the launch saved is worth about one empty launch, "
            "and the fused program emits its rows' tables one after another; inside the whole indexer "
            f"({f64['ms'] * 1e3:.0f} us at batch 64) the difference is {abs(f64['ms'] - f64['baseline_ms']) * 1e3:.1f} us."
        )
    return out

