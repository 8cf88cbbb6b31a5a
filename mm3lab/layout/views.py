"""Page-16 views of a page-128 KV cache: allocation, layout recognition, page-id mapping.

See the package docstring of :mod:`mm3lab.layout` for the two layouts.
"""

from __future__ import annotations

import dataclasses

import torch

from .._checks import (
    FLOAT_DTYPES,
    check_block_page_stride,
    check_device,
    check_int,
    check_last_dim_contiguous,
    check_no_alias,
    check_same_device,
    check_tensor,
)
from ..constants import PAGE16_SIDES_PER_BLOCK, PAGE_SIZE, PAGES_PER_SPARSE_BLOCK, SPARSE_BLOCK_SIZE
from ..fp8 import FP8_DTYPE

KV_DTYPES = (*FLOAT_DTYPES, FP8_DTYPE)
"""Cache dtypes: float32, float16, bfloat16, and float8_e4m3fn with per-(token, head) scales."""

LAYOUTS = ("dense", "packed")
MAX_PAGES = 2**31 - 1
"""Page ids are int32: a pair of views holds at most this many pages."""
I64_MIN = -(2**63)
DENSE_STRIDE = PAGES_PER_SPARSE_BLOCK  # 8 page ids per block
PACKED_STRIDE = PAGES_PER_SPARSE_BLOCK * PAGE16_SIDES_PER_BLOCK  # 16 page ids per block


