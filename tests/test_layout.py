"""Page-16 KV layouts (SPEC section 4): views, page-id mapping, rebase, K/V writes, bad input."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mm3lab
from mm3lab import reference
from mm3lab.compat import vllm
from mm3lab.constants import PAGE16_SIDES_PER_BLOCK, PAGE_SIZE, PAGES_PER_SPARSE_BLOCK, SPARSE_BLOCK_SIZE
from mm3lab.layout import DENSE_STRIDE, PACKED_STRIDE, kernel, num_cache_blocks
from mm3lab.testing import assert_equal_int, assert_paths_agree, poison, run_paths

LAYOUTS = ("dense", "packed")
STRIDE = {"dense": DENSE_STRIDE, "packed": PACKED_STRIDE}
BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def numbered_cache(layout, num_blocks=3, h=2, d=4, device="cpu", dtype=torch.float32):
    """A cache whose every element holds its own logical index in ``kv`` (all values distinct)."""
    cache = mm3lab.allocate_kv_cache(num_blocks, h, d, layout, dtype=dtype, device=device)
    cache.kv.copy_(torch.arange(cache.kv.numel(), dtype=torch.float32).reshape(cache.kv.shape))
    return cache


def storage_start(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    """Bit-exact equality of float tensors (NaN poison included)."""
    assert actual.dtype == expected.dtype
    assert_equal_int(actual.view(BITS[actual.dtype]), expected.view(BITS[expected.dtype]), name)


# ----------------------------------------------------------------------------
# views are true views
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_views_share_memory_with_the_page128_tensor(layout, device):
    nb, h, d = 3, 2, 4
    cache = mm3lab.allocate_kv_cache(nb, h, d, layout, device=device, fill=0.0)
    kv, k_cache, v_cache = cache.kv, cache.k_cache, cache.v_cache
    assert kv.shape == (nb, 2, SPARSE_BLOCK_SIZE, h, d)
    assert kv_layout_is(kv, layout)
    if layout == "dense":
        assert k_cache.shape == v_cache.shape == (nb * PAGES_PER_SPARSE_BLOCK, PAGE_SIZE, h, d)
        assert v_cache.data_ptr() - k_cache.data_ptr() == nb * PAGES_PER_SPARSE_BLOCK * cache.page_bytes
    else:
        assert k_cache.shape == (nb * PACKED_STRIDE, PAGE_SIZE, h, d)
        assert v_cache.shape == (nb * PACKED_STRIDE - PAGES_PER_SPARSE_BLOCK, PAGE_SIZE, h, d)
        assert v_cache.data_ptr() - k_cache.data_ptr() == PAGES_PER_SPARSE_BLOCK * cache.page_bytes
    for view in (k_cache, v_cache):
        assert storage_start(view) == storage_start(kv)
        assert view.is_contiguous()
    # page16_views of the same tensor again: the same memory, never a copy
    k2, v2 = mm3lab.page16_views(kv)
    assert (k2.data_ptr(), v2.data_ptr()) == (k_cache.data_ptr(), v_cache.data_ptr())
    assert k2.shape == k_cache.shape and v2.shape == v_cache.shape
    k3, v3 = mm3lab.page16_views(kv, layout)
    assert (k3.data_ptr(), v3.data_ptr()) == (k_cache.data_ptr(), v_cache.data_ptr())


def kv_layout_is(kv, layout) -> bool:
    return mm3lab.kv_cache_layout(kv) == layout


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_view_page_lands_where_locate_page_says(layout, device):
    nb = 3
    cache = numbered_cache(layout, nb, device=device)
    base = storage_start(cache.kv)
    for view_name, view in (("k", cache.k_cache), ("v", cache.v_cache)):
        for p in range(view.shape[0]):
            loc = mm3lab.locate_page(p, view_name, layout, nb, cache.page_bytes)
            assert loc.view_index == p and loc.view == view_name
            assert view[p].data_ptr() - base == loc.byte_offset
            t0 = loc.first_token
            assert torch.equal(view[p], cache.kv[loc.block, loc.side, t0 : t0 + PAGE_SIZE])
            if layout == "dense":
                assert loc.side == (0 if view_name == "k" else 1)
        with pytest.raises(ValueError, match="page_id"):
            mm3lab.locate_page(view.shape[0], view_name, layout, nb)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_writes_through_views_and_through_kv_meet(layout, device):
    nb, h, d = 2, 3, 5
    cache = mm3lab.allocate_kv_cache(nb, h, d, layout, device=device, fill=0.0)
    for view_name, side in (("k", 0), ("v", 1)):
        view = cache.k_cache if view_name == "k" else cache.v_cache
        for block, j, r, hh, dd in [(0, 0, 0, 0, 0), (1, 7, 15, 2, 4), (1, 3, 9, 1, 2)]:
            page_id = block * STRIDE[layout] + j
            token = j * PAGE_SIZE + r
            # view -> kv
            cache.kv.zero_()
            view[page_id, r, hh, dd] = 7.0
            hit = torch.nonzero(cache.kv).tolist()
            assert hit == [[block, side, token, hh, dd]]
            # kv -> view
            cache.kv.zero_()
            cache.kv[block, side, token, hh, dd] = 5.0
            assert view[page_id, r, hh, dd].item() == 5.0
            assert torch.count_nonzero(view).item() == 1
            # the location agrees with locate_page
            loc = mm3lab.locate_page(page_id, view_name, layout, nb)
            assert (loc.block, loc.side, loc.page_in_block) == (block, side, j)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_one_page_id_reaches_k_and_v_of_one_block(layout, device):
    """SPEC: page id ``block * stride + j`` reaches block's K page j via k_cache and V page j via v_cache."""
    nb = 3
    cache = numbered_cache(layout, nb, device=device)
    stride = mm3lab.sparse_block_page_stride(cache.k_cache, cache.v_cache)
    assert stride == STRIDE[layout] == cache.block_page_stride
    for b in range(nb):
        ids = mm3lab.page_ids_of_block(b, stride)
        assert ids == [b * stride + j for j in range(PAGES_PER_SPARSE_BLOCK)]
        for j, pid in enumerate(ids):
            rows = slice(j * PAGE_SIZE, (j + 1) * PAGE_SIZE)
            assert torch.equal(cache.k_cache[pid], cache.kv[b, 0, rows])
            assert torch.equal(cache.v_cache[pid], cache.kv[b, 1, rows])
    for slot in (0, 15, 16, 127, 128, 300, nb * SPARSE_BLOCK_SIZE - 1):
        page, row = mm3lab.slot_to_page(slot, stride)
        b, off = divmod(slot, SPARSE_BLOCK_SIZE)
        assert torch.equal(cache.k_cache[page, row], cache.kv[b, 0, off])
        assert torch.equal(cache.v_cache[page, row], cache.kv[b, 1, off])
    assert mm3lab.slot_to_page(-1, stride) is None


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_recognition(layout, device):
    cache = mm3lab.allocate_kv_cache(4, 1, 8, layout, device=device)
    packed = layout == "packed"
    assert mm3lab.sides_are_packed(cache.k_cache, cache.v_cache) is packed
    assert mm3lab.sparse_block_page_stride(cache.k_cache, cache.v_cache) == (16 if packed else 8)
    assert reference.sparse_block_page_stride(cache.k_cache, cache.v_cache) == (16 if packed else 8)
    assert vllm.minimax_m3_sparse_block_page_stride(cache.k_cache, cache.v_cache) == (16 if packed else 8)
    assert mm3lab.check_kv_views(cache.k_cache, cache.v_cache) == cache.block_page_stride
    assert num_cache_blocks(cache.k_cache, cache.v_cache) == 4
    assert mm3lab.kv_cache_layout(cache.kv) == layout
    other = "dense" if packed else "packed"
    with pytest.raises(ValueError, match="kv_cache"):
        mm3lab.page16_views(cache.kv, other)


