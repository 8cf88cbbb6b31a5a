"""Synthetic sequences, the selection analysis, its pictures and the block-selection widget;
the index-cache pictures.

* ``mm3lab.synthetic``: seeded, shapes/dtype/device as asked, each pattern's structure is
  what the indexer finds (needle and sink blocks chosen, recency picks the previous block);
  ``page_sequence`` writes the caches the real way;
* ``mm3lab.indexer.analysis``: a top-k is a prefix of a larger one, full softmax rows sum to 1
  and are causal, all blocks selected capture all the mass, the indexer never beats the oracle;
* ``mm3lab.viz.selection`` / ``mm3lab.widgets.selection``: what is drawn and printed, and the
  widget redrawing on every control;
* ``mm3lab.viz.index_cache``: occupancy read from the cache, the slot tables, the fill steps.
"""

from __future__ import annotations

import pytest
import torch
from matplotlib.figure import Figure

import mm3lab
from mm3lab import synthetic
from mm3lab.constants import SPARSE_BLOCK_SIZE as BLOCK
from mm3lab.indexer import analysis
from mm3lab.viz import index_cache as vi
from mm3lab.viz import selection as vs

SMALL = dict(num_kv_heads=2, num_q_heads=4, index_dim=16, head_dim=16)
SEQ_LEN = 768  # 6 blocks


@pytest.fixture(scope="module")
def sequences():
    return {p: synthetic.make_sequence(p, SEQ_LEN, seed=1, **SMALL) for p in synthetic.PATTERNS}


@pytest.fixture(scope="module")
def selections(sequences):
    return {
        p: analysis.select_for_sequence(s, 6, positions=analysis.default_positions(SEQ_LEN, 24))
        for p, s in sequences.items()
    }


# --- synthetic sequences ----------------------------------------------------------------------


def test_make_sequence_shapes_seed_dtype_device(device):
    a = synthetic.make_sequence("needle", 300, seed=3, dtype=torch.float16, device=device, **SMALL)
    assert a.index_q.shape == (300, 2, 16) and a.index_k.shape == (300, 16)
    assert a.q.shape == (300, 4, 16) and a.k.shape == (300, 2, 16) and a.v.shape == (300, 2, 16)
    assert all(t.dtype == torch.float16 and t.device.type == device for t in (a.index_q, a.index_k, a.q, a.k, a.v))
    assert a.num_blocks == 3 and a.needle_block == 1 and len(a.signal_tokens) == synthetic.SIGNAL_TOKENS
    assert all(BLOCK <= t < 2 * BLOCK for t in a.signal_tokens)
    b = synthetic.make_sequence("needle", 300, seed=3, dtype=torch.float16, device=device, **SMALL)
    c = synthetic.make_sequence("needle", 300, seed=4, dtype=torch.float16, device=device, **SMALL)
    assert torch.equal(a.index_k, b.index_k) and torch.equal(a.q, b.q) and not torch.equal(a.index_k, c.index_k)
    wide = synthetic.make_sequence("recency", 200, num_kv_heads=1, index_dim=8, head_dim=32, seed=0)
    assert wide.q.shape == (200, 4, 32) and wide.needle_block is None and wide.signal_tokens == ()
    assert synthetic.make_sequence("sink", 130, **SMALL).needle_block == 0


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(pattern="zigzag"), "pattern"),
        (dict(seq_len=0), "seq_len"),
        (dict(num_q_heads=3, num_kv_heads=2), "num_q_heads"),
        (dict(needle_block=9), "needle_block"),
    ],
)
def test_make_sequence_rejects_bad_arguments(kwargs, match):
    args = dict(pattern="needle", seq_len=256)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        synthetic.make_sequence(**args)


