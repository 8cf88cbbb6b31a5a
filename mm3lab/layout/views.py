"""Page-16 views of a page-128 KV cache: allocation, layout recognition, page-id mapping.

See the package docstring of :mod:`mm3lab.layout` for the two layouts.
"""

from __future__ import annotations

import dataclasses

import torch

from .._checks import FLOAT_DTYPES, check_int, check_last_dim_contiguous, check_same_device, check_tensor
from ..constants import PAGE16_SIDES_PER_BLOCK, PAGE_SIZE, PAGES_PER_SPARSE_BLOCK, SPARSE_BLOCK_SIZE

LAYOUTS = ("dense", "packed")
DENSE_STRIDE = PAGES_PER_SPARSE_BLOCK  # 8 page ids per block
PACKED_STRIDE = PAGES_PER_SPARSE_BLOCK * PAGE16_SIDES_PER_BLOCK  # 16 page ids per block


def _check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected 'dense' or 'packed', got {layout!r}")
    return layout


def layout_block_page_stride(layout: str) -> int:
    """Page ids per physical block: 8 for ``"dense"``, 16 for ``"packed"``."""
    return DENSE_STRIDE if _check_layout(layout) == "dense" else PACKED_STRIDE


# ----------------------------------------------------------------------------
# allocation and views
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    """A page-128 KV cache and its page-16 views (all sharing one storage).

    Attributes:
        kv: ``[num_blocks, 2, 128, H, D]``, the logical page-128 tensor.
        k_cache, v_cache: ``[pages, 16, H, D]`` page-16 views of the K and V sides.
        layout: ``"dense"`` or ``"packed"``.
    """

    kv: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    layout: str

    @property
    def num_blocks(self) -> int:
        return self.kv.shape[0]

    @property
    def block_page_stride(self) -> int:
        return layout_block_page_stride(self.layout)

    @property
    def num_kv_heads(self) -> int:
        return self.kv.shape[3]

    @property
    def head_dim(self) -> int:
        return self.kv.shape[4]

    @property
    def page_bytes(self) -> int:
        return PAGE_SIZE * self.num_kv_heads * self.head_dim * self.kv.element_size()