def test_one_block_edge_case():
    """With one block both memory orders coincide; each view pair keeps its own page ids."""
    packed = numbered_cache("packed", num_blocks=1)
    dense = numbered_cache("dense", num_blocks=1)
    assert torch.equal(packed.kv, dense.kv)
    assert mm3lab.kv_cache_layout(packed.kv) == "dense"  # indistinguishable; reported as dense
    assert packed.k_cache.shape[0] == PACKED_STRIDE and packed.v_cache.shape[0] == PAGES_PER_SPARSE_BLOCK
    assert dense.k_cache.shape[0] == dense.v_cache.shape[0] == PAGES_PER_SPARSE_BLOCK
    assert mm3lab.sides_are_packed(packed.k_cache, packed.v_cache)
    assert not mm3lab.sides_are_packed(dense.k_cache, dense.v_cache)
    # block 0's page ids are 0..7 in both, and reach the same data
    for j in range(PAGES_PER_SPARSE_BLOCK):
        assert torch.equal(packed.k_cache[j], dense.k_cache[j])
        assert torch.equal(packed.v_cache[j], dense.v_cache[j])
    # the packed view of the one-block tensor is still available explicitly
    k, v = mm3lab.page16_views(dense.kv, "packed")
    assert k.shape[0] == PACKED_STRIDE and v.shape[0] == PAGES_PER_SPARSE_BLOCK
    assert v.data_ptr() == dense.v_cache.data_ptr()


# ----------------------------------------------------------------------------
# rebase
# ----------------------------------------------------------------------------

