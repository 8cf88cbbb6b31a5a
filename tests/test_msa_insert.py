"""The fused first launch of a planned step (mm3lab.msa.insert) writes exactly what the three entry kernels write.

Rows, slots, both caches and their FP8 scales are compared bit for bit with
``rows_and_slots`` + the index-cache insert + the KV write, over decode and prefill rows,
padded rows (a negative position, a request outside the batch), rows past the block table,
slots past a cache, both layouts, float32 / float16 / FP8 caches (FP8 quantizes in float32:
the interpreter's bf16 arithmetic is inexact) and bf16 copied as it is, on the CPU
interpreter and, where present, the GPU.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mm3lab
from mm3lab.fp8 import FP8_DTYPE
from mm3lab.msa.insert import _three_launches, step_insert_kernel

H, D, DI = 2, 32, 16


def _caches(device, num_blocks, layout, kv_dtype, index_dtype, gen):
    kv = mm3lab.allocate_kv_cache(num_blocks, H, D, layout, dtype=kv_dtype, device=device, fill=0.0)
    ic = mm3lab.allocate_index_cache(num_blocks, DI, dtype=index_dtype, device=device, fill=0.0)
    isc = mm3lab.allocate_index_scale(num_blocks, device=device) if index_dtype == FP8_DTYPE else None
    if kv_dtype != FP8_DTYPE:  # (history, so that a wrong write is seen)
        kv.kv.copy_(torch.randn(kv.kv.shape, generator=gen).to(kv_dtype))
    return kv, ic, isc


def _clone(kv, ic, isc):
    kv2 = mm3lab.allocate_kv_cache(kv.num_blocks, H, D, kv.layout, dtype=kv.kv.dtype, device=kv.kv.device)
    kv2.kv.copy_(kv.kv)
    if kv.scale is not None:
        kv2.scale.copy_(kv.scale)
    return kv2, ic.clone(), None if isc is None else isc.clone()


def _run(fn, bt, rows, inputs, caches):
    kv, ic, isc = caches
    n = inputs["key"].shape[0]
    slots = torch.full((n,), 7, dtype=torch.int64, device=bt.device)
    if rows[0] == "decode":
        req = torch.full((n,), 5, dtype=torch.int32, device=bt.device)
        pos = torch.full((n,), 5, dtype=torch.int32, device=bt.device)
        extra = (rows[1], rows[2])
    else:
        req, pos = rows[1], rows[2]
        extra = (None, 1)
    fn(
        bt, req, pos, slots, inputs["index_k"], ic, inputs["key"], inputs["value"], kv.k_cache, kv.v_cache,
        kv.block_page_stride, *extra, isc, kv.k_scale, kv.v_scale,
    )  # fmt: skip
    return req, pos, slots


def _fused(bt, req, pos, slots, index_k, ic, key, value, kc, vc, stride, seq_lens, dql, isc, ks, vs):
    step_insert_kernel(
        bt, req, pos, slots, index_k, ic, key, value, kc, vc, stride,
        seq_lens=seq_lens, decode_query_len=dql, index_scale=isc, k_scale=ks, v_scale=vs,
    )  # fmt: skip


def _check(device, layout, kv_dtype, index_dtype, rows_of, num_blocks, m, batch, n, seed):
    gen = torch.Generator().manual_seed(seed)
    caches = _caches(device, num_blocks, layout, kv_dtype, index_dtype, gen)
    twin = _clone(*caches)
    bt = torch.randint(-1, num_blocks + 2, (batch, m), generator=gen, dtype=torch.int32)  # some past the cache
    bt = bt.to(device)
    rows = rows_of(gen, batch, m, n)
    rows = tuple(r.to(device) if isinstance(r, torch.Tensor) else r for r in rows)
    n = rows[1].shape[0] * rows[2] if rows[0] == "decode" else rows[1].shape[0]
    src = torch.float16 if kv_dtype == FP8_DTYPE else kv_dtype
    inputs = {
        "key": torch.randn(n, H, D, generator=gen).to(src).to(device),
        "value": torch.randn(n, H, D, generator=gen).to(src).to(device),
        "index_k": torch.randn(n, DI, generator=gen).to(src if index_dtype == FP8_DTYPE else index_dtype).to(device),
    }
    got = _run(_fused, bt, rows, inputs, caches)
    want = _run(_three_launches, bt, rows, inputs, twin)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    kv, ic, isc = caches
    kv2, ic2, isc2 = twin
    assert torch.equal(kv.kv.view(torch.uint8), kv2.kv.view(torch.uint8))
    assert torch.equal(ic.view(torch.uint8), ic2.view(torch.uint8))
    if kv.scale is not None:
        assert torch.equal(kv.scale, kv2.scale)
    if isc is not None:
        assert torch.equal(isc, isc2)
    return got


def _decode_rows(dql):
    def rows(gen, batch, m, n):
        seq_lens = torch.randint(-1, m * 128 + 3, (batch,), generator=gen, dtype=torch.int32)
        seq_lens[0] = 0  # (padded rows)
        seq_lens[-1] = 130  # (live rows, in the table's second block)
        return ("decode", seq_lens, dql)

    return rows


def _prefill_rows(gen, batch, m, n):
    req = torch.randint(-1, batch + 1, (n,), generator=gen, dtype=torch.int32)  # some outside the batch
    pos = torch.randint(-2, m * 128 + 3, (n,), generator=gen, dtype=torch.int32)  # padded, past the table
    req[0], pos[0] = 0, -1  # (a padded row)
    req[-1], pos[-1] = batch - 1, 5  # (a live row)
    return ("prefill", req, pos)


CASES = [
    ("dense", torch.float32, torch.float32, _decode_rows(1)),
    ("packed", torch.float16, torch.float16, _decode_rows(3)),
    ("dense", FP8_DTYPE, FP8_DTYPE, _decode_rows(2)),
    ("packed", FP8_DTYPE, torch.float16, _prefill_rows),
    ("dense", torch.float16, FP8_DTYPE, _prefill_rows),
    ("packed", torch.float32, torch.float32, _prefill_rows),
]


@pytest.mark.parametrize("layout,kv_dtype,index_dtype,rows_of", CASES)
def test_fused_insert_writes_what_the_three_launches_write(device, layout, kv_dtype, index_dtype, rows_of):
    _, _, slots = _check(device, layout, kv_dtype, index_dtype, rows_of, 6, 3, 3, 7, seed=1)
    assert (slots < 0).any() and ((slots >= 0) & (slots < 6 * 128)).any()  # padded rows, and rows written


def test_fused_insert_with_bf16_inputs_copies_them_exactly(device):
    _check(device, "dense", torch.bfloat16, torch.bfloat16, _decode_rows(1), 4, 2, 2, 2, seed=3)


def test_fused_insert_of_no_rows_writes_nothing(device):
    gen = torch.Generator().manual_seed(0)
    kv, ic, isc = _caches(device, 2, "dense", torch.float32, torch.float32, gen)
    before = kv.kv.clone()
    bt = torch.zeros(1, 1, dtype=torch.int32, device=device)
    empty = torch.empty(0, dtype=torch.int32, device=device)
    step_insert_kernel(
        bt, empty, empty, torch.empty(0, dtype=torch.int64, device=device),
        torch.empty(0, DI, device=device), ic, torch.empty(0, H, D, device=device), torch.empty(0, H, D, device=device),
        kv.k_cache, kv.v_cache, kv.block_page_stride, seq_lens=torch.empty(0, dtype=torch.int32, device=device),
    )  # fmt: skip
    assert torch.equal(kv.kv, before)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    case=st.sampled_from(CASES),
    num_blocks=st.integers(1, 5),
    m=st.integers(1, 4),
    batch=st.integers(1, 3),
    n=st.integers(1, 6),
    seed=st.integers(0, 2**16),
)
def test_fused_insert_matches_the_three_launches_property(device, case, num_blocks, m, batch, n, seed):
    layout, kv_dtype, index_dtype, rows_of = case
    _check(device, layout, kv_dtype, index_dtype, rows_of, num_blocks, m, batch, n, seed)
