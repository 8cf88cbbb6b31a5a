"""Value checks of one call fused into one small launch and one host read (SPEC section 7).

A value check reads tensor contents (an id past a table, a position the table
cannot hold); on a GPU every separate check would be several small launches and a
device-to-host sync. Here a call describes all its value checks as
:class:`Segment` s (metadata only, no device work), and :func:`flags` evaluates
them together into a small int32 flag buffer (one flag per segment range check and
one per segment modulus check) with one launch, then reads the flags back once. Only
when a flag is set does the caller compute its detailed message (the slow path,
which may cost more syncs: it runs once, on the way to an exception).

A segment checks the entries of an integer tensor ``t`` seen as ``R`` rows of
``C`` columns against ``[lo, hi]`` (and, optionally, ``v mod modulus < mod_limit``),
restricted to the entries its ``kind`` says a call reads:

``"all"``
    every entry of ``t`` (1-d, 2-d or 3-d, any strides; 3-d is ``[H, N, C]``).
``"len"``
    row ``r`` of ``t`` (``[R, C]`` or ``[H, N, C]``) up to column
    ``ceil(clamp(aux[r], 0, C * unit) / unit)`` (``aux`` has ``t``'s shape without its last dimension):
    the pages a ``sparse_ctx`` reads, the blocks a ``seq_len`` reads.
``"live"``
    the entries of a vector ``t`` whose ``aux`` entry (a position) is ``>= 0``.
``"gather"`` / ``"gather_last"``
    ``t`` is a block table ``[B, M]``; query row ``n`` with ``req = aux[n]``, ``p = pos[n]``
    (live when ``p >= 0`` and ``0 <= req < B``) reads row ``req`` from column 0 (``"gather"``)
    or only at column ``min(p, M * unit - 1) // unit`` (``"gather_last"``).

On a CUDA tensor the check is one Triton launch (:func:`_valcheck_kernel`); on a CPU
tensor the same flags come from a few PyTorch ops (Triton's interpreter takes about a
millisecond per program; :func:`kernel_on_cpu` forces the kernel there, for tests).
:func:`stats` counts check launches and host reads, so tests can assert at most one
read per public call (and none with validation off).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
import time
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import _replay, backend
from ._grid import cdiv, next_power_of_2

__all__ = [
    "Fused",
    "Segment",
    "flags",
    "flags_known",
    "fused_buffers",
    "fused_flags",
    "gate",
    "keep_checked",
    "kernel_on_cpu",
    "read_fused",
    "record_checked",
    "replay_checked",
    "replay_kept",
    "reset_stats",
    "signal_done",
    "signal_done_of",
    "stats",
    "wait_done",
]

KINDS = ("all", "len", "live", "gather", "gather_last")
_MODE = {kind: i + 1 for i, kind in enumerate(KINDS)}
MAX_SEGMENTS = 4
I64_MIN, I64_MAX = -(2**63), 2**63 - 1

_stats = {"launches": 0, "host_reads": 0}
_kernel_on_cpu = False


def stats() -> dict:
    """``{"launches": ..., "host_reads": ...}`` since the last :func:`reset_stats` (value checks only)."""
    return dict(_stats)


def reset_stats() -> None:
    for key in _stats:
        _stats[key] = 0


@contextlib.contextmanager
def kernel_on_cpu(enabled: bool = True):
    """Run the Triton check kernel (interpreted) on CPU tensors too, instead of the PyTorch evaluation."""
    global _kernel_on_cpu
    previous = _kernel_on_cpu
    _kernel_on_cpu = bool(enabled)
    try:
        yield
    finally:
        _kernel_on_cpu = previous


@dataclasses.dataclass
class Segment:
    """One range check of a call (see the module docstring); building one does no device work."""

    kind: str
    t: torch.Tensor
    lo: int | None = None
    hi: int | None = None
    aux: torch.Tensor | None = None
    pos: torch.Tensor | None = None
    unit: int = 1
    modulus: int = 0
    mod_limit: int = 0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind: expected one of {KINDS}, got {self.kind!r}")


# ----------------------------------------------------------------------------
# the kernel
# ----------------------------------------------------------------------------


@triton.jit
def _segment(
    flags_ptr,
    pid,
    tensors,
    ints,
    MODE: tl.constexpr,
    HAS_MOD: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """One segment: ``tensors = (t, aux, pos)`` and ``ints`` as :func:`_kernel_args` lays them out."""
    t_ptr, aux_ptr, pos_ptr = tensors
    n1, s0, s1, s2, R, C, a0, a1, p0, unit, lo, hi, modulus, mod_limit, flag = ints
    rows = (pid * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    rok = rows < R
    if MODE == 4 or MODE == 5:  # rows of a block table (n1 = its B rows) reached through (req, pos)
        req = tl.load(aux_ptr + rows * a0, mask=rok, other=-1).to(tl.int64)
        p = tl.load(pos_ptr + rows * p0, mask=rok, other=-1).to(tl.int64)
        live = rok & (p >= 0) & (req >= 0) & (req < n1)
        last = tl.minimum(p, C * unit - 1) // unit
        roff = tl.where(live, req, 0) * s0
        limit = tl.where(live, last + 1, 0)
    else:
        roff = (rows // n1) * s0 + (rows % n1) * s1
        if MODE == 2:  # columns used: ceil(clamp(len, 0, C * unit) / unit)
            ln = tl.load(aux_ptr + (rows // n1) * a0 + (rows % n1) * a1, mask=rok, other=0).to(tl.int64)
            ln = tl.minimum(tl.maximum(ln, 0), C * unit)
            limit = tl.where(rok, (ln + unit - 1) // unit, 0)
        elif MODE == 3:  # live rows: aux (a position) >= 0
            lv = tl.load(aux_ptr + rows * a0, mask=rok, other=-1).to(tl.int64)
            limit = tl.where(rok & (lv >= 0), C, 0).to(tl.int64)
        else:
            limit = tl.where(rok, C, 0).to(tl.int64)
    if MODE == 5:  # only the last column a row reads
        col = tl.where(live, last, 0)
        v1 = tl.load(t_ptr + roff + col * s2, mask=live, other=0).to(tl.int64)
        total = tl.sum((live & ((v1 < lo) | (v1 > hi))).to(tl.int32), axis=0)
        total_mod = total * 0
    else:
        nbad = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.int32)
        nmod = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.int32)
        c0 = pid * 0  # an int32 scalar (a loop-carried value must keep its type)
        while c0 < C:  # (a while loop: Triton's interpreter cannot run range() with runtime bounds)
            cols = (c0 + tl.arange(0, BLOCK_C)).to(tl.int64)
            m = cols[None, :] < limit[:, None]
            v = tl.load(t_ptr + roff[:, None] + cols[None, :] * s2, mask=m, other=0).to(tl.int64)
            nbad += (m & ((v < lo) | (v > hi))).to(tl.int32)
            if HAS_MOD:
                nmod += (m & ((v % modulus + modulus) % modulus >= mod_limit)).to(tl.int32)
            c0 += BLOCK_C
        total = tl.sum(tl.sum(nbad, axis=1), axis=0)
        total_mod = tl.sum(tl.sum(nmod, axis=1), axis=0)
    # (plain stores of 1, never of 0: programs agree, and the flags may live in pinned host memory)
    tl.store(flags_ptr + flag, 1, mask=total > 0)
    if HAS_MOD:
        tl.store(flags_ptr + flag + 1, 1, mask=total_mod > 0)


_SEG_TENSORS = ("t", "aux", "pos")
_SEG_INTS = ("n1", "s0", "s1", "s2", "R", "C", "a0", "a1", "p0", "unit", "lo", "hi", "mod", "modl", "flag")
# (flat, not tuples: Triton specializes every int inside a tuple argument, do_not_specialize or not)
_INT_ARGS = [f"{name}{i}" for i in range(MAX_SEGMENTS) for name in _SEG_INTS]
_PTR_ARGS = ["flags_ptr", "count_ptr", "done_ptr"] + [
    f"{name}{i}" for i in range(MAX_SEGMENTS) for name in _SEG_TENSORS
]


# The sizes, strides and bounds change from call to call: int64 and never specialized. Nor are the
# pointers on their alignment (the loads are gathers). So the compiled kernel depends only on the
# constexprs and the tensors' dtypes, which is what lets a call skip Triton's argument binding.
@triton.jit(do_not_specialize=_INT_ARGS, do_not_specialize_on_alignment=_PTR_ARGS)
def _valcheck_kernel(
    flags_ptr,
    t0,
    aux0,
    pos0,
    n10: tl.int64,
    s00: tl.int64,
    s10: tl.int64,
    s20: tl.int64,
    R0: tl.int64,
    C0: tl.int64,
    a00: tl.int64,
    a10: tl.int64,
    p00: tl.int64,
    unit0: tl.int64,
    lo0: tl.int64,
    hi0: tl.int64,
    mod0: tl.int64,
    modl0: tl.int64,
    flag0: tl.int64,
    t1,
    aux1,
    pos1,
    n11: tl.int64,
    s01: tl.int64,
    s11: tl.int64,
    s21: tl.int64,
    R1: tl.int64,
    C1: tl.int64,
    a01: tl.int64,
    a11: tl.int64,
    p01: tl.int64,
    unit1: tl.int64,
    lo1: tl.int64,
    hi1: tl.int64,
    mod1: tl.int64,
    modl1: tl.int64,
    flag1: tl.int64,
    t2,
    aux2,
    pos2,
    n12: tl.int64,
    s02: tl.int64,
    s12: tl.int64,
    s22: tl.int64,
    R2: tl.int64,
    C2: tl.int64,
    a02: tl.int64,
    a12: tl.int64,
    p02: tl.int64,
    unit2: tl.int64,
    lo2: tl.int64,
    hi2: tl.int64,
    mod2: tl.int64,
    modl2: tl.int64,
    flag2: tl.int64,
    t3,
    aux3,
    pos3,
    n13: tl.int64,
    s03: tl.int64,
    s13: tl.int64,
    s23: tl.int64,
    R3: tl.int64,
    C3: tl.int64,
    a03: tl.int64,
    a13: tl.int64,
    p03: tl.int64,
    unit3: tl.int64,
    lo3: tl.int64,
    hi3: tl.int64,
    mod3: tl.int64,
    modl3: tl.int64,
    flag3: tl.int64,
    count_ptr,
    done_ptr,
    MODES: tl.constexpr,
    HAS_MOD: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    SIGNAL: tl.constexpr,
):
    """``MAX_SEGMENTS`` slots, each :data:`_SEG_TENSORS` + :data:`_SEG_INTS` (as :func:`_kernel_args` lays them
    out), its ``MODES`` entry (0: unused) and ``HAS_MOD`` entry; one :func:`_segment` per slot.
    ``SIGNAL``: the last program sets ``done`` once every program's flags are written (:func:`signal_done`)."""
    pid = tl.program_id(0)
    tensors = (
        (t0, aux0, pos0),
        (t1, aux1, pos1),
        (t2, aux2, pos2),
        (t3, aux3, pos3),
    )
    ints = (
        (n10, s00, s10, s20, R0, C0, a00, a10, p00, unit0, lo0, hi0, mod0, modl0, flag0),
        (n11, s01, s11, s21, R1, C1, a01, a11, p01, unit1, lo1, hi1, mod1, modl1, flag1),
        (n12, s02, s12, s22, R2, C2, a02, a12, p02, unit2, lo2, hi2, mod2, modl2, flag2),
        (n13, s03, s13, s23, R3, C3, a03, a13, p03, unit3, lo3, hi3, mod3, modl3, flag3),
    )
    for i in tl.static_range(len(MODES)):
        if MODES[i] != 0:
            _segment(flags_ptr, pid, tensors[i], ints[i], MODES[i], HAS_MOD[i], BLOCK_R, BLOCK_C)
    if SIGNAL:
        signal_done(count_ptr, done_ptr)


