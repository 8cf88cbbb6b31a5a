"""Pure-PyTorch references of sparse paged attention (SPEC section 5), written as loops.

Two references, two routes to the same numbers:

* :func:`sparse_attention` walks each (row, KV head)'s page list, exactly what
  the kernel does, one page at a time;
* :func:`dense_masked_attention` never looks at pages: it attends over the
  request's whole sequence with the mask "causal for ``p`` and the token's block
  is selected for head ``h``". Agreement of the two is the test that the
  page-list path (block table, layout, causal tail) is right.

Both compute in float32 and return the query's dtype.
"""

from __future__ import annotations

import torch

from .._checks import check_index, check_same_device, check_tensor, first_bad_row, validation_enabled
from .._twin import twin_of
from ..constants import PAGE_SIZE, SPARSE_BLOCK_SIZE
from .checks import check_sparse_attention, clamp_ctx, readable_pages


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float):
    """Softmax attention of ``G`` queries ``[G, D]`` over ``T`` keys/values ``[T, D]`` in float32.

    Returns ``(out [G, D], lse [G])``; with ``T == 0``: zeros and ``-inf``.
    """
    g, d = q.shape
    if keys.shape[0] == 0:
        return q.new_zeros(g, d, dtype=torch.float32), q.new_full((g,), float("-inf"), dtype=torch.float32)
    scores = scale * (q.float() @ keys.float().T)  # [G, T]
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.softmax(scores, dim=-1)
    return probs @ values.float(), lse


def _load(cache: torch.Tensor, scale: torch.Tensor | None, page: int, rows: int, h: int) -> torch.Tensor:
    """The first ``rows`` tokens of ``page`` for head ``h``, float32 (an FP8 value times its scale)."""
    values = cache[page, :rows, h].float()
    return values if scale is None else values * scale[page, :rows, h, None]


