"""The tiled prefill kernel agrees with the page-walking and dense-masked references.

Same cases and tolerances as ``test_attention.py`` (decode, speculative decode,
prefill, both layouts, padded rows, ``ctx`` 0, duplicates, tails mid-page), run
through ``sparse_attention(..., algorithm="tiled")``, plus prefill chunks of
consecutive positions whose tiles share their selections at a chosen level, from
fully shared to fully disjoint, and raw page lists with repeated pages.
Every tile mode is checked: the per-tile rule, the union walk forced and the
row-by-row walk forced.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_attention import (
    TOLERANCE,
    Case,
    assert_lse_close,
    dtypes_for,
    over_shapes,
    poisoned_launch,
    run_dense,
    run_reference,
    shape_cases,
    with_rows,
    write_sequences,
)

import mm3lab
from mm3lab.attention import choose_algorithm, tiled
from mm3lab.attention.checks import readable_pages
from mm3lab.constants import SPARSE_BLOCK_SIZE
from mm3lab.testing import assert_close, poison

TILE_MODES = ["auto", "union", "rows", "auto/tile-programs", "rows/tile-programs"]
"""The kernel's ``mode`` values; ``/tile-programs``: the row walks run one program per tile (``row_programs=False``)."""


def mode_kwargs(name: str) -> dict:
    """``tiled_attention_kernel`` keyword arguments of a :data:`TILE_MODES` name."""
    mode, _, programs = name.partition("/")
    return {"mode": mode, **({"row_programs": False} if programs == "tile-programs" else {})}


def run_tiled(case: Case, mode: str | None = None, **launch):
    """The tiled kernel on poisoned outputs: through ``sparse_attention`` by default, else launched directly
    in tile ``mode`` (a :data:`TILE_MODES` name) with ``launch`` overrides."""
    if mode is not None:
        launch = {**launch, **mode_kwargs(mode)}
        mode = launch.pop("mode")
    if mode is None and not launch:
        out = poison(torch.empty_like(case.q))
        return mm3lab.sparse_attention(*case.args, return_lse=True, out=out, algorithm="tiled")
    return poisoned_launch(tiled.tiled_attention_kernel, case, mode=mode or "auto", **launch)


def check_tiled(case: Case, mode: str | None = None, dense: bool = True, **launch):
    """The tiled kernel's ``(out, lse)`` (as :func:`run_tiled`), checked against the references."""
    dtype = case.q.dtype
    atol, rtol = TOLERANCE[dtype]
    out_ref, lse_ref = run_reference(case)
    out_t, lse_t = run_tiled(case, mode, **launch)
    assert out_t.dtype == dtype
    assert_close(out_t, out_ref, atol=atol, rtol=rtol, name=f"tiled ({mode}) vs reference")
    assert_lse_close(lse_t, lse_ref, atol=max(atol, 1e-4), rtol=rtol)
    if dense and dtype == torch.float32:
        out_dense, _ = run_dense(case)
        assert_close(out_t, out_dense, atol=atol, rtol=rtol, name="tiled vs dense-masked")
    return out_t, lse_t


