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
from ..block_table import build_sparse_block_table_decode, build_sparse_block_table_prefill  # noqa: E402
from ..constants import PAGES_PER_SPARSE_BLOCK  # noqa: E402

__all__ += ["minimax_m3_build_sparse_block_table_decode", "minimax_m3_build_sparse_block_table_prefill"]


def _one_head(build, topk_idx, *args) -> tuple[torch.Tensor, torch.Tensor]:
    """``build`` (an mm3lab sparse block table entry point) on a one-head selection, the head dimension dropped."""
    if isinstance(topk_idx, torch.Tensor) and (topk_idx.dim() != 3 or topk_idx.shape[0] != 1):
        raise ValueError(
            f"topk_idx: the upstream entry points take one selection head, shape [1, N, K]; "
            f"got {tuple(topk_idx.shape)} (use mm3lab.build_sparse_block_table_* for H > 1)"
        )
    sparse_bt, sparse_ctx = build(topk_idx, *args)
    return sparse_bt[0], sparse_ctx[0]


def minimax_m3_build_sparse_block_table_decode(
    topk_idx: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    decode_query_len: int = 1,
    block_page_stride: int = PAGES_PER_SPARSE_BLOCK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Upstream name of :func:`mm3lab.build_sparse_block_table_decode`: ``topk_idx [1, N, K]`` ->
    ``(sparse_bt [N, K * 8], sparse_ctx [N])`` int32."""
    return _one_head(
        build_sparse_block_table_decode, topk_idx, block_table, seq_lens, decode_query_len, block_page_stride
    )


def minimax_m3_build_sparse_block_table_prefill(
    topk_idx: torch.Tensor,
    block_table: torch.Tensor,
    query_req_id: torch.Tensor,
    query_abs_pos: torch.Tensor,
    block_page_stride: int = PAGES_PER_SPARSE_BLOCK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Upstream name of :func:`mm3lab.build_sparse_block_table_prefill`, one head, as the decode one."""
    return _one_head(
        build_sparse_block_table_prefill, topk_idx, block_table, query_req_id, query_abs_pos, block_page_stride
    )


# --- index cache (SPEC section 2, step 1) ---
from ..index_cache import insert_index_cache  # noqa: E402

__all__ += ["minimax_m3_insert_index_cache"]


def minimax_m3_insert_index_cache(
    index_k: torch.Tensor, index_cache: torch.Tensor, index_slot_mapping: torch.Tensor
) -> None:
    """Upstream name of :func:`mm3lab.insert_index_cache`: ``index_k [N, Di]`` into
    ``index_cache [num_blocks, 128, Di]`` at ``index_slot_mapping [N]`` (negative = padding), in place."""
    insert_index_cache(index_k, index_cache, index_slot_mapping)
