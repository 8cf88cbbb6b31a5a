"""The sparse block table (SPEC section 3): selected logical blocks -> a row of page-16 ids.

For each query row and KV head, the top-k selected logical blocks become a
fixed-width row of ``topk * 8`` physical page ids with the **causal tail block
last**, plus ``sparse_ctx``, the number of tokens the row attends. Full blocks
contribute 8 whole pages each, so the only partial page is the last one, and
the attention kernel's ordinary context-length mask *is* the causal mask.

Decode rows take their position from ``seq_lens``, prefill rows carry a request id and
an absolute position each (the SPEC 2 row rule, :mod:`mm3lab.rows`). A padded row is all
zeros, ``ctx = 0``.

mm3lab's definitions where upstream is undefined: a block named twice is
attended once (first occurrence kept, every entry past the used pages 0), and a
block id at or past the block table's width is never read.

Validation (on by default) raises ``ValueError`` naming the argument and row for
a block id past the table, a ``seq_len``/position the table cannot hold and a
request id out of range; it costs one device sync. Turn it off for CUDA-graph
capture with ``mm3lab.validation(False)`` and pass ``out=`` buffers; the kernel
then treats such ids as not selected and such rows as padded, and still reads
nothing out of bounds.

``reference.py`` is the specification (loops, and the row helpers
``plan_sparse_row``, ``attended_tokens``, ``decode_positions``); ``kernel.py``
the Triton kernel and its reusable device function ``emit_sparse_block_table_row``.
"""

from __future__ import annotations

import torch

from .. import _replay, _valcheck, backend
from .._checks import raise_flagged, validation_enabled
from ..constants import PAGES_PER_SPARSE_BLOCK
from . import reference
from .checks import BLOCK_PAGE_STRIDES, _physical_id_range, check_decode, check_decode_values, check_prefill
from .reference import (
    SparseRow,
    attended_ranges,
    attended_tokens,
    decode_positions,
    plan_sparse_row,
    sparse_block_table_row,
)

# The reference's names: its row helpers re-exported, its entry points as kernels (same signatures).
__all__ = ["BLOCK_PAGE_STRIDES"]
__all__ += reference.__all__


def _outputs(topk_idx: torch.Tensor, out):
    if out is not None:
        return out[0], out[1]
    h, n, k = topk_idx.shape
    sparse_bt = torch.empty(h, n, k * PAGES_PER_SPARSE_BLOCK, dtype=torch.int32, device=topk_idx.device)
    sparse_ctx = torch.empty(h, n, dtype=torch.int32, device=topk_idx.device)
    return sparse_bt, sparse_ctx


MAX_KERNEL_TOPK = 512
"""Widest selection the kernel compacts in registers (its duplicate check is ``K x K``).

Wider rows (a dense baseline that "selects" every block of a long context) take
the PyTorch path; the model's top-k is 16.
"""


def _build(entry: str, topk_idx, block_table, rows: tuple, block_page_stride: int, out, check=None):
    """After the checks: ``entry``'s kernel (``<entry>_kernel``), or its reference where SPEC 7 says so;
    ``check``: the decode kernel's own value checks (its argument; ignored by the reference)."""
    fallback = None if topk_idx.shape[-1] <= MAX_KERNEL_TOPK else "topk-over-512"
    tensors = [t for t in rows if isinstance(t, torch.Tensor)]
    if not backend.use_kernel(topk_idx, block_table, *tensors, entry_point=entry, fallback=fallback):
        return getattr(reference, entry)(topk_idx, block_table, *rows, block_page_stride, out=out)
    from . import kernel

    sparse_bt, sparse_ctx = _outputs(topk_idx, out)
    launch = getattr(kernel, entry + "_kernel")
    checks = {} if check is None else {"check": check}
    launch(topk_idx, block_table, *rows, block_page_stride, sparse_bt, sparse_ctx, **checks)
    return sparse_bt, sparse_ctx


