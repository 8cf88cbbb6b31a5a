"""Cost model of one MSA layer: tokens and bytes read per query token, dense versus sparse.

For one query token (a decode row) at context length ``L`` (the query's position
is ``L - 1``), one layer reads:

dense attention
    K and V of all ``L`` tokens for each of the ``Hkv`` KV heads:
    ``L * Hkv * D * 2 * kv_bytes``.
sparse attention (SPEC section 5)
    each KV head attends only its selected blocks: ``min(topk, blocks)`` blocks
    of 128 tokens, the query's own (tail) block only up to the query, i.e.
    ``L`` tokens while ``L <= topk * 128`` and ``(topk - 1) * 128 + tail`` after;
    so at most ``topk * 128 = 2048`` tokens whatever ``L`` is.
indexer (SPEC section 2)
    the one shared index key of every context token, ``L * Di * index_bytes``,
    plus the sparse block table row (``Hkv * topk * 8`` int32 page ids). The
    indexer's read still grows with ``L``, but a token costs ``Di * index_bytes``
    bytes there against ``Hkv * D * 2 * kv_bytes`` in dense attention (8x less
    with the model's shapes in one dtype).

Bytes are what must come from memory at least once (no re-reads, no writes); the
time estimate divides them by a memory bandwidth. Defaults are MiniMax-M3's
shapes in bf16.
"""

from __future__ import annotations

import dataclasses
import math

from ._checks import check_int
from .constants import (
    DEFAULT_TOPK,
    HEAD_DIM,
    INDEX_HEAD_DIM,
    MAX_CONTEXT,
    NUM_KV_HEADS,
    PAGES_PER_SPARSE_BLOCK,
    SPARSE_BLOCK_SIZE,
)

TABLE_ENTRY_BYTES = 4  # one int32 page id of the sparse block table
H200_TBPS = 4.8
"""H200 HBM3e peak bandwidth, TB/s (the benchmarks measure the achievable copy bandwidth)."""


@dataclasses.dataclass(frozen=True)
class AttentionCost:
    """What one query token reads in one layer at ``context_len`` tokens of context.

    Attributes:
        context_len: tokens the query may see (its position + 1).
        dense_tokens: tokens each KV head attends densely (= ``context_len``).
        sparse_tokens: tokens each KV head attends after selection (``<= topk * 128``).
        dense_kv_bytes: K and V bytes of dense attention, all KV heads.
        sparse_kv_bytes: K and V bytes of sparse attention, all KV heads.
        indexer_bytes: index keys scored by the indexer (shared by the index heads).
        table_bytes: the sparse block table row of every KV head.
    """

    context_len: int
    dense_tokens: int
    sparse_tokens: int
    dense_kv_bytes: int
    sparse_kv_bytes: int
    indexer_bytes: int
    table_bytes: int

    @property
    def sparse_total_bytes(self) -> int:
        """Everything the sparse path reads: indexer + table + selected K/V."""
        return self.sparse_kv_bytes + self.indexer_bytes + self.table_bytes

    @property
    def kv_saving(self) -> float:
        """``dense_kv_bytes / sparse_kv_bytes``: how much less K/V the selection reads."""
        return self.dense_kv_bytes / self.sparse_kv_bytes if self.sparse_kv_bytes else math.inf

    @property
    def total_saving(self) -> float:
        """``dense_kv_bytes / sparse_total_bytes``, the indexer included."""
        return self.dense_kv_bytes / self.sparse_total_bytes if self.sparse_total_bytes else math.inf


def sparse_tokens(context_len: int, topk: int = DEFAULT_TOPK) -> int:
    """Tokens one (query, KV head) row attends when the query's own block is among ``topk`` selected.

    ``L`` while all blocks fit in the selection, else ``topk - 1`` full blocks plus
    the tail block's ``L - (blocks - 1) * 128`` visible tokens.
    """
    if context_len <= 0:
        return 0
    blocks = math.ceil(context_len / SPARSE_BLOCK_SIZE)
    if blocks <= topk:
        return context_len
    tail = context_len - (blocks - 1) * SPARSE_BLOCK_SIZE
    return (topk - 1) * SPARSE_BLOCK_SIZE + tail


def attention_cost(
    context_len: int,
    *,
    topk: int = DEFAULT_TOPK,
    num_kv_heads: int = NUM_KV_HEADS,
    head_dim: int = HEAD_DIM,
    index_head_dim: int = INDEX_HEAD_DIM,
    kv_bytes: int = 2,
    index_bytes: int = 2,
) -> AttentionCost:
    """Tokens and bytes one query token reads in one layer (see the module docstring).

    Args:
        context_len: tokens visible to the query.
        topk: blocks selected per (query, KV head).
        num_kv_heads, head_dim: ``Hkv`` and ``D`` of the KV cache.
        index_head_dim: ``Di`` of the index keys.
        kv_bytes, index_bytes: bytes per element of the KV cache and of the index cache.
    """
    check_int("context_len", context_len, minimum=0)
    check_int("topk", topk, minimum=1)
    check_int("num_kv_heads", num_kv_heads, minimum=1)
    per_token = num_kv_heads * head_dim * 2 * kv_bytes  # K and V of every KV head
    tokens = sparse_tokens(context_len, topk)
    return AttentionCost(
        context_len=context_len,
        dense_tokens=context_len,
        sparse_tokens=tokens,
        dense_kv_bytes=context_len * per_token,
        sparse_kv_bytes=tokens * per_token,
        indexer_bytes=context_len * index_head_dim * index_bytes,
        table_bytes=num_kv_heads * topk * PAGES_PER_SPARSE_BLOCK * TABLE_ENTRY_BYTES,
    )


def default_context_lens(max_context: int = MAX_CONTEXT) -> list[int]:
    """Powers of two from 1K up to ``max_context`` (1M by default), plus ``max_context``."""
    lens, length = [], 1024
    while length < max_context:
        lens.append(length)
        length *= 2
    return lens + [max_context]


def cost_curve(context_lens=None, **shape) -> list[AttentionCost]:
    """:func:`attention_cost` at each context length (default :func:`default_context_lens`)."""
    return [attention_cost(int(length), **shape) for length in (context_lens or default_context_lens())]


def read_time_us(num_bytes: float, bandwidth_tbps: float = H200_TBPS) -> float:
    """Microseconds to read ``num_bytes`` at ``bandwidth_tbps`` TB/s (a lower bound on the time)."""
    return num_bytes / (bandwidth_tbps * 1e12) * 1e6


def cost_table(context_lens=None, batch: int = 1, **shape) -> str:
    """A text table: per context length, tokens and MB read per query step (``batch`` query tokens)."""
    lines = [f"{'context':>9} {'dense tok':>10} {'sparse tok':>10} {'dense MB':>10} {'sparse MB':>10} {'saving':>7}"]
    for c in cost_curve(context_lens, **shape):
        lines.append(
            f"{c.context_len:>9} {c.dense_tokens:>10} {c.sparse_tokens:>10} "
            f"{batch * c.dense_kv_bytes / 1e6:>10.2f} {batch * c.sparse_total_bytes / 1e6:>10.2f} "
            f"{c.total_saving:>6.1f}x"
        )
    return "\n".join(lines)


__all__ = [
    "AttentionCost",
    "H200_TBPS",
    "attention_cost",
    "cost_curve",
    "cost_table",
    "default_context_lens",
    "read_time_us",
    "sparse_tokens",
]