def make_chunk_case(
    device, layout, shape, seq_lens, chunk, *, overlap, seed, topk=3, dtype=torch.float32, tile=8, pad_rows=0
) -> Case:
    """A prefill chunk: the last ``chunk[r]`` positions of request ``r``, rows consecutive.

    ``shape`` is ``(Hkv, group size, head dim)``. Each run of ``tile`` rows draws one shared selection;
    each row keeps a shared entry with probability ``overlap`` and otherwise picks its own block, so
    ``overlap = 1`` shares everything and ``overlap = 0`` is independent per row.
    """
    hkv, group, d = shape
    sequences = write_sequences(device, layout, shape, seq_lens, dtype, torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed + 1)
    req = torch.cat([torch.full((c,), r) for r, c in enumerate(chunk)] + [torch.zeros(pad_rows, dtype=torch.long)])
    pos = torch.cat(
        [torch.arange(s - c, s) for s, c in zip(seq_lens, chunk, strict=True)] + [torch.full((pad_rows,), -1)]
    )
    n = req.shape[0]
    *_, block_table = sequences
    width_blocks = block_table.shape[1]
    topk_idx = torch.full((hkv, n, topk), -1, dtype=torch.int32)
    for h in range(hkv):
        shared = None
        for i in range(n):
            p = int(pos[i])
            if i % tile == 0 or shared is None:
                top = max(int(p) // SPARSE_BLOCK_SIZE, 0) + 1
                shared = torch.randperm(min(top + 2, width_blocks), generator=g)[:topk].tolist()
            if p < 0:
                continue
            self_blk = p // SPARSE_BLOCK_SIZE
            row = []
            for j in range(topk):
                if torch.rand(1, generator=g) < overlap:
                    row.append(shared[j] if j < len(shared) else -1)
                else:
                    row.append(int(torch.randint(0, min(self_blk + 2, width_blocks), (1,), generator=g)))
            if torch.rand(1, generator=g) < 0.7:
                row[0] = self_blk  # usually the local block; blocks past self_blk are dropped by the table
            topk_idx[h, i] = torch.tensor(row, dtype=torch.int32)
    q = torch.randn(n, hkv * group, d, generator=g).to(dtype)
    return with_rows(sequences, seq_lens, q, topk_idx, req, pos)


# ----------------------------------------------------------------------------
# the cases of test_attention, through the tiled kernel
# ----------------------------------------------------------------------------


@over_shapes
def test_tiled_matches_references(device, layout, mode, dql, shape):
    for case in shape_cases(device, layout, mode, dql, shape):
        check_tiled(case)


@pytest.mark.parametrize("tile_mode", TILE_MODES)
@pytest.mark.parametrize("layout", ["dense", "packed"])
@pytest.mark.parametrize("overlap", [1.0, 0.5, 0.0])
def test_chunk_every_tile_mode(device, tile_mode, layout, overlap):
    """Multi-request chunk (a request ending mid-page, one of length 1), padded rows."""
    case = make_chunk_case(
        device, layout, (2, 4, 32), [263, 1, 150], [13, 1, 9], overlap=overlap, seed=int(overlap * 10), pad_rows=2
    )
    check_tiled(case, tile_mode, tile_rows=4)


@pytest.mark.parametrize("programs", ["row-programs", "tile-programs"])
@pytest.mark.parametrize("launch", [{"row_block_n": 32}, {"row_block_n": 16, "row_num_stages": 1}])
def test_row_walks_with_other_steps(device, programs, launch):
    """The row walks' own settings (tokens per step, pipeline depth; the benchmarks' row-walk arms) keep the
    result: independent selections, where the rule sends every tile to its rows, and forced row walks."""
    case = make_chunk_case(device, "packed", (2, 4, 32), [263, 1, 150], [13, 1, 9], overlap=0.0, seed=5, pad_rows=2)
    for mode in ("auto", "rows"):
        name = mode if programs == "row-programs" else f"{mode}/tile-programs"
        check_tiled(case, name, tile_rows=4, **launch)


@pytest.mark.parametrize("overlap", [1.0, 0.5])
def test_plain_steps_change_nothing(device, overlap):
    """Steps whose pages every row of the tile reads whole, once, skip the per-token weights, and the
    whole steps of them can come first, in a loop without masks (lean steps; read as blocks where the
    GPU allows): the same steps as weighting every step (shared selections make such steps common).
    Bit-identical in the interpreter; compiled, the differently shaped code may round differently."""
    case = make_chunk_case(device, "dense", (1, 4, 32), [700], [40], overlap=overlap, seed=3, topk=4)
    weighted = run_tiled(case, "union", tile_rows=4, plain_steps=False)
    variants = {
        "plain steps tested one by one": dict(lean_steps=False),
        "lean steps": dict(lean_steps=True),
        "lean steps, gathered": dict(lean_steps=True, block_steps=False),
        "default": {},
    }
    for name, launch in variants.items():
        got = run_tiled(case, "union", tile_rows=4, **launch)
        if device == "cpu":
            assert torch.equal(got[0], weighted[0]) and torch.equal(got[1], weighted[1]), name
        else:
            assert_close(got[0], weighted[0], atol=1e-5, rtol=1e-5, name=name)
            assert_close(got[1], weighted[1], atol=1e-5, rtol=1e-5, name=name)
    check_tiled(case, "union", tile_rows=4, lean_steps=True)


@pytest.mark.parametrize("tile_rows,pages", [(8, 1), (16, 2), (32, 4)])
def test_tile_and_step_sizes(device, tile_rows, pages):
    case = make_chunk_case(
        device, "packed", (1, 2, 16), [333], [21], overlap=0.7, seed=tile_rows, topk=4, dtype=torch.float16
    )
    check_tiled(case, "union", tile_rows=tile_rows, pages_per_step=pages)


def test_ctx_zero_and_padded_rows_give_zeros(device):
    cache = mm3lab.allocate_kv_cache(2, 2, 32, "dense", device=device, fill=float("nan"))
    q = torch.randn(5, 4, 32, device=device)
    bt = torch.zeros(2, 5, 8, dtype=torch.int32, device=device)
    ctx = torch.zeros(2, 5, dtype=torch.int32, device=device)
    for mode in TILE_MODES:
        out = poison(torch.empty_like(q))
        lse = poison(torch.empty(5, 4, device=device))
        tiled.tiled_attention_kernel(q, cache.k_cache, cache.v_cache, bt, ctx, 0.2, out, lse, **mode_kwargs(mode))
        assert torch.equal(out.cpu(), torch.zeros(5, 4, 32)), mode
        assert torch.isinf(lse).all() and (lse < 0).all()


@pytest.mark.parametrize("tile_mode", TILE_MODES)
def test_raw_page_lists_with_repeats(device, tile_mode):
    """A page list need not come from a block table: repeated pages (attended twice, as the
    reference does), pages shared by some rows only, tails mid-page, pages outside the cache skipped
    with validation off."""
    g = torch.Generator().manual_seed(5)
    hkv, group, d, n, width = 2, 2, 16, 9, 8
    cache = mm3lab.allocate_kv_cache(2, hkv, d, "packed", device=device, fill=0.0)
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=g).to(device))
    readable = min(cache.k_cache.shape[0], cache.v_cache.shape[0])
    bt = torch.randint(0, 4, (hkv, n, width), generator=g, dtype=torch.int32)
    bt[0, 0] = torch.tensor([3, 3, 3, 1, 2, 3, 0, 0], dtype=torch.int32)
    bt[1, 4, 2] = readable + 3  # outside the cache: skipped
    ctx = torch.randint(0, width * 16 + 1, (hkv, n), generator=g, dtype=torch.int32)
    ctx[0, 1] = 0
    q = torch.randn(n, hkv * group, d, generator=g).to(device)
    bt, ctx = bt.to(device), ctx.to(device)
    with mm3lab.validation(False):
        expected, lse_e = mm3lab.reference.sparse_attention(q, cache.k_cache, cache.v_cache, bt, ctx, return_lse=True)
        out = poison(torch.empty_like(q))
        lse = poison(torch.empty(n, hkv * group, device=device))
        tiled.tiled_attention_kernel(
            q, cache.k_cache, cache.v_cache, bt, ctx, d**-0.5, out, lse, **mode_kwargs(tile_mode)
        )
    assert_close(out, expected, atol=2e-5, rtol=2e-5)
    assert_lse_close(lse, lse_e, 1e-4, 2e-5)


