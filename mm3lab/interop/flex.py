"""MSA selections as PyTorch FlexAttention block masks (SPEC sections 5 and 10).

:func:`block_mask` turns a top-k selection (``topk_idx [Hkv, N, topk]`` of logical
128-token blocks, with each row's request and absolute position) into a
``torch.nn.attention.flex_attention.BlockMask`` whose ``mask_mod`` is exactly SPEC
section 5's mask: query row ``n``, query head ``hq`` (KV head ``hq // G``) sees
token ``s`` of its own request when ``s <= p`` and ``s // 128`` is one of the
row's selected blocks; a padded row (``p < 0``) sees nothing; ``-1`` entries and
blocks past the position select nothing; a block named twice counts once.

FlexAttention has one key sequence, so the requests' sequences are laid side by
side, each starting on a 128-token boundary (:func:`kv_layout`, :func:`pack_kv`):
request ``r``'s block ``b`` is key block ``block_offset[r] + b``. The block-level
part of the mask (which key blocks a 128-query tile touches at all, and which it
sees entirely) is built directly with ``BlockMask.from_kv_blocks``, so building
it costs block-level work, not ``N x L`` calls of ``mask_mod``.

Fully masked rows (padded rows, ``ctx`` 0): ``sparse_attention`` returns zeros and
``lse = -inf``; FlexAttention's output for such a row is also zeros, and its
log-sum-exp ``-inf``. :func:`flex_sparse_attention` returns them the same way, and
the tests check both.
"""

from __future__ import annotations

import math

import torch

from ..constants import SPARSE_BLOCK_SIZE
from ..rows import decode_rows

__all__ = ["block_mask", "block_mask_decode", "flex_sparse_attention", "kv_layout", "pack_kv", "selected_blocks"]


def kv_layout(seq_lens) -> tuple[torch.Tensor, int]:
    """``(block_offset [B] int64, kv_len)``: where each request's blocks start in the packed key sequence."""
    seq_lens = torch.as_tensor(seq_lens, dtype=torch.int64).cpu()
    blocks = (seq_lens + SPARSE_BLOCK_SIZE - 1) // SPARSE_BLOCK_SIZE
    offset = torch.cumsum(blocks, 0) - blocks
    return offset, int(blocks.sum()) * SPARSE_BLOCK_SIZE


def pack_kv(x: torch.Tensor, seq_lens) -> torch.Tensor:
    """``[B, S, Hkv, D]`` per-request sequences -> ``[1, Hkv, kv_len, D]`` packed on 128-token boundaries."""
    offset, kv_len = kv_layout(seq_lens)
    _, _, hkv, d = x.shape
    packed = x.new_zeros(1, hkv, max(kv_len, SPARSE_BLOCK_SIZE), d)
    for r, length in enumerate(torch.as_tensor(seq_lens).tolist()):
        start = int(offset[r]) * SPARSE_BLOCK_SIZE
        packed[0, :, start : start + length] = x[r, :length].transpose(0, 1)
    return packed


