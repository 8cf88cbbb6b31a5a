"""One function per entry point; each appends records to the Context (method: see ``common``).

Shapes are the model's (SPEC section 1): 64 query heads, 4 KV heads, head dim 128,
index dim 128, bf16, top-k 16, 128-token blocks. ``--dry-run`` swaps in tiny shapes
and float32 so that every suite's code runs on the CPU in seconds.

Every entry point is timed eager (validation on and off) and as a CUDA-graph replay,
next to its baselines in the same mode, on the same inputs:

* attention (decode and prefill): dense SDPA over the whole context, gather + SDPA
  (the selected tokens gathered, then SDPA), and compiled FlexAttention with a block
  mask built from the same selection (over contiguous, unpaged K/V);
* block table, indexer, top-k, index-cache insert: the same step as PyTorch ops;
* the MSA decode step (one-shot and planned): dense SDPA and the gather pipeline.

``msa_decode_stages`` times each launch of a planned decode step on its own.

Beside the default eager path, the same calls with one host-time measure off, in the same
run: ``*_no_replay`` (repeated calls not replayed), ``*_merge_launch`` (split attention merged
by a launch of its own, as inside a CUDA graph, instead of by its last split) and
``msa_decode_no_kept_checks`` (the value check's launch built anew every call).
"""

from __future__ import annotations

import dataclasses
import math
import sys

import torch
import triton

import mm3lab
from mm3lab import _valcheck
from mm3lab.attention import kernel as attn_kernel
from mm3lab.constants import HEAD_DIM, INDEX_HEAD_DIM, NUM_KV_HEADS, NUM_Q_HEADS, SPARSE_BLOCK_SIZE
from mm3lab.testing import relative_error

from . import baselines
from .common import ROTATE_BYTES, Context, Timing, fallback_reason, msa_args, num_sets, time_replay

K128 = 128 * 1024


@dataclasses.dataclass
class Shapes:
    """The sizes a run uses: the model's on the GPU, tiny ones for the CPU dry run."""

    hq: int
    hkv: int
    d: int
    di: int
    topk: int
    dtype: torch.dtype
    attention_batches: tuple
    decode_context: int
    prefill_context: int
    prefill_chunk: int
    table_batches: tuple
    indexer_batches: tuple
    topk_rows: tuple
    topk_width: int
    insert_tokens: tuple
    msa_batches: tuple
    stage_shapes: tuple  # (batch, context) pairs
    spec_batches: tuple = (16, 64)
    spec_q_lens: tuple = (2, 4, 8)

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).replace("torch.", "").replace("bfloat16", "bf16").replace("float", "fp")


def model_shapes(quick: bool) -> Shapes:
    stage = [(b, c) for c in (K128, 32 * 1024, 8 * 1024) for b in (1, 16, 64)]  # 128K first (the budget)
    return Shapes(
        hq=NUM_Q_HEADS,
        hkv=NUM_KV_HEADS,
        d=HEAD_DIM,
        di=INDEX_HEAD_DIM,
        topk=16,
        dtype=torch.bfloat16,
        attention_batches=(16,) if quick else (1, 16, 64),
        decode_context=K128,
        prefill_context=32 * 1024,
        prefill_chunk=1024 if quick else 4096,
        table_batches=(64,) if quick else (1, 16, 64),
        indexer_batches=(16,) if quick else (1, 16, 64),
        topk_rows=(64,) if quick else (64, 1024),
        topk_width=8192,
        insert_tokens=(16,) if quick else (16, 4096),
        msa_batches=(16,) if quick else (1, 16, 64),
        stage_shapes=((16, K128),) if quick else tuple(stage),
        spec_batches=(16,) if quick else (16, 64),
        spec_q_lens=(4,) if quick else (2, 4, 8),
    )


def dry_run_shapes() -> Shapes:
    return Shapes(
        hq=4,
        hkv=2,
        d=16,
        di=16,
        topk=2,
        dtype=torch.float32,
        attention_batches=(2,),
        decode_context=300,
        prefill_context=512,
        prefill_chunk=128,
        table_batches=(2,),
        indexer_batches=(2,),
        topk_rows=(4,),
        topk_width=64,
        insert_tokens=(4,),
        msa_batches=(2,),
        stage_shapes=((2, 300),),
        spec_batches=(2,),
        spec_q_lens=(2,),
    )


def _shapes(ctx: Context) -> Shapes:
    return ctx.shapes  # set by __main__