@triton.jit
def signal_done(count_ptr, done_ptr):
    """Tell the host that this launch's value checks are finished: every program calls this once, after
    writing its flags; the last one to arrive resets the counter ``count_ptr`` (device memory, zero
    when a launch starts) and sets ``done_ptr`` (host memory) to 1, so the host can read the flags
    without waiting for the rest of the stream (:func:`wait_done`).

    Ordering: a program's flag stores come before its release of the counter (a barrier first, so
    every thread's stores count), and the last program acquires the counter before its release
    store of ``done``; all at system scope, the host being the reader."""
    signal_done_of(count_ptr, done_ptr, tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2))


@triton.jit
def signal_done_of(count_ptr, done_ptr, total):
    """:func:`signal_done` for a launch where only ``total`` of its programs check values (each calls this
    once, after writing its flags; the others never do)."""
    tl.debug_barrier()
    ticket = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="sys")
    last = ticket == total - 1
    tl.atomic_xchg(count_ptr, 0, mask=last, sem="relaxed", scope="gpu")
    tl.atomic_xchg(done_ptr, 1, mask=last, sem="release", scope="sys")


TILE = 1024
"""Entries a program checks at once: ``BLOCK_R`` rows of ``BLOCK_C`` columns (:func:`_tile_shape`)."""