def test_tile_config_bounds_the_prepass_sort():
    """The model's group of 16 takes 4-row tiles; very wide page lists take fewer rows so that the
    pre-pass sorts at most PREPASS_MAX_ENTRIES entries per tile, never fewer than 16 query vectors."""
    cfg = tiled.tiled_config(4096, 64, 4, 128, 128, "cpu")
    assert cfg["T"] * 16 == tiled.TILE_QUERY_VECTORS and cfg["PAGES"] == tiled.TILE_PAGES
    for group, width in [(1, 128), (1, 512), (2, 1024), (16, 4096), (1, 4096)]:
        t = tiled.tiled_config(4096, group * 4, 4, 128, width, "cpu")["T"]
        w_pad = 1 << (width - 1).bit_length()
        assert t * group >= 16
        assert t * w_pad <= tiled.PREPASS_MAX_ENTRIES or t * group == 16


def test_dispatch_rule():
    from mm3lab.attention import TILED_MIN_ROWS

    assert choose_algorithm(1) == "rows"
    assert choose_algorithm(TILED_MIN_ROWS - 1) == "rows"  # decode / spec decode batches
    assert choose_algorithm(TILED_MIN_ROWS) == "tiled"  # prefill chunks: each tile chooses on the device
    assert choose_algorithm(1, "tiled") == "tiled"
    assert choose_algorithm(TILED_MIN_ROWS, "rows") == "rows"
    with pytest.raises(ValueError, match="algorithm"):
        choose_algorithm(1, "flash")


