"""Pure-PyTorch reference of the indexer (SPEC section 2, steps 2-3), written as loops.

For every query row ``t`` (request ``r``, absolute position ``p``) and index head ``h``:

1. **Score.** For each candidate block ``b <= p // 128``::

       score[h, t, b] = max over tokens s of block b with s <= p of dot(index_q[t, h], index_k[s])

   in float32, where the index keys of logical block ``b`` are
   ``index_cache[block_table[r, b]]`` (one key per token, shared by all heads).
   Blocks after ``p // 128`` are not candidates (score ``-inf``).
2. **Force.** With ``valid = p // 128 + 1``: every raw score is first clamped to
   ``[-1e28, 1e28]`` (``+inf`` counts as ``1e28``); then a block ``b < init_blocks`` scores
   ``1e30``; then a block ``b >= valid - local_blocks`` scores ``1e29`` (local is
   applied last, so a block that is both ends at ``1e29``). NaN counts as ``-1e30``.
3. **Top-k.** ``topk_idx[h, t, :]`` = the ``topk`` candidates by descending score,
   ties to the lower block id, ``-1`` past ``min(topk, valid)``. A padded row
   (``p < 0``) is all ``-1``.

Rows: the SPEC 2 row rule (:func:`mm3lab.rows.decode_rows`).

mm3lab's definitions for input that validation rejects (they apply only with
validation off): a request id outside the block table makes the row padded,
candidates stop at the block table's width ``M``, and a block whose physical id
is outside the cache is never read (it stays a candidate, scoring ``-inf``).

An FP8 index cache (``float8_e4m3fn`` keys with per-token float32 scales
``index_scale``, SPEC section 9) is read as the keys it stands for,
``key * scale``, in float32; the rule above is then unchanged.

The entry point twins take the signatures of the entry points in :mod:`mm3lab.indexer`
(:func:`mm3lab._twin.twin_of`: parameters and defaults are stated there) and are the
specification those are tested against.
"""

from __future__ import annotations

import math
import types
from collections.abc import Sequence

import torch

from .._twin import twin_of
from ..block_table.reference import build_sparse_block_table_decode, build_sparse_block_table_prefill
from ..constants import INIT_SCORE, LOCAL_SCORE, NAN_SCORE, RAW_SCORE_LIMIT, SPARSE_BLOCK_SIZE
from ..fp8 import dequantize
from ..rows import decode_rows
from .checks import NO_TOPK, check_decode, check_prefill, check_topk_scores

# --- one row, in the SPEC's words -----------------------------------------------------------


def candidate_blocks(p: int, table_width: int | None = None) -> int:
    """``valid``: how many blocks ``0 .. valid - 1`` a query at position ``p`` may select.

    ``p // 128 + 1`` (its own block and every earlier one), ``0`` for a padded row
    (``p < 0``), at most ``table_width`` when given.
    """
    valid = p // SPARSE_BLOCK_SIZE + 1 if p >= 0 else 0
    return valid if table_width is None else min(valid, table_width)


def force_scores(scores: Sequence[float], init_blocks: int = 0, local_blocks: int = 1) -> list[float]:
    """The selection scores of one row's ``valid = len(scores)`` candidates.

    First every raw score is clamped to ``[-1e28, 1e28]`` (``+inf`` counts as ``1e28``);
    then ``b < init_blocks`` -> ``1e30``; then ``b >= valid - local_blocks`` -> ``1e29``
    (local last); NaN -> ``-1e30``. Forced blocks therefore win against any raw score.
    """
    valid = len(scores)
    forced = [s if math.isnan(s) else min(max(s, -RAW_SCORE_LIMIT), RAW_SCORE_LIMIT) for s in map(float, scores)]
    for b in range(valid):
        if b < init_blocks:
            forced[b] = INIT_SCORE
    for b in range(valid):
        if b >= valid - local_blocks:
            forced[b] = LOCAL_SCORE
    return [NAN_SCORE if math.isnan(s) else s for s in forced]


def select_topk(scores: Sequence[float], topk: int) -> list[int]:
    """Top-k of one row of candidate scores: ids by descending score, ties to the lower id,
    ``-1`` past ``min(topk, len(scores))``. NaN counts as ``-1e30``."""
    scores = [NAN_SCORE if math.isnan(s) else s for s in scores]
    order = sorted(range(len(scores)), key=lambda b: (-scores[b], b))
    chosen = order[:topk]
    return chosen + [-1] * (topk - len(chosen))


