"""Triton kernel: scatter ``[N, Di]`` index keys into the index cache ``[num_blocks, 128, Di]`` by slot.

One launch; each program copies a tile of ``BLOCK_N`` tokens x ``BLOCK_D`` dims.
A negative slot (padding) or a slot past the cache masks its row: nothing is
read for it and nothing written.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..constants import SPARSE_BLOCK_SIZE


@triton.jit
def _insert_index_cache(
    index_k_ptr,  # [N, Di] any row stride, any dim stride
    stride_kn, stride_kd,
    cache_ptr,  # [num_blocks, 128, Di], head dim contiguous
    stride_cb, stride_ct,
    slot_ptr,  # [N] int32/int64 slots, negative = padding
    stride_s,
    N, Di,
    capacity,  # num_blocks * 128
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPARSE_BLOCK: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    in_rows = rows < N
    slot = tl.load(slot_ptr + rows.to(tl.int64) * stride_s, mask=in_rows, other=-1).to(tl.int64)
    write = in_rows & (slot >= 0) & (slot < capacity)
    block = tl.where(write, slot // SPARSE_BLOCK, 0)
    offset = tl.where(write, slot % SPARSE_BLOCK, 0)
    mask = write[:, None] & (dims[None, :] < Di)
    src = index_k_ptr + rows.to(tl.int64)[:, None] * stride_kn + dims[None, :] * stride_kd
    keys = tl.load(src, mask=mask)
    dst = cache_ptr + block[:, None] * stride_cb + offset[:, None] * stride_ct + dims[None, :]
    tl.store(dst, keys, mask=mask)


def insert_index_cache_kernel(index_k, index_cache, slot_mapping) -> None:
    """Launch the insert (arguments already validated, ``N > 0``)."""
    n, di = index_k.shape
    block_d = min(triton.next_power_of_2(di), 256)
    block_n = max(1, min(32, 4096 // block_d, triton.next_power_of_2(n)))
    grid = (triton.cdiv(n, block_n), triton.cdiv(di, block_d))
    _insert_index_cache[grid](
        index_k, *index_k.stride(),
        index_cache, index_cache.stride(0), index_cache.stride(1),
        slot_mapping, slot_mapping.stride(0),
        n, di, index_cache.shape[0] * SPARSE_BLOCK_SIZE,
        BLOCK_N=block_n, BLOCK_D=block_d, SPARSE_BLOCK=SPARSE_BLOCK_SIZE,
        num_warps=4,
    )


__all__ = ["insert_index_cache_kernel"]
