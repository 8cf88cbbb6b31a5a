"""The index cache insert (SPEC section 2, step 1): kernel against reference, bit for bit.

* parametrized dtypes (float32, float16, bfloat16: the insert only moves bits), strided
  ``index_k``, int32/int64 slots, padding slots, the cache poisoned with NaN first;
* a hypothesis sweep of sizes, head dims and slot patterns;
* bad input raises a clear error naming the argument and leaves the cache bit-identical;
  with validation off a slot past the cache is skipped, never written;
* ``token_slots`` and a prefill-then-decode fill through the same block table as the KV cache;
* on CUDA: 4096 tokens of head dim 128 in bf16.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mm3lab
from mm3lab import reference
from mm3lab.compat import vllm
from mm3lab.constants import SPARSE_BLOCK_SIZE as BLOCK
from mm3lab.index_cache import allocate_index_cache, insert_index_cache, token_slots
from mm3lab.testing import assert_paths_agree, assert_same, poison, run_paths

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def insert_every_path(index_k, cache, slots):
    """Insert through every path (:func:`mm3lab.testing.run_paths`) into a copy of ``cache`` each;
    all must be bit-identical. Returns the kernel's cache."""
    got = run_paths(insert_index_cache, lambda: ((index_k, cache.clone(), slots), {}), result=lambda _, a, kw: a[1])
    assert_paths_agree(got, "index_cache")
    return got["kernel"]


def random_slots(n, num_blocks, gen, pad_every=0, dtype=torch.int64):
    slots = torch.randperm(num_blocks * BLOCK, generator=gen)[:n]
    if pad_every:
        slots[::pad_every] = -1
    return slots.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("n,di", [(1, 8), (37, 24), (130, 64)])
def test_insert_matches_reference(device, dtype, slot_dtype, n, di):
    gen = torch.Generator().manual_seed(n * 7 + di)
    num_blocks = 3
    cache = poison(allocate_index_cache(num_blocks, di, dtype=dtype, device=device))
    index_k = torch.randn(n, di, generator=gen).to(dtype).to(device)
    slots = random_slots(n, num_blocks, gen, pad_every=5, dtype=slot_dtype).to(device)
    got = insert_every_path(index_k, cache, slots)
    # every written slot holds its key; every other slot is still poison
    flat = got.view(-1, di).cpu()
    written = torch.zeros(num_blocks * BLOCK, dtype=torch.bool)
    for row, s in enumerate(slots.tolist()):
        if s >= 0:
            assert_same(flat[s], index_k[row].cpu(), f"slot {s}")
            written[s] = True
    assert torch.isnan(flat[~written].float()).all()


def test_strided_index_k_and_cache(device):
    gen = torch.Generator().manual_seed(3)
    di = 20
    wide = torch.randn(50, 2 * di, generator=gen).to(device)
    index_k = wide[:, 5 : 5 + di]  # row stride 2 * di
    transposed = torch.randn(di, 50, generator=gen).to(device).T  # last dim not contiguous: allowed for index_k
    backing = poison(torch.empty(4, BLOCK, 2 * di, device=device))
    cache = backing[..., :di]  # block and token strides of a wider buffer, head dim contiguous
    slots = random_slots(50, 4, gen, pad_every=7).to(device)
    for keys in (index_k, transposed):
        got = insert_every_path(keys, cache, slots)
        assert_same(got.view(-1, di)[slots[1]], keys[1])


