"""The results notebook's pictures and table, on a small results dict shaped like the benchmarks' output."""

from __future__ import annotations

import json

import matplotlib
import pytest

matplotlib.use("Agg")

from mm3lab.viz import performance


def _record(name, shape, ms, baseline=None, baseline_ms=None, tbps=None):
    return {
        "name": name,
        "gpu": "GPU",
        "torch": "t",
        "triton": "tr",
        "shape": shape,
        "ms": ms,
        "baseline": baseline,
        "baseline_ms": baseline_ms,
        "speedup": None if baseline_ms is None else baseline_ms / ms,
        "bytes": None if tbps is None else int(tbps * 1e12 * ms * 1e-3),
        "achieved_TBps": tbps,
        "fraction_of_copy_bw": None if tbps is None else tbps / 4.0,
    }


RESULTS = {
    "meta": {"gpu": "GPU", "torch": "t", "triton": "tr", "copy_TBps": 4.0},
    "records": [
        _record("copy_bandwidth", {"bytes": 1}, 1.0, tbps=4.0),
        _record(
            "attention_decode", {"batch": 1, "context": 131072, "layout": "dense"}, 0.01, "naive_gather_sdpa", 0.1, 1.0
        ),
        _record("attention_decode", {"batch": 1, "context": 131072, "layout": "dense"}, 0.01, "dense_sdpa", 0.5, 1.0),
        _record(
            "attention_decode", {"batch": 64, "context": 131072, "layout": "dense"}, 0.1, "naive_gather_sdpa", 1.5, 3.0
        ),
        _record("attention_decode", {"batch": 64, "context": 131072, "layout": "dense"}, 0.1, "dense_sdpa", 3.6, 3.0),
        _record("block_table_decode", {"rows": 256}, 0.005, "torch_ops", 0.5, 0.1),
    ],
}


def test_summary_table_lists_every_kernel_record():
    text = performance.summary_table(RESULTS)
    assert "copy bandwidth 4.00 TB/s" in text
    assert text.count("attention_decode") == 4
    assert "100.0x" in text  # block table: 0.5 ms / 0.005 ms
    assert "copy_bandwidth" not in text


def test_plots_draw_what_the_records_hold():
    fig = performance.plot_roofline(RESULTS)
    ax = fig.axes[0]
    assert len(ax.patches) == 3  # one bar per (name, shape)
    assert "4.00 TB/s" in ax.get_legend().get_texts()[0].get_text()
    fig = performance.plot_decode_times(RESULTS)
    assert len(fig.axes[0].patches) == 6  # 2 batches x 3 methods
    assert "128K" in fig.axes[0].get_title()
    fig = performance.plot_speedups(RESULTS)
    assert len(fig.axes[0].patches) == 5


def test_load_results_reads_a_file(tmp_path):
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(RESULTS))
    assert performance.load_results(path)["meta"]["copy_TBps"] == 4.0
    assert len(performance.records(RESULTS, "attention_decode", "dense_sdpa")) == 2


def test_goals_report_marks_met_missed_and_unmeasured():
    text = performance.goals_report(RESULTS)
    assert "[met ] block table, 256 rows: speedup over the PyTorch ops: 100x (goal 20x)" in text
    assert "[MISS] attention decode, batch 64: speedup over dense SDPA: 36x (goal 40x), 0.90 of the goal" in text
    assert "[ -- ] top-k, 64 rows of 8192: speedup over torch.topk: not measured" in text
    assert len(text.splitlines()) == len(performance.goals(RESULTS))


def test_limits_are_computed_from_the_records():
    results = json.loads(json.dumps(RESULTS))
    results["records"] += [
        _record("launch_empty_triton", {"grid": 1}, 0.0005),
        _record("block_table_decode", {"rows": 1}, 0.0015, "torch_ops", 0.1, 0.001),
        {
            **_record(
                "attention_prefill",
                {"chunk": 4, "context": 8, "q_heads": 64, "kv_heads": 4, "head_dim": 128},
                2.0,
                "dense_sdpa_causal_32k",
                20.0,
            ),
            "attended_TFLOPs": 80.0,
            "baseline_TFLOPs": 600.0,
        },
    ]
    text = "\n".join(performance.limits(results))
    assert "one row already takes 1.50 us per launch in a CUDA graph, 3.0x an empty kernel (0.50 us)" in text
    assert "255 more rows add 3.50 us" in text
    # 80 TFLOP/s for 2 ms at 4 * 128 * 16 FLOP per (row, token) and 512 bytes of K/V per (row, token)
    assert "10.0 GB in 2.00 ms = 5.0 TB/s (1.25x copy bandwidth" in text and "16 FLOP per byte" in text
    assert "batch 64: 15x" not in text  # met: 1.5 ms / 0.1 ms
    a64 = performance.records(results, "attention_decode", "naive_gather_sdpa")[1]
    a64["baseline_ms"], a64["speedup"] = 1.2, 12.0
    # 15x over 1.2 ms means 80 us; 75% of copy bandwidth in 100 us would be 94% in 80 us
    assert "means 80 us, 94% of copy bandwidth on the selected bytes; the kernel reads them at 75% (100 us)" in (
        "\n".join(performance.limits(results))
    )
    assert performance.limits({"meta": RESULTS["meta"], "records": []}) == []


