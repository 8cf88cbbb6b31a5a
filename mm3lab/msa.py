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

:func:`dense_decode` / :func:`dense_prefill` are the dense-attention baseline on
the same inputs: the KV insert, then causal attention over every block of the
request. It runs through the same sparse kernel with every block selected, which
*is* dense causal attention, so sparse-versus-dense differences come from the
selection alone.

:func:`attention_weights` and :func:`selected_mass` measure what the selection
keeps: the dense softmax weight of each token, and the share of it that falls in
the selected blocks.
"""

from __future__ import annotations

import dataclasses

import torch

from ._checks import check_index, check_same_device, check_tensor
from .attention import sparse_attention
from .block_table import build_sparse_block_table_decode, build_sparse_block_table_prefill
from .constants import DEFAULT_TOPK, SPARSE_BLOCK_SIZE
from .index_cache import insert_index_cache, token_slots
from .index_cache.checks import check_insert_index_cache
from .indexer import (
    index_scores_decode,
    index_scores_prefill,
    index_topk_block_table_decode,
    index_topk_block_table_prefill,
)
from .indexer.checks import check_decode as check_indexer_decode
from .indexer.checks import check_prefill as check_indexer_prefill
from .layout import check_kv_views, write_kv_page16
from .layout.checks import check_write_kv

__all__ = [
    "MSADemo",
    "MSAStep",
    "SyntheticLayer",
    "synthetic_layer",
    "attention_weights",
    "decode_query_rows",
    "dense_decode",
    "dense_prefill",
    "msa_decode",
    "msa_prefill",
    "run_msa_demo",
    "selected_mass",
    "topk_sweep",
]


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
# rows and slots
# ----------------------------------------------------------------------------


def decode_query_rows(seq_lens: torch.Tensor, decode_query_len: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Request and position of every decode row: row ``n = r * dql + i`` is at ``p = seq_lens[r] - dql + i``.

    Args:
        seq_lens: ``[B]`` tokens per request, the decode queries included.
        decode_query_len: query tokens per request (``> 1`` for speculative decode).
    Returns:
        ``(query_req_id [B * dql], query_abs_pos [B * dql])`` int32; ``p < 0`` marks a padded row (``-1``).
    """
    check_index("seq_lens", seq_lens, ndim=1)
    if not isinstance(decode_query_len, int) or decode_query_len < 1:
        raise ValueError(f"decode_query_len: expected a positive int, got {decode_query_len!r}")
    dql = decode_query_len
    rows = torch.arange(seq_lens.shape[0] * dql, device=seq_lens.device)
    req = rows // dql
    pos = seq_lens.long()[req] - dql + rows % dql
    return req.to(torch.int32), pos.clamp(min=-1).to(torch.int32)


# ----------------------------------------------------------------------------
# validation of the whole step, before any cache is written
# ----------------------------------------------------------------------------


def _check_query(q, k_cache, v_cache, index_q=None) -> int:
    """``q`` (and ``index_q``) against the KV cache, what later steps would reject; returns ``block_page_stride``."""
    stride = check_kv_views(k_cache, v_cache)
    _, _, hkv, d = k_cache.shape
    if index_q is not None:
        check_tensor("index_q", index_q, ndim=3)
        if index_q.shape[1] != hkv:
            raise ValueError(
                f"index_q: {index_q.shape[1]} index heads, but the KV cache has {hkv} KV heads (one index head each)"
            )
    check_tensor("q", q, ndim=3)
    if q.dtype != k_cache.dtype:
        raise TypeError(f"q: dtype {q.dtype} differs from k_cache's {k_cache.dtype}")
    if q.shape[2] != d:
        raise ValueError(f"q: head dim {q.shape[2]} does not match k_cache's head dim {d}")
    if q.shape[1] % hkv:
        raise ValueError(f"q: {q.shape[1]} query heads are not a multiple of the cache's {hkv} KV heads")
    return stride


