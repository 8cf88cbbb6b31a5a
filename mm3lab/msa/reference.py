"""Pure-PyTorch twins of the whole MSA layer (SPEC 2): :func:`msa_decode` / :func:`msa_prefill`.

The same layer as :mod:`mm3lab.msa.layer` (same signatures, checks, order and
:class:`~mm3lab.msa.layer.MSAStep`), every step taken from :mod:`mm3lab.reference`:
rows and slots, the index-cache and KV inserts, the indexer and sparse block table, and
the sparse attention are each the readable reference, on any device and any backend.
"""

from __future__ import annotations

import types

from .._twin import twin_of
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


@twin_of("mm3lab.msa.layer")
def msa_decode(**arguments):
    """:func:`mm3lab.msa_decode` from the reference steps (:mod:`mm3lab.reference`)."""
    return layer.run_layer(_steps(), arguments)


@twin_of("mm3lab.msa.layer")
def msa_prefill(**arguments):
    """:func:`mm3lab.msa_prefill` from the reference steps (:mod:`mm3lab.reference`)."""
    return layer.run_layer(_steps(), arguments)
