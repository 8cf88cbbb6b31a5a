"""``analysis.select_for_sequence`` forces the kernel's raw scores on the host (one scoring pass
instead of two): the result equals the scoring kernel's own ``forced=True`` output."""

from __future__ import annotations

import pytest
import torch

import mm3lab
from mm3lab import synthetic
from mm3lab.indexer import analysis

SEQ_LEN = 768  # 6 blocks


@pytest.mark.parametrize(("init_blocks", "local_blocks"), [(0, 1), (1, 1), (2, 3), (0, 0)])
@pytest.mark.parametrize("pattern", ["needle", "random"])
def test_host_forcing_equals_the_kernels_forced_scores(pattern, init_blocks, local_blocks):
    seq = synthetic.make_sequence(pattern, SEQ_LEN, seed=3, num_kv_heads=2, num_q_heads=4, index_dim=16, head_dim=16)
    pos = analysis.default_positions(SEQ_LEN, 12)
    sel = analysis.select_for_sequence(seq, 4, init_blocks, local_blocks, positions=pos)
    nb = seq.num_blocks
    table = torch.arange(nb, dtype=torch.int32).view(1, nb)
    cache = mm3lab.allocate_index_cache(nb, seq.index_dim, dtype=seq.index_k.dtype, fill=0.0)
    every = torch.arange(SEQ_LEN)
    mm3lab.insert_index_cache(seq.index_k, cache, mm3lab.token_slots(table, torch.zeros_like(every), every))
    want = mm3lab.index_scores_prefill(
        seq.index_q[pos], cache, table, torch.zeros_like(pos), pos, init_blocks, local_blocks, forced=True
    )
    assert torch.equal(sel.forced, want)
