"""The upstream vLLM ``minimax_m3`` entry points, with their shapes (SPEC section 6).

Upstream selection has a single head (H = 1): ``topk_idx`` is ``[1, N, K]`` and
the outputs drop the head dimension. Each function validates that and calls
the mm3lab entry point of the same meaning.
"""

from __future__ import annotations

import torch

from ..layout import rebase_block_table_to_page16, sparse_block_page_stride

__all__ = [
    "minimax_m3_rebase_block_table_to_page16",
    "minimax_m3_sparse_block_page_stride",
]


def minimax_m3_rebase_block_table_to_page16(block_table: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Upstream name of :func:`mm3lab.rebase_block_table_to_page16`."""
    return rebase_block_table_to_page16(block_table, out=out)


def minimax_m3_sparse_block_page_stride(k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    """Upstream name of :func:`mm3lab.sparse_block_page_stride`."""
    return sparse_block_page_stride(k_cache, v_cache)


# --- sparse block table (SPEC section 3) ---
# --- index cache (SPEC section 2, step 1) ---