def _tile_shape(columns: int) -> tuple[int, int]:
    """``(BLOCK_R, BLOCK_C)``: a row's columns in one step where they fit in :data:`TILE` (a program's
    loop over column steps is serial, so a [1, 1024] table checked 32 columns a step took 20 us on
    an H200), the rest of the tile filled with rows."""
    block_c = min(max(next_power_of_2(max(columns, 1)), 16), TILE)
    return TILE // block_c, block_c


def _as_rows(t: torch.Tensor):
    """``(t, n1, s0, s1, s2, R, C)``: row ``r`` of ``t`` at ``(r // n1) * s0 + (r % n1) * s1``, column stride ``s2``."""
    nd = t.dim()
    if nd == 0 or nd > 3:
        t, nd = t.reshape(-1), 1
    shape, st = t.shape, t.stride()
    if nd == 1:
        return t, max(shape[0], 1), 0, st[0], 0, shape[0], 1
    if nd == 2:
        return t, max(shape[0], 1), 0, st[0], st[1], shape[0], shape[1]
    h, n, c = shape
    return t, max(n, 1), st[0], st[1], st[2], h * n, c


def _aux_strides(seg: Segment) -> tuple[int, int]:
    st = seg.aux.stride()
    return (st[0], st[1]) if len(st) == 2 else (0, st[0])


