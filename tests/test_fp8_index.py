"""FP8 index cache (SPEC section 9): quantizing insert, FP8 scoring, top-k, fused block table.

Kernel vs reference: the insert stores the same bits; scores agree within
``INDEX_SCORE_FP8_RTOL * max_s sum_d |q_d| |k_sd|``; selected ids agree except where
two reference scores lie within that bound of the selection boundary (a near tie).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mm3lab
from mm3lab import reference as R
from mm3lab.fp8 import FP8_DTYPE, FP8_MAX, INDEX_SCORE_FP8_RTOL, dequantize

FLOATS = [torch.float32, torch.float16, torch.bfloat16]


def _cache(num_blocks, di, device, seed=0, scale_spread=True):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(num_blocks * 128, di, generator=g)
    if scale_spread:
        keys = keys * torch.exp(torch.randn(num_blocks * 128, 1, generator=g))
    cache = mm3lab.allocate_index_cache(num_blocks, di, dtype=FP8_DTYPE, device=device, fill=0.0)
    scale = mm3lab.allocate_index_scale(num_blocks, device=device)
    mm3lab.insert_index_cache(keys.to(device), cache, torch.arange(num_blocks * 128, device=device), index_scale=scale)
    return cache, scale


def _bound(index_q, cache, scale):
    """Per (head, row) score tolerance: RTOL * max_s sum_d |q_d| |k_sd|."""
    keys = dequantize(cache, scale).abs().reshape(-1, cache.shape[-1]).cpu()
    q = index_q.float().abs().cpu()  # [N, H, Di]
    return INDEX_SCORE_FP8_RTOL * (q @ keys.T).amax(-1).T  # [H, N]


def assert_scores_close(got, want, bound):
    got, want = got.cpu(), want.cpu()
    assert torch.equal(torch.isfinite(got), torch.isfinite(want))
    fin = torch.isfinite(want)
    err = torch.where(fin, (got - want).abs(), torch.zeros_like(got))
    assert bool((err <= bound[..., None] + 1e-6).all()), float(err.max())


def assert_ids_match(got, want, forced_scores, bound):
    """Equal selections, except ids swapped at a near tie of the reference's forced scores."""
    got, want, forced_scores = got.cpu(), want.cpu(), forced_scores.cpu()
    h, n, k = want.shape
    for head in range(h):
        for row in range(n):
            a = set(got[head, row].tolist()) - {-1}
            b = set(want[head, row].tolist()) - {-1}
            assert len(a) == len(b)
            if a == b:
                continue
            chosen = [i for i in want[head, row].tolist() if i >= 0]
            edge = float(forced_scores[head, row, chosen[-1]])
            for blk in a ^ b:
                assert abs(float(forced_scores[head, row, blk]) - edge) <= 2 * float(bound[head, row]) + 1e-6


# --- insert ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOATS)
def test_insert_matches_reference_bits(device, dtype):
    g = torch.Generator().manual_seed(1)
    keys = (torch.randn(40, 128, generator=g) * torch.exp(3 * torch.randn(40, 1, generator=g))).to(dtype)
    keys[3] = 0
    slots = torch.randperm(3 * 128, generator=g)[:40]
    slots[7] = -1
    caches = []
    for insert in (mm3lab.insert_index_cache, R.insert_index_cache):
        cache = mm3lab.allocate_index_cache(3, 128, dtype=FP8_DTYPE, device=device, fill=0.0)
        scale = mm3lab.allocate_index_scale(3, device=device, fill=-1.0)
        insert(keys.to(device), cache, slots.to(device), index_scale=scale)
        caches.append((cache.view(torch.uint8).cpu(), scale.cpu()))
    assert torch.equal(caches[0][0], caches[1][0])
    assert torch.equal(caches[0][1], caches[1][1])
    cache_bits, scale = caches[0]
    b, o = divmod(int(slots[3]), 128)
    assert float(scale[b, o]) == 1.0 and int(cache_bits[b, o].sum()) == 0  # zero key: scale 1, zeros stored
    b, o = divmod(int(slots[0]), 128)
    want = keys[0].float().abs().max() / FP8_MAX
    assert float(scale[b, o]) == pytest.approx(float(want), rel=1e-6)
    assert int((scale == -1.0).sum()) == 3 * 128 - 39  # padding wrote nothing


