"""Triton kernels of the indexer (SPEC section 2, steps 2-3): block scores, top-k, and top-k fused
with the sparse block table.

**Scoring** (:func:`index_scores_kernel`). A program owns a tile of query rows
(``BLOCK_Q`` rows x ``BLOCK_H`` heads = ``BLOCK_M`` lanes, padded to at least 16
for ``tl.dot``) and a chunk of consecutive logical blocks; the grid is
``(row tiles, block chunks)``, so even one decode row of a 1M-token context
spreads over every SM. For each block the program loads the ``[128, Di]`` key tile
once and scores every lane with one ``tl.dot`` (all heads share the one index
key), masks the tokens after each lane's position, and keeps the maximum
(NaN if any visible dot is NaN, like ``torch.amax``). Decode tiles are rows of one
request, so a block is one key tile: compiled, the decode loop keeps ``num_stages``
key tiles in flight (their load masks depend only on the tile's last position, and
the head dim is unmasked when it fills the tile, so the loads vectorize and pipeline),
which reads bf16 keys at copy bandwidth. Where a prefill tile's rows read different
physical blocks (a request boundary) the program loads one key tile per distinct
physical block. With
``FORCE`` the program also clamps raw scores to ``[-1e28, 1e28]``, applies init/local forcing and NaN -> ``-1e30``,
writing the scores top-k ranks.

**FP8 keys** (SPEC section 9). The program rounds each lane's query to an FP8
pair, ``q ~ s * (hi + lo / 16)`` with ``s = amax(|q|) / 448`` (``hi`` the e4m3
rounding of ``q / s``, ``lo`` that of the remainder times 16: about bf16's 8
significant bits), multiplies both with the FP8 key tile through ``tl.dot``
(FP8 tensor cores on Hopper), and scales each dot by ``s`` and the token's
scale before the block max. The FP8 dots run as tokens x lanes (``keys @ q^T``):
128 token rows let Hopper's warp-group MMA take the FP8 operands as they are, where
16 lane rows would upcast both to fp16 first. A tile of 8 lanes or fewer (decode with
up to 8 index heads) puts each lane's hi and lo parts side by side in one 16-column
operand, so one dot serves both. The second dot costs no memory traffic, which is
what the decode scorer is bound by.

**Top-k** (:func:`topk_kernel`). A program owns a few (head, row) pairs (one for the
widest rows). Each candidate's (score, block id) becomes one int64 key whose order
is "score descending, then id ascending" (the float's bits made monotone in the
high word, ``2^31 - 1 - id`` in the low word), so keys are distinct and ordering
them is the whole tie rule. Rows up to 8192 blocks (the model's 1M tokens) stay in
registers. Wide rows first keep only the ``topk`` groups of ``TOPK_GROUP`` columns
with the largest maxima (the top ``topk`` cannot lie elsewhere), then select among
those ``topk * TOPK_GROUP`` columns. Selection is ``tl.topk`` (a bitonic network)
when compiled, or ``topk`` max-reductions, each over the keys below the previous
pick (faster in the interpreter); nothing sorts the whole row. Rows wider than the
registers are re-read chunk by chunk, one max-reduction a pick. With
``EMIT_TABLE`` the selected ids go straight into
:func:`mm3lab.block_table.kernel.emit_sparse_block_table_row`: one launch from
scores to ``topk_idx``, ``sparse_bt`` and ``sparse_ctx``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _pdl, backend
from .._combine import maximum as _max  # (tl.reduce's combiners: Triton's own where it has them)
from .._combine import minimum as _min
from .._fit import fitting
from .._fp8_triton import round_to_e4m3
from .._grid import cdiv, next_power_of_2
from .._valcheck import signal_done
from ..block_table.kernel import emit_sparse_block_table_row
from ..constants import INIT_SCORE, LOCAL_SCORE, NAN_SCORE, PAGES_PER_SPARSE_BLOCK, RAW_SCORE_LIMIT, SPARSE_BLOCK_SIZE
from ..rows import row_request_position

MAX_REGISTER_ROW = 8192
"""Widest score row the top-k keeps in registers (8192 blocks = 1M tokens)."""

TOPK_GROUP = 16
"""Columns per group in the top-k's group pre-selection (rows of at least 64 * k columns)."""


_KEY_NONE = tl.constexpr(-(2**63) + 1)  # top-k key of a non-candidate: below every score's key, -inf's included
_KEY_MAX = tl.constexpr(2**63 - 1)
# compiled Triton reads module globals only when they are constexpr objects
_INIT_SCORE = tl.constexpr(INIT_SCORE)
_LOCAL_SCORE = tl.constexpr(LOCAL_SCORE)
_NAN_SCORE = tl.constexpr(NAN_SCORE)
_RAW_LIMIT = tl.constexpr(RAW_SCORE_LIMIT)

# --- row positions --------------------------------------------------------------------------