def _prepare_inserts(q, key, value, index_k, k_cache, v_cache, index_cache, block_table, req, pos) -> torch.Tensor:
    """Slots of the new tokens, after checking both inserts: nothing is written until all checks pass."""
    if q.shape[0] != pos.shape[0]:
        raise ValueError(f"q: expected one row per query token ({pos.shape[0]}), got {q.shape[0]}")
    check_same_device(q=q, k_cache=k_cache, block_table=block_table)
    slots = token_slots(block_table, req, pos)
    check_write_kv(key, value, k_cache, v_cache, slots)
    if index_k is not None:
        check_insert_index_cache(index_k, index_cache, slots)
    return slots


def _insert(key, value, index_k, k_cache, v_cache, index_cache, slots) -> None:
    if index_k is not None:
        insert_index_cache(index_k, index_cache, slots)
    write_kv_page16(key, value, k_cache, v_cache, slots)


# ----------------------------------------------------------------------------
# the MSA layer
# ----------------------------------------------------------------------------


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
):
    """One MSA layer for decode (and speculative-decode) rows: insert, select, attend.

    The ``N = B * decode_query_len`` new tokens are the last positions of their
    requests (row ``n = r * dql + i`` at ``p = seq_lens[r] - dql + i``); their index
    key, K and V are written to the caches first, so every query sees itself.

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
    Returns:
        ``out [N, Hq, D]`` in q's dtype, or ``(out, MSAStep)``.
    """
    stride = _check_query(q, k_cache, v_cache, index_q)
    check_indexer_decode(
        index_q, index_cache, block_table, seq_lens, topk, decode_query_len, init_blocks, local_blocks
    )
    req, pos = decode_query_rows(seq_lens, decode_query_len)
    slots = _prepare_inserts(q, key, value, index_k, k_cache, v_cache, index_cache, block_table, req, pos)
    _insert(key, value, index_k, k_cache, v_cache, index_cache, slots)
    topk_idx, sparse_bt, sparse_ctx = index_topk_block_table_decode(
        index_q, index_cache, block_table, seq_lens, topk, decode_query_len, init_blocks, local_blocks, stride
    )
    out, lse = sparse_attention(q, k_cache, v_cache, sparse_bt, sparse_ctx, scale, return_lse=True)
    if not return_intermediates:
        return out
    scores = index_scores_decode(index_q, index_cache, block_table, seq_lens, decode_query_len)
    return out, MSAStep(req, pos, slots, scores, topk_idx, sparse_bt, sparse_ctx, lse)


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
):
    """One MSA layer for prefill rows, each with its own request and position.

    All ``N`` tokens are inserted before any is scored, so a chunk's queries see
    the whole chunk up to themselves (causal).

    Args:
        as :func:`msa_decode`, with ``query_req_id [N]`` and ``query_abs_pos [N]``
        (negative = padded row) in place of ``seq_lens`` and ``decode_query_len``.
    Returns:
        ``out [N, Hq, D]``, or ``(out, MSAStep)``.
    """
    stride = _check_query(q, k_cache, v_cache, index_q)
    check_indexer_prefill(
        index_q, index_cache, block_table, query_req_id, query_abs_pos, topk, init_blocks, local_blocks
    )
    req, pos = query_req_id, query_abs_pos
    slots = _prepare_inserts(q, key, value, index_k, k_cache, v_cache, index_cache, block_table, req, pos)
    _insert(key, value, index_k, k_cache, v_cache, index_cache, slots)
    topk_idx, sparse_bt, sparse_ctx = index_topk_block_table_prefill(
        index_q, index_cache, block_table, req, pos, topk, init_blocks, local_blocks, stride
    )
    out, lse = sparse_attention(q, k_cache, v_cache, sparse_bt, sparse_ctx, scale, return_lse=True)
    if not return_intermediates:
        return out
    scores = index_scores_prefill(index_q, index_cache, block_table, req, pos)
    return out, MSAStep(req, pos, slots, scores, topk_idx, sparse_bt, sparse_ctx, lse)


