"""Conversion between mm3lab selections and the official MiniMax MSA kernels' ``topk_indices`` (SPEC section 10).

mm3lab's indexer returns ``topk_idx [H, N, K]`` (index head = KV head first), ids
by descending score, the forced local block first, ``-1`` past
``min(K, p // 128 + 1)``. The official decode attention takes the transposed
``[N, Hkv, K]`` with a different order. What this module relies on was checked
against the public MiniMax-AI/MSA repository (snapshot of commit ``3b9fed0``):

* ``inference/msa_v1/attention/decode/_flashinfer_interface.py`` (``plan``):
  ``topk_indices`` is int32, contiguous, shape ``[batch * q_len_per_req,
  num_kv_heads, topk]`` with ``1 <= topk <= 16`` (``_MAX_TOPK = 16``); pages are
  ``_PAGE_SIZE = 128`` tokens, head dim 128, 8 or 16 query heads per KV head.
* ``inference/msa_v1/attention/decode/_flashinfer.py`` (``_build_sparse_metadata``):
  row ``n = r * q_len + i`` is at ``p = seq_lens[r] - q_len + i`` (``seq_lens``
  includes the query chunk; a negative ``p`` is rejected); with
  ``local = p // 128`` the valid entries are exactly the first
  ``min(local + 1, topk)`` slots, all non-negative; the rest is a ``-1``
  suffix; the LAST valid entry is the local page; the earlier ("historical")
  entries are below it and distinct, in no required order (the check does not
  order them: they are an unordered set). Each row attends
  ``(valid - 1) * 128 + p % 128 + 1`` tokens.
* ``inference/msa_v1/indexer/decode/_interface.py`` and
  ``inference/msa_v1/indexer/_common/topk_select/interface.py``: the official
  indexer writes int32 ``[num_index_heads, batch * Q, 16]`` (the head-first
  layout of mm3lab's ``topk_idx``), "15 historical columns and one forced tail"
  per row, at most 8192 pages (1M tokens) per row.

So :func:`to_msa_topk_indices` transposes and moves the local block to the end
of the valid prefix (historical ids keep their order), and
:func:`from_msa_topk_indices` transposes back with the local block first; the
historical order of an official selection carries no score, so only the set is
defined on the way back (:func:`same_selection` compares sets). Padded mm3lab
rows (``p < 0``), which the official kernels do not accept, map to all ``-1``.
"""

from __future__ import annotations

import torch

from .._checks import check_index, check_int, check_same_device
from ..constants import SPARSE_BLOCK_SIZE
from ..rows import decode_rows

MSA_MAX_TOPK = 16
"""The official kernels' largest ``topk`` (``_MAX_TOPK``)."""

MSA_PAGE_SIZE = SPARSE_BLOCK_SIZE
"""The official kernels' page: 128 tokens, mm3lab's sparse block."""

__all__ = [
    "MSA_MAX_TOPK",
    "MSA_PAGE_SIZE",
    "decode_positions",
    "from_msa_topk_indices",
    "same_selection",
    "to_msa_topk_indices",
]


def decode_positions(seq_lens: torch.Tensor, q_len: int) -> torch.Tensor:
    """``p`` of every decode row ``n = r * q_len + i``: ``seq_lens[r] - q_len + i``, int64 ``[B * q_len]``."""
    check_index("seq_lens", seq_lens, ndim=1)
    return decode_rows(seq_lens, check_int("q_len", q_len, minimum=1))[1]


