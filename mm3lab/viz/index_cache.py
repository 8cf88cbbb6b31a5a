"""Pictures of the index cache (SPEC section 2, step 1).

* :func:`slot_table_text`: token -> logical block, offset, physical block, slot (or padding);
* :func:`shared_table_text`: one request's block table read by both caches: the index
  cache's slots and the KV cache's page-16 ids of every logical block;
* :func:`occupancy`: which request owns each written slot of an index cache;
* :func:`plot_index_cache`: that occupancy as a picture, one row per physical block;
* :func:`simulate_fill` / :func:`plot_fill_steps`: a prefill then decode steps written with
  :func:`mm3lab.insert_index_cache`, and the cache after each step, new slots outlined.

Every function returns a :class:`matplotlib.figure.Figure` made without pyplot (nothing
to close). Occupancy is read from the cache's contents (a NaN-filled cache, so an
unwritten slot stays NaN): the pictures show what the real insert wrote. Artists
carry a ``gid`` (``"occupancy"``, ``"new"``) so tests can find them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from ..constants import SPARSE_BLOCK_SIZE
from ..index_cache import allocate_index_cache, insert_index_cache, token_slots
from ..layout.views import layout_block_page_stride, page_ids_of_block

EMPTY, UNOWNED = -1, -2
_REQUEST_COLORS = ("#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf")


def slot_table_text(block_table: torch.Tensor, query_req_id: torch.Tensor, query_abs_pos: torch.Tensor) -> str:
    """One line per token: request, position, logical block and offset, physical block, slot."""
    slots = token_slots(block_table, query_req_id, query_abs_pos).tolist()
    lines = ["row  request  position  logical block  offset  physical block  slot"]
    table = block_table.tolist()
    for n, (r, p, s) in enumerate(zip(query_req_id.tolist(), query_abs_pos.tolist(), slots, strict=False)):
        if p < 0:
            lines.append(
                f"{n:3d}  {r:7d}  {p:8d}  {'-':>13s}  {'-':>6s}  {'-':>14s}  {s:4d}  (padding: nothing written)"
            )
            continue
        b, off = divmod(p, SPARSE_BLOCK_SIZE)
        lines.append(
            f"{n:3d}  {r:7d}  {p:8d}  {b:13d}  {off:6d}  {table[r][b]:14d}  {s:4d}"
            f"  = {table[r][b]} * {SPARSE_BLOCK_SIZE} + {off}"
        )
    return "\n".join(lines)


def shared_table_text(block_table_row: Sequence[int], seq_len: int, layout: str = "dense") -> str:
    """How one request's block table row addresses both caches.

    Logical block ``b`` -> physical block ``block_table[b]``: index cache rows
    ``index_cache[block_table[b], 0:128]`` (slots ``block_table[b] * 128 + 0..127``), and
    KV page-16 ids ``block_table[b] * block_page_stride + 0..7`` in ``layout``.
    """
    stride = layout_block_page_stride(layout)
    blocks = -(-int(seq_len) // SPARSE_BLOCK_SIZE)
    lines = [
        f"{seq_len} tokens, {layout} KV layout (block_page_stride {stride})",
        "logical  physical  tokens     index cache slots  KV page ids",
    ]
    for b in range(blocks):
        phys = int(block_table_row[b])
        first, last = b * SPARSE_BLOCK_SIZE, min((b + 1) * SPARSE_BLOCK_SIZE, seq_len) - 1
        pages = page_ids_of_block(phys, stride)
        lines.append(
            f"{b:7d}  {phys:8d}  {first:4d}-{last:<4d}  {phys * SPARSE_BLOCK_SIZE:6d}-"
            f"{phys * SPARSE_BLOCK_SIZE + SPARSE_BLOCK_SIZE - 1:<6d}      {pages[0]}..{pages[-1]}"
        )
    return "\n".join(lines)


def occupancy(index_cache: torch.Tensor, block_table: torch.Tensor | None = None) -> np.ndarray:
    """``[num_blocks, 128]`` int: the request owning each written slot (``-1`` unwritten,
    ``-2`` written but in no request's block table). A slot counts as written unless NaN."""
    written = ~torch.isnan(index_cache.float().cpu()).all(dim=-1)  # [num_blocks, 128]
    owner = np.full((index_cache.shape[0],), UNOWNED, dtype=np.int64)
    if block_table is not None:
        for r, row in enumerate(block_table.tolist()):
            for phys in row:
                if 0 <= phys < len(owner):
                    owner[phys] = r
    occ = np.where(written.numpy(), owner[:, None], EMPTY)
    return occ


def _draw_occupancy(ax, occ: np.ndarray, num_requests: int, title: str, labels: Sequence[str] | None = None):
    colors = ["#7f7f7f", "white"] + [_REQUEST_COLORS[r % len(_REQUEST_COLORS)] for r in range(num_requests)]
    image = ax.imshow(
        occ + 2,
        cmap=ListedColormap(colors),
        vmin=0,
        vmax=len(colors) - 1,
        aspect="auto",
        interpolation="nearest",
        extent=(-0.5, SPARSE_BLOCK_SIZE - 0.5, occ.shape[0] - 0.5, -0.5),
    )
    image.set_gid("occupancy")
    ax.set_yticks(range(occ.shape[0]), labels or [f"block {i}" for i in range(occ.shape[0])], fontsize=8)
    ax.set_xticks([0, 32, 64, 96, 127])
    ax.set_xlabel("offset in block (slot % 128)")
    for y in range(occ.shape[0] + 1):
        ax.axhline(y - 0.5, color="#bbbbbb", linewidth=0.5)
    ax.set_title(title, fontsize=10)


def _block_labels(block_table: torch.Tensor | None, num_blocks: int) -> list[str]:
    labels = [f"block {i}: free" for i in range(num_blocks)]
    if block_table is not None:
        for r, row in enumerate(block_table.tolist()):
            for b, phys in enumerate(row):
                if 0 <= phys < num_blocks:
                    labels[phys] = f"block {phys}: req {r}, logical {b}"
    return labels


def plot_index_cache(
    index_cache: torch.Tensor, block_table: torch.Tensor | None = None, title: str = "index cache"
) -> Figure:
    """The index cache's slots, one row per physical block: coloured by owning request where written."""
    occ = occupancy(index_cache, block_table)
    nreq = 0 if block_table is None else block_table.shape[0]
    fig = Figure(figsize=(8.0, 0.45 * occ.shape[0] + 1.4), layout="constrained")
    ax = fig.add_subplot()
    _draw_occupancy(ax, occ, nreq, title, _block_labels(block_table, occ.shape[0]))
    handles = [Patch(color=_REQUEST_COLORS[r % len(_REQUEST_COLORS)], label=f"request {r}") for r in range(nreq)]
    handles.append(Patch(facecolor="white", edgecolor="#999999", label="not written"))
    ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


@dataclasses.dataclass(frozen=True)
class FillStep:
    """One insert of :func:`simulate_fill`.

    Attributes:
        name: ``"prefill"`` or ``"decode i"``.
        query_req_id, query_abs_pos, slot_mapping: ``[N]`` the tokens written and their slots.
        index_cache: a copy of the cache after the step.
    """

    name: str
    query_req_id: torch.Tensor
    query_abs_pos: torch.Tensor
    slot_mapping: torch.Tensor
    index_cache: torch.Tensor


def simulate_fill(
    block_table: torch.Tensor,
    prefill_lens: Sequence[int],
    decode_steps: int = 3,
    *,
    index_dim: int = 8,
    num_blocks: int | None = None,
    padding_rows: int = 1,
    seed: int = 0,
) -> list[FillStep]:
    """Fill an index cache the way a server does: one prefill of every request (plus
    ``padding_rows`` padded rows, slot ``-1``), then ``decode_steps`` steps of one token each.

    Args:
        block_table: ``[B, M]`` int block table shared with the KV cache.
        prefill_lens: tokens each request brings to the prefill.
        decode_steps: decode steps after it.
        index_dim: ``Di``; num_blocks: physical blocks (default ``max(block_table) + 1``).
        padding_rows: padded rows appended to the prefill batch (they write nothing).
        seed: seeds the index keys.
    Returns:
        a :class:`FillStep` per insert, each holding the cache as it was after that step.
    """
    gen = torch.Generator().manual_seed(seed)
    b = block_table.shape[0]
    if len(prefill_lens) != b:
        raise ValueError(f"prefill_lens: expected one length per request ({b}), got {len(prefill_lens)}")
    num_blocks = int(block_table.max()) + 1 if num_blocks is None else num_blocks
    cache = allocate_index_cache(num_blocks, index_dim, fill=float("nan"))
    steps = []

    def insert(name, req, pos):
        req = torch.tensor(req, dtype=torch.int64)
        pos = torch.tensor(pos, dtype=torch.int64)
        slots = token_slots(block_table, req, pos)
        keys = torch.randn(len(pos), index_dim, generator=gen)
        insert_index_cache(keys, cache, slots)
        steps.append(FillStep(name, req, pos, slots, cache.clone()))

    req = [r for r, n in enumerate(prefill_lens) for _ in range(n)] + [0] * padding_rows
    pos = [p for n in prefill_lens for p in range(n)] + [-1] * padding_rows
    insert("prefill", req, pos)
    lens = list(prefill_lens)
    for i in range(decode_steps):
        insert(f"decode {i + 1}", list(range(b)), lens)
        lens = [n + 1 for n in lens]
    return steps


def fill_text(steps: Sequence[FillStep]) -> str:
    """Per step: tokens written, padded rows, slots written, slots in use after it."""
    lines = ["step       tokens  padded  slots written                          slots in use"]
    for st in steps:
        slots = st.slot_mapping.tolist()
        live = [s for s in slots if s >= 0]
        shown = live if len(live) <= 4 else live[:2] + ["..."] + live[-2:]
        used = int((~torch.isnan(st.index_cache).all(dim=-1)).sum())
        lines.append(f"{st.name:9s}  {len(slots):6d}  {len(slots) - len(live):6d}  {shown!s:37s}  {used:6d}")
    return "\n".join(lines)


def plot_fill_steps(steps: Sequence[FillStep], block_table: torch.Tensor) -> Figure:
    """The cache after each step, side by side; the slots a step wrote are outlined black."""
    fig = Figure(figsize=(3.6 * len(steps), 0.4 * steps[0].index_cache.shape[0] + 1.6), layout="constrained")
    axes = fig.subplots(1, len(steps), squeeze=False, sharey=True)[0]
    nreq = block_table.shape[0]
    labels = _block_labels(block_table, steps[0].index_cache.shape[0])
    for ax, st in zip(axes, steps, strict=False):
        _draw_occupancy(ax, occupancy(st.index_cache, block_table), nreq, st.name, labels)
        for blk, start, stop in _runs(st.slot_mapping.tolist()):
            ax.add_patch(
                Rectangle(
                    (start - 0.5, blk - 0.45),
                    stop - start,
                    0.9,
                    fill=False,
                    edgecolor="black",
                    linewidth=1.4,
                    gid="new",
                )
            )
    return fig


def _runs(slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """Written slots as ``(block, first offset, last offset + 1)`` runs of consecutive offsets."""
    runs: list[list[int]] = []
    for s in sorted(x for x in slots if x >= 0):
        blk, off = divmod(s, SPARSE_BLOCK_SIZE)
        if runs and runs[-1][0] == blk and runs[-1][2] == off:
            runs[-1][2] = off + 1
        else:
            runs.append([blk, off, off + 1])
    return [tuple(r) for r in runs]


def plot_bytes_per_token(
    num_kv_heads: int | None = None, head_dim: int | None = None, index_dim: int | None = None, dtype_bytes: int = 2
) -> Figure:
    """Stacked bar per token: K and V bytes of every KV head against the one shared index key."""
    from ..constants import HEAD_DIM, INDEX_HEAD_DIM, NUM_KV_HEADS

    hkv, d, di = num_kv_heads or NUM_KV_HEADS, head_dim or HEAD_DIM, index_dim or INDEX_HEAD_DIM
    k = v = hkv * d * dtype_bytes
    idx = di * dtype_bytes
    fig = Figure(figsize=(7.0, 2.4), layout="constrained")
    ax = fig.add_subplot()
    ax.barh(1, k, color="#1f77b4", label=f"K: {hkv} heads x {d} dims x {dtype_bytes} B")
    ax.barh(1, v, left=k, color="#2ca02c", label="V: the same")
    ax.barh(0, idx, color="#ff7f0e", label=f"index key: {di} dims x {dtype_bytes} B, shared by the heads")
    for y, total in ((1, k + v), (0, idx)):
        ax.text(total, y, f"  {total} B", va="center", fontsize=9)
    ax.set_yticks([0, 1], ["index cache", "KV cache"])
    ax.set_xlim(0, (k + v) * 1.2)
    ax.set_xlabel("bytes per token (one layer)")
    ax.set_title(f"one token: {k + v} B of K/V, {idx} B of index key ({idx / (k + v):.1%})", loc="left", fontsize=10)
    ax.legend(loc="lower right", fontsize=8)
    return fig


DEMO_BLOCK_TABLE = ((3, 0, 5), (1, 4, 2))
"""The notebook's block table: request 0 -> physical blocks 3, 0, 5; request 1 -> 1, 4, 2."""


def show_index_fill(
    prefill_len: int = 200,
    decode_steps: int = 3,
    request: int = 0,
    block_table=DEMO_BLOCK_TABLE,
    other_prefill_len: int = 70,
    index_dim: int = 8,
    num_blocks: int = 7,
) -> Figure:
    """Print one request's slots through a prefill and decode steps; return the cache after the last step.

    ``request`` prefills ``prefill_len`` tokens, the other request ``other_prefill_len``
    (the widget's callback, :func:`mm3lab.widgets.index_cache.index_cache_widget`).
    """
    bt = torch.as_tensor(block_table, dtype=torch.int64)
    capacity = bt.shape[1] * SPARSE_BLOCK_SIZE
    if not 0 <= request < bt.shape[0]:
        raise ValueError(f"request: expected 0 <= request < {bt.shape[0]}, got {request}")
    if prefill_len < 0 or decode_steps < 0 or prefill_len + decode_steps > capacity:
        raise ValueError(
            f"prefill_len + decode_steps: expected at most {capacity} (the request's blocks), "
            f"got {prefill_len} + {decode_steps}"
        )
    lens = [other_prefill_len] * bt.shape[0]
    lens[request] = int(prefill_len)
    steps = simulate_fill(bt, lens, int(decode_steps), index_dim=index_dim, num_blocks=num_blocks)
    seq_len = prefill_len + decode_steps
    print(f"request {request}: prefill {prefill_len} tokens, then {decode_steps} decode steps -> {seq_len} tokens")
    for st in steps:
        pairs = zip(st.query_req_id.tolist(), st.slot_mapping.tolist(), strict=False)
        mine = [s for r, s in pairs if r == request and s >= 0]
        if mine:
            runs = ", ".join(
                f"{b * SPARSE_BLOCK_SIZE + lo}-{b * SPARSE_BLOCK_SIZE + hi - 1} (block {b})"
                for b, lo, hi in sorted(_runs(mine), key=lambda r: mine.index(r[0] * SPARSE_BLOCK_SIZE + r[1]))
            )
            print(f"  {st.name:<9} {len(mine):4d} slot(s): {runs}")
    print(shared_table_text(bt[request].tolist(), max(seq_len, 1), "dense"))
    return plot_index_cache(
        steps[-1].index_cache,
        bt,
        title=f"after the prefill and {decode_steps} decode step(s); request {request} prefilled {prefill_len}",
    )


__all__ = [
    "DEMO_BLOCK_TABLE",
    "FillStep",
    "fill_text",
    "occupancy",
    "plot_bytes_per_token",
    "plot_fill_steps",
    "plot_index_cache",
    "shared_table_text",
    "show_index_fill",
    "simulate_fill",
    "slot_table_text",
]