def _elt(dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _try(ctx: Context, label: str, fn):
    """Run one measurement; a failure is noted (and the suite goes on) instead of ending the run."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 (a baseline that cannot run here is a note, not a failed run)
        ctx.notes.append(f"{label}: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}")
        print(f"  skipped {label}: {type(exc).__name__}: {exc}", file=sys.stderr)
        if ctx.cuda:
            torch.cuda.synchronize()
        return None


def _ours(ctx: Context, fns, label: str, *, validation: bool = True, graph: bool = True) -> dict:
    """``{(mode, validation): Timing}`` of an mm3lab entry point: eager on, eager off, graph."""
    out = {}
    if validation:
        with mm3lab.validation(True):
            out[("eager", True)] = _try(ctx, f"{label} eager", lambda: ctx.eager(fns))
        with mm3lab.validation(False):
            out[("eager", False)] = _try(ctx, f"{label} eager (validation off)", lambda: ctx.eager(fns))
    else:
        out[("eager", None)] = _try(ctx, f"{label} eager", lambda: ctx.eager(fns))
    if graph and ctx.cuda:
        with mm3lab.validation(False):
            out[("graph", None)] = _try(ctx, f"{label} graph", lambda: ctx.graph(fns))
    return out


def _no_replay(ctx: Context, fns, label: str) -> dict:
    """``{("eager", validation): Timing}`` of an entry point with repeated-call replay off
    (``mm3lab._replay.ENABLED = False``: every call checks everything and launches through Triton),
    measured beside :func:`_ours` so that one run shows what the replay saves."""
    from mm3lab import _replay

    return _switched(ctx, fns, f"{label} (no replay)", [(_replay, "ENABLED", False)])


def _switched(ctx: Context, fns, label: str, settings) -> dict:
    """``{("eager", validation): Timing}`` of an entry point with package settings changed (``settings``:
    ``(module, name, value)`` triples), measured beside :func:`_ours` so that one run shows what each
    is worth. The call memos and recorded steps are cleared before and after (a recording keeps the
    launches it was made with)."""
    from mm3lab import _replay
    from mm3lab.msa import recorded

    saved = [(module, name, getattr(module, name)) for module, name, _ in settings]
    for module, name, value in settings:
        setattr(module, name, value)
    _replay.clear_memos()
    recorded.clear()
    try:
        return _ours(ctx, fns, label, graph=False)
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
        _replay.clear_memos()
        recorded.clear()


def _theirs(ctx: Context, fns, label: str) -> dict:
    """``{mode: Timing}`` of a baseline."""
    out = {"eager": _try(ctx, f"{label} eager", lambda: ctx.eager(fns))}
    if ctx.cuda:
        out["graph"] = _try(ctx, f"{label} graph", lambda: ctx.graph(fns))
    return out


def _free(ctx: Context) -> None:
    if ctx.cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _per_batch(ctx: Context, batches, one) -> None:
    """``one(ctx, batch)`` for each batch the suite still has time for (a skipped batch is noted), the
    GPU memory freed after each."""
    for batch in batches:
        if ctx.out_of_time(f"batch {batch}"):
            continue
        one(ctx, batch)
        _free(ctx)


# ----------------------------------------------------------------------------
# problems
# ----------------------------------------------------------------------------


class DecodeProblem:
    """``batch`` requests of ``context`` tokens over one paged KV cache and index cache, and
    several input sets (each its own random block table over the whole cache, queries and
    selection): calls rotate over the sets, so consecutive calls read different blocks."""

    def __init__(
        self, ctx: Context, batch: int, context: int, *, layout: str = "dense", seed: int = 0, index: bool = True
    ):
        s = _shapes(ctx)
        dev, dt = ctx.device, s.dtype
        self.batch, self.context, self.s = batch, context, s
        self.m = m = math.ceil(context / SPARSE_BLOCK_SIZE)
        need = batch * m
        block_bytes = SPARSE_BLOCK_SIZE * s.hkv * s.d * 2 * _elt(dt)
        self.num_blocks = max(need, math.ceil(ROTATE_BYTES / block_bytes)) if ctx.cuda else need + 3
        self.cache = mm3lab.allocate_kv_cache(self.num_blocks, s.hkv, s.d, layout, dtype=dt, device=dev)
        g = torch.Generator(device=dev).manual_seed(seed)
        self.cache.kv.normal_(generator=g)
        self.stride = self.cache.block_page_stride
        self.index_cache = None
        if index:
            self.index_cache = torch.randn(self.num_blocks, SPARSE_BLOCK_SIZE, s.di, generator=g, device=dev, dtype=dt)
        nsets = 4 if ctx.cuda else 2
        self.g = g
        self.sets = [self._set(g, ctx) for _ in range(nsets)]

    def new_sets(self, ctx: Context, *, q_len: int = 1, selection: str = "random", nsets: int | None = None) -> list:
        """Input sets over the same caches with ``q_len`` query rows per request (speculative decode: rows
        ``r * q_len + i`` at positions ``context - q_len + i``); ``selection``: ``"random"`` per row, or
        ``"shared"`` (one draw per request, shared by its rows)."""
        nsets = nsets or (4 if ctx.cuda else 2)
        return [self._set(self.g, ctx, q_len=q_len, selection=selection) for _ in range(nsets)]

    def _set(self, g, ctx, *, q_len: int = 1, selection: str = "random"):
        s, b, m, dev, dt = self.s, self.batch, self.m, ctx.device, self.s.dtype
        rows = b * q_len
        bt = torch.randperm(self.num_blocks, generator=g, device=dev)[: b * m].view(b, m).to(torch.int32)
        seq_lens = torch.full((b,), self.context, dtype=torch.int32, device=dev)
        if selection == "shared":
            scores = torch.rand(s.hkv, b, m, generator=g, device=dev).repeat_interleave(q_len, dim=1)
        else:
            scores = torch.rand(s.hkv, rows, m, generator=g, device=dev)
        pos = self.context - q_len + torch.arange(rows, device=dev) % q_len
        blk = torch.arange(m, device=dev)
        scores = scores.masked_fill(blk.view(1, 1, -1) > (pos // SPARSE_BLOCK_SIZE).view(1, -1, 1), -1.0)
        scores.scatter_(2, (pos // SPARSE_BLOCK_SIZE).view(1, -1, 1).expand(s.hkv, -1, 1), 2.0)  # the local block
        topk_idx = scores.topk(min(s.topk, m), dim=-1).indices.to(torch.int32)
        with mm3lab.validation(False):
            sbt, sctx = mm3lab.build_sparse_block_table_decode(
                topk_idx, bt, seq_lens, decode_query_len=q_len, block_page_stride=self.stride
            )

        def rnd(*shape):
            return torch.randn(*shape, generator=g, device=dev, dtype=dt)

        return {
            "block_table": bt,
            "seq_lens": seq_lens,
            "topk_idx": topk_idx,
            "sparse_bt": sbt,
            "sparse_ctx": sctx,
            "q": rnd(rows, s.hq, s.d),
            "key": rnd(b, s.hkv, s.d),
            "value": rnd(b, s.hkv, s.d),
            "index_q": rnd(b, s.hkv, s.di),
            "index_k": rnd(b, s.di),
        }

    def msa_args(self, st) -> tuple:
        return msa_args(st, self.cache, self.index_cache)

    def attended_bytes(self) -> int:
        return self.attended_bytes_of(self.sets[0])

    def attended_bytes_of(self, st) -> int:
        """K/V bytes the set's rows attend (each row's tokens once) plus q and out."""
        tokens = int(st["sparse_ctx"].sum())
        return tokens * self.s.d * 2 * _elt(self.s.dtype) + 2 * st["q"].numel() * _elt(self.s.dtype)


class DenseKV:
    """Contiguous K/V ``[B, Hkv, S, D]`` for the dense and FlexAttention baselines, in enough sets for cold L2."""

    def __init__(self, ctx: Context, batch: int, context: int, seed: int = 1):
        s = _shapes(ctx)
        bytes_per_set = 2 * batch * s.hkv * context * s.d * _elt(s.dtype)
        g = torch.Generator(device=ctx.device).manual_seed(seed)
        n = num_sets(bytes_per_set) if ctx.cuda else 1
        self.sets = [
            tuple(
                torch.randn(batch, s.hkv, context, s.d, generator=g, device=ctx.device, dtype=s.dtype) for _ in range(2)
            )
            for _ in range(n)
        ]
        self.bytes = bytes_per_set


# ----------------------------------------------------------------------------
# FlexAttention with a block mask from the selection
# ----------------------------------------------------------------------------

_FLEX = {}


def _flex_fn(ctx: Context):
    """Compiled ``flex_attention`` on the GPU (the uncompiled one on the CPU dry run)."""
    from torch.nn.attention.flex_attention import flex_attention

    if not ctx.cuda:
        import warnings

        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        return flex_attention
    if "fn" not in _FLEX:
        import torch._dynamo

        for name in ("recompile_limit", "cache_size_limit"):  # one compile per shape, a few shapes per run
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, max(64, getattr(torch._dynamo.config, name)))
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    return _FLEX["fn"]


def _block_mask_from_selection(selected: torch.Tensor, group: int, q_len: int, kv_len: int, q_pos0, mask_mod):
    """A ``BlockMask`` whose listed KV blocks per (batch, query head, 128-row query block) are the selected ones.

    ``selected``: ``[B, Hkv, Q_BLOCKS, M]`` bool; every listed block is partial (``mask_mod`` decides per token).
    """
    from torch.nn.attention.flex_attention import BlockMask

    sel = selected.repeat_interleave(group, dim=1)  # [B, Hq, QB, M]
    kv_num = sel.sum(-1).to(torch.int32)
    kv_idx = torch.argsort(sel.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return BlockMask.from_kv_blocks(
        kv_num,
        kv_idx,
        BLOCK_SIZE=SPARSE_BLOCK_SIZE,
        mask_mod=mask_mod,
        seq_lengths=(q_len, kv_len),
        compute_q_blocks=False,
    )


def flex_causal(seq_lens: torch.Tensor):
    """``mask_mod`` of decode rows: token ``kv`` visible to request ``b`` while ``kv < seq_lens[b]``.

    Build it once per shape and share it between block masks: a new function is a new compile."""
    last = (seq_lens.long() - 1).clone()

    def causal(b_, h_, q_, kv_):
        return kv_ <= last[b_]

    return causal


def flex_selection_mask_mod(topk_idx: torch.Tensor, seq_lens: torch.Tensor, group: int, m: int):
    """``mask_mod`` of decode rows that also holds the selection: exact for uncompiled FlexAttention too,
    which applies only ``mask_mod`` (the compiled kernel visits only the listed blocks, where the causal
    ``flex_causal`` is enough and needs no per-selection compile)."""
    hkv, b, _ = topk_idx.shape
    sel = torch.zeros(b, hkv, m + 1, dtype=torch.bool, device=topk_idx.device)
    sel.scatter_(2, torch.where(topk_idx < 0, m, topk_idx.long()).permute(1, 0, 2), True)
    last = (seq_lens.long() - 1).clone()

    def selected(b_, h_, q_, kv_):
        return sel[b_, h_ // group, kv_ // SPARSE_BLOCK_SIZE] & (kv_ <= last[b_])

    return selected


def check_flex_decode(
    out: torch.Tensor,
    q: torch.Tensor,
    kd: torch.Tensor,
    vd: torch.Tensor,
    topk_idx,
    seq_lens,
    scale: float,
    rows: int = 2,
) -> float:
    """Relative error of FlexAttention's decode output against masked softmax over the selected tokens
    (the first ``rows`` requests, float32)."""
    b, hkv, s_len, d = kd.shape
    hq = q.shape[1]
    r = min(rows, b)
    sel = flex_selection_mask_mod(topk_idx[:, :r], seq_lens[:r], hq // hkv, math.ceil(s_len / SPARSE_BLOCK_SIZE))
    kv_idx = torch.arange(s_len, device=kd.device)
    visible = torch.stack([torch.stack([sel(i, h * (hq // hkv), 0, kv_idx) for h in range(hkv)]) for i in range(r)])
    qg = q[:r].float().view(r, hkv, hq // hkv, d)
    scores = torch.einsum("bhgd,bhsd->bhgs", qg, kd[:r].float()) * scale
    scores = scores.masked_fill(~visible.unsqueeze(2), float("-inf"))
    want = torch.einsum("bhgs,bhsd->bhgd", scores.softmax(-1), vd[:r].float()).reshape(r, hq, d)
    return relative_error(out[:r].float().reshape(r, hq, d), want)


def flex_decode_inputs(topk_idx: torch.Tensor, mask_mod, group: int, m: int, kv_len: int):
    """Block mask of decode rows (one per request): the request's selected blocks, ``mask_mod`` inside them."""
    hkv, b, _ = topk_idx.shape
    selected = torch.zeros(b, hkv, 1, m + 1, dtype=torch.bool, device=topk_idx.device)
    idx = torch.where(topk_idx < 0, m, topk_idx.long()).permute(1, 0, 2).unsqueeze(2)  # [B, Hkv, 1, K]
    selected.scatter_(3, idx, True)
    return _block_mask_from_selection(selected[..., :m], group, 1, kv_len, None, mask_mod)


