"""Plans (SPEC section 8): one MSA layer step with its shapes fixed, validated once, allocated once.

:func:`mm3lab.msa_decode` / :func:`mm3lab.msa_prefill` check every argument and allocate
their outputs and intermediates on each call. A serving loop calls the same layer with
the same shapes thousands of times; a *plan* does that work once::

    plan = mm3lab.MSADecodePlan(k_cache, v_cache, index_cache, batch=16, max_blocks=1024,
                                num_q_heads=64, topk=16)
    out = plan.run(q, key, value, index_q, index_k, k_cache, v_cache, index_cache,
                   block_table, seq_lens)

At construction the plan fixes the shapes (rows, heads, head dims, block-table width),
the dtypes, the cache layout and the selection (``topk``, ``init_blocks``,
``local_blocks``), checks all of it, and allocates every buffer of the step. Then:

* ``run(...)`` checks only tensor metadata against the plan (no device work), runs
  the value checks while validation is on (:func:`mm3lab.validation`; skipped while a
  CUDA graph is being captured), and launches the step's kernels into the plan's
  buffers: rows, slots, index-cache insert and KV write (one launch, :mod:`mm3lab.msa.insert`),
  indexer scores, fused top-k + sparse block table, attention. It allocates nothing, so it can be
  captured in the caller's own ``torch.cuda.graph``.
* With ``graph=True`` (CUDA only) the plan captures that launch sequence in its own
  CUDA graph on the first ``run`` and replays it afterwards: inputs are copied into
  the plan's static buffers, so their addresses never matter. Only tensor *values*
  may change between runs: ``seq_lens`` (or positions), the block table, the caches'
  contents, padded rows (a decode request with ``seq_len = 0`` or a prefill row with a
  negative position). A different shape, dtype or device raises ``ValueError`` /
  ``TypeError``; a cache with a new address is captured again. A stale graph is never
  replayed.

The output is bit-identical to the one-shot function on the same inputs. It is the
plan's own buffer (``plan.out``), overwritten by the next ``run``: clone it to keep it.
The step's intermediates stay readable after a run: ``plan.slots``, ``plan.scores``,
``plan.topk_idx``, ``plan.sparse_bt``, ``plan.sparse_ctx``, ``plan.lse``.

When to use which: one-shot calls for notebooks and experiments (shapes change from
call to call); a plan for a loop over the same shapes, eager (``graph=False``) when
the caller captures its own graph or cannot, ``graph=True`` to get graph-replay
speed without writing the capture.

FP8 caches (SPEC section 9): pass the scales at construction and at every run, as the
one-shot functions take them (``index_scale=`` for an FP8 index cache, ``k_scale=`` /
``v_scale=`` for an FP8 KV cache); they are fixed like the caches (shape, dtype, device
checked per run, a new address is captured again). With an FP8 cache the inputs' float
dtype is not the cache's: ``query_dtype=`` (default bfloat16) fixes the dtype of ``q``,
``key``, ``value`` (FP8 KV cache) and of ``index_q``, ``index_k`` (FP8 index cache).

On a backend where a step takes the PyTorch path (``mm3lab.set_backend("torch")``,
bfloat16 in the interpreter, float32 with more than 16 index heads on a GPU, an FP8 cache on
a GPU without FP8), ``run``
calls the one-shot function (same answer, allocations included) and ``graph=True`` is
rejected at construction. On the CPU, ``graph=True`` is rejected too: there are no CUDA
graphs to capture.
"""

from __future__ import annotations

import itertools

import torch

from . import _replay, backend
from ._checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_int,
    check_same_device,
    check_tensor,
    dtype_name,
    validation_enabled,
)
from .constants import DEFAULT_TOPK, PAGES_PER_SPARSE_BLOCK
from .fp8 import FP8_DTYPE
from .index_cache.checks import check_index_cache, check_index_scale
from .layout.views import check_kv_scales, check_kv_views

__all__ = ["MSADecodePlan", "MSAPrefillPlan"]


_TENSOR_INPUTS = ("q", "key", "value", "index_q", "index_k")
"""A run's first arguments (then come the caches, ``block_table`` and the rows, as in the one-shot functions)."""
_PLAN_IDS = itertools.count()
"""A number for each plan (part of its value checks' key)."""

