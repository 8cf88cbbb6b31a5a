"""What mm3lab's kernels are compared with, each measured in the same run.

* ``torch_*``: the same step written as a chain of vectorized PyTorch ops, the
  way a user without a custom kernel would write it (mm3lab's own references
  loop over rows for readability and are far too slow to time at these sizes).
* ``naive_sparse_attention``: gather the selected K/V tokens, then
  ``scaled_dot_product_attention`` with a length mask.
* ``dense_sdpa_decode``: SDPA over the whole context (no selection).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mm3lab.constants import PAGE_SIZE, PAGES_PER_SPARSE_BLOCK, SPARSE_BLOCK_SIZE


def torch_block_table_decode(topk_idx, block_table, seq_lens, decode_query_len=1, block_page_stride=8):
    """Sparse block table (SPEC section 3) as PyTorch ops over all rows at once."""
    h, n, k = topk_idx.shape
    dev = topk_idx.device
    rows = torch.arange(n, device=dev)
    req = rows // decode_query_len
    p = (seq_lens.long()[req] - decode_query_len + rows % decode_query_len).view(1, n, 1)  # [1, N, 1]
    causal_len = (p + 1).clamp(min=0)
    self_blk = torch.div(p, SPARSE_BLOCK_SIZE, rounding_mode="floor")
    blk = topk_idx.long()
    width = block_table.shape[1]
    valid = (causal_len > 0) & (blk >= 0) & (blk <= self_blk) & (blk < width)
    # drop duplicates: keep the first occurrence
    same = blk.unsqueeze(-1) == blk.unsqueeze(-2)  # [H, N, K, K]
    earlier = torch.ones(k, k, dtype=torch.bool, device=dev).tril(-1)
    dup = (same & earlier & valid.unsqueeze(-2)).any(-1)
    valid &= ~dup
    is_tail = valid & (blk == self_blk)
    full = valid & ~is_tail
    # order: full blocks in selection order, then the tail
    order_key = torch.where(full, torch.arange(k, device=dev), torch.where(is_tail, k, 2 * k))
    order = order_key.argsort(dim=-1, stable=True)
    sel = torch.gather(blk, -1, order)
    sel_valid = torch.gather(valid, -1, order)
    phys = torch.gather(block_table.long()[req].unsqueeze(0).expand(h, -1, -1), -1, sel.clamp(min=0, max=width - 1))
    pages = phys.unsqueeze(-1) * block_page_stride + torch.arange(PAGES_PER_SPARSE_BLOCK, device=dev)
    pages = torch.where(sel_valid.unsqueeze(-1), pages, 0).reshape(h, n, k * PAGES_PER_SPARSE_BLOCK)
    nfull = full.sum(-1)
    has_tail = is_tail.any(-1)
    nvalid = valid.sum(-1)
    causal_len, self_blk = causal_len.view(1, n), self_blk.view(1, n)
    ctx = torch.where(
        has_tail,
        nfull * SPARSE_BLOCK_SIZE + (causal_len - self_blk * SPARSE_BLOCK_SIZE),
        torch.minimum(nvalid * SPARSE_BLOCK_SIZE, causal_len),
    )
    return pages.to(torch.int32), ctx.to(torch.int32)


def naive_sparse_attention(q, k_cache, v_cache, sparse_bt, sparse_ctx, scale=None):
    """Gather every row's selected K/V tokens, then SDPA with a length mask.

    Args:
        q: ``[N, Hq, D]``; k_cache, v_cache: page-16 views; sparse_bt ``[Hkv, N, W]``; sparse_ctx ``[Hkv, N]``.
    """
    n, hq, d = q.shape
    hkv, _, width = sparse_bt.shape
    g = hq // hkv
    tokens = width * PAGE_SIZE
    i = torch.arange(tokens, device=q.device)
    page = sparse_bt.long()[..., i // PAGE_SIZE]  # [Hkv, N, T]
    row = i % PAGE_SIZE
    head = torch.arange(hkv, device=q.device).view(hkv, 1, 1)
    k = k_cache[page, row, head]  # [Hkv, N, T, D]
    v = v_cache[page, row, head]
    mask = i.view(1, 1, -1) < sparse_ctx.unsqueeze(-1)  # [Hkv, N, T]
    qh = q.view(n, hkv, g, d).permute(1, 0, 2, 3)  # [Hkv, N, G, D]
    out = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask.unsqueeze(2), scale=scale)
    out = torch.nan_to_num(out)  # rows with ctx == 0
    return out.permute(1, 0, 2, 3).reshape(n, hq, d)


def dense_sdpa_decode(q, k, v):
    """SDPA over the whole context. q ``[B, Hq, 1, D]``, k/v ``[B, Hkv, S, D]`` (GQA)."""
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def torch_index_scores(index_q, index_cache, block_table, seq_lens, max_blocks):
    """Block scores for one decode token per request as PyTorch ops.

    Args:
        index_q: ``[B, H, Di]``; index_cache ``[num_blocks, 128, Di]``; block_table ``[B, M]``.
    Returns:
        ``[H, B, max_blocks]`` float32, ``-inf`` past the query's block.
    """
    keys = index_cache[block_table[:, :max_blocks].long()]  # [B, nb, 128, Di]
    dots = torch.einsum("bhd,bntd->bhnt", index_q, keys).float()  # [B, H, nb, 128]
    pos = torch.arange(max_blocks * SPARSE_BLOCK_SIZE, device=index_q.device).view(max_blocks, SPARSE_BLOCK_SIZE)
    visible = pos.unsqueeze(0) < seq_lens.view(-1, 1, 1)  # [B, nb, 128]
    dots = dots.masked_fill(~visible.unsqueeze(1), float("-inf"))
    return dots.amax(-1).permute(1, 0, 2)