# ----------------------------------------------------------------------------
# suites
# ----------------------------------------------------------------------------


@triton.jit
def _empty_kernel(x_ptr):
    pass


def run_launch_overhead(ctx: Context) -> dict:
    """The floor: an empty Triton kernel, eager (one Python launch per call) and from a CUDA graph."""
    if not ctx.cuda:
        return {}
    x = torch.empty(1, device="cuda")

    def fn():
        return _empty_kernel[(1,)](x)

    eager, graph = ctx.eager(fn, calls=200), ctx.graph(fn, calls=200)
    for t in (eager, graph):
        ctx.add(
            "launch_empty_triton", {"grid": 1}, t.ms, None, None, None, **t.fields(), validation=None, fallback=None
        )
    return {"eager": eager.ms, "graph": graph.ms}


def run_attention_decode(ctx: Context) -> None:
    """``sparse_attention`` of decode rows at 128K against dense SDPA, gather + SDPA and FlexAttention."""
    _per_batch(ctx, _shapes(ctx).attention_batches, _attention_decode_one)


def _attention_decode_one(ctx, batch) -> None:
    s = _shapes(ctx)
    context, scale, group = s.decode_context, s.d**-0.5, s.hq // s.hkv
    p = DecodeProblem(ctx, batch, context, index=False)
    kc, vc = p.cache.k_cache, p.cache.v_cache
    fns = [
        lambda st=st: mm3lab.sparse_attention(st["q"], kc, vc, st["sparse_bt"], st["sparse_ctx"], scale)
        for st in p.sets
    ]
    st0 = p.sets[0]
    with mm3lab.validation(False):
        out = fns[0]()
    fallback = fallback_reason()
    ref = baselines.naive_sparse_attention(st0["q"], kc, vc, st0["sparse_bt"], st0["sparse_ctx"], scale)
    err = relative_error(out.float(), ref.float())
    assert err < 2e-2, f"sparse_attention differs from gather + SDPA: relative error {err:.3e}"
    ours = _ours(ctx, fns, f"sparse_attention b{batch}")
    no_replay = _no_replay(ctx, fns, f"sparse_attention b{batch}")
    merge_launch = _switched(ctx, fns, f"sparse_attention b{batch} (merge launch)", [(attn_kernel, "OWN_MERGE", False)])
    gather = [
        lambda st=st: baselines.naive_sparse_attention(st["q"], kc, vc, st["sparse_bt"], st["sparse_ctx"], scale)
        for st in p.sets
    ]
    theirs = {"gather_sdpa": _theirs(ctx, gather, f"gather_sdpa b{batch}")}
    dense = DenseKV(ctx, batch, context)
    n = max(len(dense.sets), len(p.sets))
    qd = [st["q"].view(batch, s.hq, 1, s.d) for st in p.sets]
    dfns = [
        lambda i=i: baselines.dense_sdpa_decode(qd[i % len(qd)], *dense.sets[i % len(dense.sets)]) for i in range(n)
    ]
    theirs["dense_sdpa"] = _theirs(ctx, dfns, f"dense_sdpa b{batch}")
    flex = _flex_fn(ctx)
    causal = flex_causal(st0["seq_lens"])  # every set has the same lengths: one compile per shape

    def mask_mod(st):
        return causal if ctx.cuda else flex_selection_mask_mod(st["topk_idx"], st["seq_lens"], group, p.m)

    masks = _try(
        ctx,
        f"flex block mask b{batch}",
        lambda: [flex_decode_inputs(st["topk_idx"], mask_mod(st), group, p.m, context) for st in p.sets],
    )
    if masks is not None:
        ffns = [
            lambda i=i: flex(
                qd[i % len(qd)],
                *dense.sets[i % len(dense.sets)],
                block_mask=masks[i % len(masks)],
                scale=scale,
                enable_gqa=True,
            )
            for i in range(n)
        ]
        flex_err = _try(
            ctx,
            f"flex_attention b{batch} check",
            lambda: check_flex_decode(
                ffns[0](), qd[0].view(batch, s.hq, s.d), *dense.sets[0], st0["topk_idx"], st0["seq_lens"], scale
            ),
        )
        if flex_err is not None and flex_err < 2e-2:
            theirs["flex_attention"] = _theirs(ctx, ffns, f"flex_attention b{batch}")
        else:
            ctx.notes.append(f"flex_attention b{batch}: output check failed (relative error {flex_err})")
    shape = {
        "batch": batch,
        "context": context,
        "q_heads": s.hq,
        "kv_heads": s.hkv,
        "head_dim": s.d,
        "topk": s.topk,
        "dtype": s.dtype_name,
        "layout": "dense",
    }
    ctx.compare(
        "sparse_attention",
        shape,
        ours,
        theirs,
        p.attended_bytes(),
        fallback,
        rel_err_vs_gather=round(err, 6),
        dense_bytes=dense.bytes,
    )
    dense_only = {"dense_sdpa": theirs["dense_sdpa"]}
    ctx.compare("sparse_attention_no_replay", shape, no_replay, dense_only, p.attended_bytes(), fallback)
    ctx.compare("sparse_attention_merge_launch", shape, merge_launch, dense_only, p.attended_bytes(), fallback)
    _free(ctx)


