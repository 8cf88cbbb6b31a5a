"""Triton kernel: scatter ``[N, Di]`` index keys into the index cache ``[num_blocks, 128, Di]`` by slot.

One launch; each program copies a tile of ``BLOCK_N`` tokens x ``BLOCK_D`` dims.
A negative slot (padding) or a slot past the cache masks its row: nothing is
read for it and nothing written. A gated launch (``gate``) first reads the flags that
the call's value-check launch, queued before it, wrote: if one is set, it writes
nothing at all, so the host can queue the insert before it has read those flags. A checking
launch (``check``, :func:`checks_in_launch`) runs that value check itself: every program reads
every slot, so all of them find the same verdict without waiting for one another; a slot past
the cache sets the flag and then no program writes, and the ``done`` word, set by the last
program to finish its check, tells the host the flag is final
(:func:`mm3lab._valcheck.signal_done`). So an insert of up to a few thousand keys is one launch
and one wait.
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
    CHECK: tl.constexpr,  # the value check in this launch (every program reads every slot)
    CHECK_BLOCK: tl.constexpr,  # CHECK: slots read per step of that check
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    in_rows = rows < N
    if GATED:  # (the check launch before this one has finished: its flags are all written)
        flagged = tl.max(tl.load(gate_ptr + tl.arange(0, GATE_FLAGS), volatile=True), 0)
        in_rows = in_rows & ((tl.zeros_like(rows) + flagged) == 0)
    slot = tl.load(slot_ptr + rows.to(tl.int64) * stride_s, mask=in_rows, other=-1).to(tl.int64)
    if CHECK:  # every program reads every slot: each finds the same verdict, and writes only if it is clear
        past = tl.zeros([CHECK_BLOCK], dtype=tl.int32)
        start = 0
        while start < N:  # (a while loop: the interpreter cannot run range() with runtime bounds)
            at = start + tl.arange(0, CHECK_BLOCK)
            every = tl.load(slot_ptr + at.to(tl.int64) * stride_s, mask=at < N, other=-1).to(tl.int64)
            past = tl.maximum(past, (every >= capacity).to(tl.int32))
            start += CHECK_BLOCK
        bad = tl.max(past, 0)
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


CHECK_READS = 2**21
"""The most slot reads a checking launch makes in all: each of its programs reads all ``N`` slots, so
its reads grow as ``N**2`` (4096 keys of 128 dims: 128 programs, 0.5M reads of slots the first program
brought into L2)."""


def _grid(n: int, di: int, quant: bool) -> tuple[int, int]:
    block_n, block_d = _tiles(n, di, quant)
    return cdiv(n, block_n), cdiv(di, block_d)


def checks_in_launch(n: int, di: int, quant: bool) -> bool:
    """Whether an insert of ``n`` keys of ``di`` dims may check its own slots (a launch given ``check``):
    every program reads every slot, at most :data:`CHECK_READS` reads in all (up to 8192 keys of 128 dims)."""
    programs = _grid(n, di, quant)
    return 0 < n and programs[0] * programs[1] * n <= CHECK_READS


def insert_index_cache_kernel(index_k, index_cache, slot_mapping, index_scale=None, gate=None, check=None) -> None:
    """Launch the insert (arguments already validated, ``N > 0``); ``index_scale`` for an FP8 cache.
    ``gate``: int32 flags (a power of two of them) that a value-check launch queued before this one
    writes; the insert writes nothing where one is set. ``check``: ``(flags, count, done)``
    (:class:`mm3lab._valcheck.Fused`), where :func:`checks_in_launch`: the launch checks the slots
    itself (flags[0] set where one is past the cache, and then nothing written) and signals ``done``."""
    n, di = index_k.shape
    quant = index_scale is not None
    block_n, block_d = _tiles(n, di, quant)
    grid = _grid(n, di, quant)
    if check is not None and not checks_in_launch(n, di, quant):
        raise ValueError(f"a checking insert reads every slot in each program: {n} keys are too many")
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
        CHECK_BLOCK=min(1024, next_power_of_2(n)),
        num_warps=4,
    )


__all__ = ["CHECK_READS", "checks_in_launch", "index_rows_store", "insert_index_cache_kernel"]
