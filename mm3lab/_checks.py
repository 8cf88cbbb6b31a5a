"""Argument checks shared by every public entry point.

Two kinds of check exist:

* structural checks (rank, shape, dtype, device, contiguity) read only tensor
  metadata and always run (the MSA layer skips a repeat of a call shape that
  passed them: :class:`PassedChecks`);
* value checks (a block id past the block table, a seq_len the table cannot
  hold) read tensor contents, which on a GPU means waiting for the device. They
  run while validation is enabled (the default). Turn them off for CUDA-graph
  capture with ``mm3lab.validation(False)`` (a context manager) or the
  environment variable ``MM3LAB_VALIDATE=0``. The kernels mask every index they
  read either way, so turning validation off can never cause an out-of-bounds
  access: it only trades a clear ``ValueError`` for mm3lab's defined fallback.

Value checks cost one small launch and one host read per call
(:mod:`mm3lab._valcheck`): every range check of the call is evaluated together
into a few flags, and only a flagged call computes its detailed message. The
launch's last program sets a ``done`` word in pinned host memory, which the call
watches instead of syncing the stream. A repeated eager call of ``sparse_attention``
(with a new output), of the decode block table or of a decode indexer entry point (a
remembered call shape, :class:`mm3lab._replay.Memo`) has its kernel (the indexer's scores
kernel) run the same checks as it reads the entries, writing the flags into pinned host
memory and saying when they are final: no check launch, and one host read that does not
wait for the rest of the kernel. An index-cache insert of up to 8192 keys checks its own
slots the same way, and writes nothing when one is past the cache.
The block table given ``out=`` keeps what it overwrites, and a rejected call puts
it back before raising.

Errors name the argument (and, for value checks, the row).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Sequence

import torch

from .constants import PAGE16_SIDES_PER_BLOCK, PAGES_PER_SPARSE_BLOCK, SPARSE_BLOCK_SIZE

INDEX_DTYPES = (torch.int32, torch.int64)
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_validate = os.environ.get("MM3LAB_VALIDATE", "1").strip() not in ("0", "false", "no", "off")


def validation_enabled() -> bool:
    """Whether value checks (those that read tensor contents) run."""
    return _validate


@contextlib.contextmanager
def validation(enabled: bool):
    """Context manager: turn value checks on or off for the enclosed calls."""
    global _validate
    previous = _validate
    _validate = bool(enabled)
    try:
        yield
    finally:
        _validate = previous


def check_tensor(
    name: str,
    t,
    *,
    ndim: int | None = None,
    dtypes: Sequence[torch.dtype] | None = None,
    shape: Sequence[int | None] | None = None,
) -> torch.Tensor:
    """Check type, rank, dtype and shape (``None`` in ``shape`` matches any size)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if ndim is None and shape is not None:
        ndim = len(shape)
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name}: expected dtype {allowed}, got {str(t.dtype).replace('torch.', '')}")
    if shape is not None:
        for axis, (want, got) in enumerate(zip(shape, t.shape, strict=False)):
            if want is not None and want != got:
                raise ValueError(
                    f"{name}: expected shape {tuple('*' if s is None else s for s in shape)}, "
                    f"got {tuple(t.shape)} (dimension {axis})"
                )
    return t


def check_index(name: str, t, *, ndim: int | None = None, shape=None) -> torch.Tensor:
    """An integer index tensor: int32 or int64."""
    if isinstance(t, torch.Tensor) and t.dtype.is_floating_point:
        raise TypeError(f"{name}: expected an int32 or int64 tensor of ids, got {str(t.dtype).replace('torch.', '')}")
    return check_tensor(name, t, ndim=ndim, dtypes=INDEX_DTYPES, shape=shape)


def check_same_device(**tensors: torch.Tensor) -> torch.device:
    """All named tensors on one device; returns it."""
    items = list(tensors.items())
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.device != first.device:
            raise ValueError(f"{name} is on {t.device} but {first_name} is on {first.device}: put them on one device")
    return first.device


def check_device(name: str, device) -> torch.device:
    """A device to allocate on (``str`` or ``torch.device``) that this machine has; returns it."""
    if isinstance(device, bool) or not isinstance(device, (str, torch.device, int)):
        raise TypeError(f"{name}: expected a device such as 'cpu' or 'cuda', got {type(device).__name__}")
    try:
        device = torch.device(device)
    except (RuntimeError, ValueError) as err:
        raise ValueError(f"{name}: {device!r} is not a device ({err})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{name}: {str(device)!r} asked for, but this machine has no CUDA GPU (use 'cpu')")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"{name}: {str(device)!r} asked for, but this machine has {torch.cuda.device_count()} GPU(s)")
    return device


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name}: the last dimension must be contiguous (stride 1), got strides {t.stride()}")


