"""Recorded launches: an eager plan run that skips Triton's per-launch argument binding, and the
memo of repeated one-shot call shapes (:class:`Memo`, the same for single entry points).

Each ``kernel[grid](...)`` launch costs host time before the GPU sees it: Triton binds
the arguments, works out their specialization (is a pointer 16-byte aligned, is an
integer 1 or a multiple of 16), looks the compiled kernel up and only then calls the
launcher. On an H200 host that is 17 us for a kernel of one argument and about 1 us more
per tensor argument; a planned MSA step is four or five launches of 20 to 60 arguments, so binding
costs more than the step's kernels at small batch.

A plan's launches are the same every step: the same kernels, grids, buffers and caches,
and inputs of the planned shapes. So the first eager run of a plan is recorded (each
launch's compiled kernel, grid and bound arguments), and later runs call the compiled
kernels' launchers directly, with the step's input tensors put in place of the recorded
ones. A recording is used only while everything it depends on is unchanged, else the run
records anew (the normal launch path):

* every input has the recorded strides and the recorded 16-byte alignment (Triton
  specializes on both), and every cache and scale is the recorded tensor (same address,
  shape and strides);
* a launch argument is either an input itself, or a tensor descriptor over the whole of one
  (rebuilt over the step's input at each replay), or does not touch an input's memory (a
  view of an input inside a launch would go stale: such a run is not recorded), and no
  tensor is passed as two inputs (``key`` and ``value`` one tensor: not recorded either);
* programmatic dependent launch (:data:`mm3lab._pdl.ENABLED`) is set as when it was recorded
  (a kernel's launch attribute is part of its recorded launch; the memo keys hold the setting too);
* no Triton launch hook is set (profilers), and the Triton version is one whose launcher
  this module was verified on (:data:`VERIFIED_TRITON`); on others plans launch normally.

The replayed launches are the recorded ones exactly, in order, on the current stream, so
results are bit-identical to the normal path (``tests/test_plan_replay.py`` checks this on
the GPU). Set :data:`ENABLED` to ``False`` to turn recording off (benchmarks compare both).
"""

from __future__ import annotations

import collections
import copy
import functools
import itertools
import threading
from typing import NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import _pdl, backend

ENABLED = True
"""Record and replay eager plan runs (where :func:`supported`); ``False``: always launch normally."""

DIRECT = True
"""Replayed launches call the compiled launcher's C entry with addresses (:func:`direct_launcher`);
``False``: through :func:`launch_compiled` with the tensors (benchmarks compare both)."""

COMPILED_GUARDS = True
"""A memo compares its kept shapes' tensor metadata with PyTorch's compiled tensor guard where there is
one (:func:`tensor_guard`); ``False``: with the same read in Python (benchmarks compare both)."""

QUEUE_DURING_CHECKS = True
"""A replayed :func:`memo_call` queues its launches while its kept check launch runs, before the host
reads the check's flags, where its value checks allow it (the indexer's, whose launches write only new
outputs; the index-cache insert's, whose launch reads the check's flags and writes nothing when one is
set); ``False``: after the read (benchmarks compare both)."""

VERIFIED_TRITON = ("3.6.",)
"""Triton versions (prefixes) whose launcher call this module was verified against."""

_local = threading.local()


def supported() -> bool:
    """Recording applies: enabled, compiled kernels on a GPU, a verified Triton."""
    return ENABLED and _platform_supported()


@functools.cache
def _platform_supported() -> bool:
    """Compiled kernels on a GPU and a verified Triton (fixed for the process; asked on every launch)."""
    if backend.INTERPRETER or not torch.cuda.is_available():
        return False
    import triton

    return triton.__version__.startswith(VERIFIED_TRITON)


def _inputs_meta(inputs: dict) -> dict:
    return {name: (t.stride(), t.data_ptr() % 16 == 0) for name, t in inputs.items()}


def _caches_meta(caches) -> tuple:
    return tuple(None if t is None else (t.data_ptr(), tuple(t.shape), t.stride()) for t in caches)


