"""The MSA notebook's experiments: one decode step of a synthetic layer run sparse and dense
(:func:`run_msa_demo`), and the output error and attention mass kept per ``topk`` (:func:`topk_sweep`).

:mod:`mm3lab.viz.msa` draws what they return.
"""

from __future__ import annotations

import dataclasses

import torch

from ..constants import DEFAULT_TOPK
from ..msa.dense import dense_decode
from ..msa.layer import MSAStep, msa_decode
from ..msa.metrics import attention_weights, selected_mass
from ..synthetic import SyntheticLayer

__all__ = ["MSADemo", "run_msa_demo", "topk_sweep"]


@dataclasses.dataclass
class MSADemo:
    """One decode step of a :class:`SyntheticLayer` run sparse and dense, with what the selection kept.

    Attributes:
        layer: the inputs; topk: the selection size.
        out: ``[N, Hq, D]`` MSA output; step: its :class:`MSAStep`.
        dense: ``[N, Hq, D]`` the dense baseline's output.
        weights: ``[N, Hq, S]`` dense attention weights (:func:`attention_weights`).
        mass: ``[N, Hq]`` share of them in the selected blocks (:func:`selected_mass`).
        error: ``||out - dense|| / ||dense||`` over all rows and heads.
    """

    layer: SyntheticLayer
    topk: int
    out: torch.Tensor
    step: MSAStep
    dense: torch.Tensor
    weights: torch.Tensor
    mass: torch.Tensor
    error: float


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    denom = b.norm().item()
    return (a - b).norm().item() / denom if denom else (a - b).norm().item()


def run_msa_demo(layer: SyntheticLayer, topk: int = DEFAULT_TOPK, dense: torch.Tensor | None = None) -> MSADemo:
    """Run :func:`msa_decode` (and :func:`dense_decode` unless ``dense`` is given) on ``layer``.

    Both calls write the step's new tokens into the layer's caches (the same
    values every time), so a layer can be run again with another ``topk``.
    """
    out, step = msa_decode(**layer.inputs(), topk=topk, return_intermediates=True)
    if dense is None:
        dense = dense_decode(**layer.dense_inputs())
    weights = attention_weights(layer.q, layer.full_key, step.query_req_id, step.query_abs_pos)
    mass = selected_mass(weights, step.topk_idx)
    return MSADemo(layer, topk, out, step, dense, weights, mass, _relative_error(out, dense))


def topk_sweep(layer: SyntheticLayer, topks=(1, 2, 4, 8, 16)) -> list[dict]:
    """Sparse-versus-dense output error and attention mass kept, per ``topk``.

    Returns one dict per ``topk``: ``topk``, ``error`` (relative, all rows and heads),
    ``mass`` (mean share of the dense attention weight in the selected blocks),
    ``tokens`` (mean ``sparse_ctx``) and ``context`` (mean visible tokens).
    """
    dense = dense_decode(**layer.dense_inputs())
    rows = []
    for topk in topks:
        demo = run_msa_demo(layer, int(topk), dense)
        rows.append(
            dict(
                topk=int(topk),
                error=demo.error,
                mass=float(demo.mass.mean()),
                tokens=float(demo.step.sparse_ctx.float().mean()),
                context=float((demo.step.query_abs_pos.float() + 1).clamp(min=0).mean()),
            )
        )
    return rows