@settings(max_examples=25)
@given(
    n=st.integers(0, 70),
    di=st.sampled_from([1, 3, 16, 40]),
    num_blocks=st.integers(1, 3),
    pad=st.sampled_from([0, 2, 3]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_insert_sweep(n, di, num_blocks, pad, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    n = min(n, num_blocks * BLOCK)
    cache = poison(allocate_index_cache(num_blocks, di, dtype=dtype))
    index_k = torch.randn(n, di, generator=gen).to(dtype)
    slots = random_slots(n, num_blocks, gen, pad_every=pad)
    insert_every_path(index_k, cache, slots)


def test_vllm_name(device):
    gen = torch.Generator().manual_seed(0)
    cache = poison(allocate_index_cache(2, 16, device=device))
    index_k = torch.randn(9, 16, generator=gen).to(device)
    slots = random_slots(9, 2, gen, pad_every=4).to(device)
    expected = cache.clone()
    reference.insert_index_cache(index_k, expected, slots)
    vllm.minimax_m3_insert_index_cache(index_k, cache, slots)
    assert_same(cache, expected)


# --- bad input -------------------------------------------------------------------------------

BAD = [
    # (what, index_k shape / dtype, cache shape / dtype, slots, error, argument named)
    ("index_k rank", (4, 1, 16), torch.float32, (2, BLOCK, 16), torch.float32, "ok", ValueError, "index_k"),
    ("head dim", (4, 8), torch.float32, (2, BLOCK, 16), torch.float32, "ok", ValueError, "head dim"),
    ("cache rank", (4, 16), torch.float32, (2 * BLOCK, 16), torch.float32, "ok", ValueError, "index_cache"),
    ("block size", (4, 16), torch.float32, (2, 64, 16), torch.float32, "ok", ValueError, "index_cache"),
    ("dtype", (4, 16), torch.float16, (2, BLOCK, 16), torch.float32, "ok", TypeError, "index_k"),
    ("int cache", (4, 16), torch.float32, (2, BLOCK, 16), torch.int32, "ok", TypeError, "index_cache"),
    ("slot length", (4, 16), torch.float32, (2, BLOCK, 16), torch.float32, "short", ValueError, "slot_mapping"),
    ("float slots", (4, 16), torch.float32, (2, BLOCK, 16), torch.float32, "float", TypeError, "slot_mapping"),
    ("slot rank", (4, 16), torch.float32, (2, BLOCK, 16), torch.float32, "2d", ValueError, "slot_mapping"),
    ("slot past cache", (4, 16), torch.float32, (2, BLOCK, 16), torch.float32, "past", ValueError, "row 2"),
]


@pytest.mark.parametrize("what,k_shape,k_dtype,c_shape,c_dtype,slots,error,named", BAD, ids=[b[0] for b in BAD])
def test_bad_input_raises_and_leaves_cache_untouched(
    device, what, k_shape, k_dtype, c_shape, c_dtype, slots, error, named
):
    index_k = torch.ones(k_shape, dtype=k_dtype, device=device)
    cache = (
        poison(torch.empty(c_shape, dtype=c_dtype, device=device))
        if c_dtype.is_floating_point
        else torch.full(c_shape, 7, dtype=c_dtype, device=device)
    )
    n = k_shape[0]
    slot_mapping = {
        "ok": torch.arange(n, device=device),
        "short": torch.arange(n - 1, device=device),
        "float": torch.arange(n, device=device).float(),
        "2d": torch.arange(n, device=device).view(n, 1),
        "past": torch.tensor([0, 1, 2 * BLOCK, 3], device=device),
    }[slots]
    before = cache.clone()
    for entry in (insert_index_cache, reference.insert_index_cache, vllm.minimax_m3_insert_index_cache):
        with pytest.raises(error, match=named):
            entry(index_k, cache, slot_mapping)
        assert_same(cache, before)


def test_non_contiguous_cache_head_dim_and_device_mix(device):
    cache = torch.zeros(2, 16, BLOCK, device=device).transpose(1, 2)  # [2, 128, 16], head dim stride 128
    with pytest.raises(ValueError, match="index_cache: the last dimension must be contiguous"):
        insert_index_cache(torch.ones(3, 16, device=device), cache, torch.arange(3, device=device))
    with pytest.raises(TypeError, match="index_k: expected a torch.Tensor"):
        insert_index_cache([1.0], torch.zeros(2, BLOCK, 16, device=device), torch.arange(1, device=device))
    if device == "cuda":
        with pytest.raises(ValueError, match="slot_mapping is on cpu"):
            insert_index_cache(
                torch.ones(3, 16, device=device), torch.zeros(2, BLOCK, 16, device=device), torch.arange(3)
            )


def test_slot_past_cache_with_validation_off_is_skipped(device):
    cache = poison(allocate_index_cache(2, 16, device=device))
    index_k = torch.arange(4 * 16, dtype=torch.float32, device=device).view(4, 16)
    slots = torch.tensor([5, 2 * BLOCK, 10**9, 7], device=device)
    with mm3lab.validation(False):
        got = insert_every_path(index_k, cache, slots)
    flat = got.view(-1, 16)
    assert torch.equal(flat[5], index_k[0]) and torch.equal(flat[7], index_k[3])
    assert int(torch.isnan(flat).all(dim=1).sum()) == 2 * BLOCK - 2  # nothing else written, nowhere outside


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("flag", [None, 0, 5])
def test_a_gated_insert_writes_only_where_every_flag_is_clear(device, fp8, flag):
    """The kernel's gate (what a replayed insert reads: the flags its value check wrote, queued before it):
    all clear, the insert as usual; any one set, nothing written, the FP8 scales included."""
    from mm3lab.index_cache.kernel import insert_index_cache_kernel

    if fp8 and device == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability 8.9")
    g = torch.Generator().manual_seed(3)
    dtype = torch.float8_e4m3fn if fp8 else torch.float32
    cache = allocate_index_cache(3, 32, dtype=dtype, device=device, fill=0.0)
    scale = mm3lab.allocate_index_scale(3, device=device) if fp8 else None
    index_k = torch.randn(6, 32, generator=g).to(device)
    slots = torch.tensor([4, -1, 130, 300, 7, 255], device=device)
    gate = torch.zeros(8, dtype=torch.int32, device=device)
    if flag is not None:
        gate[flag] = 1
    want_cache, want_scale = cache.clone(), None if scale is None else scale.clone()
    if flag is None:
        reference.insert_index_cache(index_k, want_cache, slots, index_scale=want_scale)
    insert_index_cache_kernel(index_k, cache, slots, scale, gate)
    assert torch.equal(cache.view(torch.uint8), want_cache.view(torch.uint8))
    if fp8:
        assert torch.equal(scale, want_scale)
    if flag is None:
        assert int(torch.count_nonzero(cache.float().abs().sum(-1))) == 5  # (the five live slots)


def _checking_insert(device, n, di, fp8, bad_rows, pad_rows, seed):
    """A checking launch (it checks its own slots) against the reference: ``(flag, done, counter)`` and
    whether the cache (and FP8 scales) hold what the reference wrote, or nothing where a slot is bad."""
    from mm3lab.index_cache.kernel import insert_index_cache_kernel

    g = torch.Generator().manual_seed(seed)
    dtype = torch.float8_e4m3fn if fp8 else torch.float32
    num_blocks = 2
    capacity = num_blocks * BLOCK
    cache = allocate_index_cache(num_blocks, di, dtype=dtype, device=device, fill=0.0)
    scale = mm3lab.allocate_index_scale(num_blocks, device=device) if fp8 else None
    index_k = torch.randn(n, di, generator=g).to(device)
    slots = torch.randperm(capacity, generator=g)[:n]
    for r in pad_rows:
        slots[r] = -1
    for i, r in enumerate(bad_rows):
        slots[r] = capacity + i * 37  # (the first one exactly at the end)
    slots = slots.to(device)
    want_cache, want_scale = cache.clone(), None if scale is None else scale.clone()
    if not bad_rows:
        reference.insert_index_cache(index_k, want_cache, slots, index_scale=want_scale)
    flags, count, done = (torch.zeros(1, dtype=torch.int32, device=device) for _ in range(3))
    insert_index_cache_kernel(index_k, cache, slots, scale, check=(flags, count, done))
    same = torch.equal(cache.view(torch.uint8), want_cache.view(torch.uint8))
    if fp8:
        same = same and torch.equal(scale, want_scale)
    return int(flags[0]), int(done[0]), int(count[0]), same


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("n", [6, 100])
@pytest.mark.parametrize("bad_rows", [(), (0,), (5,), (2, 5), (99,), (40, 99)])
def test_a_checking_insert_writes_only_when_every_slot_is_inside(device, fp8, n, bad_rows):
    """An insert's launch that checks its own slots (one program, or four along the tokens: each reads
    every slot): all inside, the insert as usual and its flag clear; any one past the cache, its flag
    set and nothing written by any program, the FP8 scales included. Either way its ``done`` word is
    set and its counter back at zero."""
    if fp8 and device == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability 8.9")
    if any(r >= n for r in bad_rows):
        pytest.skip("rows past the call")
    flag, done, count, same = _checking_insert(device, n, 32, fp8, bad_rows, pad_rows=(1,), seed=3)
    assert (flag, done, count, same) == (int(bool(bad_rows)), 1, 0, True)


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 256),
    di=st.sampled_from([8, 24, 128]),
    data=st.data(),
    seed=st.integers(0, 2**16),
)
def test_checking_insert_sweep(n, di, data, seed):
    """Token counts from one program's to eight programs', head dims, bad and padded rows anywhere
    (CPU: the interpreter)."""
    rows = st.lists(st.integers(0, n - 1), max_size=3, unique=True)
    bad_rows, pad_rows = data.draw(rows), data.draw(rows)
    pad_rows = [r for r in pad_rows if r not in bad_rows]
    flag, done, count, same = _checking_insert("cpu", n, di, False, tuple(bad_rows), pad_rows, seed)
    assert (flag, done, count, same) == (int(bool(bad_rows)), 1, 0, True)


def test_a_checking_insert_reads_every_slot_in_each_program():
    from mm3lab.index_cache.kernel import CHECK_READS, checks_in_launch, insert_index_cache_kernel

    assert CHECK_READS == 2**21
    assert checks_in_launch(1, 128, False) and checks_in_launch(32, 128, True) and checks_in_launch(4096, 128, False)
    assert checks_in_launch(8192, 128, False)  # 256 programs x 8192 slots
    assert not checks_in_launch(8193, 128, False) and not checks_in_launch(0, 128, False)
    assert not checks_in_launch(4096, 1024, False)  # 1024 programs x 4096 slots
    cache = allocate_index_cache(2, 128, fill=0.0)
    check = tuple(torch.zeros(1, dtype=torch.int32) for _ in range(3))
    with pytest.raises(ValueError, match="reads every slot in each program: 8193 keys are too many"):
        insert_index_cache_kernel(torch.zeros(8193, 128), cache, torch.arange(8193), check=check)
    with pytest.raises(ValueError, match="not both"):
        insert_index_cache_kernel(torch.zeros(3, 128), cache, torch.arange(3), gate=check[0], check=check)


def test_empty_insert_is_a_no_op(device):
    cache = poison(allocate_index_cache(1, 8, device=device))
    before = cache.clone()
    insert_index_cache(torch.empty(0, 8, device=device), cache, torch.empty(0, dtype=torch.int64, device=device))
    assert_same(cache, before)


# --- slots from positions, and a prefill then decode fill -----------------------------------


def test_token_slots_follow_the_spec(device):
    bt = torch.tensor([[3, 1], [0, 2]], device=device)
    req = torch.tensor([0, 0, 1, 1, 0], device=device)
    pos = torch.tensor([0, 130, -1, 255, 127], device=device)
    want = [3 * BLOCK, 1 * BLOCK + 2, -1, 2 * BLOCK + 127, 3 * BLOCK + 127]
    assert token_slots(bt, req, pos).tolist() == want
    assert reference.token_slots(bt, req, pos).tolist() == want
    with pytest.raises(ValueError, match="query_abs_pos: row 0"):
        token_slots(bt, req[:1], torch.tensor([2 * BLOCK], device=device))
    with pytest.raises(ValueError, match="query_req_id: row 1"):
        token_slots(bt, torch.tensor([0, 2], device=device), torch.tensor([0, 0], device=device))
    with mm3lab.validation(False):  # unchecked: tokens outside the table are skipped, never read past it
        got = token_slots(
            bt, torch.tensor([0, 2, -1, 1, 0], device=device), torch.tensor([0, 0, 5, 2 * BLOCK, 129], device=device)
        )
        assert got.tolist() == [3 * BLOCK, -1, -1, -1, 1 * BLOCK + 1]


def test_prefill_then_decode_fill_matches_the_sequence(device):
    """Prefill 200 tokens of request 0 and 70 of request 1 (one padded row), then 3 decode steps:
    gathering the cache through the block table gives back each request's keys in order."""
    gen = torch.Generator().manual_seed(11)
    di = 8
    bt = torch.tensor([[4, 0, 2], [1, 3, 5]], device=device)
    cache = poison(allocate_index_cache(6, di, device=device))
    lens = [200, 70]
    keys = [torch.randn(260, di, generator=gen).to(device) for _ in lens]
    req = torch.tensor([0] * 200 + [1] * 70 + [0], device=device)
    pos = torch.cat([torch.arange(200), torch.arange(70), torch.tensor([-1])]).to(device)
    k = torch.cat([keys[0][:200], keys[1][:70], torch.zeros(1, di, device=device)])
    insert_index_cache(k, cache, token_slots(bt, req, pos))
    for _ in range(3):  # one decode token per request
        step_pos = torch.tensor(lens, device=device)
        step_k = torch.stack([keys[r][lens[r]] for r in range(2)])
        insert_index_cache(step_k, cache, token_slots(bt, torch.tensor([0, 1], device=device), step_pos))
        lens = [x + 1 for x in lens]
    for r, seq_len in enumerate(lens):
        gathered = cache[bt[r].long()].reshape(-1, di)[:seq_len]
        assert torch.equal(gathered, keys[r][:seq_len])
        assert torch.isnan(cache[bt[r].long()].reshape(-1, di)[seq_len:]).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_large_bf16_insert_on_cuda():
    gen = torch.Generator().manual_seed(5)
    cache = poison(allocate_index_cache(4096, 128, dtype=torch.bfloat16, device="cuda"))
    index_k = torch.randn(4096, 128, generator=gen).to(torch.bfloat16).cuda()
    slots = random_slots(4096, 4096, gen, pad_every=9).cuda()
    expected = cache.clone()
    expected.view(-1, 128)[slots[slots >= 0]] = index_k[slots >= 0]
    insert_index_cache(index_k, cache, slots)
    assert_same(cache, expected)
