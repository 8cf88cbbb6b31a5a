"""Cheap validation (SPEC section 7): a call's value checks cost one launch and one host read.

* the Triton check kernel (interpreted here, compiled on a GPU) and the PyTorch evaluation give
  the same flags over random segments of every kind;
* every public entry point with value checks does at most one check launch and one host read
  per call with validation on, and none with it off (``mm3lab._valcheck.stats()``);
* bad values are still rejected, with the detailed message, when the kernel does the check.
"""

from __future__ import annotations

import pytest
import torch
import triton
from hypothesis import given, settings
from hypothesis import strategies as st
from test_bad_calls import ENTRY, _layer

import mm3lab
from mm3lab import _valcheck, reference
from mm3lab._valcheck import Segment
from mm3lab.compat import vllm

# --- the kernel gives the PyTorch evaluation's flags -------------------------------------------


def _ints(g, lo, hi, *shape, dtype=torch.int32):
    return torch.randint(lo, hi, shape, generator=g, dtype=dtype)


def _segments(seed: int, bad: float):
    """Random segments of every kind; ``bad`` widens the value ranges past the bounds."""
    g = torch.Generator().manual_seed(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    b, m, n = (
        int(x)
        for x in torch.randint(0, 5, (1,), generator=gen).tolist() + torch.randint(0, 40, (2,), generator=gen).tolist()
    )
    over = int(bad * 8)
    bt = _ints(g, -over, 10 + over, b, m)
    req = _ints(g, -1 - over, b + over + 1, n)
    pos = _ints(g, -3, max(m, 1) * 128 + 64 * over, n, dtype=torch.int64)
    h, w = 1 + seed % 3, seed % 33
    sbt = _ints(g, -over, 40 + over, n, h, w).transpose(0, 1)  # non-contiguous [H, N, W]
    ctx = _ints(g, -over, w * 16 + 1 + over, h, n, dtype=torch.int64)
    return [
        Segment("gather", bt, lo=0, hi=9, aux=req, pos=pos, unit=128),
        Segment("gather_last", bt, lo=0, hi=9, aux=req, pos=pos, unit=128),
        Segment("len", sbt, lo=0, hi=39, aux=ctx, unit=16, modulus=16, mod_limit=8 + (seed % 9)),
        Segment("live" if seed % 2 else "all", req, lo=0, hi=b - 1, aux=pos),
    ]


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), bad=st.sampled_from([0.0, 0.2, 1.0]))
def test_kernel_flags_match_torch(seed, bad):
    segments = _segments(seed, bad)
    for i in range(len(segments)):  # each segment alone, then all four in one launch
        subset = segments[i : i + 1] if i < len(segments) - 1 else segments
        want = _valcheck.flags(*subset)
        with _valcheck.kernel_on_cpu():
            got = _valcheck.flags(*subset)
        assert got == want


def test_kernel_flags_on_device(device):
    """The compiled kernel on a GPU (and the PyTorch evaluation on the CPU) against the CPU flags."""
    for seed in range(6):
        segments = _segments(seed, 0.2)
        want = _valcheck.flags(*segments)
        assert _valcheck.flags(*_moved(segments, device)) == want


def _moved(segments, device):
    return [
        Segment(
            s.kind,
            s.t.to(device),
            s.lo,
            s.hi,
            None if s.aux is None else s.aux.to(device),
            None if s.pos is None else s.pos.to(device),
            s.unit,
            s.modulus,
            s.mod_limit,
        )
        for s in segments
    ]


def test_flags_buffer_is_zero_again_after_a_flagged_call(device):
    """The flags buffer is kept from call to call: a flagged call must not leave a flag for the next one."""
    bad = [Segment("all", torch.tensor([0, 7, 3], dtype=torch.int32, device=device), lo=0, hi=5)]
    good = [Segment("all", torch.tensor([0, 5, 3], dtype=torch.int32, device=device), lo=0, hi=5)]
    with _valcheck.kernel_on_cpu():
        for _ in range(2):
            assert _valcheck.flags(*bad) == [1, 0]
            assert _valcheck.flags(*good) == [0, 0]