def check_out(name: str, out: torch.Tensor | None, shape: Sequence[int], dtype: torch.dtype, device) -> None:
    """A caller-supplied output buffer: exact shape, dtype, device, contiguous."""
    if out is None:
        return
    check_tensor(name, out, shape=tuple(shape), dtypes=(dtype,))
    if out.device != torch.device(device):
        raise ValueError(f"{name}: expected a tensor on {device}, got {out.device}")
    if not out.is_contiguous():
        raise ValueError(f"{name}: must be contiguous")


def _storage_span(t: torch.Tensor) -> tuple[int, int] | None:
    """The byte range ``[start, end)`` that ``t`` covers (``None`` when it covers nothing)."""
    n = t.numel()
    if n == 0 or t.is_meta:
        return None
    start, item = t.data_ptr(), t.element_size()
    if t.is_contiguous():
        return start, start + n * item
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return start, start + (last + 1) * item


def check_no_alias(*, inputs: dict, **buffers) -> None:
    """No tensor of ``inputs`` shares memory with a tensor of ``buffers`` (the ones a call writes).

    Metadata only (address ranges, no device work); ``None`` entries are skipped. A call that
    read an input through the buffer it writes would read its own output.
    """
    spans = [(name, t.device, _storage_span(t)) for name, t in inputs.items() if isinstance(t, torch.Tensor)]
    for out_name, buf in buffers.items():
        if not isinstance(buf, torch.Tensor):
            continue
        span = _storage_span(buf)
        if span is None:
            continue
        for name, device, other in spans:
            if other and device == buf.device and other[0] < span[1] and span[0] < other[1]:
                raise ValueError(f"{name}: shares memory with {out_name}, which this call writes; pass a copy")


def first_bad_row(mask: torch.Tensor) -> int | None:
    """Index (along dim 0 of a flattened view) of the first True in ``mask``, or None."""
    bad = mask.reshape(mask.shape[0], -1).any(dim=1) if mask.dim() > 1 else mask
    idx = torch.nonzero(bad)
    return int(idx[0, 0]) if idx.numel() else None


BLOCK_PAGE_STRIDES = (PAGES_PER_SPARSE_BLOCK, PAGES_PER_SPARSE_BLOCK * PAGE16_SIDES_PER_BLOCK)
"""Page ids per physical block: 8 (dense planes) or 16 (packed sides)."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def check_int(name: str, value, *, minimum: int, maximum: int | None = None) -> int:
    """A Python int (not a bool, a float or a tensor: ``TypeError``) in ``[minimum, maximum]`` (``ValueError``)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected a Python int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name}: expected an int in [{minimum}, {maximum}], got {value}")
    return value


def check_scale(scale, head_dim: int) -> float:
    """The softmax ``scale``: ``None`` (``head_dim ** -0.5``) or a finite Python float / int (not a bool)."""
    if scale is None:
        return head_dim**-0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale: expected a Python float or None, got {type(scale).__name__}")
    if not math.isfinite(scale):
        raise ValueError(f"scale: expected a finite float, got {scale}")
    return float(scale)


class CheckedKey:
    """A :class:`PassedChecks` key: the metadata tuple, hashed once. A call's key is looked up in several
    tables (the passed checks, the kept value checks, the recorded steps), and hashing the tuple of a
    layer call's 14 tensors costs about as much as building it; equal where the tuples are equal."""

    __slots__ = ("value", "_hash")

    def __init__(self, value: tuple):
        self.value = value
        self._hash = hash(value)  # (an unhashable scalar raises TypeError here)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        if self is other:
            return True
        if not isinstance(other, CheckedKey):
            return NotImplemented
        return self._hash == other._hash and self.value == other.value

    def __repr__(self) -> str:
        return f"CheckedKey({self.value!r})"


