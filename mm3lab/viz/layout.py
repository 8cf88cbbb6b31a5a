"""Pictures of the page-16 KV layouts (SPEC section 4).

* :func:`plot_memory_map`: the cache's memory in order, 16 pages a row, each
  page coloured by its block and side, the chosen block's pages outlined with
  the page id that reaches each;
* :func:`plot_page_id_table` / :func:`page_table_text`: the 8 page ids a block
  spans and where each reaches K and V (storage page, byte offset);
* :func:`plot_kv_views`: ``k_cache`` and ``v_cache`` index ranges drawn against
  the same memory, which is why packed V sits 8 pages after K;
* :func:`plot_rebase` / :func:`rebase_text`: what a kernel that hard-codes 8
  pages per block reads in the packed layout, without and with
  :func:`mm3lab.rebase_block_table_to_page16`;
* :func:`plot_layout` / :func:`show_layout`: memory map plus page-id table,
  what the layout widget redraws.

Functions that give byte offsets take a :class:`PageShape` (heads, head size,
element size of one page; :data:`MODEL_PAGE` by default).

Every function returns a :class:`matplotlib.figure.Figure` made without
pyplot (nothing to close; Jupyter shows a returned figure once). The page
mapping comes from :func:`mm3lab.locate_page`, the same code the tests check.
Patches that a reader should notice carry a ``gid`` (``"highlight"``,
``"selected-k"``, ``"read-ok"``, ...) so tests can find them.
"""

from __future__ import annotations

import dataclasses

import matplotlib.colors as mcolors
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from ..constants import HEAD_DIM, NUM_KV_HEADS, PAGE16_SIDES_PER_BLOCK, PAGE_SIZE, PAGES_PER_SPARSE_BLOCK
from ..layout.views import layout_block_page_stride, locate_page

PAGES_PER_ROW = PAGES_PER_SPARSE_BLOCK * PAGE16_SIDES_PER_BLOCK  # 16 storage pages per drawn row
SIDE_NAMES = ("K", "V")
_BLOCK_COLORS = [mcolors.to_rgb(c) for c in mcolors.TABLEAU_COLORS.values()]
_OK, _WRONG, _HIGHLIGHT = "#2ca02c", "#d62728", "black"


def _block_color(block: int, side: int):
    """Block hue; V is the same hue lightened (and hatched where drawn)."""
    rgb = _BLOCK_COLORS[block % len(_BLOCK_COLORS)]
    if side == 1:
        rgb = tuple(0.45 * c + 0.55 for c in rgb)
    return rgb


def _check_block(block: int, num_blocks: int) -> None:
    if not isinstance(num_blocks, int) or num_blocks < 1:
        raise ValueError(f"num_blocks: expected a positive int, got {num_blocks!r}")
    if not isinstance(block, int) or not 0 <= block < num_blocks:
        raise ValueError(f"block: expected 0 <= block < {num_blocks}, got {block!r}")


def page_bytes(num_kv_heads: int = NUM_KV_HEADS, head_dim: int = HEAD_DIM, dtype_bytes: int = 2) -> int:
    """Bytes of one page-16 page: ``16 * H * D * element size`` (bf16 by default)."""
    return PAGE_SIZE * num_kv_heads * head_dim * dtype_bytes


@dataclasses.dataclass(frozen=True)
class PageShape:
    """What one page-16 page holds: 16 tokens x ``num_kv_heads`` heads x ``head_dim`` dims of
    ``dtype_bytes`` each. The pictures take one to turn storage pages into byte offsets."""

    num_kv_heads: int = NUM_KV_HEADS
    head_dim: int = HEAD_DIM
    dtype_bytes: int = 2

    def __post_init__(self) -> None:
        from .._checks import check_int

        for name, value in dataclasses.asdict(self).items():
            check_int(name, value, minimum=1)

    @property
    def nbytes(self) -> int:
        """:func:`page_bytes` of this shape."""
        return page_bytes(self.num_kv_heads, self.head_dim, self.dtype_bytes)