class _Launch:
    """One recorded launch. ``values``: its bound arguments (tensors as passed); ``direct``: the
    compiled launcher's C entry and the arguments before the kernel's own, where it can be called
    directly (:func:`direct_launcher`), with ``addresses``: ``values`` with every GPU tensor as
    its address (the launcher asks the driver about each tensor it is given; an address it takes as is)."""

    __slots__ = ("kernel", "grid", "values", "subs", "descs", "direct", "addresses")

    def __init__(self, kernel, grid, values, subs, descs=()):
        self.kernel, self.grid, self.values, self.subs, self.descs = kernel, grid, values, subs, descs
        self.direct = direct_launcher(kernel, grid)
        self.addresses = [v.data_ptr() if isinstance(v, torch.Tensor) and v.is_cuda else v for v in values]


class Recording:
    """The launches of one eager run, and what they depend on (see the module doc)."""

    def __init__(self, inputs: dict, caches):
        self.inputs_meta = _inputs_meta(inputs)
        self.caches_meta = _caches_meta(caches)
        self.pdl = _pdl.ENABLED  # (the setting its launches were made under)
        self._inputs = inputs
        self._spans = {name: _span(t) for name, t in inputs.items()}
        self.launches: list[_Launch] = []
        self._holding = True  # (the launches' values may hold tensors: those recorded, or a replay's without DIRECT)
        self.ok = True
        self.reason = ""
        self.replays = 0
        if len({id(t) for t in inputs.values()}) < len(inputs):
            # one tensor passed as two inputs: its launch arguments could not say which input they were
            self.ok = False
            self.reason = "one tensor is passed as two inputs"

    def _add(self, fn, args, kwargs, grid, kernel) -> None:
        from triton import knobs
        from triton.runtime.driver import driver

        if hasattr(kernel, "result"):
            kernel = kernel.result()
        kw = dict(kwargs)
        kw["debug"] = kw.get("debug", fn.debug) or knobs.runtime.debug
        kw["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        binder = fn.device_caches[driver.active.get_current_device()][4]
        bound_args = binder(*args, **kw)[0]
        if callable(grid):
            grid = grid(bound_args)
        grid = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
        values = list(bound_args.values())
        subs = []
        descs = []
        for pos, value in enumerate(values):
            if not isinstance(value, torch.Tensor):
                over = descriptor_over(value, self._inputs)
                if over is False:  # a descriptor over part of an input: it would go stale
                    self.ok = False
                    self.reason = f"{fn.__name__} argument {pos} is a tensor descriptor over part of an input"
                elif over is not None:
                    descs.append((pos, over, _descriptor_template(value)))
                continue
            name = next((n for n, t in self._inputs.items() if t is value), None)
            if name is not None:
                subs.append((pos, name))
            else:
                inside = [n for n, span in self._spans.items() if _overlap(_span(value), span)]
                if inside:  # a view of an input: it would go stale
                    self.ok = False
                    self.reason = f"{fn.__name__} argument {pos} is a view of the input {inside[0]}"
        self.launches.append(_Launch(kernel, grid, values, tuple(subs), tuple(descs)))

    def matches(self, inputs: dict, caches) -> bool:
        return (
            self.ok
            and self.pdl == _pdl.ENABLED
            and _caches_meta(caches) == self.caches_meta
            and _inputs_meta(inputs) == self.inputs_meta
        )

    def release(self) -> None:
        """Drop the recording's references to the last run's inputs (they are put in place at each replay),
        so that a kept recording does not keep its caller's tensors alive."""
        if not self._holding:  # (direct replays put addresses in place, which hold nothing)
            return
        self._holding = False
        for launch in self.launches:
            for pos, *_ in launch.subs + launch.descs:
                launch.values[pos] = None
                launch.addresses[pos] = None

    def replay(self, inputs: dict, device: torch.device, stream=None) -> None:
        """The recorded launches with ``inputs`` in place (the caller checked :meth:`matches`), on
        ``stream`` (a handle as :func:`current_stream` gives; default: ``device``'s current stream).

        Each launch calls the compiled launcher directly with the inputs' addresses where it can
        (:func:`direct_launcher`; no launch hook set), else :func:`launch_compiled` with the tensors.
        """
        self.replays += 1
        if stream is None:
            stream = current_stream(device)
        idle = DIRECT and hooks_idle()
        for launch in self.launches:
            direct = launch.direct
            if direct is not None and idle:
                values = launch.addresses
                for pos, name in launch.subs:
                    values[pos] = inputs[name].data_ptr()
                if launch.descs:
                    _put_descriptors(values, launch.descs, inputs)
                call_direct(launch.kernel, direct, launch.grid, stream, values)
                continue
            values = launch.values
            self._holding = True
            for pos, name in launch.subs:
                values[pos] = inputs[name]
            _put_descriptors(values, launch.descs, inputs)
            launch_compiled(launch.kernel, launch.grid, values, stream)


def descriptor_over(value, inputs: dict):
    """For a launch argument that is not a tensor: the name of the input that a tensor descriptor
    (Triton's host-side ``TensorDescriptor``: a ``base`` tensor, shape, strides and block) covers whole,
    ``False`` for a descriptor over part of an input, ``None`` for anything else (a scalar, or a
    descriptor that touches no input)."""
    base = getattr(value, "base", None)
    if type(value).__name__ != "TensorDescriptor" or not isinstance(base, torch.Tensor):
        return None
    span = _span(base)
    for name, t in inputs.items():
        if t is not None and _overlap(span, _span(t)):
            whole = span == _span(t) and t.is_contiguous() and base.is_contiguous()
            return name if whole else False
    return None


def _descriptor_template(desc):
    """A copy of a recorded descriptor without its base (a kept recording holds no input alive)."""
    template = copy.copy(desc)
    template.base = None
    return template


def _put_descriptors(values: list, descs: tuple, inputs: dict) -> None:
    """Each recorded descriptor rebuilt over this replay's input: the launcher reads only its base's address,
    shape, strides and block, and the input has the recorded shape and strides (:meth:`Recording.matches`)."""
    for pos, name, template in descs:
        desc = copy.copy(template)
        desc.base = inputs[name]
        values[pos] = desc


def current_stream(device: torch.device):
    """The handle of ``device``'s current stream, as Triton's launcher takes it (Triton's CUDA driver
    asks PyTorch the same; on other drivers, Triton's own answer)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if _raw_stream is not None:
        return _raw_stream(index)
    from triton.runtime.driver import driver

    return driver.active.get_current_stream(index)


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) if torch.version.cuda else None


_NO_HOOKS = (None, None, None)  # launch metadata, enter hook, exit hook


def direct_launcher(kernel, grid) -> tuple | None:
    """``(C launch function, grid, cooperative flag, PDL flag)`` of a compiled kernel whose launcher
    can be called directly: Triton's CUDA launcher (``CudaLauncher``) of a kernel that needs no
    global or profiling scratch memory (the launcher would allocate it per launch). ``None``
    elsewhere (other launchers, scratch): such launches go through :func:`launch_compiled`."""
    run = kernel.run
    c_launch = getattr(run, "launch", None)
    fields = ("global_scratch_size", "profile_scratch_size", "launch_cooperative_grid", "launch_pdl")
    if type(run).__name__ != "CudaLauncher" or c_launch is None or not all(hasattr(run, f) for f in fields):
        return None
    if run.global_scratch_size or run.profile_scratch_size:
        return None
    return c_launch, tuple(grid), run.launch_cooperative_grid, run.launch_pdl


def call_direct(kernel, direct: tuple, grid: tuple[int, int, int], stream, values) -> None:
    """Launch the compiled ``kernel`` on ``grid`` through its launcher's C entry (``direct``: what
    :func:`direct_launcher` gave for it; its grid is not used), ``values`` its bound arguments with
    every GPU tensor as its address. The caller knows no launch hook is set (:func:`hooks_idle`)."""
    c_launch, _, cooperative, pdl = direct
    c_launch(*grid, stream, kernel.function, cooperative, pdl, None, None, kernel.packed_metadata, *_NO_HOOKS, *values)


def launch_compiled(kernel, grid: tuple[int, int, int], values, stream) -> None:
    """Launch the compiled ``kernel`` with its bound arguments ``values`` (constexprs included, in
    parameter order) through its launcher: the last step of Triton's own launch, without the
    argument binding and lookup before it. The caller knows ``kernel`` is the one Triton would pick."""
    from triton import knobs

    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    meta = None if _idle(enter) else kernel.launch_metadata(grid, stream, *values)
    kernel.run(*grid, stream, kernel.function, kernel.packed_metadata, meta, enter, leave, *values)


@functools.cache
def _runtime_knobs():
    """Triton's runtime settings object (its launch hooks live there; looked up once, read every call)."""
    from triton import knobs

    return knobs.runtime


