"""Argument checks of ``sparse_attention``, shared by the kernel path and the reference.

Structural checks always run. Value checks (context lengths, page ids) read the
tables (one small launch and one host read, :mod:`mm3lab._valcheck`; a replayed call
with a new output: inside the attention launch, ``kernel._check_row``) and run while
validation is on; with it off, both paths apply the same
defined fallback instead (see :func:`readable_pages` and :func:`clamp_ctx`).
"""

from __future__ import annotations

import torch

from .._checks import (
    FLOAT_DTYPES,
    check_index,
    check_out,
    check_same_device,
    check_scale,
    check_tensor,
    validation_enabled,
    value_checks,
)
from .._valcheck import Segment
from ..constants import PAGE_SIZE, PAGES_PER_SPARSE_BLOCK
from ..fp8 import FP8_DTYPE
from ..layout.views import PACKED_STRIDE, check_kv_scales, check_kv_views


def readable_pages(k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    """Page ids ``0 .. readable_pages - 1`` are inside both views (the V view is 8 pages shorter when packed)."""
    return min(k_cache.shape[0], v_cache.shape[0])


def clamp_ctx(ctx: int, width: int) -> int:
    """The context actually attended: ``ctx`` clipped to ``[0, width * 16]``."""
    return max(0, min(int(ctx), width * PAGE_SIZE))


def _first(mask: torch.Tensor):
    idx = torch.nonzero(mask)
    return None if idx.numel() == 0 else tuple(int(i) for i in idx[0])


def _detail(k_cache, v_cache, sparse_bt, sparse_ctx, block_page_stride) -> None:
    """The value checks one by one, with their messages (run only for a flagged call)."""
    width = sparse_bt.shape[2]
    bad = _first((sparse_ctx < 0) | (sparse_ctx > width * PAGE_SIZE))
    if bad is not None:
        raise ValueError(
            f"sparse_ctx: (head {bad[0]}, row {bad[1]}) is {int(sparse_ctx[bad])}, outside "
            f"[0, {width * PAGE_SIZE}] (the row's {width} pages of {PAGE_SIZE} tokens)"
        )
    used_pages = (sparse_ctx.long() + PAGE_SIZE - 1) // PAGE_SIZE  # [Hkv, N]
    used = torch.arange(width, device=sparse_bt.device) < used_pages.unsqueeze(-1)  # [Hkv, N, W]
    pages = readable_pages(k_cache, v_cache)
    bad = _first(used & ((sparse_bt < 0) | (sparse_bt >= pages)))
    if bad is not None:
        raise ValueError(
            f"sparse_bt: (head {bad[0]}, row {bad[1]}) entry {bad[2]} is page {int(sparse_bt[bad])}, "
            f"outside the cache's {pages} readable pages"
        )
    if block_page_stride == PACKED_STRIDE:
        bad = _first(used & (sparse_bt % PACKED_STRIDE >= PAGES_PER_SPARSE_BLOCK))
        if bad is not None:
            raise ValueError(
                f"sparse_bt: (head {bad[0]}, row {bad[1]}) entry {bad[2]} is page {int(sparse_bt[bad])}, "
                f"which in the packed layout is not a K page (ids are block * {PACKED_STRIDE} + j, "
                f"j < {PAGES_PER_SPARSE_BLOCK}); was the table built with block_page_stride={PACKED_STRIDE}?"
            )


def check_sparse_attention(
    q, k_cache, v_cache, sparse_bt, sparse_ctx, scale, out=None, k_scale=None, v_scale=None
) -> tuple[int, float]:
    """Validate ``sparse_attention``'s arguments; return ``(block_page_stride, scale)``.

    Raises ``TypeError``/``ValueError`` naming the argument (and the ``(head, row)``
    for value checks) before anything runs.
    """
    block_page_stride = check_kv_views(k_cache, v_cache)
    _, _, hkv, d = k_cache.shape
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    n, hq, dq = q.shape
    check_kv_scales(k_cache, v_cache, k_scale, v_scale)  # FP8 KV (SPEC section 9): any float q
    if q.dtype != k_cache.dtype and k_cache.dtype != FP8_DTYPE:
        raise TypeError(
            f"q: dtype {str(q.dtype).replace('torch.', '')} differs from k_cache's "
            f"{str(k_cache.dtype).replace('torch.', '')}"
        )
    if dq != d:
        raise ValueError(f"q: head dim {dq} does not match k_cache's head dim {d} (shape {tuple(k_cache.shape)})")
    if hq % hkv != 0:
        raise ValueError(
            f"q: {hq} query heads are not a multiple of the cache's {hkv} KV heads "
            "(the GQA group size Hq / Hkv must be a whole number)"
        )
    check_index("sparse_bt", sparse_bt, ndim=3)
    check_index("sparse_ctx", sparse_ctx, ndim=2)
    if sparse_bt.shape[0] != hkv or sparse_bt.shape[1] != n:
        raise ValueError(
            f"sparse_bt: expected shape ({hkv}, {n}, width) = (KV heads, rows of q, topk * {PAGES_PER_SPARSE_BLOCK}), "
            f"got {tuple(sparse_bt.shape)}"
        )
    check_tensor("sparse_ctx", sparse_ctx, shape=(hkv, n))
    check_same_device(q=q, k_cache=k_cache, sparse_bt=sparse_bt, sparse_ctx=sparse_ctx)
    check_out("out", out, (n, hq, d), q.dtype, q.device)
    scale = check_scale(scale, d)
    check_sparse_attention_values(k_cache, v_cache, sparse_bt, sparse_ctx, block_page_stride)
    return block_page_stride, scale


def check_sparse_attention_values(k_cache, v_cache, sparse_bt, sparse_ctx, block_page_stride: int) -> None:
    """The value checks of :func:`check_sparse_attention` (while validation is on): every ``ctx``
    in ``[0, W * 16]``, every used page id inside the cache (a K page when packed)."""
    if validation_enabled() and sparse_bt.shape[1]:
        width = sparse_bt.shape[2]
        pages = readable_pages(k_cache, v_cache)
        packed = block_page_stride == PACKED_STRIDE
        segments = [
            Segment("all", sparse_ctx, lo=0, hi=width * PAGE_SIZE),
            Segment(
                "len",
                sparse_bt,
                lo=0,
                hi=pages - 1,
                aux=sparse_ctx,
                unit=PAGE_SIZE,
                modulus=PACKED_STRIDE if packed else 0,
                mod_limit=PAGES_PER_SPARSE_BLOCK,
            ),
        ]
        value_checks(segments, lambda: _detail(k_cache, v_cache, sparse_bt, sparse_ctx, block_page_stride))