def test_insert_round_trip_error(device):
    keys = torch.randn(128, 64)
    cache = mm3lab.allocate_index_cache(1, 64, dtype=FP8_DTYPE, device=device)
    scale = mm3lab.allocate_index_scale(1, device=device)
    mm3lab.insert_index_cache(keys.to(device), cache, torch.arange(128, device=device), index_scale=scale)
    back = dequantize(cache, scale).cpu()[0]
    amax = keys.abs().amax(-1, keepdim=True)
    assert bool(((back - keys).abs() <= amax * 2.0**-4 + 1e-6).all())  # e4m3: half an ulp of the largest


def test_insert_errors():
    cache = mm3lab.allocate_index_cache(2, 16, dtype=FP8_DTYPE)
    scale = mm3lab.allocate_index_scale(2)
    keys, slots = torch.randn(4, 16), torch.arange(4)
    with pytest.raises(ValueError, match="index_scale"):
        mm3lab.insert_index_cache(keys, cache, slots)
    with pytest.raises(ValueError, match="index_scale"):
        mm3lab.insert_index_cache(keys, cache, slots, index_scale=scale[:1])
    with pytest.raises(TypeError, match="index_scale"):
        mm3lab.insert_index_cache(keys, cache, slots, index_scale=scale.double())
    with pytest.raises(ValueError, match="index_scale"):
        mm3lab.insert_index_cache(keys, torch.zeros(2, 128, 16), slots, index_scale=scale)
    before = (cache.view(torch.uint8).clone(), scale.clone())
    with pytest.raises(ValueError, match="slot_mapping"):
        mm3lab.insert_index_cache(keys, cache, torch.tensor([0, 1, 2, 999]), index_scale=scale)
    assert torch.equal(before[0], cache.view(torch.uint8)) and torch.equal(before[1], scale)
    with pytest.raises(TypeError, match="dtype"):
        mm3lab.allocate_index_cache(2, 16, dtype=torch.float8_e5m2)


# --- scoring and top-k ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("dql", [1, 3])
def test_decode_scores_and_topk(device, dtype, dql):
    nb, di, h = 10, 128, 4
    cache, scale = _cache(nb, di, device, seed=dql)
    g = torch.Generator().manual_seed(7)
    bt = torch.randperm(nb, generator=g)[:9].view(3, 3).int().to(device)
    seq = torch.tensor([300, 129, 2], device=device)
    q = torch.randn(3 * dql, h, di, generator=g).to(dtype).to(device)
    bound = _bound(q, cache, scale)
    raw = mm3lab.index_scores_decode(q, cache, bt, seq, dql, index_scale=scale)
    assert_scores_close(raw, R.index_scores_decode(q, cache, bt, seq, dql, index_scale=scale), bound)
    forced = R.index_scores_decode(q, cache, bt, seq, dql, 1, 1, forced=True, index_scale=scale)
    got = mm3lab.index_topk_decode(q, cache, bt, seq, 2, dql, 1, 1, index_scale=scale)
    want = R.index_topk_decode(q, cache, bt, seq, 2, dql, 1, 1, index_scale=scale)
    assert_ids_match(got, want, forced, bound)
    fused = mm3lab.index_topk_block_table_decode(q, cache, bt, seq, 2, dql, 1, 1, index_scale=scale)
    assert torch.equal(fused[0], got)
    ref_bt = R.build_sparse_block_table_decode(got.cpu(), bt.cpu(), seq.cpu(), dql)
    assert torch.equal(fused[1].cpu(), ref_bt[0]) and torch.equal(fused[2].cpu(), ref_bt[1])