def hooks_idle() -> bool:
    """No Triton launch hook is set (a profiler's hooks want Triton's own launch path)."""
    runtime = _runtime_knobs()
    return _idle(runtime.launch_enter_hook) and _idle(runtime.launch_exit_hook)


def record(launch, inputs: dict, caches) -> Recording | None:
    """Run ``launch()`` (the normal launches) while recording them; ``None`` if this run cannot be replayed."""
    from triton.runtime.jit import JITFunction

    if not hooks_idle():
        launch()  # a profiler's hooks want Triton's own launch path
        return None
    rec = Recording(inputs, caches)
    original = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        kernel = original(self, *args, grid=grid, warmup=warmup, **kwargs)
        if not warmup and getattr(_local, "recording", None) is rec:  # this thread's launches only
            rec._add(self, args, kwargs, grid, kernel)
        return kernel

    _local.recording = rec
    JITFunction.run = run
    try:
        with _DeviceWork(rec):
            launch()
    finally:
        JITFunction.run = original
        _local.recording = None
    rec._inputs = None
    global last_reason
    last_reason = rec.reason if not rec.ok else ("" if rec.launches else "no launches seen")
    return rec if rec.ok and rec.launches else None


last_reason = ""
"""Why the last :func:`record` gave no recording (empty when it gave one)."""