def test_results_path_argument_env_and_checkout(tmp_path, monkeypatch):
    folder = tmp_path / "benchmarks" / "results"
    folder.mkdir(parents=True)
    (folder / "gpu.json").write_text(json.dumps(RESULTS))
    assert performance.results_path(folder) == folder / "gpu.json"
    monkeypatch.setenv(performance.RESULTS_ENV, str(folder / "gpu.json"))
    assert performance.results_path() == folder / "gpu.json"
    monkeypatch.delenv(performance.RESULTS_ENV)
    inner = tmp_path / "notebooks"
    inner.mkdir()
    monkeypatch.chdir(inner)  # a checkout's notebooks/ folder: the results are found above it
    assert performance.load_results()["meta"]["copy_TBps"] == 4.0
    monkeypatch.chdir(folder)
    (folder / "gpu.json").unlink()
    with pytest.raises(FileNotFoundError, match="no benchmark results"):
        performance.load_results()


# --- records with a mode (the benchmarks' record schema) ----------------------------------------


def _rec(name, shape, ms, mode, baseline=None, baseline_ms=None, tbps=None, **extra):
    r = _record(name, shape, ms, baseline, baseline_ms, tbps)
    r.update({"mode": mode, "cv": 0.02, "samples": 20, "validation": None, "fallback": None, **extra})
    return r


def _stage(stage, us, mode="graph", batch=16, context=131072, tbps=2.0):
    return _rec("msa_decode_stage", {"batch": batch, "context": context, "stage": stage}, us * 1e-3, mode, tbps=tbps)


SCHEMA = {
    "meta": {"gpu": "GPU", "torch": "t", "triton": "tr", "copy_TBps": 4.0, "method": "synthetic"},
    "records": [
        _stage("insert", 5),
        _stage("indexer_scores", 100),
        _stage("topk", 40),
        _stage("block_table", 5),
        _stage("attention", 150),
        _stage("topk_block_table", 42),
        _stage("total", 310),
        _stage("total", 650, "eager"),
        _rec("msa_decode_plan", {"batch": 16, "context": 131072}, 0.310, "graph", "dense_sdpa", 3.2),
        _rec("msa_decode_plan", {"batch": 16, "context": 131072}, 0.650, "eager", "dense_sdpa", 3.2, validation=False),
        _rec("msa_decode", {"batch": 16, "context": 131072}, 0.320, "graph", "dense_sdpa", 3.2),
        _rec("msa_decode", {"batch": 16, "context": 131072}, 0.780, "eager", "dense_sdpa", 3.2, validation=True),
        _rec("msa_decode", {"batch": 16, "context": 131072}, 0.700, "eager", "dense_sdpa", 3.2, validation=False),
        _rec("msa_decode", {"batch": 16, "context": 32768}, 0.200, "graph", "dense_sdpa", 0.8),
        _rec("msa_decode", {"batch": 1, "context": 32768}, 0.050, "graph", "dense_sdpa", 0.06),
        _rec("msa_decode", {"batch": 1, "context": 131072}, 0.060, "graph", "dense_sdpa", 0.2),
        _rec(
            "msa_decode_grid",
            {"batch": 1, "context": 32768, "index_dtype": "bf16", "kv_dtype": "fp8", "q_len": 1},
            0.05,
            "graph",
            "dense_sdpa",
            0.1,
        ),
        _rec(
            "msa_decode_grid",
            {"batch": 16, "context": 131072, "index_dtype": "bf16", "kv_dtype": "fp8", "q_len": 1},
            0.2,
            "graph",
            "dense_sdpa",
            2.0,
        ),
        _rec(
            "attention_prefill",
            {"batch": 1, "context": 32768, "selection": "tile"},
            2.0,
            "eager",
            "dense_sdpa",
            1.0,
            attended_TFLOPs=100.0,
            flops_ratio=0.4,
        ),
    ],
}


