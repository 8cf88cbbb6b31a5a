"""Pure-PyTorch twins of the whole MSA layer (SPEC 2): :func:`msa_decode` / :func:`msa_prefill`.

The same layer as :mod:`mm3lab.msa.layer` (same signatures, checks, order and
:class:`~mm3lab.msa.layer.MSAStep`), every step taken from :mod:`mm3lab.reference`:
rows and slots, the index-cache and KV inserts, the indexer and sparse block table, and
the sparse attention are each the readable reference, on any device and any backend.
"""

from __future__ import annotations

import types

import torch

from ..constants import DEFAULT_TOPK
from ..rows import decode_query_rows
from .layer import run_layer

__all__ = ["msa_decode", "msa_prefill"]


def _steps():
    from .. import reference

    def rows_and_slots(block_table, rows):
        kind, first, second = rows
        req, pos = decode_query_rows(first, second) if kind == "decode" else (first, second)
        return req, pos, reference.token_slots(block_table, req, pos)

    names = (
        "insert_index_cache",
        "write_kv_page16",
        "index_topk_block_table_decode",
        "index_topk_block_table_prefill",
        "index_scores_decode",
        "index_scores_prefill",
        "sparse_attention",
    )
    return types.SimpleNamespace(rows_and_slots=rows_and_slots, **{name: getattr(reference, name) for name in names})


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
    """:func:`mm3lab.msa_decode` from the reference steps (:mod:`mm3lab.reference`)."""
    return run_layer(
        _steps(),
        ("decode", seq_lens, decode_query_len),
        q,
        key,
        value,
        index_q,
        index_k,
        k_cache,
        v_cache,
        index_cache,
        block_table,
        topk=topk,
        init_blocks=init_blocks,
        local_blocks=local_blocks,
        scale=scale,
        return_intermediates=return_intermediates,
        index_scale=index_scale,
        k_scale=k_scale,
        v_scale=v_scale,
    )


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
    """:func:`mm3lab.msa_prefill` from the reference steps (:mod:`mm3lab.reference`)."""
    return run_layer(
        _steps(),
        ("prefill", query_req_id, query_abs_pos),
        q,
        key,
        value,
        index_q,
        index_k,
        k_cache,
        v_cache,
        index_cache,
        block_table,
        topk=topk,
        init_blocks=init_blocks,
        local_blocks=local_blocks,
        scale=scale,
        return_intermediates=return_intermediates,
        index_scale=index_scale,
        k_scale=k_scale,
        v_scale=v_scale,
    )
