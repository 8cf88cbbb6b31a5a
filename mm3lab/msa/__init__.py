"""The MSA layer (SPEC section 2), one module per job.

- :mod:`.layer`: :func:`msa_decode` / :func:`msa_prefill`, the whole layer in one call, and
  :class:`MSAStep`, its intermediates; :func:`decode_query_rows`, the decode row rule.
- :mod:`.dense`: :func:`dense_decode` / :func:`dense_prefill`, the dense-attention baseline.
- :mod:`.metrics`: :func:`attention_weights` / :func:`selected_mass`, what the selection keeps.

The synthetic layer the notebook and tests run lives in :mod:`mm3lab.synthetic`
(:func:`synthetic_layer`), the notebook's experiments in :mod:`mm3lab.viz.msa_demo`; both are
re-exported here, so ``from mm3lab.msa import X`` works for every name below.
"""

from ..synthetic import SyntheticLayer, synthetic_layer
from ..viz.msa_demo import MSADemo, run_msa_demo, topk_sweep
from .dense import dense_decode, dense_prefill
from .layer import MSAStep, decode_query_rows, msa_decode, msa_prefill
from .metrics import attention_weights, selected_mass

__all__ = [
    "MSADemo",
    "MSAStep",
    "SyntheticLayer",
    "attention_weights",
    "decode_query_rows",
    "dense_decode",
    "dense_prefill",
    "msa_decode",
    "msa_prefill",
    "run_msa_demo",
    "selected_mass",
    "synthetic_layer",
    "topk_sweep",
]
