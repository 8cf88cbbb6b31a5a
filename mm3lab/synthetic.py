"""Seeded synthetic sequences with recognizable block-selection structure.

:func:`make_sequence` builds, for one request of ``seq_len`` tokens, everything an
MSA layer consumes: index queries and the shared index keys, and attention
``q``/``k``/``v`` that follow the same structure (so the attention a full softmax
pays can be compared with the blocks the indexer picks). :func:`page_sequence`
writes it into paged caches through a shuffled block table, with the real
:func:`mm3lab.insert_index_cache` and :func:`mm3lab.write_kv_page16`.
:func:`synthetic_layer` builds a whole MSA decode step from them (:class:`SyntheticLayer`:
the caches hold every token but the new ones), the input of the MSA notebook and tests.

Patterns (``PATTERNS``), each a few lines of :func:`make_sequence`:

``"needle"``
    A handful of tokens of one block (``needle_block``) carry the direction every
    query points along: the block wins for every query after it.
``"sink"``
    The same, on the first tokens of block 0: an attention-sink-like first block.
``"recency"``
    Rotary-style features whose dot product ``sum_i w_i cos(w_i (t - s))`` decays with
    the distance ``t - s``: the blocks just before the query score best.
``"random"``
    Independent Gaussian noise: no structure, scores are a max of noise.

Everything is drawn from one ``torch.Generator`` seeded with ``seed``, in float32 on
the CPU, then cast to ``dtype`` and moved to ``device``: a seed gives the same
numbers everywhere.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ._checks import check_int
from .constants import SPARSE_BLOCK_SIZE
from .rows import decode_rows

PATTERNS = ("needle", "sink", "recency", "random")
"""The structures :func:`make_sequence` can plant."""

SIGNAL_TOKENS = 8
"""Tokens of the needle (or sink) block that carry the signal."""


class _TensorSize:
    """A read-only attribute that is one size of a tensor field: ``_TensorSize("q", 1)`` reads
    ``self.q.shape[1]``, so the sizes always agree with the tensors."""

    def __init__(self, field: str, axis: int):
        self.field, self.axis = field, axis
        self.__doc__ = f"``{field}.shape[{axis}]``"

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, obj, owner=None) -> int:
        if obj is None:
            return self
        return getattr(obj, self.field).shape[self.axis]

    def __set__(self, obj, value) -> None:
        raise AttributeError(f"{self.name} is {self.__doc__}; it cannot be set")


@dataclasses.dataclass(frozen=True)
class SyntheticSequence:
    """One request's tokens with a planted structure.

    Attributes:
        pattern: one of :data:`PATTERNS`.
        index_q: ``[S, H, Di]`` index queries (one per token and index head = KV head).
        index_k: ``[S, Di]`` index keys, one per token, shared by every index head.
        q: ``[S, Hq, D]`` attention queries; head ``hq`` belongs to KV head ``hq // (Hq // H)``.
        k, v: ``[S, H, D]`` attention keys and values.
        needle_block: the block holding the signal (``"needle"``: the planted block,
            ``"sink"``: 0), else ``None``.
        signal_tokens: positions of the tokens that carry it (empty without one).
        seed: the generator's seed.
    """

    pattern: str
    index_q: torch.Tensor
    index_k: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    needle_block: int | None
    signal_tokens: tuple[int, ...]
    seed: int

    seq_len = _TensorSize("index_k", 0)
    num_kv_heads = _TensorSize("index_q", 1)
    num_q_heads = _TensorSize("q", 1)
    index_dim = _TensorSize("index_k", 1)
    head_dim = _TensorSize("q", 2)

    @property
    def num_blocks(self) -> int:
        """Logical 128-token blocks the sequence spans."""
        return math.ceil(self.seq_len / SPARSE_BLOCK_SIZE)


def _check_positive(name: str, value) -> int:
    return check_int(name, value, minimum=1)


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True)


def _embed(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The first ``dim`` features of ``x`` (zero-padded when ``x`` is narrower)."""
    if x.shape[-1] >= dim:
        return x[..., :dim]
    pad = torch.zeros(*x.shape[:-1], dim - x.shape[-1], dtype=x.dtype)
    return torch.cat([x, pad], dim=-1)


