"""The indexer (SPEC 2, steps 2-3): which 128-token blocks each query token attends.

The scores, the init/local forcing, the top-k order and the row rule are SPEC 2's
(rows: :mod:`mm3lab.rows`); ``reference.py`` writes them as loops, ``kernel.py``
as Triton kernels. Entry points:

* :func:`index_topk_decode` / :func:`index_topk_prefill` -> ``topk_idx [H, N, topk]`` int32,
  what :func:`mm3lab.build_sparse_block_table_decode` / ``_prefill`` consume;
* :func:`index_scores_decode` / :func:`index_scores_prefill` -> the scores ``[H, N, M]``,
  raw (``forced=False``, for heatmaps) or as top-k ranks them (``forced=True``);
* :func:`index_topk_block_table_decode` / :func:`index_topk_block_table_prefill`: the
  top-k fused with the sparse block table (SPEC 3), one launch from scores to
  ``(topk_idx, sparse_bt, sparse_ctx)``, equal to running the two steps apart;
* :func:`topk_blocks`: the top-k rule alone, on any ``[..., W]`` score tensor.

Every call is two launches at most (scores, then top-k with or without the table).
The top-k pre-selects groups of columns by their maxima on wide rows, then picks with
``tl.topk`` when compiled (see :mod:`mm3lab.indexer.kernel`). The PyTorch paths (SPEC 7,
:data:`mm3lab.backend.FALLBACK_RULES`): bfloat16 under the interpreter, and float32 with
more than 16 index heads on a GPU. **FP8 keys** (SPEC 9): an index cache of
``float8_e4m3fn`` keys takes its per-token float32 scales as ``index_scale=``
(:func:`mm3lab.allocate_index_scale`) on every entry point; ``index_q`` stays
float32/float16/bfloat16. The kernel rounds each (row, head) query to a two-term FP8
pair, scores with FP8 ``tl.dot`` and multiplies every dot by its token's scale before
the block max; the reference dequantizes the keys. Scores agree within
:data:`mm3lab.fp8.INDEX_SCORE_FP8_RTOL`, selected ids except at near ties. Value checks
(one device sync with validation on): :mod:`mm3lab.indexer.checks`.
"""

from __future__ import annotations

import functools
import inspect
import types
from typing import NamedTuple

import torch

from .. import _replay, _valcheck, backend
from .._checks import validation_enabled
from ..block_table import MAX_KERNEL_TOPK, build_sparse_block_table_decode, build_sparse_block_table_prefill
from ..constants import PAGES_PER_SPARSE_BLOCK
from ..fp8 import FP8_DTYPE
from . import reference
from .checks import (
    NO_TOPK,
    check_block_page_stride,
    check_decode,
    check_decode_values,
    check_prefill,
    check_table_entries,
    check_topk_scores,
)
from .reference import block_score, candidate_blocks, force_scores, select_topk

__all__ = reference.__all__  # the same names: its helpers re-exported, its entry points as kernels


def index_fallback(query_dtype: torch.dtype, index_cache_dtype: torch.dtype, heads: int) -> str | None:
    """The rule (a :data:`mm3lab.backend.FALLBACK_RULES` name) by which scoring index queries of
    ``query_dtype`` with ``heads`` index heads takes the PyTorch path (SPEC 7), or ``None``."""
    if index_cache_dtype == FP8_DTYPE:  # FP8 keys: the kernel rounds index_q to FP8 itself, from any float dtype
        return None
    # float32 tiles are kept at 16 lanes (see kernel.index_scores_kernel); more than 16 index
    # heads would need wider ones, so such float32 calls take the PyTorch path on a GPU.
    if query_dtype == torch.float32 and heads > 16 and not backend.INTERPRETER:
        return "fp32-wide-index-heads"
    return backend.bf16_interpreted(query_dtype)


def _use_kernel(entry_point: str, index_q, index_cache, *tensors) -> bool:
    fallback = index_fallback(index_q.dtype, index_cache.dtype, index_q.shape[1])
    return backend.use_kernel(index_q, index_cache, *tensors, entry_point=entry_point, fallback=fallback)


class _Rows(NamedTuple):
    """A call's rows as the kernels take them (the SPEC 2 row rule, :mod:`mm3lab.rows`)."""

    req: torch.Tensor  # decode: seq_lens; prefill: query_req_id
    pos: torch.Tensor  # decode: seq_lens (unused); prefill: query_abs_pos
    dql: int  # decode_query_len; 1 for prefill rows
    prefill: bool


