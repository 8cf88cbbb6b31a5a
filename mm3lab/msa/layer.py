"""One MSA layer in one call (SPEC section 2): every step joined, intermediates on request.

:func:`msa_decode` / :func:`msa_prefill` run, for the layer's new query tokens:

1. index-cache insert  (:func:`mm3lab.insert_index_cache`): each token's index key;
2. KV insert           (:func:`mm3lab.write_kv_page16`): each token's K and V;
3. indexer + top-k     (:func:`mm3lab.index_topk_decode` / ``_prefill``): ``topk``
   blocks per (token, KV head), the local block forced;
4. sparse block table  (:func:`mm3lab.build_sparse_block_table_decode` / ``_prefill``),
   fused with the top-k into one launch (``mm3lab.indexer.index_topk_block_table_*``,
   equal to running the two apart);
5. sparse attention    (:func:`mm3lab.sparse_attention`).

Both caches take the same slot, from the one block table
(:func:`mm3lab.index_cache.token_slots`: ``block_table[r, p // 128] * 128 + p % 128``). Everything is validated
before the first cache write, so bad input leaves every cache untouched.

FP8 caches (SPEC section 9): an FP8 index cache takes its per-token scales as ``index_scale=``
(:func:`mm3lab.allocate_index_scale`), an FP8 KV cache its per-(token, head) scales as ``k_scale=`` /
``v_scale=`` (``PagedKVCache.k_scale`` / ``.v_scale``). The insert quantizes the new tokens, the indexer
and the attention read the stored values times their scales. With an FP8 KV cache ``q``, ``key`` and
``value`` may be any float dtype (one dtype for the three); with an FP8 index cache, so may ``index_q`` and
``index_k``. Other caches take ``None`` for their scales.
"""

from __future__ import annotations

import dataclasses
import types

import torch

from .._checks import (
    FLOAT_DTYPES,
    PassedChecks,
    check_int,
    check_no_alias,
    check_same_device,
    check_scale,
    check_tensor,
    validation,
)
from ..attention import _attend_checked
from ..constants import DEFAULT_TOPK
from ..fp8 import FP8_DTYPE
from ..index_cache import _insert_checked
from ..index_cache.checks import check_index_cache, check_insert_index_cache
from ..indexer import _checked_entry, index_scores_decode, index_scores_prefill
from ..indexer.checks import MAX_TOPK, check_table_entries
from ..indexer.checks import check_decode as check_indexer_decode
from ..indexer.checks import check_decode_values as check_indexer_decode_values
from ..indexer.checks import check_prefill as check_indexer_prefill
from ..layout import _write_checked, check_kv_views
from ..layout.checks import check_write_kv
from ..layout.views import check_kv_scales
from ..rows import decode_query_rows, rows_and_slots
from . import recorded

__all__ = ["MSAStep", "decode_query_rows", "msa_decode", "msa_prefill"]


@dataclasses.dataclass
class MSAStep:
    """Every intermediate of one MSA layer call (``return_intermediates=True``).

    Attributes:
        query_req_id, query_abs_pos: ``[N]`` request and absolute position of each row (negative = padded).
        slot_mapping: ``[N]`` page-128 slot each token was written to (``-1`` for padded rows).
        scores: ``[H, N, M]`` float32 raw block scores, ``max_s index_q . index_k`` over each
            block's visible tokens, before the init/local forcing (``-inf`` for blocks that
            are not candidates); ``None`` for the dense baseline.
        topk_idx: ``[H, N, topk]`` selected logical blocks, ``-1`` padding.
        sparse_bt, sparse_ctx: ``[H, N, topk * 8]`` page ids and ``[H, N]`` tokens attended.
        lse: ``[N, Hq]`` float32 log-sum-exp of the attention scores.
    """

    query_req_id: torch.Tensor
    query_abs_pos: torch.Tensor
    slot_mapping: torch.Tensor
    scores: torch.Tensor | None
    topk_idx: torch.Tensor
    sparse_bt: torch.Tensor
    sparse_ctx: torch.Tensor
    lse: torch.Tensor


# ----------------------------------------------------------------------------
# validation of the whole step, before any cache is written
# ----------------------------------------------------------------------------