def run_block_table(ctx: Context) -> None:
    """``build_sparse_block_table_decode`` (caller-owned outputs) against the same table as PyTorch ops."""
    _per_batch(ctx, _shapes(ctx).table_batches, _block_table_one)


def _block_table_one(ctx, batch) -> None:
    s = _shapes(ctx)
    p = DecodeProblem(ctx, batch, s.decode_context, index=False)
    outs = [(torch.empty_like(st["sparse_bt"]), torch.empty_like(st["sparse_ctx"])) for st in p.sets]
    fns = [
        lambda st=st, o=o: mm3lab.build_sparse_block_table_decode(
            st["topk_idx"], st["block_table"], st["seq_lens"], block_page_stride=p.stride, out=o
        )
        for st, o in zip(p.sets, outs, strict=False)
    ]
    ref = [
        lambda st=st: baselines.torch_block_table_decode(
            st["topk_idx"], st["block_table"], st["seq_lens"], block_page_stride=p.stride
        )
        for st in p.sets
    ]
    with mm3lab.validation(False):
        got = fns[0]()
    fallback = fallback_reason()
    want = ref[0]()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), "block table differs from PyTorch ops"
    ours = _ours(ctx, fns, f"block_table b{batch}")
    theirs = {"torch_ops": _theirs(ctx, ref, f"torch block table b{batch}")}
    nbytes = sum(t.numel() * 4 for t in (p.sets[0]["topk_idx"], *outs[0])) + batch * s.topk * 4
    shape = {"batch": batch, "context": s.decode_context, "kv_heads": s.hkv, "topk": s.topk}
    ctx.compare("block_table_decode", shape, ours, theirs, nbytes, fallback)
    ctx.compare("block_table_decode_no_replay", shape, _no_replay(ctx, fns, f"block_table b{batch}"), theirs, nbytes)
    _free(ctx)