MODEL_PAGE = PageShape()
"""The model's page: 4 KV heads x 128 dims in bf16, 16 KiB (the pictures' default)."""


def _kib(n: int) -> str:
    return f"{n // 1024} KiB" if n % 1024 == 0 else f"{n} B"


# ----------------------------------------------------------------------------
# the page-id table of one block
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PageRow:
    """One of the 8 pages of a block: its page id and where it reaches K and V."""

    j: int
    first_token: int
    page_id: int
    k_storage_page: int
    k_byte_offset: int
    v_storage_page: int
    v_byte_offset: int


def page_table(layout: str, num_blocks: int, block: int, page: PageShape = MODEL_PAGE) -> list[PageRow]:
    """The 8 rows ``j = 0..7`` of block ``block``: page id ``block * stride + j`` and its K/V locations
    (byte offsets for pages of shape ``page``)."""
    _check_block(block, num_blocks)
    stride = layout_block_page_stride(layout)
    nbytes = page.nbytes
    rows = []
    for j in range(PAGES_PER_SPARSE_BLOCK):
        pid = block * stride + j
        k = locate_page(pid, "k", layout, num_blocks, nbytes)
        v = locate_page(pid, "v", layout, num_blocks, nbytes)
        assert (k.block, k.side, v.block, v.side) == (block, 0, block, 1)
        rows.append(PageRow(j, k.first_token, pid, k.storage_page, k.byte_offset, v.storage_page, v.byte_offset))
    return rows


TABLE_COLUMNS = ("j", "tokens", "page id", "K storage page", "K byte offset", "V storage page", "V byte offset")


def _table_cells(rows: list[PageRow]) -> list[list[str]]:
    return [
        [
            str(r.j),
            f"{r.first_token}-{r.first_token + PAGE_SIZE - 1}",
            str(r.page_id),
            str(r.k_storage_page),
            str(r.k_byte_offset),
            str(r.v_storage_page),
            str(r.v_byte_offset),
        ]
        for r in rows
    ]


