"""Sparse paged attention (SPEC section 5).

Each (query token ``n``, KV head ``h``) row is ordinary single-query paged
attention over its compacted page list: the first ``sparse_ctx[h, n]`` tokens of
the pages ``sparse_bt[h, n, :]``, shared by the ``G = Hq / Hkv`` query heads of
the group (16 in MiniMax-M3). Decode, speculative decode and prefill are all
rows of this one call; the causal mask is already in ``sparse_ctx`` because the
sparse block table puts the causal tail block last (SPEC section 3).

``reference.py`` holds the readable page-walking reference and the
dense-masked reference (whole sequence, mask "causal and block selected");
``kernel.py`` the GQA-packed per-row Triton kernel with its split-over-pages merge;
``tiled.py`` the tiled prefill kernel, whose programs take a tile of consecutive
rows and walk the union of their pages once.

Which kernel runs (``algorithm=None``), a rule measured on an H200 at the model's
shapes (64 query / 4 KV heads, head dim 128, top-k 16, bf16):

* fewer than :data:`TILED_MIN_ROWS` rows (decode, speculative decode up to
  batch 64 x 8 draft tokens): the per-row kernel. At 128K context (``spec_decode``
  suite, graph) the tiled kernel wins only where a request's draft rows share
  their selection and there are enough of them (batch 64 with 4 or 8 rows per
  request: 2.3x and 2.7x; batch 16 with 8: 1.6x); with 2 rows per request, or
  independent selections, it loses (up to 5x at batch 16), and telling the cases
  apart needs the overlap read back to the host, which costs a decode step more
  than it saves;
* from :data:`TILED_MIN_ROWS` rows up (prefill chunks): the tiled kernel, whose
  programs each choose, on the device, between walking their tile's union and
  walking their rows one by one (:data:`tiled.ROW_MODE_FACTOR`). Measured on an H100
  (4096-token chunk at 32K, graph), it is 3.4x and 2.1x faster than the per-row kernel
  on tile-shared and synthetic selections and 3% slower on independent random ones
  (3.12 against 3.02 ms), and nothing is read back, so the choice is CUDA-graph
  capturable and an eager call does not wait for the device.
"""

from __future__ import annotations

import torch

from .. import _replay, _valcheck, backend
from .._checks import check_scale, raise_flagged, validation_enabled
from ..constants import PAGES_PER_SPARSE_BLOCK
from ..layout.views import PACKED_STRIDE
from . import reference
from .checks import _detail, check_sparse_attention, check_sparse_attention_values
from .reference import dense_masked_attention

__all__ = [
    "ALGORITHMS",
    "TILED_MIN_ROWS",
    "choose_algorithm",
    "dense_masked_attention",
    "sparse_attention",
]

ALGORITHMS = ("rows", "tiled")
TILED_MIN_ROWS = 1024
"""Calls with fewer rows (query tokens) run the per-row kernel by default, calls with more the tiled one."""