def run_indexer_decode(ctx: Context) -> None:
    """``index_topk_decode`` (scores + top-k) against einsum, block max and ``torch.topk``."""
    _per_batch(ctx, _shapes(ctx).indexer_batches, _indexer_decode_one)


def _indexer_decode_one(ctx, batch) -> None:
    s = _shapes(ctx)
    p = DecodeProblem(ctx, batch, s.decode_context)
    ic = p.index_cache
    fns = [
        lambda st=st: mm3lab.index_topk_decode(st["index_q"], ic, st["block_table"], st["seq_lens"], s.topk)
        for st in p.sets
    ]
    ref = [
        lambda st=st: baselines.torch_index_scores(st["index_q"], ic, st["block_table"], st["seq_lens"], p.m).topk(
            min(s.topk, p.m), dim=-1
        )
        for st in p.sets
    ]
    with mm3lab.validation(False):
        fns[0]()
    fallback = fallback_reason()
    ours = _ours(ctx, fns, f"indexer b{batch}")
    theirs = {"torch_ops": _theirs(ctx, ref, f"torch indexer b{batch}")}
    nbytes = batch * s.decode_context * s.di * _elt(s.dtype)
    shape = {
        "batch": batch,
        "context": s.decode_context,
        "index_heads": s.hkv,
        "index_dim": s.di,
        "topk": s.topk,
        "dtype": s.dtype_name,
    }
    ctx.compare("indexer_decode", shape, ours, theirs, nbytes, fallback)
    ctx.compare("indexer_decode_no_replay", shape, _no_replay(ctx, fns, f"indexer b{batch}"), theirs, nbytes)
    _free(ctx)


