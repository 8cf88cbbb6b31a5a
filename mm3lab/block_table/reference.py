"""Pure-Python/PyTorch reference of the sparse block table (SPEC section 3), written as loops.

One row of the table is computed by :func:`sparse_block_table_row`, which reads
like the SPEC::

    causal_len = max(p + 1, 0)            self_blk = p // 128   (only used when p >= 0)
    valid(b)   = causal_len > 0 and 0 <= b <= self_blk
    full       = valid blocks with b <  self_blk, in selection order
    tail       = the valid block with b == self_blk, if selected
    row        = for b in full + [tail]: block_table[b] * block_page_stride + j, j = 0..7
    row        = row padded with 0 to width topk * 8
    ctx        = len(full) * 128 + (causal_len - self_blk * 128)    if tail
                 min(len(valid) * 128, causal_len)                   otherwise

plus mm3lab's definitions where upstream is undefined: a block named twice is
attended once (first occurrence kept), and a block id at or past the block
table's width is never read (it counts as not selected).

The two entry points loop over rows and call it: decode rows get their position
from ``seq_lens`` (the SPEC 2 row rule, :mod:`mm3lab.rows`), prefill rows carry theirs.
They take the signatures of the kernel entry points in :mod:`mm3lab.block_table`
(:func:`mm3lab._twin.twin_of`) and are the specification those are tested against.

Small helpers the notebooks, the ``mm3lab explain`` command and other modules use:

* :func:`plan_sparse_row` -- the row in logical terms (full blocks, tail, what was
  dropped and why, ``ctx``), as a :class:`SparseRow`;
* :func:`attended_tokens` / :func:`attended_ranges` -- the logical token positions a
  row attends, in attention order;
* :func:`decode_positions` -- ``p`` of each decode row of one request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .._twin import twin_of
from ..constants import PAGES_PER_SPARSE_BLOCK, SPARSE_BLOCK_SIZE
from ..rows import decode_rows
from .checks import check_decode, check_prefill

PADDING = "padding"
PADDED_ROW = "padded row"
FUTURE = "after the query's block"
DUPLICATE = "duplicate"
PAST_TABLE = "past the block table"


@dataclass(frozen=True)
class SparseRow:
    """One sparse block table row in logical terms (SPEC section 3).

    Attributes:
        p: the query's absolute position (negative = padded row).
        causal_len: ``max(p + 1, 0)``, tokens the query may see.
        self_blk: ``p // 128``, the query's own block (``None`` for a padded row).
        full: selected valid blocks before ``self_blk``, in selection order, each once.
        tail: ``self_blk`` if it was selected, else ``None``.
        dropped: ``(slot, block id, reason)`` for every selection slot not attended.
        ctx: tokens attended, ``sparse_ctx``.
    """

    p: int
    causal_len: int
    self_blk: int | None
    full: tuple[int, ...]
    tail: int | None
    dropped: tuple[tuple[int, int, str], ...]
    ctx: int

    @property
    def blocks(self) -> tuple[int, ...]:
        """Logical blocks in attention order: the full blocks, then the tail."""
        return self.full + (() if self.tail is None else (self.tail,))

    @property
    def tail_tokens(self) -> int:
        """Tokens of the tail block the query sees (``p % 128 + 1``), 0 without a tail."""
        return 0 if self.tail is None else self.causal_len - self.tail * SPARSE_BLOCK_SIZE


def plan_sparse_row(blk: Sequence[int], p: int, table_width: int | None = None) -> SparseRow:
    """Split one selection row into full blocks, the tail and the dropped slots.

    Args:
        blk: ``[K]`` selected logical block ids, any order, ``-1`` (any negative) = padding.
        p: the query's absolute position; negative = padded row.
        table_width: the block table's width ``M``; ids ``>= M`` are never read.
            ``None``: no limit.
    """
    blk = [int(b) for b in blk]
    p = int(p)
    causal_len = max(p + 1, 0)
    self_blk = p // SPARSE_BLOCK_SIZE if causal_len > 0 else None
    full: list[int] = []
    tail = None
    seen: set[int] = set()
    dropped = []
    for slot, b in enumerate(blk):
        if b < 0:
            dropped.append((slot, b, PADDING))
        elif table_width is not None and b >= table_width:
            dropped.append((slot, b, PAST_TABLE))
        elif self_blk is None:
            dropped.append((slot, b, PADDED_ROW))
        elif b > self_blk:
            dropped.append((slot, b, FUTURE))
        elif b in seen:
            dropped.append((slot, b, DUPLICATE))
        else:
            seen.add(b)
            if b == self_blk:
                tail = b
            else:
                full.append(b)
    if tail is not None:
        ctx = len(full) * SPARSE_BLOCK_SIZE + (causal_len - self_blk * SPARSE_BLOCK_SIZE)
    else:
        ctx = min(len(full) * SPARSE_BLOCK_SIZE, causal_len)
    return SparseRow(p, causal_len, self_blk, tuple(full), tail, tuple(dropped), ctx)


def sparse_block_table_row(
    blk: Sequence[int], block_table_row: Sequence[int], p: int, block_page_stride: int = PAGES_PER_SPARSE_BLOCK
) -> tuple[list[int], int]:
    """One row of physical page ids, causal tail block last, and its ``sparse_ctx``.

    Args:
        blk: ``[K]`` selected logical block ids (``-1`` = padding).
        block_table_row: ``[M]`` the request's logical -> physical block map.
        p: the query's absolute position (negative = padded row).
        block_page_stride: page ids per physical block, 8 (dense) or 16 (packed).
    Returns:
        ``(row, ctx)``: ``row`` is ``K * 8`` page ids, zero past the used pages. A page id that
        does not fit int32 (past every cache) is ``-1``, never wrapped; while validation is on
        the entry points reject it first.
    """
    plan = plan_sparse_row(blk, p, table_width=len(block_table_row))
    row = []
    for b in plan.blocks:
        physical = int(block_table_row[b])
        for j in range(PAGES_PER_SPARSE_BLOCK):
            page = physical * block_page_stride + j
            row.append(page if -(2**31) <= page < 2**31 else -1)  # past int32 = past every cache: never read
    row.extend([0] * (len(blk) * PAGES_PER_SPARSE_BLOCK - len(row)))
    return row, plan.ctx


def attended_tokens(blk: Sequence[int], p: int, table_width: int | None = None) -> list[int]:
    """Logical token positions a row attends, in attention order (length ``ctx``).

    Each full block contributes its 128 tokens, the tail block its tokens up to
    and including ``p``. For a decode row of a request with ``seq_len`` tokens
    and ``decode_query_len = 1``, ``p = seq_len - 1``.

    Args:
        blk: ``[K]`` selected logical block ids (``-1`` = padding).
        p: the query's absolute position.
        table_width: the block table's width ``M`` (ids ``>= M`` are not attended); ``None``: no limit.
    """
    return [t for start, stop in attended_ranges(blk, p, table_width) for t in range(start, stop)]


def attended_ranges(blk: Sequence[int], p: int, table_width: int | None = None) -> list[tuple[int, int]]:
    """Half-open ``(start, stop)`` token ranges of :func:`attended_tokens`, one per attended block."""
    plan = plan_sparse_row(blk, p, table_width)
    ranges = [(b * SPARSE_BLOCK_SIZE, (b + 1) * SPARSE_BLOCK_SIZE) for b in plan.full]
    if plan.tail is not None:
        ranges.append((plan.tail * SPARSE_BLOCK_SIZE, plan.causal_len))
    return ranges


def decode_positions(seq_len: int, decode_query_len: int = 1) -> list[int]:
    """``p`` of the decode rows of one request: the last ``decode_query_len`` positions of its sequence.

    Row ``i`` has ``p = seq_len - decode_query_len + i``; a negative ``p`` is a padded row.
    """
    return decode_rows(torch.tensor([int(seq_len)]), int(decode_query_len))[1].tolist()


def _fill(topk_idx, block_table, rows, block_page_stride, out):
    """``rows[n] = (request, p)``; write every (head, row) with :func:`sparse_block_table_row`."""
    h, n, k = topk_idx.shape
    b, m = block_table.shape
    width = k * PAGES_PER_SPARSE_BLOCK
    topk = topk_idx.tolist()
    table = block_table.tolist()
    sparse_bt = [[[0] * width for _ in range(n)] for _ in range(h)]
    sparse_ctx = [[0] * n for _ in range(h)]
    for head in range(h):
        for row, (req, p) in enumerate(rows):
            if not 0 <= req < b:  # a request id out of range: treated as a padded row
                req, p = 0, -1
            bt_row = table[req] if b else []
            sparse_bt[head][row], sparse_ctx[head][row] = sparse_block_table_row(
                topk[head][row], bt_row, p, block_page_stride
            )
    device = topk_idx.device
    result_bt = torch.tensor(sparse_bt, dtype=torch.int32).reshape(h, n, width).to(device)
    result_ctx = torch.tensor(sparse_ctx, dtype=torch.int32).reshape(h, n).to(device)
    if out is None:
        return result_bt, result_ctx
    return out[0].copy_(result_bt), out[1].copy_(result_ctx)


@twin_of("mm3lab.block_table")
def build_sparse_block_table_decode(topk_idx, block_table, seq_lens, decode_query_len, block_page_stride, out):
    """Sparse block table of decode rows (rows: SPEC 2, :func:`mm3lab.rows.decode_rows`), as loops.

    Arguments and results: :func:`mm3lab.build_sparse_block_table_decode`.
    """
    check_decode(topk_idx, block_table, seq_lens, decode_query_len, block_page_stride, out)
    req, pos = decode_rows(seq_lens, decode_query_len)
    rows = list(zip(req.tolist(), pos.tolist(), strict=True))
    return _fill(topk_idx, block_table, rows, block_page_stride, out)


@twin_of("mm3lab.block_table")
def build_sparse_block_table_prefill(topk_idx, block_table, query_req_id, query_abs_pos, block_page_stride, out):
    """Sparse block table of prefill rows, each with its own request id and absolute position, as loops.

    Arguments and results: :func:`mm3lab.build_sparse_block_table_prefill`.
    """
    check_prefill(topk_idx, block_table, query_req_id, query_abs_pos, block_page_stride, out)
    rows = list(zip(query_req_id.tolist(), query_abs_pos.tolist(), strict=False))
    return _fill(topk_idx, block_table, rows, block_page_stride, out)


__all__ = [
    "SparseRow",
    "attended_ranges",
    "attended_tokens",
    "build_sparse_block_table_decode",
    "build_sparse_block_table_prefill",
    "decode_positions",
    "plan_sparse_row",
    "sparse_block_table_row",
]
