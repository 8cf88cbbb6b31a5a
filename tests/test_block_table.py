"""The sparse block table (SPEC section 3): kernel against reference, exactly.

* the SPEC's four worked examples, on both entry points, both strides and every path;
* mm3lab's definitions: duplicates, ids past the table, padded rows, request ids out of range;
* hypothesis sweeps (decode with decode_query_len 1..4, prefill, the vLLM names): H up to 4,
  int32/int64, strided views, both strides, outputs poisoned first;
* bad input raises before any kernel runs and leaves the ``out`` buffers untouched;
* the device function ``emit_sparse_block_table_row`` called from another kernel;
* on CUDA: long block tables (8192 blocks), 4096 rows, K = 16, and CUDA-graph capture.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given, settings
from hypothesis import strategies as st

import mm3lab
from mm3lab import (
    attended_tokens,
    build_sparse_block_table_decode,
    build_sparse_block_table_prefill,
    plan_sparse_row,
    reference,
)
from mm3lab.block_table import attended_ranges, decode_positions, sparse_block_table_row
from mm3lab.block_table.kernel import emit_sparse_block_table_row
from mm3lab.compat import vllm
from mm3lab.constants import PAGES_PER_SPARSE_BLOCK as PAGES
from mm3lab.constants import SPARSE_BLOCK_SIZE as BLOCK
from mm3lab.rows import decode_rows
from mm3lab.testing import GARBAGE_INT, assert_equal_int, assert_paths_agree, poison, run_paths

STRIDES = (8, 16)


def poisoned_out(h, n, k, device):
    sbt = poison(torch.empty(h, n, k * PAGES, dtype=torch.int32, device=device))
    ctx = poison(torch.empty(h, n, dtype=torch.int32, device=device))
    return sbt, ctx


def pages_of(physical, stride):
    return [physical * stride + j for j in range(PAGES)]


def build_every_path(entry, args, kwargs, h, n, k, device, own_outputs=True):
    """Every path (:func:`mm3lab.testing.run_paths`) into poisoned ``out`` buffers, and the kernel
    allocating its own outputs; every result must be identical. Returns the kernel's."""
    outs = []

    def inputs():
        outs.append(poisoned_out(h, n, k, device))
        return args, {**kwargs, "out": outs[-1]}

    got = run_paths(entry, inputs)
    sbt, ctx = got["kernel"]
    assert sbt.data_ptr() == outs[0][0].data_ptr() and ctx.data_ptr() == outs[0][1].data_ptr()
    if own_outputs:
        got["own outputs"] = entry(*args, **kwargs)
    for got_bt, got_ctx in got.values():
        assert got_bt.dtype == torch.int32 and got_ctx.dtype == torch.int32
        assert got_bt.is_contiguous() and got_ctx.is_contiguous()
        assert got_bt.device.type == torch.device(device).type
    assert_paths_agree(got, "(sparse_bt, sparse_ctx)")
    return sbt, ctx


# --- the SPEC's worked examples ------------------------------------------------------------

WORKED = [
    # topk, block table row, seq_len, logical blocks in row order, ctx
    ([1, 0, -1], [5, 7], 129, [5, 7], 129),
    ([1, 0, -1], [5, 7], 0, [], 0),
    ([0, 1, 2], [5, 6, 7, 0], 300, [5, 6, 7], 300),
    ([0, 1, -1], [3, 4, 0, 0], 200, [3, 4], 200),
]


