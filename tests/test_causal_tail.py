"""The causal-tail pictures (mm3lab.viz.causal_tail), the widget and the text explainer:
what they draw and print agrees with the sparse block table reference."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from matplotlib.figure import Figure

from mm3lab import cli
from mm3lab.block_table.reference import attended_tokens, sparse_block_table_row
from mm3lab.explain import explain_sparse_block_table
from mm3lab.viz import causal_tail as viz

TABLE = list(viz.DEMO_BLOCK_TABLE_ROW)


def patches(ax, gid):
    return [p for p in ax.patches if p.get_gid() == gid]


def texts(ax):
    return [t.get_text() for t in ax.texts]


def lines(ax, gid):
    return [ln for ln in ax.lines if ln.get_gid() == gid]


@pytest.mark.parametrize("p", [0, 15, 16, 127, 128, 300])
def test_causal_tail_fills_the_visible_tokens(p):
    fig = viz.plot_causal_tail(p)
    ax = fig.axes[0]
    assert len(patches(ax, "visible")) == p % 128 + 1
    assert len(patches(ax, "hidden")) == 128 - (p % 128 + 1)
    (query,) = patches(ax, "query")
    assert (query.get_x(), query.get_y()) == (p % 16, (p % 128) // 16)  # row within page, page
    assert f"p = {p}: self_blk = {p // 128}" in ax.get_title()


def test_causal_tail_rejects_padded_rows():
    with pytest.raises(ValueError, match="p: a padded row"):
        viz.plot_causal_tail(-1)


@pytest.mark.parametrize("stride", [8, 16])
@pytest.mark.parametrize("topk,p", [([2, 0, 1, -1], 300), ([1, 0, -1], 128), ([0, 3, 0], 200), ([-1, -1], -1)])
def test_sparse_row_draws_the_reference_row(topk, p, stride):
    fig = viz.plot_sparse_row(topk, TABLE, p, stride)
    assert isinstance(fig, Figure) and len(fig.axes) == 2
    ax_row, ax_tok = fig.axes
    row, ctx = sparse_block_table_row(topk, TABLE, p, stride)
    # one cell per entry, labelled with the reference's page id, in order
    cells = sorted(
        (c for c in ax_row.patches if c.get_gid() and c.get_gid().startswith("page-")), key=lambda c: c.get_x()
    )
    assert len(cells) == len(topk) * 8
    labels = [t for t in texts(ax_row) if t.isdigit()]
    assert labels == [str(v) for v in row]
    n_tail = 8 if p >= 0 and (p // 128) in topk else 0
    assert len(patches(ax_row, "page-tail")) == n_tail
    if n_tail:  # the tail is the last used block
        used = [c for c in cells if c.get_gid() != "page-unused"]
        assert all(c.get_gid() == "page-tail" for c in used[-8:])
    (bar,) = lines(ax_row, "ctx")
    assert bar.get_xdata()[0] == ctx / 16
    assert f"ctx = {ctx}" in ax_row.get_title()
    # the token strip's attended segments cover exactly attended_tokens
    attended = sum(int(r.get_width()) for r in ax_tok.patches if r.get_gid() in ("token-attended", "token-tail"))
    assert attended == len(attended_tokens(topk, p)) == ctx


def test_sparse_row_input_errors():
    with pytest.raises(ValueError, match="topk: expected integers"):
        viz.plot_sparse_row("1, x", TABLE, 5)
    with pytest.raises(ValueError, match="block_page_stride"):
        viz.plot_sparse_row([0], TABLE, 5, 12)
    with pytest.raises(ValueError, match="p: position 1024 needs block 8"):
        viz.plot_sparse_row([0], TABLE, 1024)
    assert viz.parse_topk("[3, 0 2,-1]") == [3, 0, 2, -1]


def test_spec_decode_rows_side_by_side():
    fig = viz.plot_spec_decode_rows([1, 0, -1], TABLE, seq_len=129, decode_query_len=3, block_page_stride=16)
    ax_row, ax_tok = fig.axes
    ticks = [t.get_text() for t in ax_row.get_yticklabels()]
    assert ticks == ["row 0: p = 126\nctx = 127", "row 1: p = 127\nctx = 128", "row 2: p = 128\nctx = 129"]
    # rows 0 and 1 have block 0 as their tail; row 2 has block 1 as tail and block 0 full
    assert len(patches(ax_row, "page-tail")) == 3 * 8 and len(patches(ax_row, "page-full")) == 8
    assert len(lines(ax_tok, "query")) == 3
    assert ax_tok.get_xlim() == (126 - 12, 128 + 12)
    padded = viz.plot_spec_decode_rows("0 -1", TABLE, seq_len=2, decode_query_len=4)
    ticks = [t.get_text() for t in padded.axes[0].get_yticklabels()]
    assert ticks[0] == "row 0: p = -2\nctx = 0" and ticks[3] == "row 3: p = 1\nctx = 2"
    with pytest.raises(ValueError, match="topk: expected one selection or 2"):
        viz.plot_spec_decode_rows([[0], [0], [0]], TABLE, 10, 2)


def test_prefill_chunk_staircase():
    start, length = 120, 16
    mask = viz.prefill_mask([1, 0], TABLE, start, length)
    assert mask.shape == (16, 256)
    for i in range(length):
        p = start + i
        assert (mask[i] >= 2).sum() == len(attended_tokens([1, 0], p))
        assert (mask[i, p + 1 :] == 0).all()
    # consecutive tokens in block 0 share it as their tail; from p = 128 block 0 is full, block 1 the tail
    assert (mask[:8, :128] == 3).sum() == sum(p % 128 + 1 for p in range(120, 128))
    assert (mask[8:, :128] == 2).all() and (mask[8:, 128] == 3).all()
    fig = viz.plot_prefill_chunk([1, 0], TABLE, start, length)
    (curve,) = lines(fig.axes[1], "ctx")
    assert list(curve.get_xdata()) == [p + 1 for p in range(120, 136)]
    np.testing.assert_array_equal(fig.axes[0].images[0].get_array(), mask)


def test_show_causal_tail_prints_and_draws(capsys):
    fig = viz.show_causal_tail(300, "2 0 1 -1", 1, 8, TABLE)
    out = capsys.readouterr().out
    assert "ctx = len(full) * 128 + (causal_len - self_blk * 128) = 2 * 128 + (301 - 2 * 128) = 301" in out
    assert len(fig.axes) == 2 and "ctx = 301" in fig.axes[0].get_title()
    fig = viz.show_causal_tail(128, "1 0 -1", 3, 16, TABLE)
    assert "row 2 of 3: p = 128" in capsys.readouterr().out
    assert fig.axes[0].get_title().startswith("seq_len = 129, decode_query_len = 3")


def test_causal_tail_widget_redraws_on_every_control(capsys, draw_widget):
    pytest.importorskip("ipywidgets")
    from mm3lab.widgets.causal_tail import causal_tail_widget

    w = causal_tail_widget()
    controls, first = draw_widget(w)
    assert set(controls) == {"position p", "top-k row", "dql", "stride"}
    assert isinstance(first, Figure) and "p = 300" in first.axes[0].get_title()
    controls["position p"].value = 128
    assert "p = 128 (self_blk = 1)" in w.result.axes[0].get_title()
    controls["top-k row"].value = "1, 0"
    assert "topk = [1, 0]" in w.result.axes[0].get_title() and "ctx = 129" in w.result.axes[0].get_title()
    controls["stride"].value = 16
    labels = [t for t in texts(w.result.axes[0]) if t.isdigit()]
    assert labels[0] == str(TABLE[0] * 16) and labels[8] == str(TABLE[1] * 16)
    controls["dql"].value = 3
    assert w.result.axes[0].get_title().startswith("seq_len = 129, decode_query_len = 3")
    assert "row 0 of 3: p = 126" in capsys.readouterr().out
    controls["top-k row"].value = "1 zero"
    assert w.result is None and "cannot build this row: topk" in capsys.readouterr().out
    controls["top-k row"].value = "9"  # past the 8-block demo table
    assert w.result is None and "past the block table" in capsys.readouterr().out
    assert controls["position p"].max == len(TABLE) * 128 - 1


# --- the text explainer and `mm3lab explain` --------------------------------------------------


def test_explain_worked_example():
    text = explain_sparse_block_table([1, 0, -1], [5, 7], 129)
    assert "self_blk = p // 128 = 1" in text
    assert "     0      0         5        40..47         0..127  full (128 tokens), topk[1]" in text
    assert "     1      1         7        56..63       128..128  tail (1 of 128 tokens), topk[0]" in text
    assert "     2      -         -         0 x 8              -  unused" in text
    assert "dropped: topk[2] = -1 (padding)" in text
    assert text.rstrip().endswith("attended tokens: 0..127, 128..128")
    assert "= 1 * 128 + (129 - 1 * 128) = 129" in text


def test_explain_duplicates_padding_and_no_tail():
    text = explain_sparse_block_table([2, 0, 2], [5, 7, 9], 300, 16)
    assert "dropped: topk[2] = 2 (duplicate)" in text and "144..151" in text  # 9 * 16
    text = explain_sparse_block_table([0], [5, 7], 200)
    assert "ctx = len(full) * 128 = 1 * 128 = 128   (own block 1 not selected: no tail)" in text
    text = explain_sparse_block_table([0], [5], 1, decode_query_len=2)
    assert "row 0 of 2: p = -1" in text and "padded row (p < 0)" in text
    text = explain_sparse_block_table([[0], [1]], [5, 6], 129, decode_query_len=2)
    assert "selection topk = [0]" in text and "selection topk = [1]" in text


def test_cli_explain(capsys):
    assert (
        cli.main(["explain", "--topk", "1", "0", "-1", "--block-table", "5", "7", "--seq-len", "129", "--stride", "16"])
        == 0
    )
    out = capsys.readouterr().out
    assert "80..87" in out and "112..119" in out and "= 129" in out
    assert cli.main(["explain", "--topk", "1", "0", "--block-table", "5", "--seq-len", "129"]) == 2
    assert "seq_lens: request 0 has seq_len 129" in capsys.readouterr().err
    assert cli.main(["explain", "--topk", "0", "--block-table", "5", "7", "--seq-len", "130", "--dql", "2"]) == 0
    assert "row 1 of 2: p = 129" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["explain", "--topk", "0", "--block-table", "5", "--seq-len", "3", "--stride", "4"])


def test_cli_explain_as_a_command():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "mm3lab",
            "explain",
            "--topk",
            "0",
            "1",
            "2",
            "--block-table",
            "5",
            "6",
            "7",
            "0",
            "--seq-len",
            "300",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "40..63" not in out.stdout and "72..79" not in out.stdout and "56..63" in out.stdout
    assert "= 2 * 128 + (300 - 2 * 128) = 300" in out.stdout