SLOT_EXAMPLE = ([-1, 0, 127, 128, 129, 255, 256], [-1, 0, 127, 256, 257, 383, 512])


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_rebase_block_table_spec_example(dtype, device):
    bt = torch.tensor([-1, 0, 3], dtype=dtype, device=device)
    for fn in (
        mm3lab.rebase_block_table_to_page16,
        reference.rebase_block_table_to_page16,
        vllm.minimax_m3_rebase_block_table_to_page16,
    ):
        got = fn(bt)
        assert got.dtype == dtype and got.device == bt.device
        assert got.tolist() == [-2, 0, 6]
        assert bt.tolist() == [-1, 0, 3]  # input untouched
        out = poison(torch.empty_like(bt))
        assert fn(bt, out=out) is out
        assert out.tolist() == [-2, 0, 6]
        inplace = bt.clone()
        assert fn(inplace, out=inplace) is inplace
        assert inplace.tolist() == [-2, 0, 6]


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_rebase_slot_mapping_spec_example(dtype, device):
    slots = torch.tensor(SLOT_EXAMPLE[0], dtype=dtype, device=device)
    for fn in (mm3lab.rebase_slot_mapping_to_page16, reference.rebase_slot_mapping_to_page16):
        got = fn(slots)
        assert got.dtype == dtype and got.tolist() == SLOT_EXAMPLE[1]


def test_rebase_of_a_strided_block_table_is_contiguous():
    bt = torch.arange(12, dtype=torch.int32).reshape(3, 4).t()
    got = mm3lab.rebase_block_table_to_page16(bt)
    assert got.is_contiguous() and torch.equal(got, bt * 2)
    slots = torch.arange(0, 1000, 7)[::3]
    got = mm3lab.rebase_slot_mapping_to_page16(slots)
    assert got.is_contiguous() and torch.equal(got, reference.rebase_slot_mapping_to_page16(slots))


@settings(max_examples=40)
@given(
    values=st.lists(st.integers(-300, 1 << 20), min_size=0, max_size=24),
    dtype=st.sampled_from([torch.int32, torch.int64]),
    two_d=st.booleans(),
)
def test_rebase_public_equals_reference(values, dtype, two_d):
    t = torch.tensor(values, dtype=dtype)
    if two_d and len(values) % 2 == 0:
        t = t.reshape(2, -1)
    assert_equal_int(mm3lab.rebase_block_table_to_page16(t), reference.rebase_block_table_to_page16(t))
    assert_equal_int(mm3lab.rebase_slot_mapping_to_page16(t), reference.rebase_slot_mapping_to_page16(t))
    rebased = mm3lab.rebase_slot_mapping_to_page16(t)
    for s, r in zip(t.reshape(-1).tolist(), rebased.reshape(-1).tolist(), strict=False):
        if s < 0:
            assert r == s
        else:  # same offset, block id doubled: the K half of a 2*128-slot packed block
            block, off = divmod(s, SPARSE_BLOCK_SIZE)
            assert divmod(r, SPARSE_BLOCK_SIZE) == (PAGE16_SIDES_PER_BLOCK * block, off)


def test_rebased_block_table_gives_rebased_slots():
    """Slots computed from the rebased block table are the rebased slots."""
    bt = torch.tensor([[5, 2, 7], [0, 3, -1]])
    rebased_bt = mm3lab.rebase_block_table_to_page16(bt)
    for r in range(bt.shape[0]):
        for pos in (0, 1, 127, 128, 200, 383):
            lb, off = divmod(pos, SPARSE_BLOCK_SIZE)
            if bt[r, lb] < 0:
                continue
            slot = int(bt[r, lb]) * SPARSE_BLOCK_SIZE + off
            rebased_slot = int(rebased_bt[r, lb]) * SPARSE_BLOCK_SIZE + off
            assert mm3lab.rebase_slot_mapping_to_page16(torch.tensor([slot])).item() == rebased_slot


@pytest.mark.parametrize("num_blocks", [1, 4])
def test_rebase_identity_reaches_the_same_memory(num_blocks, device):
    """A stride-8 page id from the rebased table, ``(2b)*8 + j``, is the packed id ``16b + j``
    and reaches the same K and V as dense page ``8b + j`` (same logical data in both layouts)."""
    dense = numbered_cache("dense", num_blocks, device=device)
    packed = numbered_cache("packed", num_blocks, device=device)
    assert torch.equal(dense.kv, packed.kv)  # same logical tensor, different memory order
    blocks = torch.arange(num_blocks, device=device)
    rebased = mm3lab.rebase_block_table_to_page16(blocks)
    for b in range(num_blocks):
        for j in range(PAGES_PER_SPARSE_BLOCK):
            pid = int(rebased[b]) * PAGES_PER_SPARSE_BLOCK + j  # what a hard-coded-8 kernel emits
            assert pid == b * PACKED_STRIDE + j
            assert torch.equal(packed.k_cache[pid], dense.k_cache[b * DENSE_STRIDE + j])
            assert torch.equal(packed.v_cache[pid], dense.v_cache[b * DENSE_STRIDE + j])
            # without the rebase, the same kernel would read the wrong page of the packed cache
            if num_blocks > 1 and b > 0:
                wrong = b * PAGES_PER_SPARSE_BLOCK + j
                assert not torch.equal(packed.k_cache[wrong], dense.k_cache[wrong])