@pytest.mark.parametrize("stride", STRIDES)
@pytest.mark.parametrize("topk,table,seq_len,physical,ctx", WORKED)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_worked_examples(device, dtype, topk, table, seq_len, physical, ctx, stride):
    expected = [pid for b in physical for pid in pages_of(b, stride)]
    expected += [0] * (len(topk) * PAGES - len(expected))
    t = torch.tensor([[topk]], dtype=dtype, device=device)
    bt = torch.tensor([table], dtype=dtype, device=device)
    args = (t, bt, torch.tensor([seq_len], dtype=dtype, device=device))
    sbt, sctx = build_every_path(build_sparse_block_table_decode, args, {"block_page_stride": stride}, 1, 1, 3, device)
    assert sbt[0, 0].tolist() == expected and sctx.tolist() == [[ctx]]
    # The same row as prefill: request 0 at p = seq_len - 1.
    args = (t, bt, torch.tensor([0], dtype=dtype, device=device), torch.tensor([seq_len - 1], device=device))
    sbt, sctx = build_every_path(build_sparse_block_table_prefill, args, {"block_page_stride": stride}, 1, 1, 3, device)
    assert sbt[0, 0].tolist() == expected and sctx.tolist() == [[ctx]]
    # And through the upstream names (H = 1, head dimension dropped).
    sbt, sctx = vllm.minimax_m3_build_sparse_block_table_decode(
        args[0], bt, torch.tensor([seq_len], device=device), block_page_stride=stride
    )
    assert sbt.shape == (1, 24) and sbt[0].tolist() == expected and sctx.tolist() == [ctx]


def test_row_helpers_follow_the_spec():
    row, ctx = sparse_block_table_row([1, 0, -1], [5, 7], p=128)
    assert row == list(range(40, 48)) + list(range(56, 64)) + [0] * 8 and ctx == 129
    plan = plan_sparse_row([1, 0, -1, 1, 3], p=128)
    assert plan.full == (0,) and plan.tail == 1 and plan.blocks == (0, 1)
    assert plan.self_blk == 1 and plan.causal_len == 129 and plan.tail_tokens == 1
    assert [(s, r) for s, _, r in plan.dropped] == [(2, "padding"), (3, "duplicate"), (4, "after the query's block")]
    assert attended_ranges([1, 0, -1], 128) == [(0, 128), (128, 129)]
    assert attended_tokens([1, 0, -1], 128) == list(range(129))
    assert attended_tokens([2, 0], 300) == list(range(0, 128)) + list(range(256, 301))
    assert len(attended_tokens([0, 2, 1], 299)) == plan_sparse_row([0, 2, 1], 299).ctx == 300
    assert decode_positions(129, 3) == [126, 127, 128]
    assert decode_positions(1, 3) == [-2, -1, 0]
    padded = plan_sparse_row([0, -1], -1)
    assert padded.self_blk is None and padded.ctx == 0 and padded.blocks == ()


# --- mm3lab's definitions where upstream is undefined ---------------------------------------


@pytest.mark.parametrize("stride", STRIDES)
def test_duplicates_are_attended_once(device, stride):
    # Tail (block 2) named three times, full block 0 twice; p = 300 -> self_blk = 2.
    t = torch.tensor([[[2, 0, 2, 0, 1, 2]]], device=device)
    bt = torch.tensor([[10, 11, 12]], device=device)
    sbt, ctx = build_every_path(
        build_sparse_block_table_decode,
        (t, bt, torch.tensor([301], device=device)),
        {"block_page_stride": stride},
        1,
        1,
        6,
        device,
    )
    expected = pages_of(10, stride) + pages_of(11, stride) + pages_of(12, stride) + [0] * (3 * PAGES)
    assert sbt[0, 0].tolist() == expected
    assert ctx.item() == 2 * BLOCK + (301 - 2 * BLOCK)


def test_blocks_after_the_query_and_padding_are_dropped(device):
    # dql = 3 rows of one request at p = 126, 127, 128: block 1 is future, then the tail.
    t = torch.tensor([[[1, 0, -1]] * 3], device=device)
    bt = torch.tensor([[5, 7]], device=device)
    sbt, ctx = build_every_path(
        build_sparse_block_table_decode, (t, bt, torch.tensor([129], device=device), 3), {}, 1, 3, 3, device
    )
    assert ctx.tolist() == [[127, 128, 129]]
    assert sbt[0, 0].tolist() == pages_of(5, 8) + [0] * 16  # block 0 is the tail of rows 0 and 1
    assert sbt[0, 2].tolist() == pages_of(5, 8) + pages_of(7, 8) + [0] * 8