def run_topk(ctx: Context) -> None:
    """``topk_blocks`` over score rows (8192 blocks = 1M tokens) against ``torch.topk``."""
    s = _shapes(ctx)
    g = torch.Generator(device=ctx.device).manual_seed(7)
    for rows in s.topk_rows:
        if ctx.out_of_time(f"rows {rows}"):
            continue
        n = num_sets(rows * s.topk_width * 4) if ctx.cuda else 2
        sets = [torch.randn(rows, s.topk_width, generator=g, device=ctx.device) for _ in range(n)]
        fns = [lambda x=x: mm3lab.topk_blocks(x, s.topk) for x in sets]
        ref = [lambda x=x: torch.topk(x, s.topk, dim=-1) for x in sets]
        with mm3lab.validation(False):
            got = fns[0]()
        fallback = fallback_reason()
        assert torch.equal(got.long(), ref[0]().indices), "topk_blocks differs from torch.topk"
        ours = _ours(ctx, fns, f"topk r{rows}")
        theirs = {"torch_topk": _theirs(ctx, ref, f"torch.topk r{rows}")}
        shape, nbytes = {"rows": rows, "width": s.topk_width, "k": s.topk}, rows * s.topk_width * 4
        ctx.compare("topk", shape, ours, theirs, nbytes, fallback)
        ctx.compare("topk_no_replay", shape, _no_replay(ctx, fns, f"topk r{rows}"), theirs, nbytes)
    _free(ctx)


def run_index_cache(ctx: Context) -> None:
    """``insert_index_cache`` against ``index_copy_`` into the flattened cache."""
    s = _shapes(ctx)
    dev, dt = ctx.device, s.dtype
    num_blocks = 4096 if ctx.cuda else 8
    cache = torch.zeros(num_blocks, SPARSE_BLOCK_SIZE, s.di, dtype=dt, device=dev)
    flat = cache.view(-1, s.di)
    g = torch.Generator(device=dev).manual_seed(8)
    for tokens in s.insert_tokens:
        if ctx.out_of_time(f"tokens {tokens}"):
            continue
        sets = [
            (
                torch.randn(tokens, s.di, generator=g, device=dev, dtype=dt),
                torch.randperm(num_blocks * SPARSE_BLOCK_SIZE, generator=g, device=dev)[:tokens],
            )
            for _ in range(4 if ctx.cuda else 2)
        ]
        fns = [lambda k=k, sl=sl: mm3lab.insert_index_cache(k, cache, sl) for k, sl in sets]
        ref = [lambda k=k, sl=sl: flat.index_copy_(0, sl, k) for k, sl in sets]
        with mm3lab.validation(False):
            fns[0]()
        fallback = fallback_reason()
        ours = _ours(ctx, fns, f"insert t{tokens}")
        theirs = {"torch_ops": _theirs(ctx, ref, f"index_copy t{tokens}")}
        shape = {"tokens": tokens, "index_dim": s.di, "dtype": s.dtype_name}
        nbytes = tokens * s.di * _elt(dt) * 2 + tokens * 8
        ctx.compare("index_cache_insert", shape, ours, theirs, nbytes, fallback)
        no_replay = _no_replay(ctx, fns, f"insert t{tokens}")
        ctx.compare("index_cache_insert_no_replay", shape, no_replay, theirs, nbytes)
    _free(ctx)


