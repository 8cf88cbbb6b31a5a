"""FP8 selection quality: the module (mm3lab.indexer.quality), its pictures (mm3lab.viz.fp8) and widget."""

from __future__ import annotations

import matplotlib
import pytest
import torch

matplotlib.use("Agg")

from matplotlib.figure import Figure

from mm3lab.fp8 import round_trip
from mm3lab.indexer import quality
from mm3lab.viz import fp8 as vf


def test_set_recall_on_worked_cases():
    want = torch.tensor([[3, 1, 2, -1], [0, 1, 2, 3]])
    got = torch.tensor([[1, 2, 5, -1], [3, 2, 1, 0]])
    assert quality.set_recall(got, want).tolist() == [2 / 3, 1.0]
    assert quality.set_recall(torch.tensor([[-1]]), torch.tensor([[-1]])).tolist() == [0.0]


def test_index_keys_are_the_caches_values():
    k = torch.randn(300, 64, generator=torch.Generator().manual_seed(0))
    assert torch.equal(quality.index_keys(k, "bf16"), k.bfloat16().double())
    assert torch.equal(quality.index_keys(k, "fp8"), round_trip(k).double())
    with pytest.raises(ValueError, match="key_dtype"):
        quality.index_keys(k, "int8")


def test_identical_keys_select_identically():
    cmp = quality.compare("needle", 1024, topk=4, rows=8)
    scores = cmp.scores["bf16"]
    ids = quality.select(scores, cmp.positions, 4)
    assert torch.equal(ids, cmp.topk_idx["bf16"])
    assert float(quality.set_recall(ids, ids).mean()) == 1.0
    # the local block is forced first; -1 only past the row's candidate blocks
    assert torch.equal(ids[:, :, 0].long(), (cmp.positions // 128).expand(ids.shape[0], -1))


def test_compare_numbers_are_in_range_and_consistent():
    cmp = quality.compare("needle", 4096, topk=16, rows=16)
    for k in (1, 4, 16):
        r = cmp.recall(k)
        assert 0.9 <= r <= 1.0
        assert 0.0 < cmp.mass("bf16", k) <= 1.0 and abs(cmp.mass("fp8", k) - cmp.mass("bf16", k)) < 0.02
    codes = cmp.differing(16)
    counts = vf.differing_counts(cmp, 16)
    assert counts.sum() == codes.numel() and counts[2] == counts[3]  # a swap: as many in as out
    sel = cmp.topk_idx["bf16"]
    assert counts[1] + counts[2] == int((sel >= 0).sum())


def test_quality_table_and_text():
    table = quality.quality_table(patterns=("sink", "random"), contexts=(2048,), topks=(1, 4), rows=8)
    assert [(r.pattern, r.topk) for r in table] == [("sink", 1), ("sink", 4), ("random", 1), ("random", 4)]
    assert all(r.topk != 1 or r.recall == 1.0 for r in table)  # top-1 is the forced local block
    text = vf.recall_text(table, topk=4)
    assert text.splitlines()[0].split()[:3] == ["pattern", "context", "top-k"] and len(text.splitlines()) == 3
    with pytest.raises(ValueError, match="topk"):
        vf.recall_text(table, topk=8)
    fig = vf.plot_quality(table)
    assert isinstance(fig, Figure)
    gids = [ln.get_gid() for ax in fig.axes for ln in ax.get_lines()]
    assert gids.count("recall") == 2 and gids.count("mass-bf16") == 2 and gids.count("mass-fp8") == 2


def test_differing_picture_and_show():
    cmp = quality.compare("random", 2048, topk=8, rows=8)
    fig = vf.plot_differing_blocks(cmp, 8, head=1)
    assert [im.get_gid() for im in fig.axes[0].get_images()] == ["differ"]
    assert vf.differing_text(cmp, 8).splitlines()[1].startswith("head")
    fig = vf.show_fp8_selection("needle", 4096, 4, "bf16")
    assert {im.get_gid() for ax in fig.axes for im in ax.get_images()} == {"selected", "differ"}
    with pytest.raises(ValueError, match="dtype"):
        vf.show_fp8_selection("needle", 4096, 4, "int4")
    with pytest.raises(ValueError, match="topk"):
        vf.show_fp8_selection("needle", 4096, 17)


def test_widget_runs_its_callback_without_a_frontend():
    ipywidgets = pytest.importorskip("ipywidgets")
    from mm3lab.widgets.fp8 import fp8_widget

    w = fp8_widget(context=4096, topk=4)
    assert isinstance(w, ipywidgets.interactive)
    assert isinstance(w.result, Figure) and "recall" in w.text
    controls = {c.description: c for c in w.children if hasattr(c, "description")}
    controls["index keys"].value = "bf16"
    assert isinstance(w.result, Figure)
    controls["top-k"].value = 2
    assert "top-2 recall" in w.text
