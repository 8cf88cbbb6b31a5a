"""Triton kernel: write K/V of N tokens into page-16 views of either layout."""

from __future__ import annotations

import triton
import triton.language as tl

from .. import backend
from .._fp8_triton import round_to_e4m3
from .._grid import next_power_of_2
from ..constants import PAGE_SIZE, SPARSE_BLOCK_SIZE


@triton.jit
def kv_row_store(
    n,  # the token (int64)
    slot,  # its page-128 slot (int64 scalar), negative = padding
    src,  # (key_ptr, value_ptr [N, H, D], their strides: kn, kh, kd, vn, vh, vd)
    dst,  # (k_cache_ptr, v_cache_ptr page-16 views, capacity in slots, their strides: kp, kr, kh, vp, vr, vh)
    scales,  # QUANT: (ks_ptr, vs_ptr [pages, 16, H] float32 scale views, their strides: kp, kr, kh, vp, vr, vh)
    QUANT: tl.constexpr,
    INTERPRETED: tl.constexpr,
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_PAGE_STRIDE: tl.constexpr,  # page ids per physical block: 8 dense, 16 packed
    SPARSE_BLOCK: tl.constexpr,
    PAGE: tl.constexpr,
):
    """Write token ``n``'s K/V at ``slot`` of page-16 views (a negative slot or one past ``capacity``
    writes nothing; ``QUANT``: an FP8 cache and its per-(token, head) scales)."""
    key_ptr, value_ptr, stride_kn, stride_kh, stride_kd, stride_vn, stride_vh, stride_vd = src
    k_cache_ptr, v_cache_ptr, capacity, stride_kcp, stride_kcr, stride_kch, stride_vcp, stride_vcr, stride_vch = dst
    ks_ptr, vs_ptr, stride_ksp, stride_ksr, stride_ksh, stride_vsp, stride_vsr, stride_vsh = scales
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    # The slot broadcast to the [BLOCK_H, BLOCK_D] tile, so every mask term is a
    # vector comparison (a scalar bool mixed into a vector mask is not portable).
    slot = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.int64) + slot
    in_slot = (slot >= 0) & (slot < capacity)  # negative = padding; past the cache = never written
    safe = tl.where(in_slot, slot, 0)
    block = safe // SPARSE_BLOCK
    off = safe % SPARSE_BLOCK
    page = block * BLOCK_PAGE_STRIDE + off // PAGE
    row = off % PAGE
    # (the token's K/V are read whatever its slot, so that these loads need not wait for the slot's)
    tile = (heads < H) & (dims < D)
    mask = tile & in_slot
    k = tl.load(key_ptr + n * stride_kn + heads * stride_kh + dims * stride_kd, mask=tile)
    v = tl.load(value_ptr + n * stride_vn + heads * stride_vh + dims * stride_vd, mask=tile)
    if QUANT:  # SPEC section 9: one scale per (token, head), amax / 448 (1 for zeros), stored x / scale
        head_ok = (tl.arange(0, BLOCK_H) < H) & (tl.max(slot, 1) >= 0) & (tl.max(slot, 1) < capacity)
        page_h = tl.max(page, 1)
        row_h = tl.max(row, 1)
        hs = tl.arange(0, BLOCK_H)
        kf = tl.where(mask, k.to(tl.float32), 0.0)
        vf = tl.where(mask, v.to(tl.float32), 0.0)
        ka = tl.max(tl.abs(kf), 1)
        va = tl.max(tl.abs(vf), 1)
        fp8_max = tl.full(ka.shape, 448.0, tl.float32)
        k_sc = tl.where(ka > 0, tl.math.div_rn(ka, fp8_max), 1.0)
        v_sc = tl.where(va > 0, tl.math.div_rn(va, fp8_max), 1.0)
        k = round_to_e4m3(tl.math.div_rn(kf, tl.broadcast_to(k_sc[:, None], kf.shape)), INTERPRETED)
        v = round_to_e4m3(tl.math.div_rn(vf, tl.broadcast_to(v_sc[:, None], vf.shape)), INTERPRETED)
        tl.store(ks_ptr + page_h * stride_ksp + row_h * stride_ksr + hs * stride_ksh, k_sc, mask=head_ok)
        tl.store(vs_ptr + page_h * stride_vsp + row_h * stride_vsr + hs * stride_vsh, v_sc, mask=head_ok)
    tl.store(k_cache_ptr + page * stride_kcp + row * stride_kcr + heads * stride_kch + dims, k, mask=mask)
    tl.store(v_cache_ptr + page * stride_vcp + row * stride_vcr + heads * stride_vch + dims, v, mask=mask)


