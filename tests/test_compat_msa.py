"""mm3lab selections <-> the official MiniMax MSA ``topk_indices``, on worked cases."""

from __future__ import annotations

import pytest
import torch

import mm3lab
from mm3lab.compat import msa


def test_worked_case_decode():
    # B = 2 requests, q_len = 2, H = 1 head, K = 3.
    # request 0: seq_len 300 -> rows at p = 298, 299 (local block 2, 3 candidates);
    # request 1: seq_len 129 -> rows at p = 127 (local 0, 1 candidate) and 128 (local 1, 2 candidates).
    topk_idx = torch.tensor([[[2, 0, 1], [2, 1, 0], [0, -1, -1], [1, 0, -1]]], dtype=torch.int32)
    seq_lens = torch.tensor([300, 129])
    got = msa.to_msa_topk_indices(topk_idx, seq_lens, q_len=2)
    want = torch.tensor([[[0, 1, 2]], [[1, 0, 2]], [[0, -1, -1]], [[0, 1, -1]]], dtype=torch.int32)
    assert torch.equal(got, want)
    back = msa.from_msa_topk_indices(got)
    assert torch.equal(back, topk_idx)  # local first, historical order kept
    assert bool(msa.same_selection(back, topk_idx).all())


def test_positions_and_padding():
    assert msa.decode_positions(torch.tensor([5, 130]), 3).tolist() == [2, 3, 4, 127, 128, 129]
    # a padded mm3lab row (p < 0) becomes all -1
    got = msa.to_msa_topk_indices(torch.tensor([[[-1, -1]]], dtype=torch.int32), torch.tensor([0]), 1)
    assert got.tolist() == [[[-1, -1]]]


def test_official_contract_on_indexer_output():
    """mm3lab's own selections satisfy every rule the official plan() checks."""
    torch.manual_seed(0)
    nb, di, h, q_len = 12, 32, 2, 2
    cache = mm3lab.allocate_index_cache(nb, di, fill=0.0)
    mm3lab.insert_index_cache(torch.randn(nb * 128, di), cache, torch.arange(nb * 128))
    bt = torch.randperm(nb)[:12].view(3, 4).int()
    seq_lens = torch.tensor([512, 200, 2])
    q = torch.randn(3 * q_len, h, di)
    topk_idx = mm3lab.index_topk_decode(q, cache, bt, seq_lens, 3, q_len)
    off = msa.to_msa_topk_indices(topk_idx, seq_lens, q_len)
    p = msa.decode_positions(seq_lens, q_len)
    local = p // 128
    valid = torch.clamp(local + 1, max=3)
    for n in range(off.shape[0]):
        for head in range(h):
            row = off[n, head].tolist()
            v = int(valid[n])
            assert all(x >= 0 for x in row[:v]) and all(x == -1 for x in row[v:])
            assert row[v - 1] == int(local[n])
            assert all(x < int(local[n]) for x in row[: v - 1]) and len(set(row[:v])) == v
    assert torch.equal(msa.from_msa_topk_indices(off), topk_idx)


def test_errors():
    with pytest.raises(ValueError, match="at most 16"):
        msa.to_msa_topk_indices(torch.zeros(1, 1, 17, dtype=torch.int32), torch.tensor([5000]), 1)
    with pytest.raises(ValueError, match="rows"):
        msa.to_msa_topk_indices(torch.zeros(1, 2, 1, dtype=torch.int32), torch.tensor([5]), 1)
    with pytest.raises(ValueError, match="selects 1 blocks"):
        msa.to_msa_topk_indices(torch.tensor([[[1, -1]]], dtype=torch.int32), torch.tensor([300]), 1)
    with pytest.raises(ValueError, match="local block"):
        msa.to_msa_topk_indices(torch.tensor([[[0, 1]]], dtype=torch.int32), torch.tensor([300]), 1)
    with pytest.raises(TypeError):
        msa.from_msa_topk_indices(torch.zeros(1, 1, 1))
