"""The MSA pictures (mm3lab.viz.msa), their text twins and the MSA widget."""

from __future__ import annotations

import pytest
from matplotlib.figure import Figure

from mm3lab import cost, msa
from mm3lab.constants import PAGE_SIZE, SPARSE_BLOCK_SIZE
from mm3lab.viz import msa as viz

SHAPE = dict(batch=1, num_kv_heads=2, group_size=2, head_dim=32, index_dim=16)


def patches(ax, gid):
    return [p for p in ax.patches if p.get_gid() == gid]


@pytest.fixture(scope="module")
def demo():
    layer = msa.synthetic_layer(700, pattern="needle", layout="packed", seed=2, **SHAPE)
    return msa.run_msa_demo(layer, topk=3)


def test_block_scores_mark_the_selection(demo):
    fig = viz.plot_block_scores(demo.step)
    assert isinstance(fig, Figure) and len(fig.axes) == 2  # one panel per KV head
    p = int(demo.step.query_abs_pos[0])
    self_blk = p // SPARSE_BLOCK_SIZE
    for h, ax in enumerate(fig.axes):
        selected = {round(r.get_x() + 0.4) for r in patches(ax, "selected")}
        forced = {round(r.get_x() + 0.4) for r in patches(ax, "forced")}
        others = patches(ax, "not-selected")
        assert forced == {self_blk}
        assert selected | forced == set(demo.step.topk_idx[h, 0].tolist())
        assert len(selected) + len(forced) + len(others) == self_blk + 1  # every candidate drawn once
        assert "1" in [t.get_text() for t in ax.texts]  # ranks


def test_sparse_table_pages_and_ctx(demo):
    layer, step = demo.layer, demo.step
    fig = viz.plot_sparse_table(step, layer.block_table, layer.cache.block_page_stride)
    ax = fig.axes[0]
    width = step.sparse_bt.shape[2]
    used = sum(-(-int(c) // PAGE_SIZE) for c in step.sparse_ctx[:, 0])
    assert len(patches(ax, "page")) == used
    assert len(patches(ax, "page-unused")) == 2 * width - used
    ctx_lines = [ln for ln in ax.lines if ln.get_gid() == "ctx"]
    assert sorted(ln.get_xdata()[0] for ln in ctx_lines) == sorted(int(c) / PAGE_SIZE for c in step.sparse_ctx[:, 0])
    labels = [t.get_text() for t in ax.texts]
    self_blk = int(step.query_abs_pos[0]) // SPARSE_BLOCK_SIZE
    assert labels.count(f"b{self_blk}") == 2  # the tail block, in both heads' rows
    with pytest.raises(ValueError, match="row"):
        viz.plot_sparse_table(step, layer.block_table, 16, row=5)


def test_attention_mass_shades_selected_blocks(demo):
    fig = viz.plot_attention_mass(demo)
    for h, ax in enumerate(fig.axes):
        spans = patches(ax, "selected-block")
        assert len(spans) == len(set(demo.step.topk_idx[h, 0].tolist()) - {-1})
        assert "% of the attention weight" in ax.get_title(loc="left")


def test_topk_sweep_and_table():
    layer = msa.synthetic_layer(512, pattern="sink", **SHAPE)
    rows = msa.topk_sweep(layer, (1, 4))
    assert [r["topk"] for r in rows] == [1, 4]
    assert rows[-1]["error"] < 1e-5 and abs(rows[-1]["mass"] - 1) < 1e-5  # 4 blocks = all of them
    assert rows[0]["tokens"] == 128 and rows[0]["context"] == 512
    fig = viz.plot_topk_sweep({"sink": rows})
    assert len(fig.axes) == 2 and len(fig.axes[0].lines) == 1
    text = viz.sweep_table({"sink": rows})
    assert text.splitlines()[1].split()[:3] == ["sink", "1", "128"]


def test_cost_model_plot():
    fig = viz.plot_cost_model([1024, 4096, 1 << 20])
    ax_tok, ax_bytes = fig.axes
    dense, sparse = ax_tok.lines[:2]
    assert list(dense.get_ydata()) == [1024, 4096, 1 << 20]
    assert list(sparse.get_ydata()) == [1024, 2048, 2048]
    assert f"{cost.attention_cost(1 << 20).total_saving:.1f}x" in ax_bytes.get_title(loc="left")


def test_summaries(demo):
    text = viz.layer_summary(demo.layer)
    assert "needle" in text and "packed" in text and "seq_lens [700]" in text
    text = viz.step_summary(demo)
    assert text.startswith("row 0: p = 699, top-3")
    assert f"ctx {int(demo.step.sparse_ctx[0, 0])}" in text


def test_show_msa_prints_and_draws(capsys):
    fig = viz.show_msa(topk=2, context_len=300, layout="dense", pattern="recency")
    out = capsys.readouterr().out
    assert "row 0: p = 299, top-2" in out and "output error vs dense attention" in out
    assert isinstance(fig, Figure) and len(fig.axes) == 2
    assert patches(fig.axes[0], "forced")


def test_msa_widget_redraws_on_change():
    ipywidgets = pytest.importorskip("ipywidgets")
    from mm3lab.widgets.msa import msa_widget

    w = msa_widget(topk=2, context_len=256, layout="packed", pattern="needle")
    assert isinstance(w, ipywidgets.interactive)
    controls = {c.description: c for c in w.children if hasattr(c, "description")}
    assert {"top-k", "context", "layout", "pattern"} <= set(controls)
    first = w.result
    assert isinstance(first, Figure)
    controls["context"].value = 384
    controls["top-k"].value = 3
    second = w.result
    assert second is not first
    assert "context 384, top-3" in second.axes[0].get_title(loc="left")
    controls["layout"].value = "dense"
    assert "dense layout" in w.result.axes[0].get_title(loc="left")
    controls["pattern"].value = "random"
    assert w.result.axes[0].get_title(loc="left").startswith("random")
