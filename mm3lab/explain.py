"""Text renderings of the sparse block table (SPEC section 3), for terminals and notebooks.

``mm3lab explain --topk 1 0 -1 --block-table 5 7 --seq-len 129`` prints
:func:`explain_sparse_block_table`: for each decode row of one request, its
position, its self block, the row's pages grouped per block (full blocks in
selection order, the causal tail last), what was dropped and why, the ``ctx``
formula with its numbers, and the token ranges attended.

The row and ``ctx`` come from :func:`mm3lab.build_sparse_block_table_decode` (the
kernel on this machine's backend); the annotations from
:func:`mm3lab.block_table.reference.plan_sparse_row`, and the two are checked to agree.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch

from ._checks import check_block_page_stride, check_int
from .block_table import BLOCK_PAGE_STRIDES, build_sparse_block_table_decode
from .block_table.reference import attended_ranges, decode_positions, plan_sparse_row
from .constants import PAGES_PER_SPARSE_BLOCK, SPARSE_BLOCK_SIZE


def _span(first: int, last: int) -> str:
    return f"{first}..{last}"


MAX_EXPLAIN_ROWS = 1024
"""Most decode rows (and selected blocks per row) one explanation prints."""
I64_MAX = 2**63 - 1


def _int64_list(name: str, values) -> list[int]:
    """Python ints (not bools or floats) that fit int64."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(f"{name}: expected a list of ints, got {type(values).__name__}")
    if len(values) > MAX_EXPLAIN_ROWS:
        raise ValueError(f"{name}: at most {MAX_EXPLAIN_ROWS} entries, got {len(values)}")
    return [check_int(f"{name}[{i}]", v, minimum=-I64_MAX - 1, maximum=I64_MAX) for i, v in enumerate(values)]


def _selection_rows(topk, rows: int) -> list[list[int]]:
    nested = isinstance(topk, Sequence) and len(topk) and isinstance(topk[0], Sequence)
    topk = [_int64_list("topk", r) for r in topk] if nested else [_int64_list("topk", topk)] * rows
    if len(topk) != rows:
        raise ValueError(f"topk: expected one selection or {rows} (one per decode row), got {len(topk)}")
    if any(len(r) != len(topk[0]) for r in topk) or not topk[0]:
        raise ValueError("topk: every row needs the same number (at least one) of selected blocks")
    return topk


def _row_text(
    blk: list[int],
    bt_row: list[int],
    p: int,
    seq_len: int,
    i: int,
    dql: int,
    block_page_stride: int,
    pages: list[int],
    ctx: int,
) -> list[str]:
    plan = plan_sparse_row(blk, p, table_width=len(bt_row))
    if plan.ctx != ctx:  # pragma: no cover - only a kernel bug gets here
        raise AssertionError(f"sparse_ctx {ctx} from the kernel, {plan.ctx} from the reference")
    head = f"row {i} of {dql}: p = {p} (seq_len {seq_len} - decode_query_len {dql} + {i})"
    if plan.self_blk is None:
        return [head, "  padded row (p < 0): causal_len = 0, nothing attended, every page id 0, ctx = 0"]
    sb = plan.self_blk
    seen = plan.causal_len - sb * SPARSE_BLOCK_SIZE
    lines = [
        head,
        (
            f"  causal_len = p + 1 = {plan.causal_len}; self_blk = p // {SPARSE_BLOCK_SIZE} = {sb} "
            f"(tokens {_span(sb * SPARSE_BLOCK_SIZE, (sb + 1) * SPARSE_BLOCK_SIZE - 1)}); "
            f"the query sees {seen} of its block's {SPARSE_BLOCK_SIZE} tokens"
        ),
        f"  {'slot':>4}  {'block':>5}  {'physical':>8}  {'page ids':>12}  {'tokens':>13}  role",
    ]
    slot_of = {}
    for slot, b in enumerate(blk):
        slot_of.setdefault(b, slot)
    for out_slot, b in enumerate(plan.blocks):
        ids = pages[out_slot * PAGES_PER_SPARSE_BLOCK : (out_slot + 1) * PAGES_PER_SPARSE_BLOCK]
        first = b * SPARSE_BLOCK_SIZE
        if b == plan.tail:
            last, role = p, f"tail ({seen} of {SPARSE_BLOCK_SIZE} tokens), topk[{slot_of[b]}]"
        else:
            last, role = first + SPARSE_BLOCK_SIZE - 1, f"full ({SPARSE_BLOCK_SIZE} tokens), topk[{slot_of[b]}]"
        lines.append(
            f"  {out_slot:>4}  {b:>5}  {bt_row[b]:>8}  {_span(ids[0], ids[-1]):>12}  {_span(first, last):>13}  {role}"
        )
    for out_slot in range(len(plan.blocks), len(blk)):
        lines.append(f"  {out_slot:>4}  {'-':>5}  {'-':>8}  {'0 x 8':>12}  {'-':>13}  unused")
    if plan.dropped:
        lines.append("  dropped: " + ", ".join(f"topk[{s}] = {b} ({why})" for s, b, why in plan.dropped))
    if plan.tail is None:
        lines.append(
            f"  ctx = len(full) * {SPARSE_BLOCK_SIZE} = {len(plan.full)} * {SPARSE_BLOCK_SIZE} = {ctx}"
            f"   (own block {sb} not selected: no tail)"
        )
    else:
        lines.append(
            f"  ctx = len(full) * {SPARSE_BLOCK_SIZE} + (causal_len - self_blk * {SPARSE_BLOCK_SIZE}) "
            f"= {len(plan.full)} * {SPARSE_BLOCK_SIZE} + ({plan.causal_len} - {sb} * {SPARSE_BLOCK_SIZE}) "
            f"= {ctx}"
        )
    ranges = attended_ranges(blk, p, table_width=len(bt_row))
    lines.append("  attended tokens: " + (", ".join(_span(a, z - 1) for a, z in ranges) or "none"))
    return lines


