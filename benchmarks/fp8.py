"""The decode grid of the official MSA benchmarks, bf16 and FP8 caches (suite ``fp8``).

Batch 1 / 8 / 16 / 32 / 64 / 128 x context 1K / 8K / 32K / 128K / 200K x query length 1
and 8 (speculative decode: 8 draft queries per request, each with its own selection), at
the model's sizes (64 query heads, 4 KV heads, head dim 128, index dim 128, top-k 16).
Each cell is measured twice, with bf16 caches and with FP8 caches (FP8 index keys with
per-token scales, FP8 KV with per-(token, head) scales, SPEC section 9), all through one
:class:`mm3lab.MSADecodePlan` per buffer set:

* ``indexer_decode_grid``: the scoring launch (``plan.stages()["indexer_scores"]``);
  ``bytes`` = the index keys (and scales) it reads, so ``fraction_of_copy_bw`` is the
  indexer's share of copy bandwidth;
* ``msa_decode_grid`` with ``shape.stage``: ``topk_block_table`` (the fused top-k +
  sparse block table), ``attention``, and ``step`` (the whole planned step: rows and
  slots, both inserts, indexer, top-k + table, attention); on a GPU with programmatic
  dependent launch (:mod:`mm3lab._pdl`), also ``step_no_pdl`` at batch <= 16, query
  length 1: the same step with its launches in plain stream order.

Every time is a CUDA-graph replay (``mode = "graph"``) of 20 calls rotating over buffer
sets (one plan, block table and set of queries each, the caches sized to >= 256 MB) so
L2 stays cold; median and cv over the samples. The baseline is dense SDPA over the whole
context (contiguous ``[B, Hkv, S, D]`` bf16 K/V, GQA), measured in the same run at the
same batch, context and query length (for 8 queries it attends the whole context without
the causal tail: the same bytes). Records carry ``shape.dtype`` (``bf16`` / ``fp8``),
``shape.index_dtype``, ``shape.kv_dtype`` and ``shape.q_len``.

The full grid does not fit a few minutes: cells run in priority order (batch 64 at 128K
first, then batch 1 at every context, then the rest) and once :data:`TIME_CAP_S` seconds
are spent the remaining cells are skipped, each named in the run's notes. Cells whose
caches do not fit the free GPU memory are skipped the same way. ``--quick`` runs batch 1
and 64 at 8K and 128K. ``--dry-run`` runs the code on the CPU with tiny shapes (eager
times, the PyTorch path).
"""

from __future__ import annotations

import math
import sys
import time

import torch

import mm3lab
from mm3lab import _pdl
from mm3lab.constants import SPARSE_BLOCK_SIZE
from mm3lab.fp8 import FP8_DTYPE, quantize

from .common import ROTATE_BYTES, Context, Timing, fallback_reason, msa_args, num_sets

TIME_CAP_S = 240.0
"""Seconds the grid may spend; later cells are skipped (and noted)."""

K = 1024
GRID_BATCHES = (1, 8, 16, 32, 64, 128)
GRID_CONTEXTS = (K, 8 * K, 32 * K, 128 * K, 200 * K)
GRID_Q_LENS = (1, 8)
QUICK_CELLS = tuple((b, c) for b in (64, 1) for c in (128 * K, 8 * K))
STAGES = ("indexer_scores", "topk_block_table", "attention")


def grid_cells(quick: bool) -> list[tuple[int, int]]:
    """(batch, context) cells in the order they run: the goals' cells first."""
    if quick:
        return list(QUICK_CELLS)
    cells = [(64, 128 * K)] + [(1, c) for c in GRID_CONTEXTS]
    cells += [(b, c) for b in GRID_BATCHES for c in GRID_CONTEXTS if (b, c) not in cells]
    return cells