def page_table_text(layout: str, num_blocks: int, block: int, page: PageShape = MODEL_PAGE) -> str:
    """The page-id table of one block as aligned text (what the notebook prints)."""
    from .._checks import check_int

    check_int("num_blocks", num_blocks, minimum=1)
    check_int("block", block, minimum=0, maximum=num_blocks - 1)
    rows = page_table(layout, num_blocks, block, page)
    stride = layout_block_page_stride(layout)
    head = (
        f"{layout} layout, {num_blocks} blocks, block {block}: page ids {block}*{stride}+j "
        f"(page = {PAGE_SIZE} tokens x {page.num_kv_heads} heads x {page.head_dim} dims x {page.dtype_bytes} bytes "
        f"= {page.nbytes} bytes)"
    )
    cells = [list(TABLE_COLUMNS)] + _table_cells(rows)
    widths = [max(len(row[c]) for row in cells) for c in range(len(TABLE_COLUMNS))]
    lines = [head] + ["  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=False)) for row in cells]
    return "\n".join(lines)


def plot_page_id_table(layout: str, num_blocks: int, block: int, page: PageShape = MODEL_PAGE, ax=None) -> Figure:
    """The page-id table of one block drawn as a matplotlib table."""
    rows = page_table(layout, num_blocks, block, page)
    fig, ax = _figure_and_axes(ax, (10, 3))
    ax.axis("off")
    table = ax.table(cellText=_table_cells(rows), colLabels=list(TABLE_COLUMNS), loc="center", cellLoc="center")
    table.auto_set_font_size(False)
    table.set_fontsize(9)
    table.scale(1, 1.25)
    for c in range(len(TABLE_COLUMNS)):
        table[0, c].set_facecolor("#dddddd")
    for r in range(1, len(rows) + 1):
        table[r, 3].set_facecolor(_block_color(block, 0))
        table[r, 5].set_facecolor(_block_color(block, 1))
    stride = layout_block_page_stride(layout)
    ax.set_title(f"{layout}: page ids of block {block} = {block}*{stride} + j, and the memory each reaches")
    return fig


# ----------------------------------------------------------------------------
# memory map
# ----------------------------------------------------------------------------


def _figure_and_axes(ax, size):
    if ax is not None:
        return ax.figure, ax
    fig = Figure(figsize=size, layout="constrained")
    return fig, fig.subplots()


def _storage_owner(layout: str, num_blocks: int, storage_page: int) -> tuple[int, int, int]:
    """(block, side, page_in_block) of a storage page, via the k_cache view (it starts at storage 0)."""
    if layout == "packed":
        loc = locate_page(storage_page, "k", layout, num_blocks)
    else:
        half = num_blocks * PAGES_PER_SPARSE_BLOCK
        loc = locate_page(storage_page % half, "k" if storage_page < half else "v", layout, num_blocks)
    return loc.block, loc.side, loc.page_in_block


def _page_cell(ax, x, y, block, side, *, w=1.0, h=1.0, alpha=1.0, gid=None, edge="white", lw=0.8):
    rect = Rectangle(
        (x, y),
        w,
        h,
        facecolor=_block_color(block, side),
        edgecolor=edge,
        linewidth=lw,
        alpha=alpha,
        hatch="//" if side == 1 else None,
        gid=gid,
    )
    ax.add_patch(rect)
    return rect


def _side_legend(ax, **kw):
    handles = [Patch(facecolor="0.55", label="K page"), Patch(facecolor="0.85", hatch="//", label="V page")]
    ax.legend(handles=handles, **kw)


def plot_memory_map(layout: str, num_blocks: int, block: int = 0, page: PageShape = MODEL_PAGE, ax=None) -> Figure:
    """The cache's memory in order, 16 page-16 pages per row.

    Each cell is one storage page, coloured by its block (V lightened and
    hatched) and labelled ``b<block>`` / ``K<j>`` or ``V<j>``. The 16 pages of
    ``block`` are outlined (``gid="highlight"``) and show the page id that
    reaches them (through ``k_cache`` for K, ``v_cache`` for V). The y axis
    gives each row's byte offset for pages of shape ``page``.
    """
    _check_block(block, num_blocks)
    nbytes = page.nbytes
    stride = layout_block_page_stride(layout)
    fig, ax = _figure_and_axes(ax, (12, 0.75 * num_blocks + 1.6))
    for s in range(num_blocks * PAGES_PER_ROW):
        b, side, j = _storage_owner(layout, num_blocks, s)
        x, y = s % PAGES_PER_ROW, s // PAGES_PER_ROW
        chosen = b == block
        _page_cell(ax, x, y, b, side, alpha=1.0 if chosen else 0.45)
        label = f"b{b}\n{SIDE_NAMES[side]}{j}"
        if chosen:
            label = f"{SIDE_NAMES[side]}{j}\nid {b * stride + j}"
        ax.text(
            x + 0.5, y + 0.5, label, ha="center", va="center", fontsize=7, fontweight="bold" if chosen else "normal"
        )
    for s in range(num_blocks * PAGES_PER_ROW):  # outlines last, so they sit on top of neighbours
        b, side, _ = _storage_owner(layout, num_blocks, s)
        if b == block:
            x, y = s % PAGES_PER_ROW, s // PAGES_PER_ROW
            ax.add_patch(Rectangle((x, y), 1, 1, fill=False, edgecolor=_HIGHLIGHT, linewidth=2.2, gid="highlight"))
    ax.set_xlim(0, PAGES_PER_ROW)
    ax.set_ylim(num_blocks, 0)
    ax.set_xticks([i + 0.5 for i in range(PAGES_PER_ROW)], [str(i) for i in range(PAGES_PER_ROW)], fontsize=7)
    ax.set_xlabel("storage page within the row")
    ax.set_yticks(
        [r + 0.5 for r in range(num_blocks)],
        [
            f"pages {r * PAGES_PER_ROW}-{r * PAGES_PER_ROW + PAGES_PER_ROW - 1}\n@ {_kib(r * PAGES_PER_ROW * nbytes)}"
            for r in range(num_blocks)
        ],
        fontsize=7,
    )
    order = "dense planes: all K, then all V" if layout == "dense" else "packed sides: each block's K then its V"
    ax.set_title(f"{layout} layout ({order}); block {block} outlined, ids = page id (stride {stride})")
    _side_legend(ax, loc="upper right", bbox_to_anchor=(1.0, -0.03), ncol=2, fontsize=8, frameon=False)
    return fig


# ----------------------------------------------------------------------------
# k_cache and v_cache against the same memory
# ----------------------------------------------------------------------------


def view_offset(layout: str, num_blocks: int) -> int:
    """Storage page where ``v_cache[0]`` sits: 8 when packed, ``8 * num_blocks`` when dense."""
    return locate_page(0, "v", layout, num_blocks).storage_page


def plot_kv_views(layout: str, num_blocks: int, block: int = 0, ax=None) -> Figure:
    """``k_cache`` and ``v_cache`` index ranges drawn under the memory they view.

    Row 0 is memory (storage pages in order), row 1 ``k_cache[i]`` and row 2
    ``v_cache[i]``, each cell placed over the storage page it reaches. The page
    ids of ``block`` are marked in both views (``gid="selected-k"`` /
    ``"selected-v"``) and the memory they reach outlined (``gid="reached"``).
    """
    _check_block(block, num_blocks)
    stride = layout_block_page_stride(layout)
    total = num_blocks * PAGES_PER_ROW
    offset = view_offset(layout, num_blocks)
    fig, ax = _figure_and_axes(ax, (12, 3.2))
    ids = [block * stride + j for j in range(PAGES_PER_SPARSE_BLOCK)]
    y_mem, y_k, y_v = 0, 1.5, 2.7
    for s in range(total):
        b, side, _ = _storage_owner(layout, num_blocks, s)
        _page_cell(ax, s, y_mem, b, side, lw=0.3)
    views = (
        ("k", y_k, 0, total if layout == "packed" else total // 2),
        ("v", y_v, offset, total - offset if layout == "packed" else total // 2),
    )
    for name, y, start, count in views:
        ax.add_patch(Rectangle((start, y), count, 0.8, facecolor="0.93", edgecolor="0.5", linewidth=0.8))
        for i in range(count):
            if i % PAGES_PER_SPARSE_BLOCK == 0:
                ax.text(start + i + 0.5, y + 0.4, str(i), ha="center", va="center", fontsize=6, color="0.35")
        for pid in ids:
            loc = locate_page(pid, name, layout, num_blocks)
            x = loc.storage_page
            ax.add_patch(
                Rectangle(
                    (x, y),
                    1,
                    0.8,
                    facecolor=_block_color(loc.block, loc.side),
                    edgecolor=_HIGHLIGHT,
                    linewidth=1.2,
                    gid=f"selected-{name}",
                )
            )
            ax.add_patch(Rectangle((x, y_mem), 1, 1, fill=False, edgecolor=_HIGHLIGHT, linewidth=1.6, gid="reached"))
            ax.annotate(
                "",
                xy=(x + 0.5, y_mem + 1.0),
                xytext=(x + 0.5, y),
                arrowprops={"arrowstyle": "->", "lw": 0.6, "color": "0.3"},
            )
        ax.text(-0.5, y + 0.4, f"{name}_cache[i]\n(starts at page {start})", ha="right", va="center", fontsize=8)
    ax.text(-0.5, y_mem + 0.5, "memory", ha="right", va="center", fontsize=8)
    ax.text(
        ids[0] + (offset if layout == "dense" else 0),
        y_v + 1.25,
        f"ids {ids[0]}-{ids[-1]} of block {block}",
        fontsize=8,
        ha="left",
    )
    ax.set_xlim(-0.5, total + 0.5)
    ax.set_ylim(y_v + 1.5, -0.3)
    ax.set_yticks([])
    ax.set_xlabel("storage page")
    why = (
        f"v_cache starts {offset} pages in: one id reaches K through k_cache and the V "
        f"{offset} pages later through v_cache"
    )
    ax.set_title(f"{layout}: k_cache and v_cache over the same memory\n{why}", fontsize=10)
    _side_legend(ax, loc="upper right", bbox_to_anchor=(1.0, -0.08), ncol=2, fontsize=8, frameon=False)
    return fig


# ----------------------------------------------------------------------------
# the rebase
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RebaseRead:
    """What a hard-coded-8 kernel reads for one block-table entry."""

    entry: int
    physical_block: int
    table_value: int  # the value the kernel sees: b, or 2*b after the rebase
    first_id: int
    k_reached: tuple[int, int]  # (block, side) that k_cache[first_id .. +7] reaches
    v_reached: tuple[int, int]

    @property
    def correct(self) -> bool:
        return self.k_reached == (self.physical_block, 0) and self.v_reached == (self.physical_block, 1)


def rebase_reads(block_table, num_blocks: int, rebased: bool) -> list[RebaseRead]:
    """For each entry ``b`` of ``block_table``: the ids ``t*8 + j`` a kernel with 8 pages per block emits
    (``t = b``, or ``t = 2b`` after the rebase) and what they reach in the packed layout."""
    reads = []
    for e, b in enumerate(block_table):
        b = int(b)
        _check_block(b, num_blocks)
        t = b * PAGE16_SIDES_PER_BLOCK if rebased else b
        first = t * PAGES_PER_SPARSE_BLOCK
        k = locate_page(first, "k", "packed", num_blocks)
        v = locate_page(first, "v", "packed", num_blocks)
        reads.append(RebaseRead(e, b, t, first, (k.block, k.side), (v.block, v.side)))
    return reads


def rebase_text(block_table=(2, 0, 3), num_blocks: int = 4) -> str:
    """What a kernel that hard-codes 8 pages per block reads from a packed cache, per entry."""
    lines = [f"packed cache of {num_blocks} blocks, block_table {list(map(int, block_table))}:"]
    for rebased in (False, True):
        lines.append("with rebase_block_table_to_page16 (t = 2*b):" if rebased else "without the rebase (t = b):")
        for r in rebase_reads(block_table, num_blocks, rebased):
            last = r.first_id + PAGES_PER_SPARSE_BLOCK - 1
            lines.append(
                f"  entry {r.entry}: b={r.physical_block} t={r.table_value} ids {r.first_id}-{last}: "
                f"k_cache -> block {r.k_reached[0]} {SIDE_NAMES[r.k_reached[1]]}, "
                f"v_cache -> block {r.v_reached[0]} {SIDE_NAMES[r.v_reached[1]]}  "
                + ("right" if r.correct else f"WRONG (wanted block {r.physical_block} K and V)")
            )
    return "\n".join(lines)


def plot_rebase(block_table=(2, 0, 3), num_blocks: int = 4) -> Figure:
    """Two panels over a packed cache: the pages a hard-coded-8 kernel reads per block-table entry,
    without (top) and with (bottom) the rebase. K reads are drawn above the memory, V reads below,
    green where they reach the entry's own block (``gid="read-ok"``), red elsewhere (``"read-wrong"``)."""
    total = num_blocks * PAGES_PER_ROW
    fig = Figure(figsize=(12, 5.2), layout="constrained")
    axes = fig.subplots(2, 1)
    for ax, rebased in zip(axes, (False, True), strict=False):
        for s in range(total):
            b, side, _ = _storage_owner("packed", num_blocks, s)
            _page_cell(ax, s, 0, b, side, lw=0.3)
            if s % PAGES_PER_SPARSE_BLOCK == 0:
                ax.text(
                    s + PAGES_PER_SPARSE_BLOCK / 2,
                    0.5,
                    f"b{b} {SIDE_NAMES[side]}",
                    ha="center",
                    va="center",
                    fontsize=8,
                )
        reads = rebase_reads(block_table, num_blocks, rebased)
        for r in reads:
            for name, (blk, side), y in (
                ("K", r.k_reached, -1.1 - 0.9 * r.entry),
                ("V", r.v_reached, 1.3 + 0.9 * r.entry),
            ):
                x = r.first_id + (PAGES_PER_SPARSE_BLOCK if name == "V" else 0)
                ok = (blk, side) == (r.physical_block, 0 if name == "K" else 1)
                ax.add_patch(
                    Rectangle(
                        (x, y),
                        PAGES_PER_SPARSE_BLOCK,
                        0.7,
                        facecolor=_OK if ok else _WRONG,
                        alpha=0.8,
                        gid="read-ok" if ok else "read-wrong",
                    )
                )
                view = "k_cache" if name == "K" else "v_cache"
                ax.text(
                    x + PAGES_PER_SPARSE_BLOCK / 2,
                    y + 0.35,
                    f"e{r.entry}: {view}[{r.first_id}-{r.first_id + PAGES_PER_SPARSE_BLOCK - 1}]",
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white",
                )
        n = len(reads)
        ax.set_xlim(0, total)
        ax.set_ylim(1.3 + 0.9 * n + 0.1, -1.1 - 0.9 * (n - 1) - 0.1)
        ax.set_yticks([])
        ax.set_xticks(range(0, total + 1, PAGES_PER_SPARSE_BLOCK))
        values = [r.table_value for r in reads]
        if rebased:
            ax.set_title(f"with the rebase: the kernel sees 2*b = {values}, emits 16*b + j: every read is its block's")
        else:
            ax.set_title(
                f"without the rebase: the kernel sees b = {values}, emits 8*b + j: "
                "packed memory has 16 pages per block, so it lands in the wrong block or side"
            )
    axes[1].set_xlabel(
        "storage page (= k_cache index) of the packed cache; e<n> = block_table entry n; "
        "K reads above the memory, V reads below"
    )
    return fig


# ----------------------------------------------------------------------------
# what the widget redraws
# ----------------------------------------------------------------------------


def plot_layout(layout: str, num_blocks: int = 4, block: int = 0, page: PageShape = MODEL_PAGE) -> Figure:
    """Memory map (top) and page-id table (bottom) of one block, in one figure."""
    _check_block(block, num_blocks)
    # Fixed margins (inches) instead of a layout engine: the widget redraws this figure on every
    # move, and constrained layout would measure its ~200 texts in an extra pass before each draw.
    # The margins are the ones constrained layout finds for up to 8 blocks.
    width, height = 12.0, 0.75 * num_blocks + 5.0
    left, right, top_margin, table_height, gap, pad = 0.86, 0.04, 0.26, 2.95, 0.69, 0.04
    fig = Figure(figsize=(width, height))
    map_bottom = pad + table_height + gap
    axes_width = (width - left - right) / width
    top = fig.add_axes((left / width, map_bottom / height, axes_width, (height - top_margin - map_bottom) / height))
    bottom = fig.add_axes((left / width, pad / height, axes_width, table_height / height))
    plot_memory_map(layout, num_blocks, block, page, ax=top)
    plot_page_id_table(layout, num_blocks, block, page, ax=bottom)
    for cell in bottom.tables[0].get_celld().values():  # rows 0.26 in tall, as under constrained layout
        cell.set_height(0.26 / table_height)
    return fig


def show_layout(
    layout: str = "packed", block: int = 0, num_kv_heads: int = NUM_KV_HEADS, num_blocks: int = 4
) -> Figure:
    """Print the page-id table of ``block`` and return :func:`plot_layout`'s figure (the widget's callback),
    for pages of ``num_kv_heads`` heads of the model's head size in bf16."""
    page = PageShape(num_kv_heads=num_kv_heads)
    print(page_table_text(layout, num_blocks, block, page))
    return plot_layout(layout, num_blocks, block, page)


__all__ = [
    "MODEL_PAGE",
    "PageRow",
    "PageShape",
    "RebaseRead",
    "page_bytes",
    "page_table",
    "page_table_text",
    "plot_kv_views",
    "plot_layout",
    "plot_memory_map",
    "plot_page_id_table",
    "plot_rebase",
    "rebase_reads",
    "rebase_text",
    "show_layout",
    "view_offset",
]