def _kernel_args(seg: Segment, flag: int, dummy: torch.Tensor) -> tuple[tuple, tuple, int, bool]:
    """``(tensors, ints, mode, has_mod)`` of one slot: ``tensors`` as :data:`_SEG_TENSORS`, ``ints`` as
    :data:`_SEG_INTS` (``R``: the rows the slot checks)."""
    lo = I64_MIN if seg.lo is None else seg.lo
    hi = I64_MAX if seg.hi is None else seg.hi
    kind = seg.kind
    if kind == "gather" or kind == "gather_last":
        bt, aux, pos = seg.t, seg.aux, seg.pos
        b, m = bt.shape
        bs = bt.stride()
        # n1 carries B here (the live test is req < n1)
        tensors = (bt, aux, pos)
        ints = (b, bs[0], 0, bs[1], aux.shape[0], m, aux.stride(0), 0, pos.stride(0))
    else:
        t, n1, s0, s1, s2, rows, c = _as_rows(seg.t)
        if kind == "len":
            a0, a1 = _aux_strides(seg)
            aux = seg.aux
        elif kind == "live":
            a0, a1, aux = seg.aux.stride(0), 0, seg.aux
        else:
            a0, a1, aux = 0, 0, dummy
        tensors, ints = (t, aux, dummy), (n1, s0, s1, s2, rows, c, a0, a1, 0)
    ints += (max(seg.unit, 1), lo, hi, max(seg.modulus, 1), seg.mod_limit, flag)
    return tensors, ints, _MODE[kind], seg.modulus > 0


FAST_LAUNCH = True
"""Launch the compiled check kernel through its launcher once Triton has compiled it for the same
constexprs and dtypes (see :func:`_run_kernel`); ``False``: always Triton's own launch path."""

_compiled: dict = {}  # (device index, modes, has_mod, BLOCK_C, dtypes) -> Triton's compiled kernel
_UNUSED_INTS = (1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 1, 0, 0)  # an unused slot's ints (as _SEG_INTS)


def _run_kernel(segments: list[Segment], flags_buf: torch.Tensor, target=None, signal=None, keep=None) -> None:
    """One check launch into ``target`` (default ``flags_buf``, which also stands in for unused pointers);
    ``signal``: ``(count, done)`` where the launch tells the host it is finished (:func:`signal_done`);
    ``keep``: a list that gets ``(kernel, direct, grid, values)`` where the launch was a direct one
    (what :func:`flags_known` launches again).

    Triton's own launch binds all 75 arguments and looks the compiled kernel up by their
    specialization, which costs tens of microseconds of host time per call. Here nothing but the
    constexprs and the dtypes decide the compiled kernel (the ints are int64 and unspecialized,
    the pointers unspecialized on alignment), so after Triton's first launch of a combination its
    compiled kernel is launched directly: through the compiled launcher's C entry with every
    pointer as an address where it can (:func:`mm3lab._replay.direct_launcher`; the launcher asks
    the driver about each tensor it is given), else :func:`mm3lab._replay.launch_compiled`.
    """
    flat, addresses, modes, has_mod, dtypes = [], [], [], [], []
    rows, columns = 1, 0
    for i, seg in enumerate(segments):
        tensors, ints, mode, mod = _kernel_args(seg, 2 * i, flags_buf)
        flat += tensors
        flat += ints
        # (each GPU tensor as its address, for a direct launch; a CPU tensor as it is: the launcher rejects it)
        addresses += [t.data_ptr() if t.is_cuda else t for t in tensors]
        addresses += ints
        modes.append(mode)
        has_mod.append(mod)
        dtypes += (tensors[0].dtype, tensors[1].dtype, tensors[2].dtype)
        rows, columns = max(rows, ints[4]), max(columns, ints[5])
    unused = MAX_SEGMENTS - len(segments)
    if unused:  # unused slots: the flags buffer and inert ints
        flat += (flags_buf, flags_buf, flags_buf, *_UNUSED_INTS) * unused
        ptr = flags_buf.data_ptr() if flags_buf.is_cuda else flags_buf
        addresses += (ptr, ptr, ptr, *_UNUSED_INTS) * unused
        modes += [0] * unused
        has_mod += [False] * unused
    modes, has_mod = tuple(modes), tuple(has_mod)
    block_r, block_c = _tile_shape(columns)
    grid = (cdiv(rows, block_r), 1, 1)
    target = flags_buf if target is None else target
    count, done = (flags_buf, flags_buf) if signal is None else signal
    consts = (modes, has_mod, block_r, block_c, signal is not None)
    fast = FAST_LAUNCH and _replay.supported() and _replay.hooks_idle()
    if fast:
        # (unused slots always hold the int32 flags buffer: the used slots' dtypes decide)
        key = (flags_buf.get_device(), *consts[:-2], *dtypes, consts[-1])
        compiled = _compiled.get(key)
        if compiled is not None:
            kernel, direct = compiled
            stream = _replay.current_stream(flags_buf.device)
            if direct is not None and _replay.DIRECT:
                # (target, count and done: this module's buffers, on the GPU or pinned, whose address is the GPU's)
                values = (target.data_ptr(), *addresses, count.data_ptr(), done.data_ptr(), *consts)
                _replay.call_direct(kernel, direct, grid, stream, values)
                if keep is not None:
                    keep.append((kernel, direct, grid, values))
            else:
                _replay.launch_compiled(kernel, grid, (target, *flat, count, done, *consts), stream)
            return
    kernel = _valcheck_kernel[grid](
        target, *flat, count, done, modes, has_mod, BLOCK_R=block_r, BLOCK_C=block_c, SIGNAL=signal is not None
    )
    if fast and kernel is not None:
        kernel = kernel.result() if hasattr(kernel, "result") else kernel
        _compiled[key] = (kernel, _replay.direct_launcher(kernel, grid))


