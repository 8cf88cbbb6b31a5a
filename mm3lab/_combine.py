"""Combine functions for ``tl.reduce`` and ``tl.associative_scan``.

Triton's own elementwise maximum and minimum where this Triton has them: the interpreter maps
these to numpy (``tl.max`` / ``tl.min`` are device functions themselves, which the interpreter
calls far more slowly); else jitted fallbacks of the same meaning.
"""

from __future__ import annotations

import triton
import triton.language as tl

maximum = getattr(tl.standard, "_elementwise_max", None)
minimum = getattr(tl.standard, "_elementwise_min", None)
if maximum is None or minimum is None:  # pragma: no cover - depends on the Triton version

    @triton.jit
    def maximum(a, b):
        return tl.maximum(a, b)

    @triton.jit
    def minimum(a, b):
        return tl.minimum(a, b)


__all__ = ["maximum", "minimum"]