_CACHE_NAMES = ("k_cache", "v_cache", "index_cache", "index_scale", "k_scale", "v_scale")
"""The caches and their scales, as a plan holds them (``caches`` tuples) and the one-shot functions name them."""
_SHARED_ARGUMENTS = (
    "k_cache",
    "v_cache",
    "index_cache",
    "batch",
    "max_blocks",
    "num_q_heads",
    "topk",
    "init_blocks",
    "local_blocks",
    "scale",
    "id_dtype",
    "graph",
    "algorithm",
    "index_scale",
    "k_scale",
    "v_scale",
    "query_dtype",
)
"""The constructor arguments both plans hand to :class:`_MSAPlan` as they are."""


def _shared(arguments: dict) -> dict:
    """The :data:`_SHARED_ARGUMENTS` of a plan constructor's arguments (its ``locals()``)."""
    return {name: arguments[name] for name in _SHARED_ARGUMENTS}


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _fingerprint(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), t.stride(), t.dtype, t.device, t.data_ptr())


class _MSAPlan:
    """What decode and prefill plans share; see the module docstring."""

    _prefill = False
    _staging = False  # set while stages() runs run()
    _ROW_INPUTS: tuple[str, ...] = ()  # the rows' inputs, after ``block_table`` (as the one-shot function takes them)

    def __init__(
        self,
        k_cache,
        v_cache,
        index_cache,
        *,
        rows: int,
        batch: int,
        max_blocks: int,
        num_q_heads: int,
        decode_query_len: int,
        topk: int,
        init_blocks: int,
        local_blocks: int,
        scale,
        id_dtype,
        graph: bool,
        algorithm,
        index_scale=None,
        k_scale=None,
        v_scale=None,
        query_dtype=torch.bfloat16,
    ):
        stride = check_kv_views(k_cache, v_cache)
        check_index_cache(index_cache)
        check_kv_scales(k_cache, v_cache, k_scale, v_scale)
        check_index_scale(index_cache, index_scale)
        if query_dtype not in FLOAT_DTYPES:
            raise TypeError(f"query_dtype: expected float32, float16 or bfloat16, got {query_dtype}")
        device = check_same_device(k_cache=k_cache, index_cache=index_cache)
        self.batch = check_int("batch", batch, minimum=1)
        self.max_blocks = check_int("max_blocks", max_blocks, minimum=1)
        self.num_q_heads = check_int("num_q_heads", num_q_heads, minimum=1)
        self.decode_query_len = check_int("decode_query_len", decode_query_len, minimum=1)
        self._plan_id = next(_PLAN_IDS)  # (its value checks' key: :meth:`_value_checks`)
        self.rows = check_int("rows", rows, minimum=1)
        self.topk = check_int("topk", topk, minimum=1)
        self.init_blocks = check_int("init_blocks", init_blocks, minimum=0)
        self.local_blocks = check_int("local_blocks", local_blocks, minimum=0)
        if id_dtype not in INDEX_DTYPES:
            raise TypeError(f"id_dtype: expected torch.int32 or torch.int64, got {id_dtype}")
        if not isinstance(graph, bool):
            raise TypeError(f"graph: expected a bool, got {type(graph).__name__}")
        _, _, hkv, d = k_cache.shape
        if num_q_heads % hkv:
            raise ValueError(f"num_q_heads: {num_q_heads} query heads are not a multiple of the cache's {hkv} KV heads")
        kv_blocks = k_cache.shape[0] // stride
        if kv_blocks < index_cache.shape[0]:
            raise ValueError(
                f"index_cache: {index_cache.shape[0]} blocks, but the KV cache holds only {kv_blocks}; a plan "
                "needs a KV cache at least as large (both caches take the same slot of each token)"
            )
        if scale is None:
            scale = d**-0.5
        elif isinstance(scale, (bool, torch.Tensor)) or not isinstance(scale, (int, float)):
            raise TypeError(f"scale: expected a Python float or None, got {type(scale).__name__}")
        self.scale = float(scale)
        self.block_page_stride = stride
        self.device = device
        self.cache_dtype, self.index_cache_dtype, self.id_dtype = k_cache.dtype, index_cache.dtype, id_dtype
        # input dtypes: the cache's, or query_dtype where the cache is FP8 (it quantizes what it is given)
        self.dtype = query_dtype if k_cache.dtype == FP8_DTYPE else k_cache.dtype
        self.index_dtype = query_dtype if index_cache.dtype == FP8_DTYPE else index_cache.dtype
        self.num_kv_heads, self.head_dim, self.index_dim = hkv, d, index_cache.shape[2]
        self._caches = (k_cache, v_cache, index_cache, index_scale, k_scale, v_scale)
        self.uses_kernels = self._kernels_apply()
        if graph and device.type != "cuda":
            raise ValueError("graph=True: CUDA graphs need a CUDA device; on the CPU use graph=False (same API)")
        if graph and not self.uses_kernels:
            raise ValueError(
                "graph=True: this plan runs the PyTorch path (backend "
                f"{backend.get_backend()!r}, dtype {dtype_name(self.dtype)}/{dtype_name(self.index_dtype)}), "
                "which allocates per call; use graph=False"
            )
        self.graph = graph
        self._cache_prints = tuple(None if t is None else _fingerprint(t) for t in self._caches)
        self._allocate()
        self._cuda_graph = None
        self._captured_with = None
        self._recording = None
        self._device_work = False  # (a run that puts work on the device besides its launches: never recorded)
        self._set_algorithm(algorithm)

    # --- construction ----------------------------------------------------------------------

    def _kernels_apply(self) -> bool:
        # the rules of the entry points the plan launches (SPEC 7), logged and recorded under the plan's name
        k_cache, index_cache = self._caches[0], self._caches[2]
        from .indexer import index_fallback

        fallback = (
            backend.bf16_interpreted(self.dtype)
            or backend.bf16_interpreted(self.index_dtype)
            or index_fallback(self.index_dtype, index_cache.dtype, k_cache.shape[2])
        )
        return backend.use_kernel(k_cache, index_cache, entry_point=type(self).__name__, fallback=fallback)

    def _allocate(self) -> None:
        n, b, m, h, dev = self.rows, self.batch, self.max_blocks, self.num_kv_heads, self.device
        hq, d, di, k = self.num_q_heads, self.head_dim, self.index_dim, self.topk
        i32 = {"dtype": torch.int32, "device": dev}
        self.slots = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.scores = torch.empty(h, n, m, dtype=torch.float32, device=dev)
        self.topk_idx = torch.empty(h, n, k, **i32)
        self.sparse_bt = torch.empty(h, n, k * PAGES_PER_SPARSE_BLOCK, **i32)
        self.sparse_ctx = torch.empty(h, n, **i32)
        self.out = torch.empty(n, hq, d, dtype=self.dtype, device=dev)
        self.lse = torch.empty(n, hq, dtype=torch.float32, device=dev)
        self.workspace = None
        if self.uses_kernels:
            from .attention.kernel import num_splits

            splits = num_splits(n, hq, h, d, k * PAGES_PER_SPARSE_BLOCK, dev, self._caches[4] is not None)
            if splits > 1:
                self.workspace = (
                    torch.empty(n, hq, splits, d, dtype=torch.float32, device=dev),
                    torch.empty(n, hq, splits, dtype=torch.float32, device=dev),
                )
        if self._prefill:
            self.req = self.pos = None  # the caller's (eager) or the static copies (graph)
        else:
            self.req = torch.empty(n, **i32)
            self.pos = torch.empty(n, **i32)
        self._static = None
        if self.graph:
            kv = {"dtype": self.dtype, "device": dev}
            static = {
                "q": torch.zeros(n, hq, d, **kv),
                "key": torch.zeros(n, h, d, **kv),
                "value": torch.zeros(n, h, d, **kv),
                "index_q": torch.zeros(n, h, di, dtype=self.index_dtype, device=dev),
                "index_k": torch.zeros(n, di, dtype=self.index_dtype, device=dev),
                "block_table": torch.zeros(b, m, dtype=self.id_dtype, device=dev),
            }
            if self._prefill:
                static["query_req_id"] = torch.zeros(n, dtype=self.id_dtype, device=dev)
                static["query_abs_pos"] = torch.full((n,), -1, dtype=self.id_dtype, device=dev)
            else:
                static["seq_lens"] = torch.zeros(b, dtype=self.id_dtype, device=dev)
            self._static = static

    # --- per run -----------------------------------------------------------------------------

    def _expected(self) -> dict:
        n, b, m, h = self.rows, self.batch, self.max_blocks, self.num_kv_heads
        hq, d, di = self.num_q_heads, self.head_dim, self.index_dim
        spec = {
            "q": ((n, hq, d), self.dtype),
            "key": ((n, h, d), self.dtype),
            "value": ((n, h, d), self.dtype),
            "index_q": ((n, h, di), self.index_dtype),
            "index_k": ((n, di), self.index_dtype),
            "block_table": ((b, m), self.id_dtype),
        }
        if self._prefill:
            spec["query_req_id"] = ((n,), self.id_dtype)
            spec["query_abs_pos"] = ((n,), self.id_dtype)
        else:
            spec["seq_lens"] = ((b,), self.id_dtype)
        return spec

    def _check_inputs(self, inputs: dict, caches) -> None:
        """Metadata only (no device work): every input as planned."""
        kind = type(self).__name__
        for name, (shape, dtype) in self._expected().items():
            t = inputs[name]
            check_tensor(name, t, dtypes=FLOAT_DTYPES if dtype.is_floating_point else INDEX_DTYPES)
            if tuple(t.shape) != shape:
                raise ValueError(
                    f"{name}: the {kind} was planned for shape {shape}, got {tuple(t.shape)}; "
                    "build a new plan for new shapes"
                )
            if t.dtype != dtype:
                raise TypeError(
                    f"{name}: the {kind} was planned for dtype {dtype_name(dtype)}, got {dtype_name(t.dtype)}"
                )
            if t.device != self.device:
                raise ValueError(f"{name}: the {kind} was planned on {self.device}, got a tensor on {t.device}")
        for name, t, planned in zip(_CACHE_NAMES, caches, self._cache_prints, strict=True):
            if planned is None:
                if t is not None:
                    raise ValueError(f"{name}: the {kind} was planned without it (not an FP8 cache), pass None")
                continue
            if t is None:
                raise ValueError(f"{name}: the {kind} was planned with an FP8 cache and its scales; got None")
            check_tensor(name, t)
            got = _fingerprint(t)
            if got[:4] != planned[:4]:
                raise ValueError(
                    f"{name}: the {kind} was planned for a cache of shape {planned[0]}, strides {planned[1]}, "
                    f"{dtype_name(planned[2])} on {planned[3]}; got shape {got[0]}, strides {got[1]}, "
                    f"{dtype_name(got[2])} on {got[3]}"
                )

    def _row_inputs(self, inputs: dict) -> tuple:
        """``(req, pos, decode_query_len)`` as the kernels read them: a prefill's rows, or a decode's
        ``seq_lens`` twice (its rows are derived from it)."""
        if self._prefill:
            return inputs["query_req_id"], inputs["query_abs_pos"], 1
        return inputs["seq_lens"], inputs["seq_lens"], self.decode_query_len

    def _value_checks(self, inputs: dict) -> None:
        """The run's value checks (its shapes are the plan's: :meth:`_check_inputs`)."""
        from .indexer.checks import check_decode_values, check_table_entries

        index_cache, block_table = self._caches[2], inputs["block_table"]
        # The plan fixed the shapes, dtypes, device and index cache; with the inputs' addresses and strides
        # this key fixes the check's segments, so a run that repeats them launches the kept check
        # (_valcheck.flags_known).
        key = ["plan", self._plan_id, block_table.data_ptr(), block_table.stride()]
        if self._prefill:
            req, pos = inputs["query_req_id"], inputs["query_abs_pos"]
            key += [req.data_ptr(), req.stride(), pos.data_ptr(), pos.stride()]
            check_table_entries(block_table, req, pos, index_cache.shape[0], "the index cache", key=tuple(key))
        elif self.rows:
            seq_lens = inputs["seq_lens"]
            key += [seq_lens.data_ptr(), seq_lens.stride()]
            check_decode_values(index_cache, block_table, seq_lens, key=tuple(key))

    def _one_shot(self, inputs: dict, caches):
        """The one-shot function on the run's arguments (every input and cache by its name there)."""
        from .msa import msa_decode, msa_prefill

        if self._prefill:
            function, extra = msa_prefill, {}
        else:
            function, extra = msa_decode, {"decode_query_len": self.decode_query_len}
        selection = {"topk": self.topk, "init_blocks": self.init_blocks, "local_blocks": self.local_blocks}
        caches = dict(zip(_CACHE_NAMES, caches, strict=True))
        return function(**inputs, **caches, **selection, scale=self.scale, **extra)

    # --- the step's launches (arguments already checked; they allocate nothing) ---------------

    def _insert(self, inputs: dict, caches) -> None:
        """Rows and slots, index-cache insert, KV write: one launch (:mod:`mm3lab.msa.insert`)."""
        from .msa.insert import step_insert_kernel

        k_cache, v_cache, index_cache, index_scale, k_scale, v_scale = caches
        if self._prefill:
            req, pos, rows = inputs["query_req_id"], inputs["query_abs_pos"], {}
        else:
            req, pos = self.req, self.pos
            rows = {"seq_lens": inputs["seq_lens"], "decode_query_len": self.decode_query_len}
        step_insert_kernel(
            inputs["block_table"],
            req,
            pos,
            self.slots,
            inputs["index_k"],
            index_cache,
            inputs["key"],
            inputs["value"],
            k_cache,
            v_cache,
            self.block_page_stride,
            index_scale=index_scale,
            k_scale=k_scale,
            v_scale=v_scale,
            **rows,
        )

    def _scores(self, inputs: dict, caches) -> None:
        from .indexer.kernel import index_scores_kernel

        req, pos, dql = self._row_inputs(inputs)
        index_scores_kernel(
            inputs["index_q"],
            caches[2],
            inputs["block_table"],
            req,
            pos,
            dql,
            self._prefill,
            self.init_blocks,
            self.local_blocks,
            True,
            self.scores,
            index_scale=caches[3],
        )

    def _topk(self, inputs: dict, *, table: bool = True) -> None:
        """Top-k into ``plan.topk_idx``, with the sparse block table fused in (``table``) or alone."""
        from .indexer.kernel import topk_kernel

        req, pos, dql = self._row_inputs(inputs)
        tables = {}
        if table:
            tables = {
                "block_table": inputs["block_table"],
                "block_page_stride": self.block_page_stride,
                "sparse_bt": self.sparse_bt,
                "sparse_ctx": self.sparse_ctx,
            }
        positions = 2 if self._prefill else 1
        topk_kernel(
            self.scores,
            self.topk,
            self.topk_idx,
            positions=positions,
            req=req,
            pos=pos,
            batch=self.batch,
            dql=dql,
            **tables,
        )

    def _block_table(self, inputs: dict) -> None:
        """The sparse block table alone, from ``plan.topk_idx`` (the step fuses it into :meth:`_topk`)."""
        from .block_table.kernel import build_sparse_block_table_decode_kernel, build_sparse_block_table_prefill_kernel

        req, pos, dql = self._row_inputs(inputs)
        bt, tables = inputs["block_table"], (self.block_page_stride, self.sparse_bt, self.sparse_ctx)
        if self._prefill:
            build_sparse_block_table_prefill_kernel(self.topk_idx, bt, req, pos, *tables)
        else:
            build_sparse_block_table_decode_kernel(self.topk_idx, bt, req, dql, *tables)

    def _launch(self, inputs: dict, caches) -> None:
        """The step's kernels, into the plan's buffers (arguments already checked; allocates nothing)."""
        self._insert(inputs, caches)
        self._scores(inputs, caches)
        self._topk(inputs)
        self._attend(inputs["q"], caches, self.algorithm)

    def _set_algorithm(self, algorithm) -> None:
        """Fix the attention kernel: ``algorithm`` if given, else what the one-shot call runs for the plan's
        rows (``mm3lab.attention.choose_algorithm``; an FP8 KV cache: the per-row kernel)."""
        from .attention import choose_algorithm

        algorithm = choose_algorithm(self.rows, algorithm)
        if self._caches[4] is not None:
            algorithm = "rows"  # (an FP8 KV cache: the per-row kernel, which dequantizes in registers)
        self.algorithm = algorithm

    def _attend(self, q, caches, algorithm) -> None:
        """Attention into ``plan.out`` / ``plan.lse`` with ``algorithm`` (an FP8 KV cache always takes the
        per-row kernel, as the one-shot call does)."""
        from .attention import tiled
        from .attention.kernel import sparse_attention_kernel

        k_cache, v_cache, _, _, k_scale, v_scale = caches
        tables = (self.sparse_bt, self.sparse_ctx, self.scale, self.out, self.lse)
        if algorithm == "tiled" and k_scale is None:
            tiled.tiled_attention_kernel(q, k_cache, v_cache, *tables)
        else:
            sparse_attention_kernel(q, k_cache, v_cache, *tables, k_scale, v_scale, workspace=self.workspace)

    def stages(self, *args, **kwargs) -> dict:
        """The step's launches as callables, arguments as :meth:`run`; see :meth:`_stages`."""
        self._staging = True
        try:
            return self.run(*args, **kwargs)
        finally:
            self._staging = False

    def _run(self, inputs: dict, caches):
        if self._staging:  # (stages(): the launches as callables instead of a run)
            return self._stages(inputs, caches)
        self._check_inputs(inputs, caches)
        if validation_enabled() and not _capturing():
            self._value_checks(inputs)
        if not self.uses_kernels:
            return self._one_shot(inputs, caches)
        if not self.graph:
            self._eager_launch(inputs, caches)
            return self.out
        static = self._static
        for name, t in inputs.items():
            static[name].copy_(t)
        if self._prefill:
            self.req, self.pos = static["query_req_id"], static["query_abs_pos"]
        prints = tuple(None if t is None else _fingerprint(t) for t in caches)
        if self._cuda_graph is None or self._captured_with != prints:
            self._capture(caches)
            self._captured_with = prints
        self._cuda_graph.replay()
        return self.out

    def _eager_launch(self, inputs: dict, caches) -> None:
        """:meth:`_launch`, replaying the recorded launches of an earlier run where they still apply
        (:mod:`mm3lab._replay`: the same kernels without Triton's per-launch binding). A run inside a
        CUDA-graph capture launches normally: an eager recording may hold launches that a graph must
        not (the attention's own split merge counts arrivals on the eager stream's counters)."""
        if _capturing():  # (the caller's graph gets the normal launches, never a replay of eager ones)
            self._launch(inputs, caches)
            return
        rec = self._recording
        if rec is not None and rec.matches(inputs, caches):
            rec.replay(inputs, self.device)
            return
        if not _replay.supported() or self._device_work:  # (device work besides launches is never replayed)
            self._recording = None
            self._launch(inputs, caches)
            return
        self._recording = _replay.record(lambda: self._launch(inputs, caches), inputs, caches)
        self._device_work = self._recording is None and _replay.last_reason.startswith(_replay.DEVICE_WORK)

    def _capture(self, caches) -> None:
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # warm up: compile every kernel outside the capture
            self._launch(self._static, caches)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._launch(self._static, caches)
        self._cuda_graph = graph

    def _inputs(self, *tensors) -> dict:
        """``run``'s tensor inputs by name: ``q, key, value, index_q, index_k, block_table`` and the rows."""
        return dict(zip((*_TENSOR_INPUTS, "block_table", *self._ROW_INPUTS), tensors, strict=True))

    def _stages(self, inputs: dict, caches) -> dict:
        """The step's launches one by one, as zero-argument callables (for per-stage timing).

        ``insert`` (rows and slots, index-cache insert, KV write), ``indexer_scores``, ``topk``
        (top-k alone), ``block_table`` (the sparse block table from ``plan.topk_idx``),
        ``topk_block_table`` (the fused launch the step runs), ``attention`` (the per-row kernel).
        Each writes the plan's buffers and allocates nothing.
        """
        self._check_inputs(inputs, caches)
        if not self.uses_kernels:
            raise ValueError("stages: this plan runs the PyTorch path; its steps are not separate launches")
        return {
            "insert": lambda: self._insert(inputs, caches),
            "indexer_scores": lambda: self._scores(inputs, caches),
            "topk": lambda: self._topk(inputs, table=False),
            "block_table": lambda: self._block_table(inputs),
            "topk_block_table": lambda: self._topk(inputs),
            "attention": lambda: self._attend(inputs["q"], caches, "rows"),
        }

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(rows={self.rows}, batch={self.batch}, max_blocks={self.max_blocks}, "
            f"heads={self.num_q_heads}/{self.num_kv_heads}, head_dim={self.head_dim}, index_dim={self.index_dim}, "
            f"dtype={dtype_name(self.dtype)}, cache={dtype_name(self.cache_dtype)}/"
            f"{dtype_name(self.index_cache_dtype)}, topk={self.topk}, block_page_stride={self.block_page_stride}, "
            f"graph={self.graph}, kernels={self.uses_kernels})"
        )