def _check_query(q, k_cache, v_cache, index_q=None, k_scale=None, v_scale=None) -> int:
    """``q`` (and ``index_q``) against the KV cache, what later steps would reject; returns ``block_page_stride``."""
    block_page_stride = check_kv_views(k_cache, v_cache)
    check_kv_scales(k_cache, v_cache, k_scale, v_scale)  # FP8 KV (SPEC section 9)
    _, _, hkv, d = k_cache.shape
    if index_q is not None:
        check_tensor("index_q", index_q, ndim=3)
        if index_q.shape[1] != hkv:
            raise ValueError(
                f"index_q: {index_q.shape[1]} index heads, but the KV cache has {hkv} KV heads (one index head each)"
            )
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    if q.dtype != k_cache.dtype and k_cache.dtype != FP8_DTYPE:  # an FP8 cache takes queries of any float dtype
        raise TypeError(f"q: dtype {q.dtype} differs from k_cache's {k_cache.dtype}")
    if q.shape[2] != d:
        raise ValueError(f"q: head dim {q.shape[2]} does not match k_cache's head dim {d}")
    if q.shape[1] % hkv:
        raise ValueError(f"q: {q.shape[1]} query heads are not a multiple of the cache's {hkv} KV heads")
    return block_page_stride


def _check_inserts(
    q,
    key,
    value,
    index_k,
    k_cache,
    v_cache,
    index_cache,
    block_table,
    slots,
    *,
    block_page_stride: int,
    scale=None,
    index_scale=None,
    k_scale=None,
    v_scale=None,
) -> None:
    """Check every argument of the step's cache inserts (SPEC section 7), before anything is written.

    The new tokens' K/V (and index keys), the ``scale``, and the ``slots [N]`` the caller
    computed from rows already checked against the block table in one read (the indexer's
    checks, or :func:`mm3lab.indexer.checks.check_table_entries`). The KV views and their
    scales are :func:`_check_query`'s (``block_page_stride`` is what it returned).
    """
    n = slots.shape[0]
    _, _, hkv, d = k_cache.shape
    if q.shape[0] != n:
        raise ValueError(f"q: expected one row per query token ({n}), got {q.shape[0]}")
    kv_dtype = q.dtype if k_cache.dtype == FP8_DTYPE else k_cache.dtype  # FP8: new K/V in q's dtype, quantized
    check_tensor("key", key, shape=(n, hkv, d), dtypes=(kv_dtype,))
    check_tensor("value", value, shape=(n, hkv, d), dtypes=(kv_dtype,))
    check_scale(scale, d)
    check_same_device(q=q, k_cache=k_cache, key=key, value=value, block_table=block_table)
    caches = {"k_cache": k_cache, "v_cache": v_cache, "index_cache": index_cache}
    scales = {"index_scale": index_scale, "k_scale": k_scale, "v_scale": v_scale}
    inputs = {"q": q, "key": key, "value": value, "index_k": index_k}
    check_no_alias(inputs=inputs, **caches, **scales)  # what the step writes, against its inputs (None: skipped)
    check_write_kv(key, value, k_cache, v_cache, slots, k_scale, v_scale, block_page_stride=block_page_stride)
    if index_cache is not None:
        check_insert_index_cache(index_k, index_cache, slots, index_scale)


def _check_index_step(index_k, index_cache, k_cache, topk, block_page_stride: int) -> None:
    """The MSA layer's own rules: an index key per token, the top-k, one block count for both caches
    (``block_page_stride``: the KV views', as :func:`_check_query` checked and returned it)."""
    check_tensor("index_k", index_k, ndim=2)
    check_int("topk", topk, minimum=1, maximum=MAX_TOPK)
    check_index_cache(index_cache)
    kv_blocks = k_cache.shape[0] // block_page_stride
    if index_cache.shape[0] != kv_blocks:
        raise ValueError(
            f"index_cache: {index_cache.shape[0]} blocks, but the KV cache has {kv_blocks}: both caches take the "
            "same slot from the one block table, so they must hold the same number of blocks"
        )


# ----------------------------------------------------------------------------
# the MSA layer, on kernel steps or (mm3lab.msa.reference) on reference steps
# ----------------------------------------------------------------------------


def _kernel_rows_and_slots(block_table, rows):
    """``(req, pos, slots)`` in one launch (:func:`mm3lab.rows.rows_and_slots`)."""
    kind, first, second = rows
    if kind == "decode":
        n, dev = first.shape[0] * second, first.device
        req = torch.empty(n, dtype=torch.int32, device=dev)
        pos = torch.empty(n, dtype=torch.int32, device=dev)
        slots = torch.empty(n, dtype=torch.int64, device=dev)
        rows_and_slots(block_table, req, pos, slots, seq_lens=first, decode_query_len=second)
        return req, pos, slots
    slots = torch.empty(second.shape[0], dtype=torch.int64, device=second.device)
    rows_and_slots(block_table, first, second, slots)
    return first, second, slots


