"""Sparse paged attention (SPEC section 5): kernel, page-walking reference and dense-masked reference agree.

Every case writes a request's contiguous K/V into a NaN-filled paged cache,
selects blocks, builds the sparse block table and then checks

* kernel (poisoned output) == page-walking reference, to the dtype's tolerance;
* page-walking reference == dense-masked reference (whole sequence, mask
  "causal and block selected"), the independent route, in float32.

A read of any cache slot that was never written (past a sequence, a padded
page) would bring a NaN into the output and fail.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mm3lab
from mm3lab import reference
from mm3lab.attention import kernel as attn_kernel
from mm3lab.constants import PAGE_SIZE, PAGES_PER_SPARSE_BLOCK, SPARSE_BLOCK_SIZE
from mm3lab.rows import decode_rows
from mm3lab.testing import assert_close, assert_same, poison, relative_error, run_paths

# (atol, rtol) of the kernel against the float32 reference, per input dtype.
TOLERANCE = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (3e-3, 3e-3),
    torch.bfloat16: (2e-2, 2e-2),
}
REF_TOL = (1e-5, 1e-5)  # page-walking vs dense-masked reference (both float32 arithmetic)


def dtypes_for(device):
    return [torch.float32, torch.float16] + ([torch.bfloat16] if device == "cuda" else [])


# ----------------------------------------------------------------------------
# cases
# ----------------------------------------------------------------------------


@dataclasses.dataclass
class Case:
    q: torch.Tensor  # [N, Hq, D]
    key: torch.Tensor  # [B, S, Hkv, D] the requests' whole sequences
    value: torch.Tensor
    cache: mm3lab.PagedKVCache
    block_table: torch.Tensor  # [B, M]
    seq_lens: torch.Tensor  # [B]
    topk_idx: torch.Tensor  # [Hkv, N, topk]
    query_req_id: torch.Tensor  # [N]
    query_abs_pos: torch.Tensor  # [N]
    sparse_bt: torch.Tensor  # [Hkv, N, topk * 8]
    sparse_ctx: torch.Tensor  # [Hkv, N]

    @property
    def args(self) -> tuple:
        """The positional arguments of ``sparse_attention``: ``(q, k_cache, v_cache, sparse_bt, sparse_ctx)``."""
        return self.q, self.cache.k_cache, self.cache.v_cache, self.sparse_bt, self.sparse_ctx


def build_table(topk_idx, block_table, query_req_id, query_abs_pos, stride):
    """The sparse block table of SPEC section 3, row by row."""
    return reference.build_sparse_block_table_prefill(
        topk_idx, block_table, query_req_id, query_abs_pos, block_page_stride=stride
    )


def write_sequences(device, layout, shape, seq_lens, dtype, g):
    """Random whole sequences of the requests, written into a NaN-filled paged cache.

    ``shape`` is ``(Hkv, group size, head dim)``. Returns ``(key, value, cache, block_table)`` on ``device``.
    """
    hkv, _, d = shape
    b = len(seq_lens)
    s_max = max(max(seq_lens), 1)
    m = math.ceil(s_max / SPARSE_BLOCK_SIZE)
    num_blocks = b * m + 1
    block_table = torch.randperm(num_blocks, generator=g)[: b * m].view(b, m).to(torch.int32)
    key = torch.randn(b, s_max, hkv, d, generator=g).to(dtype)
    value = torch.randn(b, s_max, hkv, d, generator=g).to(dtype)
    cache = mm3lab.allocate_kv_cache(num_blocks, hkv, d, layout, dtype=dtype, device=device, fill=float("nan"))
    with mm3lab.use_backend("torch"):  # the KV write is tested in test_layout; here it only fills the cache
        for r, length in enumerate(seq_lens):
            pos = torch.arange(length)
            slots = block_table[r, pos // SPARSE_BLOCK_SIZE].long() * SPARSE_BLOCK_SIZE + pos % SPARSE_BLOCK_SIZE
            mm3lab.write_kv_page16(
                key[r, :length].to(device),
                value[r, :length].to(device),
                cache.k_cache,
                cache.v_cache,
                slots.to(device),
            )
    return key.to(device), value.to(device), cache, block_table.to(device)


def with_rows(sequences, seq_lens, q, topk_idx, req, pos) -> Case:
    """The case of query rows ``(req, pos)`` over :func:`write_sequences`' output, with its sparse block table."""
    key, value, cache, block_table = sequences
    req, pos = req.to(torch.int32), pos.to(torch.int32)
    sparse_bt, sparse_ctx = build_table(topk_idx, block_table.cpu(), req, pos, cache.block_page_stride)
    device = cache.kv.device
    q, *rows = (t.to(device) for t in (q, topk_idx, req, pos, sparse_bt, sparse_ctx))
    return Case(q, key, value, cache, block_table, torch.tensor(seq_lens, device=device), *rows)