def test_speculative_decode_rows_with_padding(device):
    # seq_len 1 with dql 3: rows at p = -2, -1 are padded, row 2 at p = 0.
    t = torch.tensor([[[0, -1]] * 3], device=device)
    bt = torch.tensor([[9]], device=device)
    sbt, ctx = build_every_path(
        build_sparse_block_table_decode, (t, bt, torch.tensor([1], device=device), 3), {}, 1, 3, 2, device
    )
    assert ctx.tolist() == [[0, 0, 1]]
    assert sbt[0, :2].eq(0).all() and sbt[0, 2].tolist() == pages_of(9, 8) + [0] * 8


def test_prefill_chunk_shares_its_tail(device):
    # Tokens 126..130 of request 1: the tail switches from block 0 to block 1 at p = 128.
    pos = torch.arange(126, 131, device=device)
    t = torch.tensor([[[1, 0]] * 5], device=device)
    bt = torch.tensor([[0, 0], [4, 6]], device=device)
    req = torch.ones(5, dtype=torch.int32, device=device)
    sbt, ctx = build_every_path(build_sparse_block_table_prefill, (t, bt, req, pos), {}, 1, 5, 2, device)
    assert ctx.tolist() == [[127, 128, 129, 130, 131]]
    assert sbt[0, 0].tolist() == pages_of(4, 8) + [0] * 8
    assert sbt[0, 4].tolist() == pages_of(4, 8) + pages_of(6, 8)


def test_validation_off_defines_out_of_range(device):
    """Ids past the table are never read, a seq_len past the table drops its tail, a request id out
    of range is a padded row; kernel and reference agree, and nothing is read out of bounds."""
    t = torch.tensor([[[0, 5, 1], [1, 0, 99], [0, 1, 2]]], device=device)
    bt = torch.tensor([[3, 4], [6, 7], [8, 9]], device=device)
    seq_lens = torch.tensor([256, 200, 1000], device=device)
    with mm3lab.validation(False):
        sbt, ctx = build_every_path(build_sparse_block_table_decode, (t, bt, seq_lens), {}, 1, 3, 3, device)
    assert ctx.tolist() == [[256, 200, 256]]
    assert sbt[0, 0].tolist() == pages_of(3, 8) + pages_of(4, 8) + [0] * 8
    assert sbt[0, 2].tolist() == pages_of(8, 8) + pages_of(9, 8) + [0] * 8  # self block 7 is past the table

    req = torch.tensor([0, 3, -1, 2], device=device)
    pos = torch.tensor([5, 5, 5, -1], device=device)
    t4 = torch.tensor([[[0, -1]] * 4], device=device)
    with mm3lab.validation(False):
        sbt, ctx = build_every_path(build_sparse_block_table_prefill, (t4, bt, req, pos), {}, 1, 4, 2, device)
    assert ctx.tolist() == [[6, 0, 0, 0]]
    assert sbt[0, 1:].eq(0).all()


def test_no_rows_and_no_selection(device):
    for h, n, k in [(2, 0, 3), (0, 2, 3), (2, 2, 0)]:
        t = torch.full((h, n, k), -1, dtype=torch.int32, device=device)
        bt = torch.zeros(n, 2, dtype=torch.int32, device=device)
        seq = torch.full((n,), 100, dtype=torch.int32, device=device)
        sbt, ctx = build_every_path(build_sparse_block_table_decode, (t, bt, seq), {}, h, n, k, device)
        assert sbt.shape == (h, n, k * PAGES) and ctx.shape == (h, n) and not ctx.any()
    # A prefill batch of padded rows only, with an empty block table.
    t = torch.full((1, 2, 2), -1, device=device)
    bt = torch.zeros(0, 0, dtype=torch.int32, device=device)
    rows = torch.tensor([-1, -1], device=device)
    sbt, ctx = build_every_path(build_sparse_block_table_prefill, (t, bt, rows, rows), {}, 1, 2, 2, device)
    assert not sbt.any() and not ctx.any()


# --- hypothesis sweeps -----------------------------------------------------------------------

EDGE_LENS = [0, 1, 2, 127, 128, 129, 255, 256, 257, 383, 384, 385]