def test_every_time_carries_its_mode():
    assert performance.timed(SCHEMA["records"][0]) == "5.0 us (graph)"
    assert performance.mode_of({"name": "old"}) == "unknown"  # records written before the schema had a mode
    table = performance.mode_table(SCHEMA)
    assert all(len(line) <= 100 for line in table.splitlines()[1:])
    assert "graph" in table and "eager" in table and "ctx=128K" in table


def test_stage_breakdown_accounts_for_the_step():
    b = performance.stage_breakdown(SCHEMA, 16, 131072)
    # the step's launches: top-k and block table fused, as the plan runs them
    assert [s for s, _ in b["stages"]] == ["insert", "indexer_scores", "topk_block_table", "attention"]
    assert abs(b["sum_ms"] - 0.297) < 1e-9 and b["fused"]["ms"] == 0.042 and abs(b["unfused_ms"] - 0.045) < 1e-9
    assert b["total"]["graph"]["ms"] == 0.310 and b["step"]["eager"]["validation"] is False
    text = performance.breakdown_text(SCHEMA, 16, 131072)
    assert "sum of launches" in text and "297.0 us (graph)" in text
    assert "two launches instead: 45.0 us (graph)" in text
    assert "whole step (graph) - sum of launches = 13.0 us" in text  # 310 - 297
    assert "host overhead: eager - graph = 340.0 us" in text  # the plan: 650 - 310
    assert "msa_decode, checks on" in text
    assert performance.stage_breakdown(SCHEMA, 1, 1) is None
    assert "no msa_decode_stage records" in performance.breakdown_text(SCHEMA, 1, 1)
    fig = performance.plot_stage_breakdown(SCHEMA)
    assert len(fig.axes[0].patches) == 4
    fig = performance.plot_stage_roofline(SCHEMA)
    assert len(fig.axes[0].patches) == 4


def test_stage_bytes_are_counted_where_the_records_have_none():
    r = {"shape": {"batch": 1, "context": 1 << 20, "stage": "attention", "dtype": "bf16"}, "bytes": None}
    counted = {s: b for s, b, _ in performance.real_size_stages(1 << 20)}
    assert performance._stage_bytes(r) == counted["attention"]
    r["shape"]["stage"] = "topk_block_table"
    assert performance._stage_bytes(r) == counted["topk"] + counted["block_table"]
    r["shape"]["dtype"] = "fp32"  # not the model's sizes: no count
    assert performance._stage_bytes(r) is None


def test_plan_text_and_meta_text():
    text = performance.plan_text(SCHEMA)
    assert "batch 16, ctx=128K:" in text
    assert "  MSADecodePlan.run      graph                310.0 us (its own graph=True replay)" in text
    assert "  msa_decode (one-shot)  eager, checks on     780.0 us" in text
    assert "ctx=32K" not in text  # shapes without plan records are left out
    assert performance.plan_text({"meta": {}, "records": []}).startswith("no msa_decode_plan records")
    dry = {"meta": {"gpu": "cpu-dry-run", "copy_TBps": None, "failures": {"prefill": "no CUDA"}}, "records": []}
    text = performance.meta_text(dry)
    assert "copy bandwidth: not measured" in text and "suite prefill failed" in text
    assert "copy bandwidth 4.00 TB/s" in performance.mode_table(SCHEMA) or "4.00 TB/s" in performance.mode_table(SCHEMA)
    assert "not measured" in performance.mode_table(dry)
    assert performance.plot_roofline(dry) is None and performance.plot_stage_roofline(dry) is None


def test_goals_from_the_results_file_itself():
    results = {
        "meta": {
            "goals": [
                {"goal": "msa_decode eager >= 2.0x dense SDPA", "shape": {"batch": 16}, "value": 3.25, "met": True},
                {"goal": "x: eager - graph <= 15.0 us", "shape": {"batch": 1}, "value": 20.0, "met": False},
            ]
        },
        "records": [],
    }
    text = performance.goals_report(results)
    assert text.splitlines() == [
        "[met ] msa_decode eager >= 2.0x dense SDPA (b=16): 3.25",
        "[MISS] x: eager - graph <= 15.0 us (b=1): 20",
    ]
    assert performance.goals_report({"meta": {"goals": []}, "records": []}).startswith("the benchmark run checked no")


