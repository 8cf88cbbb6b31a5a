"""The prefill-tile picture: counts and bytes from a hand-checked selection, and what the figure draws."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import numpy as np
import torch

from mm3lab.viz import prefill


def _selection():
    # 4 rows at positions 126..129 (block 0 then block 1), top-k 2, tiles of 2 rows
    pos = torch.tensor([126, 127, 128, 129])
    topk = torch.tensor([[[0, -1], [0, 0], [1, 0], [1, -1]]], dtype=torch.int32)
    return topk, pos


def test_counts_and_visible_tokens():
    topk, pos = _selection()
    vis = prefill.visible_tokens(topk, pos)
    assert vis.tolist() == [[127, 0], [128, 0], [128, 1], [0, 2]]  # duplicate counted once
    assert prefill.tile_block_counts(topk, pos, tile=2).tolist() == [[2, 0], [1, 2]]


def test_bytes_per_tile():
    topk, pos = _selection()
    per_token, tiled = prefill.bytes_per_tile(topk, pos, tile=2, head_dim=4, elem_bytes=1)
    token = 2 * 4
    assert per_token.tolist() == [(127 + 128) * token, (129 + 2) * token]
    assert tiled.tolist() == [128 * token, (128 + 2) * token]
    assert np.all(tiled <= per_token)


def test_padded_rows_and_shared_tiles():
    pos = torch.tensor([300, 301, -1])
    topk = torch.tensor([[[2, 0], [0, 2], [1, 2]]], dtype=torch.int32)
    counts = prefill.tile_block_counts(topk, pos, tile=4)
    assert counts.tolist() == [[2, 0, 2]]


def test_figure_draws_both_panels():
    topk, pos = _selection()
    fig = prefill.plot_prefill_tiles(topk, pos, tile=2)
    gids = {a.get_gid() for ax in fig.axes for a in ax.get_children()}
    assert {"tile-counts", "bytes-per-token", "bytes-tiled"} <= gids


def test_example_selections_and_text():
    shares = {}
    for kind in prefill.SELECTIONS:
        topk, pos = prefill.example_selection(kind, chunk=256, context=4096, hkv=2)
        assert topk.shape == (2, 256, 16)
        assert (topk.long() <= (pos // 128)[None, :, None]).all()  # causal: the scores rule out later blocks
        assert (topk == (pos // 128).view(1, -1, 1).to(torch.int32)).any(-1).all()  # the own block always
        per_token, tiled = prefill.bytes_per_tile(topk, pos)
        shares[kind] = per_token.sum() / tiled.sum()
    assert shares["tile"] > shares["synthetic"] > shares["random"] >= 1
    text = prefill.bytes_text(*prefill.example_selection("tile", chunk=256, context=4096, hkv=1))
    assert text.startswith("K+V read by the chunk: per-token kernel") and "x less" in text