def _index(draw, values, device):
    dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    return torch.tensor(values, dtype=dtype, device=device)


def _strided(draw, t: torch.Tensor) -> torch.Tensor:
    """The same values as ``t`` in a non-contiguous view (or ``t`` itself)."""
    how = draw(st.sampled_from(["contiguous", "token_major", "every_other"]))
    if how == "token_major" and t.dim() == 3:  # a [N, H, K] buffer transposed to [H, N, K]
        buf = torch.empty(t.shape[1], t.shape[0], t.shape[2], dtype=t.dtype, device=t.device)
        buf.copy_(t.transpose(0, 1))
        return buf.transpose(0, 1)
    if how == "every_other":  # every other element of the last dimension of a wider buffer
        buf = torch.full((*t.shape[:-1], 2 * t.shape[-1]), GARBAGE_INT, dtype=t.dtype, device=t.device)
        buf[..., ::2] = t
        return buf[..., ::2]
    return t


def _selection(draw, self_blks, h, k, m, out_of_range):
    """``[H, N, K]`` ids: mostly the rows a top-k would produce (own block, distinct blocks,
    -1 padding), plus duplicates, future blocks and (when allowed) ids past the table."""
    hi = m + 2 if out_of_range else m - 1
    rows = []
    for _ in range(h):
        head = []
        for sb in self_blks:
            row = draw(st.lists(st.integers(-1, max(hi, 0)), min_size=k, max_size=k))
            if sb >= 0 and draw(st.booleans()):
                row[draw(st.integers(0, k - 1))] = min(sb, m - 1) if not out_of_range else sb
            head.append(row)
        rows.append(head)
    return rows


def _lens(draw, count, capacity, out_of_range):
    top = capacity + 300 if out_of_range else capacity
    edge = [v for v in EDGE_LENS if v <= top] + [capacity]
    return draw(st.lists(st.one_of(st.sampled_from(edge), st.integers(0, top)), min_size=count, max_size=count))


def _table_dims(draw, topks):
    """Block-table width ``m``, top-k ``k`` (one of ``topks``), and whether ids and lengths may fall out of range."""
    return draw(st.integers(1, 5)), draw(st.sampled_from(topks)), draw(st.booleans()) and draw(st.booleans())


def _arguments(draw, device, self_blks, h, k, m, b, out_of_range, rows, **fixed) -> dict:
    """A case as keyword arguments in signature order: a selection over the rows' ``self_blks``, a block table,
    the ``rows`` index lists, the ``fixed`` values, a stride; index tensors int32/int64, maybe strided."""
    topk = _index(draw, _selection(draw, self_blks, h, k, m, out_of_range), device)
    table = draw(st.lists(st.lists(st.integers(0, 50), min_size=m, max_size=m), min_size=b, max_size=b))
    case = {"topk_idx": _strided(draw, topk), "block_table": _strided(draw, _index(draw, table, device))}
    case.update({name: _strided(draw, _index(draw, values, device)) for name, values in rows.items()})
    return {**case, **fixed, "block_page_stride": draw(st.sampled_from(STRIDES)), "out_of_range": out_of_range}