def test_host_overhead_and_speedup_and_grid():
    rows = performance.host_device_rows(SCHEMA)
    step = [
        r for r in rows if r["name"] == "msa_decode" and r["shape"]["context"] == 131072 and r["shape"]["batch"] == 16
    ]
    assert step and abs(step[0]["host_ms"] - 0.380) < 1e-9  # validation off preferred: 700 - 320
    assert performance.plot_host_device(SCHEMA) is not None
    series = performance.speedup_series(SCHEMA)
    assert series[(16, "graph")] == [(32768, 4.0), (131072, 10.0)]
    assert performance.plot_speedup_vs_context(SCHEMA) is not None
    fig = performance.plot_grid_heatmap(SCHEMA)
    assert "10.0x" in [t.get_text() for t in fig.axes[0].texts]
    assert "tile" in performance.prefill_text(SCHEMA) and "(eager)" in performance.prefill_text(SCHEMA)
    assert "checks on" in performance.validation_text(SCHEMA)


def test_absent_record_families_degrade_gracefully():
    empty = {"meta": {"gpu": "GPU", "copy_TBps": 4.0}, "records": []}
    for plot in (
        performance.plot_stage_breakdown,
        performance.plot_stage_roofline,
        performance.plot_host_device,
        performance.plot_speedup_vs_context,
        performance.plot_grid_heatmap,
    ):
        assert plot(empty) is None
    assert performance.prefill_text(empty).startswith("no ")
    assert performance.validation_text(empty).startswith("no ")
    assert performance.stage_shapes(empty) == []


def test_real_size_stages():
    rows = performance.real_size_stages(1 << 20)
    names = [s for s, _, _ in rows]
    assert names == list(performance.STAGES)
    att = {s: b for s, b, _ in rows}
    assert att["indexer_scores"] > att["attention"]  # at 1M the indexer's read dominates
    assert "total" in performance.real_size_text()


def test_real_size_pipeline_and_bytes_per_token():
    from mm3lab.viz import index_cache

    fig = performance.plot_real_size_stages()
    assert len(fig.axes[0].patches) == 3 * len(performance.STAGES)
    fig = index_cache.plot_bytes_per_token()
    assert "2048 B of K/V, 256 B of index key (12.5%)" in fig.axes[0].get_title(loc="left")


def test_plan_demo_runs_the_plan_against_the_one_shot_call():
    text = performance.plan_demo(context_len=256, topk=2)
    assert "plan.run == msa_decode bit for bit: True; output is the plan's buffer: True" in text
    assert "only a value changed): equal to msa_decode: True" in text
    assert "run 3 (two rows instead of one): ValueError" in text
    assert "graph=True" in text.splitlines()[-1]


def test_grid_heatmap_draws_the_whole_step_not_its_stages():
    def rec(stage, speedup):
        shape = {"batch": 64, "context": 131072, "q_len": 1, "index_dtype": "fp8", "kv_dtype": "fp8", "stage": stage}
        return {"name": "msa_decode_grid", "shape": shape, "mode": "graph", "ms": 1.0, "speedup": speedup}

    results = {"meta": {"gpu": "GPU"}, "records": [rec("step", 4.3), rec("attention", 51.5)]}
    texts = [t.get_text() for t in performance.plot_grid_heatmap(results).axes[0].texts]
    assert texts == ["4.3x"]


def test_tuning_text_lists_every_configuration_against_the_default():
    assert "indexer_tuning" in performance.tuning_text(RESULTS)  # none measured: says how to measure
    shape = {"batch": 64, "context": 131072, "dtype": "fp8", "num_stages": 5, "orientation": "tokens_x_lanes"}
    recs = [
        {
            **_record("indexer_scores_config", {**shape, "default": True}, 0.33, "default_config", 0.33, 3.3),
            "mode": "graph",
        },
        {
            **_record(
                "indexer_scores_config", {**shape, "num_stages": 2, "default": False}, 0.5, "default_config", 0.33, 2.2
            ),
            "mode": "graph",
        },
    ]
    text = performance.tuning_text({"meta": RESULTS["meta"], "records": recs})
    lines = text.splitlines()
    assert lines[0].startswith("fp8 index keys")
    assert "stages 2" in lines[1] and "0.66x the default" in lines[1] and "55% of copy bandwidth" in lines[1]
    assert "stages 5" in lines[2] and lines[2].endswith("<- default") and "1.00x" in lines[2]