class _Call(NamedTuple):
    """One call of an indexer entry point, decode or prefill alike; :meth:`run` checks and runs it."""

    index_q: torch.Tensor
    index_cache: torch.Tensor
    block_table: torch.Tensor
    rows: _Rows
    init_blocks: int
    local_blocks: int
    index_scale: torch.Tensor | None

    @classmethod
    def of(cls, arguments: dict) -> _Call:
        """The call of an entry point from its arguments by name: decode rows if ``seq_lens`` is among them."""
        a = types.SimpleNamespace(**arguments)
        if "seq_lens" in arguments:
            rows = _Rows(a.seq_lens, a.seq_lens, a.decode_query_len, False)
        else:
            rows = _Rows(a.query_req_id, a.query_abs_pos, 1, True)
        return cls(a.index_q, a.index_cache, a.block_table, rows, a.init_blocks, a.local_blocks, a.index_scale)

    def run(self, entry: str, arguments: dict, checked: bool = False, outs: dict | None = None, check=None):
        """Check the call (unless the caller has: ``checked``), then run ``entry``: the scores kernel
        (then the top-k kernel), or the reference where SPEC 7 says so.

        ``arguments``: every argument of the entry point by name; besides the rows and the tensors,
        its own ones: ``forced`` (scores), ``topk``, and ``block_page_stride`` (top-k fused with
        the sparse block table). ``outs``: the kernels' output buffers by name (:meth:`tensors`), else new ones.
        ``check``: the scores launch checks the call's values (where :meth:`checks_in_scores`; see
        :func:`.kernel.index_scores_kernel`).
        """
        outs = outs or {}
        index_q, index_cache, block_table, rows, init_blocks, local_blocks, index_scale = self
        topk = arguments.get("topk", NO_TOPK)
        block_page_stride = arguments.get("block_page_stride")
        if not checked:
            self._check(topk, block_page_stride)
        if not _use_kernel(entry, index_q, index_cache, block_table, rows.req, rows.pos):
            return getattr(reference, entry)(**arguments)  # the twin has the same signature
        if block_page_stride is not None and topk > MAX_KERNEL_TOPK:
            backend.fallback_taken(entry, "topk-over-512")
        scores = self.scores(forced=bool(arguments.get("forced", True)), out=outs.get("scores"), check=check)
        if topk is NO_TOPK:
            return scores
        table = () if block_page_stride is None else (block_table, block_page_stride)
        return _topk(scores, topk, rows.req, rows.pos, block_table.shape[0], rows.dql, rows.prefill, *table, outs=outs)

    def _check(self, topk: int, block_page_stride) -> None:
        """Every check of the call (SPEC 7), ``topk`` and ``block_page_stride`` included where it has them."""
        index_q, index_cache, block_table, rows, init_blocks, local_blocks, index_scale = self
        if rows.prefill:
            check_prefill(
                index_q, index_cache, block_table, rows.req, rows.pos, topk, init_blocks, local_blocks, index_scale
            )
        else:
            check_decode(
                index_q, index_cache, block_table, rows.req, topk, rows.dql, init_blocks, local_blocks, index_scale
            )
        if block_page_stride is not None:
            check_block_page_stride(block_page_stride)

    def memo_key(self, entry: str, arguments: dict):
        """The call's :class:`mm3lab._replay.Memo` key; ``None`` where the memo does not apply (besides
        :meth:`mm3lab._replay.Memo.key`'s cases: a top-k wider than the fused table's, which runs the
        table's own entry point as a second step)."""
        index_q, index_cache, block_table, rows, init_blocks, local_blocks, index_scale = self
        topk = arguments.get("topk", NO_TOPK)
        block_page_stride = arguments.get("block_page_stride")
        if block_page_stride is not None and (not isinstance(topk, int) or topk > MAX_KERNEL_TOPK):
            return None
        per_call = (index_q, block_table, rows.req, rows.pos if rows.prefill else None)
        scalars = (entry, None if topk is NO_TOPK else topk, rows.dql, init_blocks, local_blocks)
        scalars += (arguments.get("forced"), block_page_stride, validation_enabled())
        return _MEMO.key(per_call, (index_cache, index_scale), scalars)

    def check_values(self, key, then=None) -> None:
        """The call's value checks alone, for a repeat of a checked call shape ``key`` (its check launch
        kept, :func:`mm3lab._valcheck.flags_known`: the key and the addresses fix its segments).
        ``then``: the call's launches, queued while a kept check runs (they write only the call's new
        outputs and the memo's scratch, and never read outside the cache and tables, whatever the values)."""
        _, index_cache, block_table, rows, *_ = self
        known = (key.token, block_table.data_ptr(), rows.req.data_ptr(), rows.pos.data_ptr())
        if rows.prefill:
            cache = "the index cache"
            check_table_entries(block_table, rows.req, rows.pos, index_cache.shape[0], cache, key=known, then=then)
        else:
            check_decode_values(index_cache, block_table, rows.req, key=known, then=then)

    def tensors(self, arguments: dict) -> dict:
        """The call's tensors by name (:func:`mm3lab._replay.memo_call`), with new output buffers."""
        index_q, index_cache, block_table, rows, _, _, index_scale = self
        named = {"index_q": index_q, "index_cache": index_cache, "block_table": block_table}
        if rows.prefill:
            named.update(query_req_id=rows.req, query_abs_pos=rows.pos)
        else:
            named["seq_lens"] = rows.req
        named["index_scale"] = index_scale
        n, h, _ = index_q.shape
        topk = arguments.get("topk", NO_TOPK)
        new = functools.partial(torch.empty, device=index_q.device)
        if topk is NO_TOPK:
            named["scores"] = new(h, n, block_table.shape[1], dtype=torch.float32)
            return named
        named["topk_idx"] = new(h, n, topk, dtype=torch.int32)
        if arguments.get("block_page_stride") is not None:
            named["sparse_bt"] = new(h, n, topk * PAGES_PER_SPARSE_BLOCK, dtype=torch.int32)
            named["sparse_ctx"] = new(h, n, dtype=torch.int32)
        return named

    def checks_in_scores(self) -> bool:
        """Whether the scores launch can run the call's value checks (given tensors that passed the
        structural checks): decode rows, some rows, heads and blocks, the kernel path."""
        index_q, index_cache, block_table, rows, *_ = self
        if rows.prefill or not isinstance(index_q, torch.Tensor) or index_q.dim() != 3 or not index_q.numel():
            return False
        if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2 or not block_table.shape[1]:
            return False
        return _use_kernel(None, index_q, index_cache, block_table, rows.req)  # (None: no fallback logged)

    def scores(self, forced: bool, out: torch.Tensor | None = None, check=None) -> torch.Tensor:
        """The scores kernel: ``[H, N, M]`` float32 (into ``out`` where given), forced (what top-k ranks) or raw;
        ``check``: :func:`.kernel.index_scores_kernel`'s."""
        from .kernel import index_scores_kernel

        index_q, index_cache, block_table, rows, init_blocks, local_blocks, index_scale = self
        n, h, _ = index_q.shape
        if index_scale is not None and backend.INTERPRETER and index_q.dtype == torch.bfloat16:
            index_q = index_q.float()  # exact; the interpreter's bfloat16 arithmetic is not
        scores = out
        if scores is None:
            scores = torch.empty(h, n, block_table.shape[1], dtype=torch.float32, device=index_q.device)
        index_scores_kernel(
            index_q,
            index_cache,
            block_table,
            *rows,
            init_blocks,
            local_blocks,
            forced,
            scores,
            index_scale=index_scale,
            check=check,
        )
        return scores


