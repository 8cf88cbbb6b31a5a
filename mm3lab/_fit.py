"""Launches that fit the GPU's shared memory: the pipeline depth comes down where a GPU has less.

A kernel's shared memory grows with its pipeline depth (``num_stages``: tiles in flight) and its
tile sizes. The depths mm3lab launches with were tuned on an H100/H200, which gives a program
227 KiB; an A100 gives 163 KiB, and RTX 30xx/40xx/50xx, A10, L4 and L40S give 99 KiB. Triton
refuses a launch that needs more (``OutOfResources``, raised before anything runs), so a launch
through :func:`fitting` tries the depths it is given, deepest first, and remembers the first that
fits for that kernel and configuration. A GPU where the preferred depth fits never pays for more
than one dictionary test per launch.

``tests/gpu_compile.py`` checks every launch at the model's shapes against the shared memory of
sm_80, sm_89 and sm_90 this way, without a GPU.
"""

from __future__ import annotations

import torch
from triton.runtime.errors import OutOfResources

_chosen: dict = {}  # (kernel, option, configuration) -> the depth that fit


def _configuration(args, kwargs) -> tuple:
    """What decides a launch's shared memory: the tensors' dtypes and the constexpr / option values."""
    dtypes = tuple(a.dtype for a in args if isinstance(a, torch.Tensor))
    options = tuple(sorted((k, v) for k, v in kwargs.items() if not isinstance(v, torch.Tensor)))
    return dtypes, options


class fitting:  # noqa: N801  (used like the kernel it wraps: fitting(kernel, ...)[grid](...))
    """``fitting(kernel, option, depths)[grid](*args, **kwargs)``: ``kernel[grid](...)`` with ``option`` (a launch
    option such as ``num_stages``, or a constexpr) set to the first of ``depths`` whose compiled kernel fits."""

    def __init__(self, kernel, option: str, depths):
        self.kernel, self.option, self.depths = kernel, option, tuple(depths)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self._launch(grid, args, kwargs)

    def _launch(self, grid, args, kwargs):
        kernel, option = self.kernel, self.option
        key = None
        if _chosen:  # (some launch in this process did not fit at its first depth)
            key = (kernel, option, self.depths, _configuration(args, kwargs))
            depth = _chosen.get(key)
            if depth is not None:
                return kernel[grid](*args, **kwargs, **{option: depth})
        for i, depth in enumerate(self.depths):
            try:
                launched = kernel[grid](*args, **kwargs, **{option: depth})
            except OutOfResources as err:
                if err.name != "shared memory":
                    raise
                if i + 1 < len(self.depths):
                    continue
                raise RuntimeError(
                    f"{kernel.__name__}: needs {err.required} B of shared memory even with {option}={depth}, and "
                    f"this GPU gives a program {err.limit} B; use bfloat16 / float16 inputs or smaller head dims"
                ) from err
            if i:  # remember a depth that had to come down
                _chosen[key or (kernel, option, self.depths, _configuration(args, kwargs))] = depth
            return launched
        return None


def chosen() -> dict:
    """``(kernel name, option) -> depth`` for the launches whose first depth did not fit (for ``mm3lab info``)."""
    return {(k[0].__name__, k[1]): depth for k, depth in _chosen.items()}


__all__ = ["chosen", "fitting"]