STANDARD_SEQ_LENS = (300, 1, 141)
"""Three requests: one ending mid-page in its third block, a single token, one ending mid-page in its second."""


def make_case(
    device,
    layout,
    mode,
    shape,
    *,
    seq_lens=STANDARD_SEQ_LENS,
    topk=3,
    seed=0,
    dtype=torch.float32,
    dql=1,
    rows=None,
    pad_rows=0,
) -> Case:
    """A seeded case; ``shape`` is ``(Hkv, group size, head dim)``.

    ``mode``: ``"decode"`` (the last ``dql`` positions of each request) or ``"prefill"`` (``rows`` random
    positions, all when None, then ``pad_rows`` padded rows at position -1).
    """
    hkv, group, d = shape
    g = torch.Generator().manual_seed(seed)
    sequences = write_sequences(device, layout, shape, seq_lens, dtype, g)
    if mode == "decode":
        req, pos = decode_rows(torch.tensor(seq_lens), dql)
    else:
        pairs = [(r, p) for r, length in enumerate(seq_lens) for p in range(length)]
        pick = torch.randperm(len(pairs), generator=g)[: rows or len(pairs)].tolist()
        req = torch.tensor([pairs[i][0] for i in pick] + [0] * pad_rows, dtype=torch.long)
        pos = torch.tensor([pairs[i][1] for i in pick] + [-1] * pad_rows, dtype=torch.long)
    pos = torch.where(pos < 0, -1, pos)
    n = req.shape[0]
    topk_idx = torch.full((hkv, n, topk), -1, dtype=torch.int32)
    for h in range(hkv):
        for i in range(n):
            p = int(pos[i])
            if p < 0:
                continue
            self_blk = p // SPARSE_BLOCK_SIZE
            pool = torch.randperm(self_blk + 1, generator=g).tolist()
            count = int(torch.randint(1, topk + 1, (1,), generator=g))
            chosen = pool[:count]
            if torch.rand(1, generator=g) < 0.8 and self_blk not in chosen:  # usually the local block
                chosen = [self_blk] + chosen[: topk - 1]
            if torch.rand(1, generator=g) < 0.2 and len(chosen) < topk:  # a duplicate
                chosen.append(chosen[0])
            topk_idx[h, i, : len(chosen)] = torch.tensor(chosen, dtype=torch.int32)
    q = torch.randn(n, hkv * group, d, generator=g).to(dtype)
    return with_rows(sequences, seq_lens, q, topk_idx, req, pos)


def poisoned_launch(kernel, case: Case, **launch):
    """``kernel(*case.args, scale, out, lse, **launch)`` into poisoned outputs: ``(out, lse)``."""
    n, hq, d = case.q.shape
    out = poison(torch.empty_like(case.q))
    lse = poison(torch.empty(n, hq, dtype=torch.float32, device=case.q.device))
    kernel(*case.args, d**-0.5, out, lse, **launch)
    return out, lse


