"""Assertion helpers used by mm3lab's tests, usable by anyone checking a kernel.

Integer outputs (block tables, top-k ids, context lengths) are compared
exactly; float outputs by relative error against a reference, with the
tolerance stated by the caller. Failures print the mismatching elements, not
only ``False``. Last, a small synthetic MSA layer and the sizes of a plan for it.
"""

from __future__ import annotations

import torch

GARBAGE_INT = -123456789
"""What :func:`poison` writes into integer buffers: no valid output equals it."""


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` in place with values no kernel would write (NaN, or ``GARBAGE_INT``)."""
    if t.dtype.is_floating_point:
        return t.fill_(float("nan"))
    return t.fill_(GARBAGE_INT if t.dtype in (torch.int32, torch.int64) else 0)


def _mismatch_report(actual: torch.Tensor, expected: torch.Tensor, bad: torch.Tensor, limit: int) -> str:
    idx = torch.nonzero(bad)
    lines = [f"{idx.shape[0]} of {bad.numel()} elements differ; first {min(limit, idx.shape[0])}:"]
    for row in idx[:limit].tolist():
        where = tuple(row)
        lines.append(f"  at {where}: got {actual[where].item()!r}, expected {expected[where].item()!r}")
    return "\n".join(lines)


def assert_equal_int(actual: torch.Tensor, expected: torch.Tensor, name: str = "output", limit: int = 12) -> None:
    """Exact equality of integer tensors (shape, values; dtype may differ)."""
    if tuple(actual.shape) != tuple(expected.shape):
        raise AssertionError(f"{name}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    a = actual.detach().cpu().to(torch.int64)
    e = expected.detach().cpu().to(torch.int64)
    bad = a != e
    if bad.any():
        raise AssertionError(f"{name}: " + _mismatch_report(a, e, bad, limit))


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``||actual - expected|| / ||expected||`` in float64 (0 when both are zero)."""
    a = actual.detach().cpu().double()
    e = expected.detach().cpu().double()
    denom = e.norm().item()
    diff = (a - e).norm().item()
    return diff if denom == 0 else diff / denom


def assert_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    atol: float,
    rtol: float,
    name: str = "output",
    limit: int = 12,
) -> None:
    """Elementwise ``a == e`` or ``|a - e| <= atol + rtol * |e|``; NaN never passes. Reports the relative error."""
    if tuple(actual.shape) != tuple(expected.shape):
        raise AssertionError(f"{name}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    a = actual.detach().cpu().double()
    e = expected.detach().cpu().double()
    bad = ~((a == e) | ((a - e).abs() <= atol + rtol * e.abs()))  # equal infinities pass; NaN never does
    if bad.any():
        raise AssertionError(
            f"{name}: relative error {relative_error(a, e):.3e} (atol={atol}, rtol={rtol}); "
            + _mismatch_report(a, e, bad, limit)
        )


def assert_same(
    actual, expected, name: str = "output", *, atol: float | None = None, rtol: float = 0.0, limit: int = 12
) -> None:
    """The one comparison of the test harness, printing the mismatching elements.

    Tensors, or tuples/lists of them (compared item by item). Integer tensors: exact
    (:func:`assert_equal_int`). Float tensors: the same dtype and identical values when ``atol`` is
    None (``a == e``, or both NaN: what a copy or an exact computation gives), else
    :func:`assert_close` within ``atol + rtol * |expected|``.
    """
    if isinstance(expected, (tuple, list)):
        if not isinstance(actual, (tuple, list)) or len(actual) != len(expected):
            raise AssertionError(f"{name}: expected {len(expected)} results, got {actual!r:.80}")
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same(a, e, f"{name}[{i}]", atol=atol, rtol=rtol, limit=limit)
        return
    if expected is None or actual is None:
        if actual is not expected:
            raise AssertionError(f"{name}: one result is None, the other is not")
        return
    if not expected.dtype.is_floating_point:
        assert_equal_int(actual, expected, name, limit)
        return
    if atol is not None:
        assert_close(actual, expected, atol=atol, rtol=rtol, name=name, limit=limit)
        return
    if tuple(actual.shape) != tuple(expected.shape):
        raise AssertionError(f"{name}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    if actual.dtype != expected.dtype:
        raise AssertionError(f"{name}: dtype {actual.dtype} != expected {expected.dtype}")
    a, e = actual.detach().cpu(), expected.detach().cpu()
    bad = ~((a == e) | (torch.isnan(a) & torch.isnan(e)))
    if bad.any():
        raise AssertionError(f"{name}: values differ; " + _mismatch_report(a, e, bad, limit))


PATHS = ("kernel", "torch", "reference")
"""The ways :func:`run_paths` runs an entry point: the public entry on the backend in force
(the Triton kernel where it applies), the same entry on the ``"torch"`` backend, and its twin
of the same name in :mod:`mm3lab.reference`."""


def run_paths(entry, make_inputs, *, result=None, paths=PATHS) -> dict:
    """Run ``entry`` once per path on fresh inputs; ``{path: what it gave}``.

    Args:
        entry: a public entry point (its reference twin is ``mm3lab.reference.<entry.__name__>``).
        make_inputs: ``() -> (args, kwargs)``, called once per path, so outputs and caches can be
            made afresh and poisoned (:func:`poison`) for each: a path that skips an element shows.
        result: ``(returned, args, kwargs) -> value`` to compare (default: the return value), e.g.
            the cache an in-place entry point wrote.
        paths: a subset of :data:`PATHS`.
    """
    import contextlib

    from . import backend, reference

    got = {}
    for path in paths:
        args, kwargs = make_inputs()
        fn = getattr(reference, entry.__name__) if path == "reference" else entry
        with backend.use_backend("torch") if path == "torch" else contextlib.nullcontext():
            returned = fn(*args, **kwargs)
        got[path] = returned if result is None else result(returned, args, kwargs)
    return got


def assert_paths_agree(got: dict, name: str = "output", *, against: str = "reference", **tolerance) -> None:
    """Every path of :func:`run_paths` gives what path ``against`` gave (:func:`assert_same`)."""
    for path, value in got.items():
        if path != against:
            assert_same(value, got[against], f"{name}: {path} vs {against}", **tolerance)


def small_msa_layer(device="cpu", *, context: int = 300, dql: int = 1, **options):
    """A :func:`mm3lab.msa.synthetic_layer` small enough for interpreted kernels.

    Float32, 2 requests of about ``context`` tokens, 2 KV heads of 2 query heads each, head dim
    and index dim 16, ``dql`` query tokens per request; ``options`` override any of its keywords.
    """
    from .msa import synthetic_layer

    shape = dict(batch=2, num_kv_heads=2, group_size=2, head_dim=16, index_dim=16, dtype=torch.float32)
    return synthetic_layer(context, decode_query_len=dql, device=device, **{**shape, **options})


def plan_sizes(layer) -> dict:
    """``batch``, ``max_blocks`` and ``num_q_heads`` of a plan for a synthetic ``layer``."""
    return {
        "batch": layer.block_table.shape[0],
        "max_blocks": layer.block_table.shape[1],
        "num_q_heads": layer.q.shape[1],
    }