class PassedChecks:
    """The metadata of calls whose structural checks passed, so that a repeat can skip them.

    Structural checks read nothing but tensor metadata and Python scalars, so a call whose
    tensors have the same type, address, shape, strides, dtype and device as a call that
    passed, and whose scalars are equal (and of the same type), passes them too. A decode loop
    repeats one call shape; :meth:`key` costs about half a microsecond per tensor, the checks it
    stands for tens of microseconds. Value checks read contents and are never skipped this way.
    The last :attr:`size` keys are kept; no tensor is referenced.
    """

    size = 16

    def __init__(self):
        self._passed: dict = {}

    @staticmethod
    def key(tensors, scalars=()) -> CheckedKey | None:
        """The call's metadata (``None`` entries allowed), or ``None`` when an argument is not a tensor
        or a hashable scalar (such a call is checked in full, and its error raised)."""
        try:
            metadata = tuple(
                [
                    None if t is None else (type(t), t.data_ptr(), t.shape, t.stride(), t.dtype, t.device)
                    for t in tensors
                ]
            )
            return CheckedKey((metadata, tuple([(type(x), x) for x in scalars])))
        except (AttributeError, RuntimeError, TypeError, NotImplementedError):
            return None

    def get(self, key, default=None):
        """What :meth:`add` stored for ``key`` (a call that passed), else ``default``."""
        return default if key is None else self._passed.get(key, default)

    def add(self, key, value=True) -> None:
        if key is None or self.size < 1:  # (size 0: every call is checked in full)
            return
        while len(self._passed) >= self.size:
            self._passed.pop(next(iter(self._passed)), None)  # the oldest
        self._passed[key] = value

    def clear(self) -> None:
        self._passed.clear()


def check_block_page_stride(block_page_stride) -> int:
    """``block_page_stride``: 8 (dense planes) or 16 (packed sides)."""
    dense, packed = BLOCK_PAGE_STRIDES
    if isinstance(block_page_stride, bool) or not isinstance(block_page_stride, int):
        raise TypeError(f"block_page_stride: expected a Python int (8 or 16), got {type(block_page_stride).__name__}")
    if block_page_stride not in BLOCK_PAGE_STRIDES:
        raise ValueError(
            f"block_page_stride: expected {dense} (dense planes) or {packed} (packed sides), got {block_page_stride}"
        )
    return block_page_stride


def value_checks(segments, detail, key=None, then=None) -> None:
    """Run a call's value checks: ``segments`` (:class:`mm3lab._valcheck.Segment`, or a function that
    builds them) in one launch and one host read; only if one is flagged, ``detail()`` (the slow
    path, which may sync more) raises the detailed ``ValueError``. ``key``: what fixes the segments
    (:func:`mm3lab._valcheck.flags_known`: a repeat launches the kept arguments; ``then``: what
    the host queues while such a kept check runs)."""
    from ._valcheck import flags_known

    if any(flags_known(key, segments if callable(segments) else lambda: segments, then)):
        raise_flagged(detail)


def raise_flagged(detail) -> None:
    """A call's value check flagged an entry: ``detail()``, the call's detailed checks, raises their
    ``ValueError``; one that finds nothing is a bug in the checks, and raises ``RuntimeError``."""
    detail()
    raise RuntimeError("mm3lab: a value check flagged an entry its detailed check does not find (a bug)")


def check_slots_inside(slot_mapping: torch.Tensor, capacity: int, cache: str, key=None, then=None) -> None:
    """With validation on: every slot of ``slot_mapping`` below ``capacity``, the slots of ``cache``
    (negative slots are padding); one launch and one host read. Raises ``ValueError`` naming the row.
    ``key``: what fixes ``slot_mapping``'s address and metadata and ``capacity``, if the caller has it
    (a repeat launches the kept check, :func:`mm3lab._valcheck.flags_known`, and queues ``then``)."""
    from ._valcheck import Segment

    if not validation_enabled() or slot_mapping.numel() == 0:
        return

    def detail() -> None:
        row = first_bad_row(slot_mapping >= capacity)
        if row is not None:
            raise ValueError(
                f"slot_mapping: row {row} has slot {int(slot_mapping[row])}, past {cache}'s "
                f"{capacity} slots ({capacity // SPARSE_BLOCK_SIZE} blocks of {SPARSE_BLOCK_SIZE})"
            )

    segments = lambda: [Segment("all", slot_mapping, hi=capacity - 1)]  # noqa: E731
    value_checks(segments, detail, None if key is None else ("slots_inside", cache, capacity, key), then)