def _local_last(sel: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``sel [N, H, K]`` with each row's local block ``p // 128`` moved to the end of its valid prefix."""
    n, h, k = sel.shape
    local = torch.where(p >= 0, torch.div(p, SPARSE_BLOCK_SIZE, rounding_mode="floor"), -2)[:, None, None]
    valid = (sel >= 0).sum(-1, keepdim=True)  # [N, H, 1]
    slots = torch.arange(k, device=sel.device)
    is_local = sel == local
    # stable order: historical ids (valid, not local) by slot, then the local block, then -1 padding
    rank = torch.where(sel < 0, 2 * k + slots, torch.where(is_local, k + slots, slots))
    order = torch.argsort(rank, dim=-1, stable=True)
    out = torch.gather(sel, -1, order)
    if bool(((is_local.sum(-1, keepdim=True) != 1) & (valid > 0)).any()):
        bad = torch.nonzero(((is_local.sum(-1, keepdim=True) != 1) & (valid > 0)).squeeze(-1))[0].tolist()
        raise ValueError(
            f"topk_idx: (head {bad[1]}, row {bad[0]}) does not select its local block {int(local.view(-1)[bad[0]])} "
            "exactly once; the official kernels need it (select with local_blocks >= 1)"
        )
    return out


def to_msa_topk_indices(topk_idx: torch.Tensor, seq_lens: torch.Tensor, q_len: int = 1) -> torch.Tensor:
    """mm3lab decode selections ``[H, B * q_len, K]`` -> the official ``topk_indices [B * q_len, H, K]`` int32.

    Every valid row must hold its local block ``p // 128`` (mm3lab forces it with
    ``local_blocks >= 1``) and exactly ``min(K, p // 128 + 1)`` ids, as mm3lab's
    top-k gives; ``K <= 16``. The local block moves to the last valid slot, the
    other ids keep their order, ``-1`` pads. Rows with ``p < 0`` become all ``-1``.

    Raises:
        ValueError: ``K > 16``, a row count other than ``B * q_len``, a row whose count of
            ids differs from ``min(K, p // 128 + 1)`` or that lacks its local block.
    """
    check_index("topk_idx", topk_idx, ndim=3)
    h, n, k = topk_idx.shape
    if k > MSA_MAX_TOPK:
        raise ValueError(f"topk_idx: the official kernels take at most {MSA_MAX_TOPK} blocks per row, got K = {k}")
    p = decode_positions(seq_lens, q_len)
    check_same_device(topk_idx=topk_idx, seq_lens=seq_lens)
    if p.shape[0] != n:
        raise ValueError(f"topk_idx: expected B * q_len = {p.shape[0]} rows, got {n}")
    sel = topk_idx.permute(1, 0, 2).to(torch.int32)
    sel = torch.where((p >= 0)[:, None, None], sel, -1)
    want = torch.where(p >= 0, torch.clamp(torch.div(p, SPARSE_BLOCK_SIZE, rounding_mode="floor") + 1, max=k), 0)
    count = (sel >= 0).sum(-1)  # [N, H]
    bad = torch.nonzero(count != want[:, None])
    if bad.numel():
        row, head = bad[0].tolist()
        raise ValueError(
            f"topk_idx: (head {head}, row {row}) selects {int(count[row, head])} blocks, the official kernels "
            f"need min(K, p // 128 + 1) = {int(want[row])} (p = {int(p[row])})"
        )
    return _local_last(sel, p).contiguous()


def from_msa_topk_indices(topk_indices: torch.Tensor) -> torch.Tensor:
    """The official ``topk_indices [N, Hkv, K]`` -> mm3lab's ``[Hkv, N, K]`` int32, local block first.

    The official rows end their valid prefix with the local block; mm3lab's order
    puts it first (its forced score is the highest). The historical ids keep their
    official order (it carries no score); ``-1`` stays a suffix.
    """
    check_index("topk_indices", topk_indices, ndim=3)
    n, h, k = topk_indices.shape
    sel = topk_indices.to(torch.int32)
    valid = (sel >= 0).sum(-1, keepdim=True)
    slots = torch.arange(k, device=sel.device)
    is_local = (slots == valid - 1) & (valid > 0)
    rank = torch.where(sel < 0, 2 * k + slots, torch.where(is_local, -1, slots))
    out = torch.gather(sel, -1, torch.argsort(rank, dim=-1, stable=True))
    return out.permute(1, 0, 2).contiguous()


def same_selection(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per row, whether two ``[..., K]`` selections hold the same set of ids (``-1`` ignored): bool ``[...]``."""
    check_index("a", a)
    check_index("b", b)
    if a.shape != b.shape:
        raise ValueError(f"a and b: shapes differ, {tuple(a.shape)} and {tuple(b.shape)}")
    big = torch.iinfo(torch.int64).max
    sa = torch.sort(torch.where(a >= 0, a.to(torch.int64), big), dim=-1).values
    sb = torch.sort(torch.where(b >= 0, b.to(torch.int64), big), dim=-1).values
    return (sa == sb).all(-1)