# ----------------------------------------------------------------------------
# the dense baseline
# ----------------------------------------------------------------------------


def _all_blocks(hkv: int, n: int, block_table: torch.Tensor) -> torch.Tensor:
    """``topk_idx`` that selects every block of the table, ``[H, N, M]``."""
    m = block_table.shape[1]
    return torch.arange(m, dtype=torch.int32, device=block_table.device).expand(hkv, n, m)


def dense_decode(
    q, key, value, k_cache, v_cache, block_table, seq_lens, *, decode_query_len: int = 1, scale=None,
    return_intermediates: bool = False,
):
    """Dense causal attention for decode rows on the same inputs as :func:`msa_decode` (baseline).

    Inserts K/V, then attends every token ``s <= p`` of the request: the sparse path
    with every block selected. ``return_intermediates`` gives an :class:`MSAStep`
    with ``scores = None``.
    """
    stride = _check_query(q, k_cache, v_cache)
    check_index("block_table", block_table, ndim=2)
    check_index("seq_lens", seq_lens, shape=(block_table.shape[0],))
    req, pos = decode_query_rows(seq_lens, decode_query_len)
    slots = _prepare_inserts(q, key, value, None, k_cache, v_cache, None, block_table, req, pos)
    write_kv_page16(key, value, k_cache, v_cache, slots)
    topk_idx = _all_blocks(k_cache.shape[2], q.shape[0], block_table)
    sparse_bt, sparse_ctx = build_sparse_block_table_decode(topk_idx, block_table, seq_lens, decode_query_len, stride)
    out, lse = sparse_attention(q, k_cache, v_cache, sparse_bt, sparse_ctx, scale, return_lse=True)
    if not return_intermediates:
        return out
    return out, MSAStep(req, pos, slots, None, topk_idx, sparse_bt, sparse_ctx, lse)


def dense_prefill(
    q, key, value, k_cache, v_cache, block_table, query_req_id, query_abs_pos, *, scale=None,
    return_intermediates: bool = False,
):
    """Dense causal attention for prefill rows on the same inputs as :func:`msa_prefill` (baseline)."""
    stride = _check_query(q, k_cache, v_cache)
    req, pos = query_req_id, query_abs_pos
    slots = _prepare_inserts(q, key, value, None, k_cache, v_cache, None, block_table, req, pos)
    write_kv_page16(key, value, k_cache, v_cache, slots)
    topk_idx = _all_blocks(k_cache.shape[2], q.shape[0], block_table)
    sparse_bt, sparse_ctx = build_sparse_block_table_prefill(topk_idx, block_table, req, pos, stride)
    out, lse = sparse_attention(q, k_cache, v_cache, sparse_bt, sparse_ctx, scale, return_lse=True)
    if not return_intermediates:
        return out
    return out, MSAStep(req, pos, slots, None, topk_idx, sparse_bt, sparse_ctx, lse)


# ----------------------------------------------------------------------------
# what the selection keeps
# ----------------------------------------------------------------------------