def choose_algorithm(n_rows: int, algorithm: str | None = None) -> str:
    """The kernel a call with ``n_rows`` rows runs: ``algorithm`` if given, else the documented rule."""
    if algorithm is not None:
        if algorithm not in ALGORITHMS:
            names = ", ".join(map(repr, ALGORITHMS))
            raise ValueError(f"algorithm: expected None or one of {names}, got {algorithm!r}")
        return algorithm
    return "rows" if n_rows < TILED_MIN_ROWS else "tiled"


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
    algorithm: str | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
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
        algorithm: ``None`` (the rule in the module docstring: per-row below
            :data:`TILED_MIN_ROWS` rows, tiled from there up),
            ``"rows"`` (one program per row and KV head) or ``"tiled"`` (one program per tile of
            consecutive rows and KV head, each union page read once per tile). All give the same
            result to floating-point tolerance.
        k_scale, v_scale: FP8 caches only (``PagedKVCache.k_scale`` / ``.v_scale``, ``[pages, 16, Hkv]``
            float32). The kernel reads the FP8 K/V and dequantizes them in registers: the K
            scale multiplies each score column (float32), each V row is scaled in float32 and
            rounded to q's dtype for the second dot. Tolerance: :data:`mm3lab.fp8.ATTENTION_FP8_ATOL` against the
            bf16 reference over the unquantized K/V, :data:`mm3lab.fp8.ATTENTION_FP8_DEQUANT_ATOL`
            against the reference over the dequantized cache.
    Returns:
        ``out [N, Hq, D]`` in q's dtype, or ``(out, lse [N, Hq] float32)``.
    """
    # a repeated call shape: checked once, its launches replayed (mm3lab._replay.Memo)
    caches = (k_cache, v_cache, k_scale, v_scale)
    key = _MEMO.key((q, sparse_bt, sparse_ctx, out), caches, (scale, return_lse, algorithm, validation_enabled()))
    entry = _MEMO.get(key)
    if entry is not None:
        if entry.recording is None:  # (seen, not replayable: the normal path)
            key = None
        else:
            block_page_stride, fused, bufs, check_values = entry.info
            if check_values:  # (validation on, the checks not in the launch)
                check_sparse_attention_values(k_cache, v_cache, sparse_bt, sparse_ctx, block_page_stride)
            out, lse, inputs = _outputs(q, k_cache, v_cache, sparse_bt, sparse_ctx, k_scale, v_scale, return_lse, out)
            if _valcheck.replay_checked(entry.recording, inputs, q.device, key.stream, fused, bufs):
                # the checks' own message (they find what the launch flagged)
                raise_flagged(lambda: _detail(k_cache, v_cache, sparse_bt, sparse_ctx, block_page_stride))
            return (out, lse) if return_lse else out
    block_page_stride, scale = check_sparse_attention(
        q, k_cache, v_cache, sparse_bt, sparse_ctx, scale, out, k_scale, v_scale
    )
    if algorithm is not None:
        choose_algorithm(q.shape[0], algorithm)  # a bad name raises on every path
    if key is None:
        return _attend_checked(
            q, k_cache, v_cache, sparse_bt, sparse_ctx, scale, return_lse, out, algorithm, k_scale, v_scale
        )
    # Where the replays' value checks can run inside the attention launch: validation on, a new output
    # (a call that raises has then written nothing of the caller's), and the per-row kernel or the
    # tiled kernel's fused pre-pass (compiled, some table columns).
    fused = None
    rows = q.shape[0]  # (q passed the checks)
    kernel = "rows" if k_scale is not None else choose_algorithm(rows, algorithm)
    in_kernel = kernel == "rows" or (sparse_bt.shape[-1] > 0 and not backend.INTERPRETER)
    if validation_enabled() and out is None and rows and in_kernel:
        fused = _valcheck.fused_flags(q.device)
    check = None if fused is None else (fused, *_page_rule(block_page_stride))
    out, lse, inputs = _outputs(q, k_cache, v_cache, sparse_bt, sparse_ctx, k_scale, v_scale, return_lse, out)
    args = (q, k_cache, v_cache, sparse_bt, sparse_ctx, scale, return_lse, out, algorithm, k_scale, v_scale)
    launch = lambda: _attend_checked(*args, lse=lse, check=check)  # noqa: E731
    returned, recording = _valcheck.record_checked(launch, inputs, q.device, fused)
    # (what a replay needs: the key holds the validation setting, so check_values holds for every replay)
    bufs = None if fused is None else _valcheck.fused_buffers(q.device)
    _MEMO.put(key, recording, (block_page_stride, fused, bufs, fused is None and validation_enabled()))
    return returned  # (the kernels wrote out and lse; a PyTorch path returns its own, and is not replayed)


def _page_rule(block_page_stride: int) -> tuple[int, int]:
    """``(page_mod, page_mod_limit)``: a used page id ``p`` needs ``p mod page_mod < page_mod_limit``
    (packed layout: a K page, ``block * 16 + j`` with ``j < 8``; dense: any)."""
    return (PACKED_STRIDE, PAGES_PER_SPARSE_BLOCK) if block_page_stride == PACKED_STRIDE else (1, 1)


def _outputs(q, k_cache, v_cache, sparse_bt, sparse_ctx, k_scale, v_scale, return_lse, out):
    """A recorded call's ``out`` (new unless given) and ``lse``, and every tensor of the call by name."""
    n, hq, d = q.shape
    if out is None:
        out = torch.empty(n, hq, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(n, hq, dtype=torch.float32, device=q.device) if return_lse else None
    inputs = {
        "q": q,
        "k_cache": k_cache,
        "v_cache": v_cache,
        "sparse_bt": sparse_bt,
        "sparse_ctx": sparse_ctx,
        "out": out,
        "lse": lse,
        "k_scale": k_scale,
        "v_scale": v_scale,
    }
    return out, lse, inputs


_MEMO = _replay.Memo("sparse_attention")
"""Repeated call shapes of :func:`sparse_attention`: checked once, launches replayed on a GPU
(:class:`mm3lab._replay.Memo`)."""


def _attend_checked(
    q,
    k_cache,
    v_cache,
    sparse_bt,
    sparse_ctx,
    scale,
    return_lse,
    out,
    algorithm,
    k_scale,
    v_scale,
    *,
    lse=None,
    check=None,
):
    """:func:`sparse_attention` after its checks, for a caller that made them (the MSA layer, whose
    page lists the sparse block table built); ``scale=None`` is ``D ** -0.5``; ``lse``: the buffer
    for it where ``return_lse`` (else one is allocated); ``check``: the attention launch's own value
    checks (``sparse_attention_kernel``'s or ``tiled_attention_kernel``'s argument)."""
    scale = check_scale(scale, q.shape[-1])
    fallback = backend.bf16_interpreted(q.dtype)
    if not backend.use_kernel(q, k_cache, sparse_bt, entry_point="sparse_attention", fallback=fallback):
        return reference.sparse_attention(
            q,
            k_cache,
            v_cache,
            sparse_bt,
            sparse_ctx,
            scale,
            return_lse=return_lse,
            out=out,
            k_scale=k_scale,
            v_scale=v_scale,
        )
    from . import tiled
    from .kernel import sparse_attention_kernel

    n, hq, d = q.shape
    if out is None:
        out = torch.empty(n, hq, d, dtype=q.dtype, device=q.device)
    if return_lse and lse is None:
        lse = torch.empty(n, hq, dtype=torch.float32, device=q.device)
    elif not return_lse:
        lse = None

    fp8 = k_scale is not None  # FP8 caches: the per-row kernel (the tiled kernel reads bf16/fp16 pages)
    if n and not fp8 and choose_algorithm(n, algorithm) == "tiled":
        tiled.tiled_attention_kernel(q, k_cache, v_cache, sparse_bt, sparse_ctx, scale, out, lse, check=check)
    elif n:
        sparse_attention_kernel(
            q, k_cache, v_cache, sparse_bt, sparse_ctx, scale, out, lse, k_scale, v_scale, check=check
        )
    return (out, lse) if return_lse else out