def run_kernel(case: Case, **launch):
    """The Triton kernel on poisoned outputs (``launch`` overrides num_splits / block_n)."""
    if launch:
        return poisoned_launch(attn_kernel.sparse_attention_kernel, case, **launch)
    return mm3lab.sparse_attention(*case.args, return_lse=True, out=poison(torch.empty_like(case.q)))


def run_reference(case: Case):
    """The PyTorch reference on the case's sparse block table: ``(out, lse)``."""
    return reference.sparse_attention(*case.args, return_lse=True)


def run_dense(case: Case):
    return reference.dense_masked_attention(
        case.q.float(),
        case.key.float(),
        case.value.float(),
        case.topk_idx,
        case.query_req_id,
        case.query_abs_pos,
        return_lse=True,
    )


def assert_lse_close(actual, expected, atol, rtol, name="lse"):
    empty = torch.isinf(expected.cpu())
    assert torch.equal(torch.isinf(actual.cpu()), empty), f"{name}: -inf (ctx == 0) rows differ"
    finite = actual.cpu().masked_fill(empty, 0), expected.cpu().masked_fill(empty, 0)
    assert_close(*finite, atol=atol, rtol=rtol, name=name)


def attention_every_path(case: Case, **launch):
    """Every path of ``sparse_attention`` (:func:`mm3lab.testing.run_paths`) on poisoned outputs,
    the kernel path launched directly when ``launch`` overrides num_splits / block_n: each within
    the dtype's tolerance of the reference; in float32 the reference also matches dense-masked attention."""
    dtype = case.q.dtype
    atol, rtol = TOLERANCE[dtype]
    got = run_paths(
        mm3lab.sparse_attention, lambda: (case.args, {"return_lse": True, "out": poison(torch.empty_like(case.q))})
    )
    if launch:
        got["kernel"] = run_kernel(case, **launch)
    out_ref, lse_ref = got.pop("reference")
    for path, (out, lse) in got.items():
        assert out.dtype == dtype
        assert_same(out, out_ref, f"out: {path} vs reference", atol=atol, rtol=rtol)
        assert_lse_close(lse, lse_ref, atol=max(atol, 1e-4), rtol=rtol, name=f"lse: {path} vs reference")
    if dtype == torch.float32:
        out_dense, lse_dense = run_dense(case)
        assert_same(out_ref, out_dense, "reference vs dense-masked", atol=REF_TOL[0], rtol=REF_TOL[1])
        assert_lse_close(lse_ref, lse_dense, *REF_TOL)
    return out_ref


# ----------------------------------------------------------------------------
# parametrized agreement
# ----------------------------------------------------------------------------

SHAPES = [(1, 1, 64), (2, 4, 128), (4, 3, 80), (1, 16, 96)]  # (Hkv, group size, head dim)
MODES = [("decode", 1), ("decode", 3), ("prefill", None)]  # decode, speculative decode, prefill


def shape_cases(device, layout, mode, dql, shape):
    """The cases of one (layout, mode, shape), one per dtype the device runs (shared with test_attention_tiled)."""
    hkv, group, d = shape
    seed = hkv * 100 + group * 10 + d
    for dtype in dtypes_for(device):
        yield make_case(device, layout, mode, shape, dtype=dtype, seed=seed, dql=dql or 1, rows=6, pad_rows=1)


def over_shapes(test):
    """Parametrize ``test(device, layout, mode, dql, shape)`` over both layouts, :data:`MODES` and :data:`SHAPES`."""
    test = pytest.mark.parametrize("shape", SHAPES, ids=lambda shape: "-".join(map(str, shape)))(test)
    test = pytest.mark.parametrize("mode,dql", MODES, ids=["decode", "spec_decode", "prefill"])(test)
    return pytest.mark.parametrize("layout", ["dense", "packed"])(test)


@over_shapes
def test_kernel_matches_references(device, layout, mode, dql, shape):
    for case in shape_cases(device, layout, mode, dql, shape):
        attention_every_path(case)


