"""mm3lab's compiled-kernel host paths on a machine without a GPU, with nothing launched.

Import this module before anything imports ``mm3lab``: it makes PyTorch report a GPU, so that
``mm3lab.backend`` chooses compiled Triton (not the interpreter) and the entry points take the
host paths they take on a GPU: the same checks, launch configurations and argument lists. Then
:func:`install` lets CPU tensors reach the kernels' launches and replaces Triton's launch with
``launch`` (a function of the kernel, its arguments and grid). Two users:

* ``tests/gpu_compile.py``: ``launch`` compiles each specialization for a GPU architecture;
* :mod:`benchmarks.host`: ``launch`` does nothing, which times mm3lab's own host work per call.

Nothing computes, so kernel outputs hold garbage; with validation off no entry point reads one
back on the host.
"""

from __future__ import annotations

import contextlib
import os

import torch

if "mm3lab" in __import__("sys").modules:
    raise RuntimeError("benchmarks.offline must be imported before mm3lab")
os.environ.pop("TRITON_INTERPRET", None)
torch.cuda.is_available = lambda: True
torch.cuda.is_current_stream_capturing = lambda: False  # (nothing is ever captured here)

HQ, HKV, D, DI, TOPK = 64, 4, 128, 128, 16
"""MiniMax-M3's query and KV heads, head and index dims, and top-k."""
FP8 = torch.float8_e4m3fn


def model_layer(dtype, layout, fp8, batch=2, context=4096, dql=1) -> dict:
    """A decode step's arguments (:func:`mm3lab.msa_decode`'s names) at the model's head counts and dims:
    ``batch`` requests of ``context`` tokens, ``dql`` rows each; FP8 index and KV caches with ``fp8``."""
    import mm3lab

    g = torch.Generator().manual_seed(0)
    m = context // 128 + 1
    blocks = batch * m + 2
    cache = mm3lab.allocate_kv_cache(blocks, HKV, D, layout, dtype=FP8 if fp8 else dtype)
    index_cache = mm3lab.allocate_index_cache(blocks, DI, dtype=FP8 if fp8 else dtype)
    n = batch * dql
    return dict(
        q=torch.randn(n, HQ, D, generator=g).to(dtype),
        key=torch.randn(n, HKV, D, generator=g).to(dtype),
        value=torch.randn(n, HKV, D, generator=g).to(dtype),
        index_q=torch.randn(n, HKV, DI, generator=g).to(dtype),
        index_k=torch.randn(n, DI, generator=g).to(dtype),
        k_cache=cache.k_cache,
        v_cache=cache.v_cache,
        index_cache=index_cache,
        block_table=torch.randperm(blocks, generator=g)[: batch * m].view(batch, m).to(torch.int32),
        seq_lens=torch.full((batch,), context, dtype=torch.int32),
        index_scale=mm3lab.allocate_index_scale(blocks) if fp8 else None,
        k_scale=cache.k_scale if fp8 else None,
        v_scale=cache.v_scale if fp8 else None,
    )


def prefill_chunk(inputs, tokens=256) -> dict:
    """The layer's inputs as a prefill chunk: ``tokens`` rows of request 0 ending at its last position."""
    context = int(inputs["seq_lens"][0])
    out = dict(inputs)
    for name in ("q", "key", "value", "index_q", "index_k"):
        t = inputs[name]
        out[name] = t[:1].expand(tokens, *t.shape[1:]).contiguous()
    del out["seq_lens"]
    out["query_req_id"] = torch.zeros(tokens, dtype=torch.int32)
    out["query_abs_pos"] = torch.arange(context - tokens, context, dtype=torch.int32)
    return out


H200_SMS = 132
"""The H200's streaming multiprocessors: the entry points' split decisions are the H200's."""


def install(launch) -> None:
    """Route CPU tensors to the kernel launches and replace every launch by ``launch(kernel, *args, grid=...,
    warmup=..., **kwargs)``."""
    from triton.runtime.jit import JITFunction

    from mm3lab import _replay, backend
    from mm3lab.attention import kernel as attention_kernel
    from mm3lab.msa import recorded

    if backend.INTERPRETER:
        raise RuntimeError("the interpreter is on in this process (TRITON_INTERPRET=1 was set before mm3lab)")
    JITFunction.run = launch
    attention_kernel._device_programs = lambda device: H200_SMS
    recorded.ENABLED = False  # the one-shot replay path needs real launches
    _replay.ENABLED = False  # (and so does recording a plan's run)
    use_kernel = backend.use_kernel
    backend.use_kernel = lambda *tensors, **kw: use_kernel(**kw)  # (CPU tensors would take the PyTorch path)


def install_recordings() -> None:
    """After :func:`install`: the one-shot decode step (:mod:`mm3lab.msa.recorded`) and the repeated call
    shapes of single entry points (their :class:`mm3lab._replay.Memo`) take their recorded paths on CPU
    tensors, as on a GPU (the memos inside :func:`memo_keys_cpu_calls`). Their launches are recorded with
    the arguments they are given (the input tensors by name, as :class:`mm3lab._replay.Recording` keeps
    them) and replayed through a launcher that returns at once: what is left is mm3lab's own Python on
    those paths."""
    from mm3lab import _replay
    from mm3lab.attention import TILED_MIN_ROWS
    from mm3lab.msa import recorded

    class _Kernel:  # (what a replay reads of a compiled kernel)
        function = 0
        packed_metadata = None

    def add(rec, fn, args, kwargs, grid, kernel) -> None:
        values = [*args, *kwargs.values()]
        subs = []
        for pos, value in enumerate(values):
            name = next((n for n, t in rec._inputs.items() if t is value), None)
            if name is not None:
                subs.append((pos, name))
        launch = _replay._Launch.__new__(_replay._Launch)
        launch.kernel, launch.grid, launch.values, launch.subs = _Kernel(), (1, 1, 1), values, tuple(subs)
        launch.descs = ()  # (tensor descriptors: the tiled kernel's, which these paths never launch)
        launch.direct = (lambda *launcher_args: None, (1, 1, 1), False, False)
        launch.addresses = [v.data_ptr() if isinstance(v, torch.Tensor) else v for v in values]
        rec.launches.append(launch)

    recorded.ENABLED = _replay.ENABLED = True
    _replay.Recording._add = add
    _replay._platform_supported = lambda: True
    _replay.current_stream = lambda device: 0
    recorded.applies = lambda args: not args.return_intermediates and args.q.shape[0] < TILED_MIN_ROWS


@contextlib.contextmanager
def memo_keys_cpu_calls():
    """After :func:`install_recordings`: every tensor says it is on a GPU (``is_cuda``), so that the memos
    key CPU calls as they key GPU ones. Validation off only (the value checks would take their GPU path)."""
    previous = torch.Tensor.is_cuda
    torch.Tensor.is_cuda = property(lambda self: True)
    try:
        yield
    finally:
        torch.Tensor.is_cuda = previous
