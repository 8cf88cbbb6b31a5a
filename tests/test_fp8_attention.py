"""FP8 KV cache (SPEC section 9): quantizing page-16 writes and sparse attention, both layouts.

Tolerances (``mm3lab.fp8``): against the reference over the dequantized cache
``ATTENTION_FP8_DEQUANT_ATOL``; against the bf16 reference over the original K/V
``ATTENTION_FP8_ATOL`` (unit-variance K/V, scale ``D ** -0.5``).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mm3lab
from mm3lab import reference as R
from mm3lab.fp8 import ATTENTION_FP8_ATOL, ATTENTION_FP8_DEQUANT_ATOL, FP8_DTYPE, FP8_MAX

LAYOUTS = ["dense", "packed"]


def _filled(nb, h, d, layout, device, seed=0):
    """An FP8 cache and a bf16 cache of ``nb`` full blocks of the same random K/V. Written by the
    reference writer, which ``test_write_matches_reference_bits`` proves bit-identical to the kernel
    (the interpreted kernel takes seconds per cache, one program per token)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(nb * 128, h, d, generator=g)
    v = torch.randn(nb * 128, h, d, generator=g)
    slots = torch.arange(nb * 128, device=device)
    c8 = mm3lab.allocate_kv_cache(nb, h, d, layout, dtype=FP8_DTYPE, device=device, fill=0.0)
    cb = mm3lab.allocate_kv_cache(nb, h, d, layout, dtype=torch.bfloat16, device=device, fill=0.0)
    R.write_kv_page16(k.to(device), v.to(device), c8.k_cache, c8.v_cache, slots, k_scale=c8.k_scale, v_scale=c8.v_scale)
    R.write_kv_page16(k.bfloat16().to(device), v.bfloat16().to(device), cb.k_cache, cb.v_cache, slots)
    return c8, cb


def _table(h, n, nb, stride, topk, seed, device):
    g = torch.Generator().manual_seed(seed)
    blocks = torch.stack([torch.stack([torch.randperm(nb, generator=g)[:topk] for _ in range(n)]) for _ in range(h)])
    bt = (blocks[..., None] * stride + torch.arange(8)).reshape(h, n, topk * 8).int()
    ctx = torch.randint(0, topk * 128 + 1, (h, n), generator=g).int()
    return bt.to(device), ctx.to(device)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_write_matches_reference_bits(device, layout, dtype):
    g = torch.Generator().manual_seed(3)
    key = (torch.randn(30, 2, 64, generator=g) * 4).to(dtype)
    value = torch.randn(30, 2, 64, generator=g).to(dtype)
    key[5, 1] = 0
    slots = torch.randperm(3 * 128, generator=g)[:30]
    slots[2] = -1
    got = []
    for write in (mm3lab.write_kv_page16, R.write_kv_page16):
        c = mm3lab.allocate_kv_cache(3, 2, 64, layout, dtype=FP8_DTYPE, device=device, fill=0.0)
        write(
            key.to(device),
            value.to(device),
            c.k_cache,
            c.v_cache,
            slots.to(device),
            k_scale=c.k_scale,
            v_scale=c.v_scale,
        )
        got.append((c.kv.view(torch.uint8).cpu(), c.scale.cpu()))
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])
    c = got[0][1]
    b, off = divmod(int(slots[5]), 128)
    assert float(c[b, 0, off, 1]) == 1.0  # a zero key vector: scale 1
    b, off = divmod(int(slots[0]), 128)
    assert float(c[b, 1, off, 0]) == pytest.approx(float(value[0, 0].float().abs().max()) / FP8_MAX, rel=1e-6)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_attention_tolerances(device, layout, dtype):
    nb, h, d, hq, n, topk = 6, 2, 64, 8, 3, 3
    c8, cb = _filled(nb, h, d, layout, device)
    bt, ctx = _table(h, n, nb, c8.block_page_stride, topk, 1, device)
    q = torch.randn(n, hq, d, generator=torch.Generator().manual_seed(5)).to(device)
    out = mm3lab.sparse_attention(q.to(dtype), c8.k_cache, c8.v_cache, bt, ctx, k_scale=c8.k_scale, v_scale=c8.v_scale)
    ref = R.sparse_attention(q, c8.k_cache, c8.v_cache, bt, ctx, k_scale=c8.k_scale, v_scale=c8.v_scale)
    atol = ATTENTION_FP8_DEQUANT_ATOL if dtype == torch.float32 else ATTENTION_FP8_DEQUANT_ATOL + 2**-7
    assert (out.float().cpu() - ref.float().cpu()).abs().max() <= atol
    bf16 = R.sparse_attention(q.bfloat16(), cb.k_cache, cb.v_cache, bt, ctx)
    assert (out.float().cpu() - bf16.float().cpu()).abs().max() <= ATTENTION_FP8_ATOL


