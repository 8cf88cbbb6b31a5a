"""FP8 caches (SPEC section 9): the quantization rule, its checks, and the stated tolerances.

Both FP8 caches store ``float8_e4m3fn`` values with one float32 scale per
stored vector:

* the **index cache** keeps one scale per token, ``index_scale [num_blocks, 128]``;
* the **KV cache** keeps one scale per (token, KV head) and side, ``k_scale`` /
  ``v_scale`` page-16 views ``[pages, 16, Hkv]`` in the same layout as
  ``k_cache`` / ``v_cache``.

The rule is the same everywhere: ``scale = amax(|x|) / 448`` over the vector (448
is e4m3's largest finite value), a zero vector gets ``scale = 1``, the stored
value is ``x / scale`` rounded to nearest-even e4m3, and the value it stands for
is ``stored * scale``. Kernels and references quantize bit-identically (the
division is correctly rounded in both).

Tolerances, stated once here and quoted by the docs and the tests:

* :data:`INDEX_SCORE_FP8_RTOL`: FP8 index scores of a kernel against the reference
  (which dequantizes the keys and applies SPEC section 2 in float32). The
  scoring kernels round ``index_q`` per (row, head) to a two-term FP8 pair (a
  high and a low e4m3 part, see :mod:`mm3lab.indexer.kernel`), so each score is
  off by at most ``INDEX_SCORE_FP8_RTOL * max_s sum_d |q_d| |k_sd|``. Selected ids
  agree except where two candidates' reference scores lie within that bound
  (a near tie).
* :data:`ATTENTION_FP8_ATOL`: sparse attention over an FP8 KV cache against the
  bf16 reference over the unquantized K/V, for unit-variance K/V and softmax
  scale ``D ** -0.5`` (each output element is a convex combination of V rows).
  Against the reference over the *dequantized* cache it agrees to float32
  rounding (:data:`ATTENTION_FP8_DEQUANT_ATOL`).
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
"""The storage dtype of both FP8 caches."""

FP8_MAX = 448.0
"""Largest finite ``float8_e4m3fn`` value: ``scale = amax / FP8_MAX``."""

INDEX_SCORE_FP8_RTOL = 2.0**-7
"""FP8 index score, kernel vs reference: ``|delta| <= RTOL * max_s sum_d |q_d| |k_sd|``."""

ATTENTION_FP8_ATOL = 0.1
"""FP8 KV sparse attention vs the bf16 reference over the original K/V (unit-variance K/V)."""

ATTENTION_FP8_DEQUANT_ATOL = 2e-3
"""FP8 KV sparse attention vs the reference over the dequantized K/V."""


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is the FP8 storage dtype."""
    return dtype == FP8_DTYPE


def quantize(x: torch.Tensor, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` to e4m3 with one scale per vector along ``dim`` (SPEC section 9).

    Returns ``(values, scale)``: ``values`` has ``x``'s shape in ``float8_e4m3fn``;
    ``scale`` is float32 with ``dim`` removed (``amax(|x|) / 448``, 1 for a zero vector).
    """
    xf = x.float()
    amax = xf.abs().amax(dim=dim)
    # (a tensor divisor: CUDA PyTorch divides by a Python scalar as a multiply by its reciprocal,
    # which is not the correctly rounded quotient the kernels compute)
    scale = torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))
    values = (xf / scale.unsqueeze(dim)).to(FP8_DTYPE)
    return values, scale


def dequantize(values: torch.Tensor, scale: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``values * scale`` in float32 (``scale`` broadcast along ``dim``)."""
    return values.float() * scale.float().unsqueeze(dim)


def round_trip(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``x`` after an FP8 store and load, float32 (what an FP8 cache gives back)."""
    return dequantize(*quantize(x, dim), dim=dim)


__all__ = [
    "ATTENTION_FP8_ATOL",
    "ATTENTION_FP8_DEQUANT_ATOL",
    "FP8_DTYPE",
    "FP8_MAX",
    "INDEX_SCORE_FP8_RTOL",
    "dequantize",
    "is_fp8",
    "quantize",
    "round_trip",
]
