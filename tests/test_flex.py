"""FlexAttention with ``mm3lab.interop.flex.block_mask`` matches ``sparse_attention`` (SPEC sections 5, 10)."""

from __future__ import annotations

import pytest
import torch
from test_attention import make_case
from test_attention_tiled import make_chunk_case

import mm3lab
from mm3lab.interop import flex
from mm3lab.testing import assert_close

pytest.importorskip("torch.nn.attention.flex_attention")


def check_flex(case, decode_query_len=None, atol=2e-5, rtol=2e-5):
    hq = case.q.shape[1]
    seq_lens = case.seq_lens.tolist()
    if decode_query_len is None:
        mask = flex.block_mask(case.topk_idx, case.query_req_id, case.query_abs_pos, seq_lens, num_q_heads=hq)
    else:
        mask = flex.block_mask_decode(case.topk_idx, seq_lens, num_q_heads=hq, decode_query_len=decode_query_len)
    key = torch.nan_to_num(case.key)
    value = torch.nan_to_num(case.value)
    out_f, lse_f = flex.flex_sparse_attention(case.q, key, value, mask, seq_lens, return_lse=True)
    out_s, lse_s = mm3lab.sparse_attention(*case.args, return_lse=True)
    assert_close(out_f, out_s, atol=atol, rtol=rtol, name="flex vs sparse_attention")
    empty = torch.isinf(lse_s.cpu())
    assert torch.equal(torch.isinf(lse_f.cpu()), empty)
    assert_close(lse_f.cpu().masked_fill(empty, 0), lse_s.cpu().masked_fill(empty, 0), atol=1e-4, rtol=rtol)
    if empty.any():  # fully masked rows: zeros from both
        assert torch.equal(out_f.cpu()[empty], torch.zeros_like(out_f.cpu()[empty]))


@pytest.mark.parametrize("layout", ["dense", "packed"])
@pytest.mark.parametrize("dql", [1, 3])
def test_decode_forms_match(device, layout, dql):
    case = make_case(device, layout, "decode", (2, 2, 32), seq_lens=[300, 2, 141], seed=11 + dql, dql=dql)
    check_flex(case, decode_query_len=dql)
    check_flex(case)


@pytest.mark.parametrize("overlap", [1.0, 0.3])
def test_prefill_chunk_matches(device, overlap):
    """A multi-request chunk with a tail mid-page, duplicates and padded rows."""
    case = make_chunk_case(
        device, "packed", (2, 2, 32), [270, 1, 150], [140, 1, 9], overlap=overlap, seed=4, pad_rows=2
    )
    check_flex(case)


def test_random_prefill_rows_match(device):
    case = make_case(device, "dense", "prefill", (1, 4, 16), seq_lens=[300, 129], topk=2, seed=9, rows=20, pad_rows=3)
    check_flex(case)


def test_block_mask_lists_blocks():
    """Block level: query tile 0 touches exactly the selected blocks; a fully visible block is 'full'."""
    topk = torch.tensor([[[0, 1], [0, -1], [1, 1]]], dtype=torch.int32)  # 1 KV head, 3 rows
    req = torch.zeros(3, dtype=torch.int32)
    pos = torch.tensor([200, 5, -1], dtype=torch.int32)
    sel = flex.selected_blocks(topk, req, pos, [256])
    assert sel[0].tolist() == [[True, True], [True, False], [False, False]]
    mask = flex.block_mask(topk, req, pos, [256], num_q_heads=2)
    assert mask.kv_num_blocks.tolist() == [[[2], [2]]]  # both partial (row 1 sees block 0 only up to 5)
    assert mask.full_kv_num_blocks.tolist() == [[[0], [0]]]