def allocate_kv_cache(
    num_blocks: int,
    num_kv_heads: int,
    head_dim: int,
    layout: str = "dense",
    *,
    dtype: torch.dtype = torch.float32,
    device="cpu",
    fill: float | None = None,
) -> PagedKVCache:
    """Allocate a page-128 KV cache in one of the two memory orders.

    Args:
        num_blocks: physical 128-token blocks.
        num_kv_heads, head_dim: ``H`` and ``D``.
        layout: ``"dense"`` (side-major planes) or ``"packed"`` (block-major sides).
        fill: initial value (``None`` leaves memory uninitialized).
    Returns:
        a :class:`PagedKVCache` whose ``kv`` has logical shape ``[num_blocks, 2, 128, H, D]``.
    """
    _check_layout(layout)
    for name, value in (("num_blocks", num_blocks), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
        check_int(name, value, minimum=1)
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype: expected float32, float16 or bfloat16, got {dtype}")
    if layout == "dense":
        storage = torch.empty(2, num_blocks, SPARSE_BLOCK_SIZE, num_kv_heads, head_dim, dtype=dtype, device=device)
        kv = storage.permute(1, 0, 2, 3, 4)
    else:
        kv = torch.empty(num_blocks, 2, SPARSE_BLOCK_SIZE, num_kv_heads, head_dim, dtype=dtype, device=device)
    if fill is not None:
        kv.fill_(fill)
    k_cache, v_cache = page16_views(kv, layout)
    return PagedKVCache(kv, k_cache, v_cache, layout)


def kv_cache_layout(kv_cache: torch.Tensor) -> str:
    """Which memory order a page-128 tensor ``[num_blocks, 2, 128, H, D]`` has.

    With one block both orders are the same memory; that case reports ``"dense"``.
    """
    _check_page128(kv_cache)
    if kv_cache.permute(1, 0, 2, 3, 4).is_contiguous():
        return "dense"
    if kv_cache.is_contiguous():
        return "packed"
    raise ValueError(
        f"kv_cache: strides {kv_cache.stride()} are neither dense planes (side-major) nor packed sides (block-major)"
    )


def _check_page128(kv_cache) -> None:
    check_tensor("kv_cache", kv_cache, ndim=5, dtypes=FLOAT_DTYPES)
    if kv_cache.shape[1] != 2:
        raise ValueError(f"kv_cache: dimension 1 must be the 2 sides (K, V), got shape {tuple(kv_cache.shape)}")
    if kv_cache.shape[2] != SPARSE_BLOCK_SIZE:
        raise ValueError(
            f"kv_cache: dimension 2 must hold {SPARSE_BLOCK_SIZE} tokens so a block divides into "
            f"{PAGES_PER_SPARSE_BLOCK} pages of {PAGE_SIZE}, got shape {tuple(kv_cache.shape)}"
        )


def page16_views(kv_cache: torch.Tensor, layout: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The page-16 views ``(k_cache, v_cache)`` of a page-128 cache, without copies.

    Args:
        kv_cache: ``[num_blocks, 2, 128, H, D]`` in dense-plane or packed-side memory order.
        layout: the order to view it as; ``None`` detects it from the strides.
    Returns:
        dense: ``k_cache, v_cache`` both ``[num_blocks * 8, 16, H, D]``;
        packed: ``k_cache [num_blocks * 16, 16, H, D]`` and ``v_cache [num_blocks * 16 - 8, 16, H, D]``.
    """
    detected = kv_cache_layout(kv_cache)
    if layout is None:
        layout = detected
    _check_layout(layout)
    nb, _, _, h, d = kv_cache.shape
    if nb > 1 and layout != detected:
        raise ValueError(f"kv_cache: its memory order is {detected!r}, not {layout!r}")
    if layout == "dense":
        planes = kv_cache.permute(1, 0, 2, 3, 4)  # [2, nb, 128, h, d], contiguous
        k_cache = planes[0].view(nb * PAGES_PER_SPARSE_BLOCK, PAGE_SIZE, h, d)
        v_cache = planes[1].view(nb * PAGES_PER_SPARSE_BLOCK, PAGE_SIZE, h, d)
    else:
        pages = kv_cache.view(nb * PACKED_STRIDE, PAGE_SIZE, h, d)
        k_cache = pages
        v_cache = pages[PAGES_PER_SPARSE_BLOCK:]
    return k_cache, v_cache


def sides_are_packed(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """True for the packed-sides layout: ``v_cache`` has 8 pages fewer than ``k_cache``."""
    check_tensor("k_cache", k_cache, ndim=4)
    check_tensor("v_cache", v_cache, ndim=4)
    return v_cache.shape[0] == k_cache.shape[0] - PAGES_PER_SPARSE_BLOCK


def sparse_block_page_stride(k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    """Page ids per physical block for these views: 16 when packed, else 8."""
    return PACKED_STRIDE if sides_are_packed(k_cache, v_cache) else DENSE_STRIDE


def check_kv_views(k_cache, v_cache) -> int:
    """Validate a pair of page-16 views; return their ``block_page_stride``.

    Checks: 4-D ``[pages, 16, H, D]``, a float dtype shared by both, one device,
    the same ``(16, H, D)``, a contiguous last dimension, and page counts that
    fit one of the two layouts (equal and a multiple of 8, or ``v = k - 8`` with
    ``k`` a multiple of 16).
    """
    check_tensor("k_cache", k_cache, ndim=4, dtypes=FLOAT_DTYPES)
    check_tensor("v_cache", v_cache, ndim=4, dtypes=FLOAT_DTYPES)
    if v_cache.dtype != k_cache.dtype:
        raise TypeError(f"v_cache: dtype {v_cache.dtype} differs from k_cache's {k_cache.dtype}")
    check_same_device(k_cache=k_cache, v_cache=v_cache)
    if k_cache.shape[1] != PAGE_SIZE:
        raise ValueError(f"k_cache: dimension 1 must be the page size {PAGE_SIZE}, got shape {tuple(k_cache.shape)}")
    if v_cache.shape[1:] != k_cache.shape[1:]:
        raise ValueError(
            f"v_cache: shape {tuple(v_cache.shape)} does not match k_cache {tuple(k_cache.shape)} past dimension 0"
        )
    check_last_dim_contiguous("k_cache", k_cache)
    check_last_dim_contiguous("v_cache", v_cache)
    pk, pv = k_cache.shape[0], v_cache.shape[0]
    if pk == pv and pk % DENSE_STRIDE == 0:
        return DENSE_STRIDE
    if pv == pk - PAGES_PER_SPARSE_BLOCK and pk % PACKED_STRIDE == 0:
        return PACKED_STRIDE
    raise ValueError(
        f"k_cache/v_cache: page counts {pk} and {pv} fit neither layout "
        f"(dense: equal, a multiple of {DENSE_STRIDE}; "
        f"packed: v = k - {PAGES_PER_SPARSE_BLOCK}, k a multiple of {PACKED_STRIDE})"
    )


def num_cache_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    """Physical 128-token blocks behind a pair of page-16 views."""
    return k_cache.shape[0] // check_kv_views(k_cache, v_cache)


# ----------------------------------------------------------------------------
# page id <-> memory mapping
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PageLocation:
    """Where one page-16 view index lands in the page-128 cache's memory.

    Attributes:
        view_index: the index into ``k_cache`` or ``v_cache`` (= the page id).
        view: ``"k"`` or ``"v"``, the view it was indexed through.
        block: physical 128-token block.
        side: 0 (K) or 1 (V) of that block actually reached.
        page_in_block: 0..7, which 16-token page of that block's side.
        storage_page: page index in memory order (16-token pages from the start of storage).
        byte_offset: ``storage_page * page_bytes``.
    """

    view_index: int
    view: str
    block: int
    side: int
    page_in_block: int
    storage_page: int
    byte_offset: int

    @property
    def first_token(self) -> int:
        """The token offset inside ``block`` of this page's first row."""
        return self.page_in_block * PAGE_SIZE


def locate_page(page_id: int, view: str, layout: str, num_blocks: int, page_bytes: int = 1) -> PageLocation:
    """Map a page id read through ``k_cache`` (``view="k"``) or ``v_cache`` (``"v"``) to memory.

    Dense: the K view is storage pages ``0 .. 8*num_blocks``, the V view the next
    ``8*num_blocks``. Packed: the K view is all storage pages and the V view
    starts 8 pages later, so a page id ``16*b + j`` (``j < 8``) reaches block
    ``b``'s K page ``j`` through ``k_cache`` and its V page ``j`` through ``v_cache``.
    """
    _check_layout(layout)
    if view not in ("k", "v"):
        raise ValueError(f"view: expected 'k' or 'v', got {view!r}")
    pages_total = num_blocks * PACKED_STRIDE
    if layout == "dense":
        count = num_blocks * DENSE_STRIDE
        storage = page_id + (count if view == "v" else 0)
    else:
        count = pages_total - (PAGES_PER_SPARSE_BLOCK if view == "v" else 0)
        storage = page_id + (PAGES_PER_SPARSE_BLOCK if view == "v" else 0)
    if not 0 <= page_id < count:
        raise ValueError(f"page_id: {page_id} is outside the {view}_cache view of {count} pages")
    if layout == "dense":
        side, rest = divmod(storage, num_blocks * DENSE_STRIDE)
        block, page = divmod(rest, PAGES_PER_SPARSE_BLOCK)
    else:
        block, rest = divmod(storage, PACKED_STRIDE)
        side, page = divmod(rest, PAGES_PER_SPARSE_BLOCK)
    return PageLocation(page_id, view, block, side, page, storage, storage * page_bytes)


def page_ids_of_block(block: int, block_page_stride: int) -> list[int]:
    """The 8 page ids ``block * block_page_stride + j`` that cover one physical block."""
    if block_page_stride not in (DENSE_STRIDE, PACKED_STRIDE):
        raise ValueError(f"block_page_stride: expected 8 or 16, got {block_page_stride!r}")
    return [block * block_page_stride + j for j in range(PAGES_PER_SPARSE_BLOCK)]


def slot_to_page(slot: int, block_page_stride: int) -> tuple[int, int] | None:
    """A page-128 slot ``block*128 + off`` -> ``(page_id, row)``; ``None`` for a padding slot."""
    if block_page_stride not in (DENSE_STRIDE, PACKED_STRIDE):
        raise ValueError(f"block_page_stride: expected 8 or 16, got {block_page_stride!r}")
    if slot < 0:
        return None
    block, off = divmod(slot, SPARSE_BLOCK_SIZE)
    return block * block_page_stride + off // PAGE_SIZE, off % PAGE_SIZE