@st.composite
def decode_cases(draw, device):
    h = draw(st.integers(1, 4))
    dql = draw(st.integers(1, 4))
    b = draw(st.integers(1, max(1, 6 // (h * dql))))
    m, k, out_of_range = _table_dims(draw, [1, 2, 3, 4, 5, 8])
    seq_lens = _lens(draw, b, m * BLOCK, out_of_range)
    p = [pos // BLOCK if pos >= 0 else -1 for s in seq_lens for pos in decode_positions(s, dql)]
    return _arguments(draw, device, p, h, k, m, b, out_of_range, {"seq_lens": seq_lens}, decode_query_len=dql)


@st.composite
def prefill_cases(draw, device):
    h = draw(st.integers(1, 4))
    b = draw(st.integers(1, 3))
    n = draw(st.integers(1, max(1, 8 // h)))
    m, k, out_of_range = _table_dims(draw, [1, 2, 3, 4, 6, 8])
    pos = [s - 1 for s in _lens(draw, n, m * BLOCK, out_of_range)]  # p = -1: a padded row
    if draw(st.booleans()):  # a chunk of consecutive tokens of one request
        start = draw(st.integers(0, max(m * BLOCK - n, 0)))
        pos = [min(start + i, m * BLOCK - 1) for i in range(n)]
    req = [draw(st.integers(-1, b) if out_of_range else st.integers(0, b - 1)) for _ in range(n)]
    self_blks = [q // BLOCK if q >= 0 else -1 for q in pos]
    rows = {"query_req_id": req, "query_abs_pos": pos}
    return _arguments(draw, device, self_blks, h, k, m, b, out_of_range, rows)


def _check_case(entry, case, device):
    case = dict(case)
    out_of_range = case.pop("out_of_range")
    h, n, k = case["topk_idx"].shape
    args = tuple(case.values())
    if out_of_range:  # may hold ids past the table, lengths it cannot hold, request ids out of range
        try:
            entry(*args)
        except ValueError as err:
            assert any(name in str(err) for name in ("topk_idx", "seq_lens", "query_req_id", "query_abs_pos"))
        with mm3lab.validation(False):
            build_every_path(entry, args, {}, h, n, k, device, own_outputs=False)
    else:
        build_every_path(entry, args, {}, h, n, k, device, own_outputs=False)


@settings(max_examples=150)
@given(data=st.data())
def test_decode_matches_reference(data):
    _check_case(build_sparse_block_table_decode, data.draw(decode_cases("cpu")), "cpu")


@settings(max_examples=150)
@given(data=st.data())
def test_prefill_matches_reference(data):
    _check_case(build_sparse_block_table_prefill, data.draw(prefill_cases("cpu")), "cpu")


@settings(max_examples=40)
@given(data=st.data())
def test_vllm_names_match_reference(data):
    case = data.draw(decode_cases("cpu"))
    if case.pop("out_of_range"):
        return
    topk = case["topk_idx"][:1]
    sbt, ctx = vllm.minimax_m3_build_sparse_block_table_decode(topk, *list(case.values())[1:])
    ref_bt, ref_ctx = reference.build_sparse_block_table_decode(topk, *list(case.values())[1:])
    assert_equal_int(sbt, ref_bt[0], "sparse_bt")
    assert_equal_int(ctx, ref_ctx[0], "sparse_ctx")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@settings(max_examples=300)
@given(data=st.data())
def test_sweep_on_gpu(data):
    for entry, cases in (
        (build_sparse_block_table_decode, decode_cases),
        (build_sparse_block_table_prefill, prefill_cases),
    ):
        _check_case(entry, data.draw(cases("cuda")), "cuda")


# --- bad input raises before anything runs ---------------------------------------------------


def _decode_args(device):
    return dict(
        topk_idx=torch.tensor([[[0, -1], [1, 0]]], device=device),
        block_table=torch.tensor([[3, 4]], device=device),
        seq_lens=torch.tensor([200], device=device),
        decode_query_len=2,
    )


def _prefill_args(device):
    return dict(
        topk_idx=torch.tensor([[[0, -1], [1, 0]]], device=device),
        block_table=torch.tensor([[3, 4]], device=device),
        query_req_id=torch.tensor([0, 0], device=device),
        query_abs_pos=torch.tensor([10, 200], device=device),
    )


DECODE_BAD = [
    (dict(topk_idx=torch.tensor([[0, -1], [1, 0]])), ValueError, "topk_idx: expected 3 dimensions"),
    (dict(topk_idx=torch.tensor([[[0.0, -1.0], [1.0, 0.0]]])), TypeError, "topk_idx: expected an int32 or int64"),
    (dict(block_table=torch.tensor([3, 4])), ValueError, "block_table: expected 2 dimensions"),
    (dict(block_table=torch.tensor([[3.0, 4.0]])), TypeError, "block_table"),
    (dict(seq_lens=torch.tensor([200, 10])), ValueError, "seq_lens: expected shape"),
    (dict(seq_lens=torch.tensor([200], dtype=torch.int16)), TypeError, "seq_lens: expected dtype"),
    (dict(decode_query_len=1), ValueError, r"topk_idx: expected batch \* decode_query_len = 1 \* 1 = 1 rows"),
    (dict(decode_query_len=0), ValueError, "decode_query_len: expected an int >= 1"),
    (dict(decode_query_len=2.0), TypeError, "decode_query_len"),
    (dict(block_page_stride=4), ValueError, "block_page_stride: expected 8"),
    (
        dict(seq_lens=torch.tensor([257])),
        ValueError,
        "seq_lens: request 0 has seq_len 257, but its block_table row holds 2",
    ),
    (dict(topk_idx=torch.tensor([[[0, -1], [1, 2]]])), ValueError, "topk_idx: head 0, row 1 selects block 2"),
]

PREFILL_BAD = [
    (dict(query_req_id=torch.tensor([0])), ValueError, "query_req_id: expected shape"),
    (dict(query_abs_pos=torch.tensor([[10, 200]])), ValueError, "query_abs_pos: expected 1 dimensions"),
    (dict(query_abs_pos=torch.tensor([10.0, 200.0])), TypeError, "query_abs_pos"),
    (dict(query_req_id=torch.tensor([0, 1])), ValueError, r"query_req_id: row 1 has request id 1, outside"),
    (dict(query_req_id=torch.tensor([-1, 0])), ValueError, r"query_req_id: row 0 has request id -1"),
    (dict(query_abs_pos=torch.tensor([10, 256])), ValueError, "query_abs_pos: row 1 has position 256"),
    (dict(topk_idx=torch.tensor([[[0, 7], [1, 0]]])), ValueError, "topk_idx: head 0, row 0 selects block 7"),
    (dict(block_page_stride=True), TypeError, "block_page_stride"),
]


def _on(device, changes):
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in changes.items()}


STEPS = {  # step: (its good arguments, its entry point and reference twin)
    "decode": (_decode_args, build_sparse_block_table_decode, reference.build_sparse_block_table_decode),
    "prefill": (_prefill_args, build_sparse_block_table_prefill, reference.build_sparse_block_table_prefill),
}


@pytest.mark.parametrize(
    "step,changes,error,match", [("decode", *bad) for bad in DECODE_BAD] + [("prefill", *bad) for bad in PREFILL_BAD]
)
def test_bad_input_raises_and_leaves_out_untouched(device, step, changes, error, match, monkeypatch):
    _forbid_kernels(monkeypatch)
    good_args, *entries = STEPS[step]
    args = {**good_args(device), **_on(device, changes)}
    for entry in entries:
        out = poisoned_out(1, 2, 2, device)
        with pytest.raises(error, match=match):
            entry(**args, out=out) if args["topk_idx"].dim() == 3 else entry(**args)
        assert out[0].eq(GARBAGE_INT).all() and out[1].eq(GARBAGE_INT).all()


def test_padded_prefill_rows_may_carry_any_request_id():
    args = {**_prefill_args("cpu"), "query_req_id": torch.tensor([5, 0]), "query_abs_pos": torch.tensor([-1, 200])}
    _, ctx = build_sparse_block_table_prefill(**args)
    assert ctx.tolist() == [[0, 201]]


def test_bad_out_buffers():
    args = _decode_args("cpu")
    with pytest.raises(TypeError, match="out: expected a pair"):
        build_sparse_block_table_decode(**args, out=torch.empty(1, 2, 16, dtype=torch.int32))
    sbt, ctx = poisoned_out(1, 2, 2, "cpu")
    with pytest.raises(ValueError, match=r"out\[0\] \(sparse_bt\): expected shape"):
        build_sparse_block_table_decode(**args, out=(sbt[:, :, :8], ctx))
    with pytest.raises(TypeError, match=r"out\[1\] \(sparse_ctx\): expected dtype int32"):
        build_sparse_block_table_decode(**args, out=(sbt, ctx.long()))
    with pytest.raises(ValueError, match=r"out\[0\] \(sparse_bt\): must be contiguous"):
        build_sparse_block_table_decode(**args, out=(torch.empty(1, 16, 2, dtype=torch.int32).transpose(1, 2), ctx))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_device_mix_is_rejected():
    args = {**_decode_args("cuda"), "seq_lens": torch.tensor([200])}
    with pytest.raises(ValueError, match="seq_lens is on cpu but topk_idx is on cuda"):
        build_sparse_block_table_decode(**args)


def test_vllm_names_take_one_head():
    args = _decode_args("cpu")
    args["topk_idx"] = args["topk_idx"].expand(2, 2, 2)
    with pytest.raises(ValueError, match=r"topk_idx: the upstream entry points take one selection head"):
        vllm.minimax_m3_build_sparse_block_table_decode(**args)
    pargs = _prefill_args("cpu")
    sbt, ctx = vllm.minimax_m3_build_sparse_block_table_prefill(**pargs, block_page_stride=16)
    assert sbt.shape == (2, 16) and ctx.tolist() == [11, 201]
    assert sbt[1].tolist() == pages_of(3, 16) + pages_of(4, 16)


def _forbid_kernels(monkeypatch):
    from mm3lab.block_table import kernel

    def boom(*args, **kwargs):  # pragma: no cover - reached only on a bug
        raise AssertionError("a kernel ran on bad input")

    monkeypatch.setattr(kernel, "build_sparse_block_table_decode_kernel", boom)
    monkeypatch.setattr(kernel, "build_sparse_block_table_prefill_kernel", boom)


# --- the device function, called from another kernel -----------------------------------------


# compiled Triton reads module globals only when they are constexpr objects
_BLOCK_C = tl.constexpr(BLOCK)
_PAGES_C = tl.constexpr(PAGES)


@triton.jit
def _countdown_rows(pos_ptr, bt_ptr, M, out_ptr, ctx_ptr, K, K_BLOCK: tl.constexpr, STRIDE: tl.constexpr):
    """Selection computed in registers (own block first, then the ones before it), compacted by
    the block table's device function."""
    n = tl.program_id(0)
    p = tl.load(pos_ptr + n)
    slots = tl.arange(0, K_BLOCK)
    blk = tl.where(slots < K, p // _BLOCK_C - slots, -1)
    ctx = emit_sparse_block_table_row(
        blk,
        p,
        bt_ptr,
        1,
        M,
        out_ptr + n * K * _PAGES_C,
        K,
        K_BLOCK=K_BLOCK,
        BLOCK_PAGE_STRIDE=STRIDE,
        SPARSE_BLOCK=_BLOCK_C,
        PAGES=_PAGES_C,
    )
    tl.store(ctx_ptr + n, ctx)


def test_device_function_is_reusable(device):
    pos = torch.tensor([0, 5, 130, 400, 700], device=device)
    table = torch.tensor([2, 4, 6, 8, 10, 12], device=device)
    k = 3
    sbt, ctx = poisoned_out(1, 5, k, device)
    _countdown_rows[(5,)](pos, table, 6, sbt, ctx, k, K_BLOCK=4, STRIDE=16)
    topk = torch.tensor([[[max(q // BLOCK - j, -1) for j in range(k)] for q in pos.tolist()]], device=device)
    req = torch.zeros(5, dtype=torch.int64, device=device)
    ref = reference.build_sparse_block_table_prefill(topk, table[None], req, pos, 16)
    assert_equal_int(sbt, ref[0], "sparse_bt")
    assert_equal_int(ctx, ref[1], "sparse_ctx")


# --- large shapes and CUDA graphs (GPU only) --------------------------------------------------


def _model_like_selection(pos: torch.Tensor, h: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """``[H, N, K]``: own block first, then distinct earlier blocks by random score, -1 padding."""
    n = pos.shape[0]
    self_blk = torch.div(pos, BLOCK, rounding_mode="floor")
    num_blocks = int(self_blk.max()) + 1
    scores = torch.rand(h, n, num_blocks, generator=gen)
    candidate = torch.arange(num_blocks)[None, None, :] <= self_blk[None, :, None]
    scores = torch.where(candidate, scores, -1.0)
    scores[:, torch.arange(n), self_blk] = 2.0
    values, idx = scores.topk(min(k, num_blocks), dim=-1)
    idx = torch.where(values >= 0, idx, -1)
    if idx.shape[-1] < k:
        idx = torch.cat([idx, torch.full((h, n, k - idx.shape[-1]), -1)], dim=-1)
    return idx


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("stride", STRIDES)
def test_large_decode_and_prefill_on_gpu(stride):
    gen = torch.Generator().manual_seed(0)
    h, k, m = 4, 16, 8192
    # Decode: 1024 requests x 4 speculative tokens = 4096 rows, sequences up to 1M tokens.
    b, dql = 1024, 4
    seq_lens = torch.randint(0, m * BLOCK + 1, (b,), generator=gen)
    seq_lens[:4] = torch.tensor([0, 1, m * BLOCK, 3])
    table = torch.randperm(b * m, generator=gen).reshape(b, m).to(torch.int32)
    pos = decode_rows(seq_lens, dql)[1]
    topk = _model_like_selection(pos.clamp(min=0), h, k, gen)
    topk[:, pos < 0] = -1
    token_major = topk.transpose(0, 1).contiguous().cuda().transpose(0, 1)  # strided [H, N, K] view
    args = (token_major, table.cuda(), seq_lens.cuda(), dql, stride)
    sbt, ctx = poisoned_out(h, b * dql, k, "cuda")
    build_sparse_block_table_decode(*args, out=(sbt, ctx))
    ref = reference.build_sparse_block_table_decode(topk, table, seq_lens, dql, stride)
    assert_equal_int(sbt, ref[0], "sparse_bt")
    assert_equal_int(ctx, ref[1], "sparse_ctx")
    # Prefill: 4096 tokens of 4 requests with 8192-block tables (chunks ending anywhere).
    b, n = 4, 4096
    table = torch.randperm(b * m, generator=gen).reshape(b, m)
    req = torch.arange(n) // (n // b)
    pos = torch.randint(0, m * BLOCK - n // b, (b,), generator=gen)[req] + torch.arange(n) % (n // b)
    pos[::97] = -1
    topk = _model_like_selection(pos.clamp(min=0), h, k, gen).to(torch.int32)
    args = (topk.cuda(), table.cuda(), req.cuda(), pos.cuda(), stride)
    sbt, ctx = poisoned_out(h, n, k, "cuda")
    build_sparse_block_table_prefill(*args, out=(sbt, ctx))
    ref = reference.build_sparse_block_table_prefill(topk, table, req, pos, stride)
    assert_equal_int(sbt, ref[0], "sparse_bt")
    assert_equal_int(ctx, ref[1], "sparse_ctx")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_capture_and_replay():
    h, b, dql, k, m = 2, 8, 2, 16, 64
    gen = torch.Generator().manual_seed(1)
    topk = torch.full((h, b * dql, k), -1, dtype=torch.int32, device="cuda")
    table = torch.randint(0, 1000, (b, m), generator=gen, dtype=torch.int32).cuda()
    seq_lens = torch.ones(b, dtype=torch.int32, device="cuda") * 10
    out = poisoned_out(h, b * dql, k, "cuda")
    build_sparse_block_table_decode(topk, table, seq_lens, dql, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with mm3lab.validation(False), torch.cuda.graph(graph):
        build_sparse_block_table_decode(topk, table, seq_lens, dql, out=out)
    for _ in range(3):
        new_lens = torch.randint(dql, m * BLOCK + 1, (b,), generator=gen, dtype=torch.int32)
        pos = decode_rows(new_lens, dql)[1]
        new_topk = _model_like_selection(pos, h, k, gen).to(torch.int32)
        seq_lens.copy_(new_lens)
        topk.copy_(new_topk)
        poison(out[0]), poison(out[1])
        graph.replay()
        ref = reference.build_sparse_block_table_decode(new_topk, table.cpu(), new_lens, dql)
        assert_equal_int(out[0], ref[0], "sparse_bt")
        assert_equal_int(out[1], ref[1], "sparse_ctx")
