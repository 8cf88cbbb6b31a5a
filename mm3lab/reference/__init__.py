"""Pure-PyTorch twins of every mm3lab entry point, same names, same signatures.

Each is written as plain loops in the SPEC's terms: it is the specification
the Triton kernels are tested against, and the code to read when a kernel's
behaviour is in question. They run on any device, slowly.
"""

from ..constants import PAGE16_SIDES_PER_BLOCK, PAGE_SIZE, PAGES_PER_SPARSE_BLOCK, SPARSE_BLOCK_SIZE  # noqa: F401
from ..layout.reference import (  # noqa: F401
    rebase_block_table_to_page16,
    rebase_slot_mapping_to_page16,
    write_kv_page16,
)
from ..layout.views import sides_are_packed, sparse_block_page_stride  # noqa: F401  (metadata only: one definition)

# --- sparse block table (SPEC section 3) ---
# --- index cache and indexer (SPEC section 2, steps 1-3) ---
# --- sparse paged attention and the MSA step (SPEC section 5) ---