@pytest.mark.parametrize("fast", [False, True])
def test_direct_launch_gives_the_launch_path_flags(device, fast, monkeypatch):
    """On a GPU the check kernel, once compiled for a combination of constexprs and dtypes, is launched
    through its launcher directly; its flags equal Triton's own launch's and the PyTorch evaluation's."""
    monkeypatch.setattr(_valcheck, "FAST_LAUNCH", fast)
    monkeypatch.setattr(_valcheck, "_compiled", {})
    for seed in range(8):
        for bad in (0.0, 1.0):
            segments = _segments(seed, bad)
            moved = _moved(segments, device)
            for part in (slice(None), slice(2)):  # a second combination of segment kinds
                want = _valcheck.flags(*segments[part])
                with _valcheck.kernel_on_cpu():
                    assert _valcheck.flags(*moved[part]) == want
    if device == "cuda":
        assert bool(_valcheck._compiled) == (fast and _valcheck._replay.supported())


def test_a_kept_check_launch_reads_the_values_of_each_call(device):
    """:func:`flags_known`: a key's first call builds its segments (and, on a GPU, keeps the direct
    launch); a repeat of the key launches the kept arguments without building them, and its flags
    are those of the tensors' contents at that call (changed in place: flagged; fixed: clear).
    Elsewhere (the CPU, key ``None``) every call builds them. Same flags as :func:`flags` throughout."""
    seq_lens = torch.tensor([5, 130, 9], dtype=torch.int32, device=device)
    table = torch.tensor([[0, 1], [2, 3], [4, 9]], dtype=torch.int32, device=device)
    built = []

    def segments():
        built.append(1)
        return [Segment("all", seq_lens, lo=0, hi=256), Segment("len", table, lo=0, hi=8, aux=seq_lens, unit=128)]

    kept = device == "cuda" and _valcheck._replay.supported()
    with _valcheck.kernel_on_cpu():
        for key in ("a step", None):
            # (the first launch of a kernel combination is Triton's own, the next a direct one, which is kept)
            for _ in range(2):
                assert _valcheck.flags_known(key, segments) == [0, 0, 0, 0]
            built.clear()
            assert _valcheck.flags_known(key, segments) == [0, 0, 0, 0]
            seq_lens[2] = 200  # row 2 now reads its second block, page 9: outside [0, 8]
            assert _valcheck.flags_known(key, segments) == [0, 0, 1, 0]
            seq_lens[0] = -1
            assert _valcheck.flags_known(key, segments) == [1, 0, 1, 0]
            seq_lens[0], seq_lens[2] = 5, 9
            assert _valcheck.flags_known(key, segments) == [0, 0, 0, 0]
            assert len(built) == (0 if kept and key is not None else 4)
            seq_lens[2] = 200
            assert _valcheck.flags(*segments()) == [0, 0, 1, 0]
            seq_lens[2] = 9


def test_int64_extremes_and_empty_segments():
    big = torch.tensor([0, 2**62, -(2**62)], dtype=torch.int64)
    for force in (False, True):
        with _valcheck.kernel_on_cpu(force):
            assert _valcheck.flags(Segment("all", big, lo=-(2**62), hi=2**62)) == [0, 0]
            assert _valcheck.flags(Segment("all", big, hi=2**62 - 1)) == [1, 0]
            assert _valcheck.flags(Segment("all", big, lo=-(2**62) + 1)) == [1, 0]
            assert _valcheck.flags(Segment("all", big[:0], hi=-1)) == []


def test_segment_rejects_unknown_kind():
    with pytest.raises(ValueError, match="kind"):
        Segment("rows", torch.zeros(1, dtype=torch.int32))


# --- one host read per call ---------------------------------------------------------------------


def _attention_args(device):
    a = _layer(device)
    sbt = torch.tensor([[[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]]], dtype=torch.int32, device=device)
    ctx = torch.tensor([[100, 128]], dtype=torch.int32, device=device)
    return (a["q"], a["k_cache"], a["v_cache"], sbt, ctx), {}


def _entry_args(name):
    def make(device):
        e = ENTRY[name]
        a = _layer(device)
        return tuple(a[k] for k in e.args), dict(e.kwargs)

    return make


def _prefill_table_args(fn):
    def make(device):
        a = _layer(device)
        return (a["topk_idx"], a["block_table"], a["query_req_id"], a["query_abs_pos"]), {}

    return make


def _index_args(prefill):
    def make(device):
        a = _layer(device)
        rows = (a["query_req_id"], a["query_abs_pos"]) if prefill else (a["seq_lens"],)
        return (a["index_q"], a["index_cache"], a["block_table"], *rows), {"topk": 2}

    return make