def _gather_pipeline(p: DecodeProblem, scale: float):
    """The decode step as PyTorch ops: index scores, ``torch.topk``, the block table, gather + SDPA
    (the KV and index-key writes as ``index_copy_``)."""
    s = p.s
    kv_flat = p.cache.kv  # [blocks, 2, 128, Hkv, D] page-128 view, dense layout
    ic_flat = p.index_cache.view(-1, s.di)

    def step(st):
        slots = (
            st["block_table"].long()[
                torch.arange(p.batch, device=kv_flat.device), (st["seq_lens"].long() - 1) // SPARSE_BLOCK_SIZE
            ]
            * SPARSE_BLOCK_SIZE
            + (st["seq_lens"].long() - 1) % SPARSE_BLOCK_SIZE
        )
        ic_flat.index_copy_(0, slots, st["index_k"])
        blk, off = slots // SPARSE_BLOCK_SIZE, slots % SPARSE_BLOCK_SIZE
        kv_flat[blk, 0, off] = st["key"]
        kv_flat[blk, 1, off] = st["value"]
        scores = baselines.torch_index_scores(st["index_q"], p.index_cache, st["block_table"], st["seq_lens"], p.m)
        topk_idx = scores.topk(min(s.topk, p.m), dim=-1).indices.to(torch.int32)
        sbt, sctx = baselines.torch_block_table_decode(
            topk_idx, st["block_table"], st["seq_lens"], block_page_stride=p.stride
        )
        return baselines.naive_sparse_attention(st["q"], p.cache.k_cache, p.cache.v_cache, sbt, sctx, scale)

    return step


def run_msa_decode(ctx: Context) -> None:
    """One MSA decode step at 128K: ``msa_decode`` and ``MSADecodePlan`` (eager, and graph replay: the
    one-shot call captured, the plan's own ``graph=True``) against dense SDPA and the gather pipeline."""
    _per_batch(ctx, _shapes(ctx).msa_batches, _msa_decode_one)


def _msa_decode_one(ctx, batch) -> None:
    s = _shapes(ctx)
    context, scale = s.decode_context, s.d**-0.5
    p = DecodeProblem(ctx, batch, context)
    fns = [lambda st=st: mm3lab.msa_decode(*p.msa_args(st), topk=s.topk) for st in p.sets]
    with mm3lab.validation(False):
        want = fns[0]().clone()
    fallback = fallback_reason()
    ours = _ours(ctx, fns, f"msa_decode b{batch}")
    switched = {
        "msa_decode_merge_launch": [(attn_kernel, "OWN_MERGE", False)],
        "msa_decode_no_kept_checks": [(_valcheck, "KNOWN_CHECKS", 0)],
    }
    switched = {name: _switched(ctx, fns, f"{name} b{batch}", how) for name, how in switched.items()}
    plan = mm3lab.MSADecodePlan(
        p.cache.k_cache, p.cache.v_cache, p.index_cache, batch=batch, max_blocks=p.m, num_q_heads=s.hq, topk=s.topk
    )
    pfns = [lambda st=st: plan.run(*p.msa_args(st)) for st in p.sets]
    # the sets share the cache (each writes its new token into blocks another set may read): recompute the
    # one-shot output right before each comparison
    with mm3lab.validation(False):
        want = fns[0]().clone()
    assert torch.equal(pfns[0](), want), "MSADecodePlan differs from msa_decode"
    plan_t = _ours(ctx, pfns, f"msa_decode plan b{batch}", graph=False)
    if ctx.cuda and plan.uses_kernels:
        gplan = mm3lab.MSADecodePlan(
            p.cache.k_cache,
            p.cache.v_cache,
            p.index_cache,
            batch=batch,
            max_blocks=p.m,
            num_q_heads=s.hq,
            topk=s.topk,
            graph=True,
        )
        gfns = [lambda st=st: gplan.run(*p.msa_args(st)) for st in p.sets]
        with mm3lab.validation(False):
            got = gfns[0]().clone()
            want = fns[0]().clone()
            assert torch.equal(got, want), "MSADecodePlan(graph=True) differs from msa_decode"
            plan_t[("graph", None)] = _try(
                ctx,
                f"plan graph b{batch}",
                lambda: time_replay(lambda: [f() for f in gfns], calls=ctx.calls, samples=ctx.samples),
            )
        if plan_t[("graph", None)] is not None:  # the replay ran once per set: per call
            t = plan_t[("graph", None)]
            k = len(gfns)
            plan_t[("graph", None)] = Timing(
                t.ms / k, t.cv, t.samples, "graph", None if t.host_ms is None else t.host_ms / k
            )
    step = _gather_pipeline(p, scale)
    theirs = {"gather_sdpa": _theirs(ctx, [lambda st=st: step(st) for st in p.sets], f"gather pipeline b{batch}")}
    dense = DenseKV(ctx, batch, context)
    qd = [st["q"].view(batch, s.hq, 1, s.d) for st in p.sets]
    n = max(len(dense.sets), len(qd))
    dfns = [
        lambda i=i: baselines.dense_sdpa_decode(qd[i % len(qd)], *dense.sets[i % len(dense.sets)]) for i in range(n)
    ]
    theirs["dense_sdpa"] = _theirs(ctx, dfns, f"dense_sdpa b{batch}")
    nbytes = batch * (context * s.di * _elt(s.dtype)) + p.attended_bytes()
    shape = {
        "batch": batch,
        "context": context,
        "dtype": s.dtype_name,
        "topk": s.topk,
        "q_heads": s.hq,
        "kv_heads": s.hkv,
        "head_dim": s.d,
        "index_dim": s.di,
    }
    ctx.compare("msa_decode", shape, ours, theirs, nbytes, fallback)
    ctx.compare("msa_decode_plan", shape, plan_t, theirs, nbytes, fallback)
    for name, times in switched.items():
        ctx.compare(name, shape, times, {"dense_sdpa": theirs["dense_sdpa"]}, nbytes, fallback)
    _free(ctx)