# ----------------------------------------------------------------------------
# write_kv_page16: kernel vs reference
# ----------------------------------------------------------------------------


def write_every_path(layout, nb, h, d, dtype, device, slots, key=None, value=None, seed=0, name="kv"):
    """Write the same tokens through every path (:func:`mm3lab.testing.run_paths`) into a poisoned
    cache each; the caches must be bit-identical. Returns ``(key, value, the kernel's cache)``."""
    g = torch.Generator().manual_seed(seed)
    n = slots.shape[0]
    if key is None:
        key = torch.randn(n, h, d, generator=g).to(dtype).to(device)
        value = torch.randn(n, h, d, generator=g).to(dtype).to(device)
    caches = []

    def inputs():
        caches.append(mm3lab.allocate_kv_cache(nb, h, d, layout, dtype=dtype, device=device))
        poison(caches[-1].kv)
        return (key, value, caches[-1].k_cache, caches[-1].v_cache, slots), {}

    got = run_paths(mm3lab.write_kv_page16, inputs, result=lambda *_: caches[-1])
    assert_paths_agree({path: cache.kv for path, cache in got.items()}, name)
    return key, value, got["kernel"]


def check_written(key, value, cache, slots):
    """Independent of the reference: each valid token sits at kv[block, side, off]; nothing else was written."""
    key, value, slots = key.cpu(), value.cpu(), slots.cpu()
    kv = cache.kv.cpu()
    written = 0
    for n, s in enumerate(slots.tolist()):
        if 0 <= s < cache.num_blocks * SPARSE_BLOCK_SIZE:
            b, off = divmod(s, SPARSE_BLOCK_SIZE)
            assert torch.equal(kv[b, 0, off], key[n]), f"K of token {n} (slot {s})"
            assert torch.equal(kv[b, 1, off], value[n]), f"V of token {n} (slot {s})"
            written += 1
    finite = (~torch.isnan(kv)).sum().item()
    assert finite == written * 2 * cache.num_kv_heads * cache.head_dim, "stray or missing writes"


def float_dtypes(device):
    dts = [torch.float32, torch.float16]
    return dts + [torch.bfloat16] if device == "cuda" else dts


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("h,d", [(1, 16), (2, 80), (3, 96), (4, 8)])
def test_write_kv_kernel_equals_reference(layout, h, d, device):
    nb = 3 if device == "cpu" else 64
    g = torch.Generator().manual_seed(h * 1000 + d)
    n = 12 if device == "cpu" else 500
    slots = torch.randperm(nb * SPARSE_BLOCK_SIZE - 1, generator=g)[:n]  # the last slot is placed below, once
    slots[::5] = -1  # padding tokens
    slots[1] = -SPARSE_BLOCK_SIZE - 3
    slots[2] = nb * SPARSE_BLOCK_SIZE - 1  # the last slot of the cache
    for dtype in float_dtypes(device):
        for slot_dtype in (torch.int32, torch.int64):
            s = slots.to(slot_dtype).to(device)
            key, value, got = write_every_path(layout, nb, h, d, dtype, device, s, name=f"kv ({layout}, {dtype})")
            if device == "cpu":
                check_written(key.cpu(), value.cpu(), got, s.cpu())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_write_kv_every_offset_of_a_block(layout, device):
    """All 128 in-block offsets once (spread over the blocks): every page and row is exercised."""
    nb, h, d = 3, 1, 8
    offs = torch.arange(SPARSE_BLOCK_SIZE)
    slots = (offs * 5 % nb) * SPARSE_BLOCK_SIZE + offs
    key, value, got = write_every_path(layout, nb, h, d, torch.float32, device, slots.to(device), name=f"kv ({layout})")
    check_written(key.cpu(), value.cpu(), got, slots)


def test_write_kv_large_on_gpu_matches_reference(device):
    if device != "cuda":
        pytest.skip("large shapes only on the GPU")
    nb, h, d = 256, 4, 128
    slots = torch.randperm(nb * SPARSE_BLOCK_SIZE)[:20000]
    slots[::7] = -1
    for layout in LAYOUTS:
        s = slots.to(device)
        key = torch.randn(s.shape[0], h, d, device=device, dtype=torch.bfloat16)
        value = torch.randn_like(key)
        got = mm3lab.allocate_kv_cache(nb, h, d, layout, dtype=torch.bfloat16, device=device)
        poison(got.kv)
        mm3lab.write_kv_page16(key, value, got.k_cache, got.v_cache, s)
        valid = s >= 0
        blocks, offs = s[valid] // SPARSE_BLOCK_SIZE, s[valid] % SPARSE_BLOCK_SIZE
        assert torch.equal(got.kv[blocks, 0, offs], key[valid])
        assert torch.equal(got.kv[blocks, 1, offs], value[valid])