class MemoEntry(NamedTuple):
    recording: Recording | None
    info: object
    cheap: tuple = ()
    guard: object = None


class CallKey:
    """A call's :class:`Memo` key: ``cheap``, a tuple compared by equality (the current stream first, then
    the PDL setting, the scalar arguments, each per-call tensor's 16-byte alignment and each cache's
    address), and ``tensors``, whose metadata a kept entry's guard compares (:func:`tensor_guard`).
    ``token`` names the kept call shape it matched or made (:meth:`Memo.get`, :meth:`Memo.put`):
    unique in the process, so it can key what a kept shape fixes (:func:`mm3lab._valcheck.flags_known`)."""

    __slots__ = ("cheap", "tensors", "token")

    def __init__(self, cheap: tuple, tensors: tuple):
        self.cheap, self.tensors, self.token = cheap, tensors, None

    @property
    def stream(self):
        """The current stream's handle when the key was made (:func:`current_stream`)."""
        return self.cheap[0]


_PLAIN = frozenset({bool, int, float, str, type(None)})
"""Scalar argument types a key compares (by type and value); any other scalar: the memo does not apply."""

_tokens = itertools.count()


class _MetaGuard:
    """:func:`tensor_guard` where PyTorch's own is missing: the tensors' shapes, strides, dtypes, devices and
    ``requires_grad``."""

    __slots__ = ("meta",)

    def __init__(self, tensors):
        self.meta = _meta(tensors)

    def check(self, *tensors) -> bool:
        return _meta(tensors) == self.meta


def _meta(tensors) -> tuple:
    return tuple((t.shape, t.stride(), t.dtype, t.get_device(), t.requires_grad) for t in tensors)


def tensor_guard(tensors: tuple):
    """An object whose ``check(*others)`` says whether ``others`` have the metadata of ``tensors``: the
    same shapes, strides, dtypes, devices, ``requires_grad`` and dispatch keys. PyTorch's compiled
    tensor guard (the C++ check behind ``torch.compile``'s guards) where it is there: about 0.1 us per
    tensor, where reading the same in Python costs about 0.5 us; else the same read in Python."""
    if _TensorGuards is not None and COMPILED_GUARDS:
        try:
            sizes = [list(t.shape) for t in tensors]
            return _TensorGuards(
                *tensors, dynamic_dims_sizes=sizes, dynamic_dims_strides=[list(t.stride()) for t in tensors]
            )
        except Exception:  # (another PyTorch's signature: the Python read)
            pass
    return _MetaGuard(tensors)


try:
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
except ImportError:  # pragma: no cover (PyTorch without it)
    _TensorGuards = None


