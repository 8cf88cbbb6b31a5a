"""The benchmark harness on the CPU: every suite's code path with tiny shapes (``--dry-run``), the record
schema, the timing helpers, and the FlexAttention block masks built from a selection."""

from __future__ import annotations

import ast
import json
import math

import pytest
import torch

import mm3lab
from benchmarks import __main__ as cli
from benchmarks import suites
from benchmarks.common import bench, num_sets, time_eager
from mm3lab.constants import SPARSE_BLOCK_SIZE
from mm3lab.viz import performance

RECORD_KEYS = {
    "suite",
    "name",
    "gpu",
    "torch",
    "triton",
    "shape",
    "ms",
    "baseline",
    "baseline_ms",
    "speedup",
    "bytes",
    "achieved_TBps",
    "fraction_of_copy_bw",
    "mode",
    "cv",
    "samples",
    "validation",
    "fallback",
}


def run_cli(argv) -> int:
    """``python -m benchmarks ARGV``, the backend restored afterwards."""
    previous = mm3lab.get_backend()
    try:
        return cli.main(argv)
    finally:
        mm3lab.set_backend(previous)


def test_dry_run_covers_every_suite(tmp_path):
    out = tmp_path / "dry.json"
    rc = run_cli(["--dry-run", "--out", str(out), "--calls", "1", "--samples", "2"])
    assert rc == 0
    payload = json.loads(out.read_text())
    assert payload["meta"]["failures"] == {} and payload["meta"]["dry_run"] is True
    assert "cold L2" in payload["meta"]["method"]
    records = payload["records"]
    names = {r["name"] for r in records}
    assert set(cli.ENTRY_POINTS) | {"spec_decode_attention"} <= names
    assert set(payload["meta"]["suite_seconds"]) == set(suites.SUITES)
    assert {r["suite"] for r in records} <= set(suites.SUITES) | {"setup"}
    prefill = [r for r in records if r["name"] == "attention_prefill"]
    assert {r["shape"]["selection"] for r in prefill} == {"random", "tile", "synthetic"}
    assert {r["baseline"] for r in prefill} == {"flex_attention", "dense_sdpa", "per_token_kernel"}
    for r in prefill:
        assert r["attended_TFLOPs"] >= 0 and r["flops_ratio"] >= 0 and r["algorithm"] in ("rows", "tiled")
        if r["baseline"] == "flex_attention":
            assert r["mask_build_ms"] > 0 and r["baseline_rel_error"] < 1e-4
    assert isinstance(payload["meta"]["goals"], list) and payload["meta"]["goals"]
    for r in records:
        assert RECORD_KEYS <= set(r), r["name"]
        assert r["mode"] == "eager" and r["samples"] == 2 and r["ms"] > 0
        assert r["validation"] in (True, False)
    baselines = {(r["name"], r["baseline"]) for r in records}
    for want in [
        ("sparse_attention", "dense_sdpa"),
        ("sparse_attention", "gather_sdpa"),
        ("spec_decode_attention", "per_token_kernel"),
        ("attention_prefill", "dense_sdpa"),
        ("sparse_attention", "flex_attention"),
        ("attention_prefill", "flex_attention"),
        ("msa_decode", "dense_sdpa"),
        ("msa_decode", "gather_sdpa"),
        ("topk", "torch_topk"),
    ]:
        assert want in baselines
    validation = {(r["name"], r["validation"]) for r in records}
    assert ("msa_decode", True) in validation and ("msa_decode", False) in validation


def test_stage_breakdown_runs_the_kernels(tmp_path):
    out = tmp_path / "stages.json"
    rc = run_cli(
        [
            "--dry-run",
            "--backend",
            "interpret",
            "--only",
            "msa_decode_stages",
            "--out",
            str(out),
            "--calls",
            "1",
            "--samples",
            "1",
        ]
    )
    assert rc == 0
    records = json.loads(out.read_text())["records"]
    stages = [r["shape"]["stage"] for r in records if r["name"] == "msa_decode_stage"]
    assert stages == [*suites.STAGES, "total"]