class MSADecodePlan(_MSAPlan):
    """A planned :func:`mm3lab.msa_decode` (SPEC section 8); see :mod:`mm3lab.plan`.

    Args:
        k_cache, v_cache: page-16 views of the KV cache (dense or packed); fix ``Hkv``, ``D``,
            the dtype, the layout and the device.
        index_cache: ``[num_blocks, 128, Di]``; fixes ``Di`` and the index dtype.
        batch: requests ``B`` (``N = B * decode_query_len`` rows).
        max_blocks: block-table width ``M`` (``seq_len <= M * 128``).
        num_q_heads: ``Hq``, a multiple of ``Hkv``.
        decode_query_len, topk, init_blocks, local_blocks, scale: as :func:`mm3lab.msa_decode`.
        id_dtype: dtype of ``block_table`` and ``seq_lens`` (int32 or int64).
        graph: capture and replay a CUDA graph (CUDA only).
        index_scale, k_scale, v_scale: an FP8 cache's scales (as :func:`mm3lab.msa_decode`), else ``None``.
        query_dtype: the float dtype of the inputs an FP8 cache quantizes (default bfloat16).
        algorithm: the attention kernel, as :func:`mm3lab.sparse_attention`'s. ``None``: the per-row
            kernel below ``mm3lab.attention.TILED_MIN_ROWS`` rows, the tiled kernel from there up.
    """

    _ROW_INPUTS = ("seq_lens",)

    def __init__(
        self,
        k_cache,
        v_cache,
        index_cache,
        *,
        batch: int,
        max_blocks: int,
        num_q_heads: int,
        decode_query_len: int = 1,
        topk: int = DEFAULT_TOPK,
        init_blocks: int = 0,
        local_blocks: int = 1,
        scale: float | None = None,
        id_dtype: torch.dtype = torch.int32,
        graph: bool = False,
        index_scale=None,
        k_scale=None,
        v_scale=None,
        query_dtype: torch.dtype = torch.bfloat16,
        algorithm: str | None = None,
    ):
        check_int("batch", batch, minimum=1)
        check_int("decode_query_len", decode_query_len, minimum=1)
        super().__init__(rows=batch * decode_query_len, decode_query_len=decode_query_len, **_shared(locals()))

    def run(
        self,
        q,
        key,
        value,
        index_q,
        index_k,
        k_cache,
        v_cache,
        index_cache,
        block_table,
        seq_lens,
        *,
        index_scale=None,
        k_scale=None,
        v_scale=None,
    ):
        """One decode step, arguments as :func:`mm3lab.msa_decode`; returns ``plan.out [N, Hq, D]``."""
        inputs = self._inputs(q, key, value, index_q, index_k, block_table, seq_lens)
        return self._run(inputs, (k_cache, v_cache, index_cache, index_scale, k_scale, v_scale))


