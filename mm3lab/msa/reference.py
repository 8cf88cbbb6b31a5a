"""Pure-PyTorch twins of the whole MSA layer (SPEC 2): :func:`msa_decode` / :func:`msa_prefill`.

The same layer as :mod:`mm3lab.msa.layer` (same signatures, checks, order and
:class:`~mm3lab.msa.layer.MSAStep`), every step taken from :mod:`mm3lab.reference`:
rows and slots, the index-cache and KV inserts, the indexer and sparse block table, and
the sparse attention are each the readable reference, on any device and any backend.
"""

from __future__ import annotations

import functools
import inspect
import types

from ..rows import decode_query_rows
from . import layer

__all__ = ["msa_decode", "msa_prefill"]


def _steps():
    from .. import reference

    def rows_and_slots(block_table, rows):
        kind, first, second = rows
        req, pos = decode_query_rows(first, second) if kind == "decode" else (first, second)
        return req, pos, reference.token_slots(block_table, req, pos)

    names = (
        "insert_index_cache",
        "write_kv_page16",
        "index_topk_block_table_decode",
        "index_topk_block_table_prefill",
        "index_scores_decode",
        "index_scores_prefill",
        "sparse_attention",
    )
    return types.SimpleNamespace(rows_and_slots=rows_and_slots, **{name: getattr(reference, name) for name in names})


def _twin(layer_function):
    """``layer_function`` (:func:`mm3lab.msa_decode` or ``msa_prefill``) on the reference steps:
    the same signature and argument binding, then :func:`mm3lab.msa.layer.run_layer`."""
    signature = inspect.signature(layer_function)

    @functools.wraps(layer_function)
    def twin(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return layer.run_layer(_steps(), bound.arguments)

    twin.__module__ = __name__
    twin.__doc__ = f":func:`mm3lab.{layer_function.__name__}` from the reference steps (:mod:`mm3lab.reference`)."
    return twin


msa_decode = _twin(layer.msa_decode)
msa_prefill = _twin(layer.msa_prefill)
