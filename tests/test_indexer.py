"""The indexer (SPEC section 2, steps 2-3): kernels against the reference.

* a worked example whose scores are known by hand: causal visibility inside a block,
  init/local forcing (local last), ties to the lower block id, ``-1`` past the candidates;
* NaN scores (kept raw, ranked as ``-1e30``), ``-inf`` candidates, padded rows;
* hypothesis sweeps of decode / speculative decode / prefill on integer-valued inputs
  (dot products exact, ties real): kernel == torch backend == reference exactly, for the
  scores, the top-k and the top-k fused with the sparse block table (also == the two
  steps apart); outputs poisoned; caches poisoned with NaN past every written token;
* every kernel code path on small shapes: split over block chunks, several row tiles
  per request, prefill tiles that mix requests, top-k rows read in chunks;
* random float inputs: scores within a stated tolerance;
* bad input raises naming the argument; validation off: the defined fallback, no
  out-of-bounds access;
* on CUDA: bf16, head dim 128, 64K and 1M-token contexts.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mm3lab
from mm3lab import indexer, reference
from mm3lab.constants import INIT_SCORE, LOCAL_SCORE, NAN_SCORE
from mm3lab.constants import SPARSE_BLOCK_SIZE as BLOCK
from mm3lab.indexer import reference as indexer_reference
from mm3lab.indexer.kernel import index_scores_kernel, topk_kernel
from mm3lab.testing import assert_close, assert_equal_int, assert_paths_agree, assert_same, poison, run_paths

SCORE_ATOL, SCORE_RTOL = 1e-3, 1e-4
"""Float scores: |kernel - reference| <= atol + rtol * |reference| (sums of Di float32 products
in a different order)."""


# --- building problems ----------------------------------------------------------------------


def make_cache(gen, num_blocks, di, dtype, device, values):
    """An index cache of integers in ``[-values, values]`` (``values=None``: standard normal)."""
    if values is None:
        cache = torch.randn(num_blocks, BLOCK, di, generator=gen)
    else:
        cache = torch.randint(-values, values + 1, (num_blocks, BLOCK, di), generator=gen).float()
    return cache.to(dtype).to(device)


def make_table(gen, b, m, num_blocks, dtype, device):
    return torch.randperm(num_blocks, generator=gen)[: b * m].view(b, m).to(dtype).to(device)


def poison_unwritten(cache, block_table, written):
    """NaN into every slot of request ``r`` at or past ``written[r]`` and into every unused block."""
    used = torch.zeros(cache.shape[0], BLOCK, dtype=torch.bool)
    for r, length in enumerate(written):
        for blk, physical in enumerate(block_table[r].tolist()):
            start = blk * BLOCK
            visible = max(0, min(BLOCK, length - start))
            used[physical, :visible] = True
    cache[~used.to(cache.device)] = float("nan")
    return cache


def make_index_q(gen, n, h, di, dtype, device, values, strided):
    shape = (h, n, di) if strided else (n, h, di)
    if values is None:
        q = torch.randn(shape, generator=gen)
    else:
        q = torch.randint(-values, values + 1, shape, generator=gen)
    q = q.to(dtype).to(device)
    return q.transpose(0, 1) if strided else q


def decode_problem(
    gen,
    *,
    b,
    m,
    h,
    di,
    dql,
    seq_lens,
    dtype=torch.float32,
    device="cpu",
    values=2,
    idx_dtype=torch.int64,
    strided=False,
    spare_blocks=1,
):
    num_blocks = b * m + spare_blocks
    cache = make_cache(gen, num_blocks, di, dtype, device, values)
    bt = make_table(gen, b, m, num_blocks, idx_dtype, device)
    poison_unwritten(cache, bt.cpu(), seq_lens)
    q = make_index_q(gen, b * dql, h, di, dtype, device, values, strided)
    return q, cache, bt, torch.tensor(seq_lens, dtype=idx_dtype, device=device)


def prefill_problem(
    gen, *, b, m, h, di, req, pos, dtype=torch.float32, device="cpu", values=2, idx_dtype=torch.int64, strided=False
):
    num_blocks = b * m + 1
    cache = make_cache(gen, num_blocks, di, dtype, device, values)
    bt = make_table(gen, b, m, num_blocks, idx_dtype, device)
    written = [0] * b
    for r, p in zip(req, pos, strict=False):
        if 0 <= r < b:
            written[r] = max(written[r], p + 1)
    poison_unwritten(cache, bt.cpu(), written)
    q = make_index_q(gen, len(req), h, di, dtype, device, values, strided)
    as_t = lambda x: torch.tensor(x, dtype=idx_dtype, device=device)  # noqa: E731
    return q, cache, bt, as_t(req), as_t(pos)


# --- running every path ---------------------------------------------------------------------


def assert_same_scores(actual, expected, name="scores"):
    assert_same(actual, expected, name)  # exact: inf equals inf and NaN equals NaN


def index_every_path(kind, args, topk, init_blocks, local_blocks, extra=(), block_page_stride=8):
    """Scores (raw and forced), top-k and fused top-k + block table through every path
    (:func:`mm3lab.testing.run_paths`): integers equal exactly; scores equal exactly (integer
    inputs); the fused launch equals the top-k and block table run apart."""
    decode = kind == "decode"
    scores_fn = indexer.index_scores_decode if decode else indexer.index_scores_prefill
    topk_fn = indexer.index_topk_decode if decode else indexer.index_topk_prefill
    fused_fn = indexer.index_topk_block_table_decode if decode else indexer.index_topk_block_table_prefill
    table_fn = mm3lab.build_sparse_block_table_decode if decode else mm3lab.build_sparse_block_table_prefill
    # extra: decode -> (decode_query_len,), prefill -> ()
    topk_args = args + (topk,) + extra + (init_blocks, local_blocks)
    score_args = args + extra + (init_blocks, local_blocks)
    results = {}
    for forced in (False, True):
        got = run_paths(scores_fn, lambda forced=forced: (score_args, {"forced": forced}))
        assert all(t.dtype == torch.float32 and t.is_contiguous() for t in got.values())
        assert_paths_agree(got, f"scores forced={forced}")
        results[f"scores{int(forced)}"] = got["reference"]
    got = run_paths(topk_fn, lambda: (topk_args, {}))
    assert all(t.dtype == torch.int32 and t.is_contiguous() for t in got.values())
    assert_paths_agree(got, "topk_idx")
    results["topk"] = got["reference"]
    table_args = args[2:]  # block_table, seq_lens | block_table, query_req_id, query_abs_pos
    fused = run_paths(fused_fn, lambda: (topk_args, {"block_page_stride": block_page_stride}))
    assert all(t.dtype == torch.int32 and t.is_contiguous() for f in fused.values() for t in f)
    fused["apart"] = (got["kernel"], *table_fn(got["kernel"], *table_args, *extra, block_page_stride=block_page_stride))
    assert_paths_agree(fused, "fused (topk_idx, sparse_bt, sparse_ctx)", against="apart")
    return results


# --- the worked example ---------------------------------------------------------------------


def worked_problem(device, dtype=torch.float32):
    """Request 0 has 300 tokens in physical blocks [2, 0, 1]; head 0 reads dim 0, head 1 dim 1.

    dim 0 values: token 3 -> 5 (block 0), token 200 -> 9 (block 1), token 270 -> 7 and
    token 290 -> 10 (block 2), else 0. dim 1: 4 at the first token of each block, else 0
    (every block ties).
    """
    di = 16
    cache = torch.zeros(3, BLOCK, di)
    bt = torch.tensor([[2, 0, 1]])
    keys = torch.zeros(3 * BLOCK, di)
    for s, v in ((3, 5), (200, 9), (270, 7), (290, 10)):
        keys[s, 0] = v
    keys[[0, 128, 256], 1] = 4
    keys[300:] = float("nan")  # never written
    for blk in range(3):
        cache[bt[0, blk]] = keys[blk * BLOCK : (blk + 1) * BLOCK]
    q = torch.zeros(4, 2, di)
    q[:, 0, 0] = 1
    q[:, 1, 1] = 1
    req = torch.tensor([0, 0, 0, 0])
    pos = torch.tensor([299, 260, 5, -1])
    to = lambda t: t.to(device)  # noqa: E731
    return to(q.to(dtype)), to(cache.to(dtype)), to(bt), to(req), to(pos)


def test_worked_example(device):
    q, cache, bt, req, pos = worked_problem(device)
    inf = float("inf")
    raw = indexer.index_scores_prefill(q, cache, bt, req, pos)
    assert raw[0].tolist() == [[5, 9, 10], [5, 9, 0], [5, -inf, -inf], [-inf, -inf, -inf]]
    assert raw[1].tolist() == [[4, 4, 4], [4, 4, 4], [4, -inf, -inf], [-inf, -inf, -inf]]
    forced = indexer.index_scores_prefill(q, cache, bt, req, pos, forced=True)
    local = torch.tensor(LOCAL_SCORE).item()
    assert forced[0].tolist() == [[5, 9, local], [5, 9, local], [local, -inf, -inf], [-inf] * 3]
    topk = indexer.index_topk_prefill(q, cache, bt, req, pos, 5)
    assert topk[0].tolist() == [[2, 1, 0, -1, -1], [2, 1, 0, -1, -1], [0, -1, -1, -1, -1], [-1] * 5]
    assert topk[1].tolist() == [[2, 0, 1, -1, -1], [2, 0, 1, -1, -1], [0, -1, -1, -1, -1], [-1] * 5]
    # no forcing: plain scores, ties to the lower block id
    plain = indexer.index_topk_prefill(q, cache, bt, req, pos, 2, 0, 0)
    assert plain[0].tolist() == [[2, 1], [1, 0], [0, -1], [-1, -1]]
    assert plain[1].tolist() == [[0, 1], [0, 1], [0, -1], [-1, -1]]
    # init and local overlap: the local score wins (local is applied last)
    both = indexer.index_scores_prefill(q, cache, bt, req, pos, 1, 2, forced=True)
    init = torch.tensor(INIT_SCORE).item()
    assert both[0, 0].tolist() == [init, local, local] and both[0, 2].tolist() == [local, -inf, -inf]
    assert indexer.index_topk_prefill(q, cache, bt, req, pos, 3, 1, 2)[0, 0].tolist() == [0, 1, 2]
    # the decode rows of the same request (dql 2: p = 298, 299) agree with prefill at those positions
    dq = torch.stack([q[0], q[0]])
    got = indexer.index_topk_decode(dq, cache, bt, torch.tensor([300], device=device), 3, 2)
    assert got[0].tolist() == [[2, 1, 0], [2, 1, 0]]
    index_every_path("prefill", (q, cache, bt, req, pos), 5, 1, 1)


def test_nan_scores_rank_as_minus_1e30(device):
    q, cache, bt, req, pos = worked_problem(device)
    cache[bt[0, 1], 10, 0] = float("nan")  # a visible token of block 1 for the first two rows
    raw = indexer.index_scores_prefill(q, cache, bt, req, pos)
    assert torch.isnan(raw[0, 0, 1]) and torch.isnan(raw[0, 1, 1]) and raw[0, 0, 0] == 5
    forced = indexer.index_scores_prefill(q, cache, bt, req, pos, forced=True)
    assert forced[0, 0, 1].item() == torch.tensor(NAN_SCORE).item()
    # the NaN block ranks below every finite score but is still a candidate
    assert indexer.index_topk_prefill(q, cache, bt, req, pos, 4)[0, 0].tolist() == [2, 0, 1, -1]
    index_every_path("prefill", (q, cache, bt, req, pos), 4, 0, 1)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_minus_inf_candidates_are_still_selected(device):
    q, cache, bt, req, pos = worked_problem(device)
    q[:, 0, 0] = float("-inf")  # dots: -inf where the key is positive, NaN where it is 0
    cache[:, :, 0] = torch.where(torch.isnan(cache[:, :, 0]), cache[:, :, 0], torch.ones_like(cache[:, :, 0]))
    raw = indexer.index_scores_prefill(q, cache, bt, req, pos)
    assert raw[0, 0].tolist() == [float("-inf")] * 3
    assert indexer.index_topk_prefill(q, cache, bt, req, pos, 4, 0, 0)[0, 0].tolist() == [0, 1, 2, -1]
    index_every_path("prefill", (q, cache, bt, req, pos), 4, 0, 0)


@pytest.mark.parametrize("dql", [1, 3])
def test_padded_decode_rows_are_all_minus_one(device, dql):
    gen = torch.Generator().manual_seed(1)
    args = decode_problem(gen, b=3, m=2, h=2, di=16, dql=dql, seq_lens=[0, 1, 200], device=device)
    res = index_every_path("decode", args, 3, 0, 1, extra=(dql,))
    topk = res["topk"]
    rows_of_empty = list(range(dql))  # request 0 has no token: every row padded
    assert (topk[:, rows_of_empty] == -1).all()
    if dql == 3:  # request 1 has one token: rows at p = -2, -1 padded, p = 0 selects block 0
        assert (topk[:, 3:5] == -1).all() and topk[:, 5, 0].eq(0).all() and (topk[:, 5, 1:] == -1).all()


# --- hypothesis sweeps on integer-valued inputs ---------------------------------------------

_LEN = st.one_of(st.sampled_from([0, 1, 2, 127, 128, 129, 255, 256, 257]), st.integers(0, 512))
_SWEEP = {  # what both sweeps draw
    "h": st.sampled_from([1, 2, 4]),
    "di": st.sampled_from([4, 16, 20]),
    "b": st.integers(1, 3),
    "m": st.integers(1, 4),
    "topk": st.integers(1, 6),
    "init_blocks": st.integers(0, 2),
    "local_blocks": st.integers(0, 2),
    "dtype": st.sampled_from([torch.float32, torch.float16]),
    "idx_dtype": st.sampled_from([torch.int32, torch.int64]),
    "strided": st.booleans(),
    "seed": st.integers(0, 2**16),
}


@settings(max_examples=30)
@given(dql=st.integers(1, 3), lens=st.lists(_LEN, min_size=3, max_size=3), stride=st.sampled_from([8, 16]), **_SWEEP)
def test_decode_sweep(h, di, b, m, dql, lens, topk, init_blocks, local_blocks, dtype, idx_dtype, strided, stride, seed):
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [min(x, m * BLOCK) for x in lens[:b]]
    args = decode_problem(
        gen, b=b, m=m, h=h, di=di, dql=dql, seq_lens=seq_lens, dtype=dtype, idx_dtype=idx_dtype, strided=strided
    )
    index_every_path("decode", args, topk, init_blocks, local_blocks, extra=(dql,), block_page_stride=stride)


@settings(max_examples=30)
@given(
    rows=st.lists(st.tuples(st.integers(0, 2), _LEN), min_size=1, max_size=12),
    padded=st.lists(st.integers(0, 11), max_size=3),
    **_SWEEP,
)
def test_prefill_sweep(h, di, b, m, rows, padded, topk, init_blocks, local_blocks, dtype, idx_dtype, strided, seed):
    gen = torch.Generator().manual_seed(seed)
    req = [r % b for r, _ in rows]
    pos = [min(p, m * BLOCK - 1) for _, p in rows]
    for i in padded:
        if i < len(pos):
            pos[i], req[i] = -1, 7  # a padded row may carry any request id
    args = prefill_problem(
        gen, b=b, m=m, h=h, di=di, req=req, pos=pos, dtype=dtype, idx_dtype=idx_dtype, strided=strided
    )
    index_every_path("prefill", args, topk, init_blocks, local_blocks)


# --- every kernel code path on small shapes -------------------------------------------------


def _kernel_scores(q, cache, bt, req, pos, dql, prefill, forced, **overrides):
    out = poison(torch.empty(q.shape[1], q.shape[0], bt.shape[1], device=q.device))
    index_scores_kernel(q, cache, bt, req, pos, dql, prefill, 1, 1, forced, out, **overrides)
    return out


@pytest.mark.parametrize("blocks_per_program", [1, 2, 3])
@pytest.mark.parametrize("block_q", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_scoring_chunks_and_row_tiles(device, blocks_per_program, block_q, dtype):
    """The grid split over block chunks and several row tiles per request (speculative decode:
    5 rows a request, in tiles of 1 (float32: 16 lanes) or 1 and 4 (float16: 16 or 64 lanes))."""
    gen = torch.Generator().manual_seed(blocks_per_program * 10 + block_q)
    q, cache, bt, seq_lens = decode_problem(
        gen, b=2, m=5, h=16, di=16, dql=5, seq_lens=[600, 130], device=device, dtype=dtype
    )
    for forced in (False, True):
        want = reference.index_scores_decode(q, cache, bt, seq_lens, 5, 1, 1, forced=forced)
        got = _kernel_scores(
            q, cache, bt, seq_lens, seq_lens, 5, False, forced, block_q=block_q, blocks_per_program=blocks_per_program
        )
        assert_same_scores(got, want)


def _checking_scores(device, seq_lens, bad, blocks_per_program, block_q, dql=3, m=5, seed=0):
    """The decode scores launch with its value checks (``check``): ``(flags, done, counter, scores equal
    the reference's)``. ``bad``: ``(request, column, value)`` entries written into the block table."""
    gen = torch.Generator().manual_seed(seed)
    q, cache, bt, seq = decode_problem(
        gen, b=len(seq_lens), m=m, h=4, di=16, dql=dql, seq_lens=[min(s, m * BLOCK) for s in seq_lens], device=device
    )
    seq = torch.tensor(seq_lens, dtype=seq.dtype, device=device)
    for r, c, v in bad:
        bt[r, c] = v
    flags, count, done = (torch.zeros(2 if i == 0 else 1, dtype=torch.int32, device=device) for i in range(3))
    got = _kernel_scores(
        q, cache, bt, seq, seq, dql, False, True, block_q=block_q, blocks_per_program=blocks_per_program,
        check=(flags, count, done),
    )  # fmt: skip
    with mm3lab.validation(False):  # (the reference masks what the kernel masks)
        want = reference.index_scores_decode(q, cache, bt, seq.clamp(max=m * BLOCK), dql, 1, 1, forced=True)
    same = bool(torch.equal(got, want)) if not bad else True
    return flags.tolist(), int(done[0]), int(count[0]), same


@pytest.mark.parametrize("blocks_per_program", [1, 2, 5])
@pytest.mark.parametrize("block_q", [1, 4])
@pytest.mark.parametrize(
    ("seq_lens", "bad", "want"),
    [
        ([600, 130], [], [0, 0]),
        ([600, 130], [(0, 4, -1)], [0, 1]),  # the last entry a 600-token request reads
        ([600, 130], [(1, 1, 11)], [0, 1]),  # past the cache (11 blocks), read by the 130-token request
        ([600, 130], [(1, 2, 99), (0, 0, -5)], [0, 1]),  # (1, 2) is not read; (0, 0) is
        ([600, 130], [(1, 2, 99)], [0, 0]),  # an entry no row reads
        ([641, 130], [], [1, 0]),  # a seq_len past the table's 5 blocks
        ([0, 130], [(0, 0, -1)], [0, 0]),  # an empty request reads nothing
    ],
)
def test_a_checking_scores_launch_flags_what_the_value_checks_reject(
    device, blocks_per_program, block_q, seq_lens, bad, want
):
    """The decode scores launch that checks the call's values itself: its flags say what
    ``check_decode_values`` rejects (``seq_len`` past the table, a read entry outside the cache), whichever
    program reads the entry (chunks of 1, 2 or 5 blocks; row tiles of 1 or 4 rows of a request); its
    ``done`` word is set and its counter back at zero; a clean call's scores are the reference's."""
    flags, done, count, same = _checking_scores(device, seq_lens, bad, blocks_per_program, block_q)
    assert (flags, done, count, same) == (want, 1, 0, True)
    from mm3lab.indexer.checks import check_decode_values

    gen = torch.Generator().manual_seed(0)
    _, cache, bt, _ = decode_problem(gen, b=2, m=5, h=4, di=16, dql=3, seq_lens=[0, 0], device=device)
    for r, c, v in bad:
        bt[r, c] = v
    seq = torch.tensor(seq_lens, dtype=torch.int64, device=device)
    if any(want):
        with pytest.raises(ValueError, match="seq_lens" if want[0] else "block_table"):
            check_decode_values(cache, bt, seq)
    else:
        check_decode_values(cache, bt, seq)


@settings(max_examples=20, deadline=None)
@given(
    seq_lens=st.lists(st.integers(0, 5 * BLOCK + 40), min_size=1, max_size=3),
    bad=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 4), st.sampled_from([-1, 11, 2**31 - 1])), max_size=2),
    blocks_per_program=st.integers(1, 5),
    seed=st.integers(0, 2**16),
)
def test_checking_scores_sweep(seq_lens, bad, blocks_per_program, seed):
    """Random lengths and bad entries: the launch's flags equal what the detailed check finds (CPU: the
    interpreter)."""
    from mm3lab.indexer.checks import check_decode_values

    bad = [(r % len(seq_lens), c, v) for r, c, v in bad]
    flags, done, count, _ = _checking_scores("cpu", seq_lens, bad, blocks_per_program, 1, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    _, cache, bt, _ = decode_problem(gen, b=len(seq_lens), m=5, h=4, di=16, dql=3, seq_lens=[0] * len(seq_lens))
    for r, c, v in bad:
        bt[r, c] = v
    seq = torch.tensor(seq_lens, dtype=torch.int64)
    try:
        check_decode_values(cache, bt, seq)
        rejected = False
    except ValueError:
        rejected = True
    assert (done, count) == (1, 0)
    assert bool(any(flags)) == rejected
    assert flags[0] == int(any(s > 5 * BLOCK for s in seq_lens))


def test_a_checking_scores_launch_takes_decode_rows():
    q = torch.zeros(2, 4, 16)
    cache, bt, seq = torch.zeros(3, BLOCK, 16), torch.zeros(1, 2, dtype=torch.int32), torch.tensor([3])
    out = torch.empty(4, 2, 2)
    check = tuple(torch.zeros(2, dtype=torch.int32) for _ in range(3))
    with pytest.raises(ValueError, match="decode rows only"):
        index_scores_kernel(q, cache, bt, seq, seq, 1, True, 0, 1, True, out, check=check)
    with pytest.raises(ValueError, match="decode rows only"):
        index_scores_kernel(q, cache, bt[:, :0], seq, seq, 2, False, 0, 1, True, out, check=check)


@pytest.mark.parametrize("prefill", [False, True], ids=["decode", "prefill"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_scoring_either_dot_orientation(device, prefill, dtype):
    """Lanes x tokens (the bf16 / fp16 / fp32 default) and tokens x lanes (the FP8 default) score
    alike: the same rule, only the dot's operand order differs. A decode tile of 3 rows of 4 heads,
    and prefill rows of two requests in one tile."""
    gen = torch.Generator().manual_seed(11)
    q, cache, bt, seq_lens = decode_problem(
        gen, b=2, m=4, h=4, di=32, dql=3, seq_lens=[400, 200], device=device, dtype=dtype
    )
    if prefill:
        req, pos = mm3lab.rows.decode_query_rows(seq_lens, 3)
        want = reference.index_scores_prefill(q, cache, bt, req, pos, 1, 1, forced=True)
    else:
        req = pos = seq_lens
        want = reference.index_scores_decode(q, cache, bt, seq_lens, 3, 1, 1, forced=True)
    for tok_m in (False, True):
        got = _kernel_scores(q, cache, bt, req, pos, 3 if not prefill else 1, prefill, True, tok_m=tok_m)
        assert_same_scores(got, want)


def test_prefill_tiles_that_mix_requests(device):
    """Rows of three requests interleaved in one tile: each row reads its own physical blocks."""
    gen = torch.Generator().manual_seed(4)
    req = [0, 1, 2, 0, 1, 2, 2, 0]
    pos = [300, 10, 140, 299, 255, -1, 0, 128]
    args = prefill_problem(gen, b=3, m=3, h=2, di=16, req=req, pos=pos, device=device)
    q, cache, bt, r, p = args
    for bpp in (1, 3):
        want = reference.index_scores_prefill(q, cache, bt, r, p)
        got = _kernel_scores(q, cache, bt, r, p, 1, True, False, block_q=8, blocks_per_program=bpp)
        assert_same_scores(got, want)
    index_every_path("prefill", args, 4, 0, 1)


@pytest.mark.parametrize("width", [1, 16, 37, 100])
def test_topk_rows_read_in_chunks(device, width):
    gen = torch.Generator().manual_seed(width)
    scores = torch.randint(-3, 4, (2, 3, width), generator=gen).float().to(device)
    scores[0, 0, :3] = float("nan")
    want = reference.topk_blocks(scores, 6)
    for row_width in (16, 32):
        got = poison(torch.empty(2, 3, 6, dtype=torch.int32, device=device))
        topk_kernel(scores, 6, got, max_register_row=row_width)
        assert_equal_int(got, want, f"topk_idx (chunks of {row_width})")


@pytest.mark.parametrize("algorithm", ["rounds", "bitonic"])
@pytest.mark.parametrize("group", [1, 4, 16])
def test_topk_groups_and_algorithms(device, algorithm, group):
    """Both selection algorithms, over the whole row and with groups pre-selected by their
    maxima, on unmasked rows, decode rows and prefill rows with the fused block table: all equal
    the reference (ties and NaN included; rows whose candidates end inside the first group)."""
    gen = torch.Generator().manual_seed(group + (algorithm == "bitonic"))
    width, topk = 70, 5
    scores = torch.randint(-3, 4, (2, 6, width), generator=gen).float().to(device)
    scores[0, 1, 10:20] = float("nan")
    run = dict(algorithm=algorithm, group=group)
    got = poison(torch.empty(2, 6, topk, dtype=torch.int32, device=device))
    topk_kernel(scores, topk, got, **run)
    assert_equal_int(got, reference.topk_blocks(scores, topk), f"topk_idx ({run})")
    seq_lens = torch.tensor([70 * BLOCK, 20 * BLOCK + 3, 1], dtype=torch.int32, device=device)
    query_req_id = torch.tensor([0, 1, 2, 1, 7, 0], dtype=torch.int32, device=device)
    query_abs_pos = torch.tensor([8000, 2000, 0, 10, -1, 40 * BLOCK], dtype=torch.int32, device=device)
    bt = torch.randint(0, 500, (3, width), generator=gen, dtype=torch.int32).to(device)
    cases = {  # the rows' positions: decode rows of seq_lens, or prefill rows (req, pos)
        "decode": {"positions": 1, "req": seq_lens, "pos": seq_lens, "dql": 2},
        "prefill": {"positions": 2, "req": query_req_id, "pos": query_abs_pos, "dql": 1},
    }
    for kind, row_kw in cases.items():
        outs = []
        for settings_ in ({}, run):
            out = [
                poison(torch.empty(2, 6, topk, dtype=torch.int32, device=device)),
                poison(torch.empty(2, 6, topk * 8, dtype=torch.int32, device=device)),
                poison(torch.empty(2, 6, dtype=torch.int32, device=device)),
            ]
            topk_kernel(
                scores,
                topk,
                out[0],
                **row_kw,
                batch=3,
                block_table=bt,
                sparse_bt=out[1],
                sparse_ctx=out[2],
                **settings_,
            )
            outs.append(out)
        if kind == "decode":
            want = indexer_reference._topk(scores, indexer_reference._decode_rows(seq_lens, 2), topk)
        else:
            rows = indexer_reference._prefill_rows(bt, query_req_id, query_abs_pos)
            want = indexer_reference._topk(scores, rows, topk)
        assert_equal_int(outs[0][0], want, f"{kind} topk_idx (one launch, rounds)")
        for name, a, b in zip(("topk_idx", "sparse_bt", "sparse_ctx"), *outs, strict=False):
            assert_equal_int(b, a, f"{kind} {name} ({run})")


def test_topk_blocks(device):
    gen = torch.Generator().manual_seed(0)
    distinct = torch.randn(4, 300, generator=gen).to(device)
    got = indexer.topk_blocks(distinct, 16)
    assert_equal_int(got, torch.topk(distinct, 16, dim=-1).indices, "topk_blocks vs torch.topk")
    ties = torch.randint(-2, 3, (2, 3, 50), generator=gen).float().to(device)
    ties[0, 0, 7] = float("nan")
    ties[1, 2] = -0.0
    ties[1, 2, ::3] = 0.0  # -0.0 and +0.0 tie: lower id first
    assert_equal_int(indexer.topk_blocks(ties, 60), reference.topk_blocks(ties, 60), "topk_blocks with ties")
    assert indexer.topk_blocks(ties, 60)[1, 2].tolist() == list(range(50)) + [-1] * 10
    half = ties.half()
    assert_equal_int(indexer.topk_blocks(half, 5), reference.topk_blocks(half, 5), "topk_blocks float16")
    strided = ties.transpose(0, 1)
    assert_equal_int(indexer.topk_blocks(strided, 4), reference.topk_blocks(strided, 4), "topk_blocks strided")


def test_topk_blocks_wider_than_the_register_row(device):
    gen = torch.Generator().manual_seed(2)
    scores = torch.randn(2, 8192 + 100, generator=gen).to(device)
    scores[1, 8200] = 50.0
    got = indexer.topk_blocks(scores, 3)
    assert_equal_int(got, torch.topk(scores, 3, dim=-1).indices, "topk_blocks wide")
    assert got[1, 0].item() == 8200


# --- random float inputs: scores within tolerance ------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_random_float_scores_within_tolerance(device, dtype):
    gen = torch.Generator().manual_seed(9)
    args = decode_problem(
        gen, b=2, m=3, h=4, di=64, dql=2, seq_lens=[384, 200], dtype=dtype, device=device, values=None
    )
    got = indexer.index_scores_decode(*args, 2)
    want = reference.index_scores_decode(*args, 2)
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), finite)
    assert_close(got[finite], want[finite], atol=SCORE_ATOL, rtol=SCORE_RTOL, name="scores")
    req = torch.tensor([0, 1, 0], device=device)
    pos = torch.tensor([383, 199, 5], device=device)
    q = torch.randn(3, 4, 64, generator=gen).to(dtype).to(device)
    got = indexer.index_scores_prefill(q, args[1], args[2], req, pos)
    want = reference.index_scores_prefill(q, args[1], args[2], req, pos)
    finite = torch.isfinite(want)
    assert_close(got[finite], want[finite], atol=SCORE_ATOL, rtol=SCORE_RTOL, name="prefill scores")


def test_bf16_routes_to_torch_on_the_interpreter():
    if not mm3lab.backend.INTERPRETER:
        pytest.skip("the interpreter backend only")
    gen = torch.Generator().manual_seed(3)
    args = decode_problem(gen, b=1, m=2, h=2, di=16, dql=1, seq_lens=[200], dtype=torch.bfloat16)
    assert_equal_int(indexer.index_topk_decode(*args, 2), reference.index_topk_decode(*args, 2))


# --- bad input --------------------------------------------------------------------------------


def _decode_base(device):
    gen = torch.Generator().manual_seed(0)
    q, cache, bt, seq_lens = decode_problem(gen, b=2, m=2, h=2, di=16, dql=1, seq_lens=[100, 200], device=device)
    return dict(
        index_q=q,
        index_cache=cache,
        block_table=bt,
        seq_lens=seq_lens,
        topk=2,
        decode_query_len=1,
        init_blocks=0,
        local_blocks=1,
    )


BAD_DECODE = [
    ("index_q rank", lambda a: a.update(index_q=a["index_q"][0]), ValueError, "index_q: expected 3 dimensions"),
    ("head dim", lambda a: a.update(index_q=a["index_q"][..., :8]), ValueError, "index_q: head dim 8"),
    ("dtype", lambda a: a.update(index_q=a["index_q"].half()), TypeError, "index_q: dtype float16"),
    ("cache block", lambda a: a.update(index_cache=a["index_cache"][:, :64]), ValueError, "index_cache: dimension 1"),
    (
        "cache head dim",
        lambda a: a.update(index_cache=a["index_cache"].transpose(1, 2).contiguous().transpose(1, 2)),
        ValueError,
        "index_cache: the last dimension must be contiguous",
    ),
    ("int cache", lambda a: a.update(index_cache=a["index_cache"].int()), TypeError, "index_cache: expected dtype"),
    ("table rank", lambda a: a.update(block_table=a["block_table"][0]), ValueError, "block_table: expected 2"),
    ("float table", lambda a: a.update(block_table=a["block_table"].float()), TypeError, "block_table"),
    ("seq_lens shape", lambda a: a.update(seq_lens=a["seq_lens"][:1]), ValueError, "seq_lens: expected shape"),
    ("rows", lambda a: a.update(decode_query_len=2), ValueError, "index_q: expected batch \\* decode_query_len"),
    ("dql type", lambda a: a.update(decode_query_len=1.0), TypeError, "decode_query_len"),
    ("topk zero", lambda a: a.update(topk=0), ValueError, r"topk: expected an int (>= 1|in \[1, )"),
    ("topk tensor", lambda a: a.update(topk=torch.tensor(2)), TypeError, "topk"),
    ("init negative", lambda a: a.update(init_blocks=-1), ValueError, "init_blocks"),
    ("local type", lambda a: a.update(local_blocks=True), TypeError, "local_blocks"),
    (
        "seq_len past table",
        lambda a: a.update(seq_lens=torch.tensor([100, 257], device=a["seq_lens"].device)),
        ValueError,
        "seq_lens: request 1 has seq_len 257",
    ),
    (
        "entry past cache",
        lambda a: a["block_table"].__setitem__((1, 1), 99),
        ValueError,
        "block_table: request 1, logical block 1 maps to physical block 99",
    ),
    (
        "negative entry",
        lambda a: a["block_table"].__setitem__((0, 0), -1),
        ValueError,
        "block_table: request 0, logical block 0",
    ),
]


@pytest.mark.parametrize("what,change,error,match", BAD_DECODE, ids=[b[0] for b in BAD_DECODE])
def test_bad_decode_input(device, what, change, error, match):
    a = _decode_base(device)
    change(a)
    fused_only = dict(block_page_stride=8)
    entries = [
        (indexer.index_topk_decode, {}),
        (reference.index_topk_decode, {}),
        (indexer.index_topk_block_table_decode, fused_only),
        (reference.index_topk_block_table_decode, fused_only),
    ]
    for entry, more in entries:
        with pytest.raises(error, match=match):
            entry(**a, **more)
    scores_args = {k: v for k, v in a.items() if k != "topk"}
    if what not in ("topk zero", "topk tensor"):
        for entry in (indexer.index_scores_decode, reference.index_scores_decode):
            with pytest.raises(error, match=match):
                entry(**scores_args)


def test_bad_prefill_input_and_strides(device):
    gen = torch.Generator().manual_seed(0)
    q, cache, bt, req, pos = prefill_problem(gen, b=2, m=2, h=2, di=16, req=[0, 1], pos=[10, 200], device=device)
    for entry in (indexer.index_topk_prefill, reference.index_topk_prefill):
        with pytest.raises(ValueError, match="query_req_id: row 1 has request id 2"):
            entry(q, cache, bt, torch.tensor([0, 2], device=device), pos, 2)
        with pytest.raises(ValueError, match="query_abs_pos: row 0 has position 256"):
            entry(q, cache, bt, req, torch.tensor([256, 0], device=device), 2)
        with pytest.raises(ValueError, match="query_abs_pos: expected shape"):
            entry(q, cache, bt, req, pos[:1], 2)
        with pytest.raises(ValueError, match="query_req_id: expected shape"):
            entry(q, cache, bt, req[:1], pos, 2)
    # a padded row may carry any request id
    req, pos = torch.tensor([5, 1], device=device), torch.tensor([-1, 3], device=device)
    indexer.index_topk_prefill(q, cache, bt, req, pos, 2)
    for entry in (indexer.index_topk_block_table_prefill, reference.index_topk_block_table_prefill):
        with pytest.raises(ValueError, match="block_page_stride: expected 8"):
            entry(q, cache, bt, req, pos, 2, block_page_stride=12)
    with pytest.raises(ValueError, match="scores: expected at least one dimension"):
        indexer.topk_blocks(torch.tensor(1.0), 2)
    with pytest.raises(TypeError, match="scores: expected dtype"):
        indexer.topk_blocks(torch.ones(3, dtype=torch.int32), 2)
    if device == "cuda":
        with pytest.raises(ValueError, match="seq_lens is on cpu"):
            indexer.index_topk_decode(q, cache, bt, torch.tensor([3, 4]), 2)


# --- validation off: the defined fallback ---------------------------------------------------


def test_validation_off_fallback(device):
    gen = torch.Generator().manual_seed(8)
    q, cache, bt, seq_lens = decode_problem(gen, b=2, m=2, h=2, di=16, dql=2, seq_lens=[256, 200], device=device)
    seq_lens[0] = 10_000  # past the table: candidates stop at its width
    bt[1, 1] = 10**6  # outside the cache: never read, a candidate scoring -inf
    bt[1, 0] = -3
    with mm3lab.validation(False):
        res = index_every_path("decode", (q, cache, bt, seq_lens), 3, 0, 1, extra=(2,))
    raw = res["scores0"]
    assert torch.isinf(raw[:, 2:]).all() and (raw[:, 2:] < 0).all()
    assert res["topk"][0, 2].tolist() == [1, 0, -1]  # the local block first, then the -inf one
    assert torch.isfinite(raw[:, :2]).all()
    # a request id out of range on a live row: the row is padded
    q2, cache2, bt2, req, pos = prefill_problem(gen, b=2, m=2, h=2, di=16, req=[0, 1], pos=[10, 200], device=device)
    req[1] = 9
    with mm3lab.validation(False):
        res = index_every_path("prefill", (q2, cache2, bt2, req, pos), 2, 0, 1)
    assert (res["topk"][:, 1] == -1).all() and (res["topk"][:, 0, 0] == 0).all()


# --- on CUDA: the model's shapes ------------------------------------------------------------


def _cuda_only(device):
    if device != "cuda":
        pytest.skip("CUDA shapes")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_long_decode(device, dtype):
    _cuda_only(device)
    gen = torch.Generator().manual_seed(21)
    m = 512  # 64K tokens
    lens = [m * BLOCK, 40_000, 129, 1]
    args = decode_problem(gen, b=4, m=m, h=4, di=128, dql=1, seq_lens=lens, dtype=dtype, device=device)
    index_every_path("decode", args, 16, 0, 1, extra=(1,), block_page_stride=16)
    args = decode_problem(gen, b=2, m=m, h=4, di=128, dql=4, seq_lens=[m * BLOCK, 3000], dtype=dtype, device=device)
    index_every_path("decode", args, 16, 1, 1, extra=(4,))
    fargs = decode_problem(
        gen, b=2, m=64, h=4, di=128, dql=1, seq_lens=[8192, 5000], dtype=dtype, device=device, values=None
    )
    got = indexer.index_scores_decode(*fargs)
    want = reference.index_scores_decode(*fargs)
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got).cpu(), finite.cpu())
    assert_close(got[finite], want[finite], atol=SCORE_ATOL, rtol=SCORE_RTOL, name="bf16 scores")