def _topk(
    scores, topk, req, pos, batch, dql, prefill, block_table=None, block_page_stride=PAGES_PER_SPARSE_BLOCK, outs=None
):
    """The top-k kernel over forced ``scores [H, N, M]``; with a ``block_table``, fused with the sparse
    block table (SPEC 3) and returning ``(topk_idx, sparse_bt, sparse_ctx)``. ``outs``: output buffers
    by name (``topk_idx``, ``sparse_bt``, ``sparse_ctx``), else new ones."""
    from .kernel import topk_kernel

    h, n, _ = scores.shape
    outs = outs or {}
    topk_idx = outs.get("topk_idx")
    if topk_idx is None:
        topk_idx = torch.empty(h, n, topk, dtype=torch.int32, device=scores.device)
    tables = {}
    if block_table is not None and topk > MAX_KERNEL_TOPK:
        # the fused kernel compacts a row in registers (K x K): wider selections take two steps,
        # the second on the PyTorch path (recorded by the caller and by the block table entry point)
        topk_idx = _topk(scores, topk, req, pos, batch, dql, prefill)
        if prefill:
            return (topk_idx, *build_sparse_block_table_prefill(topk_idx, block_table, req, pos, block_page_stride))
        return (topk_idx, *build_sparse_block_table_decode(topk_idx, block_table, req, dql, block_page_stride))
    if block_table is not None:
        sparse_bt, sparse_ctx = outs.get("sparse_bt"), outs.get("sparse_ctx")
        if sparse_bt is None:
            sparse_bt = torch.empty(h, n, topk * PAGES_PER_SPARSE_BLOCK, dtype=torch.int32, device=scores.device)
            sparse_ctx = torch.empty(h, n, dtype=torch.int32, device=scores.device)
        tables = dict(
            block_table=block_table, block_page_stride=block_page_stride, sparse_bt=sparse_bt, sparse_ctx=sparse_ctx
        )
    topk_kernel(scores, topk, topk_idx, positions=2 if prefill else 1, req=req, pos=pos, batch=batch, dql=dql, **tables)
    if block_table is None:
        return topk_idx
    return topk_idx, tables["sparse_bt"], tables["sparse_ctx"]