def test_write_kv_strided_inputs(device):
    """Strided key/value/slot_mapping (views of wider buffers) are read correctly."""
    nb, h, d, n = 2, 2, 8, 6
    big_k = torch.randn(n, h, 2 * d, device=device)
    big_v = torch.randn(n, 2 * h, d, device=device)
    key, value = big_k[:, :, ::2], big_v[:, ::2]
    slots = torch.tensor([[3, 99], [130, 99], [-1, 99], [255, 99], [16, 99], [0, 99]], device=device)[:, 0]
    for layout in LAYOUTS:
        _, _, got = write_every_path(layout, nb, h, d, torch.float32, device, slots, key, value, name=f"kv ({layout})")
        check_written(key.cpu(), value.cpu(), got, slots.cpu())


def test_write_kv_no_tokens(device):
    cache = mm3lab.allocate_kv_cache(1, 1, 4, "packed", device=device, fill=1.0)
    empty = torch.empty(0, 1, 4, device=device)
    mm3lab.write_kv_page16(empty, empty, cache.k_cache, cache.v_cache, torch.empty(0, dtype=torch.int32, device=device))
    assert (cache.kv == 1.0).all()


@settings(max_examples=25)
@given(
    layout=st.sampled_from(LAYOUTS),
    nb=st.integers(1, 3),
    h=st.integers(1, 4),
    d=st.sampled_from([1, 3, 8, 33, 80, 96]),
    dtype=st.sampled_from([torch.float32, torch.float16]),
    data=st.data(),
)
def test_write_kv_hypothesis(layout, nb, h, d, dtype, data):
    capacity = nb * SPARSE_BLOCK_SIZE
    valid = data.draw(st.lists(st.integers(0, capacity - 1), unique=True, max_size=10), label="slots")
    pads = data.draw(st.lists(st.integers(-2 * SPARSE_BLOCK_SIZE, -1), max_size=3), label="padding")
    order = data.draw(st.permutations(valid + pads), label="order")
    slots = torch.tensor(order, dtype=torch.int64).reshape(-1)
    key, value, got = write_every_path(layout, nb, h, d, dtype, "cpu", slots, seed=len(order), name="kv")
    check_written(key, value, got, slots)


def guarded_views(layout, nb, h, d, device, guard_pages=PACKED_STRIDE):
    """Page-16 views cut from the middle of a bigger poisoned buffer: the rest is a guard zone."""
    page = (PAGE_SIZE, h, d)
    if layout == "packed":
        buf = poison(torch.empty(nb * PACKED_STRIDE + 2 * guard_pages, *page, device=device))
        k_cache = buf[guard_pages : guard_pages + nb * PACKED_STRIDE]
        v_cache = k_cache[PAGES_PER_SPARSE_BLOCK:]
        inside = [(guard_pages, guard_pages + nb * PACKED_STRIDE)]
    else:
        p = nb * DENSE_STRIDE
        buf = poison(torch.empty(2 * p + 3 * guard_pages, *page, device=device))
        k_cache = buf[guard_pages : guard_pages + p]
        v_cache = buf[2 * guard_pages + p : 2 * guard_pages + 2 * p]
        inside = [(guard_pages, guard_pages + p), (2 * guard_pages + p, 2 * guard_pages + 2 * p)]
    guard = torch.ones(buf.shape[0], dtype=torch.bool, device=device)
    for a, b in inside:
        guard[a:b] = False
    return buf, k_cache, v_cache, guard


@pytest.mark.parametrize("layout", LAYOUTS)
def test_validation_off_never_writes_outside_the_cache(layout, device):
    nb, h, d = 2, 2, 8
    buf, k_cache, v_cache, guard = guarded_views(layout, nb, h, d, device)
    ref_buf, ref_k, ref_v, _ = guarded_views(layout, nb, h, d, device)
    capacity = nb * SPARSE_BLOCK_SIZE
    slots = torch.tensor([5, capacity, capacity + 17, -1, 2**31 - 1, 2 * capacity + 3, capacity - 1], device=device)
    key = torch.randn(slots.shape[0], h, d, device=device)
    value = torch.randn_like(key)
    with mm3lab.validation(False):
        mm3lab.write_kv_page16(key, value, k_cache, v_cache, slots)
        reference.write_kv_page16(key, value, ref_k, ref_v, slots)
    assert torch.isnan(buf[guard]).all(), "a write landed outside the cache"
    assert_bits_equal(buf, ref_buf, "buffer")
    assert (~torch.isnan(buf)).sum().item() == 2 * 2 * h * d  # slots 5 and capacity - 1, K and V


# ----------------------------------------------------------------------------
# the slot-mapping rebase in the packed layout
# ----------------------------------------------------------------------------


