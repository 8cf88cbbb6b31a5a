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
        1e28,
        -1e28,
        1e28,
        -1e30,
        1e29,
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


@pytest.mark.parametrize("algorithm", ["rows", "tiled"])
@pytest.mark.parametrize("ctx", [2**31, 2**32 + 5, 2**40])
def test_int64_sparse_ctx_is_never_truncated(ctx, algorithm, device):
    q, k, v, bt = _attention_inputs(device)
    full = mm3lab.sparse_attention(q, k, v, bt, torch.tensor([[128]], device=device), algorithm=algorithm)
    with pytest.raises(ValueError, match="sparse_ctx"):
        mm3lab.sparse_attention(q, k, v, bt, torch.tensor([[ctx]], device=device), algorithm=algorithm)
    with mm3lab.validation(False):  # no check: clamped to the row's pages, never truncated to 5 or 0
        got = mm3lab.sparse_attention(q, k, v, bt, torch.tensor([[ctx]], device=device), algorithm=algorithm)
        if algorithm == "tiled":
            from mm3lab.attention import tiled

            for mode in ("union", "rows"):
                out = torch.empty_like(q)
                sctx = torch.tensor([[ctx]], device=device)
                tiled.tiled_attention_kernel(q, k, v, bt, sctx, 16**-0.5, out, None, mode=mode, prepass="kernel")
                torch.testing.assert_close(out, full)
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
        ref_bt, ref_ctx = reference.build_sparse_block_table_decode(
            topk_idx.cpu(), block_table.cpu(), seq_lens.cpu(), 1, stride
        )
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


# --- top-k: up to 8192, the fused path to 512, a clear error past the limit --------------------


def _one_request(device, blocks=3):
    index_q = torch.randn(1, 1, 16, generator=torch.Generator().manual_seed(1)).to(device)
    cache = torch.randn(blocks, 128, 16, generator=torch.Generator().manual_seed(2)).to(device)
    block_table = torch.arange(blocks, dtype=torch.int32, device=device).view(1, blocks)
    seq_lens = torch.tensor([blocks * 128], dtype=torch.int32, device=device)
    return index_q, cache, block_table, seq_lens


@pytest.mark.parametrize("topk", [512, 513, 1025, 8192])
def test_topk_up_to_8192_matches_the_reference(topk, device):
    args = _one_request(device)
    got = mm3lab.index_topk_block_table_decode(*args, topk)
    want = reference.index_topk_block_table_decode(*(a.cpu() for a in args), topk)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.cpu(), w)
    assert got[0].shape == (1, 1, topk) and got[0][0, 0, 3:].eq(-1).all()


@pytest.mark.parametrize("entry", ["kernel", "reference"])
def test_topk_past_8192_states_the_limit(entry):
    mod = mm3lab if entry == "kernel" else reference
    with pytest.raises(ValueError, match=r"topk: expected an int in \[1, 8192\], got 8193"):
        mod.index_topk_block_table_decode(*_one_request("cpu"), 8193)
    with pytest.raises(ValueError, match="8192"):
        mod.topk_blocks(torch.zeros(2, 3), 8193)


@pytest.mark.parametrize("fn", [mm3lab.topk_blocks, reference.topk_blocks])
def test_topk_blocks_on_zero_width_rows(fn, device):
    assert fn(torch.zeros(2, 0, device=device), 2).tolist() == [[-1, -1], [-1, -1]]
    assert fn(torch.zeros(0, 4, device=device), 2).shape == (0, 2)


# --- token_slots never wraps request -1 (validation off) ----------------------------------------


@pytest.mark.parametrize("fn", [mm3lab.token_slots, reference.token_slots])
def test_token_slots_request_minus_one_is_padding_not_the_last_request(fn):
    block_table = torch.tensor([[0, 1], [2, 3]])
    with mm3lab.validation(False):
        slots = fn(block_table, torch.tensor([-1, 2, 1, 1]), torch.tensor([5, 5, 5, 300]))
    assert slots.tolist() == [-1, -1, 2 * 128 + 5, -1]
    with pytest.raises(ValueError, match="query_req_id"):
        fn(block_table, torch.tensor([-1]), torch.tensor([5]))


# --- rebase: an id whose double does not fit is rejected, validation on or off -------------------


@pytest.mark.parametrize("on", [True, False])
def test_rebase_overflow_rejected_whatever_the_validation(on):
    with mm3lab.validation(on):
        with pytest.raises(ValueError, match="block_table"):
            mm3lab.rebase_block_table_to_page16(torch.tensor([2**30], dtype=torch.int32))
        with pytest.raises(ValueError, match="slots"):
            mm3lab.rebase_slot_mapping_to_page16(torch.tensor([2**30], dtype=torch.int32))
    edge = torch.tensor([2**30 - 1, -(2**30)], dtype=torch.int32)
    assert mm3lab.rebase_block_table_to_page16(edge).tolist() == [2**31 - 2, -(2**31)]