def _run(entry: str, arguments: dict):
    """Check and run the entry point ``entry``; ``arguments``: all of its arguments by name (its ``locals()``).

    A repeated call shape on a GPU is checked once and its launches replayed (:data:`_MEMO`); its
    value checks run on every call: inside the scores launch for decode rows (:data:`FUSED_CHECKS`),
    else in a check launch of their own."""
    call = _Call.of(arguments)
    key = call.memo_key(entry, arguments)
    entry_ = _MEMO.get(key)
    if entry_ is not None and entry_.recording is not None and entry_.info is not None:
        # a kept launch whose scores check the call's values: replay, then read its flags
        named = call.tensors(arguments)
        detail = lambda: check_decode_values(call.index_cache, call.block_table, call.rows.req)  # noqa: E731
        _valcheck.replay_kept(entry_, named, call.index_q.device, key.stream, detail)
        return _result(named)
    if entry_ is None and key is not None and FUSED_CHECKS and validation_enabled() and call.checks_in_scores():
        fused = _valcheck.fused_flags(call.index_q.device)
        if fused is not None:
            call._check(arguments.get("topk", NO_TOPK), arguments.get("block_page_stride"))  # every check
            named = call.tensors(arguments)
            launch = lambda: call.run(entry, arguments, checked=True, outs=named, check=fused)  # noqa: E731
            return _valcheck.keep_checked(_MEMO, key, launch, named, call.index_q.device, fused)
    return _replay.memo_call(
        _MEMO,
        key,
        check=lambda: call._check(arguments.get("topk", NO_TOPK), arguments.get("block_page_stride")),
        check_values=lambda replay: call.check_values(key, then=replay),
        tensors=lambda: call.tensors(arguments),
        launch=lambda named: call.run(entry, arguments, checked=True, outs=named),
        result=_result,
        entry=entry_,  # (looked up above)
    )


FUSED_CHECKS = True
"""A repeated decode call shape with validation on (and zero-copy flags) checks its values inside its
scores launch (:func:`.kernel.index_scores_kernel`'s ``check``): one launch fewer, and one wait for that
launch's programs to have checked; ``False``: a check launch of its own, the launches queued behind it."""


def _result(named: dict):
    """A replayed call's result from its tensors (:meth:`_Call.tensors`)."""
    if "sparse_bt" in named:
        return named["topk_idx"], named["sparse_bt"], named["sparse_ctx"]
    return named["topk_idx"] if "topk_idx" in named else named["scores"]


_MEMO = _replay.Memo("indexer")
"""Repeated call shapes of the indexer entry points: checked once, the launches replayed on a GPU
(:class:`mm3lab._replay.Memo`; each call's value checks still run, in one check launch)."""