def build_sparse_block_table_decode(
    topk_idx: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    decode_query_len: int = 1,
    block_page_stride: int = PAGES_PER_SPARSE_BLOCK,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse block table of decode (and speculative-decode) rows, one kernel launch.

    Rows: SPEC 2's decode row rule (:mod:`mm3lab.rows`).

    Args:
        topk_idx: ``[H, N, K]`` int32/int64 selected logical blocks (``-1`` = padding),
            ``N = B * decode_query_len``; any strides (e.g. a ``[N, H, K]`` buffer
            transposed), read without a copy.
        block_table: ``[B, M]`` int32/int64 logical -> physical block of each request.
        seq_lens: ``[B]`` int32/int64 tokens per request, the decode queries included.
        decode_query_len: query tokens per request (``> 1`` for speculative decode).
        block_page_stride: page ids per physical block: 8 (dense planes) or 16 (packed
            sides), see :func:`mm3lab.sparse_block_page_stride`.
        out: optional ``(sparse_bt, sparse_ctx)`` contiguous int32 buffers of the output
            shapes, written in place and returned (for CUDA-graph capture).
    Returns:
        ``sparse_bt [H, N, K * 8]`` int32 page ids, causal tail block last, zeros past the
        used pages; ``sparse_ctx [H, N]`` int32 tokens attended.
    Raises:
        TypeError: float ids, a non-int ``decode_query_len``/``block_page_stride``.
        ValueError: wrong ranks or shapes, ``N != B * decode_query_len``, devices that
            differ, bad ``out``; with validation on, a block id ``>= M`` (names
            ``topk_idx``, head and row) or a ``seq_len > M * 128`` (names ``seq_lens`` and
            the request).
    """
    # a repeated call shape: checked once, its launch replayed (mm3lab._replay.Memo)
    outs = (None, None) if out is None else tuple(out) if isinstance(out, (tuple, list)) and len(out) == 2 else None
    key = None
    if outs is not None:
        scalars = (decode_query_len, block_page_stride, validation_enabled())
        key = _MEMO.key((topk_idx, block_table, seq_lens, *outs), (), scalars)
    entry = _MEMO.get(key)
    if entry is not None:
        if entry.recording is None:  # (seen, not replayable: the normal path)
            key = None
        else:
            fused, backup, bufs, check_values = entry.info
            if check_values:  # (validation on, the checks not in the launch)
                check_decode_values(topk_idx, block_table, seq_lens, block_page_stride)
            out = _outputs(topk_idx, out)
            inputs = _inputs(topk_idx, block_table, seq_lens, out)
            if _valcheck.replay_checked(entry.recording, inputs, topk_idx.device, key.stream, fused, bufs):
                if backup is not None:  # the caller's buffers as they were (SPEC 7), in stream order
                    out[0].copy_(backup[0])
                    out[1].copy_(backup[1])
                # the checks' own message (they find what the launch flagged)
                raise_flagged(lambda: check_decode_values(topk_idx, block_table, seq_lens, block_page_stride))
            return out
    check_decode(topk_idx, block_table, seq_lens, decode_query_len, block_page_stride, out)
    rows = (seq_lens, decode_query_len)
    if key is None:
        return _build("build_sparse_block_table_decode", topk_idx, block_table, rows, block_page_stride, out)
    # The replays' value checks run inside the table's launch where validation is on. Into the
    # caller's ``out``, the launch first copies what each row overwrites into buffers of the memo's,
    # from which a call whose checks fail restores them before it raises (SPEC 7).
    fused = backup = None
    if validation_enabled() and topk_idx.shape[1]:
        fused = _valcheck.fused_flags(topk_idx.device)
    if fused is not None and out is not None:
        backup = (torch.empty_like(out[0]), torch.empty_like(out[1]))
    check = None if fused is None else (fused, *_physical_id_range(block_page_stride), backup)
    out = _outputs(topk_idx, out)
    inputs = _inputs(topk_idx, block_table, seq_lens, out)
    launch = lambda: _build(  # noqa: E731
        "build_sparse_block_table_decode", topk_idx, block_table, rows, block_page_stride, out, check
    )
    returned, recording = _valcheck.record_checked(launch, inputs, topk_idx.device, fused)
    # (what a replay needs: the key holds the validation setting, so check_values holds for every replay)
    bufs = None if fused is None else _valcheck.fused_buffers(topk_idx.device)
    _MEMO.put(key, recording, (fused, backup, bufs, fused is None and validation_enabled()))
    return returned


def _inputs(topk_idx, block_table, seq_lens, out) -> dict:
    """A recorded decode-table call's tensors by name."""
    return {
        "topk_idx": topk_idx,
        "block_table": block_table,
        "seq_lens": seq_lens,
        "sparse_bt": out[0],
        "sparse_ctx": out[1],
    }


_MEMO = _replay.Memo("build_sparse_block_table_decode")
"""Repeated call shapes of :func:`build_sparse_block_table_decode`: checked once, the launch
replayed on a GPU (:class:`mm3lab._replay.Memo`)."""


def build_sparse_block_table_prefill(
    topk_idx: torch.Tensor,
    block_table: torch.Tensor,
    query_req_id: torch.Tensor,
    query_abs_pos: torch.Tensor,
    block_page_stride: int = PAGES_PER_SPARSE_BLOCK,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse block table of prefill rows (each with its own request and position), one launch.

    Args:
        topk_idx: ``[H, N, K]`` int32/int64 selected logical blocks (``-1`` = padding), any strides.
        block_table: ``[B, M]`` int32/int64 logical -> physical block of each request.
        query_req_id: ``[N]`` int32/int64 request of each row (ignored on padded rows).
        query_abs_pos: ``[N]`` int32/int64 absolute position of each row; negative = padded row.
        block_page_stride: 8 (dense planes) or 16 (packed sides).
        out: optional ``(sparse_bt, sparse_ctx)`` contiguous int32 buffers, written and returned.
    Returns:
        ``sparse_bt [H, N, K * 8]`` int32, ``sparse_ctx [H, N]`` int32, as the decode table.
    Raises:
        TypeError / ValueError: as the decode table; with validation on, a request id
        outside ``[0, B)`` on a row with ``p >= 0`` (names ``query_req_id`` and the row),
        a position ``>= M * 128`` (names ``query_abs_pos``) or a block id ``>= M``. With
        validation off a row whose request id is out of range is treated as padded, and
        a block past the table as not selected.
    """
    check_prefill(topk_idx, block_table, query_req_id, query_abs_pos, block_page_stride, out)
    return _build(
        "build_sparse_block_table_prefill", topk_idx, block_table, (query_req_id, query_abs_pos), block_page_stride, out
    )