@settings(max_examples=15)
@given(
    seed=st.integers(0, 2**16),
    layout=st.sampled_from(LAYOUTS),
    topk=st.integers(1, 3),
    group=st.sampled_from([1, 4, 16]),
)
def test_attention_property(seed, layout, topk, group):
    nb, h, d, n = 4, 2, 32, 2
    c8, _ = _filled(nb, h, d, layout, "cpu", seed=seed % 3)
    bt, ctx = _table(h, n, nb, c8.block_page_stride, topk, seed, "cpu")
    q = torch.randn(n, h * group, d, generator=torch.Generator().manual_seed(seed))
    out, lse = mm3lab.sparse_attention(
        q, c8.k_cache, c8.v_cache, bt, ctx, k_scale=c8.k_scale, v_scale=c8.v_scale, return_lse=True
    )
    ref, ref_lse = R.sparse_attention(
        q, c8.k_cache, c8.v_cache, bt, ctx, k_scale=c8.k_scale, v_scale=c8.v_scale, return_lse=True
    )
    assert (out - ref).abs().max() <= ATTENTION_FP8_DEQUANT_ATOL
    fin = torch.isfinite(ref_lse)
    assert torch.equal(fin, torch.isfinite(lse)) and bool(((lse - ref_lse).abs()[fin] <= 1e-3).all())


def test_errors():
    c8 = mm3lab.allocate_kv_cache(2, 1, 16, "dense", dtype=FP8_DTYPE, fill=0.0)
    c32 = mm3lab.allocate_kv_cache(2, 1, 16, "dense", fill=0.0)
    q, bt, ctx = torch.randn(1, 2, 16), torch.zeros(1, 1, 8, dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="k_scale"):
        mm3lab.sparse_attention(q, c8.k_cache, c8.v_cache, bt, ctx)
    with pytest.raises(ValueError, match="k_scale"):
        mm3lab.sparse_attention(q, c32.k_cache, c32.v_cache, bt, ctx, k_scale=c8.k_scale, v_scale=c8.v_scale)
    with pytest.raises(ValueError, match="v_scale"):
        mm3lab.sparse_attention(q, c8.k_cache, c8.v_cache, bt, ctx, k_scale=c8.k_scale, v_scale=c8.v_scale[:8, :, :0])
    key = torch.randn(2, 1, 16)
    before = c8.kv.view(torch.uint8).clone()
    with pytest.raises(ValueError, match="v_scale"):
        mm3lab.write_kv_page16(key, key, c8.k_cache, c8.v_cache, torch.tensor([0, 1]), k_scale=c8.k_scale)
    with pytest.raises(ValueError, match="slot_mapping"):
        mm3lab.write_kv_page16(
            key, key, c8.k_cache, c8.v_cache, torch.tensor([0, 999]), k_scale=c8.k_scale, v_scale=c8.v_scale
        )
    assert torch.equal(before, c8.kv.view(torch.uint8))
    assert c32.k_scale is None and c8.k_scale.shape == (16, 16, 1)
