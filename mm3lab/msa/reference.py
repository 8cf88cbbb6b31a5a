"""Pure-PyTorch twins of the whole MSA layer (SPEC 2): :func:`msa_decode` / :func:`msa_prefill`.

The same layer as :mod:`mm3lab.msa.layer` (same signatures, checks, order and
:class:`~mm3lab.msa.layer.MSAStep`), every step taken from :mod:`mm3lab.reference`:
the index-cache and KV inserts, the indexer and sparse block table, and the sparse
attention are each the readable reference, on any device and any backend.
"""

from __future__ import annotations

from .layer import layer_entry_points

__all__ = ["msa_decode", "msa_prefill"]


def _reference_steps():
    from .. import reference

    return reference


msa_decode, msa_prefill = layer_entry_points(_reference_steps, __name__)
msa_decode.__doc__ = """:func:`mm3lab.msa_decode` from the reference steps (:mod:`mm3lab.reference`)."""
msa_prefill.__doc__ = """:func:`mm3lab.msa_prefill` from the reference steps (:mod:`mm3lab.reference`)."""
