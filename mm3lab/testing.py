"""Assertion helpers used by mm3lab's tests, usable by anyone checking a kernel.

Integer outputs (block tables, top-k ids, context lengths) are compared
exactly; float outputs by relative error against a reference, with the
tolerance stated by the caller. Failures print the mismatching elements, not
only ``False``.
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
    """Elementwise ``|a - e| <= atol + rtol * |e|``; NaN never passes. Reports the relative error."""
    if tuple(actual.shape) != tuple(expected.shape):
        raise AssertionError(f"{name}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    a = actual.detach().cpu().double()
    e = expected.detach().cpu().double()
    bad = ~((a - e).abs() <= atol + rtol * e.abs())  # NaN compares False, so it is bad
    if bad.any():
        raise AssertionError(
            f"{name}: relative error {relative_error(a, e):.3e} (atol={atol}, rtol={rtol}); "
            + _mismatch_report(a, e, bad, limit)
        )