class Memo:
    """Repeated one-shot calls of one entry point: their checks done once, their launches replayed.

    An entry point called again and again with arguments of the same metadata (a decode loop
    calling :func:`mm3lab.sparse_attention` each step) runs the same launches every time, on
    new addresses. A memo keeps, per thread, the last :attr:`size` such call shapes: what the
    first call's structural checks returned, and the recording of its launches. A later call of
    a kept shape skips the structural checks (its key holds everything they read) and replays
    the recording with its own tensors in place; its value checks still run (they read values).

    The key (:meth:`key`) holds each per-call tensor's shape, strides, dtype, device and 16-byte
    alignment (what the checks read and what Triton specializes on), each cache's address too
    (a cache is rarely new, and its address decides the layout checks), the scalar arguments,
    the current stream (recordings keep scratch buffers, reused in stream order) and the PDL setting
    (:data:`mm3lab._pdl.ENABLED`: it decides the launches). Tensor metadata is compared by a guard
    kept with each shape (:func:`tensor_guard`), the rest by equality. It applies on the
    ``triton`` backend only (the others launch no compiled kernels).
    """

    size = 4

    def __init__(self, name: str):
        self.name = name
        self._local = threading.local()
        _MEMOS.append(self)

    def _entries(self) -> collections.OrderedDict:
        """This thread's kept shapes, by token, least recently used first."""
        entries = getattr(self._local, "entries", None)
        if entries is None:
            entries = self._local.entries = collections.OrderedDict()
        return entries

    @staticmethod
    def key(per_call: tuple, caches: tuple, scalars: tuple) -> CallKey | None:
        """The call's key, or ``None`` where the memo does not apply (a non-tensor where a tensor
        goes, which the checks reject; CPU tensors; a scalar of a type outside :data:`_PLAIN`;
        not on a recordable platform; while a CUDA graph is captured)."""
        if not supported() or backend.get_backend() != "triton":
            return None
        first = per_call[0]
        if not isinstance(first, torch.Tensor) or not first.is_cuda:
            return None
        if torch.cuda.is_current_stream_capturing():
            # (a capture takes the normal path: a recording made outside it may hold launches that
            # only an eager stream may run, such as the attention's own merge on per-stream counters)
            return None
        stream = _raw_stream(first.get_device()) if _raw_stream is not None else current_stream(first.device)
        cheap = [stream, _pdl.ENABLED]
        for x in scalars:  # (by type too: True, 1 and 1.0 are equal, and not equally valid)
            if type(x) not in _PLAIN:
                return None
            cheap.append((type(x), x))
        tensors = []
        tensor = torch.Tensor
        for t in per_call:
            if t is None:
                cheap.append(None)
            elif isinstance(t, tensor):
                cheap.append(t.data_ptr() % 16)
                tensors.append(t)
            else:  # not a tensor: the normal path (its checks reject the call)
                return None
        for t in caches:
            if t is None:
                cheap.append(None)
            elif isinstance(t, tensor):
                cheap.append(t.data_ptr())
                tensors.append(t)
            else:
                return None
        return CallKey(tuple(cheap), tuple(tensors))

    def get(self, key: CallKey | None) -> MemoEntry | None:
        """What :meth:`put` kept for ``key``'s call shape (most recently used first), else ``None``;
        sets ``key.token`` where found."""
        if key is None:
            return None
        entries = self._entries()
        cheap, tensors = key.cheap, key.tensors
        for token, entry in reversed(entries.items()):
            if entry.cheap == cheap and entry.guard.check(*tensors):
                entries.move_to_end(token)
                key.token = token
                return entry
        return None

    def put(self, key: CallKey | None, recording: Recording | None, info=None) -> None:
        """Keep a checked call shape: its recording (``None``: not replayable, later calls take the
        normal path) and what its later calls need of its checks (``info``); sets ``key.token``."""
        if key is None or self.size <= 0:
            return
        entries = self._entries()
        key.token = next(_tokens)
        entries[key.token] = MemoEntry(recording, info, key.cheap, tensor_guard(key.tensors))
        while len(entries) > self.size:
            entries.popitem(last=False)

    def clear(self) -> None:
        self._entries().clear()


_MEMOS: list[Memo] = []


def clear_memos() -> None:
    """Forget every kept call shape (this thread's). A memo's key holds the call's arguments, not the
    package's settings: after changing a module-level setting that decides launches (a tuning
    constant, a kernel choice threshold), clear them."""
    for memo in _MEMOS:
        memo.clear()