def test_neighbour_share():
    blocks = torch.tensor([[[3, 5], [5, 3], [7, 9], [7, 9]]], dtype=torch.int32)  # slot starts, 1 head, 4 rows
    bt = (blocks.repeat_interleave(8, -1) * 8 + torch.arange(8).repeat(2)).to(torch.int32)
    ctx = torch.tensor([[256, 256, 256, 100]], dtype=torch.int32)  # the last row uses its first slot only
    # row 1 shares 2 of 2, row 2 0 of 2, row 3 1 of 1
    assert abs(float(tiled.neighbour_share(bt, ctx)) - 3 / 5) < 1e-6


def _read(tables):
    """A pre-pass's tables as the tiled kernel reads them: ``whole``, ``live`` and ``plain`` zeroed past each
    tile's ``count`` (the Triton pre-pass leaves them unspecified there)."""
    union, count, row_pages, whole, live, plain, lean = tables
    past = torch.arange(union.shape[-1], device=union.device) >= count.unsqueeze(-1)
    whole = whole.masked_fill(past.unsqueeze(-1), 0)
    return union, count, row_pages, whole, live.masked_fill(past, 0), plain.masked_fill(past, 0), lean


@pytest.mark.parametrize("prepass", [tiled.tile_unions, tiled.tile_unions_kernel])
def test_tile_unions_lists_distinct_used_pages(device, prepass):
    bt = torch.tensor([[[5, 6, 7, 9], [6, 2, 6, 9], [1, 1, 1, 1]]], dtype=torch.int32, device=device)
    ctx = torch.tensor([[40, 64, 0]], dtype=torch.int32, device=device)  # 3 pages (the last 8 tokens), 4, none
    union, count, row_pages, whole, live, plain, lean = _read(prepass(bt, ctx, num_pages=9, tile_rows=2))  # 9: outside
    assert count.tolist() == [[4, 0]] and row_pages.tolist() == [[6, 0]]
    assert union[0, 0, :4].tolist() == [2, 5, 6, 7] and (union[0, 0, 4:] == -1).all()
    # whole-page uses per (union page, row): page 6 twice in row 1; page 7 is row 0's tail, read in part
    assert whole[0, 0, :4].tolist() == [[0, 1], [1, 0], [1, 2], [0, 0]]
    assert not whole[0, 0, 4:].any() and not whole[0, 1].any()
    assert live[0, 0, :4].tolist() == [16, 16, 16, 8] and not live[0, 0, 4:].any()
    assert not plain.any() and not lean.any()  # no page is read whole exactly once by both rows
    bt2 = torch.tensor([[[3, 4, 8, 1], [4, 3, 1, 8]]], dtype=torch.int32, device=device)
    ctx2 = torch.tensor([[64, 20]], dtype=torch.int32, device=device)  # row 1 reads 4 tokens of page 3
    union, count, _, whole, live, plain, lean = _read(prepass(bt2, ctx2, num_pages=9, tile_rows=2))
    # the plain page (4) first, then the others in page order (1 and 8: row 0's only; 3: row 1's tail)
    assert count.tolist() == [[4]] and lean.tolist() == [[[0, 1]]]
    assert union[0, 0, :4].tolist() == [4, 1, 3, 8] and plain[0, 0].tolist() == [1, 0, 0, 0, 0, 0, 0, 0]
    assert whole[0, 0, :4].tolist() == [[1, 1], [1, 0], [1, 0], [1, 0]]
    assert live[0, 0, :4].tolist() == [16, 16, 16, 16]
    # steps of 2 pages: 4 and 5 are a whole aligned group of plain pages (ids 4 // 2 == 5 // 2), 7 is not
    bt3 = torch.tensor([[[7, 5, 4, 2], [4, 7, 5, 3]]], dtype=torch.int32, device=device)
    ctx3 = torch.tensor([[64, 56]], dtype=torch.int32, device=device)  # row 1 reads 8 tokens of page 3
    union, count, _, whole, _, plain, lean = _read(prepass(bt3, ctx3, num_pages=9, tile_rows=2, step_pages=2))
    assert lean.tolist() == [[[2, 3]]] and union[0, 0, :5].tolist() == [4, 5, 7, 2, 3]
    assert plain[0, 0, :5].tolist() == [1, 1, 1, 0, 0] and whole[0, 0, 3:5].tolist() == [[1, 0], [0, 0]]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_tile_unions_kernel_matches_torch(device, data):
    """The Triton pre-pass gives the PyTorch pre-pass's tables exactly: random page lists with repeats,
    pages outside the cache, padded rows, tails mid-page, ``ctx`` 0; int32 and int64 sort keys; the
    union's order for steps of 1 to 8 pages (compared where the tiled kernel reads them)."""
    hkv = data.draw(st.integers(1, 2))
    n = data.draw(st.integers(1, 12))
    width = data.draw(st.integers(1, 12))
    tile_rows = data.draw(st.sampled_from([1, 2, 4, 8]))
    step_pages = data.draw(st.sampled_from([1, 2, 4, 8]))
    pages = data.draw(st.integers(1, 10))
    seed = data.draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    bt = torch.randint(-1, pages + 2, (hkv, n, width), generator=g, dtype=torch.int32)
    ctx = torch.randint(-2, width * 16 + 3, (hkv, n), generator=g, dtype=torch.int32)
    if data.draw(st.booleans()):  # int64 lengths beyond int32 clamp, never wrap
        ctx = ctx.long() + (ctx > width * 8).long() * 2**32
    if data.draw(st.booleans()):  # a cache too large for int32 sort keys: the int64 keys
        pages = 2**27
    bt, ctx = bt.to(device), ctx.to(device)
    want = tiled.tile_unions(bt, ctx, pages, tile_rows, step_pages)
    got = _read(tiled.tile_unions_kernel(bt, ctx, pages, tile_rows, step_pages))
    for name, a, b in zip(("union", "count", "row_pages", "whole", "live", "plain", "lean"), got, want, strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("prepass", ["kernel", "torch", "fused"])
def test_both_prepasses_give_the_same_output(device, prepass):
    case = make_chunk_case(device, "packed", (2, 4, 32), [500, 90], [33, 20], overlap=0.6, seed=9, pad_rows=1)
    check_tiled(case, "union", tile_rows=4, prepass=prepass)


@pytest.mark.parametrize("tile_mode", ["auto", "auto/tile-programs"])
@pytest.mark.parametrize("prepass", ["kernel", "fused", "fused-all-tables"])
def test_rule_splits_a_chunk_between_both_walks(device, prepass, tile_mode, monkeypatch):
    """The rule sends some tiles to their union and some to their rows (a factor between the tiles'
    ratios): exact either way, and the same bits from each pre-pass (the launch's own, which gives the
    tiles that walk their rows their counts only or, ``fused-all-tables``, every table; a launch of its
    own; PyTorch's), which the two launches' choices are made from."""
    if prepass == "fused-all-tables":
        monkeypatch.setattr(tiled, "PREPASS_BY_RULE", False)
        prepass = "fused"
    case = make_chunk_case(device, "packed", (2, 4, 32), [700, 300], [40, 24], overlap=0.5, seed=4, topk=4)
    readable = readable_pages(case.cache.k_cache, case.cache.v_cache)
    _, count, row_pages, *_ = tiled.tile_unions(case.sparse_bt, case.sparse_ctx, readable, 4)
    ratio = (count.float() / row_pages.clamp(min=1).float()).flatten().sort().values
    factor = float(ratio[len(ratio) // 2])
    by_union = count.float() <= factor * row_pages.float()
    assert by_union.any() and not by_union.all()
    got = check_tiled(case, tile_mode, tile_rows=4, prepass=prepass, row_mode_factor=factor)
    other = run_tiled(case, "auto", tile_rows=4, prepass="torch", row_mode_factor=factor)
    assert torch.equal(got[0], other[0]) and torch.equal(got[1], other[1])


# ----------------------------------------------------------------------------
# overlap levels, property-based
# ----------------------------------------------------------------------------


@st.composite
def chunk_cases(draw, device):
    hkv = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 2, 3, 4, 8, 16]))
    d = draw(st.sampled_from([16, 32, 48]))
    b = draw(st.integers(1, 3))
    seq_lens = draw(st.lists(st.integers(1, 400), min_size=b, max_size=b))
    chunk = [draw(st.integers(1, min(s, 12))) for s in seq_lens]
    return make_chunk_case(
        device,
        draw(st.sampled_from(["dense", "packed"])),
        (hkv, group, d),
        seq_lens,
        chunk,
        dtype=draw(st.sampled_from(dtypes_for(device))),
        topk=draw(st.integers(1, 4)),
        overlap=draw(st.sampled_from([0.0, 0.25, 0.5, 0.9, 1.0])),
        seed=draw(st.integers(0, 2**16)),
        tile=draw(st.sampled_from([2, 4, 8])),
        pad_rows=draw(st.integers(0, 2)),
    )