def block_score(index_q_row: torch.Tensor, index_k_block: torch.Tensor, visible: int) -> torch.Tensor:
    """``max over the first visible tokens s of dot(index_q_row[h], index_k_block[s])`` per head, float32.

    Args:
        index_q_row: ``[H, Di]`` index queries of one row.
        index_k_block: ``[128, Di]`` index keys of one block.
        visible: tokens of the block the query sees (``1 .. 128``).
    Returns:
        ``[H]`` float32 (NaN if any visible dot is NaN).
    """
    dots = index_q_row.float() @ index_k_block[:visible].float().T  # [H, visible]
    return dots.amax(dim=1)


# --- the entry points ------------------------------------------------------------------------


def _dequantized(index_q, index_cache, index_scale):
    """An FP8 cache (SPEC section 9) as the float32 keys it stands for, ``key * scale``; other caches as given."""
    if index_scale is None:
        return index_q, index_cache
    return index_q.float(), dequantize(index_cache, index_scale)


def _decode_rows(seq_lens: torch.Tensor, decode_query_len: int) -> list[tuple[int, int]]:
    req, pos = decode_rows(seq_lens, decode_query_len)
    return list(zip(req.tolist(), pos.tolist(), strict=True))


def _scores(index_q, index_cache, block_table, rows, init_blocks, local_blocks, forced, index_scale) -> torch.Tensor:
    """``rows[n] = (request, p)``; the ``[H, N, M]`` float32 scores (``-inf`` for non-candidates)."""
    index_q, index_cache = _dequantized(index_q, index_cache, index_scale)
    n_rows, h, _ = index_q.shape
    b, m = block_table.shape
    num_blocks = index_cache.shape[0]
    table = block_table.tolist()
    scores = torch.full((h, n_rows, m), float("-inf"), dtype=torch.float32)
    for n, (r, p) in enumerate(rows):
        if not 0 <= r < b:  # a request id out of range: a padded row
            continue
        valid = candidate_blocks(p, table_width=m)
        for blk in range(valid):
            physical = table[r][blk]
            if not 0 <= physical < num_blocks:  # never read: stays a candidate scoring -inf
                continue
            visible = min(p - blk * SPARSE_BLOCK_SIZE + 1, SPARSE_BLOCK_SIZE)
            scores[:, n, blk] = block_score(index_q[n], index_cache[physical], visible).cpu()
        if forced:
            for head in range(h):
                scores[head, n, :valid] = torch.tensor(
                    force_scores(scores[head, n, :valid].tolist(), init_blocks, local_blocks), dtype=torch.float32
                )
    return scores.to(index_q.device)


def _topk(scores: torch.Tensor, rows, topk: int) -> torch.Tensor:
    """Top-k of every (head, row) of forced scores ``[H, N, M]`` over its ``valid`` candidates."""
    h, n_rows, m = scores.shape
    out = torch.full((h, n_rows, topk), -1, dtype=torch.int32)
    for n, (r, p) in enumerate(rows):
        valid = candidate_blocks(p, table_width=m) if r >= 0 else 0
        for head in range(h):
            out[head, n] = torch.tensor(select_topk(scores[head, n, :valid].tolist(), topk), dtype=torch.int32)
    return out.to(scores.device)


def _prefill_rows(block_table, query_req_id, query_abs_pos):
    b = block_table.shape[0]
    return [(r if 0 <= r < b else -1, p) for r, p in zip(query_req_id.tolist(), query_abs_pos.tolist(), strict=False)]


def _run(arguments: dict) -> torch.Tensor:
    """Steps 2-3 of one call, from all the entry point's arguments by name (its ``locals()``): the checks
    and rows of decode (``seq_lens``) or prefill rows, the scores, then with a ``topk`` their top-k."""
    a = types.SimpleNamespace(**arguments)
    topk, forced = arguments.get("topk", NO_TOPK), arguments.get("forced", True)
    tensors, selection = (a.index_q, a.index_cache, a.block_table), (a.init_blocks, a.local_blocks)
    if "seq_lens" in arguments:
        check_decode(*tensors, a.seq_lens, topk, a.decode_query_len, *selection, a.index_scale)
        rows = _decode_rows(a.seq_lens, a.decode_query_len)
    else:
        check_prefill(*tensors, a.query_req_id, a.query_abs_pos, topk, *selection, a.index_scale)
        rows = _prefill_rows(a.block_table, a.query_req_id, a.query_abs_pos)
    scores = _scores(*tensors, rows, *selection, forced, a.index_scale)
    return scores if topk is NO_TOPK else _topk(scores, rows, topk)