def record_call(launch, inputs: dict) -> tuple[object, Recording | None]:
    """:func:`record` for a one-shot call whose every tensor argument and output is in ``inputs``
    (kept only between this call and its replays: released before returning): ``(what launch()
    returned, the recording)``, the recording ``None`` outside a plain eager run (CUDA-graph
    capture) or where the run cannot be replayed (a PyTorch path, which launches nothing)."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return launch(), None
    returned = []
    rec = record(lambda: returned.append(launch()), {name: t for name, t in inputs.items() if t is not None}, ())
    if rec is not None:
        rec.release()
    return returned[0], rec


_LOOK_UP = object()


def memo_call(memo: Memo, key, *, check, check_values, tensors, launch, result, entry=_LOOK_UP):
    """One call of an entry point through ``memo``, for an entry point whose value checks run apart from
    its launches (a check launch and one host read, :func:`mm3lab._valcheck.flags`).

    A kept call shape with a recording runs ``check_values(replay)`` (its key fixed all that the
    structural checks read) and replays the recording with ``tensors()`` in place, once: where the
    value checks call ``replay`` (an entry point whose launches write only the call's new outputs, or
    write only where the check's flags are clear, may have them queued while its check runs: a call
    that the check then rejects returns nothing, and its launches read nothing outside the tensors
    they are given), else after them. It returns
    ``result`` of the tensors.
    Any other call runs ``check()`` (every check) first. A new shape (``key`` not ``None``) then runs
    ``launch(tensors())`` while recording it and keeps the recording (``None`` where nothing was
    replayable: a PyTorch path); a shape kept without one, or no key, runs ``launch(None)``.

    Args:
        memo, key: the entry point's :class:`Memo` and the call's :meth:`Memo.key`.
        check, check_values: the call's checks, all of them or the value checks alone (given ``replay``).
        tensors: makes the call's tensors by name, its outputs new (one call: its own outputs).
        launch: the call after its checks; given the tensors, it writes its kernels' outputs into
            them (given ``None``, it allocates its own) and returns the entry point's result.
        result: the entry point's result from the tensors of a replayed call.
        entry: what ``memo.get(key)`` gave, where the caller has looked it up already.
    """
    if entry is _LOOK_UP:
        entry = memo.get(key)
    if entry is not None and entry.recording is not None:
        named = tensors()
        replayed = []

        def replay() -> None:
            if not replayed:
                replayed.append(True)
                entry.recording.replay(named, named[next(iter(named))].device, key.stream)

        check_values(replay if QUEUE_DURING_CHECKS else _nothing)
        replay()  # (where the checks did not)
        return result(named)
    check()
    if key is None or entry is not None:
        return launch(None)
    named = tensors()
    returned, recording = record_call(lambda: launch(named), named)
    memo.put(key, recording)
    return returned


def _nothing() -> None:
    pass


_NO_DEVICE_WORK = {
    "empty",
    "empty_strided",
    "view",
    "_unsafe_view",
    "as_strided",
    "slice",
    "select",
    "unsqueeze",
    "squeeze",
    "permute",
    "t",
    "transpose",
    "expand",
    "alias",
    "detach",
    "lift_fresh",
    "empty_like",
    "new_empty",
    "new_empty_strided",
    "_reshape_alias",
    "split",
    "split_with_sizes",
    "unbind",
    "narrow",
    "chunk",
    "diagonal",
    "unfold",
}
"""PyTorch ops a recorded run may call: allocations and views, which put no work on the device."""


DEVICE_WORK = "the run puts work on the device besides its launches, which a replay would leave out"
"""The start of :data:`last_reason` where a run was not recorded because of such work (a fill, a copy)."""


class _DeviceWork(TorchDispatchMode):
    """While a run is recorded: any PyTorch op besides :data:`_NO_DEVICE_WORK` (a fill, a copy, a host
    read) is work that a replay would leave out, so the run is not replayable."""

    def __init__(self, rec: Recording):
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in _NO_DEVICE_WORK and self.rec.ok:
            self.rec.ok = False
            self.rec.reason = f"{DEVICE_WORK}: torch's {name}"
        return func(*args, **(kwargs or {}))


def _idle(hook) -> bool:
    """A launch hook that does nothing: ``None`` or an empty chain (Triton 3.6 keeps a chain, empty by default)."""
    return hook is None or not getattr(hook, "calls", True)


def _span(t: torch.Tensor) -> tuple[int, int]:
    if t.numel() == 0:
        return (0, 0)
    start = t.data_ptr()
    extent = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True)) + 1
    return (start, start + extent * t.element_size())


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


__all__ = [
    "COMPILED_GUARDS",
    "DIRECT",
    "ENABLED",
    "QUEUE_DURING_CHECKS",
    "VERIFIED_TRITON",
    "CallKey",
    "Memo",
    "MemoEntry",
    "clear_memos",
    "Recording",
    "call_direct",
    "current_stream",
    "descriptor_over",
    "hooks_idle",
    "launch_compiled",
    "memo_call",
    "record",
    "record_call",
    "supported",
]