def test_rebased_slot_is_the_row_of_the_flat_packed_views(device):
    """After a write with the original slots, token n sits at row ``rebase(s)`` of the packed views
    seen as flat token lists (and at row ``s`` of the dense ones: no rebase needed there)."""
    nb, h, d = 3, 2, 8
    slots = torch.tensor([0, 17, 127, 128, 200, 383, -1, 256], device=device)
    key = torch.randn(slots.shape[0], h, d, device=device)
    value = torch.randn_like(key)
    valid = slots >= 0
    for layout in LAYOUTS:
        cache = mm3lab.allocate_kv_cache(nb, h, d, layout, device=device)
        poison(cache.kv)
        mm3lab.write_kv_page16(key, value, cache.k_cache, cache.v_cache, slots)
        rows = mm3lab.rebase_slot_mapping_to_page16(slots) if layout == "packed" else slots
        assert torch.equal(cache.k_cache.flatten(0, 1)[rows[valid]], key[valid])
        assert torch.equal(cache.v_cache.flatten(0, 1)[rows[valid]], value[valid])


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_stride8_writer_with_rebased_slots_fills_the_packed_layout(slot_dtype, device):
    """A writer that hard-codes 8 pages per block (page = slot // 16), given rebased slots,
    writes through the packed views exactly what write_kv_page16 writes with the original slots."""
    if device == "cpu" and not mm3lab.backend.INTERPRETER:
        pytest.skip("compiled Triton needs CUDA tensors; the cuda case runs this kernel")
    nb, h, d = 3, 2, 16
    g = torch.Generator().manual_seed(7)
    slots = torch.randperm(nb * SPARSE_BLOCK_SIZE, generator=g)[:16]
    slots[3] = -1
    slots = slots.to(slot_dtype).to(device)
    key = torch.randn(slots.shape[0], h, d, generator=g).to(device)
    value = torch.randn(slots.shape[0], h, d, generator=g).to(device)
    rebased = mm3lab.rebase_slot_mapping_to_page16(slots)

    want = mm3lab.allocate_kv_cache(nb, h, d, "packed", device=device)
    poison(want.kv)
    mm3lab.write_kv_page16(key, value, want.k_cache, want.v_cache, slots)

    # the Triton writer launched with block_page_stride=8 on the packed views
    got = mm3lab.allocate_kv_cache(nb, h, d, "packed", device=device)
    poison(got.kv)
    kernel.write_kv_page16_kernel(key, value, got.k_cache, got.v_cache, rebased, DENSE_STRIDE)
    assert_bits_equal(got.kv, want.kv, "kv (stride-8 kernel, rebased slots)")

    # the same writer in plain PyTorch: page = slot // 16, row = slot % 16
    plain = mm3lab.allocate_kv_cache(nb, h, d, "packed", device=device)
    poison(plain.kv)
    ok = rebased >= 0
    pages, rows = rebased[ok] // PAGE_SIZE, rebased[ok] % PAGE_SIZE
    plain.k_cache[pages, rows] = key[ok]
    plain.v_cache[pages, rows] = value[ok]
    assert_bits_equal(plain.kv, want.kv, "kv (slot // 16 writer, rebased slots)")

    # without the rebase the stride-8 writer puts block b's tokens into block b/2's memory
    wrong = mm3lab.allocate_kv_cache(nb, h, d, "packed", device=device)
    poison(wrong.kv)
    kernel.write_kv_page16_kernel(key, value, wrong.k_cache, wrong.v_cache, slots, DENSE_STRIDE)
    assert not torch.equal(wrong.kv.nan_to_num(), want.kv.nan_to_num())


# ----------------------------------------------------------------------------
# bad input: clear errors naming the argument, raised before anything is written
# ----------------------------------------------------------------------------


def write_args(layout="dense", nb=2, h=2, d=8, n=3, dtype=torch.float32):
    cache = mm3lab.allocate_kv_cache(nb, h, d, layout, dtype=dtype, fill=0.0)
    key = torch.randn(n, h, d).to(dtype)
    return dict(
        key=key, value=key.clone(), k_cache=cache.k_cache, v_cache=cache.v_cache, slot_mapping=torch.arange(n)
    ), cache


def _nc_last_dim(t):
    wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
    return wide[..., ::2]