def test_prefill_scores_and_topk(device):
    nb, di, h = 8, 64, 2
    cache, scale = _cache(nb, di, device, seed=3)
    bt = torch.tensor([[3, 1, 6], [0, 7, 2]], dtype=torch.int32, device=device)
    req = torch.tensor([0, 0, 1, 1, 0, 1], device=device)
    pos = torch.tensor([5, 300, 200, -1, 130, 383], device=device)
    q = torch.randn(6, h, di, generator=torch.Generator().manual_seed(2)).to(device)
    bound = _bound(q, cache, scale)
    got = mm3lab.index_scores_prefill(q, cache, bt, req, pos, index_scale=scale)
    assert_scores_close(got, R.index_scores_prefill(q, cache, bt, req, pos, index_scale=scale), bound)
    forced = R.index_scores_prefill(q, cache, bt, req, pos, forced=True, index_scale=scale)
    ids = mm3lab.index_topk_prefill(q, cache, bt, req, pos, 2, index_scale=scale)
    assert_ids_match(ids, R.index_topk_prefill(q, cache, bt, req, pos, 2, index_scale=scale), forced, bound)
    fused = mm3lab.index_topk_block_table_prefill(q, cache, bt, req, pos, 2, block_page_stride=16, index_scale=scale)
    assert torch.equal(fused[0], ids)


@settings(max_examples=20)
@given(
    seed=st.integers(0, 2**16),
    seq=st.lists(st.integers(0, 512), min_size=1, max_size=3),
    heads=st.sampled_from([1, 2, 4]),
    topk=st.integers(1, 5),
)
def test_decode_property(seed, seq, heads, topk):
    nb, di = 12, 32
    cache, scale = _cache(nb, di, "cpu", seed=seed % 5)
    g = torch.Generator().manual_seed(seed)
    b = len(seq)
    bt = torch.randperm(nb, generator=g)[: b * 4].view(b, 4).int()
    seq_lens = torch.tensor(seq)
    q = torch.randn(b, heads, di, generator=g)
    bound = _bound(q, cache, scale)
    forced = R.index_scores_decode(q, cache, bt, seq_lens, forced=True, index_scale=scale)
    got = mm3lab.index_topk_decode(q, cache, bt, seq_lens, topk, index_scale=scale)
    want = R.index_topk_decode(q, cache, bt, seq_lens, topk, index_scale=scale)
    assert_ids_match(got, want, forced, bound)


def test_scoring_errors():
    cache = mm3lab.allocate_index_cache(2, 16, dtype=FP8_DTYPE, fill=0.0)
    scale = mm3lab.allocate_index_scale(2)
    q, bt, seq = torch.randn(1, 1, 16), torch.tensor([[0, 1]]), torch.tensor([5])
    with pytest.raises(ValueError, match="index_scale"):
        mm3lab.index_topk_decode(q, cache, bt, seq, 2)
    with pytest.raises(ValueError, match="index_scale"):
        mm3lab.index_topk_decode(q, torch.zeros(2, 128, 16), bt, seq, 2, index_scale=scale)
    with pytest.raises(ValueError, match="index_scale"):
        R.index_scores_decode(q, cache, bt, seq, index_scale=scale[:, :64])


@pytest.mark.parametrize("heads, dql", [(1, 1), (4, 1), (4, 2), (8, 1)])
def test_fp8_query_parts_in_one_dot_or_two(device, heads, dql):
    """The FP8 query's hi and lo parts side by side in one dot (8 lanes or fewer: the decode default)
    score as the two dots do; forced here both ways for each shape (a tile of 8 heads then holds
    one row, so speculative rows take several tiles)."""
    from mm3lab.indexer.kernel import index_scores_kernel

    g = torch.Generator().manual_seed(heads * 10 + dql)
    cache, scale = _cache(7, 64, device, seed=heads)
    b, m = 2, 3
    q = (torch.randn(b * dql, heads, 64, generator=g) * 3).to(device)
    bt = torch.randperm(7, generator=g)[: b * m].view(b, m).to(torch.int32).to(device)
    seq = torch.tensor([300, 200], dtype=torch.int32, device=device)
    got = []
    for pair in (False, True):
        out = torch.full((heads, b * dql, m), float("nan"), device=device)
        index_scores_kernel(q, cache, bt, seq, seq, dql, False, 0, 1, False, out, index_scale=scale, pair_parts=pair)
        got.append(out.cpu())
    finite = got[0][torch.isfinite(got[0])]
    assert finite.numel() > 0
    torch.testing.assert_close(got[1], got[0], rtol=0, atol=1e-5 * float(finite.abs().max()))
