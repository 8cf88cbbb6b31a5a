"""Recorded decode steps: repeated one-shot :func:`mm3lab.msa_decode` calls of one shape replay their launches.

A decode loop that calls :func:`mm3lab.msa_decode` directly repeats the same step: the same
kernels, grids and shapes, only the tensors' addresses and values change. Most of an eager
call's host time is spent on Triton's per-launch argument binding and on allocations
(:mod:`mm3lab._replay`), which a plan (:class:`mm3lab.MSADecodePlan`) does once. So after
checking every argument as always, the one-shot call runs the step through an internal plan of
its shapes when it has seen those shapes before:

* the first call of a shape takes the normal path and remembers the shape;
* the second builds a plan for it (buffers for the intermediates) and records its launches;
* later calls replay the recorded launches with the call's tensors put in place, which is
  valid while every tensor has the recorded strides and alignment (else the call records again);
* a call whose tensors have the addresses and metadata of one that replayed (a decode loop whose
  allocator hands out the same buffers; the structural checks' key,
  :class:`mm3lab._checks.PassedChecks`) replays at once (:func:`replay_known`), without the shape
  lookup and the recording's comparison, which that key already answers.

What a call returns is its own new ``out`` tensor: the plan's intermediates (slots, scores,
top-k, sparse block table, log-sum-exp, split partials) are reused from call to call, in
stream order (the plans are kept per thread and per CUDA stream). Neither the plans nor their
recordings keep the caller's tensors (inputs, caches) alive. Results are bit-identical to the
normal path (same kernels, same arguments; ``tests/test_msa_recorded.py``).

The path applies on a GPU with recordable launches (:func:`mm3lab._replay.supported`), outside
CUDA-graph capture, without ``return_intermediates``, for fewer than
:data:`mm3lab.attention.TILED_MIN_ROWS` rows (where the attention kernel is fixed), and where the
step runs its kernels (no PyTorch fallback). :data:`ENABLED` turns it off.
"""

from __future__ import annotations

import collections
import threading

import torch

from .. import _pdl, _replay
from ..attention import TILED_MIN_ROWS
from ..block_table import MAX_KERNEL_TOPK
from ..indexer import index_fallback

ENABLED = True
"""Replay repeated one-shot decode steps (where the module doc says); ``False``: always the normal path."""

MAX_SHAPES = 4
"""Shapes (with their plans) kept per thread and stream, least recently used dropped first."""

_TENSORS = ("q", "key", "value", "index_q", "index_k", "block_table", "seq_lens")
_CACHES = ("k_cache", "v_cache", "index_cache", "index_scale", "k_scale", "v_scale")

_PLANNED = ("decode_query_len", "topk", "init_blocks", "local_blocks", "scale", "index_scale", "k_scale", "v_scale")
"""The call's arguments a plan takes as they are."""

_local = threading.local()


class _Shape:
    """One shape's state: seen once (``plan is None``), planned, or found unplannable."""

    __slots__ = ("plan", "recording", "usable")

    def __init__(self):
        self.plan, self.recording, self.usable = None, None, True

    def drop(self) -> None:
        """Forget the plan and its recording (a shape pushed out: its buffers go, its known calls miss)."""
        self.plan, self.recording, self.usable = None, None, False


KNOWN_CALLS = 16
"""Calls known to match a shape's recording (:func:`replay_known`) kept per thread, least recently used
dropped (0: none kept, every call looks its shape up; benchmarks compare both)."""


def _key(args) -> tuple | None:
    """Everything a plan fixes: shapes and dtypes of every tensor, the selection, the stream
    (``None`` where a tensor argument is not a tensor: the normal path rejects the call)."""
    q = args.q
    key = [
        torch.cuda.current_stream(q.device).cuda_stream if q.is_cuda else None,
        args.decode_query_len,
        args.topk,
        args.init_blocks,
        args.local_blocks,
        args.scale,
    ]
    for name in (*_TENSORS, *_CACHES):
        t = getattr(args, name)
        if t is not None and not isinstance(t, torch.Tensor):
            return None  # (an argument the inserts' checks, still to come, reject)
        key.append(None if t is None else (t.shape, t.dtype, t.device))
    return tuple(key)


def _shapes() -> collections.OrderedDict:
    shapes = getattr(_local, "shapes", None)
    if shapes is None:
        shapes = _local.shapes = collections.OrderedDict()
    return shapes


def _known() -> collections.OrderedDict:
    known = getattr(_local, "known", None)
    if known is None:
        known = _local.known = collections.OrderedDict()
    return known


def clear() -> None:
    """Drop this thread's recorded shapes and their plans' buffers (the next calls start afresh)."""
    _local.shapes = None
    _local.known = None


def applies(args) -> bool:
    """Whether this call may take the recorded path (see the module doc); no device work."""
    q = args.q
    return (
        ENABLED
        and not args.return_intermediates
        and q.is_cuda
        and _replay.supported()
        and q.shape[0] < TILED_MIN_ROWS
        and not torch.cuda.is_current_stream_capturing()
    )