# ----------------------------------------------------------------------------
# the PyTorch evaluation (same flags)
# ----------------------------------------------------------------------------


def _range_bad(v: torch.Tensor, seg: Segment) -> torch.Tensor | None:
    """Entries of ``v`` outside ``[lo, hi]``, compared in ``v``'s own dtype (a bound the dtype
    cannot reach is no test); ``None`` when no entry can be outside."""
    info = torch.iinfo(v.dtype)
    bad = None
    if seg.lo is not None and seg.lo > info.min:
        bad = v < seg.lo if seg.lo <= info.max else torch.ones(v.shape, dtype=torch.bool, device=v.device)
    if seg.hi is not None and seg.hi < info.max:
        over = v > seg.hi if seg.hi >= info.min else torch.ones(v.shape, dtype=torch.bool, device=v.device)
        bad = over if bad is None else bad | over
    return bad


def _torch_flags(seg: Segment) -> list:
    """``[range_bad, mod_bad]`` of one segment: 0-d bool tensors (no host read) or ``False``."""
    kind = seg.kind
    if kind in ("gather", "gather_last"):
        bt = seg.t
        b, m = bt.shape
        if m == 0 or b == 0 or seg.pos.numel() == 0:
            return [False, False]
        req, p = seg.aux.to(torch.int64), seg.pos.to(torch.int64)
        live = (p >= 0) & (req >= 0) & (req < b)
        last = p.clamp(max=m * seg.unit - 1) // seg.unit
        r = torch.where(live, req, 0)
        if kind == "gather_last":
            v = bt[r, torch.where(live, last, 0)]
            mask = live
        else:
            v = bt[r]
            mask = live[:, None] & (torch.arange(m, device=bt.device)[None, :] <= last[:, None])
    else:
        v = seg.t
        if v.dim() == 0 or v.dim() > 3:
            v = v.reshape(-1)
        if kind == "len":
            c = v.shape[-1]
            ln = seg.aux.to(torch.int64).clamp(0, c * seg.unit)
            used = torch.div(ln + seg.unit - 1, seg.unit, rounding_mode="floor")
            mask = torch.arange(c, device=v.device) < used.unsqueeze(-1)
        elif kind == "live":
            mask = seg.aux >= 0
        else:
            mask = None
    bad = _range_bad(v, seg)
    out = [False if bad is None else (bad if mask is None else mask & bad).any()]
    if seg.modulus > 0:
        mod_bad = torch.remainder(v, seg.modulus) >= seg.mod_limit
        out.append((mod_bad if mask is None else mask & mod_bad).any())
    else:
        out.append(False)
    return out


# ----------------------------------------------------------------------------
# the entry point
# ----------------------------------------------------------------------------