def attention_weights(
    q: torch.Tensor, key: torch.Tensor, query_req_id: torch.Tensor, query_abs_pos: torch.Tensor, scale=None
) -> torch.Tensor:
    """Dense causal softmax weights of every row and query head over its request's sequence.

    Args:
        q: ``[N, Hq, D]``.
        key: ``[B, S, Hkv, D]`` the requests' whole key sequences.
        query_req_id, query_abs_pos: ``[N]``; a padded row (``p < 0``) gets all zeros.
    Returns:
        ``[N, Hq, S]`` float32, each live row summing to 1 over ``s <= p``.
    """
    n, hq, d = q.shape
    _, seq, hkv, _ = key.shape
    scale = d ** -0.5 if scale is None else float(scale)
    group = hq // hkv
    k = key[query_req_id.long().clamp(min=0)].float()  # [N, S, Hkv, D]
    k = k.repeat_interleave(group, dim=2)  # [N, S, Hq, D]
    scores = scale * torch.einsum("nhd,nshd->nhs", q.float(), k)
    visible = torch.arange(seq, device=q.device) <= query_abs_pos.long().unsqueeze(-1)  # [N, S]
    scores = scores.masked_fill(~visible.unsqueeze(1), float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    return torch.nan_to_num(weights, nan=0.0)  # padded rows: nothing visible


def selected_mass(weights: torch.Tensor, topk_idx: torch.Tensor) -> torch.Tensor:
    """Share of each row's dense attention weight that falls in its selected blocks.

    Args:
        weights: ``[N, Hq, S]`` from :func:`attention_weights`.
        topk_idx: ``[Hkv, N, K]`` selected blocks (``-1`` = padding).
    Returns:
        ``[N, Hq]`` float32 in ``[0, 1]`` (0 for padded rows).
    """
    n, hq, seq = weights.shape
    hkv = topk_idx.shape[0]
    group = hq // hkv
    blocks = -(-seq // SPARSE_BLOCK_SIZE)
    per_block = torch.zeros(n, hq, blocks * SPARSE_BLOCK_SIZE, device=weights.device)
    per_block[..., :seq] = weights
    per_block = per_block.view(n, hq, blocks, SPARSE_BLOCK_SIZE).sum(-1)  # [N, Hq, blocks]
    chosen = torch.zeros(hkv, n, blocks + 1, dtype=torch.bool, device=weights.device)
    idx = topk_idx.long()
    idx = torch.where((idx < 0) | (idx >= blocks), blocks, idx)  # padding lands in the spare last slot
    chosen.scatter_(2, idx, True)
    chosen = chosen[..., :blocks].permute(1, 0, 2).repeat_interleave(group, dim=1)  # [N, Hq, blocks]
    return (per_block * chosen).sum(-1)



# ----------------------------------------------------------------------------
# a synthetic layer to run
# ----------------------------------------------------------------------------

@dataclasses.dataclass
class SyntheticLayer:
    """A seeded MSA decode step: caches holding every token but the new ones, and the step's inputs.

    Built from :func:`mm3lab.synthetic.make_sequence` (one sequence per request) by
    :func:`synthetic_layer`.

    Attributes:
        q, key, value, index_q, index_k: the decode step's inputs (``N = B * dql`` rows), as
            :func:`msa_decode` takes them.
        cache: the KV cache (:class:`mm3lab.PagedKVCache`), history written.
        index_cache: ``[num_blocks, 128, Di]``, history written.
        block_table: ``[B, M]``; seq_lens: ``[B]`` (the new tokens included).
        decode_query_len: query tokens per request.
        full_key, full_value: ``[B, S, Hkv, D]`` every token of every request (the new ones last,
            zeros past a shorter request's end).
        sequences: the :class:`mm3lab.synthetic.SyntheticSequence` of each request.
        pattern: the :data:`mm3lab.synthetic.PATTERNS` entry used.
    """

    q: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    index_q: torch.Tensor
    index_k: torch.Tensor
    cache: object
    index_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    decode_query_len: int
    full_key: torch.Tensor
    full_value: torch.Tensor
    sequences: tuple
    pattern: str

    def inputs(self) -> dict:
        """Keyword arguments of :func:`msa_decode` for this step."""
        return dict(
            q=self.q, key=self.key, value=self.value, index_q=self.index_q, index_k=self.index_k,
            k_cache=self.cache.k_cache, v_cache=self.cache.v_cache, index_cache=self.index_cache,
            block_table=self.block_table, seq_lens=self.seq_lens, decode_query_len=self.decode_query_len,
        )

    def dense_inputs(self) -> dict:
        """Keyword arguments of :func:`dense_decode` for this step."""
        return dict(
            q=self.q, key=self.key, value=self.value, k_cache=self.cache.k_cache, v_cache=self.cache.v_cache,
            block_table=self.block_table, seq_lens=self.seq_lens, decode_query_len=self.decode_query_len,
        )


def synthetic_layer(
    context_len: int,
    *,
    batch: int = 1,
    num_kv_heads: int = 2,
    group_size: int = 4,
    head_dim: int = 64,
    index_dim: int = 32,
    layout: str = "packed",
    pattern: str = "needle",
    decode_query_len: int = 1,
    dtype: torch.dtype = torch.float32,
    device="cpu",
    seed: int = 0,
    **sequence_options,
) -> SyntheticLayer:
    """A seeded decode step over ``batch`` requests of about ``context_len`` tokens, caches filled.

    Request ``r`` is :func:`mm3lab.synthetic.make_sequence` ``(pattern, context_len + 37 * r,
    seed=seed + r, **sequence_options)``: its last ``decode_query_len`` tokens are the
    step's queries and new tokens, every earlier token is already in the KV and index
    caches, at slots given by a seeded shuffled block table.

    Args:
        context_len: tokens of request 0, the new ones included (``>= decode_query_len``).
        batch, decode_query_len: requests and query tokens per request.
        num_kv_heads, group_size, head_dim, index_dim: ``Hkv``, ``Hq / Hkv``, ``D``, ``Di``.
        layout: ``"dense"`` or ``"packed"`` KV cache.
        pattern: ``"needle"``, ``"sink"``, ``"recency"`` or ``"random"`` (see :mod:`mm3lab.synthetic`).
        dtype, device: of the caches and inputs.
        seed: seeds the sequences and the block table.
        sequence_options: passed on to ``make_sequence`` (``strength``, ``needle_block``, ...).
    """
    from .index_cache import allocate_index_cache
    from .layout import allocate_kv_cache
    from .synthetic import make_sequence

    dql = decode_query_len
    if isinstance(context_len, bool) or not isinstance(context_len, int) or context_len < dql:
        raise ValueError(f"context_len: expected an int >= decode_query_len ({dql}), got {context_len!r}")
    hkv, d, di = num_kv_heads, head_dim, index_dim
    lens = [context_len + 37 * r for r in range(batch)]
    seqs = tuple(
        make_sequence(pattern, length, num_kv_heads=hkv, num_q_heads=hkv * group_size, index_dim=di,
                      head_dim=d, seed=seed + r, **sequence_options)
        for r, length in enumerate(lens)
    )
    s_max = max(lens)
    m = -(-s_max // SPARSE_BLOCK_SIZE)
    num_blocks = batch * m + 2
    g = torch.Generator().manual_seed(seed)
    block_table = torch.randperm(num_blocks, generator=g)[: batch * m].view(batch, m).to(torch.int32)

    full_key = torch.zeros(batch, s_max, hkv, d)
    full_value = torch.zeros(batch, s_max, hkv, d)
    full_index_k = torch.zeros(batch, s_max, di)
    for r, sq in enumerate(seqs):
        full_key[r, : lens[r]], full_value[r, : lens[r]], full_index_k[r, : lens[r]] = sq.k, sq.v, sq.index_k
    req = torch.arange(batch).repeat_interleave(dql)
    pos = torch.tensor(lens)[req] - dql + torch.arange(batch * dql) % dql
    q = torch.stack([seqs[r].q[p] for r, p in zip(req.tolist(), pos.tolist())])
    index_q = torch.stack([seqs[r].index_q[p] for r, p in zip(req.tolist(), pos.tolist())])

    cache = allocate_kv_cache(num_blocks, hkv, d, layout, dtype=dtype, device=device, fill=0.0)
    index_cache = allocate_index_cache(num_blocks, di, dtype=dtype, device=device, fill=0.0)
    dev = cache.kv.device
    full_key, full_value, full_index_k = (t.to(device=dev, dtype=dtype) for t in (full_key, full_value, full_index_k))
    hist_req = torch.cat([torch.full((length - dql,), r) for r, length in enumerate(lens)]).to(dev)
    hist_pos = torch.cat([torch.arange(length - dql) for length in lens]).to(dev)
    block_table = block_table.to(dev)
    if hist_req.numel():  # the history, written through the page-128 view (one vectorized copy)
        physical = block_table.long()[hist_req, hist_pos // SPARSE_BLOCK_SIZE]
        offset = hist_pos % SPARSE_BLOCK_SIZE
        cache.kv[physical, 0, offset] = full_key[hist_req, hist_pos]
        cache.kv[physical, 1, offset] = full_value[hist_req, hist_pos]
        index_cache[physical, offset] = full_index_k[hist_req, hist_pos]
    req, pos = req.to(dev), pos.to(dev)
    return SyntheticLayer(
        q=q.to(device=dev, dtype=dtype), key=full_key[req, pos], value=full_value[req, pos],
        index_q=index_q.to(device=dev, dtype=dtype), index_k=full_index_k[req, pos],
        cache=cache, index_cache=index_cache, block_table=block_table,
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev), decode_query_len=dql,
        full_key=full_key, full_value=full_value, sequences=seqs, pattern=pattern,
    )


# ----------------------------------------------------------------------------
# experiments the notebook runs
# ----------------------------------------------------------------------------


@dataclasses.dataclass
class MSADemo:
    """One decode step of a :class:`SyntheticLayer` run sparse and dense, with what the selection kept.

    Attributes:
        layer: the inputs; topk: the selection size.
        out: ``[N, Hq, D]`` MSA output; step: its :class:`MSAStep`.
        dense: ``[N, Hq, D]`` the dense baseline's output.
        weights: ``[N, Hq, S]`` dense attention weights (:func:`attention_weights`).
        mass: ``[N, Hq]`` share of them in the selected blocks (:func:`selected_mass`).
        error: ``||out - dense|| / ||dense||`` over all rows and heads.
    """

    layer: SyntheticLayer
    topk: int
    out: torch.Tensor
    step: MSAStep
    dense: torch.Tensor
    weights: torch.Tensor
    mass: torch.Tensor
    error: float


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    denom = b.norm().item()
    return (a - b).norm().item() / denom if denom else (a - b).norm().item()


def run_msa_demo(layer: SyntheticLayer, topk: int = DEFAULT_TOPK, dense: torch.Tensor | None = None) -> MSADemo:
    """Run :func:`msa_decode` (and :func:`dense_decode` unless ``dense`` is given) on ``layer``.

    Both calls write the step's new tokens into the layer's caches (the same
    values every time), so a layer can be run again with another ``topk``.
    """
    out, step = msa_decode(**layer.inputs(), topk=topk, return_intermediates=True)
    if dense is None:
        dense = dense_decode(**layer.dense_inputs())
    weights = attention_weights(layer.q, layer.full_key, step.query_req_id, step.query_abs_pos)
    mass = selected_mass(weights, step.topk_idx)
    return MSADemo(layer, topk, out, step, dense, weights, mass, _relative_error(out, dense))


def topk_sweep(layer: SyntheticLayer, topks=(1, 2, 4, 8, 16)) -> list[dict]:
    """Sparse-versus-dense output error and attention mass kept, per ``topk``.

    Returns one dict per ``topk``: ``topk``, ``error`` (relative, all rows and heads),
    ``mass`` (mean share of the dense attention weight in the selected blocks),
    ``tokens`` (mean ``sparse_ctx``) and ``context`` (mean visible tokens).
    """
    dense = dense_decode(**layer.dense_inputs())
    rows = []
    for topk in topks:
        demo = run_msa_demo(layer, int(topk), dense)
        rows.append(dict(
            topk=int(topk), error=demo.error, mass=float(demo.mass.mean()),
            tokens=float(demo.step.sparse_ctx.float().mean()),
            context=float((demo.step.query_abs_pos.float() + 1).clamp(min=0).mean()),
        ))
    return rows