BAD_WRITES = [
    ("key rank", dict(key=lambda a: a["key"][0]), ValueError, "key"),
    ("key not a tensor", dict(key=lambda a: a["key"].tolist()), TypeError, "key"),
    ("key dtype", dict(key=lambda a: a["key"].half()), TypeError, "key"),
    ("key head count", dict(key=lambda a: a["key"][:, :1]), ValueError, "key"),
    ("value shape", dict(value=lambda a: a["value"][:2]), ValueError, "value"),
    ("value head dim", dict(value=lambda a: a["value"][..., :4]), ValueError, "value"),
    ("value dtype", dict(value=lambda a: a["value"].double()), TypeError, "value"),
    ("k_cache rank", dict(k_cache=lambda a: a["k_cache"].flatten(0, 1)), ValueError, "k_cache"),
    (
        "k_cache page size",
        dict(k_cache=lambda a: a["k_cache"].reshape(-1, 8, 2, 8), v_cache=lambda a: a["v_cache"].reshape(-1, 8, 2, 8)),
        ValueError,
        "k_cache",
    ),
    ("k_cache int dtype", dict(k_cache=lambda a: a["k_cache"].int()), TypeError, "k_cache"),
    ("k_cache last dim", dict(k_cache=lambda a: _nc_last_dim(a["k_cache"])), ValueError, "k_cache"),
    ("v_cache last dim", dict(v_cache=lambda a: _nc_last_dim(a["v_cache"])), ValueError, "v_cache"),
    ("v_cache dtype", dict(v_cache=lambda a: a["v_cache"].half()), TypeError, "v_cache"),
    ("v_cache head dim", dict(v_cache=lambda a: a["v_cache"][..., :4]), ValueError, "v_cache"),
    ("v_cache heads", dict(v_cache=lambda a: a["v_cache"][:, :, :1]), ValueError, "v_cache"),
    (
        "pages fit neither (12, 12)",
        dict(k_cache=lambda a: a["k_cache"][:12], v_cache=lambda a: a["v_cache"][:12]),
        ValueError,
        "k_cache/v_cache",
    ),
    ("pages fit neither (16, 12)", dict(v_cache=lambda a: a["v_cache"][:12]), ValueError, "k_cache/v_cache"),
    (
        "packed k not a multiple of 16",
        dict(k_cache=lambda a: torch.zeros(24, 16, 2, 8), v_cache=lambda a: torch.zeros(16, 16, 2, 8)),
        ValueError,
        "k_cache/v_cache",
    ),
    ("slot float", dict(slot_mapping=lambda a: a["slot_mapping"].float()), TypeError, "slot_mapping"),
    ("slot int16", dict(slot_mapping=lambda a: a["slot_mapping"].short()), TypeError, "slot_mapping"),
    ("slot length", dict(slot_mapping=lambda a: a["slot_mapping"][:2]), ValueError, "slot_mapping"),
    ("slot rank", dict(slot_mapping=lambda a: a["slot_mapping"][None]), ValueError, "slot_mapping"),
    (
        "slot past the cache",
        dict(slot_mapping=lambda a: torch.tensor([0, 5, 256])),
        ValueError,
        r"slot_mapping: row 2 has slot 256",
    ),
    (
        "slot far past the cache",
        dict(slot_mapping=lambda a: torch.tensor([10**9, 5, 3])),
        ValueError,
        r"slot_mapping: row 0",
    ),
]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("what,changes,exc,match", BAD_WRITES, ids=[b[0] for b in BAD_WRITES])
def test_write_kv_bad_input(what, changes, exc, match, layout, monkeypatch):
    args, cache = write_args(layout)
    for name, make in changes.items():
        args[name] = make(args)
    before = cache.kv.clone()
    called = []
    monkeypatch.setattr(kernel, "write_kv_page16_kernel", lambda *a, **k: called.append(a))
    for fn in (mm3lab.write_kv_page16, reference.write_kv_page16):
        with pytest.raises(exc, match=match):
            fn(**args)
    assert not called, "the kernel ran on bad input"
    assert_bits_equal(cache.kv, before, "cache after a rejected write")


def test_write_kv_device_mismatch(device):
    if device != "cuda":
        pytest.skip("needs a second device")
    args, _ = write_args()
    cuda = mm3lab.allocate_kv_cache(2, 2, 8, "dense", device="cuda", fill=0.0)
    with pytest.raises(ValueError, match="key is on cpu"):
        mm3lab.write_kv_page16(args["key"], args["value"], cuda.k_cache, cuda.v_cache, args["slot_mapping"])
    with pytest.raises(ValueError, match="v_cache is on cpu"):
        mm3lab.check_kv_views(cuda.k_cache, args["v_cache"])
    with pytest.raises(ValueError, match="slot_mapping is on cpu"):
        mm3lab.write_kv_page16(
            args["key"].cuda(), args["value"].cuda(), cuda.k_cache, cuda.v_cache, args["slot_mapping"]
        )


def _kv(shape=(2, 2, 128, 2, 4), dtype=torch.float32):
    return torch.zeros(shape, dtype=dtype)


BAD_KV = [
    ("rank", lambda: _kv((2, 2, 128, 8)), ValueError, "kv_cache: expected 5 dimensions"),
    ("sides", lambda: _kv((2, 3, 128, 2, 4)), ValueError, "kv_cache: dimension 1"),
    ("block of 64 tokens", lambda: _kv((2, 2, 64, 2, 4)), ValueError, "kv_cache: dimension 2 must hold 128"),
    ("block of 120 tokens", lambda: _kv((2, 2, 120, 2, 4)), ValueError, "kv_cache: dimension 2"),
    ("int dtype", lambda: _kv(dtype=torch.int32), TypeError, "kv_cache"),
    ("not a tensor", lambda: [[0.0]], TypeError, "kv_cache"),
    (
        "neither memory order",
        lambda: _kv().transpose(3, 4).contiguous().transpose(3, 4),
        ValueError,
        "kv_cache: strides",
    ),
    ("token-major", lambda: _kv((2, 128, 2, 2, 4)).permute(0, 2, 1, 3, 4), ValueError, "kv_cache: strides"),
]