def _check_layout(layout: str) -> str:
    if not isinstance(layout, str):
        raise TypeError(f"layout: expected 'dense' or 'packed', got {type(layout).__name__}")
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
        scale: FP8 caches only (else ``None``): ``[num_blocks, 2, 128, H]`` float32, one scale per
            (token, KV head) and side, in the same memory order as ``kv``.
        k_scale, v_scale: FP8 only: ``[pages, 16, H]`` page-16 views of ``scale``, the same page
            ids as ``k_cache`` / ``v_cache`` (SPEC section 9).
    """

    kv: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    layout: str
    scale: torch.Tensor | None = None
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

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
        dtype: float32, float16, bfloat16, or ``torch.float8_e4m3fn`` (SPEC section 9: the cache
            then also carries float32 scales, one per (token, KV head) and side, initialized to 1).
        fill: initial value (``None`` leaves memory uninitialized).
    Returns:
        a :class:`PagedKVCache` whose ``kv`` has logical shape ``[num_blocks, 2, 128, H, D]``
        (and, for FP8, ``scale`` / ``k_scale`` / ``v_scale``).
    """
    _check_layout(layout)
    for name, value in (("num_blocks", num_blocks), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
        check_int(name, value, minimum=1)
    if dtype not in KV_DTYPES:
        raise TypeError(f"dtype: expected float32, float16, bfloat16 or float8_e4m3fn, got {dtype}")
    if fill is not None and (isinstance(fill, bool) or not isinstance(fill, (int, float))):
        raise TypeError(f"fill: expected a Python float or None, got {type(fill).__name__}")
    device = check_device("device", device)
    if num_blocks * PACKED_STRIDE > MAX_PAGES:
        raise ValueError(
            f"num_blocks: {num_blocks} blocks need {num_blocks * PACKED_STRIDE} page ids, past int32 "
            f"(at most {MAX_PAGES // PACKED_STRIDE} blocks)"
        )
    if layout == "dense":
        storage = torch.empty(2, num_blocks, SPARSE_BLOCK_SIZE, num_kv_heads, head_dim, dtype=dtype, device=device)
        kv = storage.permute(1, 0, 2, 3, 4)
    else:
        kv = torch.empty(num_blocks, 2, SPARSE_BLOCK_SIZE, num_kv_heads, head_dim, dtype=dtype, device=device)
    if fill is not None:
        kv.fill_(fill)
    k_cache, v_cache = page16_views(kv, layout)
    if dtype != FP8_DTYPE:
        return PagedKVCache(kv, k_cache, v_cache, layout)
    if layout == "dense":
        scale = torch.ones(2, num_blocks, SPARSE_BLOCK_SIZE, num_kv_heads, device=device).permute(1, 0, 2, 3)
    else:
        scale = torch.ones(num_blocks, 2, SPARSE_BLOCK_SIZE, num_kv_heads, device=device)
    k_scale, v_scale = scale_page16_views(scale, layout)
    return PagedKVCache(kv, k_cache, v_cache, layout, scale, k_scale, v_scale)


def scale_page16_views(scale: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Page-16 views ``(k_scale, v_scale)`` ``[pages, 16, H]`` of FP8 scales ``[num_blocks, 2, 128, H]``:
    the same page ids as :func:`page16_views` gives ``k_cache`` / ``v_cache`` in that layout."""
    _check_layout(layout)
    nb, _, _, h = scale.shape
    if layout == "dense":
        planes = scale.permute(1, 0, 2, 3)
        return (
            planes[0].reshape(nb * PAGES_PER_SPARSE_BLOCK, PAGE_SIZE, h),
            planes[1].reshape(nb * PAGES_PER_SPARSE_BLOCK, PAGE_SIZE, h),
        )
    pages = scale.view(nb * PACKED_STRIDE, PAGE_SIZE, h)
    return pages, pages[PAGES_PER_SPARSE_BLOCK:]


def check_kv_scales(k_cache, v_cache, k_scale, v_scale) -> None:
    """FP8 views need ``k_scale`` / ``v_scale``: float32 ``[pages, 16, H]`` matching each view's pages,
    on its device (SPEC section 9); other dtypes take ``None``."""
    if k_cache.dtype != FP8_DTYPE:
        for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
            if t is not None:
                raise ValueError(
                    f"{name}: only an FP8 (float8_e4m3fn) KV cache has scales; the cache is "
                    f"{str(k_cache.dtype).replace('torch.', '')}, pass {name}=None"
                )
        return
    for name, t, view in (("k_scale", k_scale, k_cache), ("v_scale", v_scale, v_cache)):
        if t is None:
            raise ValueError(
                f"{name}: an FP8 KV cache needs its per-(token, head) scales (PagedKVCache.{name}), got None"
            )
        check_tensor(name, t, shape=tuple(view.shape[:3]), dtypes=(torch.float32,))
        check_same_device(k_cache=k_cache, **{name: t})


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
    check_tensor("kv_cache", kv_cache, ndim=5, dtypes=KV_DTYPES)
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
    """True for the packed-sides layout: ``v_cache`` has 8 pages fewer than ``k_cache``.

    The views get every check of :func:`check_kv_views` (page size, heads, head dim,
    dtype, device, page counts) first: a pair that fits neither layout raises.
    """
    return check_kv_views(k_cache, v_cache) == PACKED_STRIDE


def sparse_block_page_stride(k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    """Page ids per physical block for these views: 16 when packed, else 8.

    The views are checked as in :func:`check_kv_views`.
    """
    return check_kv_views(k_cache, v_cache)


def check_kv_views(k_cache, v_cache) -> int:
    """Validate a pair of page-16 views; return their ``block_page_stride``.

    Checks: 4-D ``[pages, 16, H, D]``, a float dtype shared by both, one device,
    the same ``(16, H, D)``, a contiguous last dimension, and page counts that
    fit one of the two layouts (equal and a multiple of 8, or ``v = k - 8`` with
    ``k`` a multiple of 16).
    """
    check_tensor("k_cache", k_cache, ndim=4, dtypes=KV_DTYPES)
    check_tensor("v_cache", v_cache, ndim=4, dtypes=KV_DTYPES)
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
    if pk > MAX_PAGES:
        raise ValueError(f"k_cache: {pk} pages, past int32 page ids (at most {MAX_PAGES})")
    if pk == pv and pk % DENSE_STRIDE == 0:
        check_no_alias(k_cache=k_cache, inputs={"v_cache": v_cache})  # dense planes are disjoint
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
    check_int("page_id", page_id, minimum=I64_MIN)
    if not isinstance(view, str):
        raise TypeError(f"view: expected 'k' or 'v', got {type(view).__name__}")
    if view not in ("k", "v"):
        raise ValueError(f"view: expected 'k' or 'v', got {view!r}")
    _check_layout(layout)
    check_int("num_blocks", num_blocks, minimum=1)
    check_int("page_bytes", page_bytes, minimum=1)
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
    check_int("block", block, minimum=0)
    check_block_page_stride(block_page_stride)
    return [block * block_page_stride + j for j in range(PAGES_PER_SPARSE_BLOCK)]


def slot_to_page(slot: int, block_page_stride: int) -> tuple[int, int] | None:
    """A page-128 slot ``block*128 + off`` -> ``(page_id, row)``; ``None`` for a padding slot."""
    check_int("slot", slot, minimum=I64_MIN)
    check_block_page_stride(block_page_stride)
    if slot < 0:
        return None
    block, off = divmod(slot, SPARSE_BLOCK_SIZE)
    return block * block_page_stride + off // PAGE_SIZE, off % PAGE_SIZE