def _checked_entry(entry: str):
    """The entry point named ``entry`` without its checks, for a caller that made them (the MSA layer):
    the same arguments, positional or by name."""
    parameters = inspect.signature(globals()[entry]).parameters
    names = tuple(parameters)
    defaults = {name: p.default for name, p in parameters.items() if p.default is not inspect.Parameter.empty}

    def run(*args, **kwargs):
        arguments = {**defaults, **dict(zip(names, args, strict=False)), **kwargs}
        return _Call.of(arguments).run(entry, arguments, checked=True)

    run.__name__ = run.__qualname__ = f"{entry}_checked"
    return run


def index_scores_decode(
    index_q: torch.Tensor,
    index_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    decode_query_len: int = 1,
    init_blocks: int = 0,
    local_blocks: int = 1,
    forced: bool = False,
    *,
    index_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Block scores of decode rows (SPEC section 2, step 2), one launch.

    Rows: SPEC 2's decode row rule (:mod:`mm3lab.rows`).

    Args:
        index_q: ``[N, H, Di]`` float32/float16/bfloat16 index queries (``N = B * decode_query_len``,
            ``H`` index heads = KV heads), the dtype of ``index_cache``; any strides.
        index_cache: ``[num_blocks, 128, Di]`` index keys (:func:`mm3lab.insert_index_cache`),
            contiguous head dim.
        block_table: ``[B, M]`` int32/int64 logical -> physical block of each request.
        seq_lens: ``[B]`` int32/int64 tokens per request, the decode queries included.
        decode_query_len: query tokens per request (``> 1`` for speculative decode).
        init_blocks, local_blocks: forced blocks; used only with ``forced=True``.
        forced: ``False``: the raw block maxima (NaN kept), for pictures. ``True``: the
            scores top-k ranks: init/local forcing applied, NaN as ``-1e30``.
    Returns:
        ``[H, N, M]`` float32; ``-inf`` at every block that is not a candidate
        (``b > p // 128``, padded rows).
    Raises:
        TypeError / ValueError: see :func:`index_topk_decode`.
    """
    return _run("index_scores_decode", locals())  # every argument, by name


def index_scores_prefill(
    index_q: torch.Tensor,
    index_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_req_id: torch.Tensor,
    query_abs_pos: torch.Tensor,
    init_blocks: int = 0,
    local_blocks: int = 1,
    forced: bool = False,
    *,
    index_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Block scores of prefill rows (each with its own request and position), one launch.

    Args: as :func:`index_scores_decode`, with ``query_req_id [N]`` and ``query_abs_pos [N]``
    (int32/int64; a negative position is a padded row) instead of ``seq_lens``.
    Returns:
        ``[H, N, M]`` float32, ``-inf`` at non-candidates.
    """
    return _run("index_scores_prefill", locals())  # every argument, by name


def index_topk_decode(
    index_q: torch.Tensor,
    index_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    topk: int,
    decode_query_len: int = 1,
    init_blocks: int = 0,
    local_blocks: int = 1,
    *,
    index_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The blocks each decode row attends (SPEC section 2, steps 2-3): scores, forcing, top-k.

    Args:
        index_q: ``[N, H, Di]`` index queries, ``N = B * decode_query_len``, the cache's dtype.
        index_cache: ``[num_blocks, 128, Di]``.
        block_table: ``[B, M]`` int32/int64.
        seq_lens: ``[B]`` int32/int64 (the decode queries included).
        topk: blocks selected per row (16 in MiniMax-M3); may exceed the candidates.
        decode_query_len: query tokens per request.
        init_blocks: the first blocks, forced with score ``1e30`` (0 in MiniMax-M3).
        local_blocks: the last candidate blocks, forced with ``1e29`` (1: the query's own block).
    Returns:
        ``topk_idx [H, N, topk]`` int32 logical block ids, best first, ``-1`` past
        ``min(topk, p // 128 + 1)``; padded rows all ``-1``.
    Raises:
        TypeError: non-tensors, float ids, an ``index_q`` dtype other than the cache's,
            non-int ``topk`` / ``decode_query_len`` / ``init_blocks`` / ``local_blocks``.
        ValueError: wrong ranks or shapes, a head-dim mismatch, a cache whose dimension 1
            is not 128 or whose head dim is not contiguous, ``N != B * decode_query_len``,
            devices that differ, ``topk < 1``; with validation on, a ``seq_len > M * 128``
            (names ``seq_lens`` and the request) or a used block table entry outside the
            cache (names ``block_table``, the request and the block).
    """
    return _run("index_topk_decode", locals())  # every argument, by name


def index_topk_prefill(
    index_q: torch.Tensor,
    index_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_req_id: torch.Tensor,
    query_abs_pos: torch.Tensor,
    topk: int,
    init_blocks: int = 0,
    local_blocks: int = 1,
    *,
    index_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The blocks each prefill row attends; arguments as :func:`index_topk_decode` with
    ``query_req_id [N]`` / ``query_abs_pos [N]`` instead of ``seq_lens``.

    Raises (besides the decode ones): with validation on, a request id outside
    ``[0, B)`` on a row that is not padded (names ``query_req_id`` and the row) or a
    position ``>= M * 128`` (names ``query_abs_pos``).
    """
    return _run("index_topk_prefill", locals())  # every argument, by name


def index_topk_block_table_decode(
    index_q: torch.Tensor,
    index_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    topk: int,
    decode_query_len: int = 1,
    init_blocks: int = 0,
    local_blocks: int = 1,
    block_page_stride: int = PAGES_PER_SPARSE_BLOCK,
    *,
    index_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`index_topk_decode` fused with :func:`mm3lab.build_sparse_block_table_decode`.

    The top-k kernel hands its selected ids to the sparse block table's row emitter
    in registers: one launch from scores to all three outputs (two in all, with the
    scoring). The result equals running the two steps apart.

    Args: as :func:`index_topk_decode`, plus ``block_page_stride``, 8 (dense planes) or 16
    (packed sides), see :func:`mm3lab.sparse_block_page_stride`.
    Returns:
        ``(topk_idx [H, N, topk], sparse_bt [H, N, topk * 8], sparse_ctx [H, N])``, int32, contiguous.
    """
    return _run("index_topk_block_table_decode", locals())  # every argument, by name


def index_topk_block_table_prefill(
    index_q: torch.Tensor,
    index_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_req_id: torch.Tensor,
    query_abs_pos: torch.Tensor,
    topk: int,
    init_blocks: int = 0,
    local_blocks: int = 1,
    block_page_stride: int = PAGES_PER_SPARSE_BLOCK,
    *,
    index_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`index_topk_prefill` fused with :func:`mm3lab.build_sparse_block_table_prefill`
    (see :func:`index_topk_block_table_decode`)."""
    return _run("index_topk_block_table_prefill", locals())  # every argument, by name


def topk_blocks(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """The indexer's top-k rule on any score tensor, every column a candidate (SPEC section 2, step 3).

    Ids by descending score, ties to the lower id, NaN as ``-1e30``, ``-1`` past the
    row's width (SPEC 2, step 3). Selects without sorting the row.

    Args:
        scores: ``[..., W]`` float32/float16/bfloat16, any strides.
        topk: ids per row (``>= 1``).
    Returns:
        ``[..., topk]`` int32.
    """
    check_topk_scores(scores, topk)
    if scores.shape[-1] == 0 or scores.numel() == 0:  # no candidates (or no rows): all -1
        return torch.full((*scores.shape[:-1], topk), -1, dtype=torch.int32, device=scores.device)
    shape = (*scores.shape[:-1], topk)

    def tensors() -> dict:
        rows = scores.reshape(1, -1, scores.shape[-1])  # (a view where it can be, else a copy: made every call)
        return {"rows": rows, "topk_idx": torch.empty(rows.shape[1], topk, dtype=torch.int32, device=scores.device)}

    def launch(named):
        if not backend.use_kernel(scores, entry_point="topk_blocks", fallback=backend.bf16_interpreted(scores.dtype)):
            return reference.topk_blocks(scores, topk)
        from .kernel import topk_kernel

        named = named or tensors()
        topk_kernel(named["rows"], topk, named["topk_idx"])
        return named["topk_idx"].view(shape)

    # a repeated call shape on a GPU: its launch replayed (the checks above read metadata only)
    key = _TOPK_MEMO.key((scores,), (), (topk,))
    return _replay.memo_call(
        _TOPK_MEMO,
        key,
        check=lambda: None,
        check_values=lambda replay: None,
        tensors=tensors,
        launch=launch,
        result=lambda named: named["topk_idx"].view(shape),
    )


_TOPK_MEMO = _replay.Memo("topk_blocks")
"""Repeated call shapes of :func:`topk_blocks` (:class:`mm3lab._replay.Memo`)."""