@triton.jit
def _tile_rows(
    t,
    qi,
    N,
    B,
    DQL,
    TILES_PER_REQ,
    req_ptr,
    stride_r,
    pos_ptr,
    stride_p,
    PREFILL: tl.constexpr,
    BLOCK_Q: tl.constexpr,
):
    """Rows of tile ``t`` at lanes ``qi`` (0 .. BLOCK_Q - 1): ``(n, live, request, p)``, ``p = -1`` unless live."""
    if PREFILL:
        n = (t * BLOCK_Q + qi).to(tl.int64)
        live = n < N
    else:  # decode: tile t holds queries i of request t // TILES_PER_REQ
        i = (t % TILES_PER_REQ) * BLOCK_Q + qi
        live = i < DQL
        n = (t // TILES_PER_REQ) * DQL + i.to(tl.int64)
    req, p = row_request_position(n, live, req_ptr, stride_r, pos_ptr, stride_p, B, DQL, PREFILL)
    return n, live, req, p


# --- scoring --------------------------------------------------------------------------------


@triton.jit
def _shared_block_dots(
    q,
    q_lo,
    q_scale,
    cache_ptr,
    scale_ptr,
    stride_sb,
    phys,
    stride_cb,
    stride_ct,
    lanes_ok,
    last_tok,
    tile_last,
    tok,
    dims,
    dim_ok,
    IEEE: tl.constexpr,
    FP8: tl.constexpr,
    TOK_M: tl.constexpr,
    PAIR: tl.constexpr,
):
    """Dots of every lane with physical block ``phys``'s keys (a block inside the cache), and which
    of them the lanes see (``lanes_ok`` and causal); tokens past ``tile_last`` (the last token any
    lane sees) are not read.

    FP8 keys: ``q`` / ``q_lo`` are the lanes' FP8 pair (``query ~ q_scale * (q + q_lo / 16)``),
    both multiplied with the FP8 keys by ``tl.dot``, then scaled by the lane's and the token's scale.
    """
    tok_read = tok <= tile_last
    if TOK_M:  # tokens x lanes: q arrives transposed ([Di, lanes]), the key tile is the left operand
        keys = tl.load(
            cache_ptr + phys * stride_cb + tok[:, None] * stride_ct + dims[None, :],
            mask=tok_read[:, None] & dim_ok[None, :],
            other=0.0,
        )
        if FP8:
            if PAIR:  # one dot for both parts (q holds hi and lo side by side), split after
                both = tl.dot(keys, q)
                hi, lo = tl.split(tl.permute(tl.reshape(both, (tok.shape[0], 2, q_scale.shape[0])), (0, 2, 1)))
                dots = hi + lo * 0.0625
            else:
                dots = tl.dot(keys, q) + tl.dot(keys, q_lo) * 0.0625
            k_scale = tl.load(scale_ptr + phys * stride_sb + tok, mask=tok_read, other=0.0)
            dots = dots * k_scale[:, None] * q_scale[None, :]
        elif IEEE:
            dots = tl.dot(keys, q, input_precision="ieee")
        else:
            dots = tl.dot(keys, q)
        sel = lanes_ok[None, :] & (tok[:, None] <= last_tok[None, :])
    else:  # lanes x tokens: the key tile loaded as [Di, 128], the dot's right operand as it is
        k_t = tl.load(
            cache_ptr + phys * stride_cb + tok[None, :] * stride_ct + dims[:, None],
            mask=tok_read[None, :] & dim_ok[:, None],
            other=0.0,
        )
        if FP8:
            dots = tl.dot(q, k_t) + tl.dot(q_lo, k_t) * 0.0625
            k_scale = tl.load(scale_ptr + phys * stride_sb + tok, mask=tok_read, other=0.0)
            dots = dots * q_scale[:, None] * k_scale[None, :]
        elif IEEE:  # float32: exact products, no TF32
            dots = tl.dot(q, k_t, input_precision="ieee")
        else:
            dots = tl.dot(q, k_t)
        sel = lanes_ok[:, None] & (tok[None, :] <= last_tok[:, None])
    return dots, sel


@triton.jit
def _index_scores(
    q_ptr,  # [N, H, Di] index queries, any strides
    stride_qn,
    stride_qh,
    stride_qd,
    cache_ptr,  # [num_blocks, 128, Di] index keys, head dim contiguous
    stride_cb,
    stride_ct,
    bt_ptr,  # [B, M] block_table
    stride_bb,
    stride_bm,
    req_ptr,
    stride_r,  # prefill: [N] query_req_id; decode: [B] seq_lens
    pos_ptr,
    stride_p,  # prefill: [N] query_abs_pos; decode: unused
    out_ptr,  # [H, N, M] float32, contiguous
    scale_ptr,
    stride_sb,  # FP8 keys: [num_blocks, 128] float32 per-token scales
    N,
    H,
    Di,
    B,
    M,
    num_blocks,
    DQL,
    TILES_PER_REQ,  # decode: queries per request and row tiles per request
    blocks_per_program,
    init_blocks,
    local_blocks,
    flags_ptr,  # CHECK: [2] int32 value-check flags (host memory; see _check_decode_values)
    count_ptr,  # CHECK: the launch counter and the done word (see mm3lab._valcheck.signal_done)
    done_ptr,
    PREFILL: tl.constexpr,
    FORCE: tl.constexpr,
    IEEE: tl.constexpr,
    FP8: tl.constexpr,
    INTERPRETED: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPARSE_BLOCK: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    EVEN_D: tl.constexpr,
    TOK_M: tl.constexpr,
    PAIR: tl.constexpr,
    PDL: tl.constexpr,
    CHECK: tl.constexpr,  # decode: every program checks its share of the call's values, then signals the host
):
    _pdl.wait_previous(PDL)
    BLOCK_M: tl.constexpr = BLOCK_Q * BLOCK_H
    t = tl.program_id(0)
    chunk = tl.program_id(1)
    lanes = tl.arange(0, BLOCK_M)
    qi = lanes // BLOCK_H  # the lane's row in the tile
    head = (lanes % BLOCK_H).to(tl.int64)
    n, live, req, p = _tile_rows(
        t, qi, N, B, DQL, TILES_PER_REQ, req_ptr, stride_r, pos_ptr, stride_p, PREFILL, BLOCK_Q
    )
    lane_ok = live & (head < H)
    p = tl.where(lane_ok, p, -1)
    valid = tl.where(p >= 0, tl.minimum(p // SPARSE_BLOCK + 1, M), 0)  # candidates 0 .. valid - 1
    dims = tl.arange(0, BLOCK_D)
    tok = tl.arange(0, SPARSE_BLOCK)
    if EVEN_D:  # a constant mask along the head dim, so the key loads vectorize (and pipeline)
        dim_ok = tl.full([BLOCK_D], 1, tl.int1)
    else:
        dim_ok = dims < Di
    q = tl.load(
        q_ptr + n[:, None] * stride_qn + head[:, None] * stride_qh + dims[None, :] * stride_qd,
        mask=lane_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    q_lo = q
    q_scale = tl.zeros([BLOCK_M], dtype=tl.float32)
    if FP8:  # the query as an FP8 pair: q ~ q_scale * (hi + lo / 16), about bf16's precision
        qf = q.to(tl.float32)
        q_amax = tl.max(tl.abs(qf), 1)
        q_scale = tl.where(q_amax > 0, q_amax / 448.0, 1.0)
        qn = qf / q_scale[:, None]
        q = round_to_e4m3(qn, INTERPRETED)
        q_lo = round_to_e4m3((qn - q.to(tl.float32)) * 16.0, INTERPRETED)
    out_row = out_ptr + (head * N + n) * M  # [BLOCK_M] pointers to each lane's score row
    if PAIR:  # one operand of 2 * BLOCK_M columns: the lanes' hi parts, then their lo parts
        # (arranged in float32 and converted back, which is exact: the same arrangement of the FP8
        # values themselves gave wrong scores on the H200 with Triton 3.6)
        both = tl.join(q.to(tl.float32), q_lo.to(tl.float32))  # [BLOCK_M, BLOCK_D, 2]
        both = tl.reshape(tl.permute(both, (2, 0, 1)), (2 * BLOCK_M, BLOCK_D))
        q = tl.trans(both).to(q.dtype)
        q_lo = q
    elif TOK_M:
        q = tl.trans(q)
        q_lo = tl.trans(q_lo)

    first = chunk * blocks_per_program
    last = tl.minimum(first + blocks_per_program, M)
    if CHECK:  # (decode only; before the scores, so that the host hears early)
        _check_decode_values(
            req_ptr, stride_r, bt_ptr, stride_bb, stride_bm, (t // TILES_PER_REQ).to(tl.int64), first, last, M,
            num_blocks, flags_ptr, SPARSE_BLOCK,
        )  # fmt: skip
        signal_done(count_ptr, done_ptr)
    scored_until = tl.minimum(last, tl.reduce(valid, 0, _max))  # blocks past every lane's candidates are -inf
    tile_req = (t // TILES_PER_REQ).to(tl.int64)  # decode: the tile's one request
    tile_p = tl.reduce(p, 0, _max)  # the last position of any lane
    if INTERPRETED or PREFILL:
        # (while loops, not range(): Triton's interpreter cannot take a runtime loop bound)
        b = first
        while b < scored_until:
            _score_block(
                b, q, q_lo, q_scale, p, valid, req, tile_req, tile_p, lane_ok, out_row, cache_ptr, stride_cb, stride_ct,
                scale_ptr, stride_sb, bt_ptr, stride_bb, stride_bm, num_blocks, init_blocks, local_blocks, tok, dims,
                dim_ok, PREFILL, FORCE, IEEE, FP8, SPARSE_BLOCK, TOK_M, PAIR,
            )  # fmt: skip
            b += 1
    else:  # compiled decode: one key tile per block, loads pipelined NUM_STAGES deep
        for b in tl.range(first, scored_until, num_stages=NUM_STAGES):
            _score_block(
                b, q, q_lo, q_scale, p, valid, req, tile_req, tile_p, lane_ok, out_row, cache_ptr, stride_cb, stride_ct,
                scale_ptr, stride_sb, bt_ptr, stride_bb, stride_bm, num_blocks, init_blocks, local_blocks, tok, dims,
                dim_ok, PREFILL, FORCE, IEEE, FP8, SPARSE_BLOCK, TOK_M, PAIR,
            )  # fmt: skip
    minus_inf = tl.full([BLOCK_M], float("-inf"), tl.float32)
    b = tl.maximum(first, scored_until)
    while b < last:
        tl.store(out_row + b, minus_inf, mask=lane_ok)
        b += 1


@triton.jit
def _check_decode_values(
    seq_ptr, stride_s, bt_ptr, stride_bb, stride_bm, r, first, last, M, num_blocks, flags_ptr,
    SPARSE_BLOCK: tl.constexpr,
):  # fmt: skip
    """A decode program's share of :func:`mm3lab.indexer.checks.check_decode_values`: request ``r``'s
    ``seq_len`` fits its ``M`` blocks (else ``flags[0]``), and its block-table entries ``first .. last - 1``
    that the request reads (``ceil(seq_len / 128)`` from column 0, at most ``M``) lie in the cache (else
    ``flags[1]``). The programs of a launch share out every request and every column, so together they
    make the whole check."""
    CHECK_COLS: tl.constexpr = 128
    seq_len = tl.load(seq_ptr + r * stride_s).to(tl.int64)
    used = (tl.minimum(tl.maximum(seq_len, 0), M * SPARSE_BLOCK) + SPARSE_BLOCK - 1) // SPARSE_BLOCK
    until = tl.minimum(last, used)
    outside = tl.zeros([CHECK_COLS], dtype=tl.int32)
    c = first
    while c < until:  # (a while loop: the interpreter cannot run range() with runtime bounds)
        cols = c + tl.arange(0, CHECK_COLS)
        inside = cols < until
        ids = tl.load(bt_ptr + r * stride_bb + cols * stride_bm, mask=inside, other=0).to(tl.int64)
        outside = tl.maximum(outside, (inside & ((ids < 0) | (ids >= num_blocks))).to(tl.int32))
        c += CHECK_COLS
    tl.store(flags_ptr, 1, mask=seq_len > M * SPARSE_BLOCK)
    tl.store(flags_ptr + 1, 1, mask=tl.max(outside, 0) > 0)


@triton.jit
def _score_block(
    b,
    q,
    q_lo,
    q_scale,
    p,
    valid,
    req,
    tile_req,
    tile_p,
    lane_ok,
    out_row,
    cache_ptr,
    stride_cb,
    stride_ct,
    scale_ptr,
    stride_sb,
    bt_ptr,
    stride_bb,
    stride_bm,
    num_blocks,
    init_blocks,
    local_blocks,
    tok,
    dims,
    dim_ok,
    PREFILL: tl.constexpr,
    FORCE: tl.constexpr,
    IEEE: tl.constexpr,
    FP8: tl.constexpr,
    SPARSE_BLOCK: tl.constexpr,
    TOK_M: tl.constexpr,
    PAIR: tl.constexpr,
):
    """Score logical block ``b`` for every lane (the block max of its visible dots, SPEC 2) and store it."""
    cand = b < valid
    last_tok = p - b * SPARSE_BLOCK  # the lane sees tokens 0 .. last_tok of this block
    if PREFILL:
        physical = tl.load(bt_ptr + req * stride_bb + b * stride_bm, mask=cand, other=-1).to(tl.int64)
        readable = cand & (physical >= 0) & (physical < num_blocks)  # never read outside the cache
        # One key tile per distinct physical block among the lanes: one for most tiles, more where
        # the tile spans requests.
        if TOK_M:
            dots = tl.zeros([SPARSE_BLOCK, last_tok.shape[0]], dtype=tl.float32)
            seen = tl.zeros([SPARSE_BLOCK, last_tok.shape[0]], dtype=tl.int1)
        else:
            dots = tl.zeros([last_tok.shape[0], SPARSE_BLOCK], dtype=tl.float32)
            seen = tl.zeros([last_tok.shape[0], SPARSE_BLOCK], dtype=tl.int1)
        todo = readable
        cur = tl.reduce(tl.where(todo, physical, num_blocks), 0, _min)
        while cur < num_blocks:
            mine = todo & (physical == cur)
            tile_last = tl.reduce(tl.where(mine, last_tok, -1), 0, _max)
            dots_c, sel = _shared_block_dots(
                q, q_lo, q_scale, cache_ptr, scale_ptr, stride_sb, cur, stride_cb, stride_ct,
                mine, last_tok, tile_last, tok, dims, dim_ok, IEEE, FP8, TOK_M, PAIR,
            )  # fmt: skip
            dots = tl.where(sel, dots_c, dots)
            seen = seen | sel
            todo = todo & (physical != cur)
            cur = tl.reduce(tl.where(todo, physical, num_blocks), 0, _min)
    else:  # decode: every lane of the tile is a row of request tile_req, so one physical block
        phys = tl.load(bt_ptr + tile_req * stride_bb + b * stride_bm).to(tl.int64)
        physical = tl.zeros_like(last_tok) + phys  # (a vector: a scalar bool & a vector bool is not a mask)
        readable = cand & (physical >= 0) & (physical < num_blocks)
        # (an unreadable entry reads block 0, which no lane sees: the load's mask then depends only
        # on the tile's last position, which lets the compiled loop pipeline it)
        phys = tl.where((phys >= 0) & (phys < num_blocks), phys, 0)
        dots, seen = _shared_block_dots(
            q, q_lo, q_scale, cache_ptr, scale_ptr, stride_sb, phys, stride_cb, stride_ct,
            readable, last_tok, tile_p - b * SPARSE_BLOCK, tok, dims, dim_ok, IEEE, FP8, TOK_M, PAIR,
        )  # fmt: skip
    best = tl.reduce(tl.where(seen, dots, float("-inf")), 0 if TOK_M else 1, _max)
    has_nan = tl.reduce(tl.where(seen & (dots != dots), 1, 0), 0 if TOK_M else 1, _max) > 0
    score = tl.where(has_nan, float("nan"), best)
    if FORCE:
        blk = tl.zeros_like(valid) + b
        score = tl.where(score > _RAW_LIMIT, _RAW_LIMIT, score)  # clamp (+inf counts as 1e28); NaN stays
        score = tl.where(score < -_RAW_LIMIT, -_RAW_LIMIT, score)
        score = tl.where(cand & (blk < init_blocks), _INIT_SCORE, score)
        score = tl.where(cand & (blk >= valid - local_blocks), _LOCAL_SCORE, score)
        score = tl.where(score != score, _NAN_SCORE, score)
    score = tl.where(cand, score, float("-inf"))
    tl.store(out_row + b, score, mask=lane_ok)


def _num_sms(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


DEFAULT_STAGES = {"bf16": 5, "fp8": 6}
"""Key tiles in flight in the compiled decode loop, by index-key dtype. In the ``indexer_tuning``
suite at batch 64, 128K on the H200, bf16 keys are fastest with 5 (0.48 ms; 2 to 4 stages are
6 to 10% slower); with FP8 keys, paired, 2 to 6 stages lie within 7% of each other (0.27 to
0.29 ms) and the order changes from run to run."""


def index_scores_kernel(
    index_q,
    index_cache,
    block_table,
    req,
    pos,
    dql,
    prefill,
    init_blocks,
    local_blocks,
    forced,
    out,
    *,
    index_scale=None,
    block_q: int | None = None,
    blocks_per_program: int | None = None,
    num_stages: int | None = None,
    num_warps: int | None = None,
    tok_m: bool | None = None,
    pair_parts: bool | None = None,
    check=None,
) -> None:
    """Launch the scoring kernel into ``out [H, N, M]`` float32 (arguments already validated).

    ``check``: decode rows only (``N``, ``H`` and ``M`` above 0), ``(flags, count, done)``
    (:class:`mm3lab._valcheck.Fused`): every program first checks its share of the call's values (its
    request's ``seq_len`` and the block-table entries of its chunk that the request reads), sets
    ``flags[0]`` / ``flags[1]`` for a bad ``seq_len`` / entry, and the last program to finish its
    checks sets ``done``; the scores are computed either way (they never read outside the cache).

    ``block_q`` (rows per tile) and ``blocks_per_program`` (blocks per chunk) override the
    host-side heuristic; tests use them to reach every code path with small shapes. The heuristic
    gives every SM programs; where the blocks are few it goes down to one block a program, about
    two programs an SM (a short context at batch 1: the launch's time is then one program's path).
    ``tok_m`` computes the dots as tokens x lanes (default: for FP8 keys, whose ``tl.dot`` then
    runs on Hopper's FP8 warp-group MMA instead of upcasting to fp16) rather than lanes x tokens.
    ``num_stages``: key tiles in flight in a compiled decode loop (default
    :data:`DEFAULT_STAGES`, by key dtype). ``pair_parts`` forces (or
    forbids) one dot for an FP8 query's hi and lo parts (default: tokens x lanes tiles of at
    most 8 lanes).

    The defaults (5 stages for bf16 keys, 6 for FP8; tokens x lanes for FP8 keys only) are what the ``indexer_tuning``
    benchmark suite compares against every other setting at batch 64, 128K on the GPU. The
    ``fp8`` suite's records of this launch: bf16 keys 0.48 ms (1.06x copy bandwidth, a
    read-only stream), FP8 keys 0.29 ms (0.92x), on the H200.

    ``num_warps``: default 8 for a prefill tile of 64 query lanes, else 4. With 4 warps that tile
    takes all 255 registers a thread may have and spills; the ``indexer_prefill_tuning`` suite
    (one 4096-token chunk at 32K, H200) measured 8 warps 1.46x faster with bf16 keys (2.23
    against 3.26 ms) and 1.22x with FP8 keys (3.04 against 3.71 ms).
    """
    n, h, di = index_q.shape
    b, m = block_table.shape
    if check is not None and (prefill or n == 0 or h == 0 or m == 0):
        raise ValueError("check: decode rows only, with N, H and M above 0")
    if n == 0 or h == 0 or m == 0:
        return
    block_h = next_power_of_2(h)
    group = n if prefill else dql
    fp8 = index_scale is not None
    tok_m = fp8 if tok_m is None else tok_m
    # the given depth, or the default coming down where it does not fit the GPU's shared memory (float32
    # keys at 5 stages take 136 KiB: more than RTX 30xx/40xx, A10, L4, L40S give a program)
    depths = (num_stages,) if num_stages else sorted({DEFAULT_STAGES["fp8" if fp8 else "bf16"], 3, 2, 1}, reverse=True)
    if block_q is None:
        block_q = max(1, min(next_power_of_2(group), 64 // block_h))
        # FP8 tokens x lanes, 8 lanes or fewer: the hi and lo parts share one 16-column dot
        pair = fp8 and tok_m and block_q * block_h <= 8
    else:
        pair = False
    pair = (pair if pair_parts is None else pair_parts) and tok_m  # the pair is a tokens x lanes operand
    if pair:
        block_q = 8 // block_h
    else:
        block_q = max(block_q, 16 // block_h)  # tl.dot needs at least 16 lanes
    if index_q.dtype == torch.float32 and not fp8:
        # float32 scores use the exact (FMA, not TF32) dot; on the H200 it compiled at 16 lanes but
        # not at 32, so float32 tiles stay at 16 lanes (float32 is the reference dtype, not the fast one).
        block_q = max(1, 16 // block_h)
    elif block_q * block_h == 32:
        block_q *= 2  # 16 or 64 lanes: the shapes the MMA path was checked with
    if num_warps is None:
        num_warps = 8 if prefill and block_q * block_h >= 64 else 4
    if prefill:
        tiles, tiles_per_req = cdiv(n, block_q), 1
    else:
        tiles_per_req = cdiv(dql, block_q)
        tiles = b * tiles_per_req
    if blocks_per_program is not None:
        blocks_per_program = max(1, min(blocks_per_program, m))
    elif backend.INTERPRETER or index_q.device.type != "cuda":
        blocks_per_program = m  # few, long programs: the interpreter pays per program
    else:
        # enough programs to fill every SM, even at batch 1 (FP8 keys: twice as many, each half as
        # long, since a block is half the bytes); where the blocks are few (a short context at small
        # batch) down to one block a program, so that about two programs per SM share them
        sms = _num_sms(index_q.device)
        target = (16 if fp8 else 8) * sms
        blocks_per_program = min(max(4, cdiv(tiles * m, target)), cdiv(tiles * m, 2 * sms))
    chunks = cdiv(m, blocks_per_program)
    if block_table.numel() == 0:
        block_table = torch.zeros(1, 1, dtype=torch.int32, device=index_q.device)
    block_d = max(32 if fp8 else 16, next_power_of_2(di))
    fitting(_index_scores, "NUM_STAGES", depths)[(tiles, chunks)](
        index_q,
        *index_q.stride(),
        index_cache,
        index_cache.stride(0),
        index_cache.stride(1),
        block_table,
        *block_table.stride(),
        req,
        req.stride(0),
        pos,
        pos.stride(0),
        out,
        index_scale if fp8 else out,
        index_scale.stride(0) if fp8 else 0,
        n,
        h,
        di,
        b,
        m,
        index_cache.shape[0],
        dql,
        tiles_per_req,
        blocks_per_program,
        init_blocks,
        local_blocks,
        *((block_table,) * 3 if check is None else check),
        PREFILL=prefill,
        FORCE=forced,
        IEEE=index_q.dtype == torch.float32 and not fp8,
        FP8=fp8,
        INTERPRETED=backend.INTERPRETER,
        BLOCK_Q=block_q,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        SPARSE_BLOCK=SPARSE_BLOCK_SIZE,
        EVEN_D=block_d == di,
        TOK_M=tok_m,
        PAIR=pair,
        CHECK=check is not None,
        num_warps=num_warps,
        **_pdl.options(index_q.device),
    )


# --- top-k ----------------------------------------------------------------------------------


@triton.jit
def _order_keys(s, col, cand):
    """int64 keys ordered as (score descending, id ascending); ``KEY_NONE`` where not a candidate."""
    s = s.to(tl.float32)
    s = tl.where(s != s, _NAN_SCORE, s)  # NaN counts as -1e30
    s = tl.where(s == 0.0, 0.0, s)  # -0.0 ties with +0.0
    bits = s.to(tl.int32, bitcast=True)
    monotone = bits ^ tl.where(bits < 0, 0x7FFFFFFF, 0)  # signed-int order == float order
    key = (monotone.to(tl.int64) << 32) | (0x7FFFFFFF - col).to(tl.int64)
    return tl.where(cand, key, _KEY_NONE)


@triton.jit
def _key_ids(keys):
    """Block ids of top-k keys; ``-1`` for ``KEY_NONE`` (fewer candidates than picks)."""
    return tl.where(keys == _KEY_NONE, -1, 0x7FFFFFFF - (keys - ((keys >> 32) << 32))).to(tl.int32)


@triton.jit
def _top_keys(keys, K, BLOCK_R: tl.constexpr, K_BLOCK: tl.constexpr, BITONIC: tl.constexpr):
    """The ``K_BLOCK`` largest of ``keys [BLOCK_R, W]`` per row, descending (lanes >= K: any order
    with ``"rounds"``, which fills only the first ``K``)."""
    if BITONIC:
        top = tl.topk(keys, K_BLOCK, dim=1)
    else:  # one max-reduction per pick, over the keys below the previous pick
        slots = tl.arange(0, K_BLOCK)
        top = tl.full([BLOCK_R, K_BLOCK], _KEY_NONE, tl.int64)
        prev = tl.full([BLOCK_R], _KEY_MAX, tl.int64)
        k = 0
        while k < K:  # (a while loop: Triton's interpreter cannot take a runtime range bound)
            best = tl.reduce(tl.where(keys < prev[:, None], keys, _KEY_NONE), 1, _max)
            top = tl.where(slots[None, :] == k, best[:, None], top)
            prev = best
            k += 1
    return top


@triton.jit
def _row_positions(
    row,
    row_ok,
    N,
    W,
    req_ptr,
    stride_r,
    pos_ptr,
    stride_p,
    B,
    DQL,
    CAUSAL: tl.constexpr,
    PREFILL: tl.constexpr,
    SPARSE_BLOCK: tl.constexpr,
):
    """``(n, request, p, valid)`` of flattened rows ``h * N + n``: candidates are 0 .. valid - 1."""
    n = row % N
    if CAUSAL:
        req, p = row_request_position(n, row_ok, req_ptr, stride_r, pos_ptr, stride_p, B, DQL, PREFILL)
        valid = tl.where(p >= 0, tl.minimum(p // SPARSE_BLOCK + 1, W), 0)
    else:
        req = tl.zeros_like(row)
        p = tl.full(row.shape, -1, tl.int64)
        valid = tl.where(row_ok, W, 0)
    return n, req, p, valid


@triton.jit
def _topk_rows(
    scores_ptr,  # [H, N, W] float scores, any strides
    stride_sh,
    stride_sn,
    stride_sw,
    topk_ptr,  # [H, N, K] int32 out, contiguous
    H,
    N,
    W,
    K,
    req_ptr,
    stride_r,  # prefill: [N] query_req_id; decode: [B] seq_lens (CAUSAL only)
    pos_ptr,
    stride_p,
    B,
    DQL,
    bt_ptr,
    stride_bb,
    stride_bm,
    M,  # block_table (EMIT_TABLE only)
    sbt_ptr,  # [H, N, K * 8] int32 out (EMIT_TABLE only)
    ctx_ptr,  # [H, N] int32 out (EMIT_TABLE only)
    CAUSAL: tl.constexpr,  # False: every column a candidate; True: the rows' positions bound them
    PREFILL: tl.constexpr,  # (CAUSAL) prefill rows, else decode rows
    EMIT_TABLE: tl.constexpr,
    BLOCK_R: tl.constexpr,  # (head, row) pairs per program
    BLOCK_W: tl.constexpr,
    ONE_CHUNK: tl.constexpr,
    GROUP: tl.constexpr,  # > 1: select groups of GROUP columns by their maxima first
    BITONIC: tl.constexpr,
    K_BLOCK: tl.constexpr,
    BLOCK_PAGE_STRIDE: tl.constexpr,
    SPARSE_BLOCK: tl.constexpr,
    PAGES: tl.constexpr,
    PDL: tl.constexpr,
):
    _pdl.wait_previous(PDL)
    ridx = tl.arange(0, BLOCK_R)
    row = tl.program_id(0).to(tl.int64) * BLOCK_R + ridx  # flattened h * N + n
    row_ok = row < H * N
    n, req, p, valid = _row_positions(
        row, row_ok, N, W, req_ptr, stride_r, pos_ptr, stride_p, B, DQL, CAUSAL, PREFILL, SPARSE_BLOCK
    )
    h = row // N
    row_ptr = scores_ptr + h * stride_sh + n * stride_sn  # [BLOCK_R]
    cols = tl.arange(0, BLOCK_W)
    slots = tl.arange(0, K_BLOCK)
    if ONE_CHUNK:  # the whole row in registers, read once
        cand = cols[None, :] < valid[:, None]
        s = tl.load(row_ptr[:, None] + cols[None, :] * stride_sw, mask=cand, other=0.0)
        keys = _order_keys(s, cols[None, :], cand)
        if GROUP > 1:
            # The top K lie in the K groups of GROUP columns with the largest maxima (a group
            # outside them is beaten by K larger group maxima, each a distinct column): select
            # those groups, then the top K of their K * GROUP columns, read again.
            group_max = tl.reduce(tl.reshape(keys, [BLOCK_R, BLOCK_W // GROUP, GROUP]), 2, _max)
            best_col = _key_ids(_top_keys(group_max, K, BLOCK_R, K_BLOCK, BITONIC))  # [BLOCK_R, K_BLOCK]
            first = tl.where(best_col >= 0, best_col - best_col % GROUP, W)  # W: no group, nothing read
            c2 = tl.reshape(first[:, :, None] + tl.arange(0, GROUP)[None, None, :], [BLOCK_R, K_BLOCK * GROUP])
            cand2 = c2 < valid[:, None]
            s2 = tl.load(row_ptr[:, None] + c2 * stride_sw, mask=cand2, other=0.0)
            keys = _order_keys(s2, c2, cand2)
        blk = _key_ids(_top_keys(keys, K, BLOCK_R, K_BLOCK, BITONIC))
    else:  # wider rows: every round reads the row again, chunk by chunk
        blk = tl.full([BLOCK_R, K_BLOCK], -1, tl.int32)
        prev = tl.full([BLOCK_R], _KEY_MAX, tl.int64)  # the previous pick's key: every candidate is below it
        k = 0
        while k < K:
            best = tl.full([BLOCK_R], _KEY_NONE, tl.int64)
            start = 0
            while start < W:
                c = start + cols
                cand = c[None, :] < valid[:, None]
                s = tl.load(row_ptr[:, None] + c[None, :] * stride_sw, mask=cand, other=0.0)
                keys = _order_keys(s, c[None, :], cand)
                best = tl.maximum(best, tl.reduce(tl.where(keys < prev[:, None], keys, _KEY_NONE), 1, _max))
                start += BLOCK_W
            blk = tl.where(slots[None, :] == k, _key_ids(best)[:, None], blk)
            prev = best
            k += 1
    tl.store(topk_ptr + row[:, None] * K + slots[None, :], blk, mask=row_ok[:, None] & (slots[None, :] < K))
    if EMIT_TABLE:
        for r in tl.static_range(BLOCK_R):
            this = ridx == r
            row_r = tl.reduce(tl.where(this, row, 0), 0, _max)
            if row_r < H * N:
                blk_r = tl.reduce(tl.where(this[:, None], blk, -1), 0, _max)  # [K_BLOCK], row r's ids
                p_r = tl.reduce(tl.where(this, p, -1), 0, _max)
                req_r = tl.reduce(tl.where(this, req, 0), 0, _max)
                bt_row = bt_ptr + req_r * stride_bb
                out_row = sbt_ptr + row_r * (K * PAGES)
                ctx = emit_sparse_block_table_row(
                    blk_r, p_r, bt_row, stride_bm, M, out_row, K, K_BLOCK, BLOCK_PAGE_STRIDE, SPARSE_BLOCK, PAGES
                )
                tl.store(ctx_ptr + row_r, ctx)


def topk_kernel(
    scores,
    topk,
    topk_idx,
    *,
    positions=0,
    req=None,
    pos=None,
    batch=0,
    dql=1,
    block_table=None,
    block_page_stride=PAGES_PER_SPARSE_BLOCK,
    sparse_bt=None,
    sparse_ctx=None,
    max_register_row: int = MAX_REGISTER_ROW,
    rows_per_program: int | None = None,
    algorithm: str | None = None,
    num_warps: int | None = None,
    group: int | None = None,
) -> None:
    """Launch the top-k (optionally fused with the sparse block table) over ``scores [H, N, W]``.

    ``positions``: 0 = every column a candidate, 1 = decode rows (``req`` = seq_lens),
    2 = prefill rows (``req`` = query_req_id, ``pos`` = query_abs_pos). With
    ``block_table`` given, also writes ``sparse_bt`` / ``sparse_ctx``. Rows wider than
    ``max_register_row`` (a power of 2) are read in chunks of that width each round.
    ``rows_per_program`` overrides the host-side heuristic (a power of 2; one row a program where
    the table is emitted, since a program writes its rows' tables one after another). ``algorithm`` picks
    how rows that fit in registers are selected: ``"bitonic"`` (``tl.topk``, the default when
    compiled) or ``"rounds"`` (one max-reduction per pick, the default in the interpreter, which
    runs it several times faster); both give the same answer.

    ``group`` (a power of 2; default ``TOPK_GROUP`` for rows of at least ``64 * k`` columns,
    else 1) first selects the ``k`` groups of ``group`` columns with the largest maxima, then the
    top ``k`` of their columns: a few times less selection work than the whole row, same answer.
    """
    if algorithm is None:
        algorithm = "rounds" if backend.INTERPRETER else "bitonic"
    if algorithm not in ("bitonic", "rounds"):
        raise ValueError(f"algorithm must be 'bitonic' or 'rounds', got {algorithm!r}")
    h, n, w = scores.shape
    if h == 0 or n == 0:
        return
    emit = block_table is not None
    # (arguments a launch does not read are the output itself, stride 0: no view of it, which a
    # recorded launch could not put the next call's output in place of, mm3lab._replay)
    dummy = topk_idx
    req_stride = 0 if req is None else req.stride(0)
    req = dummy if req is None else req
    pos, pos_stride = (req, req_stride) if pos is None else (pos, pos.stride(0))
    if emit:
        m = block_table.shape[1]
        if block_table.numel() == 0:
            block_table = torch.zeros(1, 1, dtype=torch.int32, device=scores.device)
        bt_strides = block_table.stride()
    else:
        m, block_table, bt_strides, sparse_bt, sparse_ctx = 0, dummy, (0, 0), dummy, dummy
    k_block = max(2, next_power_of_2(topk))  # (tl.topk needs k >= 2)
    block_w = max(16, k_block, min(next_power_of_2(max(w, 1)), max_register_row))
    rows = h * n
    bitonic = algorithm == "bitonic"
    if rows_per_program is None:
        if backend.INTERPRETER:  # few programs: the interpreter pays per program and per operation
            rows_per_program = max(1, min(next_power_of_2(rows), 16384 // block_w))
        else:
            # one row a program where it emits the table: each program writes its rows' tables one
            # after another, so fewer rows a program is the shorter path
            rows_per_program = 1 if emit else max(1, min(next_power_of_2(rows), 2048 // block_w, 64))
    if group is None:
        group = TOPK_GROUP if block_w >= 64 * k_block else 1
    if group < 1 or (group > 1 and (group & (group - 1) or block_w // group < k_block)):
        raise ValueError(
            f"group must be a power of 2 with at least {k_block} groups in a row of {block_w}, got {group}"
        )
    tile = rows_per_program * block_w
    _topk_rows[(cdiv(rows, rows_per_program),)](
        scores,
        *scores.stride(),
        topk_idx,
        h,
        n,
        w,
        topk,
        req,
        req_stride,
        pos,
        pos_stride,
        batch,
        dql,
        block_table,
        *bt_strides,
        m,
        sparse_bt,
        sparse_ctx,
        CAUSAL=positions != 0,
        PREFILL=positions == 2,
        EMIT_TABLE=emit,
        BLOCK_R=rows_per_program,
        BLOCK_W=block_w,
        ONE_CHUNK=w <= block_w,
        GROUP=group,
        BITONIC=bitonic,
        K_BLOCK=k_block,
        BLOCK_PAGE_STRIDE=block_page_stride,
        SPARSE_BLOCK=SPARSE_BLOCK_SIZE,
        PAGES=PAGES_PER_SPARSE_BLOCK,
        num_warps=num_warps or (8 if tile >= 4096 and group == 1 else (4 if tile >= 1024 or emit else 2)),
        **_pdl.options(scores.device),
    )


__all__ = ["MAX_REGISTER_ROW", "TOPK_GROUP", "index_scores_kernel", "topk_kernel"]
