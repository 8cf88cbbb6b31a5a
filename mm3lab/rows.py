"""The row rule (SPEC 2): which request and position each query row stands for, said once.

Decode rows: row ``n = r * dql + i`` is query ``i`` of request ``r``, at position
``p = seq_lens[r] - dql + i``. Prefill rows carry their own ``query_req_id[n]`` and
``query_abs_pos[n]``. For both, a negative ``p`` is a padded row, and a request id
outside ``[0, B)`` makes the row padded too.

:func:`decode_rows` is the rule on the host (PyTorch), :func:`row_request_position`
the same rule inside a Triton kernel; the kernels, checks and references all use one
of the two.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import check_index, check_int

__all__ = ["decode_rows", "decode_query_rows", "row_request_position"]


def decode_rows(seq_lens: torch.Tensor, decode_query_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(request [B * dql], p [B * dql])`` int64 of the decode rows, ``p`` as the rule gives it (no clamping)."""
    dql = decode_query_len
    rows = torch.arange(seq_lens.shape[0] * dql, device=seq_lens.device)
    req = rows // dql
    return req, seq_lens.long()[req] - dql + rows % dql


def decode_query_rows(seq_lens: torch.Tensor, decode_query_len: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Request and position of every decode row (:func:`decode_rows`), as prefill rows take them.

    Args:
        seq_lens: ``[B]`` tokens per request, the decode queries included.
        decode_query_len: query tokens per request (``> 1`` for speculative decode).
    Returns:
        ``(query_req_id [B * dql], query_abs_pos [B * dql])`` int32; a padded row has ``p = -1``.
    """
    check_index("seq_lens", seq_lens, ndim=1)
    req, pos = decode_rows(seq_lens, check_int("decode_query_len", decode_query_len, minimum=1))
    return req.to(torch.int32), pos.clamp(min=-1).to(torch.int32)


@triton.jit
def row_request_position(n, live, req_ptr, stride_r, pos_ptr, stride_p, B, DQL, PREFILL: tl.constexpr):
    """``(request, p)`` int64 of rows ``n`` (scalar or vector) where ``live``; ``p = -1`` for a padded row.

    ``PREFILL``: ``req_ptr`` / ``pos_ptr`` are ``query_req_id`` / ``query_abs_pos``; else ``req_ptr`` is
    ``seq_lens`` and ``DQL`` the decode query length (``pos_ptr`` unused). A request id outside
    ``[0, B)`` gives ``p = -1`` and request 0 (a row that reads nothing).
    """
    if PREFILL:
        req = tl.load(req_ptr + n * stride_r, mask=live, other=-1).to(tl.int64)
        p = tl.load(pos_ptr + n * stride_p, mask=live, other=-1).to(tl.int64)
    else:
        req = (n // DQL).to(tl.int64)
        p = tl.load(req_ptr + req * stride_r, mask=live, other=0).to(tl.int64) - DQL + n % DQL
    in_range = (req >= 0) & (req < B)
    p = tl.where(live & in_range, p, -1)
    req = tl.where(in_range, req, 0)
    return req, p