def lookup(args):
    """The plan of this call's shape if one is built or due (its second call), else ``None`` (normal path).

    ``args``: every argument of :func:`mm3lab.msa_decode` by name, after the query's and the indexer's
    checks; the inserts' checks come after the lookup (with the plan's slots), so a call they reject
    never runs the plan."""
    shapes = _shapes()
    key = _key(args)
    if key is None:
        return None
    try:
        shape = shapes.get(key)
    except TypeError:  # (an unhashable scale, which the inserts' checks reject)
        return None
    if shape is None:  # first sight: the normal path, remembered
        shapes[key] = _Shape()
        while len(shapes) > MAX_SHAPES:
            shapes.popitem(last=False)[1].drop()
        return None
    shapes.move_to_end(key)
    if not shape.usable:
        return None
    if shape.plan is None:
        shape.plan = _build(args)
        if shape.plan is None:
            shape.usable = False
            return None
    return shape


def _build(args):
    """A plan of the call's shapes holding none of its tensors, or ``None`` where no plan runs this call's kernels."""
    from ..plan import MSADecodePlan

    b, m = args.block_table.shape
    if args.seq_lens.dtype != args.block_table.dtype:
        return None  # (a plan takes one id dtype)
    if args.topk > MAX_KERNEL_TOPK or index_fallback(args.index_q.dtype, args.index_cache.dtype, args.index_q.shape[1]):
        return None  # (the one-shot step takes a PyTorch path there, SPEC 7; a plan would log it again)
    caches = [getattr(args, name) for name in _CACHES]
    try:
        plan = MSADecodePlan(
            *caches[:3],
            batch=b,
            max_blocks=m,
            num_q_heads=args.q.shape[1],
            id_dtype=args.block_table.dtype,
            query_dtype=args.q.dtype,
            **{name: getattr(args, name) for name in _PLANNED},
        )
        plan._check_inputs({name: getattr(args, name) for name in _TENSORS}, caches)  # metadata only
    except (TypeError, ValueError):  # (e.g. index_q's dtype differs from q's over FP8 caches)
        return None
    if not plan.uses_kernels:
        return None
    plan._caches = None  # (used only at construction and by the checks the one-shot call has made)
    plan.out = None  # (each call gets its own)
    return plan


def _inputs(args, out) -> dict:
    """The call's tensors by name, as the recording takes them (caches included: put in place at each
    replay, so that the recording keeps none of them)."""
    inputs = {name: getattr(args, name) for name in _TENSORS}
    inputs["out"] = out
    for name in _CACHES:
        t = getattr(args, name)
        if t is not None:
            inputs[name] = t
    return inputs


def run(shape: _Shape, args, checked_key=None) -> torch.Tensor:
    """The step through ``shape``'s plan, into a new ``out``: replayed where the recording applies.

    ``checked_key``: the call's :class:`mm3lab._checks.PassedChecks` key, or ``None``. Where the call
    replays or records, its key is kept (:func:`replay_known`): a later call of the same key matches
    the same recording."""
    plan = shape.plan
    q = args.q
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    inputs = _inputs(args, out)
    caches = tuple(getattr(args, name) for name in _CACHES)
    plan.out = out
    try:
        rec = shape.recording
        if rec is not None and rec.matches(inputs, ()):
            rec.replay(inputs, plan.device)
        else:
            shape.recording = rec = _replay.record(lambda: plan._launch(inputs, caches), inputs, ())
        if rec is not None:
            rec.release()
            if checked_key is not None and KNOWN_CALLS > 0:
                known = _known()
                key = (checked_key, _replay.current_stream(q.device), _pdl.ENABLED)
                known[key] = (shape, rec)
                known.move_to_end(key)
                while len(known) > KNOWN_CALLS:
                    known.popitem(last=False)
    finally:
        plan.out = None
    return out


def replay_known(checked_key, args) -> torch.Tensor | None:
    """The step of a call known to match a recording, replayed into a new ``out``; ``None`` (take
    :func:`lookup`) for any other call.

    A call is known when an earlier call with the same :class:`mm3lab._checks.PassedChecks` key (every
    tensor's address, shape, strides, dtype and device, and the scalars), on the same stream and PDL
    setting, replayed or recorded that recording, and the shape still holds it. The key holds all
    that :meth:`mm3lab._replay.Recording.matches` compares and all that :func:`lookup` keys a shape on,
    so such a call skips both; only its new ``out`` is compared (strides and alignment)."""
    known = _known()
    if checked_key is None or not known:
        return None
    q = args.q
    stream = _replay.current_stream(q.device)
    hit = known.get((checked_key, stream, _pdl.ENABLED))
    if hit is None:
        return None
    shape, rec = hit
    if shape.recording is not rec or not shape.usable:  # (recorded anew since, or the shape dropped)
        return None
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if rec.inputs_meta["out"] != (out.stride(), out.data_ptr() % 16 == 0):
        return None
    rec.replay(_inputs(args, out), shape.plan.device, stream)
    rec.release()
    return out


__all__ = ["ENABLED", "KNOWN_CALLS", "MAX_SHAPES", "applies", "clear", "lookup", "replay_known", "run"]