# --- layout helpers: every argument checked -----------------------------------------------------


@pytest.mark.parametrize(
    ("call", "exc", "name"),
    [
        (lambda: mm3lab.allocate_kv_cache(True, 1, 16), TypeError, "num_blocks"),
        (lambda: mm3lab.allocate_kv_cache(2, 1, 16, device="cuda:99"), ValueError, "device"),
        (lambda: mm3lab.allocate_kv_cache(2**27, 1, 16), ValueError, "num_blocks"),
        (lambda: mm3lab.allocate_kv_cache(2, 1, 16, layout=1), TypeError, "layout"),
        (lambda: mm3lab.allocate_kv_cache(2, 1, 16, fill="0"), TypeError, "fill"),
        (lambda: mm3lab.allocate_index_cache(2, 16, device="cuda:99"), ValueError, "device"),
        (lambda: mm3lab.locate_page(1.5, "k", "dense", 2), TypeError, "page_id"),
        (lambda: mm3lab.locate_page(True, "k", "dense", 2), TypeError, "page_id"),
        (lambda: mm3lab.locate_page(1, "k", "dense", 2.5), TypeError, "num_blocks"),
        (lambda: mm3lab.locate_page(1, "k", "dense", 0), ValueError, "num_blocks"),
        (lambda: mm3lab.locate_page(1, "k", "dense", 2, -1), ValueError, "page_bytes"),
        (lambda: mm3lab.locate_page(1, "x", "dense", 2), ValueError, "view"),
        (lambda: mm3lab.page_ids_of_block(True, 8), TypeError, "block"),
        (lambda: mm3lab.page_ids_of_block(1, 8.0), TypeError, "block_page_stride"),
        (lambda: mm3lab.slot_to_page(1.0, 8), TypeError, "slot"),
    ],
)
def test_layout_helper_arguments(call, exc, name):
    with pytest.raises(exc, match=name):
        call()


def test_cuda_without_a_gpu_is_a_value_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ValueError, match="no CUDA GPU"):
        mm3lab.allocate_kv_cache(2, 1, 16, device="cuda")


@pytest.mark.parametrize("fill", [0.0, float("nan")])
def test_sides_are_packed_checks_the_whole_pair(fill):
    cache = mm3lab.allocate_kv_cache(3, 1, 16, "packed", fill=fill)
    assert mm3lab.sides_are_packed(cache.k_cache, cache.v_cache)
    with pytest.raises(ValueError, match="v_cache"):
        mm3lab.sides_are_packed(cache.k_cache, torch.zeros(40, 8, 1, 16))
    with pytest.raises(TypeError, match="v_cache"):
        mm3lab.sparse_block_page_stride(cache.k_cache, cache.v_cache.half())


# --- the CLI: a clear message, exit status 2, never a Python overflow ---------------------------


@pytest.mark.parametrize(
    ("extra", "name"),
    [
        (["--dql", "0"], "decode_query_len"),
        (["--dql", str(2**70)], "decode_query_len"),
        (["--seq-len", str(2**70)], "seq_len"),
        (["--topk", str(2**70)], "topk"),
        (["--block-table", "5", str(2**31)], "block_table"),
        (["--block-table", "5", str(2**70)], "block_table"),
        (["--block-table", "5", str(2**27), "--block-page-stride", "16"], "block_table"),
        (["--topk", "7"], "topk"),
    ],
)
def test_explain_rejects_with_the_argument_named(extra, name, capsys):
    from mm3lab.cli import main

    base = ["explain", "--topk", "1", "0", "--block-table", "5", "7", "--seq-len", "200"]
    assert main(base + extra) == 2
    err = capsys.readouterr().err
    assert name in err and "Overflow" not in err


# --- the widgets' plain functions -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "exc", "name"),
    [
        (lambda v: v.causal_tail.show_causal_tail(position=True), TypeError, "position"),
        (lambda v: v.causal_tail.show_causal_tail(decode_query_len=0), ValueError, "decode_query_len"),
        (lambda v: v.causal_tail.show_causal_tail(block_page_stride=12), ValueError, "block_page_stride"),
        (lambda v: v.layout.show_layout(layout="both"), ValueError, "layout"),
        (lambda v: v.layout.show_layout(num_blocks=1.5), TypeError, "num_blocks"),
        (lambda v: v.selection.show_selection(topk=0), ValueError, "topk"),
        (lambda v: v.selection.show_selection(topk=2.0), TypeError, "topk"),
        (lambda v: v.msa.show_msa(topk=True), TypeError, "topk"),
        (lambda v: v.msa.show_msa(layout="x"), ValueError, "layout"),
    ],
)
def test_widget_functions_reject_bad_arguments(call, exc, name):
    import matplotlib

    matplotlib.use("Agg")
    import mm3lab.viz.causal_tail
    import mm3lab.viz.layout
    import mm3lab.viz.msa
    import mm3lab.viz.selection

    with pytest.raises(exc, match=name):
        call(mm3lab.viz)