class MSAPrefillPlan(_MSAPlan):
    """A planned :func:`mm3lab.msa_prefill` (SPEC section 8); see :mod:`mm3lab.plan`.

    Args: as :class:`MSADecodePlan`, with ``num_tokens`` (rows ``N`` of a chunk; pad shorter
    chunks with rows at a negative position) in place of ``decode_query_len``; ``batch`` is the
    block table's rows. ``id_dtype`` is also the dtype of ``query_req_id`` / ``query_abs_pos``.
    """

    _prefill = True
    _ROW_INPUTS = ("query_req_id", "query_abs_pos")

    def __init__(
        self,
        k_cache,
        v_cache,
        index_cache,
        *,
        num_tokens: int,
        batch: int,
        max_blocks: int,
        num_q_heads: int,
        topk: int = DEFAULT_TOPK,
        init_blocks: int = 0,
        local_blocks: int = 1,
        scale: float | None = None,
        id_dtype: torch.dtype = torch.int32,
        graph: bool = False,
        algorithm: str | None = None,
        index_scale=None,
        k_scale=None,
        v_scale=None,
        query_dtype: torch.dtype = torch.bfloat16,
    ):
        super().__init__(rows=num_tokens, decode_query_len=1, **_shared(locals()))

    def run(
        self,
        q,
        key,
        value,
        index_q,
        index_k,
        k_cache,
        v_cache,
        index_cache,
        block_table,
        query_req_id,
        query_abs_pos,
        *,
        index_scale=None,
        k_scale=None,
        v_scale=None,
    ):
        """One prefill step, arguments as :func:`mm3lab.msa_prefill`; returns ``plan.out [N, Hq, D]``."""
        inputs = self._inputs(q, key, value, index_q, index_k, block_table, query_req_id, query_abs_pos)
        if not self.graph:
            self.req, self.pos = query_req_id, query_abs_pos
        return self._run(inputs, (k_cache, v_cache, index_cache, index_scale, k_scale, v_scale))
