"""Argument checks of the indexer entry points, shared by the kernel path and the reference.

Structural checks (ranks, shapes, dtypes, head dims, devices, the integer
arguments) always run. Value checks read tensor contents (one small launch and
one host read in all, :mod:`mm3lab._valcheck`) and run while
``mm3lab.validation_enabled()``:

* a decode ``seq_len`` or a prefill position the block table cannot hold;
* a prefill request id outside the block table (on a row that is not padded);
* a block table entry that a row scores (logical block ``b <= p // 128``) outside
  the index cache.

With validation off both paths apply the same defined fallback instead: a row
whose request id is out of range is padded (all ``-1``), candidates stop at the
block table's width, and a block whose physical id is outside the cache is
never read (it stays a candidate with score ``-inf``).
"""

from __future__ import annotations

from .._checks import (  # noqa: F401  (check_block_page_stride, check_int re-exported)
    FLOAT_DTYPES,
    blocks_used_decode,
    blocks_used_prefill,
    check_block_page_stride,
    check_decode_rows,
    check_index,
    check_int,
    check_same_device,
    check_tensor,
    prefill_row_checks,
    seq_lens_check,
    table_entry_check,
    validation_enabled,
)
from .._checks import dtype_name as _dtype_name
from .._checks import raise_first as _raise_first
from .._checks import value_checks as _value_checks
from .._valcheck import Segment
from ..constants import SPARSE_BLOCK_SIZE
from ..fp8 import FP8_DTYPE
from ..index_cache.checks import check_index_cache, check_index_scale

MAX_TOPK = 8192
"""Largest ``topk`` (SPEC: a context of up to 8192 blocks). Up to ``MAX_KERNEL_TOPK`` (512) the
top-k and the sparse block table run fused; above it, the top-k kernel and then the table on its own."""


NO_TOPK = object()
"""``topk`` argument of :func:`check_decode` / :func:`check_prefill` for the score entry points (no top-k)."""


def check_topk_scores(scores, topk) -> None:
    """``topk_blocks``: a float score tensor ``[..., W]`` and ``topk >= 1``."""
    check_tensor("scores", scores, dtypes=FLOAT_DTYPES)
    if scores.dim() < 1:
        raise ValueError("scores: expected at least one dimension (the blocks), got a 0-d tensor")
    check_int("topk", topk, minimum=1, maximum=MAX_TOPK)


def _check_common(index_q, index_cache, block_table, topk, init_blocks, local_blocks, index_scale) -> tuple[int, int]:
    """The checks every indexer call shares; returns ``(B, N)``: requests and query rows."""
    check_index_cache(index_cache)
    di = index_cache.shape[2]
    check_tensor("index_q", index_q, ndim=3, dtypes=FLOAT_DTYPES)
    if index_q.shape[2] != di:
        raise ValueError(
            f"index_q: head dim {index_q.shape[2]} does not match index_cache's head dim {di} "
            f"(index_q {tuple(index_q.shape)}, index_cache {tuple(index_cache.shape)})"
        )
    if index_q.dtype != index_cache.dtype and index_cache.dtype != FP8_DTYPE:  # FP8 keys: any float query
        raise TypeError(
            f"index_q: dtype {_dtype_name(index_q.dtype)} differs from index_cache's {_dtype_name(index_cache.dtype)}"
        )
    check_index("block_table", block_table, ndim=2)
    if topk is not NO_TOPK:
        check_int("topk", topk, minimum=1, maximum=MAX_TOPK)
    check_int("init_blocks", init_blocks, minimum=0)
    check_int("local_blocks", local_blocks, minimum=0)
    check_index_scale(index_cache, index_scale)  # FP8 keys (SPEC section 9)
    return block_table.shape[0], index_q.shape[0]


def _table_entries_check(block_table, blocks_used, num_blocks, cache: str = "the index cache"):
    """A physical id outside ``cache`` (``num_blocks`` blocks) among the entries row ``r`` reads."""
    return table_entry_check(
        block_table,
        blocks_used,
        (block_table < 0) | (block_table >= num_blocks),
        lambda phys: f"maps to physical block {phys}, outside {cache}'s {num_blocks} blocks",
    )


