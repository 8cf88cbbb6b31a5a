"""One test per defect of the "exact integers, forcing wins, every call checked" rules (SPEC 2 and 7).

The table of bad calls lives in ``tests/test_bad_calls.py``; these are the cases that need
their own set-up: raw-score clamping, int64 -> int32 overflow, the top-k limit, and
zero-width rows.
"""

from __future__ import annotations

import pytest
import torch

import mm3lab
from mm3lab import reference


# --- SPEC 2: raw scores are clamped to [-1e28, 1e28] before forcing ---------------------------


def _huge_score_inputs(value: float, device: str):
    """One request of 3 blocks whose block 0 holds a key with dot ``value`` (or +inf) with the query."""
    di = 16
    index_q = torch.zeros(1, 1, di, device=device)
    index_q[0, 0, 0] = 1.0
    cache = torch.zeros(3, 128, di, device=device)
    cache[0, 5, 0] = value
    block_table = torch.tensor([[0, 1, 2]], dtype=torch.int32, device=device)
    seq_lens = torch.tensor([3 * 128], dtype=torch.int32, device=device)
    return index_q, cache, block_table, seq_lens


@pytest.mark.parametrize("value", [float("inf"), 1e30, 3e38])
@pytest.mark.parametrize("impl", ["kernel", "reference"])
def test_forced_local_block_beats_any_raw_score(value, impl, device):
    if impl == "reference" and device != "cpu":
        pytest.skip("the reference runs on CPU")
    mod = mm3lab if impl == "kernel" else reference
    args = _huge_score_inputs(value, device)
    # topk 1: the forced local block (2) must win over block 0's raw score
    topk = mod.index_topk_decode(*args, 1, 1, 0, 1)
    assert topk.flatten().tolist() == [2]
    scores = mod.index_scores_decode(*args, 1, 0, 1, True)
    f32 = [torch.tensor(x, dtype=torch.float32).item() for x in (1e28, 0.0, 1e29)]
    assert scores[0, 0].tolist() == f32
    # init forcing: block 0 forced 1e30, local 1e29, block 1 raw
    topk = mod.index_topk_decode(*args, 3, 1, 1, 1)
    assert topk.flatten().tolist() == [0, 2, 1]


def test_force_scores_clamps_before_forcing():
    assert reference.force_scores([float("inf"), -float("inf"), 1e30, float("nan"), 5.0], 0, 1) == [
        1e28, -1e28, 1e28, -1e30, 1e29
    ]


@pytest.mark.parametrize("value", [-float("inf"), -1e30])
def test_negative_raw_scores_clamp_to_minus_1e28(value, device):
    scores = mm3lab.index_scores_decode(*_huge_score_inputs(1.0, device), 1, 0, 1, True)
    assert scores.isfinite().all()
    args = _huge_score_inputs(value, device)
    # the key with dot `value` is block 0's only nonzero; other keys dot to 0, so block 0's max is 0
    assert mm3lab.index_scores_decode(*args, 1, 0, 1, True)[0, 0, 0].item() == 0.0


# --- SPEC 7: integers are exact (no int32 truncation or wrap), validation on or off -----------


def _attention_inputs(device, ctx_dtype=torch.int64):
    torch.manual_seed(0)
    q = torch.randn(1, 16, 16, device=device)
    k = torch.randn(8, 16, 1, 16, device=device)
    v = torch.randn(8, 16, 1, 16, device=device)
    bt = torch.arange(8, dtype=torch.int32, device=device).view(1, 1, 8)
    return q, k, v, bt


@pytest.mark.parametrize("ctx", [2**31, 2**32 + 5, 2**40])
def test_int64_sparse_ctx_is_never_truncated(ctx, device):
    q, k, v, bt = _attention_inputs(device)
    full = mm3lab.sparse_attention(q, k, v, bt, torch.tensor([[128]], device=device))
    with pytest.raises(ValueError, match="sparse_ctx"):
        mm3lab.sparse_attention(q, k, v, bt, torch.tensor([[ctx]], device=device))
    with mm3lab.validation(False):  # no check: clamped to the row's pages, never truncated to 5 or 0
        got = mm3lab.sparse_attention(q, k, v, bt, torch.tensor([[ctx]], device=device))
    torch.testing.assert_close(got, full)


@pytest.mark.parametrize("stride", [8, 16])
@pytest.mark.parametrize("fused", [False, True])
def test_page_ids_past_int32_never_wrap(stride, fused, device):
    first_bad = 2**31 // stride  # its page ids start at 2**31
    block_table = torch.tensor([[first_bad - 1, first_bad, 2**40]], dtype=torch.int64, device=device)
    seq_lens = torch.tensor([3 * 128], device=device)
    topk_idx = torch.tensor([[[0, 1, 2]]], dtype=torch.int32, device=device)
    with mm3lab.validation(False):
        if fused:
            scores = torch.tensor([[[3.0, 2.0, 1.0]]], device=device)
            from mm3lab.indexer import _topk

            _, sbt, ctx = _topk(scores, 3, seq_lens, seq_lens, 1, 1, False, block_table, stride)
        else:
            sbt, ctx = mm3lab.build_sparse_block_table_decode(topk_idx, block_table, seq_lens, 1, stride)
        ref_bt, ref_ctx = reference.build_sparse_block_table_decode(topk_idx.cpu(), block_table.cpu(), seq_lens.cpu(), 1, stride)
    good = list(range((first_bad - 1) * stride, (first_bad - 1) * stride + 8))
    row = sbt.flatten().tolist()
    assert row[:8] == good and row[8:] == [-1] * 16  # never wrapped to a negative or small page id
    assert ref_bt.flatten().tolist() == row and ctx.item() == ref_ctx.item() == 384


@pytest.mark.parametrize("entry", ["kernel", "reference"])
def test_page_ids_past_int32_rejected_with_validation(entry):
    mod = mm3lab if entry == "kernel" else reference
    block_table = torch.tensor([[0, 2**27]], dtype=torch.int64)
    topk_idx = torch.tensor([[[0, 1]]], dtype=torch.int32)
    with pytest.raises(ValueError, match="block_table"):
        mod.build_sparse_block_table_decode(topk_idx, block_table, torch.tensor([256]), 1, 16)
    assert mod.build_sparse_block_table_decode(topk_idx, block_table, torch.tensor([256]), 1, 8)[1].item() == 256
