"""Why tiling a prefill chunk pays: which blocks each query tile selects, and the bytes read.

* :func:`tile_block_counts`: the query-tile x block matrix, "how many queries of the
  tile chose this block" (after SPEC section 3's rules: causal, ``-1`` padding and
  duplicates drop out);
* :func:`bytes_per_tile`: K/V bytes each tile reads with the per-token kernel (every
  row reads its own blocks) and with the tiled kernel (every token some row of the
  tile attends, read once);
* :func:`plot_prefill_tiles`: both side by side, one figure.

Counts come from the selection alone (no kernel runs), so the picture is the same on
any machine. Artists carry a ``gid`` (``"tile-counts"``, ``"bytes-per-token"``,
``"bytes-tiled"``) so tests can find them. :func:`selection_scores` and
:func:`example_selection` draw the benchmark's three selection workloads.
"""

from __future__ import annotations

import numpy as np
import torch
from matplotlib.figure import Figure

from ..constants import SPARSE_BLOCK_SIZE

__all__ = [
    "SELECTIONS",
    "bytes_per_tile",
    "bytes_text",
    "example_selection",
    "plot_prefill_tiles",
    "selection_scores",
    "tile_block_counts",
    "visible_tokens",
]

SELECTIONS = ("random", "tile", "synthetic")
"""Selection workloads of :func:`selection_scores` (and of the prefill benchmark)."""