@pytest.mark.parametrize("what,make,exc,match", BAD_KV, ids=[b[0] for b in BAD_KV])
def test_page16_views_bad_input(what, make, exc, match):
    kv = make()
    with pytest.raises(exc, match=match):
        mm3lab.page16_views(kv)
    with pytest.raises(exc, match=match):
        mm3lab.kv_cache_layout(kv)


def test_other_bad_input():
    kv = _kv()
    with pytest.raises(ValueError, match="layout"):
        mm3lab.page16_views(kv, "planes")
    with pytest.raises(ValueError, match="layout"):
        mm3lab.allocate_kv_cache(2, 2, 4, "sideways")
    with pytest.raises(ValueError, match="num_blocks"):
        mm3lab.allocate_kv_cache(0, 2, 4)
    with pytest.raises(TypeError, match="num_kv_heads"):
        mm3lab.allocate_kv_cache(2, 2.0, 4)
    with pytest.raises(ValueError, match="head_dim"):
        mm3lab.allocate_kv_cache(2, 2, -4)
    with pytest.raises(TypeError, match="dtype"):
        mm3lab.allocate_kv_cache(2, 2, 4, dtype=torch.int8)
    with pytest.raises(ValueError, match="k_cache"):
        mm3lab.sides_are_packed(torch.zeros(8, 16, 4), torch.zeros(8, 16, 2, 4))
    with pytest.raises(ValueError, match="v_cache"):
        mm3lab.sparse_block_page_stride(torch.zeros(8, 16, 2, 4), torch.zeros(8, 16, 4))
    with pytest.raises(ValueError, match="view"):
        mm3lab.locate_page(0, "q", "dense", 2)
    with pytest.raises(ValueError, match="layout"):
        mm3lab.locate_page(0, "k", "planes", 2)
    with pytest.raises(ValueError, match="page_id"):
        mm3lab.locate_page(-1, "k", "dense", 2)
    with pytest.raises(ValueError, match="page_id"):
        mm3lab.locate_page(2 * PACKED_STRIDE - PAGES_PER_SPARSE_BLOCK, "v", "packed", 2)
    with pytest.raises(ValueError, match="block_page_stride"):
        mm3lab.page_ids_of_block(0, 4)
    with pytest.raises(ValueError, match="block_page_stride"):
        mm3lab.slot_to_page(0, 32)


BAD_REBASE = [
    ("float table", lambda: (torch.tensor([1.0]), None), TypeError, "block_table"),
    ("int16 table", lambda: (torch.tensor([1], dtype=torch.int16), None), TypeError, "block_table"),
    ("list table", lambda: ([1, 2], None), TypeError, "block_table"),
    ("out shape", lambda: (torch.tensor([1, 2]), torch.empty(3, dtype=torch.int64)), ValueError, "out"),
    ("out dtype", lambda: (torch.tensor([1, 2]), torch.empty(2, dtype=torch.int32)), TypeError, "out"),
    (
        "out not contiguous",
        lambda: (torch.zeros(2, 2, dtype=torch.int64), torch.zeros(2, 2, dtype=torch.int64).t()),
        ValueError,
        "out",
    ),
]


@pytest.mark.parametrize("what,make,exc,match", BAD_REBASE, ids=[b[0] for b in BAD_REBASE])
def test_rebase_bad_input(what, make, exc, match):
    bt, out = make()
    for fn in (
        mm3lab.rebase_block_table_to_page16,
        reference.rebase_block_table_to_page16,
        vllm.minimax_m3_rebase_block_table_to_page16,
    ):
        with pytest.raises(exc, match=match):
            fn(bt, out=out)


def test_rebase_slot_mapping_bad_input():
    for fn in (mm3lab.rebase_slot_mapping_to_page16, reference.rebase_slot_mapping_to_page16):
        with pytest.raises(TypeError, match="slots"):
            fn(torch.tensor([1.0, 2.0]))
        with pytest.raises(TypeError, match="slots"):
            fn([1, 2])


def test_public_names():
    for name in (
        "SPARSE_BLOCK_SIZE",
        "PAGE_SIZE",
        "PAGES_PER_SPARSE_BLOCK",
        "PAGE16_SIDES_PER_BLOCK",
        "sides_are_packed",
        "sparse_block_page_stride",
        "rebase_block_table_to_page16",
        "rebase_slot_mapping_to_page16",
    ):
        assert hasattr(mm3lab, name) and hasattr(reference, name), name
    assert (SPARSE_BLOCK_SIZE, PAGE_SIZE, PAGES_PER_SPARSE_BLOCK, PAGE16_SIDES_PER_BLOCK) == (128, 16, 8, 2)