def _use_kernel(t: torch.Tensor) -> bool:
    if t.is_cuda:
        return backend.use_kernel(t)
    return _kernel_on_cpu and backend.INTERPRETER and backend.get_backend() != "torch"


def _empty(seg: Segment) -> bool:
    """A segment that reads nothing (and whose tensors may have no storage to point at)."""
    return seg.t.numel() == 0 or (seg.aux is not None and seg.aux.numel() == 0)


_buffers = threading.local()

DONE = 2 * MAX_SEGMENTS
"""Index of the ``done`` word in the host flags buffer, and of the launch counter in the device one
(:func:`signal_done`); the flags come before it."""


class Buffers(NamedTuple):
    """One thread's flags buffers on one device, kept from call to call (see :func:`_flags_buffers`)."""

    device: torch.Tensor
    """int32 ``[DONE + 1]`` on the device: flags (where not zero-copy), then the launch counter (zero)."""
    host: torch.Tensor | None
    """int32 ``[DONE + 1]`` pinned host memory (a GPU only): flags, then ``done``."""
    view: object
    """``host`` as a NumPy array (the same memory): what the host reads while it waits."""
    signal: tuple | None
    """``(counter, done)`` one-element views: the pointers :func:`signal_done` takes."""


def _flags_buffers(device: torch.device) -> Buffers:
    """This thread's zeroed flags buffer on ``device`` and, on a GPU, a pinned host buffer to read it
    into, both kept from call to call: every read waits for the flags, and a flagged read zeroes
    them again, so they are all zeros whenever a call starts (a capture gets new ones)."""
    cuda = device.type == "cuda"
    if cuda and torch.cuda.is_current_stream_capturing():
        return Buffers(torch.zeros(DONE + 1, dtype=torch.int32, device=device), None, None, None)
    per_device = getattr(_buffers, "per_device", None)
    if per_device is None:
        per_device = _buffers.per_device = {}
    bufs = per_device.get(device)
    if bufs is None:
        flags_buf = torch.zeros(DONE + 1, dtype=torch.int32, device=device)
        host = view = signal = None
        if cuda:
            host = torch.zeros(DONE + 1, dtype=torch.int32, pin_memory=True)
            view = host.numpy()
            signal = (flags_buf[DONE:], host[DONE:])
        bufs = per_device[device] = Buffers(flags_buf, host, view, signal)
    return bufs


ZERO_COPY = True
"""On a GPU, the check kernel writes its flags straight into pinned host memory (mapped into the
GPU's address space), and its last program sets a ``done`` word there (:func:`signal_done`), so a
call waits for that word and reads the flags: no copy launch, no stream sync. ``False`` (or a
platform where the first such launch fails, which turns it off): flags in device memory, copied to
the pinned buffer after a stream sync."""

SPIN_SECONDS = 0.002
"""How long :func:`wait_done` watches a launch's ``done`` word alone. Past it (a check launch queued
behind long work, or one that never ran) it also asks whether the stream has drained, yielding the
CPU between looks: a drained stream has written every flag (or reports the error that stopped it).
It never syncs the stream to wait. A sync would also wait for the work queued after the check (the
attention of the same call), and the host would then queue the next call on an idle device: with
3.2 ms prefill calls, whose check waits behind the previous call, that cost 70 to 85 us a call."""


def wait_done(bufs: Buffers, device: torch.device) -> list[int]:
    """The flags of the launch that ran last into ``bufs`` (zero-copy, with :func:`signal_done`): wait
    for its ``done`` word (no stream sync; past :data:`SPIN_SECONDS`, until the word or a drained
    stream), read the flags, and zero them (where one is set) and ``done`` for the next launch."""
    view = bufs.view
    if not view[DONE]:
        t_end = time.perf_counter() + SPIN_SECONDS
        while not view[DONE]:
            if time.perf_counter() > t_end:
                stream = torch.cuda.current_stream(device)
                while not view[DONE] and not stream.query():  # (drained: then every flag is written)
                    time.sleep(0)
                break
    values = view[:DONE].tolist()
    if any(values):
        # (a gated launch queued after the check may not have read them yet: let it, then zero them)
        torch.cuda.current_stream(device).synchronize()
        view[:DONE] = 0
    view[DONE] = 0
    return values


def gate(device: torch.device) -> torch.Tensor | None:
    """The flags a value-check launch on ``device`` writes (zero-copy, :data:`ZERO_COPY`), for a launch
    queued after it in stream order that must write nothing when one is set (a gated insert, which the
    host queues before it reads the flags: :func:`mm3lab._replay.memo_call`). They are zeros at the start
    of every call, and a flagged read zeroes them only after the stream has drained. ``None`` where the
    checks do not run that way (a CPU device, zero-copy off, graph capture)."""
    if device.type != "cuda" or not ZERO_COPY or torch.cuda.is_current_stream_capturing():
        return None
    return _flags_buffers(device).host[:DONE]