def _plan_run(prefill):
    """``plan.run`` of a decode / prefill plan built outside the counted call."""

    def make(device):
        a = _layer(device)
        caches = (a["k_cache"], a["v_cache"], a["index_cache"])
        kw = {"batch": 2, "max_blocks": 3, "num_q_heads": 16, "topk": 2}
        if prefill:
            plan = mm3lab.MSAPrefillPlan(*caches, num_tokens=2, **kw)
            rows = (a["query_req_id"], a["query_abs_pos"])
        else:
            plan = mm3lab.MSADecodePlan(*caches, **kw)
            rows = (a["seq_lens"],)
        return (plan, a["q"], a["key"], a["value"], a["index_q"], a["index_k"], *caches, a["block_table"], *rows), {}

    return make


def _call_plan(plan, *args):
    return plan.run(*args)


CALLS = {
    "MSADecodePlan.run": (_call_plan, _plan_run(False)),
    "MSAPrefillPlan.run": (_call_plan, _plan_run(True)),
    "sparse_attention": (mm3lab.sparse_attention, _attention_args),
    "reference.sparse_attention": (reference.sparse_attention, _attention_args),
    "build_sparse_block_table_decode": (
        mm3lab.build_sparse_block_table_decode,
        _entry_args("build_sparse_block_table_decode"),
    ),
    "build_sparse_block_table_prefill": (mm3lab.build_sparse_block_table_prefill, _prefill_table_args(None)),
    "vllm.build_sparse_block_table_decode": (
        vllm.minimax_m3_build_sparse_block_table_decode,
        _entry_args("vllm.build_sparse_block_table_decode"),
    ),
    "index_topk_decode": (mm3lab.index_topk_decode, _index_args(False)),
    "index_topk_prefill": (mm3lab.index_topk_prefill, _index_args(True)),
    "reference.index_topk_decode": (reference.index_topk_decode, _index_args(False)),
    "index_topk_block_table_decode": (mm3lab.index_topk_block_table_decode, _index_args(False)),
    "index_topk_block_table_prefill": (mm3lab.index_topk_block_table_prefill, _index_args(True)),
    "insert_index_cache": (mm3lab.insert_index_cache, _entry_args("insert_index_cache")),
    "write_kv_page16": (mm3lab.write_kv_page16, _entry_args("write_kv_page16")),
    "token_slots": (mm3lab.token_slots, _entry_args("token_slots")),
    "msa_decode": (mm3lab.msa_decode, _entry_args("msa_decode")),
    "msa_prefill": (mm3lab.msa_prefill, _entry_args("msa_prefill")),
    "dense_decode": (mm3lab.dense_decode, _entry_args("dense_decode")),
    "dense_prefill": (mm3lab.dense_prefill, _entry_args("dense_prefill")),
}


@pytest.mark.parametrize("validate", [True, False], ids=["validation-on", "validation-off"])
@pytest.mark.parametrize("name", list(CALLS))
def test_one_host_read_per_call(name, validate, device):
    fn, make = CALLS[name]
    args, kwargs = make(device)
    with mm3lab.validation(validate):
        _valcheck.reset_stats()
        fn(*args, **kwargs)
        counts = _valcheck.stats()
    if validate:
        assert counts == {"launches": 1, "host_reads": 1}, counts
    else:
        assert counts == {"launches": 0, "host_reads": 0}, counts


def test_msa_decode_return_intermediates_reads_once(device):
    args, kwargs = _entry_args("msa_decode")(device)
    _valcheck.reset_stats()
    mm3lab.msa_decode(*args, **kwargs, return_intermediates=True)
    assert _valcheck.stats()["host_reads"] == 1


def test_rebase_bound_runs_with_validation_off(device):
    """SPEC 7: a page id that would wrap is a wrong answer, so this bound is checked either way (one read)."""
    bt = torch.tensor([[0, 2**30]], dtype=torch.int32, device=device)
    with mm3lab.validation(False):
        _valcheck.reset_stats()
        with pytest.raises(ValueError, match="block_table"):
            mm3lab.rebase_block_table_to_page16(bt)
        assert _valcheck.stats()["host_reads"] == 1


# --- bad values found by the kernel keep their detailed messages --------------------------------