def test_runs_of_some_suites_merge_into_one_file(tmp_path):
    out = tmp_path / "halves.json"
    assert (
        run_cli(["--dry-run", "--only", "topk", "index_cache", "--out", str(out), "--calls", "1", "--samples", "1"])
        == 0
    )
    assert run_cli(["--dry-run", "--only", "block_table", "--out", str(out), "--calls", "1", "--samples", "1"]) == 0
    first = json.loads(out.read_text())
    assert {r["suite"] for r in first["records"]} == {"topk", "index_cache", "block_table"}
    assert first["meta"]["suites"] == ["topk", "index_cache", "block_table"] and len(first["meta"]["runs"]) == 2
    counts = {s: sum(r["suite"] == s for r in first["records"]) for s in ("topk", "index_cache", "block_table")}
    # running a suite again replaces its records (no duplicates) and keeps the others
    assert run_cli(["--dry-run", "--only", "topk", "--out", str(out), "--calls", "1", "--samples", "1"]) == 0
    again = json.loads(out.read_text())
    assert {s: sum(r["suite"] == s for r in again["records"]) for s in counts} == counts
    assert again["meta"]["suites"] == ["index_cache", "block_table", "topk"]
    # --fresh starts over; --merge joins files without running anything
    other = tmp_path / "other.json"
    assert (
        run_cli(
            ["--dry-run", "--fresh", "--only", "index_cache", "--out", str(other), "--calls", "1", "--samples", "1"]
        )
        == 0
    )
    assert {r["suite"] for r in json.loads(other.read_text())["records"]} == {"index_cache"}
    merged = tmp_path / "merged.json"
    assert run_cli(["--merge", str(out), str(other), "--out", str(merged)]) == 0
    both = json.loads(merged.read_text())
    assert sum(r["suite"] == "index_cache" for r in both["records"]) == counts["index_cache"]
    assert {r["suite"] for r in both["records"]} == {"topk", "index_cache", "block_table"}
    # a suite marked stale says so until it runs again
    assert run_cli(["--merge", str(merged), "--out", str(merged), "--mark-stale", "topk=kernel changed"]) == 0
    assert json.loads(merged.read_text())["meta"]["stale"] == {"topk": "kernel changed"}
    assert performance.stale_note(json.loads(merged.read_text()), "topk") == "suite topk is stale: kernel changed"
    assert run_cli(["--dry-run", "--only", "topk", "--out", str(merged), "--calls", "1", "--samples", "1"]) == 0
    assert json.loads(merged.read_text())["meta"]["stale"] == {}
    with pytest.raises(SystemExit):
        run_cli(["--merge", str(merged), "--out", str(merged), "--mark-stale", "nosuch=why"])


def test_a_spent_budget_skips_shapes_and_says_so(tmp_path):
    out = tmp_path / "budget.json"
    assert (
        run_cli(
            ["--dry-run", "--only", "topk", "--budget", "1e-9", "--out", str(out), "--calls", "1", "--samples", "1"]
        )
        == 0
    )
    payload = json.loads(out.read_text())
    assert not [r for r in payload["records"] if r["name"] == "topk"]
    assert any("topk" in n and "budget" in n for n in payload["meta"]["skipped"])


def test_goal_check():
    def rec(name, shape, ms, mode="eager", validation=True, baseline=None, speedup=None, **kw):
        return {
            "name": name,
            "shape": shape,
            "ms": ms,
            "mode": mode,
            "validation": validation,
            "baseline": baseline,
            "speedup": speedup,
            **kw,
        }

    b1 = {"batch": 1, "context": 131072}
    records = [
        rec("sparse_attention", b1, 0.020, baseline="dense_sdpa", speedup=4.0),
        rec("sparse_attention", b1, 0.008, mode="graph", validation=None, baseline="dense_sdpa"),
        rec("msa_decode", {"batch": 16}, 0.5, baseline="dense_sdpa", speedup=1.5),
        rec("attention_prefill", {"selection": "tile"}, 1.0, baseline="flex_attention", speedup=1.3),
        rec("attention_prefill", {"selection": "tile"}, 1.0, baseline="dense_sdpa", speedup=0.5, flops_ratio=0.4),
        rec("attention_prefill", {"selection": "random"}, 3.5, baseline="flex_attention", speedup=15.0),
        rec("msa_decode_stage", {"stage": "topk"}, 0.1, validation=False),
    ]
    got = {(g["goal"], g["met"]) for g in cli.goals(records)}
    assert got == {
        ("sparse_attention batch 1 eager <= 25.0 us", True),
        ("sparse_attention: eager - graph <= 15.0 us", True),
        ("msa_decode eager >= 2.0x dense SDPA", False),
        ("prefill (tile) >= 1.2x FlexAttention", True),
        ("prefill (tile) >= 50% of dense SDPA's FLOP rate", False),
        ("prefill (random) >= 10.0x FlexAttention", True),
        ("prefill (random) <= 3.03 ms", False),
    }


def test_cells_pick_the_fp8_grids_batch_and_context():
    assert cli._cells(["1x8192", "64X131072"]) == ((1, 8192), (64, 131072))
    assert cli._cells(None) is None
    for bad in ("1-8192", "8192", "1x2x3", "0x8192"):
        with pytest.raises(SystemExit, match="BATCHxCONTEXT"):
            cli._cells([bad])


