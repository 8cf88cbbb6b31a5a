"""Compile every mm3lab Triton kernel for a GPU architecture, on a machine without a GPU.

The interpreter that runs the kernels on CPU accepts programs that a GPU rejects: a
``tl.dot`` tile below 16 (see ``--self-test``), ``float8_e4m3fn`` below compute capability
8.9, a program that needs more shared memory than the GPU gives one. CI has no GPU. This
script closes that gap: it runs the public entry points on CPU tensors with the launches
intercepted, and compiles each launch for ``GPUTarget("cuda", arch, 32)`` with the
specialization (dtypes, constexprs, 16-byte alignment, integer 1 / multiple-of-16 cases)
that Triton's own launcher would compute, and with the launch configuration the package
picks for that GPU's shared memory (:data:`SHARED_MEMORY`). Triton's wheel carries
``ptxas``, so the result is a real binary; a specialization fails if it does not compile or
needs more shared memory than the architecture gives a program. Nothing runs: outputs hold
garbage, and no entry point reads a kernel's output back on the host with validation off.

Run by ``tests/test_gpu_compile.py`` in a subprocess (it must decide the backend before
``mm3lab`` is imported). By hand: ``python tests/gpu_compile.py [--arch 90] [--dtypes ...]
[--verbose]``. Exit status 0 when every launched kernel compiled and fits, and every kernel
the package launches was covered.
"""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import offline  # (first: mm3lab takes its compiled-kernel paths, on CPU tensors)

# isort: split
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler.compiler import make_backend
from triton.runtime.errors import OutOfResources
from triton.runtime.jit import create_function_from_signature

import mm3lab
from mm3lab import _pdl, _valcheck
from mm3lab.attention import tiled

SHARED_MEMORY = {80: 166912, 86: 101376, 89: 101376, 90: 232448, 100: 232448, 120: 101376}
"""Shared memory one program may use (bytes, the opt-in limit) on each architecture: sm_80 A100; sm_86 RTX 30xx,
A10, A40; sm_89 RTX 40xx, L4, L40S; sm_90 H100, H200; sm_100 B200; sm_120 RTX 50xx."""
INPUTS = {
    "bf16": (torch.bfloat16, False),
    "fp16": (torch.float16, False),
    "fp32": (torch.float32, False),
    "fp8": (torch.bfloat16, True),  # bf16 inputs, FP8 index and KV caches
}
"""``--dtypes`` name -> (the inputs' dtype, FP8 caches)."""
DTYPES = tuple(INPUTS)
PACKAGE = Path(mm3lab.__file__).parent

TARGET = GPUTarget("cuda", 90, 32)  # (main() sets the one asked for)
_backend = make_backend(TARGET)
_binders: dict = {}
compiled: dict = {}  # (kernel name, specialization, options) -> compiled kernel
failures: list = []


def _compile_launch(self, *args, grid, warmup, **kwargs):
    """``JITFunction.run`` replaced: bind as the GPU launcher would, compile for sm_90, launch nothing."""
    kwargs["debug"] = kwargs.get("debug", self.debug) or triton.knobs.runtime.debug
    kwargs["instrumentation_mode"] = triton.knobs.compilation.instrumentation_mode
    binder = _binders.get(self)
    if binder is None:
        binder = _binders[self] = create_function_from_signature(self.signature, self.params, _backend)
    bound, specialization, options = binder(*args, **kwargs)
    key = (self.__name__, str(specialization), str(options))
    if key in compiled:
        return None
    opts, signature, constexprs, attrs = self._pack_args(_backend, kwargs, bound, specialization, options)
    start = time.perf_counter()
    try:
        kernel = triton.compile(ASTSource(self, signature, constexprs, attrs), target=TARGET, options=opts.__dict__)
    except Exception as err:  # reported with its launch, then the run goes on
        failures.append((self.__name__, {k: v for k, v in bound.items() if signature.get(k) == "constexpr"}, err))
        compiled[key] = None
        return None
    declared = {p.name for p in self.params if p.is_constexpr}
    named = {self.arg_names[path[0]]: value for path, value in constexprs.items() if len(path) == 1}
    constexprs = {k: v for k, v in named.items() if k in declared}
    if kernel.metadata.shared > SHARED_MEMORY[TARGET.arch]:  # as Triton refuses the launch on such a GPU
        raise OutOfResources(kernel.metadata.shared, SHARED_MEMORY[TARGET.arch], "shared memory")
    compiled[key] = (kernel, time.perf_counter() - start, constexprs)
    return None