def _launch_and_read(segments: list[Segment], bufs: Buffers, keep=None) -> list[int]:
    """One check launch and the flags on the host (a GPU: the launch's ``done`` word or a stream sync;
    no allocation, no pageable staging copy; the CPU reads them as they are). A flagged read zeroes them."""
    global ZERO_COPY
    flags_buf, host = bufs.device, bufs.host
    if host is None:
        _run_kernel(segments, flags_buf)
        values = flags_buf.tolist()
        if any(values):
            flags_buf.zero_()
        return values
    if ZERO_COPY:
        try:
            _run_kernel(segments, flags_buf, host, bufs.signal, keep)
        except (ValueError, RuntimeError):  # (a platform whose GPU cannot take a host pointer)
            ZERO_COPY = False
    if ZERO_COPY:
        return wait_done(bufs, flags_buf.device)
    stream = torch.cuda.current_stream(flags_buf.device)
    _run_kernel(segments, flags_buf)
    host.copy_(flags_buf, non_blocking=True)
    stream.synchronize()
    values = host[:DONE].tolist()
    if any(values):
        flags_buf.zero_()
        host.zero_()
        stream.synchronize()
    return values


class Fused(NamedTuple):
    """Where a kernel that runs a call's value checks itself writes its flags and says it is done."""

    flags: torch.Tensor
    """int32 pinned host memory: the kernel sets its flags (indices ``0 ..``) to 1."""
    count: torch.Tensor
    """The launch counter (device, zero when a launch starts; :func:`signal_done`)."""
    done: torch.Tensor
    """The ``done`` word (host)."""


def fused_flags(device: torch.device) -> Fused | None:
    """This thread's zeroed flags buffer in pinned host memory and its launch counter and ``done`` word,
    for a kernel that runs a call's value checks itself, writes its flags there as it runs, and
    signals when they are all written (zero-copy, :data:`ZERO_COPY`); ``None`` where there is none
    (a CPU device, zero-copy off, graph capture): such a call runs :func:`flags`."""
    if device.type != "cuda" or not ZERO_COPY or torch.cuda.is_current_stream_capturing():
        return None
    bufs = _flags_buffers(device)
    return Fused(bufs.host, *bufs.signal)


def fused_buffers(device: torch.device) -> Buffers:
    """The buffers behind :func:`fused_flags` on ``device`` (this thread's), for a caller that keeps them
    from call to call and passes them to :func:`read_fused` (a memo entry: it is kept per thread, and
    never used while a CUDA graph is captured)."""
    return _flags_buffers(device)


def read_fused(device: torch.device, bufs: Buffers | None = None) -> list[int]:
    """The flags a launch wrote into :func:`fused_flags`' buffers, once it has said they are all written
    (:func:`wait_done`: one host read, no stream sync), zeroed again where one is set. ``bufs``: those
    buffers as :func:`fused_buffers` gave them (this thread's, for ``device``), which saves looking them up.

    Every launch given :func:`fused_flags` must be followed by this (or :func:`settle`) before the
    next such launch: ``done`` is zero when a launch starts only because its reader zeroes it."""
    _stats["host_reads"] += 1
    return wait_done(_flags_buffers(device) if bufs is None else bufs, device)


def settle(device: torch.device, *, sync: bool = False) -> None:
    """Forget the flags of the last launch given :func:`fused_flags` (a first call, whose values were
    checked before it ran; or a call interrupted between its launch and its read): wait for its
    ``done`` word (``sync``: a stream sync, for a launch that may not have run), zero everything."""
    bufs = _flags_buffers(device)
    if bufs.view is None:
        return
    if sync:
        with contextlib.suppress(RuntimeError):  # (the error that interrupted the call is the one to see)
            torch.cuda.current_stream(device).synchronize()
    else:
        wait_done(bufs, device)
    bufs.view[:] = 0


def flags(*segments: Segment, _keep=None) -> list[int]:
    """``[range_bad_0, mod_bad_0, range_bad_1, mod_bad_1, ...]`` (0 or 1): one launch and one host read.

    Every segment's tensors must be on one device (checked by the callers' structural checks).
    """
    segments = [s for s in segments if s is not None and not _empty(s)]
    if not segments:
        return []
    if len(segments) > MAX_SEGMENTS:
        raise ValueError(f"segments: at most {MAX_SEGMENTS} per launch, got {len(segments)}")
    device = segments[0].t.device
    _stats["launches"] += 1
    _stats["host_reads"] += 1
    if _use_kernel(segments[0].t):
        values = _launch_and_read(segments, _flags_buffers(device), _keep)
        if _keep:
            _keep[0] += (device, 2 * len(segments))
        return values[: 2 * len(segments)]
    parts = [f for seg in segments for f in _torch_flags(seg)]
    tensors = [f for f in parts if isinstance(f, torch.Tensor)]
    values = iter(torch.stack(tensors).tolist() if tensors else [])
    return [int(next(values)) if isinstance(f, torch.Tensor) else 0 for f in parts]