def _stage_times(ctx: Context, fns, label: str) -> dict:
    with mm3lab.validation(False):
        return {
            "eager": _try(ctx, label + " eager", lambda: ctx.eager(fns)),
            "graph": _try(ctx, label + " graph", lambda: ctx.graph(fns)) if ctx.cuda else None,
        }


STAGES = ("insert", "indexer_scores", "topk", "block_table", "topk_block_table", "attention")


def run_msa_decode_stages(ctx: Context) -> None:
    """Where the time of one planned MSA decode step goes: each launch alone, eager and graph, and the
    whole step (``total``: the plan's eager ``run`` with validation off, and its launches in one graph)."""
    s = _shapes(ctx)
    for batch, context in s.stage_shapes:
        if ctx.out_of_time(f"batch {batch} context {context}"):
            continue
        _msa_decode_stages_one(ctx, batch, context)
        _free(ctx)


def _msa_decode_stages_one(ctx, batch, context) -> None:
    s = _shapes(ctx)
    p = DecodeProblem(ctx, batch, context)
    plan = mm3lab.MSADecodePlan(
        p.cache.k_cache, p.cache.v_cache, p.index_cache, batch=batch, max_blocks=p.m, num_q_heads=s.hq, topk=s.topk
    )
    if not plan.uses_kernels:
        ctx.notes.append(
            f"msa_decode_stage b{batch} c{context}: the {mm3lab.get_backend()} backend runs no separate launches"
        )
        return
    with mm3lab.validation(False):
        for st in p.sets:
            plan.run(*p.msa_args(st))
    stages = [plan.stages(*p.msa_args(st)) for st in p.sets]
    base = {"batch": batch, "context": context, "dtype": s.dtype_name, "topk": s.topk}
    for name in (*STAGES, "total"):
        if name == "total":
            fns = [lambda st=st: plan.run(*p.msa_args(st)) for st in p.sets]
        else:
            fns = [st[name] for st in stages]
        for mode, t in _stage_times(ctx, fns, f"stage {name} b{batch} c{context}").items():
            if t is not None:
                ctx.add(
                    "msa_decode_stage",
                    {**base, "stage": name},
                    t.ms,
                    None,
                    None,
                    None,
                    **t.fields(),
                    validation=False if mode == "eager" else None,
                    fallback=None,
                )
    _free(ctx)


SUITES = {
    "attention_decode": "run_attention_decode",
    "attention_prefill": "run_prefill",
    "spec_decode": "run_spec_decode",
    "block_table": "run_block_table",
    "indexer_decode": "run_indexer_decode",
    "topk": "run_topk",
    "index_cache": "run_index_cache",
    "msa_decode": "run_msa_decode",
    "msa_decode_stages": "run_msa_decode_stages",
    "fp8": "run_fp8_grid",
    "indexer_tuning": "run_indexer_tuning",
    "indexer_prefill_tuning": "run_indexer_prefill_tuning",
}
"""Suite name -> function (its name in this module, or the function itself)."""

from .fp8 import run_fp8_grid  # noqa: E402, F401  (a suite in its own module, named in SUITES)
from .prefill import run_prefill, run_spec_decode  # noqa: E402, F401  (suites in their own module, named in SUITES)
from .tuning import run_indexer_prefill_tuning, run_indexer_tuning  # noqa: E402, F401  (suites named in SUITES)

__all__ = ["SUITES", "Shapes", "dry_run_shapes", "model_shapes"]