def test_slow_functions_get_fewer_calls_per_sample():
    import time

    t = time_eager(lambda: time.sleep(0.004), calls=20, samples=2, warmup=1, device="cpu", max_sample_ms=5)
    assert t.calls == 1 and t.ms >= 4
    fast = time_eager(lambda: None, calls=20, samples=2, warmup=1, device="cpu", max_sample_ms=5)
    assert fast.calls == 20


def test_timing_helpers_keep_their_plain_signature():
    calls = []
    ms = bench(lambda: calls.append(1))
    assert isinstance(ms, float) and ms >= 0 and calls
    t = time_eager([lambda: None, lambda: None], calls=3, samples=3, device="cpu")
    assert t.mode == "eager" and t.samples == 3 and t.cv >= 0
    assert num_sets(1 << 40) == 1 and num_sets(1 << 20) == 8 and num_sets(100 << 20) == 3


def _paged(batch, context, hkv=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    m = math.ceil(context / SPARSE_BLOCK_SIZE)
    cache = mm3lab.allocate_kv_cache(batch * m + 1, hkv, d, "dense")
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=g))
    bt = torch.randperm(batch * m + 1, generator=g)[: batch * m].view(batch, m).to(torch.int32)
    s = torch.arange(context)
    blk, off = bt.long()[:, s // SPARSE_BLOCK_SIZE], s % SPARSE_BLOCK_SIZE  # [B, S]
    kd = cache.kv[blk, 0, off].permute(0, 2, 1, 3).contiguous()  # [B, Hkv, S, D]
    vd = cache.kv[blk, 1, off].permute(0, 2, 1, 3).contiguous()
    return cache, bt, m, kd, vd, g


def test_flex_decode_block_mask_matches_sparse_attention():
    from torch.nn.attention.flex_attention import flex_attention

    batch, context, hkv, hq, d, topk = 2, 300, 2, 4, 16, 2
    cache, bt, m, kd, vd, g = _paged(batch, context, hkv, d)
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    scores = torch.rand(hkv, batch, m, generator=g)
    scores[..., m - 1] = 2.0
    topk_idx = scores.topk(topk, dim=-1).indices.to(torch.int32)
    q = torch.randn(batch, hq, d, generator=g)
    with mm3lab.use_backend("torch"):
        sbt, sctx = mm3lab.build_sparse_block_table_decode(topk_idx, bt, seq_lens)
        want = mm3lab.sparse_attention(q, cache.k_cache, cache.v_cache, sbt, sctx)
    mask_mod = suites.flex_selection_mask_mod(topk_idx, seq_lens, hq // hkv, m)
    mask = suites.flex_decode_inputs(topk_idx, mask_mod, hq // hkv, m, context)
    with _no_warning_check():
        got = flex_attention(q.view(batch, hq, 1, d), kd, vd, block_mask=mask, enable_gqa=True)
    torch.testing.assert_close(got.view(batch, hq, d), want, atol=1e-5, rtol=1e-5)
    err = suites.check_flex_decode(got, q, kd, vd, topk_idx, seq_lens, d**-0.5)
    assert err < 1e-5
    # the causal-only mask (used compiled, where only listed blocks are visited) is the selection's block list
    causal = suites.flex_decode_inputs(topk_idx, suites.flex_causal(seq_lens), hq // hkv, m, context)
    assert torch.equal(causal.kv_num_blocks, mask.kv_num_blocks) and torch.equal(causal.kv_indices, mask.kv_indices)


class _no_warning_check:
    """(flex_attention warns that it is not compiled on the CPU; the warning is expected here.)"""

    def __enter__(self):
        import warnings

        self._ctx = warnings.catch_warnings()
        self._ctx.__enter__()
        warnings.simplefilter("ignore")

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)


def test_host_suite_runs_without_a_gpu(tmp_path):
    """``python3 -m benchmarks.host``: every record, validation on and off, the layer's memo on and off,
    the recorded and replayed paths."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "host.json"
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "MM3LAB_BACKEND")}
    env["PYTHONPATH"] = str(root)
    cmd = [sys.executable, "-m", "benchmarks.host", "--calls", "2", "--samples", "2", "--out", str(out)]
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    records = json.loads(out.read_text())["records"]
    assert {r["name"] for r in records} == {
        "sparse_attention",
        "index_topk_decode",
        "index_topk_block_table_decode",
        "msa_decode",
        "build_sparse_block_table_decode",
    }
    assert all(r["mode"] == "host" and r["us"] > 0 for r in records)
    layer = [r for r in records if r["name"] == "msa_decode" and "path" not in r]
    both = (True, False)
    assert {(r["validation"], r["passed_checks"]) for r in layer} == {(v, m) for v in both for m in both}
    replayed = [r for r in records if r.get("path") == "recorded"]
    assert {(r["shape"]["batch"], r["known_calls"]) for r in replayed} == {(b, k) for b in (1, 16) for k in both}
    memo = [r for r in records if r.get("path") == "replayed"]  # (the suite asserts that they replayed)
    assert {(r["name"], r["shape"]["batch"]) for r in memo} == {
        (name, b) for name in ("sparse_attention", "build_sparse_block_table_decode") for b in (1, 16)
    }


def test_the_eager_ab_runs_every_arm_and_keeps_nothing_changed(capsys):
    """``python -m benchmarks.eager_ab --dry-run``: every arm of every entry point, validation on and
    off, and the package's settings as they were afterwards."""
    from benchmarks import eager_ab
    from mm3lab import _replay, _valcheck
    from mm3lab.attention import kernel as attn_kernel

    previous = mm3lab.get_backend()
    try:
        assert eager_ab.main(["--dry-run", "--rounds", "1"]) == 0
    finally:
        mm3lab.set_backend(previous)
        eager_ab._arm(True, True)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    arms = {(r["entry"], r["arm"], r["validation"]) for r in map(ast.literal_eval, lines) if r["mode"] == "eager"}
    want = {(e, a, v) for e, names in eager_ab.ARMS.items() for a in names for v in (True, False)}
    assert arms == want - {("msa_decode", "own", False)}
    assert attn_kernel.OWN_MERGE is True and _valcheck.KNOWN_CHECKS == 16
    assert _replay.ENABLED is True and _replay.QUEUE_DURING_CHECKS is True
    assert _replay.COMPILED_GUARDS is True and mm3lab.index_cache.SELF_CHECK is True
    assert mm3lab.indexer.FUSED_CHECKS is True


def test_the_insert_ab_runs_every_arm_and_restores_the_switch(capsys):
    """``python -m benchmarks.insert_ab --dry-run``: every arm at each token count (more keys than one
    program's), and the insert's self-check switch as it was afterwards."""
    from benchmarks import insert_ab

    assert insert_ab.main(["--dry-run"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    records = [ast.literal_eval(line) for line in lines]
    assert [r["tokens"] for r in records] == [4, 40]
    assert all(set(insert_ab.ARMS) <= set(r) and all(len(v) == 1 for v in r["rounds_us"].values()) for r in records)
    assert mm3lab.index_cache.SELF_CHECK is True


def test_the_tiled_variants_run_and_agree(capsys):
    """``python -m benchmarks.tiled_variants --dry-run``: its arms and the per-row kernel run on a small
    chunk; the union walk (every tile of that selection walks its union) gives the default's bits."""
    from benchmarks import tiled_variants

    assert tiled_variants.main(["--dry-run"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    records = {r["arm"]: r for r in map(ast.literal_eval, lines)}
    assert set(records) == {"default", "union", "per_row"}
    assert records["union"]["max_abs_vs_default"] == 0
    assert records["per_row"]["max_abs_vs_default"] < 1e-5


def test_every_tiled_variant_arm_is_a_launch_of_the_kernel():
    """Each arm's settings are keyword arguments that ``tiled_attention_kernel`` takes (an arm a GPU run would
    reject only after its first compiles)."""
    import inspect

    from benchmarks import tiled_variants
    from mm3lab.attention import tiled

    params = inspect.signature(tiled.tiled_attention_kernel).parameters
    for arm, kwargs in tiled_variants.ARMS.items():
        assert set(kwargs) <= {name for name, p in params.items() if p.kind is p.KEYWORD_ONLY}, arm
    assert set(tiled_variants.SAME_BITS) <= set(tiled_variants.ARMS)


def test_the_tiled_variants_take_chosen_arms_in_rounds(capsys):
    """``--arms`` times the default and the arms named (the default first, the others compared with it),
    ``--rounds`` each of them that many times, the arms in turn, on the chunks ``--selections`` names."""
    from benchmarks import tiled_variants

    assert tiled_variants.main(["--dry-run", "--arms", "union", "--rounds", "2", "--selections", "synthetic"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    records = list(map(ast.literal_eval, lines))
    assert {r["selection"] for r in records} == {"synthetic"}
    seen = [(r["round"], r["arm"]) for r in records]
    assert seen == [(0, "default"), (0, "union"), (0, "per_row"), (1, "default"), (1, "union"), (1, "per_row")]