def test_kernel_path_keeps_messages():
    a = _layer("cpu")
    sbt = torch.tensor([[[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 99]]], dtype=torch.int32)
    ctx = torch.tensor([[100, 128]], dtype=torch.int32)
    with _valcheck.kernel_on_cpu():
        with pytest.raises(ValueError, match=r"sparse_bt: \(head 0, row 1\) entry 7 is page 99"):
            mm3lab.sparse_attention(a["q"], a["k_cache"], a["v_cache"], sbt, ctx)
        with pytest.raises(ValueError, match=r"sparse_ctx: \(head 0, row 0\) is 129"):
            mm3lab.sparse_attention(a["q"], a["k_cache"], a["v_cache"], sbt, ctx + 29)
        seq_lens = torch.tensor([200, 385], dtype=torch.int32)
        with pytest.raises(ValueError, match="seq_lens: request 1 has seq_len 385"):
            mm3lab.index_topk_decode(a["index_q"], a["index_cache"], a["block_table"], seq_lens, 2)


@pytest.mark.parametrize("seed", range(3))
def test_a_signalling_check_launch_says_done_once_every_program_has_checked(device, seed):
    """``_run_kernel(..., signal=(count, done))``: the same flags, ``done`` set to 1 by the last of the
    launch's programs, and the counter back at zero for the next launch (here 19 programs a launch)."""
    g = torch.Generator().manual_seed(seed)
    many_rows = _ints(g, 0, 10 + 3 * seed, 300, 40)  # (a 16 x 64 tile per program: 19 programs)
    segments = [*_segments(seed, 0.2)[:2], Segment("all", many_rows, lo=0, hi=9)]
    segments = [s for s in segments if not _valcheck._empty(s)]  # (as flags() drops them)
    want = _valcheck.flags(*segments)
    moved = _moved(segments, device)
    flags_buf = torch.zeros(_valcheck.DONE + 1, dtype=torch.int32, device=device)
    target = torch.zeros_like(flags_buf)
    count, done = torch.zeros(1, dtype=torch.int32, device=device), torch.zeros(1, dtype=torch.int32, device=device)
    assert triton.cdiv(300, _valcheck.TILE // 64) == 19
    for _ in range(2):
        _valcheck._run_kernel(moved, flags_buf, target, (count, done))
        assert target[: 2 * len(segments)].tolist() == want
        assert done.tolist() == [1] and count.tolist() == [0]
        target.zero_()
        done.zero_()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_check_queued_behind_long_work_is_waited_for_without_a_stream_sync(monkeypatch):
    """A check launch queued behind more than ``SPIN_SECONDS`` of work: the call watches its ``done`` word
    (and the stream's state) until the check has run, and never syncs the stream to wait for it (which
    would also wait for work queued after the check). Good values give clear flags, bad ones their flag."""
    good = [Segment("all", torch.tensor([0, 5, 3], dtype=torch.int32, device="cuda"), lo=0, hi=5)]
    bad = [Segment("all", torch.tensor([0, 7, 3], dtype=torch.int32, device="cuda"), lo=0, hi=5)]
    assert _valcheck.flags(*good) == [0, 0]  # (compiled, launched once)

    def no_sync(*args, **kwargs):
        raise AssertionError("wait_done synced the stream")

    for _ in range(2):
        torch.cuda._sleep(40_000_000)  # (about 20 ms at 2 GHz: ten times SPIN_SECONDS)
        with monkeypatch.context() as m:
            m.setattr(torch.cuda.Stream, "synchronize", no_sync)
            m.setattr(torch.cuda, "synchronize", no_sync)
            assert _valcheck.flags(*good) == [0, 0]
        torch.cuda._sleep(40_000_000)
        assert _valcheck.flags(*bad) == [1, 0]  # (a flagged read drains the stream before it zeroes them)
        assert _valcheck.flags(*good) == [0, 0]


def test_a_flagged_check_raises_the_detailed_message_or_names_the_bug():
    """``raise_flagged``: the detailed checks' own ``ValueError`` where they find the entry; where they find
    nothing that the flags said, a ``RuntimeError`` (the checks disagree), never a silent return."""
    from mm3lab._checks import raise_flagged

    def finds():
        raise ValueError("slot_mapping: row 5 has slot 512")

    with pytest.raises(ValueError, match="row 5"):
        raise_flagged(finds)
    with pytest.raises(RuntimeError, match="its detailed check does not find"):
        raise_flagged(lambda: None)
