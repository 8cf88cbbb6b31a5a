"""What FP8 index keys cost the selection: top-k set recall and attention mass, bf16 vs FP8.

The indexer's choice depends on its keys only through the block scores (SPEC
section 2). This module scores the same query rows twice on a synthetic
sequence (:mod:`mm3lab.synthetic`):

* ``"bf16"``: index keys and queries rounded to bfloat16, the mm3lab default cache;
* ``"fp8"``: the same keys stored in an FP8 index cache (SPEC section 9: per-token
  ``scale = amax / 448``, e4m3 values), read back as ``stored * scale``; the queries
  as for bf16. This is the reference twin's arithmetic; the Triton kernel's scores
  agree with it within :data:`mm3lab.fp8.INDEX_SCORE_FP8_RTOL`.

Scores are computed in float64 from those values (the products of bf16/e4m3
numbers and their sums are then exact or nearly so), so a selection, and every
number below, is the same on any CPU, BLAS or thread count. Then:

* **recall** at top-k: ``|bf16 set & fp8 set| / |bf16 set|`` per (head, row), the
  share of bf16's blocks that FP8 also selects, averaged;
* **mass captured**: the share of a full causal softmax's attention mass on the
  selected blocks (as :func:`mm3lab.indexer.analysis.attention_mass_captured`, here in
  float64 so the rounded numbers do not depend on the BLAS), for each key dtype.

Rows are :func:`mm3lab.indexer.analysis.default_positions` (evenly spread, last token
included); forcing is MiniMax-M3's (``init_blocks = 0``, ``local_blocks = 1``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from ..constants import LOCAL_SCORE, SPARSE_BLOCK_SIZE
from ..fp8 import round_trip
from .analysis import Selection, default_positions

KEY_DTYPES = ("bf16", "fp8")
"""The index-key dtypes compared."""

DEFAULT_CONTEXTS = (4096, 16384, 32768)
"""Context lengths of the quality table (tokens)."""

DEFAULT_TOPKS = (1, 2, 4, 8, 16)
"""Top-k values of the quality curves."""

_SEQUENCE_SHAPE = dict(num_kv_heads=2, num_q_heads=8, index_dim=64, head_dim=32)


def quality_sequence(pattern: str, context: int, seed: int = 0):
    """The synthetic sequence the quality numbers use (2 KV heads, 8 query heads, Di 64, D 32)."""
    from ..synthetic import make_sequence

    return make_sequence(pattern, context, seed=seed, **_SEQUENCE_SHAPE)


def index_keys(index_k: torch.Tensor, key_dtype: str) -> torch.Tensor:
    """The float64 values an index cache of ``key_dtype`` gives back for keys ``[S, Di]``."""
    if key_dtype == "bf16":
        return index_k.to(torch.bfloat16).double()
    if key_dtype == "fp8":
        return round_trip(index_k.float()).double()
    raise ValueError(f"key_dtype: expected one of {', '.join(KEY_DTYPES)}, got {key_dtype!r}")


def block_scores(index_q: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Forced block scores ``[H, T, nb]`` float64 (SPEC section 2, ``init 0, local 1``), ``-inf`` past ``p // 128``.

    Args:
        index_q: ``[T, H, Di]`` the rows' index queries (any float dtype).
        keys: ``[S, Di]`` float64 key values.
        positions: ``[T]`` absolute positions.
    """
    s = keys.shape[0]
    nb = -(-s // SPARSE_BLOCK_SIZE)
    pos = positions.cpu().long()
    dots = torch.einsum("thd,sd->hts", index_q.cpu().to(torch.bfloat16).double(), keys.cpu())  # [H, T, S]
    future = torch.arange(s).view(1, 1, s) > pos.view(1, -1, 1)
    dots = dots.masked_fill(future, float("-inf"))
    padded = torch.full((*dots.shape[:2], nb * SPARSE_BLOCK_SIZE), float("-inf"), dtype=torch.float64)
    padded[..., :s] = dots
    scores = padded.view(*dots.shape[:2], nb, SPARSE_BLOCK_SIZE).amax(-1)  # [H, T, nb]
    local = (pos // SPARSE_BLOCK_SIZE).view(1, -1, 1)
    blocks = torch.arange(nb).view(1, 1, nb)
    scores = torch.where(blocks == local, LOCAL_SCORE, scores)
    return torch.where(blocks > local, float("-inf"), scores)


def select(scores: torch.Tensor, positions: torch.Tensor, topk: int) -> torch.Tensor:
    """Top-k of forced scores ``[H, T, nb]``: ids by descending score, ties to the lower id, ``-1`` padding."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :topk]
    valid = (positions.cpu().long() // SPARSE_BLOCK_SIZE + 1).view(1, -1, 1)
    rank = torch.arange(order.shape[-1]).view(1, 1, -1)
    ids = torch.where(rank < valid, order, -1).to(torch.int32)
    if ids.shape[-1] < topk:
        ids = torch.cat([ids, torch.full((*ids.shape[:2], topk - ids.shape[-1]), -1, dtype=torch.int32)], -1)
    return ids


def set_recall(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """``|got & want| / |want|`` per row of two ``[..., K]`` selections (``-1`` ignored), float64."""
    inter = ((got.unsqueeze(-1) == want.unsqueeze(-2)) & (want >= 0).unsqueeze(-2)).any(-2).sum(-1)
    size = (want >= 0).sum(-1)
    return inter.double() / size.clamp(min=1).double()


@dataclasses.dataclass(frozen=True)
class FP8Comparison:
    """One sequence's bf16 and FP8 selections at the widest top-k.

    Attributes:
        pattern, context: the sequence.
        positions: ``[T]`` query rows.
        scores: ``{"bf16": [H, T, nb], "fp8": ...}`` forced float64 scores.
        topk_idx: ``{"bf16": [H, T, K], "fp8": ...}`` int32 selections, best first.
        topk: ``K``.
        probs: ``[Hq, T, S]`` float64 full causal softmax of the rows (for the mass captured).
        seq: the synthetic sequence.
    """

    pattern: str
    context: int
    positions: torch.Tensor
    scores: dict
    topk_idx: dict
    topk: int
    probs: torch.Tensor
    seq: object

    def selection(self, key_dtype: str, topk: int | None = None) -> Selection:
        """The :class:`~mm3lab.indexer.analysis.Selection` of ``key_dtype`` at ``topk`` (a prefix)."""
        topk = self.topk if topk is None else topk
        scores = self.scores[key_dtype].float()
        sel = Selection(self.positions, scores, scores, self.topk_idx[key_dtype], self.topk, 0, 1)
        return sel.with_topk(topk)

    def recall(self, topk: int | None = None) -> float:
        """Mean top-k set recall of FP8 against bf16."""
        topk = self.topk if topk is None else topk
        return float(set_recall(self.topk_idx["fp8"][..., :topk], self.topk_idx["bf16"][..., :topk]).mean())

    def mass(self, key_dtype: str, topk: int | None = None) -> float:
        """Mean attention mass captured by ``key_dtype``'s blocks at ``topk``."""
        sel = self.selection(key_dtype, topk)
        hq, t, s = self.probs.shape
        padded = torch.zeros(hq, t, sel.num_blocks * SPARSE_BLOCK_SIZE, dtype=torch.float64)
        padded[..., :s] = self.probs
        mass = padded.view(hq, t, sel.num_blocks, SPARSE_BLOCK_SIZE).sum(-1)
        chosen = sel.selected_mask().repeat_interleave(hq // sel.selected_mask().shape[0], dim=0)
        return float((mass * chosen).sum(-1).mean())

    def differing(self, topk: int | None = None) -> torch.Tensor:
        """``[H, T, nb]`` int8: 0 neither, 1 both, 2 bf16 only, 3 fp8 only (blocks at ``topk``)."""
        a = self.selection("bf16", topk).selected_mask()
        b = self.selection("fp8", topk).selected_mask()
        out = torch.zeros(a.shape, dtype=torch.int8)
        out[a & b] = 1
        out[a & ~b] = 2
        out[~a & b] = 3
        return out


def _full_attention64(seq, positions: torch.Tensor) -> torch.Tensor:
    """``[Hq, T, S]`` float64 causal softmax of the rows (scale ``D ** -0.5``)."""
    pos = positions.cpu().long()
    group = seq.num_q_heads // seq.num_kv_heads
    q = seq.q.cpu().double()[pos]
    k = seq.k.cpu().double().repeat_interleave(group, dim=1)
    logits = torch.einsum("thd,shd->hts", q, k) * seq.head_dim**-0.5
    future = torch.arange(seq.seq_len).view(1, 1, -1) > pos.view(1, -1, 1)
    return torch.softmax(logits.masked_fill(future, float("-inf")), dim=-1)


def compare(pattern: str, context: int, topk: int = 16, rows: int = 32, seed: int = 0) -> FP8Comparison:
    """Score ``rows`` query rows of a ``pattern`` sequence of ``context`` tokens with bf16 and FP8 keys."""
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ValueError(f"topk: expected a positive int, got {topk!r}")
    seq = quality_sequence(pattern, context, seed)
    pos = default_positions(context, rows)
    scores, ids = {}, {}
    for key_dtype in KEY_DTYPES:
        scores[key_dtype] = block_scores(seq.index_q[pos], index_keys(seq.index_k, key_dtype), pos)
        ids[key_dtype] = select(scores[key_dtype], pos, topk)
    probs = _full_attention64(seq, pos)
    return FP8Comparison(pattern, context, pos, scores, ids, topk, probs, seq)


@dataclasses.dataclass(frozen=True)
class QualityRow:
    """One line of the quality table (rounded: recall and mass to 3 decimals)."""

    pattern: str
    context: int
    topk: int
    recall: float
    mass_bf16: float
    mass_fp8: float


def quality_table(
    patterns: Sequence[str] = ("sink", "needle", "recency", "random"),
    contexts: Sequence[int] = DEFAULT_CONTEXTS,
    topks: Sequence[int] = DEFAULT_TOPKS,
    rows: int = 32,
    seed: int = 0,
) -> list[QualityRow]:
    """Recall and mass captured for every pattern x context x top-k (one scoring per pattern and context)."""
    table = []
    for pattern in patterns:
        for context in contexts:
            cmp = compare(pattern, int(context), max(topks), rows, seed)
            for k in topks:
                table.append(
                    QualityRow(
                        pattern,
                        int(context),
                        int(k),
                        round(cmp.recall(k), 3),
                        round(cmp.mass("bf16", k), 3),
                        round(cmp.mass("fp8", k), 3),
                    )
                )
    return table


def format_table(table: Sequence[QualityRow]) -> str:
    """The quality table as fixed-width text."""
    lines = [f"{'pattern':<8} {'context':>7} {'top-k':>5} {'recall':>7} {'mass bf16':>9} {'mass fp8':>8}"]
    for r in table:
        lines.append(
            f"{r.pattern:<8} {r.context:>7} {r.topk:>5} {r.recall:>7.3f} {r.mass_bf16:>9.3f} {r.mass_fp8:>8.3f}"
        )
    return "\n".join(lines)


__all__ = [
    "DEFAULT_CONTEXTS",
    "DEFAULT_TOPKS",
    "FP8Comparison",
    "KEY_DTYPES",
    "QualityRow",
    "block_scores",
    "compare",
    "format_table",
    "index_keys",
    "quality_sequence",
    "quality_table",
    "select",
    "set_recall",
]
