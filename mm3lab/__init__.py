"""mm3lab: MiniMax-M3's sparse paged attention (MSA), made visible.

Every step of one MSA layer has a Triton kernel (exported here) and a readable
pure-PyTorch twin of the same name in :mod:`mm3lab.reference`; the upstream
vLLM entry points live in :mod:`mm3lab.compat.vllm`. ``SPEC.md``'s section
numbers are quoted in the docstrings.

How kernels run (compiled Triton, Triton's interpreter, or PyTorch) is decided
once by :mod:`mm3lab.backend`, which must be imported before Triton; importing
mm3lab does that.
"""

__version__ = "0.1.0"

from . import backend  # noqa: E402,F401,I001  (first: sets TRITON_INTERPRET before any kernel module imports triton)
from ._checks import validation, validation_enabled  # noqa: E402
from .backend import get_backend, info, set_backend, use_backend  # noqa: E402
from .constants import (  # noqa: E402
    DEFAULT_TOPK,
    PAGE16_SIDES_PER_BLOCK,
    PAGE_SIZE,
    PAGES_PER_SPARSE_BLOCK,
    SPARSE_BLOCK_SIZE,
)
from .layout import (  # noqa: E402
    LAYOUTS,
    PagedKVCache,
    PageLocation,
    allocate_kv_cache,
    check_kv_views,
    kv_cache_layout,
    locate_page,
    page16_views,
    page_ids_of_block,
    rebase_block_table_to_page16,
    rebase_slot_mapping_to_page16,
    sides_are_packed,
    slot_to_page,
    sparse_block_page_stride,
    write_kv_page16,
)

# --- sparse block table (SPEC section 3) ---
from .block_table import (  # noqa: E402
    attended_tokens,
    build_sparse_block_table_decode,
    build_sparse_block_table_prefill,
    plan_sparse_row,
)

# --- index cache and indexer (SPEC section 2, steps 1-3) ---
from .index_cache import allocate_index_cache, allocate_index_scale, insert_index_cache, token_slots  # noqa: E402
from .indexer import (  # noqa: E402
    index_scores_decode,
    index_scores_prefill,
    index_topk_block_table_decode,
    index_topk_block_table_prefill,
    index_topk_decode,
    index_topk_prefill,
    topk_blocks,
)

# --- sparse paged attention and the MSA step (SPEC section 5) ---
from .attention import dense_masked_attention, sparse_attention  # noqa: E402
from .msa import MSAStep, dense_decode, dense_prefill, msa_decode, msa_prefill  # noqa: E402

# --- plans: shapes fixed, validated and allocated once (SPEC section 8) ---
from .plan import MSADecodePlan, MSAPrefillPlan  # noqa: E402

from . import compat, reference, testing  # noqa: E402,F401  (mm3lab.reference.<name> after a plain import mm3lab)

from ._twin import bind_signatures  # noqa: E402

bind_signatures()  # each reference twin shows its entry point's signature (mm3lab._twin)