@settings(max_examples=20)
@given(data=st.data())
def test_property_overlap_cpu(data):
    case = data.draw(chunk_cases("cpu"))
    lean = data.draw(st.sampled_from([None, True, False]))  # lean steps: the default (off here), on, off
    check_tiled(case, data.draw(st.sampled_from(TILE_MODES)), dense=False, lean_steps=lean)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@settings(max_examples=40)
@given(data=st.data())
def test_property_overlap_cuda(data):
    case = data.draw(chunk_cases("cuda"))
    lean = data.draw(st.sampled_from([None, True, False]))  # lean steps: the default (block steps from sm_90), on, off
    check_tiled(case, data.draw(st.sampled_from(TILE_MODES)), lean_steps=lean)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("overlap", [1.0, 0.6, 0.0])
def test_model_shape_chunk_cuda(dtype, overlap):
    """64 query heads, 4 KV heads, head dim 128, top-k 16: a 300-token chunk of two requests."""
    case = make_chunk_case(
        "cuda", "packed", (4, 16, 128), [3000, 1700], [200, 100], overlap=overlap, seed=3, topk=16, dtype=dtype, tile=8
    )
    for mode in TILE_MODES:
        check_tiled(case, mode)
    assert math.isfinite(float(run_tiled(case)[0].float().abs().max()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("layout", ["dense", "packed"])
@pytest.mark.parametrize("overlap", [1.0, 0.7])
@pytest.mark.parametrize("tile_rows,pages", [(4, 4), (8, 8), (4, 2)])
def test_block_steps_change_nothing_cuda(layout, overlap, tile_rows, pages):
    """From Hopper on, a lean step of a whole aligned group of consecutive page ids reads its K and V as
    one block each: the same as gathering them page by page, and exact."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("block steps need compute capability 9 or newer")
    case = make_chunk_case(
        "cuda", layout, (2, 16, 128), [900, 700], [300, 200], overlap=overlap, seed=5, topk=8, dtype=torch.bfloat16
    )
    cache = case.cache
    assert tiled._block_descriptors(cache.k_cache, cache.v_cache, pages, True) is not None
    readable = readable_pages(cache.k_cache, cache.v_cache)
    lean = tiled.tile_unions(case.sparse_bt, case.sparse_ctx, readable, tile_rows, pages)[-1]
    assert (lean[..., 0] >= pages).any()  # some tiles take block steps
    launch = dict(tile_rows=tile_rows, pages_per_step=pages, num_warps=8 if tile_rows == 8 else 4)
    blocks = run_tiled(case, "union", block_steps=True, **launch)
    gathered = run_tiled(case, "union", block_steps=False, lean_steps=True, **launch)
    assert_close(blocks[0], gathered[0], atol=1e-2, rtol=1e-2, name="block steps vs gathered")  # (bf16)
    assert_close(blocks[1], gathered[1], atol=1e-4, rtol=1e-4, name="block steps vs gathered (LSE)")
    check_tiled(case, "union", **launch)
    check_tiled(case, "auto", **launch)


def test_block_steps_only_where_a_copy_can_read_them(monkeypatch):
    """The block steps' tensor descriptors are made only for contiguous ``[pages, 16, Hkv, D]`` caches with a
    head dim that is a power of two from 16 to 256, on a device that has them, and when asked for; the
    interpreter never takes them (checked here with the device's answer and the backend forced)."""
    monkeypatch.setattr(tiled.backend, "INTERPRETER", False)
    monkeypatch.setattr(tiled, "blocks_enabled", lambda device: True)

    def descs(d=128, pages=4, wanted=True, contiguous=True, dtype=torch.bfloat16):
        k = torch.zeros(8, 16, 2, d, dtype=dtype)
        v = torch.zeros_like(k)
        if not contiguous:
            k = torch.zeros(8, 16, 4, d, dtype=dtype)[:, :, ::2]
        return tiled._block_descriptors(k, v, pages, wanted)

    got = descs()
    assert got is not None and [list(x.block_shape) for x in got] == [[64, 128], [64, 128]]
    assert list(got[0].shape) == [8 * 16, 2 * 128]
    assert descs(d=16, pages=16, dtype=torch.float32) is not None
    for kw in ({"wanted": False}, {"contiguous": False}, {"d": 24}, {"d": 512}, {"d": 8}, {"pages": 32}):
        assert descs(**kw) is None, kw
    monkeypatch.setattr(tiled, "blocks_enabled", lambda device: False)
    assert descs() is None
