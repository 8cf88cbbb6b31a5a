"""Sparse paged attention (SPEC section 5).

Each (query token ``n``, KV head ``h``) row is ordinary single-query paged
attention over its compacted page list: the first ``sparse_ctx[h, n]`` tokens of
the pages ``sparse_bt[h, n, :]``, shared by the ``G = Hq / Hkv`` query heads of
the group (16 in MiniMax-M3). Decode, speculative decode and prefill are all
rows of this one call; the causal mask is already in ``sparse_ctx`` because the
sparse block table puts the causal tail block last (SPEC section 3).

``reference.py`` holds the readable page-walking reference and the
dense-masked reference (whole sequence, mask "causal and block selected");
``kernel.py`` the GQA-packed Triton kernel with its split-over-pages merge.
"""

from __future__ import annotations

import torch

from .. import backend
from . import reference
from .checks import check_sparse_attention
from .reference import dense_masked_attention

__all__ = ["dense_masked_attention", "sparse_attention"]


def sparse_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    sparse_bt: torch.Tensor,
    sparse_ctx: torch.Tensor,
    scale: float | None = None,
    *,
    return_lse: bool = False,
    out: torch.Tensor | None = None,
):
    """Sparse paged attention of every (row, KV head) over its page list (SPEC section 5).

    ``out[n, hq] = softmax(scale * q[n, hq] . K^T) V`` where, with ``h = hq // (Hq // Hkv)``,
    ``K``/``V`` are the first ``sparse_ctx[h, n]`` tokens of pages ``sparse_bt[h, n, :]``
    (token ``i`` = row ``i % 16`` of page ``sparse_bt[h, n, i // 16]``, K through
    ``k_cache``, V through ``v_cache``; either layout). ``ctx == 0`` gives zeros
    (and ``lse = -inf``). Accumulation is float32.

    Bad input raises before anything runs: a group size that does not divide, a
    head-dim or dtype mismatch, views that fit neither layout, and (while
    validation is on) a ``ctx`` outside ``[0, W * 16]`` or a used page id outside
    the cache. With validation off the kernel still never reads outside the
    cache: such a ``ctx`` is clipped and such a page skipped.

    Args:
        q: ``[N, Hq, D]`` float32/float16/bfloat16, the cache's dtype (bfloat16 runs
            the PyTorch path on the interpreter backend, whose bf16 arithmetic is inexact).
        k_cache, v_cache: page-16 views ``[pages, 16, Hkv, D]`` (``mm3lab.allocate_kv_cache``).
        sparse_bt: ``[Hkv, N, W]`` int32/int64 page ids, ``W = topk * 8``.
        sparse_ctx: ``[Hkv, N]`` int32/int64 tokens attended per row.
        scale: softmax scale, default ``D ** -0.5``.
        return_lse: also return the natural-log log-sum-exp of the scaled scores.
        out: optional ``[N, Hq, D]`` contiguous buffer in q's dtype.
    Returns:
        ``out [N, Hq, D]`` in q's dtype, or ``(out, lse [N, Hq] float32)``.
    """
    _, scale = check_sparse_attention(q, k_cache, v_cache, sparse_bt, sparse_ctx, scale, out)
    fallback = backend.bf16_interpreted(q.dtype)
    if not backend.use_kernel(q, k_cache, sparse_bt, entry_point="sparse_attention", fallback=fallback):
        return reference.sparse_attention(
            q, k_cache, v_cache, sparse_bt, sparse_ctx, scale, return_lse=return_lse, out=out
        )
    from .kernel import sparse_attention_kernel

    n, hq, d = q.shape
    if out is None:
        out = torch.empty(n, hq, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(n, hq, dtype=torch.float32, device=q.device) if return_lse else None
    if n:
        sparse_attention_kernel(q, k_cache, v_cache, sparse_bt, sparse_ctx, scale, out, lse)
    return (out, lse) if return_lse else out