def test_patterns_have_the_structure_they_promise(sequences, selections):
    second = {p: sel.topk_idx[:, :, 1] for p, sel in selections.items()}  # right after the forced local block
    pos = selections["needle"].positions
    needle = sequences["needle"].needle_block
    after = pos >= (needle + 1) * BLOCK
    assert (second["needle"][:, after] == needle).all()
    beyond_first = pos >= BLOCK
    assert (second["sink"][:, beyond_first] == 0).all()
    recent = (pos // BLOCK - 1).expand_as(second["recency"])
    assert (second["recency"][:, beyond_first] == recent[:, beyond_first]).float().mean() > 0.9
    # local forcing: the query's own block always first
    for sel in selections.values():
        assert torch.equal(sel.topk_idx[:, :, 0], (sel.positions // BLOCK).to(torch.int32).expand(2, -1))


def test_page_sequence_writes_the_caches(device):
    seq = synthetic.make_sequence("sink", 300, seed=2, device=device, **SMALL)
    paged = synthetic.page_sequence(seq, kv_layout="packed", spare_blocks=2, seed=5)
    assert paged.block_table.shape == (1, 3) and paged.index_cache.shape == (5, BLOCK, 16)
    assert len(set(paged.block_table[0].tolist())) == 3 and max(paged.block_table[0].tolist()) < 5
    gathered = paged.index_cache[paged.block_table[0].long()].reshape(-1, 16)
    assert torch.equal(gathered[:300], seq.index_k) and torch.isnan(gathered[300:]).all()
    stride = mm3lab.sparse_block_page_stride(paged.kv.k_cache, paged.kv.v_cache)
    for p in (0, 17, 299):
        page, row = mm3lab.slot_to_page(int(paged.slot_mapping[p]), stride)
        assert torch.equal(paged.kv.k_cache[page, row], seq.k[p]) and torch.equal(paged.kv.v_cache[page, row], seq.v[p])
    assert paged.seq_lens.tolist() == [300]
    # the decode entry point reads the same scores as the analysis' prefill row at the last token
    topk = mm3lab.index_topk_decode(seq.index_q[-1:], paged.index_cache, paged.block_table, paged.seq_lens, 3)
    sel = analysis.select_for_sequence(seq, 3, positions=[299])
    assert torch.equal(topk.cpu(), sel.topk_idx)
    assert synthetic.page_sequence(seq, kv_layout=None).kv is None


# --- the analysis -----------------------------------------------------------------------------


def test_smaller_topk_is_a_prefix(sequences, selections):
    seq, sel = sequences["random"], selections["random"]
    for k in (1, 3):
        rerun = analysis.select_for_sequence(seq, k, positions=sel.positions)
        assert torch.equal(sel.with_topk(k).topk_idx, rerun.topk_idx)
    with pytest.raises(ValueError, match="topk"):
        sel.with_topk(7)


def test_full_attention_and_captured_mass(sequences, selections):
    seq, sel = sequences["needle"], selections["needle"]
    probs = analysis.full_attention(seq, sel.positions)
    assert probs.shape == (4, 24, SEQ_LEN)
    assert torch.allclose(probs.sum(-1), torch.ones(4, 24), atol=1e-5)
    future = torch.arange(SEQ_LEN).view(1, -1) > sel.positions.view(-1, 1)
    assert (probs[:, future] == 0).all()
    everything = analysis.attention_mass_captured(seq, sel, probs)  # top-6 of 6 blocks: every candidate
    assert torch.allclose(everything, torch.ones_like(everything), atol=1e-5)
    one = analysis.attention_mass_captured(seq, sel.with_topk(1), probs)
    own = analysis.block_mass(probs, 6)[:, torch.arange(24), sel.positions // BLOCK]
    assert torch.allclose(one, own, atol=1e-6)  # the local block alone


def test_mass_curve(sequences, selections):
    curves = {p: analysis.mass_curve(s, (1, 2, 4), selection=selections[p]) for p, s in sequences.items()}
    for c in curves.values():
        assert c.topks == (1, 2, 4)
        assert all(a <= b + 1e-6 for a, b in zip(c.indexer, c.oracle, strict=False))
        assert list(c.indexer) == sorted(c.indexer) and 0 < c.indexer[0] <= 1
    assert curves["needle"].indexer[1] > curves["random"].indexer[1] + 0.1
    assert analysis.mass_curve(sequences["sink"], (2,), positions=selections["sink"].positions).indexer[
        0
    ] == pytest.approx(curves["sink"].indexer[1])
    with pytest.raises(ValueError, match="selection"):
        analysis.mass_curve(sequences["sink"], (8,), selection=selections["sink"])
    with pytest.raises(ValueError, match="positions"):
        analysis.select_for_sequence(sequences["sink"], 2, positions=[SEQ_LEN])


# --- the selection pictures -------------------------------------------------------------------


def by_gid(ax, gid):
    return [a for a in ax.get_children() if a.get_gid() == gid]


def test_score_heatmap_marks_selected_forced_and_needle(sequences, selections):
    sel = selections["needle"].with_topk(3)
    fig = vs.plot_score_heatmap(
        sel, head=1, needle_block=sequences["needle"].needle_block, query_position=int(sel.positions[5])
    )
    assert isinstance(fig, Figure)
    ax = fig.axes[0]
    (chosen,) = by_gid(ax, "selected")
    marked = {(int(x), int(y)) for x, y in chosen.get_offsets()}
    want = {(b, t) for t in range(24) for b in sel.topk_idx[1, t].tolist() if b >= 0}
    assert marked == want
    (forced,) = by_gid(ax, "forced")
    assert {(int(x), int(y)) for x, y in forced.get_offsets()} == {
        (int(p) // BLOCK, t) for t, p in enumerate(sel.positions)
    }
    assert len(by_gid(ax, "needle")) == 1 and len(by_gid(ax, "query-row")) == 1
    image = ax.images[0].get_array()
    assert image.mask[0, 1:].all() and not image.mask[-1].any()  # blocks after the query's own are not drawn
    gallery = vs.plot_pattern_gallery([(sequences[p], selections[p]) for p in synthetic.PATTERNS])
    assert [a.get_title().split(" ")[0] for a in gallery.axes] == list(synthetic.PATTERNS)


def test_query_row_text_and_bars(selections):
    sel = selections["sink"].with_topk(3)
    p = int(sel.positions[-1])
    text = vs.selection_text(sel, p, head=0)
    ids = sel.topk_idx[0, -1].tolist()
    assert f"top-3 = {ids}" in text and "forced 1e29" in text
    assert len(text.splitlines()) == 2 + p // BLOCK + 1
    fig = vs.plot_query_scores(sel, p, head=0)
    ax = fig.axes[0]
    assert len(by_gid(ax, "bar-selected")) == 3 and len(by_gid(ax, "bar-other")) == p // BLOCK + 1 - 3
    assert sorted(t.get_text() for t in ax.texts) == ["1", "2", "3"]
    with pytest.raises(ValueError, match="position"):
        vs.selection_text(sel, p - 1)


def test_forcing_effect(sequences):
    seq = sequences["random"]
    text = vs.forcing_text(seq, 700, topk=2, init_blocks=1, local_blocks=1)
    plain = analysis.select_for_sequence(seq, 2, 0, 0, positions=[700]).topk_idx[0, 0].tolist()
    forced = analysis.select_for_sequence(seq, 2, 1, 1, positions=[700]).topk_idx[0, 0].tolist()
    assert forced == [0, 5]  # the init block (1e30) ranks above the local block (1e29)
    assert str(plain) in text and str(forced) in text
    fig = vs.plot_forcing_effect(seq, 700, topk=2, init_blocks=1, local_blocks=1)
    added = {round(p.get_x() + 0.45) for p in by_gid(fig.axes[1], "added")}
    dropped = {round(p.get_x() + 0.45) for p in by_gid(fig.axes[1], "dropped")}
    assert added == set(forced) - set(plain) and dropped == set(plain) - set(forced)


def test_mass_curve_picture_and_text(sequences, selections):
    curves = [analysis.mass_curve(sequences[p], (1, 2), selection=selections[p]) for p in ("needle", "random")]
    fig = vs.plot_mass_curve(curves)
    ax = fig.axes[0]
    assert len(by_gid(ax, "indexer")) == 2 and len(by_gid(ax, "oracle")) == 2
    assert list(by_gid(ax, "indexer")[0].get_ydata()) == list(curves[0].indexer)
    text = vs.mass_text(curves)
    assert f"{curves[0].indexer[1]:7.2f}" in text and text.count("(best possible)") == 2


def test_show_selection_prints_and_draws(capsys):
    fig = vs.show_selection("needle", topk=3, query_position=400, seq_len=512, rows=8)
    out = capsys.readouterr().out
    assert "query at p=400 (block 3)" in out and "attention mass on the selected blocks" in out
    assert len(fig.axes) == 2 and "p=400" in fig.axes[1].get_title()
    assert len(by_gid(fig.axes[0], "query-row")) == 1
    with pytest.raises(ValueError, match="query_position"):
        vs.show_selection("needle", query_position=512, seq_len=512)


def test_selection_widget_redraws_on_every_control(capsys, draw_widget):
    pytest.importorskip("ipywidgets")
    from mm3lab.widgets.selection import selection_widget

    w = selection_widget(seq_len=512, topk=2, query_position=300)
    controls, first = draw_widget(w)
    assert set(controls) == {"pattern", "top-k", "init blocks", "local blocks", "query p", "head"}
    assert isinstance(first, Figure) and "needle: scores and top-2" in first.axes[0].get_title()
    controls["pattern"].value = "sink"
    assert w.result is not first and w.result.axes[0].get_title().startswith("sink")
    controls["top-k"].value = 3
    assert len(by_gid(w.result.axes[1], "bar-selected")) == 3
    controls["query p"].value = 130
    assert "p=130" in w.result.axes[1].get_title() and len(w.result.axes[1].patches) == 2
    controls["init blocks"].value = 1
    controls["local blocks"].value = 0
    assert "query at p=130 (block 1)" in capsys.readouterr().out
    controls["head"].value = 3
    assert "head 3" in w.result.axes[1].get_title()
    assert controls["top-k"].max == 4 and controls["query p"].max == 511


# --- the index-cache pictures -----------------------------------------------------------------


def test_slot_and_shared_tables():
    bt = torch.tensor([[3, 0, 5], [1, 4, 2]])
    text = vi.slot_table_text(bt, torch.tensor([0, 0, 1, 0]), torch.tensor([0, 130, 5, -1]))
    lines = text.splitlines()
    assert "384  = 3 * 128 + 0" in lines[1] and "2  = 0 * 128 + 2" in lines[2] and "padding" in lines[4]
    shared = vi.shared_table_text(bt[0].tolist(), 300, "packed").splitlines()
    assert "block_page_stride 16" in shared[0] and len(shared) == 2 + 3
    assert shared[2].split()[-1] == "48..55" and shared[4].split()[2] == "256-299"
    assert vi.shared_table_text([7], 10, "dense").splitlines()[2].split()[-1] == "56..63"


def test_fill_steps_and_occupancy():
    bt = torch.tensor([[3, 0, 5], [1, 4, 2]])
    steps = vi.simulate_fill(bt, [200, 70], decode_steps=2, num_blocks=7, seed=1)
    assert [s.name for s in steps] == ["prefill", "decode 1", "decode 2"]
    assert steps[0].slot_mapping.tolist()[-1] == -1  # the padded row
    occ = vi.occupancy(steps[-1].index_cache, bt)
    assert (occ == 0).sum() == 202 and (occ == 1).sum() == 72 and (occ >= 0).sum() == 274
    assert (occ[3] == 0).all() and (occ[0, :74] == 0).all() and (occ[0, 74:] == -1).all()
    assert (occ[6] == -1).all()  # the free block
    assert steps[1].slot_mapping.tolist() == [0 * BLOCK + 72, 1 * BLOCK + 70]
    text = vi.fill_text(steps)
    assert text.splitlines()[1].split()[:3] == ["prefill", "271", "1"] and text.splitlines()[-1].endswith("274")
    fig = vi.plot_fill_steps(steps, bt)
    assert len(fig.axes) == 3
    new = [(int(p.get_x() + 0.5), int(p.get_y() + 0.45), int(p.get_width())) for p in by_gid(fig.axes[1], "new")]
    assert sorted(new) == [(70, 1, 1), (72, 0, 1)]
    assert sum(int(p.get_width()) for p in by_gid(fig.axes[0], "new")) == 270
    pic = vi.plot_index_cache(steps[-1].index_cache, bt)
    assert pic.axes[0].images[0].get_gid() == "occupancy"
    labels = [t.get_text() for t in pic.axes[0].get_yticklabels()]
    assert labels[3] == "block 3: req 0, logical 0" and labels[6] == "block 6: free"
    with pytest.raises(ValueError, match="prefill_lens"):
        vi.simulate_fill(bt, [1])