@twin_of("mm3lab.indexer")
def index_scores_decode(
    index_q, index_cache, block_table, seq_lens, decode_query_len, init_blocks, local_blocks, forced, index_scale
):
    """Block scores of decode rows (step 2): ``[H, N, M]`` float32, ``-inf`` at every non-candidate;
    forcing applied (and NaN as ``-1e30``) only with ``forced``. Arguments: :func:`mm3lab.index_scores_decode`."""
    return _run(locals())  # every argument, by name


@twin_of("mm3lab.indexer")
def index_scores_prefill(
    index_q, index_cache, block_table, query_req_id, query_abs_pos, init_blocks, local_blocks, forced, index_scale
):
    """Block scores of prefill rows (step 2), as :func:`index_scores_decode`; arguments:
    :func:`mm3lab.index_scores_prefill`."""
    return _run(locals())  # every argument, by name


@twin_of("mm3lab.indexer")
def index_topk_decode(
    index_q, index_cache, block_table, seq_lens, topk, decode_query_len, init_blocks, local_blocks, index_scale
):
    """Selected blocks of decode rows (steps 2-3): ``[H, N, topk]`` int32, ``-1`` padding.
    Arguments: :func:`mm3lab.index_topk_decode`."""
    return _run(locals())  # every argument, by name


@twin_of("mm3lab.indexer")
def index_topk_prefill(
    index_q, index_cache, block_table, query_req_id, query_abs_pos, topk, init_blocks, local_blocks, index_scale
):
    """Selected blocks of prefill rows (steps 2-3): ``[H, N, topk]`` int32, ``-1`` padding."""
    return _run(locals())  # every argument, by name


@twin_of("mm3lab.indexer")
def index_topk_block_table_decode(
    index_q,
    index_cache,
    block_table,
    seq_lens,
    topk,
    decode_query_len,
    init_blocks,
    local_blocks,
    block_page_stride,
    index_scale,
):
    """:func:`index_topk_decode`, then :func:`mm3lab.reference.build_sparse_block_table_decode` on its result:
    ``(topk_idx, sparse_bt, sparse_ctx)`` as :func:`mm3lab.index_topk_block_table_decode` returns them."""
    selection = (topk, decode_query_len, init_blocks, local_blocks)
    topk_idx = index_topk_decode(index_q, index_cache, block_table, seq_lens, *selection, index_scale=index_scale)
    sparse_bt, sparse_ctx = build_sparse_block_table_decode(
        topk_idx, block_table, seq_lens, decode_query_len, block_page_stride
    )
    return topk_idx, sparse_bt, sparse_ctx


@twin_of("mm3lab.indexer")
def index_topk_block_table_prefill(
    index_q,
    index_cache,
    block_table,
    query_req_id,
    query_abs_pos,
    topk,
    init_blocks,
    local_blocks,
    block_page_stride,
    index_scale,
):
    """:func:`index_topk_prefill`, then :func:`mm3lab.reference.build_sparse_block_table_prefill`."""
    selection = (topk, init_blocks, local_blocks)
    topk_idx = index_topk_prefill(
        index_q, index_cache, block_table, query_req_id, query_abs_pos, *selection, index_scale=index_scale
    )
    sparse_bt, sparse_ctx = build_sparse_block_table_prefill(
        topk_idx, block_table, query_req_id, query_abs_pos, block_page_stride
    )
    return topk_idx, sparse_bt, sparse_ctx


def topk_blocks(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """Top-k of every row of a score tensor with the indexer's rule (step 3), every column a candidate.

    Args:
        scores: ``[..., W]`` float scores.
        topk: ids per row.
    Returns:
        ``[..., topk]`` int32 ids by descending score, ties to the lower id, NaN as ``-1e30``,
        ``-1`` past ``W``.
    """
    check_topk_scores(scores, topk)
    if scores.shape[-1] == 0 or scores.numel() == 0:  # no candidates (or no rows): all -1
        return torch.full((*scores.shape[:-1], topk), -1, dtype=torch.int32, device=scores.device)
    rows = scores.reshape(-1, scores.shape[-1]).float().tolist()
    picked = [select_topk(row, topk) for row in rows]
    out = torch.tensor(picked, dtype=torch.int32).reshape(*scores.shape[:-1], topk)
    return out.to(scores.device)


__all__ = [
    "block_score",
    "candidate_blocks",
    "force_scores",
    "index_scores_decode",
    "index_scores_prefill",
    "index_topk_block_table_decode",
    "index_topk_block_table_prefill",
    "index_topk_decode",
    "index_topk_prefill",
    "select_topk",
    "topk_blocks",
]