KNOWN_CHECKS = 16
"""Check launches kept per thread for :func:`flags_known` (least recently used dropped first); 0: none."""


def flags_known(key, segments, then=None) -> list[int]:
    """:func:`flags` of the segments ``segments()`` builds, for a caller whose ``key`` fixes them: every
    tensor's address and metadata and every bound (a call's :class:`mm3lab._checks.PassedChecks` key
    and what the segments are for). The first call with ``key`` builds them and keeps its launch's
    arguments where it launched directly (zero-copy, no launch hook); a later call with the same key
    launches them again at once, without building the segments and their 75 arguments, and reads
    the flags as :func:`flags` does. ``key`` ``None``: :func:`flags` itself.

    ``then``: called between a kept launch and the read of its flags (work the host can queue while
    the check runs; the flags are read whatever it does); not called on the other paths."""
    known = getattr(_buffers, "known", None)
    if known is None:
        known = _buffers.known = collections.OrderedDict()
    entry = None if key is None or KNOWN_CHECKS <= 0 else known.get(key)
    if entry is not None and ZERO_COPY and _replay.DIRECT and _replay.hooks_idle():
        kernel, direct, grid, values, device, n = entry
        if not torch.cuda.is_current_stream_capturing():
            known.move_to_end(key)
            _stats["launches"] += 1
            _stats["host_reads"] += 1
            _replay.call_direct(kernel, direct, grid, _replay.current_stream(device), values)
            try:
                if then is not None:
                    then()
            finally:  # (the done word is read after every launch: the next launch's read starts from zero)
                flagged = wait_done(_flags_buffers(device), device)[:n]
            return flagged
    keep = [] if key is not None and KNOWN_CHECKS > 0 else None
    values = flags(*segments(), _keep=keep)
    if keep:
        known[key] = keep[0]
        while len(known) > KNOWN_CHECKS:
            known.popitem(last=False)
    return values


def replay_checked(
    recording, inputs: dict, device: torch.device, stream, fused: Fused | None, bufs: Buffers | None = None
) -> bool:
    """Replay ``recording`` (:meth:`mm3lab._replay.Recording.replay`) whose launch runs the call's value
    checks itself where ``fused`` (:func:`fused_flags`): whether that launch flagged a value. ``bufs``:
    ``fused``'s buffers (:func:`fused_buffers`), where the caller kept them."""
    try:
        recording.replay(inputs, device, stream)
    except BaseException:
        if fused is not None:
            settle(device, sync=True)
        raise
    return fused is not None and any(read_fused(device, bufs))


def replay_kept(entry, inputs: dict, device: torch.device, stream, detail) -> None:
    """Replay a memo entry that :func:`keep_checked` kept (its launch checks the call's values itself) with
    the call's ``inputs``; where the launch flagged a value, ``detail()`` (the call's detailed checks)
    raises its message (:func:`mm3lab._checks.raise_flagged`)."""
    from ._checks import raise_flagged

    fused, bufs = entry.info
    if replay_checked(entry.recording, inputs, device, stream, fused, bufs):
        raise_flagged(detail)


def keep_checked(memo, key, launch, inputs: dict, device: torch.device, fused: Fused):
    """The first call of a shape whose launch checks the call's values itself (given ``fused``): run
    ``launch`` and record it (:func:`record_checked`), keep the recording in ``memo`` under ``key`` with
    what its replays need, ``fused`` and its buffers (:func:`replay_kept`); returns ``launch``'s result."""
    returned, recording = record_checked(launch, inputs, device, fused)
    memo.put(key, recording, None if recording is None else (fused, fused_buffers(device)))
    return returned


def record_checked(launch, inputs: dict, device: torch.device, fused: Fused | None):
    """:func:`mm3lab._replay.record_call` of a first call whose values were checked before it ran and
    whose launch (where ``fused``) runs the checks too: its flags are clear, and are forgotten."""
    try:
        returned, recording = _replay.record_call(launch, inputs)
    except BaseException:
        if fused is not None:
            settle(device, sync=True)
        raise
    if fused is not None:
        settle(device, sync=recording is None)  # (no recording: maybe no launch)
    return returned, recording
