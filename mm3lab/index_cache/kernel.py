"""Triton kernel: scatter ``[N, Di]`` index keys into the index cache ``[num_blocks, 128, Di]`` by slot.

One launch; each program copies a tile of ``BLOCK_N`` tokens x ``BLOCK_D`` dims.
A negative slot (padding) or a slot past the cache masks its row: nothing is
read for it and nothing written. A gated launch (``gate``) first reads the flags that
the call's value-check launch, queued before it, wrote: if one is set, it writes
nothing at all, so the host can queue the insert before it has read those flags. A checking
launch (``check``: one program over the tokens, :func:`checks_in_one_program`) runs that value
check itself: a slot past the cache sets its flag and then nothing is written, and its ``done``
word tells the host the flag is final (:func:`mm3lab._valcheck.signal_done`), so a small insert
is one launch and one wait.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .. import backend
from .._fp8_triton import round_to_e4m3
from .._grid import cdiv, next_power_of_2
from .._valcheck import signal_done
from ..constants import SPARSE_BLOCK_SIZE
from ..fp8 import FP8_MAX as _FP8_MAX_VALUE

FP8_MAX = tl.constexpr(_FP8_MAX_VALUE)


@triton.jit
def index_rows_store(
    index_k_ptr,  # [N, Di] any strides
    stride_kn,
    stride_kd,
    cache_ptr,  # [num_blocks, 128, Di], head dim contiguous
    stride_cb,
    stride_ct,
    rows,  # [R] the rows to copy
    in_rows,  # [R] which of them exist
    slot,  # [R] their int64 slots, negative = padding
    dims,  # [BLOCK_D] the dims to copy
    Di,
    capacity,  # num_blocks * 128
    scale_ptr,  # [num_blocks, 128] float32 per-token scales (QUANT only)
    stride_sb,
    INTERPRETED: tl.constexpr,
    QUANT: tl.constexpr,
    SPARSE_BLOCK: tl.constexpr,
):
    """Copy dims ``dims`` of the index keys of ``rows`` (where ``in_rows``) to int64 slots ``slot``
    (a negative slot or one past ``capacity`` writes nothing; ``QUANT``: ``dims`` cover the key)."""
    write = in_rows & (slot >= 0) & (slot < capacity)
    block = tl.where(write, slot // SPARSE_BLOCK, 0)
    offset = tl.where(write, slot % SPARSE_BLOCK, 0)
    mask = write[:, None] & (dims[None, :] < Di)
    src = index_k_ptr + rows.to(tl.int64)[:, None] * stride_kn + dims[None, :] * stride_kd
    keys = tl.load(src, mask=in_rows[:, None] & (dims[None, :] < Di))  # (whatever the slot: no wait for it)
    dst = cache_ptr + block[:, None] * stride_cb + offset[:, None] * stride_ct + dims[None, :]
    if QUANT:  # SPEC section 9: scale = amax(|k|) / 448 (1 for a zero key), stored k / scale in e4m3
        kf = tl.where(mask, keys.to(tl.float32), 0.0)
        amax = tl.max(tl.abs(kf), 1)
        scale = tl.where(amax > 0, tl.math.div_rn(amax, tl.full(amax.shape, FP8_MAX, tl.float32)), 1.0)
        q = tl.math.div_rn(kf, tl.broadcast_to(scale[:, None], kf.shape))
        tl.store(dst, round_to_e4m3(q, INTERPRETED), mask=mask)
        tl.store(scale_ptr + block * stride_sb + offset, scale, mask=write)
    else:
        tl.store(dst, keys, mask=mask)


@triton.jit
def _insert_index_cache(
    index_k_ptr,  # [N, Di] any row stride, any dim stride
    stride_kn,
    stride_kd,
    cache_ptr,  # [num_blocks, 128, Di], head dim contiguous
    stride_cb,
    stride_ct,
    slot_ptr,  # [N] int32/int64 slots, negative = padding
    stride_s,
    N,
    Di,
    capacity,  # num_blocks * 128
    scale_ptr,  # [num_blocks, 128] float32 per-token scales (QUANT only)
    stride_sb,
    gate_ptr,  # GATED: [GATE_FLAGS] int32 value-check flags (any set: write nothing)
    flags_ptr,  # CHECK: [1] int32, set where a slot is past the cache (then nothing is written)
    count_ptr,  # CHECK: the launch counter and the done word (see mm3lab._valcheck.signal_done)
    done_ptr,
    INTERPRETED: tl.constexpr,
    QUANT: tl.constexpr,  # FP8 cache: quantize each key (BLOCK_D covers the whole key)
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPARSE_BLOCK: tl.constexpr,
    GATED: tl.constexpr,
    GATE_FLAGS: tl.constexpr,  # a power of two
    CHECK: tl.constexpr,  # the value check in this launch (its one program along the tokens sees them all)
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    in_rows = rows < N
    if GATED:  # (the check launch before this one has finished: its flags are all written)
        flagged = tl.max(tl.load(gate_ptr + tl.arange(0, GATE_FLAGS), volatile=True), 0)
        in_rows = in_rows & ((tl.zeros_like(rows) + flagged) == 0)
    slot = tl.load(slot_ptr + rows.to(tl.int64) * stride_s, mask=in_rows, other=-1).to(tl.int64)
    if CHECK:  # every program sees every token: each finds the same verdict, and writes only if clear
        bad = tl.max((in_rows & (slot >= capacity)).to(tl.int32), 0)
        tl.store(flags_ptr, bad, mask=bad != 0)
        signal_done(count_ptr, done_ptr)
        in_rows = in_rows & ((tl.zeros_like(rows) + bad) == 0)
    index_rows_store(
        index_k_ptr, stride_kn, stride_kd, cache_ptr, stride_cb, stride_ct, rows, in_rows, slot, dims, Di, capacity,
        scale_ptr, stride_sb, INTERPRETED, QUANT, SPARSE_BLOCK,
    )  # fmt: skip


def _tiles(n: int, di: int, quant: bool) -> tuple[int, int]:
    """``(BLOCK_N, BLOCK_D)``: tokens and dims per program."""
    block_d = next_power_of_2(di) if quant else min(next_power_of_2(di), 256)
    return max(1, min(32, 4096 // block_d, next_power_of_2(n))), block_d


def checks_in_one_program(n: int, di: int, quant: bool) -> bool:
    """Whether an insert of ``n`` keys of ``di`` dims has one program along the tokens, which can then
    check every slot before it writes (a launch given ``check``)."""
    return 0 < n <= _tiles(n, di, quant)[0]


def insert_index_cache_kernel(index_k, index_cache, slot_mapping, index_scale=None, gate=None, check=None) -> None:
    """Launch the insert (arguments already validated, ``N > 0``); ``index_scale`` for an FP8 cache.
    ``gate``: int32 flags (a power of two of them) that a value-check launch queued before this one
    writes; the insert writes nothing where one is set. ``check``: ``(flags, count, done)``
    (:class:`mm3lab._valcheck.Fused`), where :func:`checks_in_one_program`: the launch checks the slots
    itself (flags[0] set where one is past the cache, and then nothing written) and signals ``done``."""
    n, di = index_k.shape
    quant = index_scale is not None
    block_n, block_d = _tiles(n, di, quant)
    grid = (cdiv(n, block_n), cdiv(di, block_d))
    if check is not None and grid[0] != 1:
        raise ValueError(f"a checking insert takes one program along the tokens, not {grid[0]}")
    if check is not None and gate is not None:
        raise ValueError("an insert is gated on another launch's check or checks itself, not both")
    flags, count, done = (slot_mapping,) * 3 if check is None else check
    _insert_index_cache[grid](
        index_k,
        *index_k.stride(),
        index_cache,
        index_cache.stride(0),
        index_cache.stride(1),
        slot_mapping,
        slot_mapping.stride(0),
        n,
        di,
        index_cache.shape[0] * SPARSE_BLOCK_SIZE,
        index_scale if quant else slot_mapping,
        index_scale.stride(0) if quant else 0,
        slot_mapping if gate is None else gate,
        flags,
        count,
        done,
        QUANT=quant,
        INTERPRETED=backend.INTERPRETER,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        SPARSE_BLOCK=SPARSE_BLOCK_SIZE,
        GATED=gate is not None,
        GATE_FLAGS=1 if gate is None else gate.numel(),
        CHECK=check is not None,
        num_warps=4,
    )


__all__ = ["checks_in_one_program", "index_rows_store", "insert_index_cache_kernel"]
