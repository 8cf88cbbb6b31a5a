"""The FP8 decode-grid suite (benchmarks/fp8.py) on the CPU: its cells, its records, the dry run."""

from __future__ import annotations

import json

from test_benchmarks_smoke import RECORD_KEYS, run_cli

from benchmarks import fp8 as grid
from benchmarks import suites


def test_grid_cells_cover_the_grid_goals_first():
    cells = grid.grid_cells(quick=False)
    assert len(cells) == len(set(cells)) == len(grid.GRID_BATCHES) * len(grid.GRID_CONTEXTS)
    assert cells[0] == (64, 128 * 1024)  # the goals' cell, then batch 1 at every context
    assert cells[1:6] == [(1, c) for c in grid.GRID_CONTEXTS]
    assert set(grid.grid_cells(quick=True)) <= set(cells)
    assert suites.SUITES["fp8"] == "run_fp8_grid" and callable(suites.run_fp8_grid)


def test_dry_run_writes_grid_records(tmp_path):
    out = tmp_path / "fp8.json"
    assert run_cli(["--dry-run", "--only", "fp8", "--out", str(out), "--calls", "1", "--samples", "2"]) == 0
    payload = json.loads(out.read_text())
    assert payload["meta"]["failures"] == {}
    records = [r for r in payload["records"] if r["name"] == "msa_decode_grid"]
    assert records
    for r in records:
        assert RECORD_KEYS <= set(r)
        assert r["baseline"] == "dense_sdpa" and r["baseline_ms"] > 0 and r["mode"] == "eager"
        assert {"batch", "context", "q_len", "dtype", "index_dtype", "kv_dtype", "stage"} <= set(r["shape"])
    assert {r["shape"]["dtype"] for r in records} == {"fp32", "fp8"}
    assert {r["shape"]["q_len"] for r in records} == {1, 2}