def _attend(q, k_cache, v_cache, sparse_bt, sparse_ctx, scale=None, *, return_lse=False, k_scale=None, v_scale=None):
    """:func:`mm3lab.sparse_attention` without its checks: :func:`run_layer` made them."""
    return _attend_checked(q, k_cache, v_cache, sparse_bt, sparse_ctx, scale, return_lse, None, None, k_scale, v_scale)


KERNEL_STEPS = types.SimpleNamespace(
    rows_and_slots=_kernel_rows_and_slots,
    insert_index_cache=_insert_checked,
    write_kv_page16=_write_checked,
    index_topk_block_table_decode=_checked_entry("index_topk_block_table_decode"),
    index_topk_block_table_prefill=_checked_entry("index_topk_block_table_prefill"),
    index_scores_decode=index_scores_decode,
    index_scores_prefill=index_scores_prefill,
    sparse_attention=_attend,
)
"""The steps :func:`msa_decode` / :func:`msa_prefill` join: the kernel entry points, without the checks
:func:`run_layer` has made (all of them, before the first write); :mod:`mm3lab.msa.reference` joins
their twins, checks and all."""


_PASSED = PassedChecks()
"""Call shapes of :func:`run_layer` whose structural checks passed -> their ``block_page_stride``."""


def run_layer(steps, arguments: dict):
    """The MSA layer with its steps taken from ``steps`` (:data:`KERNEL_STEPS` or the reference's).

    ``arguments``: every argument of :func:`msa_decode` (decode rows, ``seq_lens`` among them) or of
    :func:`msa_prefill` (prefill rows), by name; the public functions and their reference twins
    (:mod:`mm3lab.msa.reference`) both hand theirs here.
    Every argument is checked before the first cache write (SPEC 7): the values in one launch and
    one host read (the indexer's checks); the slots and tables the later steps build from them are
    inside the caches, so the steps' own value checks do not run again, nor (on kernel steps) their
    structural checks, which the checks here include.
    """
    args = types.SimpleNamespace(**arguments)
    decode = "seq_lens" in arguments
    if decode:
        rows = ("decode", args.seq_lens, args.decode_query_len)
        row_args, extra = (args.seq_lens,), (args.decode_query_len,)  # (seq_lens, ..., decode_query_len, ...)
    else:
        rows = ("prefill", args.query_req_id, args.query_abs_pos)
        row_args, extra = (args.query_req_id, args.query_abs_pos), ()
    q, block_table = args.q, args.block_table
    k_cache, v_cache, index_cache = args.k_cache, args.v_cache, args.index_cache
    kv_scales = {"k_scale": args.k_scale, "v_scale": args.v_scale}  # FP8 caches' scales (SPEC 9), else None
    index_scale = args.index_scale
    # the indexer's rows, top-k and init / local blocks, in the order every indexer entry point takes them
    selection = (*row_args, args.topk, *extra, args.init_blocks, args.local_blocks)

    # A call shape whose structural checks passed skips them (_PASSED); the value checks (the
    # indexer's: one launch, one host read) run on every call.
    inputs = (q, args.key, args.value, args.index_q, args.index_k, *row_args, block_table)
    caches = (k_cache, v_cache, index_cache, index_scale, *kv_scales.values())
    passed = _PASSED.key(
        (*inputs, *caches), (decode, args.topk, args.scale, args.init_blocks, args.local_blocks, *extra)
    )
    block_page_stride = _PASSED.get(passed)
    checked = block_page_stride is not None
    if not checked:
        block_page_stride = _check_query(q, k_cache, v_cache, args.index_q, **kv_scales)
        _check_index_step(args.index_k, index_cache, k_cache, args.topk, block_page_stride)
    if not checked:
        check = check_indexer_decode if decode else check_indexer_prefill
        check(args.index_q, index_cache, block_table, *selection, index_scale)
    elif decode:  # (its structural checks passed with the rest: the values only)
        if q.shape[0]:
            check_indexer_decode_values(index_cache, block_table, args.seq_lens, passed)
    else:
        check_table_entries(block_table, args.query_req_id, args.query_abs_pos, index_cache.shape[0], "the index cache")
    # a repeated one-shot decode step replays its launches through an internal plan (mm3lab.msa.recorded)
    recorded_step = None
    if decode and steps is KERNEL_STEPS and recorded.applies(args):
        if checked:  # (a call known to match a recording: replayed at once)
            out = recorded.replay_known(passed, args)
            if out is not None:
                return out
        recorded_step = recorded.lookup(args)
    if recorded_step is not None:
        req = pos = None
        slots = recorded_step.plan.slots  # (what the inserts' checks look at: its shape and dtype)
    else:
        req, pos, slots = steps.rows_and_slots(block_table, rows)
    with validation(False):
        if not checked:  # (slots: rows_and_slots' own buffer, or a plan's: never the caller's memory)
            _check_inserts(
                q,
                args.key,
                args.value,
                args.index_k,
                k_cache,
                v_cache,
                index_cache,
                block_table,
                slots,
                block_page_stride=block_page_stride,
                scale=args.scale,
                index_scale=index_scale,
                **kv_scales,
            )
            _PASSED.add(passed, block_page_stride)
        if recorded_step is not None:
            return recorded.run(recorded_step, args, passed)
        if index_cache is not None:
            steps.insert_index_cache(args.index_k, index_cache, slots, index_scale=index_scale)
        steps.write_kv_page16(args.key, args.value, k_cache, v_cache, slots, **kv_scales)
        select = steps.index_topk_block_table_decode if decode else steps.index_topk_block_table_prefill
        topk_idx, sparse_bt, sparse_ctx = select(
            args.index_q, index_cache, block_table, *selection, block_page_stride, index_scale=index_scale
        )
        out, lse = steps.sparse_attention(
            q, k_cache, v_cache, sparse_bt, sparse_ctx, args.scale, return_lse=True, **kv_scales
        )
        if not args.return_intermediates:
            return out
        score = steps.index_scores_decode if decode else steps.index_scores_prefill
        scores = score(args.index_q, index_cache, block_table, *row_args, *extra, index_scale=index_scale)
    return out, MSAStep(req, pos, slots, scores, topk_idx, sparse_bt, sparse_ctx, lse)


