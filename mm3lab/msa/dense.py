"""The dense-attention baseline (SPEC section 2) on the same inputs as the MSA layer.

:func:`dense_decode` / :func:`dense_prefill` do the KV insert, then causal
attention over every block of the request. They run through the same sparse
kernel with every block selected, which *is* dense causal attention, so
sparse-versus-dense differences come from the selection alone.
"""

from __future__ import annotations

import torch

from .._checks import check_index, check_int, check_same_device, validation
from ..attention import sparse_attention
from ..block_table import build_sparse_block_table_decode, build_sparse_block_table_prefill
from ..index_cache import token_slots
from ..indexer.checks import check_table_entries
from ..layout import write_kv_page16
from ..rows import decode_query_rows
from .layer import MSAStep, _check_inserts, _check_query

__all__ = ["dense_decode", "dense_prefill"]


def _all_blocks(hkv: int, n: int, block_table: torch.Tensor) -> torch.Tensor:
    """``topk_idx`` that selects every block of the table, ``[H, N, M]``."""
    m = block_table.shape[1]
    return torch.arange(m, dtype=torch.int32, device=block_table.device).expand(hkv, n, m)


def dense_decode(
    q,
    key,
    value,
    k_cache,
    v_cache,
    block_table,
    seq_lens,
    *,
    decode_query_len: int = 1,
    scale=None,
    return_intermediates: bool = False,
):
    """Dense causal attention for decode rows on the same inputs as :func:`msa_decode` (baseline).

    Inserts K/V, then attends every token ``s <= p`` of the request: the sparse path
    with every block selected. ``return_intermediates`` gives an :class:`MSAStep`
    with ``scores = None``.
    """
    block_page_stride = _check_query(q, k_cache, v_cache)
    check_index("block_table", block_table, ndim=2)
    check_index("seq_lens", seq_lens, shape=(block_table.shape[0],))
    dql = check_int("decode_query_len", decode_query_len, minimum=1)
    b = block_table.shape[0]
    if q.shape[0] != b * dql:
        raise ValueError(
            f"q: expected batch * decode_query_len = {b} * {dql} = {b * dql} rows "
            f"(block_table has {b} requests), got {q.shape[0]}"
        )
    check_same_device(q=q, block_table=block_table, seq_lens=seq_lens)
    req, pos = decode_query_rows(seq_lens, decode_query_len)
    check_table_entries(block_table, req, pos, k_cache.shape[0] // block_page_stride, "the KV cache", seq_lens)
    with validation(False):  # values checked above in one read (check_table_entries): not again
        slots = token_slots(block_table, req, pos)
        checked = {"block_page_stride": block_page_stride, "scale": scale}
        _check_inserts(q, key, value, None, k_cache, v_cache, None, block_table, slots, **checked)
        write_kv_page16(key, value, k_cache, v_cache, slots)
        topk_idx = _all_blocks(k_cache.shape[2], q.shape[0], block_table)
        sparse_bt, sparse_ctx = build_sparse_block_table_decode(
            topk_idx, block_table, seq_lens, decode_query_len, block_page_stride
        )
        out, lse = sparse_attention(q, k_cache, v_cache, sparse_bt, sparse_ctx, scale, return_lse=True)
    if not return_intermediates:
        return out
    return out, MSAStep(req, pos, slots, None, topk_idx, sparse_bt, sparse_ctx, lse)


def dense_prefill(
    q,
    key,
    value,
    k_cache,
    v_cache,
    block_table,
    query_req_id,
    query_abs_pos,
    *,
    scale=None,
    return_intermediates: bool = False,
):
    """Dense causal attention for prefill rows on the same inputs as :func:`msa_prefill` (baseline)."""
    block_page_stride = _check_query(q, k_cache, v_cache)
    check_index("block_table", block_table, ndim=2)
    check_index("query_abs_pos", query_abs_pos, ndim=1)
    check_index("query_req_id", query_req_id, shape=(query_abs_pos.shape[0],))
    check_same_device(q=q, block_table=block_table, query_req_id=query_req_id, query_abs_pos=query_abs_pos)
    req, pos = query_req_id, query_abs_pos
    check_table_entries(block_table, req, pos, k_cache.shape[0] // block_page_stride, "the KV cache")
    with validation(False):  # values checked in one read (check_table_entries): not again
        slots = token_slots(block_table, req, pos)
        checked = {"block_page_stride": block_page_stride, "scale": scale}
        _check_inserts(q, key, value, None, k_cache, v_cache, None, block_table, slots, **checked)
        write_kv_page16(key, value, k_cache, v_cache, slots)
        topk_idx = _all_blocks(k_cache.shape[2], q.shape[0], block_table)
        sparse_bt, sparse_ctx = build_sparse_block_table_prefill(topk_idx, block_table, req, pos, block_page_stride)
        out, lse = sparse_attention(q, k_cache, v_cache, sparse_bt, sparse_ctx, scale, return_lse=True)
    if not return_intermediates:
        return out
    return out, MSAStep(req, pos, slots, None, topk_idx, sparse_bt, sparse_ctx, lse)