@pytest.mark.parametrize("merge", ["own", "launch"])
@pytest.mark.parametrize("num_splits,block_n", [(1, 16), (2, 32), (3, 64), (7, 16), (64, 32)])
def test_split_over_pages_and_merge(device, num_splits, block_n, merge):
    """Any split count and step size gives the same output, whoever merges the splits; empty splits
    (past ctx) contribute nothing."""
    case = make_case(device, "packed", "decode", (2, 5, 64), seq_lens=[517, 20], topk=4, seed=num_splits)
    attention_every_path(case, num_splits=num_splits, block_n=block_n, merge=merge)


@pytest.mark.parametrize("num_splits,block_n", [(2, 32), (5, 16), (12, 16), (32, 16)])
def test_both_merges_give_the_same_bits(device, num_splits, block_n):
    """The last split merging (eager calls) and the merge launch (CUDA graphs) sum the splits in one
    order: the same output and lse bit for bit, in every dtype, with and without the lse; and the
    arrival counters are all zero again after each launch."""
    if device == "cpu" and num_splits > 16:
        pytest.skip("32 splits: on the GPU (the interpreter takes most of a minute; 12 splits run here)")
    for dtype in dtypes_for(device):
        case = make_case(device, "dense", "decode", (2, 16, 64), dtype=dtype, seq_lens=[500, 130, 17], topk=4, seed=5)
        counters = attn_kernel.merge_counters(torch.device(device))
        for with_lse in (True, False):
            got = {}
            for merge in ("own", "launch"):
                n, hq, d = case.q.shape
                out = poison(torch.empty_like(case.q))
                lse = poison(torch.empty(n, hq, dtype=torch.float32, device=device)) if with_lse else None
                launch = {"num_splits": num_splits, "block_n": block_n, "merge": merge}
                attn_kernel.sparse_attention_kernel(*case.args, d**-0.5, out, lse, **launch)
                got[merge] = (out, lse)
                assert int(counters.abs().sum()) == 0, merge
            assert torch.equal(got["own"][0], got["launch"][0]), (dtype, with_lse)
            if with_lse:
                assert torch.equal(got["own"][1], got["launch"][1]), dtype
    with pytest.raises(ValueError, match="merge"):
        attn_kernel.sparse_attention_kernel(*case.args, 0.1, torch.empty_like(case.q), None, merge="last")