def test_cuda_one_million_tokens_batch_1(device):
    _cuda_only(device)
    gen = torch.Generator().manual_seed(22)
    m = 8192
    args = decode_problem(
        gen, b=1, m=m, h=4, di=128, dql=1, seq_lens=[m * BLOCK], dtype=torch.bfloat16, device=device, values=3
    )
    want = reference.index_topk_decode(*args, 16)
    assert_equal_int(indexer.index_topk_decode(*args, 16), want, "topk_idx 1M")
    fused = indexer.index_topk_block_table_decode(*args, 16)
    apart = mm3lab.build_sparse_block_table_decode(want.to(device), args[2], args[3])
    assert_equal_int(fused[1], apart[0], "sparse_bt 1M")
    assert_equal_int(fused[2], apart[1], "sparse_ctx 1M")


def test_cuda_prefill_chunk(device):
    _cuda_only(device)
    gen = torch.Generator().manual_seed(23)
    req = [0] * 200 + [1] * 56
    pos = list(range(7990, 8190)) + list(range(0, 56 * 40, 40))  # the table holds 64 * 128 = 8192 tokens
    args = prefill_problem(gen, b=2, m=64, h=4, di=128, req=req, pos=pos, dtype=torch.bfloat16, device=device)
    index_every_path("prefill", args, 16, 0, 1)


def test_cuda_topk_wide_rows(device):
    _cuda_only(device)
    gen = torch.Generator().manual_seed(24)
    for width in (8192, 20_000):
        scores = torch.randn(64, width, generator=gen).to(device)
        assert_equal_int(indexer.topk_blocks(scores, 16), torch.topk(scores, 16, dim=-1).indices, f"width {width}")
    ties = torch.randint(-3, 4, (8, 8192), generator=gen).float().to(device)
    assert_equal_int(indexer.topk_blocks(ties, 16), reference.topk_blocks(ties, 16), "ties 8192")