def raise_first(checks) -> None:
    """``checks``: ``(mask, message(row))`` pairs; raise for the first mask holding a True (one sync in all)."""
    if not checks:
        return
    anys = torch.stack([mask.any() for mask, _ in checks]).tolist()
    for (mask, message), bad in zip(checks, anys, strict=False):
        if bad:
            raise ValueError(message(first_bad_row(mask)))


def seq_lens_check(seq_lens: torch.Tensor, m: int):
    """A :func:`raise_first` check: every request's ``seq_len`` fits its block-table row of ``m`` blocks (SPEC 7)."""
    capacity = m * SPARSE_BLOCK_SIZE
    return (
        seq_lens.to(torch.int64) > capacity,
        lambda r: (
            f"seq_lens: request {r} has seq_len {int(seq_lens[r])}, but its block_table row holds "
            f"{m} blocks = {capacity} tokens"
        ),
    )


def prefill_row_checks(query_req_id: torch.Tensor, query_abs_pos: torch.Tensor, b: int, m: int) -> list:
    """:func:`raise_first` checks of prefill rows against a ``[b, m]`` block table (SPEC 7): a live row's
    request id inside ``[0, b)`` (padded rows, ``p < 0``, may carry any), every position inside a row."""
    capacity = m * SPARSE_BLOCK_SIZE
    pos = query_abs_pos.to(torch.int64)
    req = query_req_id.to(torch.int64)
    return [
        (
            (pos >= 0) & ((req < 0) | (req >= b)),
            lambda r: (
                f"query_req_id: row {r} has request id {int(query_req_id[r])}, outside the block table's "
                f"{b} requests [0, {b})"
            ),
        ),
        (
            pos >= capacity,
            lambda r: (
                f"query_abs_pos: row {r} has position {int(query_abs_pos[r])}, but a block_table row holds "
                f"{m} blocks = {capacity} tokens"
            ),
        ),
    ]


def blocks_used_decode(seq_lens: torch.Tensor, m: int) -> torch.Tensor:
    """``[B]`` int64: the block-table entries each decode request reads, ``ceil(seq_len / 128)`` (at most ``m``)."""
    lens = seq_lens.to(torch.int64).clamp(0, m * SPARSE_BLOCK_SIZE)
    return torch.div(lens + SPARSE_BLOCK_SIZE - 1, SPARSE_BLOCK_SIZE, rounding_mode="floor")


def blocks_used_prefill(req: torch.Tensor, pos: torch.Tensor, b: int, m: int) -> torch.Tensor:
    """``[b]`` int64: how many block-table entries the live prefill rows of each request read
    (``p // 128 + 1`` of its furthest row; rows outside the table, checked apart, read none)."""
    req, pos = req.to(torch.int64), pos.to(torch.int64)
    live = (pos >= 0) & (req >= 0) & (req < b) & (pos < m * SPARSE_BLOCK_SIZE)
    needed = torch.where(live, torch.div(pos, SPARSE_BLOCK_SIZE, rounding_mode="floor") + 1, 0)
    used = torch.zeros(b, dtype=torch.int64, device=pos.device)
    if b:
        used.scatter_reduce_(0, torch.where(live, req, 0), needed, reduce="amax")
    return used


def table_entry_check(block_table: torch.Tensor, blocks_used: torch.Tensor, bad: torch.Tensor, why):
    """A :func:`raise_first` check: an entry ``bad`` (``[B, M]`` bool) among the first ``blocks_used[r]``
    of row ``r``; the message names the request, the logical block and ``why(physical id)``."""
    b, m = block_table.shape
    mask = bad & (torch.arange(m, device=block_table.device).view(1, m) < blocks_used.view(b, 1))

    def message(r: int) -> str:
        col = int(torch.nonzero(mask[r])[0, 0])
        return f"block_table: request {r}, logical block {col} " + why(int(block_table[r, col]))

    return mask, message


def check_decode_rows(name: str, n: int, seq_lens, decode_query_len, b: int) -> int:
    """Decode rows (SPEC 2): ``seq_lens [b]`` integer, ``decode_query_len >= 1`` and ``n == b * dql``
    rows in ``name``; returns ``dql``."""
    check_index("seq_lens", seq_lens, shape=(b,))
    dql = check_int("decode_query_len", decode_query_len, minimum=1)
    if n != b * dql:
        raise ValueError(
            f"{name}: expected batch * decode_query_len = {b} * {dql} = {b * dql} rows "
            f"(block_table has {b} requests), got {n}"
        )
    return dql