def explain_sparse_block_table(
    topk: Sequence[int] | Sequence[Sequence[int]],
    block_table_row: Sequence[int],
    seq_len: int,
    block_page_stride: int = PAGES_PER_SPARSE_BLOCK,
    decode_query_len: int = 1,
) -> str:
    """The sparse block table rows of one request's decode queries, as text.

    Args:
        topk: ``[K]`` selected logical blocks shared by every row, or ``[dql][K]``, one per row.
        block_table_row: ``[M]`` the request's logical -> physical blocks.
        seq_len: the request's tokens, its decode queries included.
        block_page_stride: 8 (dense planes) or 16 (packed sides).
        decode_query_len: query rows of the request (``> 1``: speculative decode).
    Raises:
        ValueError: what :func:`mm3lab.build_sparse_block_table_decode` raises (a block id
            past the block table, a ``seq_len`` it cannot hold, ...).
    """
    check_block_page_stride(block_page_stride)
    dql = check_int("decode_query_len", decode_query_len, minimum=1, maximum=MAX_EXPLAIN_ROWS)
    check_int("seq_len", seq_len, minimum=0, maximum=I64_MAX)
    rows = _selection_rows(topk, dql)
    bt_row = _int64_list("block_table_row", block_table_row)
    if not bt_row:
        raise ValueError("block_table_row: expected at least one block")
    sbt, ctx = build_sparse_block_table_decode(
        torch.tensor([rows], dtype=torch.int64),
        torch.tensor([bt_row], dtype=torch.int64).reshape(1, len(bt_row)),
        torch.tensor([int(seq_len)]),
        decode_query_len,
        block_page_stride,
    )
    layout = "dense planes" if block_page_stride == PAGES_PER_SPARSE_BLOCK else "packed sides"
    lines = [
        (
            f"block table row {bt_row} (logical -> physical), block_page_stride {block_page_stride} ({layout}): "
            f"physical block b -> page ids b * {block_page_stride} + 0..{PAGES_PER_SPARSE_BLOCK - 1}"
        ),
    ]
    shared = all(r == rows[0] for r in rows)
    if shared:
        lines.append(f"selection topk = {rows[0]}" + (" (every row)" if decode_query_len > 1 else ""))
    for i, p in enumerate(decode_positions(seq_len, decode_query_len)):
        if not shared:
            lines.append(f"selection topk = {rows[i]}")
        lines.extend(
            _row_text(
                rows[i],
                bt_row,
                p,
                int(seq_len),
                i,
                decode_query_len,
                block_page_stride,
                sbt[0, i].tolist(),
                int(ctx[0, i]),
            )
        )
    return "\n".join(lines)


def _cmd_explain(args) -> int:
    try:
        text = explain_sparse_block_table(args.topk, args.block_table, args.seq_len, args.block_page_stride, args.dql)
    except (ValueError, TypeError) as err:
        print(f"mm3lab explain: {err}", file=sys.stderr)
        return 2
    print(text)
    return 0


def add_explain_parser(sub) -> None:
    """Add ``explain`` to the ``mm3lab`` command's subparsers."""
    p = sub.add_parser(
        "explain",
        help="print one request's sparse block table rows: pages per block, the causal tail, ctx",
        description="Print the sparse block table rows (SPEC section 3) of one request's decode queries.",
        epilog="example: mm3lab explain --topk 1 0 -1 --block-table 5 7 --seq-len 129 --block-page-stride 16",
    )
    p.add_argument("--topk", type=int, nargs="+", required=True, help="selected logical blocks, -1 = padding")
    p.add_argument(
        "--block-table", type=int, nargs="+", required=True, help="the request's physical block of each logical block"
    )
    p.add_argument("--seq-len", type=int, required=True, help="the request's tokens, decode queries included")
    p.add_argument(
        "--block-page-stride",
        "--stride",
        dest="block_page_stride",
        type=int,
        default=PAGES_PER_SPARSE_BLOCK,
        choices=BLOCK_PAGE_STRIDES,
        help="page ids per block: 8 dense planes (default), 16 packed sides (--stride: old name)",
    )
    p.add_argument("--dql", type=int, default=1, help="decode_query_len: query rows of the request (default 1)")
    p.set_defaults(func=_cmd_explain)


__all__ = ["add_explain_parser", "explain_sparse_block_table"]
