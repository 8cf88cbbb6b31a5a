"""The layout pictures (mm3lab.viz.layout) and the layout widget: what they draw and print."""

from __future__ import annotations

import pytest
from matplotlib.figure import Figure

import mm3lab
from mm3lab.constants import PAGES_PER_SPARSE_BLOCK
from mm3lab.viz import layout as viz

LAYOUTS = ("dense", "packed")


def patches(ax, gid):
    return [p for p in ax.patches if p.get_gid() == gid]


def texts(ax):
    return [t.get_text() for t in ax.texts]


def patch_xy(p):
    return (int(p.get_x()), int(p.get_y()))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("block", [0, 2])
def test_memory_map_highlights_the_block(layout, block):
    nb = 4
    fig = viz.plot_memory_map(layout, nb, block=block, page=viz.PageShape(num_kv_heads=2))
    assert isinstance(fig, Figure) and len(fig.axes) == 1
    ax = fig.axes[0]
    assert ax.get_title().startswith(f"{layout} layout") and f"block {block}" in ax.get_title()
    cells = [p for p in ax.patches if p.get_gid() is None]
    assert len(cells) == nb * 16  # every storage page drawn once
    outlined = patches(ax, "highlight")
    assert len(outlined) == 2 * PAGES_PER_SPARSE_BLOCK
    # the outlined cells are where locate_page puts the block's K and V pages
    stride = 8 if layout == "dense" else 16
    want = set()
    for j in range(PAGES_PER_SPARSE_BLOCK):
        for view in ("k", "v"):
            s = mm3lab.locate_page(block * stride + j, view, layout, nb).storage_page
            want.add((s % 16, s // 16))
    assert {patch_xy(p) for p in outlined} == want
    labels = texts(ax)
    for j in range(PAGES_PER_SPARSE_BLOCK):
        assert f"K{j}\nid {block * stride + j}" in labels
        assert f"V{j}\nid {block * stride + j}" in labels
    # byte offsets on the y axis follow the head count: 16 tokens * 2 heads * 128 dims * 2 bytes per page
    ticks = [t.get_text() for t in ax.get_yticklabels()]
    assert ticks[1].endswith("@ 128 KiB")


def test_memory_map_orders():
    dense = texts(viz.plot_memory_map("dense", 2, block=1).axes[0])
    packed = texts(viz.plot_memory_map("packed", 2, block=1).axes[0])
    # the 9th storage page: dense -> block 1's K0 (all K first), packed -> block 0's V0
    assert dense[8] == "K0\nid 8"
    assert packed[8] == "b0\nV0"


def test_page_table_text_and_figure_agree():
    text = viz.page_table_text("packed", 4, 1, viz.PageShape(num_kv_heads=4))
    lines = text.splitlines()
    assert len(lines) == 1 + 1 + PAGES_PER_SPARSE_BLOCK
    assert "16384 bytes" in lines[0]
    assert lines[2].split() == ["0", "0-15", "16", "16", "262144", "24", "393216"]
    fig = viz.plot_page_id_table("packed", 4, 1, viz.PageShape(num_kv_heads=4))
    ax = fig.axes[0]
    assert "block 1" in ax.get_title()
    table = ax.tables[0]
    cells = table.get_celld()
    assert cells[0, 2].get_text().get_text() == "page id"
    assert [cells[r, 2].get_text().get_text() for r in range(1, 9)] == [str(16 + j) for j in range(8)]
    assert [cells[r, 5].get_text().get_text() for r in range(1, 9)] == [str(24 + j) for j in range(8)]


def test_page_table_rows_match_locate_page():
    for layout, stride in (("dense", 8), ("packed", 16)):
        for row in viz.page_table(layout, 3, 2, viz.PageShape(num_kv_heads=1, head_dim=8, dtype_bytes=4)):
            assert row.page_id == 2 * stride + row.j
            v = mm3lab.locate_page(row.page_id, "v", layout, 3, viz.page_bytes(1, 8, 4))
            assert (row.v_storage_page, row.v_byte_offset) == (v.storage_page, v.byte_offset)


@pytest.mark.parametrize("layout,offset", [("dense", 32), ("packed", 8)])
def test_kv_views_shows_the_offset(layout, offset):
    fig = viz.plot_kv_views(layout, 4, block=1)
    ax = fig.axes[0]
    assert f"v_cache starts {offset} pages in" in ax.get_title()
    assert viz.view_offset(layout, 4) == offset
    sel_k, sel_v = patches(ax, "selected-k"), patches(ax, "selected-v")
    assert len(sel_k) == len(sel_v) == PAGES_PER_SPARSE_BLOCK
    stride = 8 if layout == "dense" else 16
    k_x = sorted(int(p.get_x()) for p in sel_k)
    v_x = sorted(int(p.get_x()) for p in sel_v)
    assert k_x == [stride + j for j in range(8)]
    assert v_x == [stride + offset + j for j in range(8)]  # the same ids, 'offset' pages later
    assert len(patches(ax, "reached")) == 2 * PAGES_PER_SPARSE_BLOCK
    assert f"(starts at page {offset})" in " ".join(texts(ax))


def test_rebase_text_and_plot():
    text = viz.rebase_text((2, 0, 3), 4)
    assert "entry 0: b=2 t=2 ids 16-23: k_cache -> block 1 K, v_cache -> block 1 V  WRONG" in text
    assert "entry 2: b=3 t=6 ids 48-55: k_cache -> block 3 K, v_cache -> block 3 V  right" in text
    without, with_ = text.split("with rebase_block_table_to_page16")
    assert without.count("WRONG") == 2 and "WRONG" not in with_  # b = 0 is right by accident
    fig = viz.plot_rebase((2, 0, 3), 4)
    top, bottom = fig.axes
    assert "without the rebase" in top.get_title() and "[2, 0, 3]" in top.get_title()
    assert "with the rebase" in bottom.get_title() and "[4, 0, 6]" in bottom.get_title()
    assert len(patches(top, "read-wrong")) == 4 and len(patches(top, "read-ok")) == 2
    assert len(patches(bottom, "read-ok")) == 6 and not patches(bottom, "read-wrong")


def test_rebase_reads_agree_with_the_rebase_function():
    import torch

    bt = torch.tensor([3, 1, 0, 2])
    rebased = mm3lab.rebase_block_table_to_page16(bt).tolist()
    reads = viz.rebase_reads(bt.tolist(), 4, rebased=True)
    assert [r.table_value for r in reads] == rebased
    assert all(r.correct for r in reads)
    assert not any(r.correct for r in viz.rebase_reads([1, 2, 3], 4, rebased=False))


def test_plot_layout_and_show_layout(capsys):
    fig = viz.show_layout("dense", block=3, num_kv_heads=1, num_blocks=4)
    out = capsys.readouterr().out
    assert out.startswith("dense layout, 4 blocks, block 3")
    assert len(fig.axes) == 2
    assert "block 3" in fig.axes[0].get_title() and fig.axes[1].tables


def test_bad_arguments():
    with pytest.raises(ValueError, match="block"):
        viz.plot_memory_map("dense", 4, block=4)
    with pytest.raises(ValueError, match="num_blocks"):
        viz.page_table_text("dense", 0, 0)
    with pytest.raises(ValueError, match="head_dim"):
        viz.PageShape(head_dim=0)
    with pytest.raises(TypeError, match="num_kv_heads"):
        viz.PageShape(num_kv_heads=1.5)
    with pytest.raises(ValueError, match="layout"):
        viz.plot_layout("planes", 4, 0)
    with pytest.raises(ValueError, match="block"):
        viz.rebase_text((9,), 4)


def test_layout_widget_redraws_on_every_control(draw_widget):
    pytest.importorskip("ipywidgets")
    from mm3lab.widgets.layout import layout_widget

    w = layout_widget(num_blocks=4)
    controls, first = draw_widget(w)
    assert set(controls) >= {"layout", "block", "KV heads"}
    assert isinstance(first, Figure) and "packed layout" in first.axes[0].get_title()

    controls["layout"].value = "dense"
    assert w.result is not first and w.result.axes[0].get_title().startswith("dense layout")
    controls["block"].value = 2
    ax = w.result.axes[0]
    assert "block 2" in ax.get_title()
    assert "K0\nid 16" in texts(ax)  # dense: block 2 starts at page id 16
    assert [w.result.axes[1].tables[0].get_celld()[1, 2].get_text().get_text()] == ["16"]
    controls["KV heads"].value = 1
    ticks = [t.get_text() for t in w.result.axes[0].get_yticklabels()]
    assert ticks[1].endswith("@ 64 KiB")  # 16 pages * 16 tokens * 1 head * 128 dims * 2 bytes
    assert controls["block"].max == 3
