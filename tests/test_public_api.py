"""SPEC section 6: the names that must stay importable, at the top level, in mm3lab.reference and in compat."""

from __future__ import annotations

import inspect

import pytest

import mm3lab
from mm3lab import reference
from mm3lab._twin import twin_of
from mm3lab.compat import vllm

TOP_LEVEL = [
    "build_sparse_block_table_decode",
    "build_sparse_block_table_prefill",
    "insert_index_cache",
    "index_topk_decode",
    "index_topk_prefill",
    "sparse_attention",
    "sides_are_packed",
    "sparse_block_page_stride",
    "rebase_block_table_to_page16",
    "rebase_slot_mapping_to_page16",
    "msa_decode",
    "msa_prefill",
]
CONSTANTS = {"SPARSE_BLOCK_SIZE": 128, "PAGE_SIZE": 16, "PAGES_PER_SPARSE_BLOCK": 8, "PAGE16_SIDES_PER_BLOCK": 2}
VLLM = [
    "minimax_m3_build_sparse_block_table_decode",
    "minimax_m3_build_sparse_block_table_prefill",
    "minimax_m3_insert_index_cache",
    "minimax_m3_rebase_block_table_to_page16",
    "minimax_m3_sparse_block_page_stride",
]
KERNEL_CHOICE = {"algorithm"}  # which kernel runs (sparse_attention): the reference has one path


@pytest.mark.parametrize("name", TOP_LEVEL)
def test_every_entry_point_has_a_reference_twin_with_the_same_signature(name):
    public, twin = getattr(mm3lab, name), getattr(reference, name)
    assert callable(public) and callable(twin)
    public_params = [p for p in inspect.signature(public).parameters if p not in KERNEL_CHOICE]
    assert public_params == list(inspect.signature(twin).parameters)
    # defaults, keyword-only markers and annotations too: the twin takes them from the entry point
    public_signature = inspect.signature(public)
    kept = [p for name, p in public_signature.parameters.items() if name not in KERNEL_CHOICE]
    assert inspect.signature(twin) == public_signature.replace(parameters=kept)


def test_a_twin_is_called_with_its_entry_points_defaults():
    @twin_of("mm3lab.block_table")
    def build_sparse_block_table_decode(topk_idx, block_table, seq_lens, decode_query_len, block_page_stride, out):
        return locals()

    seen = build_sparse_block_table_decode("t", "b", seq_lens="s")
    defaults = {"decode_query_len": 1, "block_page_stride": 8, "out": None}
    assert seen == {"topk_idx": "t", "block_table": "b", "seq_lens": "s", **defaults}
    with pytest.raises(TypeError, match="too many positional arguments"):
        build_sparse_block_table_decode("t", "b", "s", 1, 8, None)  # out is keyword-only at the entry point


def test_a_twin_that_names_other_parameters_is_refused():
    with pytest.raises(TypeError, match="not parameters of mm3lab.attention.sparse_attention in its order"):

        @twin_of("mm3lab.attention")
        def sparse_attention(q, scale, k_cache):
            pass


@pytest.mark.parametrize("name,value", sorted(CONSTANTS.items()))
def test_constants(name, value):
    assert getattr(mm3lab, name) == value
    assert getattr(reference, name) == value


@pytest.mark.parametrize("name", VLLM)
def test_vllm_names(name):
    assert callable(getattr(vllm, name))


def test_spec_parameter_names_and_defaults():
    sig = inspect.signature(mm3lab.build_sparse_block_table_decode)
    assert sig.parameters["decode_query_len"].default == 1
    assert sig.parameters["block_page_stride"].default == 8
    sig = inspect.signature(mm3lab.index_topk_decode)
    assert list(sig.parameters)[:5] == ["index_q", "index_cache", "block_table", "seq_lens", "topk"]
    assert sig.parameters["init_blocks"].default == 0 and sig.parameters["local_blocks"].default == 1
    sig = inspect.signature(mm3lab.sparse_attention)
    assert list(sig.parameters)[:6] == ["q", "k_cache", "v_cache", "sparse_bt", "sparse_ctx", "scale"]
    assert sig.parameters["scale"].default is None