def selection_scores(kind: str, chunk: int, context: int, *, hkv: int = 4, seed: int = 1, device="cpu") -> torch.Tensor:
    """``[Hkv, chunk, blocks]`` block scores of a prefill chunk's rows (the last ``chunk`` positions).

    ``kind`` (:data:`SELECTIONS`): ``"random"`` independent per row; ``"tile"`` one draw per
    128-row tile, shared by its rows; ``"synthetic"`` sink (block 0) + two needle blocks per
    head + recency, plus content noise drifting along the chunk and a little per-row jitter
    (the structure of :mod:`mm3lab.synthetic`'s patterns). Every row's own block scores
    highest; blocks past it score -1. Drawn on the CPU from one seeded generator.
    """
    g = torch.Generator().manual_seed(seed)
    nblocks = context // SPARSE_BLOCK_SIZE
    pos = torch.arange(context - chunk, context)
    blk = torch.arange(nblocks)
    self_blk = pos // SPARSE_BLOCK_SIZE
    if kind == "random":
        scores = torch.rand(hkv, chunk, nblocks, generator=g)
    elif kind == "tile":
        tiles = -(-chunk // SPARSE_BLOCK_SIZE)
        scores = torch.rand(hkv, tiles, nblocks, generator=g).repeat_interleave(SPARSE_BLOCK_SIZE, 1)[:, :chunk]
    elif kind == "synthetic":
        dist = (self_blk[:, None] - blk[None, :]).clamp(min=0).float()
        scores = 2.0 * torch.exp(-dist / 3.0).expand(hkv, chunk, nblocks).clone()  # recency
        scores[..., 0] += 3.0  # sink
        needles = torch.randint(1, nblocks - chunk // SPARSE_BLOCK_SIZE, (hkv, 2), generator=g)
        scores.scatter_add_(2, needles[:, None, :].expand(hkv, chunk, 2), torch.full((hkv, chunk, 2), 2.5))
        tiles = -(-chunk // SPARSE_BLOCK_SIZE)  # content noise that drifts along the chunk, plus per-token jitter
        drift = torch.rand(hkv, tiles + 1, nblocks, generator=g)
        w = (torch.arange(chunk) % SPARSE_BLOCK_SIZE / SPARSE_BLOCK_SIZE).view(1, -1, 1)
        idx = torch.arange(chunk) // SPARSE_BLOCK_SIZE
        scores += 0.8 * ((1 - w) * drift[:, idx] + w * drift[:, idx + 1])
        scores += 0.1 * torch.rand(hkv, chunk, nblocks, generator=g)
    else:
        raise ValueError(f"selection: expected one of {SELECTIONS}, got {kind!r}")
    scores = scores.masked_fill(blk[None, None, :] > self_blk[None, :, None], -1.0)
    scores.scatter_(2, self_blk.view(1, -1, 1).expand(hkv, -1, 1), 10.0)  # the forced local block
    return scores.to(device)


def example_selection(
    kind: str = "synthetic", chunk: int = 1024, context: int = 8192, *, topk: int = 16, hkv: int = 4, seed: int = 1
):
    """``(topk_idx [Hkv, chunk, topk] int32, query_abs_pos [chunk])`` of a chunk ending at ``context``."""
    topk_idx = selection_scores(kind, chunk, context, hkv=hkv, seed=seed).topk(topk, dim=-1).indices
    return topk_idx.to(torch.int32), torch.arange(context - chunk, context)


def bytes_text(
    topk_idx: torch.Tensor,
    query_abs_pos: torch.Tensor,
    tile: int = SPARSE_BLOCK_SIZE,
    head_dim: int = 128,
    elem_bytes: int = 2,
) -> str:
    """K + V bytes the chunk reads, all KV heads, per-token against tiled (exact integers, in MB)."""
    per_token = tiled = 0
    for h in range(topk_idx.shape[0]):
        p, t = bytes_per_tile(topk_idx, query_abs_pos, h, tile, head_dim, elem_bytes)
        per_token, tiled = per_token + int(p.sum()), tiled + int(t.sum())
    return (
        f"K+V read by the chunk: per-token kernel {per_token / 1e6:.1f} MB, tiled kernel "
        f"({tile}-row tiles) {tiled / 1e6:.1f} MB, {per_token / max(tiled, 1):.2f}x less"
    )


def visible_tokens(topk_idx: torch.Tensor, query_abs_pos: torch.Tensor, head: int = 0) -> np.ndarray:
    """``[N, blocks]`` tokens of each block that row ``n`` attends (0 where not selected).

    A selected block ``b <= p // 128`` shows ``min(128, p + 1 - 128 b)`` tokens; a block
    named twice counts once; padded rows (``p < 0``) attend nothing.
    """
    sel = topk_idx[head].long().cpu()
    pos = query_abs_pos.long().cpu()
    n = sel.shape[0]
    blocks = int(pos.max().clamp(min=0)) // SPARSE_BLOCK_SIZE + 1 if n else 1
    ok = (sel >= 0) & (pos[:, None] >= 0) & (sel <= (pos // SPARSE_BLOCK_SIZE)[:, None])
    chosen = torch.zeros(n, blocks + 1, dtype=torch.bool)
    chosen.scatter_(1, torch.where(ok, sel, blocks), True)
    chosen = chosen[:, :blocks]
    start = torch.arange(blocks) * SPARSE_BLOCK_SIZE
    tokens = (pos[:, None] + 1 - start[None, :]).clamp(0, SPARSE_BLOCK_SIZE)
    return (tokens * chosen).numpy()


def tile_block_counts(
    topk_idx: torch.Tensor, query_abs_pos: torch.Tensor, head: int = 0, tile: int = SPARSE_BLOCK_SIZE
) -> np.ndarray:
    """``[tiles, blocks]``: how many of the tile's ``tile`` consecutive rows chose each block."""
    return _in_tiles(visible_tokens(topk_idx, query_abs_pos, head) > 0, tile).sum(1)


def _in_tiles(rows: np.ndarray, tile: int) -> np.ndarray:
    """``rows [N, blocks]`` as ``[tiles, tile, blocks]``, the last tile padded with zero rows."""
    tiles = -(-rows.shape[0] // tile)
    padded = np.zeros((tiles * tile, rows.shape[1]), dtype=rows.dtype)
    padded[: rows.shape[0]] = rows
    return padded.reshape(tiles, tile, -1)


def bytes_per_tile(
    topk_idx: torch.Tensor,
    query_abs_pos: torch.Tensor,
    head: int = 0,
    tile: int = SPARSE_BLOCK_SIZE,
    head_dim: int = 128,
    elem_bytes: int = 2,
):
    """``(per_token [tiles], tiled [tiles])`` K + V bytes one KV head's tile reads.

    Per-token kernel: each row reads the tokens it attends. Tiled kernel: each token
    that at least one row of the tile attends is read once.
    """
    per_token = _in_tiles(visible_tokens(topk_idx, query_abs_pos, head).astype(np.int64), tile)
    token_bytes = 2 * head_dim * elem_bytes
    return per_token.sum((1, 2)) * token_bytes, per_token.max(1).sum(1) * token_bytes


def plot_prefill_tiles(
    topk_idx: torch.Tensor,
    query_abs_pos: torch.Tensor,
    head: int = 0,
    tile: int = SPARSE_BLOCK_SIZE,
    title: str | None = None,
) -> Figure:
    """Left: query tiles x blocks coloured by how many queries of the tile chose the block.
    Right: MB read per tile by the per-token kernel and by the tiled kernel, from
    :func:`bytes_per_tile` at its defaults (head_dim 128, bf16: the model's)."""
    counts = tile_block_counts(topk_idx, query_abs_pos, head, tile)
    per_token, tiled = bytes_per_tile(topk_idx, query_abs_pos, head, tile)
    fig = Figure(figsize=(11.0, 3.8), layout="constrained")
    ax, bx = fig.subplots(1, 2, width_ratios=[2.2, 1.0])
    masked = np.ma.masked_equal(counts, 0)
    im = ax.imshow(masked, aspect="auto", interpolation="nearest", cmap="viridis", vmin=1, vmax=tile)
    im.set_gid("tile-counts")
    fig.colorbar(im, ax=ax, label=f"queries of the tile (of {tile}) choosing the block")
    ax.set_xlabel("KV block (128 tokens)")
    ax.set_ylabel(f"query tile ({tile} rows)")
    ax.set_title(title or f"selections of KV head {head}, per query tile")
    y = np.arange(len(per_token))
    bx.barh(y - 0.2, per_token / 1e6, height=0.4, color="tab:red", label="per-token kernel", gid="bytes-per-token")
    bx.barh(y + 0.2, tiled / 1e6, height=0.4, color="tab:blue", label="tiled kernel", gid="bytes-tiled")
    bx.invert_yaxis()
    bx.set_xlabel("K + V read per tile (MB)")
    bx.set_ylabel(f"query tile ({tile} rows)")
    ratio = per_token.sum() / max(tiled.sum(), 1)
    bx.set_title(f"bytes read: tiled reads {ratio:.1f}x less")
    bx.legend(loc="lower right", fontsize=8)
    return fig