def check_table_entries(block_table, req, pos, num_blocks: int, cache: str, seq_lens=None, key=None, then=None) -> None:
    """Rows ``(req[n], pos[n])`` (negative ``pos`` = padded) against a block table and a cache of ``num_blocks``.

    Raises ``ValueError`` for a live row whose request is outside the table (names
    ``query_req_id``), a position past the table (``seq_lens`` when given, else
    ``query_abs_pos``), or a table entry that a live row reads (logical blocks ``0 .. p // 128``
    of its request) outside ``[0, num_blocks)`` (``block_table``). One launch and one host read in all;
    nothing runs with validation off (the kernels mask these reads). ``key``: what fixes the tensors'
    addresses and metadata and the bounds, if the caller has it (a repeat launches the kept check,
    :func:`mm3lab._valcheck.flags_known`, and calls ``then()`` while it runs).
    """
    if not validation_enabled() or pos.numel() == 0:
        return
    b, m = block_table.shape
    capacity = m * SPARSE_BLOCK_SIZE

    def segments() -> list:
        return [
            Segment("live", req, lo=0, hi=b - 1, aux=pos),
            Segment("all", seq_lens, hi=capacity) if seq_lens is not None else None,
            Segment("live", pos, hi=capacity - 1, aux=pos),
            Segment("gather", block_table, lo=0, hi=num_blocks - 1, aux=req, pos=pos, unit=SPARSE_BLOCK_SIZE)
            if m
            else None,
        ]

    def detail() -> None:
        checks = prefill_row_checks(req, pos, b, m)
        if seq_lens is not None:
            checks.insert(1, seq_lens_check(seq_lens, m))
        blocks_used = blocks_used_prefill(req, pos, b, m)
        checks.append(_table_entries_check(block_table, blocks_used, num_blocks, cache))
        _raise_first(checks)

    key = None if key is None else ("table_entries", cache, seq_lens is not None, key)
    _value_checks(segments, detail, key, then)


def check_decode(
    index_q, index_cache, block_table, seq_lens, topk, decode_query_len, init_blocks, local_blocks, index_scale=None
):
    """Validate a decode indexer call (``topk=NO_TOPK`` for the score entry points)."""
    b, n = _check_common(index_q, index_cache, block_table, topk, init_blocks, local_blocks, index_scale)
    check_decode_rows("index_q", n, seq_lens, decode_query_len, b)
    check_same_device(index_q=index_q, index_cache=index_cache, block_table=block_table, seq_lens=seq_lens)
    if n:
        check_decode_values(index_cache, block_table, seq_lens)


def check_decode_values(index_cache, block_table, seq_lens, key=None, then=None) -> None:
    """The value checks of :func:`check_decode` (while validation is on), for a caller whose structural
    checks passed (a plan checks its shapes once; its runs check values only). ``key``: the
    caller's :class:`mm3lab._checks.PassedChecks` key over these tensors, if any (a repeat of it
    launches the kept check, :func:`mm3lab._valcheck.flags_known`, and calls ``then()`` while it runs)."""
    if not validation_enabled():
        return
    m = block_table.shape[1]
    num_blocks = index_cache.shape[0]

    def segments() -> list:
        return [
            Segment("all", seq_lens, hi=m * SPARSE_BLOCK_SIZE),
            Segment("len", block_table, lo=0, hi=num_blocks - 1, aux=seq_lens, unit=SPARSE_BLOCK_SIZE) if m else None,
        ]

    def detail() -> None:
        blocks_used = blocks_used_decode(seq_lens, m)
        _raise_first([seq_lens_check(seq_lens, m), _table_entries_check(block_table, blocks_used, num_blocks)])

    _value_checks(segments, detail, None if key is None else ("indexer_decode", key), then)


def check_prefill(
    index_q, index_cache, block_table, query_req_id, query_abs_pos, topk, init_blocks, local_blocks, index_scale=None
):
    """Validate a prefill indexer call (``topk=NO_TOPK`` for the score entry points)."""
    _b, n = _check_common(index_q, index_cache, block_table, topk, init_blocks, local_blocks, index_scale)
    check_index("query_req_id", query_req_id, shape=(n,))
    check_index("query_abs_pos", query_abs_pos, shape=(n,))
    check_same_device(
        index_q=index_q,
        index_cache=index_cache,
        block_table=block_table,
        query_req_id=query_req_id,
        query_abs_pos=query_abs_pos,
    )
    check_table_entries(block_table, query_req_id, query_abs_pos, index_cache.shape[0], "the index cache")