def selected_blocks(topk_idx, query_req_id, query_abs_pos, seq_lens) -> torch.Tensor:
    """``[Hkv, N, kv_blocks]`` bool: key block ``j`` is selected and causally reachable for row ``n``."""
    hkv, n, _ = topk_idx.shape
    device = topk_idx.device
    offset, kv_len = kv_layout(seq_lens)
    offset = offset.to(device)
    kv_blocks = max(kv_len // SPARSE_BLOCK_SIZE, 1)
    req = query_req_id.to(device=device, dtype=torch.int64)
    pos = query_abs_pos.to(device=device, dtype=torch.int64)
    blk = topk_idx.to(torch.int64)
    ok = (blk >= 0) & (pos >= 0)[None, :, None] & (blk <= (pos // SPARSE_BLOCK_SIZE)[None, :, None])
    req_blocks = (
        (torch.as_tensor(seq_lens, device=device).to(torch.int64) + SPARSE_BLOCK_SIZE - 1) // SPARSE_BLOCK_SIZE
    )[req]
    ok &= blk < req_blocks[None, :, None]
    target = torch.where(ok, offset[req][None, :, None] + blk, kv_blocks)  # kv_blocks: a dump column
    sel = torch.zeros(hkv, n, kv_blocks + 1, dtype=torch.bool, device=device)
    sel.scatter_(2, target, True)
    return sel[..., :kv_blocks]


def block_mask(
    topk_idx: torch.Tensor,
    query_req_id: torch.Tensor,
    query_abs_pos: torch.Tensor,
    seq_lens,
    *,
    num_q_heads: int,
):
    """A FlexAttention ``BlockMask`` (128 x 128 blocks) with SPEC section 5's mask.

    Args:
        topk_idx: ``[Hkv, N, topk]`` selected logical blocks per (KV head, row), ``-1`` padded.
        query_req_id: ``[N]`` request of each row.
        query_abs_pos: ``[N]`` absolute position of each row in its request (``< 0``: padded row).
        seq_lens: ``[B]`` tokens of each request (sets the packed key layout, :func:`kv_layout`).
        num_q_heads: ``Hq`` (a multiple of ``Hkv``; query head ``hq`` uses KV head ``hq // (Hq // Hkv)``).
    Returns:
        ``BlockMask`` for ``flex_attention(q [1, Hq, N, D], k [1, Hkv, kv_len, D], ..., enable_gqa=True)``.
    """
    from torch.nn.attention.flex_attention import BlockMask

    hkv, n, _ = topk_idx.shape
    if num_q_heads % hkv:
        raise ValueError(f"num_q_heads: {num_q_heads} is not a multiple of topk_idx's {hkv} KV heads")
    group = num_q_heads // hkv
    device = topk_idx.device
    offset, kv_len = kv_layout(seq_lens)
    offset = offset.to(device)
    kv_len = max(kv_len, SPARSE_BLOCK_SIZE)
    sel = selected_blocks(topk_idx, query_req_id, query_abs_pos, seq_lens)  # [Hkv, N, KB]
    kb = sel.shape[-1]
    req = query_req_id.to(device=device, dtype=torch.int64)
    pos = query_abs_pos.to(device=device, dtype=torch.int64)
    # a selected block is seen entirely by a row when its last token is causal for the row
    last_tok = (torch.arange(kb, device=device)[None, :] - offset[req][:, None] + 1) * SPARSE_BLOCK_SIZE - 1
    full_row = sel & (last_tok <= pos[:, None])[None]
    qb = math.ceil(n / SPARSE_BLOCK_SIZE)
    pad = qb * SPARSE_BLOCK_SIZE - n
    any_sel = torch.nn.functional.pad(sel, (0, 0, 0, pad), value=False).view(hkv, qb, SPARSE_BLOCK_SIZE, kb).any(2)
    full = torch.nn.functional.pad(full_row, (0, 0, 0, pad), value=True).view(hkv, qb, SPARSE_BLOCK_SIZE, kb).all(2)
    full &= any_sel
    partial = any_sel & ~full

    def lists(m):  # [Hkv, QB, KB] bool -> counts [1, Hq, QB], indices [1, Hq, QB, KB] (selected first)
        m = m.repeat_interleave(group, dim=0).unsqueeze(0)
        counts = m.sum(-1, dtype=torch.int32)
        order = torch.argsort((~m).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return counts.contiguous(), order.contiguous()

    sel_i = sel.to(torch.int8)
    req_of_block = torch.full((kb,), -1, dtype=torch.int64, device=device)
    lens = torch.as_tensor(seq_lens, dtype=torch.int64).to(device)
    for r in range(len(lens)):  # host loop over requests only
        blocks = int((int(lens[r]) + SPARSE_BLOCK_SIZE - 1) // SPARSE_BLOCK_SIZE)
        req_of_block[int(offset[r]) : int(offset[r]) + blocks] = r

    def mask_mod(b, h, q_idx, kv_idx):
        kblk = kv_idx // SPARSE_BLOCK_SIZE
        p = pos[q_idx]
        same = req_of_block[kblk] == req[q_idx]
        causal = kv_idx - offset[req[q_idx]] * SPARSE_BLOCK_SIZE <= p
        return (sel_i[h // group, q_idx, kblk] > 0) & same & causal & (p >= 0)

    kv_num, kv_idx = lists(partial)
    full_num, full_idx = lists(full)
    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=SPARSE_BLOCK_SIZE, mask_mod=mask_mod, seq_lengths=(n, kv_len)
    )


def block_mask_decode(topk_idx: torch.Tensor, seq_lens, *, num_q_heads: int, decode_query_len: int = 1):
    """The decode form: rows are the last ``decode_query_len`` positions of each request, request-major.

    ``topk_idx [Hkv, B * decode_query_len, topk]``; rows by SPEC 2's decode row rule (:mod:`mm3lab.rows`).
    """
    lens = torch.as_tensor(seq_lens, dtype=torch.int64).to(topk_idx.device)
    req, pos = decode_rows(lens, decode_query_len)
    pos = torch.where(pos < 0, -1, pos)
    return block_mask(topk_idx, req, pos, seq_lens, num_q_heads=num_q_heads)


def flex_sparse_attention(q, key, value, mask, seq_lens, scale=None, *, return_lse=False, compiled_fn=None):
    """``flex_attention`` with a :func:`block_mask`: ``q [N, Hq, D]``, ``key/value [B, S, Hkv, D]``.

    Returns ``out [N, Hq, D]`` (and ``lse [N, Hq]``, natural log, ``-inf`` for fully masked rows),
    the layout ``sparse_attention`` returns. ``compiled_fn``: e.g. ``torch.compile(flex_attention)``.
    """
    from torch.nn.attention.flex_attention import flex_attention

    fn = compiled_fn or flex_attention
    qf = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, N, D]
    k = pack_kv(key, seq_lens)
    v = pack_kv(value, seq_lens)
    try:
        from torch.nn.attention.flex_attention import AuxRequest
    except ImportError:  # older torch: the lse flag
        out, lse = fn(qf, k, v, block_mask=mask, scale=scale, enable_gqa=True, return_lse=True)
    else:
        out, aux = fn(qf, k, v, block_mask=mask, scale=scale, enable_gqa=True, return_aux=AuxRequest(lse=True))
        lse = aux.lse
    out = out[0].transpose(0, 1)
    lse = lse[0].transpose(0, 1).float()
    lse = torch.where(torch.isfinite(lse), lse, float("-inf"))
    return (out, lse) if return_lse else out