def make_sequence(
    pattern: str = "needle",
    seq_len: int = 2048,
    *,
    num_kv_heads: int = 4,
    num_q_heads: int | None = None,
    index_dim: int = 64,
    head_dim: int = 64,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device="cpu",
    needle_block: int | None = None,
    strength: float = 1.0,
    recency_tokens: float = 160.0,
    attention_temperature: float = 0.5,
) -> SyntheticSequence:
    """A seeded sequence whose block scores have a recognizable structure.

    Index keys are Gaussian noise ``N(0, 1)`` per dimension, index queries
    ``N(0, 1 / Di)`` (so a plain dot product has a standard deviation near 1); the
    pattern adds a signal on top. Attention ``q``/``k`` embed the index vectors in the
    head dim (``q`` of query head ``hq`` from index head ``hq // group``, with a
    little per-head noise) so the attention logits ``D ** -0.5 * q . k`` are
    ``attention_temperature`` times the index dot products, approximately.

    Args:
        pattern: ``"needle"``, ``"sink"``, ``"recency"`` or ``"random"``.
        seq_len: tokens ``S``.
        num_kv_heads: ``H``, the index heads (one per KV head).
        num_q_heads: ``Hq`` (a multiple of ``H``); default ``4 * H``.
        index_dim, head_dim: ``Di`` and ``D``.
        seed: seeds every random number.
        dtype, device: of every returned tensor.
        needle_block: the needle's block (``"needle"`` only); default one third into the sequence.
        strength: scales the planted signal (0 = no signal).
        recency_tokens: ``"recency"``: the distance over which scores decay (a Gaussian width).
        attention_temperature: logits of the attention ``q``/``k`` relative to the index dots.
    Returns:
        a :class:`SyntheticSequence`.
    """
    if pattern not in PATTERNS:
        raise ValueError(f"pattern: expected one of {', '.join(PATTERNS)}, got {pattern!r}")
    for name, value in (
        ("seq_len", seq_len),
        ("num_kv_heads", num_kv_heads),
        ("index_dim", index_dim),
        ("head_dim", head_dim),
    ):
        _check_positive(name, value)
    num_q_heads = 4 * num_kv_heads if num_q_heads is None else _check_positive("num_q_heads", num_q_heads)
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads: {num_q_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    nb = math.ceil(seq_len / SPARSE_BLOCK_SIZE)
    gen = torch.Generator().manual_seed(seed)
    s, h, di = seq_len, num_kv_heads, index_dim
    index_k = torch.randn(s, di, generator=gen)
    index_q = torch.randn(s, h, di, generator=gen) / math.sqrt(di)
    signal_tokens: tuple[int, ...] = ()
    block = None

    if pattern in ("needle", "sink"):
        if pattern == "sink":
            block = 0
        else:
            block = nb // 3 if needle_block is None else int(needle_block)
            if not 0 <= block < nb:
                raise ValueError(
                    f"needle_block: expected 0 <= needle_block < {nb} (blocks of the sequence), got {block}"
                )
        # One shared direction g; each head's query direction u_h is close to it.
        g = _unit(torch.randn(di, generator=gen))
        u = _unit(g + 0.3 * _unit(torch.randn(h, di, generator=gen)))  # [H, Di]
        start = block * SPARSE_BLOCK_SIZE
        stop = min(start + SPARSE_BLOCK_SIZE, s)
        count = min(SIGNAL_TOKENS, stop - start)
        offsets = torch.randperm(stop - start, generator=gen)[:count] + start
        signal_tokens = tuple(sorted(int(t) for t in offsets))
        index_k[list(signal_tokens)] += 6.0 * strength * g
        index_q += 2.0 * strength * u.unsqueeze(0)
    elif pattern == "recency":
        # sum_i w_i cos(omega_i (t - s)) with Gaussian weights: a bump of width recency_tokens at t = s.
        period = 4.0 * s
        feats = min(di // 2, 32)
        omega = 2 * math.pi * torch.arange(feats, dtype=torch.float32) / period
        weight = torch.exp(-0.5 * (omega * recency_tokens) ** 2)
        weight = weight / weight.sum()
        t = torch.arange(s, dtype=torch.float32).unsqueeze(1)
        rot = torch.cat([torch.cos(omega * t), torch.sin(omega * t)], dim=1) * weight.repeat(2).sqrt()  # [S, 2F]
        amp = 3.5 * strength
        index_k[:, : 2 * feats] += amp * rot
        index_q[:, :, : 2 * feats] += amp * rot.unsqueeze(1)

    group = num_q_heads // num_kv_heads
    logit = attention_temperature * math.sqrt(head_dim)  # D**-0.5 * q.k == temperature * index dot
    q = _embed(index_q, head_dim).repeat_interleave(group, dim=1) * logit
    q = q + 0.1 * torch.randn(s, num_q_heads, head_dim, generator=gen) / math.sqrt(head_dim) * logit
    k = _embed(index_k, head_dim).unsqueeze(1).expand(s, h, head_dim).clone()
    k = k + 0.1 * torch.randn(s, h, head_dim, generator=gen)
    v = torch.randn(s, h, head_dim, generator=gen)
    to = lambda x: x.to(dtype).to(device)  # noqa: E731
    return SyntheticSequence(pattern, to(index_q), to(index_k), to(q), to(k), to(v), block, signal_tokens, seed)


@dataclasses.dataclass(frozen=True)
class PagedSequence:
    """A :class:`SyntheticSequence` written into paged caches (one request).

    Attributes:
        block_table: ``[1, M]`` int32 logical -> physical block (a seeded shuffle).
        slot_mapping: ``[S]`` int64 slot of every token (:func:`mm3lab.token_slots`).
        index_cache: ``[num_blocks, 128, Di]`` with every token's index key.
        kv: the :class:`mm3lab.PagedKVCache` with every token's K and V (``None`` if not asked for).
        seq_lens: ``[1]`` int32, the sequence length (for the decode entry points).
    """

    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    index_cache: torch.Tensor
    kv: object
    seq_lens: torch.Tensor


def page_sequence(
    seq: SyntheticSequence, *, kv_layout: str | None = "dense", spare_blocks: int = 0, seed: int = 0
) -> PagedSequence:
    """Write ``seq`` into an index cache and (optionally) a KV cache through a shuffled block table.

    Args:
        seq: the sequence.
        kv_layout: ``"dense"`` or ``"packed"`` page-16 layout for K/V, or ``None`` for no KV cache.
        spare_blocks: extra physical blocks nobody uses (left NaN, so reading one shows).
        seed: seeds the block table's shuffle.
    """
    from .index_cache import allocate_index_cache, insert_index_cache, token_slots
    from .layout import allocate_kv_cache, write_kv_page16

    m = seq.num_blocks
    num_blocks = m + spare_blocks
    device = seq.index_k.device
    gen = torch.Generator().manual_seed(seed)
    block_table = torch.randperm(num_blocks, generator=gen)[:m].view(1, m).to(torch.int32).to(device)
    positions = torch.arange(seq.seq_len, device=device)
    slots = token_slots(block_table, torch.zeros_like(positions), positions)
    index_cache = allocate_index_cache(
        num_blocks, seq.index_dim, dtype=seq.index_k.dtype, device=device, fill=float("nan")
    )
    insert_index_cache(seq.index_k, index_cache, slots)
    kv = None
    if kv_layout is not None:
        kv = allocate_kv_cache(
            num_blocks, seq.num_kv_heads, seq.head_dim, kv_layout, dtype=seq.k.dtype, device=device, fill=float("nan")
        )
        write_kv_page16(seq.k, seq.v, kv.k_cache, kv.v_cache, slots)
    seq_lens = torch.tensor([seq.seq_len], dtype=torch.int32, device=device)
    return PagedSequence(block_table, slots, index_cache, kv, seq_lens)


# ----------------------------------------------------------------------------
# a whole MSA decode step, caches filled
# ----------------------------------------------------------------------------


@dataclasses.dataclass
class SyntheticLayer:
    """A seeded MSA decode step: caches holding every token but the new ones, and the step's inputs.

    Built from :func:`mm3lab.synthetic.make_sequence` (one sequence per request) by
    :func:`synthetic_layer`.

    Attributes:
        q, key, value, index_q, index_k: the decode step's inputs (``N = B * dql`` rows), as
            :func:`mm3lab.msa_decode` takes them.
        cache: the KV cache (:class:`mm3lab.PagedKVCache`), history written.
        index_cache: ``[num_blocks, 128, Di]``, history written.
        block_table: ``[B, M]``; seq_lens: ``[B]`` (the new tokens included).
        decode_query_len: query tokens per request.
        full_key, full_value: ``[B, S, Hkv, D]`` every token of every request (the new ones last,
            zeros past a shorter request's end).
        sequences: the :class:`mm3lab.synthetic.SyntheticSequence` of each request.
        pattern: the :data:`mm3lab.synthetic.PATTERNS` entry used.
    """

    q: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    index_q: torch.Tensor
    index_k: torch.Tensor
    cache: object
    index_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    decode_query_len: int
    full_key: torch.Tensor
    full_value: torch.Tensor
    sequences: tuple
    pattern: str

    def inputs(self) -> dict:
        """Keyword arguments of :func:`mm3lab.msa_decode` for this step."""
        return dict(
            q=self.q,
            key=self.key,
            value=self.value,
            index_q=self.index_q,
            index_k=self.index_k,
            k_cache=self.cache.k_cache,
            v_cache=self.cache.v_cache,
            index_cache=self.index_cache,
            block_table=self.block_table,
            seq_lens=self.seq_lens,
            decode_query_len=self.decode_query_len,
        )

    def dense_inputs(self) -> dict:
        """Keyword arguments of :func:`mm3lab.msa.dense_decode` for this step: :meth:`inputs` without the
        indexer's (``index_q``, ``index_k``, ``index_cache``)."""
        return {name: value for name, value in self.inputs().items() if not name.startswith("index_")}


def synthetic_layer(
    context_len: int,
    *,
    batch: int = 1,
    num_kv_heads: int = 2,
    group_size: int = 4,
    head_dim: int = 64,
    index_dim: int = 32,
    layout: str = "packed",
    pattern: str = "needle",
    decode_query_len: int = 1,
    dtype: torch.dtype = torch.float32,
    device="cpu",
    seed: int = 0,
    **sequence_options,
) -> SyntheticLayer:
    """A seeded decode step over ``batch`` requests of about ``context_len`` tokens, caches filled.

    Request ``r`` is :func:`mm3lab.synthetic.make_sequence` ``(pattern, context_len + 37 * r,
    seed=seed + r, **sequence_options)``: its last ``decode_query_len`` tokens are the
    step's queries and new tokens, every earlier token is already in the KV and index
    caches, at slots given by a seeded shuffled block table.

    Args:
        context_len: tokens of request 0, the new ones included (``>= decode_query_len``).
        batch, decode_query_len: requests and query tokens per request.
        num_kv_heads, group_size, head_dim, index_dim: ``Hkv``, ``Hq / Hkv``, ``D``, ``Di``.
        layout: ``"dense"`` or ``"packed"`` KV cache.
        pattern: ``"needle"``, ``"sink"``, ``"recency"`` or ``"random"`` (see :mod:`mm3lab.synthetic`).
        dtype, device: of the caches and inputs.
        seed: seeds the sequences and the block table.
        sequence_options: passed on to ``make_sequence`` (``strength``, ``needle_block``, ...).
    """
    from .index_cache import allocate_index_cache
    from .layout import allocate_kv_cache

    dql = decode_query_len
    check_int("context_len", context_len, minimum=dql)
    hkv, d, di = num_kv_heads, head_dim, index_dim
    lens = [context_len + 37 * r for r in range(batch)]
    seqs = tuple(
        make_sequence(
            pattern,
            length,
            num_kv_heads=hkv,
            num_q_heads=hkv * group_size,
            index_dim=di,
            head_dim=d,
            seed=seed + r,
            **sequence_options,
        )
        for r, length in enumerate(lens)
    )
    s_max = max(lens)
    m = -(-s_max // SPARSE_BLOCK_SIZE)
    num_blocks = batch * m + 2
    g = torch.Generator().manual_seed(seed)
    block_table = torch.randperm(num_blocks, generator=g)[: batch * m].view(batch, m).to(torch.int32)

    full_key = torch.zeros(batch, s_max, hkv, d)
    full_value = torch.zeros(batch, s_max, hkv, d)
    full_index_k = torch.zeros(batch, s_max, di)
    for r, sq in enumerate(seqs):
        full_key[r, : lens[r]], full_value[r, : lens[r]], full_index_k[r, : lens[r]] = sq.k, sq.v, sq.index_k
    req, pos = decode_rows(torch.tensor(lens), dql)
    q = torch.stack([seqs[r].q[p] for r, p in zip(req.tolist(), pos.tolist(), strict=True)])
    index_q = torch.stack([seqs[r].index_q[p] for r, p in zip(req.tolist(), pos.tolist(), strict=True)])

    cache = allocate_kv_cache(num_blocks, hkv, d, layout, dtype=dtype, device=device, fill=0.0)
    index_cache = allocate_index_cache(num_blocks, di, dtype=dtype, device=device, fill=0.0)
    dev = cache.kv.device
    full_key, full_value, full_index_k = (t.to(device=dev, dtype=dtype) for t in (full_key, full_value, full_index_k))
    hist_req = torch.cat([torch.full((length - dql,), r) for r, length in enumerate(lens)]).to(dev)
    hist_pos = torch.cat([torch.arange(length - dql) for length in lens]).to(dev)
    block_table = block_table.to(dev)
    if hist_req.numel():  # the history, written through the page-128 view (one vectorized copy)
        physical = block_table.long()[hist_req, hist_pos // SPARSE_BLOCK_SIZE]
        offset = hist_pos % SPARSE_BLOCK_SIZE
        cache.kv[physical, 0, offset] = full_key[hist_req, hist_pos]
        cache.kv[physical, 1, offset] = full_value[hist_req, hist_pos]
        index_cache[physical, offset] = full_index_k[hist_req, hist_pos]
    req, pos = req.to(dev), pos.to(dev)
    return SyntheticLayer(
        q=q.to(device=dev, dtype=dtype),
        key=full_key[req, pos],
        value=full_value[req, pos],
        index_q=index_q.to(device=dev, dtype=dtype),
        index_k=full_index_k[req, pos],
        cache=cache,
        index_cache=index_cache,
        block_table=block_table,
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
        decode_query_len=dql,
        full_key=full_key,
        full_value=full_value,
        sequences=seqs,
        pattern=pattern,
    )


__all__ = [
    "PATTERNS",
    "PagedSequence",
    "SyntheticLayer",
    "SyntheticSequence",
    "make_sequence",
    "page_sequence",
    "synthetic_layer",
]