def _registers(kernel) -> tuple[int, int]:
    """``(registers, stack bytes)`` per thread of a compiled kernel, from ``cuobjdump -res-usage`` on its cubin
    (a stack above 0 means spills); ``(-1, -1)`` when the tool is missing."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return -1, -1
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    return (int(found.group(1)), int(found.group(2))) if found else (-1, -1)


def launched_kernels() -> set[str]:
    """Names of the ``@triton.jit`` functions the package launches (``name[grid](...)`` in its source)."""
    names = set()
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        jitted = {
            node.name
            for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in node.decorator_list)
        }
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Subscript)
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id in jitted
            ):
                names.add(node.func.value.id)
    return names


# ----------------------------------------------------------------------------
# the calls: model shapes (64 query / 4 KV heads, head dim 128, index dim 128, top-k 16)
# ----------------------------------------------------------------------------

HQ, HKV, D, DI, TOPK = offline.HQ, offline.HKV, offline.D, offline.DI, offline.TOPK


def run_calls(dtypes) -> int:
    """Every public entry point that launches a kernel, over dtypes, layouts and row kinds; returns the call count."""
    calls = 0
    for name in dtypes:
        dtype, fp8 = INPUTS[name]
        for layout in ("dense", "packed"):
            for dql in (1, 4):  # decode and speculative decode
                layer = offline.model_layer(dtype, layout, fp8, dql=dql)
                mm3lab.msa_decode(**layer, decode_query_len=dql)
            layer = offline.model_layer(dtype, layout, fp8)
            chunk = offline.prefill_chunk(layer)
            mm3lab.msa_prefill(**chunk)
            calls += 3
            calls += run_plans(layer, chunk, dtype)
            caches = (layer["k_cache"], layer["v_cache"])
            scales = dict(k_scale=layer["k_scale"], v_scale=layer["v_scale"])
            index_scale = layer["index_scale"]
            selection = (layer["index_q"], layer["index_cache"], layer["block_table"], layer["seq_lens"])
            for forced in (False, True):
                mm3lab.index_scores_decode(*selection, forced=forced, index_scale=index_scale)
            topk_idx = mm3lab.index_topk_decode(*selection, TOPK, index_scale=index_scale)
            bps = mm3lab.sparse_block_page_stride(*caches)
            mm3lab.build_sparse_block_table_decode(topk_idx, layer["block_table"], layer["seq_lens"], 1, bps)
            rows = (chunk["query_req_id"], chunk["query_abs_pos"])
            chunk_selection = (chunk["index_q"], layer["index_cache"], layer["block_table"], *rows)
            chunk_idx = mm3lab.index_topk_prefill(*chunk_selection, TOPK, index_scale=index_scale)
            mm3lab.build_sparse_block_table_prefill(chunk_idx, layer["block_table"], *rows, bps)
            mm3lab.insert_index_cache(layer["index_k"], layer["index_cache"], torch.arange(2), index_scale=index_scale)
            calls += 6
            for q in (layer["q"], chunk["q"]):  # a decode batch and a prefill chunk
                sparse_bt = torch.zeros(HKV, q.shape[0], TOPK * 8, dtype=torch.int32)
                sparse_ctx = torch.full((HKV, q.shape[0]), TOPK * 128, dtype=torch.int32)
                for algorithm in ("rows", "tiled"):
                    for return_lse in (False, True):
                        mm3lab.sparse_attention(
                            q, *caches, sparse_bt, sparse_ctx, algorithm=algorithm, return_lse=return_lse, **scales
                        )
                        calls += 1
    return calls


def run_plans(layer: dict, chunk: dict, dtype) -> int:
    """A decode plan and a prefill plan over ``layer``'s caches (their step's first launch is their own)."""
    caches = [layer[name] for name in ("k_cache", "v_cache", "index_cache")]
    scales = {name: layer[name] for name in ("index_scale", "k_scale", "v_scale")}
    batch, max_blocks = layer["block_table"].shape
    sizes = dict(max_blocks=max_blocks, num_q_heads=HQ, topk=TOPK, query_dtype=dtype, **scales)
    inputs = [layer[name] for name in ("q", "key", "value", "index_q", "index_k")]
    mm3lab.MSADecodePlan(*caches, batch=batch, **sizes).run(
        *inputs, *caches, layer["block_table"], layer["seq_lens"], **scales
    )
    inputs = [chunk[name] for name in ("q", "key", "value", "index_q", "index_k")]
    rows = (chunk["query_req_id"], chunk["query_abs_pos"])
    plan = mm3lab.MSAPrefillPlan(*caches, num_tokens=rows[0].shape[0], batch=batch, algorithm="rows", **sizes)
    plan.run(*inputs, *caches, layer["block_table"], *rows, **scales)
    return 2


def run_value_checks() -> int:
    """The fused value-check kernel over every segment kind (validation reads a GPU tensor's values)."""
    Segment = _valcheck.Segment

    def ids(*shape, dtype=torch.int32):
        return torch.zeros(*shape, dtype=dtype)

    sets = [
        [
            Segment("all", ids(5, 7), lo=0, hi=3, modulus=4, mod_limit=1),
            Segment("live", ids(9, dtype=torch.int64), lo=-1, aux=ids(9)),
            Segment("gather", ids(4, 6), hi=50, aux=ids(9), pos=ids(9), unit=128),
            Segment("len", ids(2, 3, 7), lo=0, hi=9, aux=ids(2, 3), unit=16),
        ],
        [
            Segment(
                "gather_last",
                ids(4, 6, dtype=torch.int64),
                lo=0,
                hi=100,
                aux=ids(9),
                pos=ids(9, dtype=torch.int64),
                unit=128,
                modulus=8,
                mod_limit=2,
            ),
        ],
    ]
    flags = ids(2 * _valcheck.MAX_SEGMENTS + 1)
    signal = (flags[-1:], flags[-1:])
    for segments in sets:
        _valcheck._run_kernel(segments, flags)
        _valcheck._run_kernel(segments, flags, flags, signal)  # (checks that tell the host they are done)
    return 2 * len(sets) + run_fused_checks(flags, signal)


def run_fused_checks(flags, signal) -> int:
    """The attention and decode-table launches that run a call's value checks themselves (a replayed
    checked call), the table's also keeping what it overwrites (a caller's ``out=``); the tiled kernel's
    checks as a launch of their own (its default) and in its first programs; and the tiled kernel's
    pre-pass as a launch of its own (the default runs it inside the tiled launch), and its row walks a
    program per tile."""
    from mm3lab.attention.kernel import sparse_attention_kernel
    from mm3lab.attention.tiled import tiled_attention_kernel
    from mm3lab.block_table.kernel import build_sparse_block_table_decode_kernel

    calls = 0
    fused = (flags, *signal)
    for b in (1, 64):
        for layout in ("dense", "packed"):
            cache = mm3lab.allocate_kv_cache(b * 8, HKV, D, layout, dtype=torch.bfloat16)
            q = torch.zeros(b, HQ, D, dtype=torch.bfloat16)
            sparse_bt = torch.zeros(HKV, b, TOPK * 8, dtype=torch.int32)
            sparse_ctx = torch.zeros(HKV, b, dtype=torch.int32)
            out = torch.empty_like(q)
            for lse in (None, torch.empty(b, HQ)):
                sparse_attention_kernel(
                    q, cache.k_cache, cache.v_cache, sparse_bt, sparse_ctx, D**-0.5, out, lse, check=(fused, 16, 8)
                )
                # what a CUDA graph captures: the splits merged by a launch of their own (eager calls merge in theirs)
                sparse_attention_kernel(
                    q, cache.k_cache, cache.v_cache, sparse_bt, sparse_ctx, D**-0.5, out, lse, merge="launch"
                )
                calls += 2
            # the tiled kernel with the checks as a launch of their own (the default) and in its first programs
            # (also where every tile walks its rows, a program per row), with its pre-pass as a launch of its
            # own, with its row walks a program per tile, and with its lean steps gathered (no block steps,
            # the default from sm_90) and not run first
            inside = {"check": (fused, 16, 8), "check_launch": "inside"}
            tiled_variants = (
                {"check": (fused, 16, 8)},
                inside,
                {**inside, "mode": "rows"},
                {"prepass": "kernel"},
                {"row_programs": False},
                {"block_steps": False, "lean_steps": True},
                {"lean_steps": False},
            )
            for kw in tiled_variants:
                tiled_attention_kernel(q, cache.k_cache, cache.v_cache, sparse_bt, sparse_ctx, D**-0.5, out, None, **kw)
                calls += 1
        topk = torch.zeros(HKV, b, TOPK, dtype=torch.int32)
        table = (torch.zeros(b, 4, dtype=torch.int32), torch.zeros(b, dtype=torch.int32))
        outs = (torch.empty(HKV, b, TOPK * 8, dtype=torch.int32), torch.empty(HKV, b, dtype=torch.int32))
        for backup in ([], [outs]):
            build_sparse_block_table_decode_kernel(topk, *table, 1, 8, *outs, check=(fused, 0, 2**27, *backup))
            calls += 1
    return calls


@triton.jit
def _square(x_ptr, y_ptr, B: tl.constexpr):
    """``y = x @ x`` for one ``[B, B]`` tile: the interpreter runs it for any B, sm_90 needs ``B >= 16``."""
    i = tl.arange(0, B)
    tile = i[:, None] * B + i[None, :]
    a = tl.load(x_ptr + tile)
    tl.store(y_ptr + tile, tl.dot(a, a))


def self_test() -> int:
    """The check catches what the interpreter lets through: an 8 x 8 ``tl.dot`` fails, 16 x 16 compiles."""
    for b in (8, 16):
        x = torch.zeros(b, b, dtype=torch.float16)
        _square[(1,)](x, x, B=b)
    failed = [constexprs["B"] for name, constexprs, _ in failures if name == "_square"]
    built = [c["B"] for (name, _, _), value in compiled.items() if name == "_square" and value for c in [value[2]]]
    print(f"self-test: failed for B={failed}, compiled for B={built}")
    return 0 if failed == [8] and built == [16] else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verbose", action="store_true", help="one line per compiled specialization")
    parser.add_argument("--self-test", action="store_true", help="only show that a kernel sm_90 rejects fails here")
    parser.add_argument("--arch", type=int, choices=sorted(SHARED_MEMORY), default=90, help="compute capability x 10")
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=DTYPES, help="the inputs' dtypes (fp8: caches)")
    parser.add_argument(
        "--shape",
        nargs=5,
        type=int,
        metavar=("HQ", "HKV", "D", "DI", "TOPK"),
        help="query heads, KV heads, head dim, index dim, top-k (default: the model's 64 4 128 128 16)",
    )
    args = parser.parse_args()
    if args.shape:
        global HQ, HKV, D, DI, TOPK
        HQ, HKV, D, DI, TOPK = args.shape
        offline.HQ, offline.HKV, offline.D, offline.DI, offline.TOPK = args.shape
    global TARGET, _backend
    TARGET = GPUTarget("cuda", args.arch, 32)
    _backend = make_backend(TARGET)
    dtypes = [d for d in args.dtypes if d != "fp8" or args.arch >= 89]  # below 8.9: FP8 takes the PyTorch path
    offline.install(_compile_launch)
    if args.arch * 10 >= _pdl.CAPABILITY[0] * 100 + _pdl.CAPABILITY[1] * 10:
        _pdl.enabled = lambda device: True  # the GPU launches these kernels with PDL: compile that variant
    if args.arch >= 90:
        tiled.blocks_enabled = lambda device: True  # the tiled kernel's block steps (tensor descriptors)
    if args.self_test:
        return self_test()
    start = time.perf_counter()
    calls = 0
    with mm3lab.validation(False):  # value checks would read kernel outputs (garbage here) on the host
        try:
            calls = run_calls(dtypes) + run_value_checks()
        except RuntimeError as err:  # a launch that fits at no pipeline depth (mm3lab._fit)
            failures.append(("(a call)", {}, str(err)))
    elapsed = time.perf_counter() - start
    per_kernel: dict = {}  # name -> [(registers, stack bytes, shared bytes, seconds, constexprs)]
    for (name, _, _), value in compiled.items():
        if value is not None:
            kernel, seconds, constexprs = value
            per_kernel.setdefault(name, []).append((*_registers(kernel), kernel.metadata.shared, seconds, constexprs))
    missing = sorted(launched_kernels() - {name for name, _, _ in compiled})
    shape = f"Hq {HQ}, Hkv {HKV}, D {D}, Di {DI}, top-k {TOPK}"
    target = f"{TARGET.backend} sm_{TARGET.arch}"
    print(f"triton {triton.__version__}, target {target}, {' '.join(dtypes)}, {shape}: {calls} calls")
    for name, found in sorted(per_kernel.items()):
        regs, stack, shared = (max(f[i] for f in found) for i in range(3))
        print(f"  {name}: {len(found)} specializations; at most {regs} registers, {stack} B stack, {shared} B shared")
        if args.verbose:
            for r, st, sh, seconds, constexprs in found:
                print(f"    {seconds:5.2f} s  {r:3d} registers {st:5d} B stack {sh:6d} B shared  {constexprs}")
    print(f"{sum(map(len, per_kernel.values()))} specializations compiled in {elapsed:.0f} s")
    spills: dict = {}  # (name, constexprs) -> [stack bytes of each specialization]: layouts differ in strides only
    for name, found in sorted(per_kernel.items()):
        for f in found:
            if f[1] > 0:
                spills.setdefault((name, str(f[4])), []).append(f[1])
    if spills:
        print(f"{sum(map(len, spills.values()))} of them spill registers to the stack (slower, not wrong):")
        for (name, constexprs), stacks in spills.items():
            print(f"  {name} x{len(stacks)}, up to {max(stacks)} B: {constexprs}")
    for name, constexprs, err in failures:
        why = err if isinstance(err, str) else f"{type(err).__name__}: {err}"
        print(f"FAILED {name} {constexprs}: {why}")
    if missing:
        print(f"NOT COVERED (launched by the package, never compiled here): {', '.join(missing)}")
    return 1 if failures or missing or not per_kernel else 0


if __name__ == "__main__":
    sys.exit(main())
