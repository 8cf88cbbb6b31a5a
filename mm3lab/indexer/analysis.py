"""What the indexer's choice is worth: scores and selections over a whole sequence, and the
share of a full softmax's attention mass that the selected blocks hold.

* :func:`select_for_sequence` runs the real entry points (:func:`mm3lab.insert_index_cache`,
  :func:`mm3lab.index_scores_prefill`, :func:`mm3lab.index_topk_prefill`) for chosen query
  positions of a :class:`mm3lab.synthetic.SyntheticSequence` and returns a :class:`Selection`;
* :func:`full_attention` is the dense causal softmax of those queries over the whole prefix;
* :func:`attention_mass_captured` is, per (query head, row), the probability mass of that
  full softmax on tokens of the blocks the row's KV head selected;
* :func:`mass_curve` gives that mass (mean over heads and rows) at each top-k, next to an
  oracle that picks blocks by their true attention mass.

The notebooks' pictures of block selection are drawn from these results.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from .._checks import check_int
from ..constants import DEFAULT_TOPK, SPARSE_BLOCK_SIZE


@dataclasses.dataclass(frozen=True)
class Selection:
    """The indexer's view of a sequence at some query positions.

    Attributes:
        positions: ``[T]`` int64 absolute positions of the query rows.
        scores: ``[H, T, nb]`` float32 raw block scores (``-inf`` = not a candidate).
        forced: ``[H, T, nb]`` the scores top-k ranks (forcing applied, NaN as ``-1e30``).
        topk_idx: ``[H, T, topk]`` int32 selected blocks, best first (``-1`` padding).
        topk, init_blocks, local_blocks: the settings used.
    """

    positions: torch.Tensor
    scores: torch.Tensor
    forced: torch.Tensor
    topk_idx: torch.Tensor
    topk: int
    init_blocks: int
    local_blocks: int

    @property
    def num_blocks(self) -> int:
        return self.scores.shape[2]

    def with_topk(self, topk: int) -> Selection:
        """The selection a smaller ``topk`` makes: the first ``topk`` ids of every row.

        Exact, because the top-k order (score descending, ties to the lower id) does not
        depend on ``topk``: a top-k is a prefix of any larger one.
        """
        check_int("topk", topk, minimum=1, maximum=self.topk)
        return dataclasses.replace(self, topk_idx=self.topk_idx[..., :topk].contiguous(), topk=topk)

    def selected_mask(self) -> torch.Tensor:
        """``[H, T, nb]`` bool: block ``b`` selected by head ``h`` for row ``t``."""
        h, t, nb = self.scores.shape
        mask = torch.zeros(h, t, nb + 1, dtype=torch.bool)
        idx = self.topk_idx.long().cpu()
        mask.scatter_(2, torch.where(idx >= 0, idx, nb), True)
        return mask[..., :nb]

    def forced_mask(self) -> torch.Tensor:
        """``[T, nb]`` bool: blocks forced for each row (init or local), the same for every head."""
        nb = self.num_blocks
        blocks = torch.arange(nb).view(1, nb)
        valid = (self.positions.cpu() // SPARSE_BLOCK_SIZE + 1).view(-1, 1)
        candidate = blocks < valid
        return candidate & ((blocks < self.init_blocks) | (blocks >= valid - self.local_blocks))


def default_positions(seq_len: int, rows: int = 64) -> torch.Tensor:
    """``rows`` query positions spread evenly over the sequence, the last token included."""
    rows = max(1, min(rows, seq_len))
    step = seq_len / rows
    return torch.tensor([int(round((i + 1) * step)) - 1 for i in range(rows)], dtype=torch.int64)


def select_for_sequence(
    seq,
    topk: int = DEFAULT_TOPK,
    init_blocks: int = 0,
    local_blocks: int = 1,
    positions: Sequence[int] | torch.Tensor | None = None,
) -> Selection:
    """Run the indexer on ``seq`` for query rows at ``positions`` (default :func:`default_positions`).

    The sequence's index keys go into an index cache through an identity block table
    (one request); the rows use ``seq.index_q`` at their positions. Runs on the
    current backend.
    """
    from ..index_cache import allocate_index_cache, insert_index_cache, token_slots
    from . import index_scores_prefill, index_topk_prefill

    device = seq.index_k.device
    pos = default_positions(seq.seq_len) if positions is None else torch.as_tensor(positions, dtype=torch.int64)
    pos = pos.to(device)
    if pos.numel() and (int(pos.min()) < 0 or int(pos.max()) >= seq.seq_len):
        raise ValueError(f"positions: expected 0 <= p < seq_len = {seq.seq_len}, got {pos.tolist()}")
    nb = seq.num_blocks
    block_table = torch.arange(nb, dtype=torch.int32, device=device).view(1, nb)
    cache = allocate_index_cache(nb, seq.index_dim, dtype=seq.index_k.dtype, device=device, fill=0.0)
    every = torch.arange(seq.seq_len, device=device)
    insert_index_cache(seq.index_k, cache, token_slots(block_table, torch.zeros_like(every), every))
    req = torch.zeros_like(pos)
    index_q = seq.index_q[pos]
    scores = index_scores_prefill(index_q, cache, block_table, req, pos, init_blocks, local_blocks, forced=False)
    forced = _force(scores.cpu(), pos.tolist(), nb, init_blocks, local_blocks)  # the same numbers as forced=True
    topk_idx = index_topk_prefill(index_q, cache, block_table, req, pos, topk, init_blocks, local_blocks)
    return Selection(pos.cpu(), scores.cpu(), forced, topk_idx.cpu(), topk, init_blocks, local_blocks)


def _force(scores: torch.Tensor, positions: list[int], table_width: int, init_blocks: int, local_blocks: int):
    """SPEC 2's forcing on the raw scores ``[H, N, M]`` of rows at ``positions`` (host, row by row):
    what ``index_scores_*(forced=True)`` returns, without a second scoring pass."""
    from .reference import candidate_blocks, force_scores

    forced = scores.clone()
    for n, p in enumerate(positions):
        valid = candidate_blocks(p, table_width=table_width)
        for h in range(scores.shape[0]):
            row = force_scores(scores[h, n, :valid].tolist(), init_blocks, local_blocks)
            forced[h, n, :valid] = torch.tensor(row, dtype=scores.dtype)
    return forced


def full_attention(seq, positions: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Dense causal softmax of the queries at ``positions`` over the whole sequence.

    Returns:
        ``[Hq, T, S]`` float32 probabilities (zero after each row's position).
    """
    scale = seq.head_dim**-0.5 if scale is None else scale
    pos = torch.as_tensor(positions, dtype=torch.int64).cpu()
    q = seq.q.float().cpu()[pos]  # [T, Hq, D]
    group = seq.num_q_heads // seq.num_kv_heads
    k = seq.k.float().cpu().repeat_interleave(group, dim=1)  # [S, Hq, D]
    logits = torch.einsum("thd,shd->hts", q, k) * scale
    future = torch.arange(seq.seq_len).view(1, 1, -1) > pos.view(1, -1, 1)
    return torch.softmax(logits.masked_fill(future, float("-inf")), dim=-1)