def _elt(dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _fill(ctx: Context, t: torch.Tensor, scale: torch.Tensor | None, g, chunk: int = 512) -> None:
    """Random normal contents, block by block (FP8: quantized by the SPEC 9 rule into ``t`` and ``scale``)."""
    for i in range(0, t.shape[0], chunk):
        x = torch.randn(t[i : i + chunk].shape, generator=g, device=ctx.device, dtype=torch.float32)
        if scale is None:
            t[i : i + chunk] = x
        else:
            values, s = quantize(x)
            t[i : i + chunk] = values
            scale[i : i + chunk] = s


class GridProblem:
    """One cell: caches of ``dtype`` holding ``batch`` requests of ``context`` tokens, and buffer sets."""

    def __init__(self, ctx: Context, batch: int, context: int, q_len: int, dtype: str, seed: int = 0):
        s = self.s = ctx.shapes
        fp8 = dtype == "fp8"
        dev, qdt = ctx.device, s.dtype
        cache_dt = FP8_DTYPE if fp8 else qdt
        self.batch, self.context, self.q_len, self.dtype = batch, context, q_len, dtype
        self.m = m = math.ceil(context / SPARSE_BLOCK_SIZE)
        block_bytes = SPARSE_BLOCK_SIZE * (s.hkv * s.d * 2 + s.di) * _elt(cache_dt)
        need = batch * m
        self.num_blocks = max(need, math.ceil(ROTATE_BYTES / block_bytes)) if ctx.cuda else need + 2
        g = torch.Generator(device=dev).manual_seed(seed)
        self.cache = mm3lab.allocate_kv_cache(self.num_blocks, s.hkv, s.d, "dense", dtype=cache_dt, device=dev)
        _fill(ctx, self.cache.kv, self.cache.scale, g)
        self.index_cache = mm3lab.allocate_index_cache(self.num_blocks, s.di, dtype=cache_dt, device=dev)
        self.index_scale = mm3lab.allocate_index_scale(self.num_blocks, device=dev) if fp8 else None
        _fill(ctx, self.index_cache, self.index_scale, g)
        self.scales = {"index_scale": self.index_scale, "k_scale": self.cache.k_scale, "v_scale": self.cache.v_scale}
        n = batch * q_len

        def rnd(*shape):
            return torch.randn(*shape, generator=g, device=dev, dtype=qdt)

        self.sets = []
        for _ in range(4 if ctx.cuda else 2):
            bt = torch.randperm(self.num_blocks, generator=g, device=dev)[:need].view(batch, m).to(torch.int32)
            self.sets.append(
                {
                    "q": rnd(n, s.hq, s.d),
                    "key": rnd(n, s.hkv, s.d),
                    "value": rnd(n, s.hkv, s.d),
                    "index_q": rnd(n, s.hkv, s.di),
                    "index_k": rnd(n, s.di),
                    "block_table": bt,
                    "seq_lens": torch.full((batch,), context, dtype=torch.int32, device=dev),
                }
            )
        self.plans = [
            mm3lab.MSADecodePlan(
                self.cache.k_cache,
                self.cache.v_cache,
                self.index_cache,
                batch=batch,
                max_blocks=m,
                num_q_heads=s.hq,
                decode_query_len=q_len,
                topk=s.topk,
                query_dtype=qdt,
                # the per-row kernel throughout (the automatic choice takes the tiled one from 1024
                # rows): one attention kernel across the grid's rows
                algorithm="rows",
                **self.scales,
            )
            for _ in self.sets
        ]

    def args(self, st) -> tuple:
        return msa_args(st, self.cache, self.index_cache)

    def step_fns(self) -> list:
        pairs = zip(self.plans, self.sets, strict=False)
        return [lambda p=p, st=st: p.run(*self.args(st), **self.scales) for p, st in pairs]

    def stage_fns(self) -> dict:
        stages = [p.stages(*self.args(st), **self.scales) for p, st in zip(self.plans, self.sets, strict=False)]
        return {name: [st[name] for st in stages] for name in STAGES}

    # bytes each launch reads (and the step's inserts write: negligible)
    def indexer_bytes(self) -> int:
        s = self.s
        per_token = s.di * _elt(self.index_cache.dtype) + (4 if self.index_scale is not None else 0)
        return self.batch * self.context * per_token + self.batch * self.q_len * s.hkv * s.di * _elt(s.dtype)

    def attention_bytes(self) -> int:
        s = self.s
        tokens = min(s.topk * SPARSE_BLOCK_SIZE, self.context)
        per_token_head = 2 * s.d * _elt(self.cache.kv.dtype) + (8 if self.cache.scale is not None else 0)
        rows = self.batch * self.q_len
        return rows * s.hkv * tokens * per_token_head + 2 * rows * s.hq * s.d * _elt(s.dtype)

    def table_bytes(self) -> int:
        """Scores read, top-k ids and the sparse block table (8 pages per block) written."""
        s = self.s
        rows = self.batch * self.q_len
        return rows * s.hkv * (self.m * 4 + s.topk * 4 * 9)


def dense_bytes(ctx: Context, batch: int, context: int) -> int:
    """Bytes of one dense K/V set."""
    s = ctx.shapes
    return 2 * batch * s.hkv * context * s.d * _elt(s.dtype)


def dense_sets(ctx: Context, batch: int, context: int) -> int:
    return num_sets(dense_bytes(ctx, batch, context)) if ctx.cuda else 1


class DenseProblem:
    """Dense SDPA inputs: contiguous K/V ``[B, Hkv, S, D]`` in enough sets for cold L2, queries ``[B, Hq, q, D]``."""

    def __init__(self, ctx: Context, batch: int, context: int, q_lens, seed: int = 1):
        s = ctx.shapes
        n = dense_sets(ctx, batch, context)
        g = torch.Generator(device=ctx.device).manual_seed(seed)
        self.kv = [
            tuple(
                torch.randn(batch, s.hkv, context, s.d, generator=g, device=ctx.device, dtype=s.dtype) for _ in range(2)
            )
            for _ in range(n)
        ]
        self.q = {
            ql: [torch.randn(batch, s.hq, ql, s.d, generator=g, device=ctx.device, dtype=s.dtype) for _ in range(n)]
            for ql in q_lens
        }

    def fns(self, q_len: int) -> list:
        qs = self.q[q_len]
        return [
            lambda i=i: torch.nn.functional.scaled_dot_product_attention(qs[i], *self.kv[i], enable_gqa=True)
            for i in range(len(self.kv))
        ]


def _time(ctx: Context, fns) -> Timing | None:
    """Graph replay on the GPU, eager on the CPU (validation off: graph capture forbids syncs)."""
    with mm3lab.validation(False):
        return ctx.graph(fns) if ctx.cuda else ctx.eager(fns)


def _cell_bytes(ctx: Context, batch: int, context: int, dtype: str) -> int:
    s = ctx.shapes
    elt = 1 if dtype == "fp8" else _elt(s.dtype)
    blocks = max(batch * math.ceil(context / SPARSE_BLOCK_SIZE), 1)
    return blocks * SPARSE_BLOCK_SIZE * ((s.hkv * s.d * 2 + s.di) * elt + 12 * s.hkv + 4)


def _fits(ctx: Context, nbytes: int) -> bool:
    if not ctx.cuda:
        return True
    free, _ = torch.cuda.mem_get_info()
    return nbytes < 0.85 * free


def _free(ctx: Context) -> None:
    if ctx.cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _shape(ctx: Context, batch: int, context: int, q_len: int, dtype: str, stage: str | None) -> dict:
    s = ctx.shapes
    shape = {
        "batch": batch,
        "context": context,
        "q_len": q_len,
        "dtype": dtype,
        "index_dtype": dtype,
        "kv_dtype": dtype,
        "topk": s.topk,
        "q_heads": s.hq,
        "kv_heads": s.hkv,
        "head_dim": s.d,
        "index_dim": s.di,
    }
    if stage is not None:
        shape["stage"] = stage
    return shape


def _record(ctx, name, shape, t: Timing | None, dense: Timing | None, nbytes, fallback) -> None:
    if t is None:
        return
    ctx.add(
        name,
        shape,
        t.ms,
        None if dense is None else "dense_sdpa",
        None if dense is None else dense.ms,
        nbytes,
        **t.fields(),
        validation=None if t.mode == "graph" else False,
        fallback=fallback,
        **({} if dense is None else {"baseline_cv": round(dense.cv, 4)}),
    )


def _run_cell(ctx: Context, batch: int, context: int, q_lens) -> None:
    s = ctx.shapes
    dense = {}
    if _fits(ctx, dense_bytes(ctx, batch, context) * dense_sets(ctx, batch, context)):
        dp = DenseProblem(ctx, batch, context, q_lens)
        for ql in q_lens:
            dense[ql] = _time(ctx, dp.fns(ql))
        del dp
        _free(ctx)
    else:
        ctx.notes.append(f"fp8 grid b{batch} c{context}: dense SDPA K/V do not fit the free memory; no baseline")
    for dtype in (s.dtype_name, "fp8"):  # bf16 on the GPU (float32 in the CPU dry run)
        if not _fits(ctx, _cell_bytes(ctx, batch, context, dtype)):
            ctx.notes.append(f"fp8 grid b{batch} c{context} {dtype}: the caches do not fit the free memory; skipped")
            continue
        for ql in q_lens:
            p = GridProblem(ctx, batch, context, ql, dtype)
            with mm3lab.validation(False):
                outs = [f() for f in p.step_fns()]
            fallback = fallback_reason()
            if not all(bool(torch.isfinite(o).all()) for o in outs[:1]):
                raise AssertionError(f"fp8 grid b{batch} c{context} q{ql} {dtype}: non-finite output")
            base = dense.get(ql)
            if p.plans[0].uses_kernels:
                stage_fns = p.stage_fns()
                # (record name, shape.stage, launch, bytes it reads)
                for name, shape_stage, stage, nbytes in (
                    ("indexer_decode_grid", None, "indexer_scores", p.indexer_bytes()),
                    ("msa_decode_grid", "topk_block_table", "topk_block_table", p.table_bytes()),
                    ("msa_decode_grid", "attention", "attention", p.attention_bytes()),
                ):
                    shape = _shape(ctx, batch, context, ql, dtype, shape_stage)
                    _record(ctx, name, shape, _time(ctx, stage_fns[stage]), base, nbytes, fallback)
            elif "fp8 grid: stages" not in " ".join(ctx.notes):
                ctx.notes.append(
                    f"fp8 grid: stages not timed on the {mm3lab.get_backend()} backend (no separate "
                    "launches); the whole step only"
                )
            _record(
                ctx,
                "msa_decode_grid",
                _shape(ctx, batch, context, ql, dtype, "step"),
                _time(ctx, p.step_fns()),
                base,
                p.indexer_bytes() + p.attention_bytes() + p.table_bytes(),
                fallback,
            )
            if ql == 1 and batch <= 16 and p.plans[0].uses_kernels and _pdl.enabled(torch.device(ctx.device)):
                # the same step with every launch in stream order (no PDL): each plan records its launches
                # anew, as a recording made with PDL is not replayed without it (mm3lab._replay)
                with _pdl.switched(False):
                    no_pdl = _time(ctx, p.step_fns())
                _record(
                    ctx,
                    "msa_decode_grid",
                    _shape(ctx, batch, context, ql, dtype, "step_no_pdl"),
                    no_pdl,
                    base,
                    p.indexer_bytes() + p.attention_bytes() + p.table_bytes(),
                    fallback,
                )
            del p, outs
            _free(ctx)


def run_fp8_grid(ctx: Context) -> None:
    """The decode grid (see the module docstring); stops starting cells after :data:`TIME_CAP_S` seconds."""
    if ctx.dry_run or not ctx.cuda:
        cells, q_lens = [(2, 300)], (1, 2)
    else:
        cells, q_lens = list(ctx.cells or grid_cells(ctx.quick)), GRID_Q_LENS
    started = time.time()
    for i, (batch, context) in enumerate(cells):
        if time.time() - started > TIME_CAP_S or ctx.out_of_time(f"fp8 grid b{batch} c{context}"):
            rest = ", ".join(f"b{b} c{c // K}K" for b, c in cells[i:])
            ctx.notes.append(
                f"fp8 grid: time cap {TIME_CAP_S:.0f} s reached after {i} of {len(cells)} cells; skipped {rest}"
            )
            break
        print(f"  fp8 grid b{batch} c{context} ({time.time() - started:.0f}s)", file=sys.stderr, flush=True)
        try:
            _run_cell(ctx, batch, context, q_lens)
        except torch.cuda.OutOfMemoryError as exc:
            ctx.notes.append(f"fp8 grid b{batch} c{context}: out of memory ({str(exc).splitlines()[0][:120]})")
            _free(ctx)


__all__ = ["GRID_BATCHES", "GRID_CONTEXTS", "GRID_Q_LENS", "TIME_CAP_S", "grid_cells", "run_fp8_grid"]