def msa_decode(
    q: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    index_q: torch.Tensor,
    index_k: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    index_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    decode_query_len: int = 1,
    topk: int = DEFAULT_TOPK,
    init_blocks: int = 0,
    local_blocks: int = 1,
    scale: float | None = None,
    return_intermediates: bool = False,
    index_scale: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
):
    """One MSA layer for decode (and speculative-decode) rows: insert, select, attend.

    The ``N = B * decode_query_len`` new tokens are the last positions of their
    requests (SPEC 2 row rule, :mod:`mm3lab.rows`); their index key, K and V are
    written to the caches first, so every query sees itself.

    Args:
        q: ``[N, Hq, D]`` queries (RoPE applied).
        key, value: ``[N, Hkv, D]`` the new tokens' K and V, the cache's dtype.
        index_q: ``[N, Hkv, Di]`` index queries (one index head per KV head).
        index_k: ``[N, Di]`` the new tokens' index keys.
        k_cache, v_cache: page-16 views of the KV cache (dense or packed layout).
        index_cache: ``[num_blocks, 128, Di]`` index-key cache.
        block_table: ``[B, M]`` logical -> physical block of each request (shared by both caches).
        seq_lens: ``[B]`` tokens per request, the new ones included.
        decode_query_len: query tokens per request.
        topk, init_blocks, local_blocks: the selection (model defaults: 16, 0, 1).
        scale: attention scale, default ``D ** -0.5``.
        return_intermediates: also return an :class:`MSAStep`.
        index_scale: ``[num_blocks, 128]`` float32 per-token scales of an FP8 index cache, else ``None``.
        k_scale, v_scale: ``[pages, 16, Hkv]`` float32 scale views of an FP8 KV cache, else ``None``.
    Returns:
        ``out [N, Hq, D]`` in q's dtype, or ``(out, MSAStep)``.
    """
    return run_layer(KERNEL_STEPS, locals())  # every argument, by name


def msa_prefill(
    q: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    index_q: torch.Tensor,
    index_k: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    index_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_req_id: torch.Tensor,
    query_abs_pos: torch.Tensor,
    *,
    topk: int = DEFAULT_TOPK,
    init_blocks: int = 0,
    local_blocks: int = 1,
    scale: float | None = None,
    return_intermediates: bool = False,
    index_scale: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
):
    """One MSA layer for prefill rows, each with its own request and position.

    All ``N`` tokens are inserted before any is scored, so a chunk's queries see
    the whole chunk up to themselves (causal).

    Args:
        as :func:`msa_decode`, with ``query_req_id [N]`` and ``query_abs_pos [N]``
        (negative = padded row) in place of ``seq_lens`` and ``decode_query_len``. Rows that are
        not padded name distinct tokens: two rows of one (request, position) write one cache slot,
        and which write lands is unspecified on a GPU (not checked).
    Returns:
        ``out [N, Hq, D]``, or ``(out, MSAStep)``.
    """
    return run_layer(KERNEL_STEPS, locals())  # every argument, by name
