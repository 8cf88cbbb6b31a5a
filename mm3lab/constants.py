"""The model's fixed numbers (SPEC section 1 and 4).

Everything in mm3lab is written in terms of these names; nothing else in the
package hard-codes 128, 16 or 8.
"""

SPARSE_BLOCK_SIZE = 128
"""Tokens per sparse (selection) block, and per page-128 KV-cache block."""

PAGE_SIZE = 16
"""Tokens per page-16 page, the unit the sparse attention kernel reads."""

PAGES_PER_SPARSE_BLOCK = SPARSE_BLOCK_SIZE // PAGE_SIZE
"""Page-16 pages in one 128-token block: 8."""

PAGE16_SIDES_PER_BLOCK = 2
"""K and V: a packed-sides block holds 2 * 8 = 16 pages."""

DEFAULT_TOPK = 16
"""Blocks selected per (query token, KV head) in MiniMax-M3."""

RAW_SCORE_LIMIT = 1e28
"""Raw block scores are clamped to ``[-RAW_SCORE_LIMIT, RAW_SCORE_LIMIT]`` before forcing (``+inf`` counts as 1e28)."""

INIT_SCORE = 1e30
"""Score given to a forced init block (``b < init_blocks``)."""

LOCAL_SCORE = 1e29
"""Score given to a forced local block (``b >= valid - local_blocks``); applied after INIT_SCORE."""

NAN_SCORE = -1e30
"""What a NaN block score counts as during top-k."""

MAX_CONTEXT = 1 << 20
"""Longest context of the model: 1,048,576 tokens = 8192 blocks."""

# The model's attention shape (SPEC section 1), used as defaults by demos and benchmarks.
NUM_Q_HEADS = 64
NUM_KV_HEADS = 4
HEAD_DIM = 128
INDEX_HEAD_DIM = 128