def block_mass(probs: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """``[Hq, T, S]`` probabilities -> ``[Hq, T, nb]`` mass per 128-token block."""
    hq, t, s = probs.shape
    padded = torch.zeros(hq, t, num_blocks * SPARSE_BLOCK_SIZE)
    padded[..., :s] = probs
    return padded.view(hq, t, num_blocks, SPARSE_BLOCK_SIZE).sum(-1)


def attention_mass_captured(seq, selection: Selection, probs: torch.Tensor | None = None) -> torch.Tensor:
    """Share of each row's full-softmax attention mass on the blocks its KV head selected.

    Args:
        seq: the sequence the selection was made on.
        selection: from :func:`select_for_sequence`.
        probs: :func:`full_attention` of ``selection.positions`` (computed when ``None``).
    Returns:
        ``[Hq, T]`` float32 in ``[0, 1]``; query head ``hq`` uses KV head ``hq // group``.
    """
    probs = full_attention(seq, selection.positions) if probs is None else probs
    mass = block_mass(probs, selection.num_blocks)  # [Hq, T, nb]
    group = seq.num_q_heads // seq.num_kv_heads
    chosen = selection.selected_mask().repeat_interleave(group, dim=0)  # [Hq, T, nb]
    return (mass * chosen).sum(-1)


@dataclasses.dataclass(frozen=True)
class MassCurve:
    """Attention mass held by the selected blocks, per top-k.

    Attributes:
        topks: the top-k values.
        indexer: mean mass captured by the indexer's blocks at each top-k.
        oracle: mean mass of the best possible ``topk`` blocks (by true attention mass, per
            query head), an upper bound for any selector.
        pattern: the sequence's pattern.
    """

    topks: tuple[int, ...]
    indexer: tuple[float, ...]
    oracle: tuple[float, ...]
    pattern: str


def mass_curve(
    seq,
    topks: Sequence[int] = (1, 2, 4, 8, 16),
    init_blocks: int = 0,
    local_blocks: int = 1,
    positions: Sequence[int] | torch.Tensor | None = None,
    *,
    selection: Selection | None = None,
) -> MassCurve:
    """Mean attention mass captured at each top-k (one indexer run: a top-k is a prefix of a larger one).

    ``selection``: a :func:`select_for_sequence` result with ``topk >= max(topks)`` to reuse
    (its positions and forcing settings then apply).
    """
    topks = tuple(int(k) for k in topks)
    if not topks or min(topks) < 1:
        raise ValueError(f"topks: expected positive ints, got {topks}")
    if selection is None:
        widest = select_for_sequence(seq, max(topks), init_blocks, local_blocks, positions)
    elif selection.topk < max(topks):
        raise ValueError(f"selection: made with topk={selection.topk}, fewer than max(topks) = {max(topks)}")
    else:
        widest = selection
    probs = full_attention(seq, widest.positions)
    mass = block_mass(probs, widest.num_blocks)  # [Hq, T, nb]
    best = mass.sort(dim=-1, descending=True).values.cumsum(-1)  # oracle: the k heaviest blocks
    indexer, oracle = [], []
    for k in topks:
        prefix = widest.with_topk(k)
        indexer.append(float(attention_mass_captured(seq, prefix, probs).mean()))
        oracle.append(float(best[..., min(k, widest.num_blocks) - 1].mean()))
    return MassCurve(topks, tuple(indexer), tuple(oracle), seq.pattern)


__all__ = [
    "MassCurve",
    "Selection",
    "attention_mass_captured",
    "block_mass",
    "default_positions",
    "full_attention",
    "mass_curve",
    "select_for_sequence",
]
