"""Pure-PyTorch twins of every mm3lab entry point, same names, same signatures.

Each is written as plain loops in the SPEC's terms: it is the specification
the Triton kernels are tested against, and the code to read when a kernel's
behaviour is in question. They run on any device, slowly. Each takes its entry
point's signature (:mod:`mm3lab._twin`: parameters and defaults are stated once, at
the entry point); its body names the arguments it reads. By step: layout
(SPEC 4), block table (SPEC 3), index cache and indexer (SPEC 2, steps 1-3),
attention (SPEC 5), and the whole layer, ``msa_decode`` / ``msa_prefill`` (SPEC 2).
"""

from ..attention.reference import dense_masked_attention, sparse_attention  # noqa: F401
from ..block_table.reference import (  # noqa: F401
    attended_ranges,
    attended_tokens,
    build_sparse_block_table_decode,
    build_sparse_block_table_prefill,
    decode_positions,
    plan_sparse_row,
    sparse_block_table_row,
)
from ..constants import PAGE16_SIDES_PER_BLOCK, PAGE_SIZE, PAGES_PER_SPARSE_BLOCK, SPARSE_BLOCK_SIZE  # noqa: F401
from ..index_cache.reference import insert_index_cache, token_slots  # noqa: F401
from ..indexer.reference import *  # noqa: F403  (the names of its __all__: entry point twins and row helpers)
from ..layout.reference import (  # noqa: F401
    rebase_block_table_to_page16,
    rebase_slot_mapping_to_page16,
    write_kv_page16,
)
from ..layout.views import sides_are_packed, sparse_block_page_stride  # noqa: F401  (metadata only: one definition)
from ..msa.reference import msa_decode, msa_prefill  # noqa: F401