@pytest.mark.parametrize("num_splits,block_n", [(16, 32), (4, 128), (2, 32)])
def test_page_ids_past_ctx_are_never_attended(device, num_splits, block_n):
    """Table entries past a row's ctx that name NaN pages inside the cache: the output ignores them,
    whether a program reads its step's page ids before the ctx (one step a split) or after."""
    hkv, d, width = 2, 32, 32
    cache = mm3lab.allocate_kv_cache(8, hkv, d, "dense", device=device, fill=float("nan"))
    g = torch.Generator().manual_seed(11)
    live_pages = torch.arange(0, 16)  # pages 0 .. 15 hold numbers; 16 .. 63 stay NaN
    for view in (cache.k_cache, cache.v_cache):
        view[live_pages] = torch.randn(16, PAGE_SIZE, hkv, d, generator=g).to(device)
    n = 3
    bt = torch.randint(0, 16, (hkv, n, width), generator=g, dtype=torch.int32)
    ctx = torch.tensor([[37, 0, 300], [512, 129, 16]], dtype=torch.int32)
    for h in range(hkv):
        for r in range(n):
            used = -(-int(ctx[h, r]) // PAGE_SIZE)
            bt[h, r, used:] = torch.randint(16, 64, (width - used,), generator=g)  # NaN pages past ctx
    q = torch.randn(n, hkv * 4, d, generator=g).to(device)
    bt, ctx = bt.to(device), ctx.to(device)
    args = (q, cache.k_cache, cache.v_cache, bt, ctx)
    want, want_lse = reference.sparse_attention(*args, return_lse=True)
    out, lse = poison(torch.empty_like(q)), poison(torch.empty(n, hkv * 4, dtype=torch.float32, device=device))
    attn_kernel.sparse_attention_kernel(*args, d**-0.5, out, lse, num_splits=num_splits, block_n=block_n)
    assert not torch.isnan(out).any()
    assert_close(out, want, atol=2e-5, rtol=2e-5)
    assert_lse_close(lse, want_lse, 1e-4, 2e-5)


def test_ctx_zero_gives_zeros(device):
    cache = mm3lab.allocate_kv_cache(2, 2, 32, "dense", device=device, fill=float("nan"))
    q = torch.randn(3, 4, 32, device=device)
    bt = torch.zeros(2, 3, 8, dtype=torch.int32, device=device)
    ctx = torch.zeros(2, 3, dtype=torch.int32, device=device)
    out = poison(torch.empty_like(q))
    out, lse = mm3lab.sparse_attention(q, cache.k_cache, cache.v_cache, bt, ctx, return_lse=True, out=out)
    assert torch.equal(out.cpu(), torch.zeros(3, 4, 32))
    assert torch.isinf(lse).all() and (lse < 0).all()


def test_single_token_returns_its_value(device):
    """ctx = 1: the softmax has one term, so the output is exactly that token's V."""
    cache = mm3lab.allocate_kv_cache(2, 1, 16, "packed", device=device, fill=0.0)
    cache.v_cache[16 + 3, 0, 0] = torch.arange(16.0)
    q = torch.randn(1, 2, 16, device=device)
    bt = torch.tensor([[[16 + 3] + [0] * 7]], dtype=torch.int32, device=device)
    ctx = torch.ones(1, 1, dtype=torch.int32, device=device)
    out = mm3lab.sparse_attention(q, cache.k_cache, cache.v_cache, bt, ctx)
    assert_close(out[0], torch.arange(16.0).expand(2, 16), atol=1e-6, rtol=0)


def test_strided_inputs_and_scale(device):
    """A transposed token-major table, a strided q and an explicit scale."""
    case = make_case(device, "dense", "decode", (2, 2, 64), seq_lens=[200, 129], topk=2, seed=7, dql=2)
    q_wide = torch.randn(case.q.shape[0], case.q.shape[1], 2 * 64, device=device)
    q = q_wide[..., ::2]  # last dim strided
    bt_token_major = case.sparse_bt.transpose(0, 1).contiguous()  # [N, Hkv, W]
    bt = bt_token_major.transpose(0, 1)
    ctx = case.sparse_ctx.t().contiguous().t()
    args = (q, case.cache.k_cache, case.cache.v_cache, bt, ctx, 0.3)
    expected = reference.sparse_attention(*args)
    assert_close(mm3lab.sparse_attention(*args), expected, atol=2e-5, rtol=2e-5)
    assert_close(mm3lab.sparse_attention(q.contiguous(), *args[1:]), expected, atol=2e-5, rtol=2e-5)


def test_bf16_on_cpu_uses_the_exact_path():
    case = make_case("cpu", "dense", "decode", (1, 2, 32), seq_lens=[40], topk=1, seed=3, dtype=torch.bfloat16)
    out = mm3lab.sparse_attention(*case.args)
    expected = run_dense(case)[0].to(torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert_close(out, expected, *(), atol=1e-2, rtol=1e-2)


# ----------------------------------------------------------------------------
# property sweep
# ----------------------------------------------------------------------------


@st.composite
def cases(draw, device):
    hkv = draw(st.sampled_from([1, 2, 4]))
    group = draw(st.integers(1, 16))
    d = draw(st.sampled_from([64, 128, 48, 80]))
    layout = draw(st.sampled_from(["dense", "packed"]))
    mode = draw(st.sampled_from(["decode", "spec_decode", "prefill"]))
    dtype = draw(st.sampled_from(dtypes_for(device)))
    b = draw(st.integers(1, 3))
    seq_lens = draw(st.lists(st.integers(0, 420), min_size=b, max_size=b))
    if mode == "prefill" and sum(seq_lens) == 0:
        seq_lens[0] = 1
    return make_case(
        device,
        layout,
        "prefill" if mode == "prefill" else "decode",
        (hkv, group, d),
        seq_lens=seq_lens,
        topk=draw(st.integers(1, 4)),
        dql=draw(st.integers(2, 4)) if mode == "spec_decode" else 1,
        seed=draw(st.integers(0, 2**16)),
        pad_rows=draw(st.integers(0, 1)),
        dtype=dtype,
        rows=4,
    )


def _property_sweep(device: str, max_examples: int) -> None:
    @settings(max_examples=max_examples)
    @given(data=st.data())
    def sweep(data):
        attention_every_path(data.draw(cases(device)))

    sweep()


def test_property_sweep_cpu():
    _property_sweep("cpu", 25)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_property_sweep_cuda():
    _property_sweep("cuda", 100)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch", [1, 8])
def test_model_shape_cuda(dtype, batch):
    """64 query heads, 4 KV heads, head dim 128, top-k 16 over a few-thousand-token context."""
    seq_lens = [3000 + 97 * i for i in range(batch)]
    case = make_case("cuda", "packed", "decode", (4, 16, 128), seq_lens=seq_lens, topk=16, seed=batch, dtype=dtype)
    attention_every_path(case)
    out_dense, _ = run_dense(case)
    atol, rtol = TOLERANCE[dtype]
    out = run_kernel(case)[0]
    assert_close(out, out_dense, atol=atol, rtol=rtol, name="kernel vs dense-masked")
    assert relative_error(out, out_dense) < (1e-2 if dtype == torch.bfloat16 else 2e-3)


# ----------------------------------------------------------------------------
# bad input
# ----------------------------------------------------------------------------


def small_args(layout="dense", hkv=2, group=2, d=32, n=3, topk=2, device="cpu"):
    cache = mm3lab.allocate_kv_cache(3, hkv, d, layout, fill=0.0, device=device)
    stride = cache.block_page_stride
    q = torch.randn(n, hkv * group, d, device=device)
    pages = torch.arange(topk * PAGES_PER_SPARSE_BLOCK) % PAGES_PER_SPARSE_BLOCK + stride  # block 1's pages
    bt = pages.to(torch.int32).expand(hkv, n, -1).contiguous().to(device)
    ctx = torch.full((hkv, n), topk * SPARSE_BLOCK_SIZE - 5, dtype=torch.int32, device=device)
    return q, cache, bt, ctx


@pytest.mark.parametrize(
    "mutate,error,match",
    [
        (lambda q, c, bt, ctx: (q[:, :3], c.k_cache, c.v_cache, bt, ctx), ValueError, "not a multiple"),
        (lambda q, c, bt, ctx: (q[..., :16], c.k_cache, c.v_cache, bt, ctx), ValueError, "head dim"),
        (lambda q, c, bt, ctx: (q.half(), c.k_cache, c.v_cache, bt, ctx), TypeError, "q: dtype"),
        (lambda q, c, bt, ctx: (q, c.k_cache, c.v_cache, bt.float(), ctx), TypeError, "sparse_bt"),
        (lambda q, c, bt, ctx: (q, c.k_cache, c.v_cache, bt[:1], ctx), ValueError, "sparse_bt"),
        (lambda q, c, bt, ctx: (q, c.k_cache, c.v_cache, bt, ctx[:, :2]), ValueError, "sparse_ctx"),
        (lambda q, c, bt, ctx: (q, c.k_cache, c.v_cache, bt.clone().fill_(24), ctx), ValueError, "outside the cache"),
        (lambda q, c, bt, ctx: (q, c.k_cache, c.v_cache, bt.clone().fill_(-1), ctx), ValueError, "outside the cache"),
        (lambda q, c, bt, ctx: (q, c.k_cache, c.v_cache, bt, ctx + 100), ValueError, "sparse_ctx: \\(head 0, row 0\\)"),
        (lambda q, c, bt, ctx: (q, c.k_cache, c.v_cache, bt, ctx - 1000), ValueError, "sparse_ctx"),
        (lambda q, c, bt, ctx: (q, c.k_cache, c.v_cache[:-8], bt, ctx), ValueError, "layout"),
        (lambda q, c, bt, ctx: (q, c.k_cache[..., :16], c.v_cache, bt, ctx), ValueError, "v_cache"),
        (lambda q, c, bt, ctx: (q.numpy(), c.k_cache, c.v_cache, bt, ctx), TypeError, "q:"),
    ],
)
def test_bad_input_raises(mutate, error, match):
    q, cache, bt, ctx = small_args()
    with pytest.raises(error, match=match):
        mm3lab.sparse_attention(*mutate(q, cache, bt, ctx))
    with pytest.raises(error, match=match):
        reference.sparse_attention(*mutate(q, cache, bt, ctx))


def test_bad_input_names_row_and_page():
    q, cache, bt, ctx = small_args(n=4)
    bt[1, 2, 9] = 999
    with pytest.raises(ValueError, match=r"sparse_bt: \(head 1, row 2\) entry 9 is page 999"):
        mm3lab.sparse_attention(q, cache.k_cache, cache.v_cache, bt, ctx)
    bt[1, 2, 9] = 8
    ctx[1, 2] = 0  # unused page ids are not checked
    bt[1, 2, :] = 999
    mm3lab.sparse_attention(q, cache.k_cache, cache.v_cache, bt, ctx)


def test_views_of_different_layouts_raise():
    dense = mm3lab.allocate_kv_cache(2, 1, 16, "dense", fill=0.0)
    packed = mm3lab.allocate_kv_cache(2, 1, 16, "packed", fill=0.0)
    q = torch.randn(1, 1, 16)
    bt = torch.zeros(1, 1, 8, dtype=torch.int32)
    ctx = torch.ones(1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="layout"):
        mm3lab.sparse_attention(q, dense.k_cache, packed.v_cache, bt, ctx)


def test_dense_stride_table_on_packed_cache_raises():
    q, cache, bt, ctx = small_args(layout="packed")
    bt = (bt % PAGES_PER_SPARSE_BLOCK) + 8  # ids 8..15: the V pages of block 0 in the packed layout
    with pytest.raises(ValueError, match="block_page_stride=16"):
        mm3lab.sparse_attention(q, cache.k_cache, cache.v_cache, bt, ctx)


def test_out_buffer_checked():
    q, cache, bt, ctx = small_args()
    with pytest.raises(ValueError, match="out"):
        mm3lab.sparse_attention(q, cache.k_cache, cache.v_cache, bt, ctx, out=torch.empty(1, 4, 32))
    with pytest.raises(TypeError, match="out"):
        mm3lab.sparse_attention(q, cache.k_cache, cache.v_cache, bt, ctx, out=torch.empty_like(q).half())


@pytest.mark.parametrize("layout", ["dense", "packed"])
def test_no_read_outside_the_cache_with_validation_off(device, layout):
    """Views cut out of a NaN-filled buffer: a page id past them, or a ctx past the row, reads nothing outside."""
    hkv, d = 2, 32
    guard = mm3lab.allocate_kv_cache(6, hkv, d, layout, fill=float("nan"), device=device)
    inner = guard.kv[2:4]  # the cache the kernel is told about: blocks 2, 3 of a larger NaN buffer
    g = torch.Generator().manual_seed(0)
    inner.copy_(torch.randn(inner.shape, generator=g).to(device))
    k_cache, v_cache = mm3lab.page16_views(inner, layout) if layout == "packed" else _dense_views(guard, 2, 4)
    stride = mm3lab.sparse_block_page_stride(k_cache, v_cache)
    n, topk = 3, 2
    pages = torch.tensor([j + stride * (j % 2) for j in range(PAGES_PER_SPARSE_BLOCK)] * topk, dtype=torch.int32)
    bt = pages.expand(hkv, n, -1).contiguous()
    bt[0, 0, 3] = k_cache.shape[0] + 50  # past the cache
    bt[1, 1, 0] = -7  # negative
    bt[0, 2, 5] = 2**30  # far past
    ctx = torch.tensor([[250, 256, 9999], [17, 256, -4]], dtype=torch.int32)
    q = torch.randn(n, hkv * 2, d, generator=g).to(device)
    bt, ctx = bt.to(device), ctx.to(device)
    with mm3lab.validation(False):
        out_k, lse_k = mm3lab.sparse_attention(q, k_cache, v_cache, bt, ctx, return_lse=True)
        out_r, lse_r = reference.sparse_attention(q, k_cache, v_cache, bt, ctx, return_lse=True)
    assert not torch.isnan(out_k).any()
    assert_close(out_k, out_r, atol=2e-5, rtol=2e-5)
    assert_lse_close(lse_k, lse_r, 1e-4, 2e-5)
    with pytest.raises(ValueError):
        mm3lab.sparse_attention(q, k_cache, v_cache, bt, ctx)


def _dense_views(guard, lo, hi):
    """Dense-plane views of blocks ``lo .. hi-1`` of a larger dense cache."""
    planes = guard.kv.permute(1, 0, 2, 3, 4)  # [2, nb, 128, H, D]
    h, d = guard.kv.shape[3], guard.kv.shape[4]
    k = planes[0, lo:hi].reshape(-1, PAGE_SIZE, h, d)
    v = planes[1, lo:hi].reshape(-1, PAGE_SIZE, h, d)
    return k, v


def test_launch_config_heuristic():
    cpu = torch.device("cpu")
    big = attn_kernel.launch_config(4096, 64, 4, 128, 128, cpu)
    assert big["num_splits"] == 1
    small = attn_kernel.launch_config(1, 64, 4, 128, 128, cpu)
    assert small["num_splits"] >= 1 and small["BLOCK_N"] % PAGE_SIZE == 0
    wide = attn_kernel.launch_config(1, 8, 1, 256, 8, cpu)["BLOCK_N"]
    assert wide == attn_kernel.launch_config(1, 8, 1, 128, 8, cpu)["BLOCK_N"] // 2  # fewer tokens per step past D 128


def test_launch_config_fp8_small_batches_take_64_token_steps(monkeypatch):
    """Compiled, FP8 K/V: 64-token steps where one split per such step still fits the SMs (the model's
    batch 1 on a 132-SM GPU); bf16 and larger batches keep 128. Plans size their split partials by the
    same rule."""
    monkeypatch.setattr(attn_kernel.backend, "INTERPRETER", False)
    monkeypatch.setattr(attn_kernel, "_device_programs", lambda device: 132)
    dev = torch.device("cpu")
    cfg = lambda n, fp8: attn_kernel.launch_config(n, 64, 4, 128, 128, dev, fp8)  # noqa: E731
    assert cfg(1, False) == {"BLOCK_N": 128, "num_splits": 16}
    assert cfg(1, True) == {"BLOCK_N": 64, "num_splits": 32}
    assert cfg(2, True) == cfg(2, False) == {"BLOCK_N": 128, "num_splits": 16}
    assert cfg(64, True) == {"BLOCK_N": 128, "num_splits": 1}
    assert attn_kernel.num_splits(1, 64, 4, 128, 128, dev, True) == 32
    assert attn_kernel.num_splits(1, 64, 4, 128, 128, dev) == 16