@twin_of("mm3lab.attention")
def sparse_attention(q, k_cache, v_cache, sparse_bt, sparse_ctx, scale, return_lse, out, k_scale, v_scale):
    """Single-query paged attention of every (row, KV head) over its page list.

    For row ``n`` and KV head ``h``, the keys are the first ``ctx = sparse_ctx[h, n]``
    tokens of the pages ``sparse_bt[h, n, :]``: token ``i`` is row ``i % 16`` of page
    ``sparse_bt[h, n, i // 16]``, read through ``k_cache`` for K and ``v_cache`` for V
    (one page id reaches both, in either layout). The ``G = Hq // Hkv`` query heads
    ``h * G .. h * G + G - 1`` share those keys:
    ``out[n, hq] = softmax(scale * q[n, hq] . K^T) V``; ``ctx == 0`` gives zeros.

    With validation off, a ``ctx`` outside ``[0, width * 16]`` is clipped to it and a
    page id outside the cache is skipped (its tokens are not attended); the kernel
    does the same.

    Args:
        q: ``[N, Hq, D]`` queries, the cache's dtype.
        k_cache, v_cache: page-16 views ``[pages, 16, Hkv, D]`` (dense or packed layout).
        sparse_bt: ``[Hkv, N, W]`` int32/int64 page ids (``W = topk * 8``).
        sparse_ctx: ``[Hkv, N]`` int32/int64 tokens attended per row.
        scale: softmax scale, default ``D ** -0.5``.
        return_lse: also return the log-sum-exp of the scaled scores.
        out: optional ``[N, Hq, D]`` output buffer (q's dtype, contiguous).
        k_scale, v_scale: FP8 caches only: ``[pages, 16, Hkv]`` float32 scales; a key / value is
            read as ``stored * scale`` (SPEC section 9).
    Returns:
        ``out [N, Hq, D]`` in q's dtype, or ``(out, lse [N, Hq] float32)``; ``lse = -inf`` where ``ctx == 0``.
    """
    _, scale = check_sparse_attention(q, k_cache, v_cache, sparse_bt, sparse_ctx, scale, out, k_scale, v_scale)
    n_rows, hq, d = q.shape
    hkv, _, width = sparse_bt.shape
    group = hq // hkv
    pages_in_cache = readable_pages(k_cache, v_cache)
    result = torch.zeros(n_rows, hq, d, dtype=torch.float32, device=q.device)
    lse = torch.full((n_rows, hq), float("-inf"), dtype=torch.float32, device=q.device)
    page_lists = sparse_bt.tolist()
    ctx_lists = sparse_ctx.tolist()
    for h in range(hkv):
        heads = slice(h * group, (h + 1) * group)
        for n in range(n_rows):
            ctx = clamp_ctx(ctx_lists[h][n], width)
            keys, values = [], []
            for slot in range((ctx + PAGE_SIZE - 1) // PAGE_SIZE):
                page = page_lists[h][n][slot]
                rows = min(PAGE_SIZE, ctx - slot * PAGE_SIZE)  # only the last page is partial
                if not 0 <= page < pages_in_cache:  # never read outside the cache
                    continue
                keys.append(_load(k_cache, k_scale, page, rows, h))
                values.append(_load(v_cache, v_scale, page, rows, h))
            k = torch.cat(keys) if keys else torch.zeros(0, d, device=q.device)
            v = torch.cat(values) if values else torch.zeros(0, d, device=q.device)
            result[n, heads], lse[n, heads] = _attend(q[n, heads], k, v, scale)
    if out is None:
        out = result.to(q.dtype)
    else:
        out.copy_(result)
    return (out, lse) if return_lse else out


def dense_masked_attention(
    q: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    topk_idx: torch.Tensor,
    query_req_id: torch.Tensor,
    query_abs_pos: torch.Tensor,
    scale: float | None = None,
    *,
    return_lse: bool = False,
):
    """Sparse attention without pages: the whole sequence, masked to the selected blocks.

    Row ``n`` belongs to request ``r = query_req_id[n]`` at position ``p = query_abs_pos[n]``.
    Query head ``hq`` (KV head ``h = hq // G``) attends to token ``s`` of request ``r``
    exactly when ``s <= p`` (causal) and ``s // 128`` is one of ``topk_idx[h, n, :]``
    (``-1`` entries select nothing; a block named twice counts once). A padded row
    (``p < 0``) or a row with nothing visible gives zeros.

    Args:
        q: ``[N, Hq, D]``.
        key, value: ``[B, S, Hkv, D]``: token ``s`` of request ``r`` is ``key[r, s]``.
        topk_idx: ``[Hkv, N, K]`` selected logical block ids, ``-1`` padding.
        query_req_id: ``[N]`` request of each row.
        query_abs_pos: ``[N]`` absolute position of each row, negative = padding.
        scale: softmax scale, default ``D ** -0.5``.
        return_lse: also return the log-sum-exp ``[N, Hq]`` (float32).
    Returns:
        ``out [N, Hq, D]`` in q's dtype, or ``(out, lse)``.
    """
    check_tensor("q", q, ndim=3)
    n_rows, hq, d = q.shape
    check_tensor("key", key, ndim=4)
    b, seq, hkv, _ = key.shape
    check_tensor("key", key, shape=(b, seq, hkv, d))
    check_tensor("value", value, shape=(b, seq, hkv, d))
    if hq % hkv:
        raise ValueError(f"q: {hq} query heads are not a multiple of key's {hkv} KV heads")
    check_index("topk_idx", topk_idx, ndim=3)
    check_tensor("topk_idx", topk_idx, shape=(hkv, n_rows, None))
    check_index("query_req_id", query_req_id, shape=(n_rows,))
    check_index("query_abs_pos", query_abs_pos, shape=(n_rows,))
    check_same_device(q=q, key=key, value=value, topk_idx=topk_idx, query_req_id=query_req_id)
    if validation_enabled() and n_rows:
        live = query_abs_pos >= 0
        row = first_bad_row(live & ((query_req_id < 0) | (query_req_id >= b)))
        if row is not None:
            raise ValueError(f"query_req_id: row {row} is request {int(query_req_id[row])}, but key holds {b}")
        row = first_bad_row(query_abs_pos >= seq)
        if row is not None:
            raise ValueError(f"query_abs_pos: row {row} is {int(query_abs_pos[row])}, past key's {seq} tokens")
    scale = d**-0.5 if scale is None else float(scale)
    group = hq // hkv
    result = torch.zeros(n_rows, hq, d, dtype=torch.float32, device=q.device)
    lse = torch.full((n_rows, hq), float("-inf"), dtype=torch.float32, device=q.device)
    token_block = torch.arange(seq, device=q.device) // SPARSE_BLOCK_SIZE  # [S]
    positions = torch.arange(seq, device=q.device)
    for n in range(n_rows):
        p, r = int(query_abs_pos[n]), int(query_req_id[n])
        if p < 0:
            continue  # padded row
        for h in range(hkv):
            heads = slice(h * group, (h + 1) * group)
            selected = topk_idx[h, n]
            selected = selected[selected >= 0]
            mask = (positions <= p) & torch.isin(token_block, selected)  # [S]
            result[n, heads], lse[n, heads] = _attend(q[n, heads], key[r, mask, h], value[r, mask, h], scale)
    out = result.to(q.dtype)
    return (out, lse) if return_lse else out


__all__ = ["dense_masked_attention", "sparse_attention"]