@triton.jit
def _write_kv_page16(
    key_ptr,  # [N, H, D]
    value_ptr,  # [N, H, D]
    k_cache_ptr,  # [pages, 16, H, D] page-16 K view
    v_cache_ptr,  # [pages(-8), 16, H, D] page-16 V view
    slot_ptr,  # [N] page-128 slots, negative = padding
    capacity,  # slots the cache holds: num_blocks * 128
    stride_s,  # slot_mapping stride (it may be a strided view)
    stride_kn,
    stride_kh,
    stride_kd,
    stride_vn,
    stride_vh,
    stride_vd,
    stride_kcp,
    stride_kcr,
    stride_kch,  # k_cache strides (page, row, head); head dim contiguous
    stride_vcp,
    stride_vcr,
    stride_vch,
    ks_ptr,
    vs_ptr,  # FP8: [pages, 16, H] float32 scale views (QUANT only)
    stride_ksp,
    stride_ksr,
    stride_ksh,
    stride_vsp,
    stride_vsr,
    stride_vsh,
    QUANT: tl.constexpr,
    INTERPRETED: tl.constexpr,
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_PAGE_STRIDE: tl.constexpr,  # page ids per physical block: 8 dense, 16 packed
    SPARSE_BLOCK: tl.constexpr,
    PAGE: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    kv_row_store(
        n,
        tl.load(slot_ptr + n * stride_s).to(tl.int64),
        (key_ptr, value_ptr, stride_kn, stride_kh, stride_kd, stride_vn, stride_vh, stride_vd),
        (k_cache_ptr, v_cache_ptr, capacity, stride_kcp, stride_kcr, stride_kch, stride_vcp, stride_vcr, stride_vch),
        (ks_ptr, vs_ptr, stride_ksp, stride_ksr, stride_ksh, stride_vsp, stride_vsr, stride_vsh),
        QUANT, INTERPRETED, H, D, BLOCK_H, BLOCK_D, BLOCK_PAGE_STRIDE, SPARSE_BLOCK, PAGE,
    )  # fmt: skip


def write_kv_page16_kernel(
    key, value, k_cache, v_cache, slot_mapping, block_page_stride: int, k_scale=None, v_scale=None
) -> None:
    """Launch one program per token (arguments already validated); scales for an FP8 cache."""
    n, h, d = key.shape
    quant = k_scale is not None
    ks, vs = (k_scale, v_scale) if quant else (slot_mapping.view(1, 1, -1), slot_mapping.view(1, 1, -1))
    capacity = (k_cache.shape[0] // block_page_stride) * SPARSE_BLOCK_SIZE
    _write_kv_page16[(n,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        capacity,
        slot_mapping.stride(0),
        *key.stride(),
        *value.stride(),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        ks,
        vs,
        *ks.stride(),
        *vs.stride(),
        QUANT=quant,
        INTERPRETED=backend.INTERPRETER,
        H=h,
        D=d,
        BLOCK_H=next_power_of_2(h),
        BLOCK_D=next_power_of_2(d),
        BLOCK_PAGE_STRIDE=block_page_stride,
        SPARSE_BLOCK=SPARSE_BLOCK_SIZE,
        PAGE=PAGE_SIZE,
    )


__all__ = ["kv_row_store", "write_kv_page16_kernel"]
