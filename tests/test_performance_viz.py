"""The results notebook's pictures and table, on a small results dict shaped like the benchmarks' output."""

from __future__ import annotations

import json

import matplotlib
import pytest

matplotlib.use("Agg")

from mm3lab.viz import performance  # noqa: E402


def _record(name, shape, ms, baseline=None, baseline_ms=None, tbps=None):
    return {
        "name": name, "gpu": "GPU", "torch": "t", "triton": "tr", "shape": shape, "ms": ms,
        "baseline": baseline, "baseline_ms": baseline_ms,
        "speedup": None if baseline_ms is None else baseline_ms / ms,
        "bytes": None if tbps is None else int(tbps * 1e12 * ms * 1e-3),
        "achieved_TBps": tbps, "fraction_of_copy_bw": None if tbps is None else tbps / 4.0,
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
        {**_record("attention_prefill", {"chunk": 4, "context": 8, "q_heads": 64, "kv_heads": 4, "head_dim": 128},
                   2.0, "dense_sdpa_causal_32k", 20.0), "attended_TFLOPs": 80.0, "baseline_TFLOPs": 600.0},
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
        "\n".join(performance.limits(results)))
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
