"""What the selection keeps: :func:`attention_weights` (the dense softmax weight of
each token) and :func:`selected_mass` (the share of it in the selected blocks).
"""

from __future__ import annotations

import torch

from ..constants import SPARSE_BLOCK_SIZE

__all__ = ["attention_weights", "selected_mass"]


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
    scale = d**-0.5 if scale is None else float(scale)
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
