"""The value checks that the attention kernels run themselves (``sparse_attention_kernel(check=...)``, and
``tiled_attention_kernel(check=...)`` in its fused pre-pass).

A repeated eager ``sparse_attention`` call (``mm3lab._replay.Memo``) with validation on and a new
output checks its values inside the attention launch: every program flags the ctx and the used page
ids it reads, and the call reads the flags once after the launch. These tests hold the flags to the
separate value checks (``_detail``, which raises exactly where a check fails) on random tables with
random bad entries, across splits and both layouts (CPU interpreter and GPU), check that the flags
never change the output, and, on the GPU, that a replayed call raises the checks' message with no
check launch of its own.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mm3lab
from mm3lab import _valcheck
from mm3lab.attention import _MEMO, _page_rule, tiled
from mm3lab.attention import kernel as attn_kernel
from mm3lab.attention.checks import _detail
from mm3lab.constants import PAGE_SIZE, PAGES_PER_SPARSE_BLOCK

HKV, G, D = 2, 2, 32


def _table(layout, n, topk, g, device):
    """A good table over a 4-block cache: each row's pages are its blocks' pages, ctx anywhere in the row."""
    cache = mm3lab.allocate_kv_cache(4, HKV, D, layout, device=device)
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=g).to(device))
    stride = cache.block_page_stride
    blocks = torch.randint(0, 4, (HKV, n, topk), generator=g)
    pages = blocks[..., None] * stride + torch.arange(PAGES_PER_SPARSE_BLOCK)
    bt = pages.reshape(HKV, n, topk * PAGES_PER_SPARSE_BLOCK).to(torch.int32)
    ctx = torch.randint(0, topk * 128 + 1, (HKV, n), generator=g).to(torch.int32)
    q = torch.randn(n, HKV * G, D, generator=g)
    return cache, q.to(device), bt.to(device), ctx.to(device)


def _signal(device):
    """``(flags, count, done)`` as a launch with checks takes them (zeros; the counter starts at zero)."""
    return tuple(torch.zeros(n, dtype=torch.int32, device=device) for n in (3, 1, 1))


def _signalled(signal) -> list:
    """The flags of a launch with checks, after checking that it said so once and left its counter at zero."""
    flags, count, done = signal
    assert done.tolist() == [1] and count.tolist() == [0], "the launch's last program signals and resets"
    return flags.tolist()


TILED_LAUNCHES = ("tiled", "tiled-inside", "tiled-rows-inside")


def _attend(cache, q, bt, ctx, splits, out, check=None):
    """One launch of the per-row kernel (``splits`` splits) or, ``splits`` ``"tiled"`` (``"tiled-inside"``),
    of the tiled kernel with its fused pre-pass (one tile of 8 rows: 16 query vectors), its checks a launch of
    their own (in the attention launch); ``"tiled-rows-inside"``: every tile walks its rows, a program per row,
    the checks in that launch."""
    if splits in TILED_LAUNCHES:
        tiled.tiled_attention_kernel(
            q,
            cache.k_cache,
            cache.v_cache,
            bt,
            ctx,
            D**-0.5,
            out,
            None,
            tile_rows=8,
            prepass="fused",
            check=check,
            check_launch="apart" if splits == "tiled" else "inside",
            mode="rows" if splits == "tiled-rows-inside" else "auto",
        )
    else:
        attn_kernel.sparse_attention_kernel(
            q, cache.k_cache, cache.v_cache, bt, ctx, D**-0.5, out, None, num_splits=splits, block_n=32, check=check
        )


def _flags(cache, q, bt, ctx, splits):
    """``(flags, out)`` of one launch with the checks on."""
    signal = _signal(q.device)
    out = torch.zeros_like(q)
    _attend(cache, q, bt, ctx, splits, out, (signal, *_page_rule(cache.block_page_stride)))
    flags = _signalled(signal)
    assert flags[2] == 0
    return flags[:2], out


def _detail_raises(cache, bt, ctx) -> bool:
    try:
        _detail(cache.k_cache, cache.v_cache, bt, ctx, cache.block_page_stride)
    except ValueError:
        return True
    return False


def _spoil(bt, ctx, cache, spoils, g):
    """Bad entries: ``("ctx", h, n, value)`` or ``("page", h, n, column, kind)``, kind 0 past the cache,
    1 negative, 2 a V page id in the packed layout (``block * 16 + 8..15``)."""
    bt, ctx = bt.clone(), ctx.clone()
    width = bt.shape[2]
    for spoil in spoils:
        if spoil[0] == "ctx":
            _, h, n, value = spoil
            ctx[h % HKV, n % ctx.shape[1]] = value
        else:
            _, h, n, col, kind = spoil
            page = [cache.k_cache.shape[0] + col, -1 - col, 16 * (col % 3) + 8 + col % 8][kind]
            bt[h % HKV, n % bt.shape[1], col % width] = page
            if col % 2:  # the row reads the spoiled page (else where its ctx says)
                ctx[h % HKV, n % bt.shape[1]] = width * PAGE_SIZE
    return bt, ctx


SPOILS = st.lists(
    st.one_of(
        st.tuples(st.just("ctx"), st.integers(0, 1), st.integers(0, 2), st.sampled_from([-1, -(2**31), 385, 10**6])),
        st.tuples(st.just("page"), st.integers(0, 1), st.integers(0, 2), st.integers(0, 23), st.integers(0, 2)),
    ),
    max_size=3,
)


@settings(max_examples=40, deadline=None)
@given(
    layout=st.sampled_from(["dense", "packed"]),
    n=st.integers(1, 3),
    topk=st.integers(1, 3),
    splits=st.sampled_from([1, 2, 3]),
    seed=st.integers(0, 2**16),
    spoils=SPOILS,
)
def test_the_kernel_flags_exactly_what_the_value_checks_reject_cpu(layout, n, topk, splits, seed, spoils):
    _flags_match_the_checks("cpu", layout, n, topk, splits, seed, spoils)


@settings(max_examples=15, deadline=None)
@given(
    layout=st.sampled_from(["dense", "packed"]),
    n=st.integers(1, 3),
    topk=st.integers(1, 3),
    seed=st.integers(0, 2**16),
    spoils=SPOILS,
    launch=st.sampled_from(TILED_LAUNCHES),
)
def test_the_tiled_kernel_flags_exactly_what_the_value_checks_reject_cpu(layout, n, topk, seed, spoils, launch):
    _flags_match_the_checks("cpu", layout, n, topk, launch, seed, spoils)


SINGLE_SPOILS = [
    ("ctx", 0, 0, -1),
    ("ctx", 1, 2, 385),
    ("ctx", 1, 1, -(2**31)),
    ("page", 0, 1, 1, 0),  # past the cache, read
    ("page", 1, 2, 3, 1),  # negative, read
    ("page", 0, 0, 5, 2),  # a V page id (packed: bad; dense: a K page, good)
    ("page", 1, 0, 4, 0),  # past the cache where the row's ctx decides whether it is read
]


@pytest.mark.parametrize("spoil", SINGLE_SPOILS)
@pytest.mark.parametrize("layout", ["dense", "packed"])
@pytest.mark.parametrize("splits", [1, 3, *TILED_LAUNCHES])
def test_each_kind_of_bad_entry_is_flagged_where_it_is_read(device, layout, splits, spoil):
    _flags_match_the_checks(device, layout, 3, 3, splits, 11, [spoil])


@pytest.mark.parametrize("launch", TILED_LAUNCHES)
@pytest.mark.parametrize("spoil", SINGLE_SPOILS[::2])
def test_one_checker_program_checks_the_whole_tiled_launch(device, spoil, launch, monkeypatch):
    """One checker program checks every row (apart: the check launch's only program; inside: the first
    program of the tiled launch, the others only attend)."""
    monkeypatch.setattr(tiled, "CHECKERS", 1)
    _flags_match_the_checks(device, "packed", 3, 3, launch, 5, [spoil])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("launch", TILED_LAUNCHES)
@pytest.mark.parametrize("checkers", [1, 3, 128])
def test_tiled_checkers_share_many_chunks(checkers, launch, monkeypatch):
    """Many rows (several chunks per checker, more programs than checkers): each spoiled entry is found."""
    monkeypatch.setattr(tiled, "CHECKERS", checkers)
    for case, spoil in enumerate([("ctx", 1, 517, 10**6), ("page", 0, 333, 7, 0), ("page", 1, 598, 2, 1), None]):
        _flags_match_the_checks("cuda", ["dense", "packed"][case % 2], 600, 2, launch, case, [spoil] if spoil else [])


def _flags_match_the_checks(device, layout, n, topk, splits, seed, spoils):
    g = torch.Generator().manual_seed(seed)
    cache, q, bt, ctx = _table(layout, n, topk, g, device)
    bad_bt, bad_ctx = _spoil(bt, ctx, cache, spoils, g)
    flags, out = _flags(cache, q, bad_bt, bad_ctx, splits)
    assert bool(any(flags)) == _detail_raises(cache, bad_bt, bad_ctx), (flags, spoils)
    width = bt.shape[2] * PAGE_SIZE
    assert flags[0] == int(bool(((bad_ctx < 0) | (bad_ctx > width)).any()))
    with mm3lab.validation(False):  # the same launch without the checks: the same output
        want = torch.zeros_like(q)
        _attend(cache, q, bad_bt, bad_ctx, splits, want)
    assert torch.equal(out, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_kernel_flags_exactly_what_the_value_checks_reject_cuda():
    rng = torch.Generator().manual_seed(7)
    for case in range(60):
        spoils = []
        for _ in range(int(torch.randint(0, 4, (1,), generator=rng))):
            r = torch.randint(0, 2**20, (5,), generator=rng).tolist()
            if r[0] % 2:
                spoils.append(("ctx", r[1], r[2], [-1, -(2**31), 385, 10**6][r[3] % 4]))
            else:
                spoils.append(("page", r[1], r[2], r[3] % 24, r[4] % 3))
        layout = ["dense", "packed"][case % 2]
        splits = [1, 2, 3, *TILED_LAUNCHES][case % 6]
        _flags_match_the_checks("cuda", layout, 1 + case % 3, 1 + case % 3, splits, case, spoils)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("algorithm", [None, "tiled"])
@pytest.mark.parametrize("layout", ["dense", "packed"])
def test_a_replayed_checked_call_checks_inside_its_launch(layout, algorithm, monkeypatch):
    _MEMO.clear()
    g = torch.Generator().manual_seed(1)
    cache, q, bt, ctx = _table(layout, 3, 4, g, "cuda")
    args = (q, cache.k_cache, cache.v_cache)
    if algorithm == "tiled":  # the tiled kernel as the automatic choice runs it (its fused pre-pass checks)
        monkeypatch.setattr(mm3lab.attention, "TILED_MIN_ROWS", 2)
    first = mm3lab.sparse_attention(*args, bt, ctx)
    _valcheck.reset_stats()
    again = mm3lab.sparse_attention(*args, bt, ctx)
    assert torch.equal(first, again)
    assert _valcheck.stats() == {"launches": 0, "host_reads": 1}  # checked in the attention launch
    (entry,) = _MEMO._entries().values()
    assert entry.recording.replays == 1 and entry.info[1] is not None
    spoiled = [
        (("page", 1, 2, 0, 0), r"sparse_bt: \(head 1, row 2\) entry 0"),
        (("page", 0, 1, 5, 1), r"sparse_bt: \(head 0, row 1\) entry 5"),
        (("ctx", 0, 1, 10**6), r"sparse_ctx: \(head 0, row 1\)"),
        (("ctx", 1, 0, -3), r"sparse_ctx: \(head 1, row 0\)"),
    ]
    if layout == "packed":
        spoiled.append((("page", 1, 0, 2, 2), r"not a K page"))
    for spoil, match in spoiled:
        bad_bt, bad_ctx = _spoil(bt, ctx, cache, [spoil], g)
        if spoil[0] == "page":  # the spoiled page is read
            bad_ctx[spoil[1], spoil[2]] = bt.shape[2] * PAGE_SIZE
        with pytest.raises(ValueError, match=match):
            mm3lab.sparse_attention(*args, bad_bt, bad_ctx)
        assert torch.equal(mm3lab.sparse_attention(*args, bt, ctx), first)  # the flags were cleared
    assert entry.recording.replays == 1 + 2 * len(spoiled)
    out = torch.empty_like(q)  # a caller's buffer: checked before the launch (it must stay untouched)
    _valcheck.reset_stats()
    mm3lab.sparse_attention(*args, bt, ctx, out=out)
    mm3lab.sparse_attention(*args, bt, ctx, out=out)
    assert _valcheck.stats() == {"launches": 2, "host_reads": 2}
    poisoned = torch.full_like(q, float("nan"))
    bad_bt, _ = _spoil(bt, ctx, cache, [("page", 0, 0, 0, 0)], g)
    with pytest.raises(ValueError, match="sparse_bt"):
        mm3lab.sparse_attention(*args, bad_bt, ctx.clamp(min=1), out=poisoned)
    assert poisoned.isnan().all()
    with mm3lab.validation(False):
        _valcheck.reset_stats()
        assert torch.equal(mm3lab.sparse_attention(*args, bt, ctx), first)
        assert torch.equal(mm3lab.sparse_attention(*args, bt, ctx), first)
        assert _valcheck.stats() == {"launches": 0, "host_reads": 0}


# ----------------------------------------------------------------------------
# the decode block table's launch (build_sparse_block_table_decode)
# ----------------------------------------------------------------------------


def _decode_table_case(g, dql, device, b=2, m=5, k=4):
    topk = torch.randint(-1, m, (HKV, b * dql, k), generator=g).to(torch.int32)
    block_table = torch.randint(0, 50, (b, m), generator=g).to(torch.int32)
    seq_lens = torch.randint(dql, m * 128 + 1, (b,), generator=g).to(torch.int32)
    return topk.to(device), block_table.to(device), seq_lens.to(device)


def _table_flags(topk, block_table, seq_lens, dql, stride):
    from mm3lab.block_table import kernel as table_kernel
    from mm3lab.block_table.checks import _physical_id_range

    h, n, k = topk.shape
    signal = _signal(topk.device)
    g = torch.Generator().manual_seed(h * 100 + n)
    old = (
        torch.randint(-9, 9, (h, n, k * 8), generator=g, dtype=torch.int32).to(topk.device),
        torch.randint(-9, 9, (h, n), generator=g, dtype=torch.int32).to(topk.device),
    )
    out = (old[0].clone(), old[1].clone())
    backup = (torch.zeros_like(out[0]), torch.zeros_like(out[1]))
    plain = (torch.empty_like(out[0]), torch.empty_like(out[1]))
    table_kernel.build_sparse_block_table_decode_kernel(topk, block_table, seq_lens, dql, stride, *plain)
    keep = stride == 16  # (with and without keeping what the launch overwrites)
    check = (signal, *_physical_id_range(stride), *([backup] if keep else []))
    table_kernel.build_sparse_block_table_decode_kernel(topk, block_table, seq_lens, dql, stride, *out, check=check)
    assert torch.equal(out[0], plain[0]) and torch.equal(out[1], plain[1])  # the checks change nothing built
    if keep:
        assert torch.equal(backup[0], old[0]) and torch.equal(backup[1], old[1])  # what it overwrote, kept
    else:
        assert not backup[0].any() and not backup[1].any()
    return _signalled(signal)


def _table_checks_raise(topk, block_table, seq_lens, stride) -> bool:
    from mm3lab.block_table.checks import check_decode_values

    try:
        check_decode_values(topk, block_table, seq_lens, stride)
    except ValueError:
        return True
    return False


TABLE_SPOILS = [
    None,
    ("seq_len", 1, 5 * 128 + 1),
    ("seq_len", 0, 10**9),
    ("seq_len", 0, -5),  # a negative seq_len reads nothing: not a value error here
    ("topk", 1, 0, 2, 5),  # an id == M
    ("topk", 0, 1, 0, 10**6),
    ("entry", 0, 0, 2**28),  # page ids past int32 (x 8 or x 16), used when seq_len reaches block 0
    ("entry", 1, 4, -(2**29)),  # the last entry: used only where seq_len reaches it
]


@pytest.mark.parametrize("spoil", TABLE_SPOILS)
@pytest.mark.parametrize("dql", [1, 3])
@pytest.mark.parametrize("stride", [8, 16])
def test_the_table_launch_flags_exactly_what_the_value_checks_reject(device, spoil, dql, stride):
    g = torch.Generator().manual_seed(3)
    topk, block_table, seq_lens = _decode_table_case(g, dql, device)
    if spoil is not None:
        if spoil[0] == "seq_len":
            seq_lens[spoil[1]] = spoil[2]
        elif spoil[0] == "topk":
            topk[spoil[1], spoil[2], spoil[3]] = spoil[4]
        else:
            block_table[spoil[1], spoil[2]] = spoil[3]
    flags = _table_flags(topk, block_table, seq_lens, dql, stride)
    assert bool(any(flags)) == _table_checks_raise(topk, block_table, seq_lens, stride), (flags, spoil)
    if spoil is not None and spoil[0] == "entry" and spoil[2] == 4:  # now make sure it is read
        seq_lens[spoil[1]] = 5 * 128
        flags = _table_flags(topk, block_table, seq_lens, dql, stride)
        assert flags == [0, 0, 1] and _table_checks_raise(topk, block_table, seq_lens, stride)


def _gpu_table_case(seed: int, spread: int):
    """A fresh table memo (returned) and a decode table case on the GPU whose requests use all 5 blocks."""
    from mm3lab.block_table import _MEMO as TABLE_MEMO

    TABLE_MEMO.clear()
    topk, block_table, seq_lens = _decode_table_case(torch.Generator().manual_seed(seed), spread, "cuda")
    seq_lens.fill_(5 * 128)
    return TABLE_MEMO, topk, block_table, seq_lens


def _spoiled(topk, block_table, seq_lens, what, seq_len, topk_at, entry_at):
    """Copies of the case with one bad value: ``seq_len`` (``(request, value)``), ``topk`` (block 5 at ``topk_at``),
    ``entry`` (a block-table entry past every cache at ``entry_at``); ``None``: unchanged copies."""
    t, bt, sl = topk.clone(), block_table.clone(), seq_lens.clone()
    if what == "seq_len":
        sl[seq_len[0]] = seq_len[1]
    elif what == "topk":
        t[topk_at] = 5
    elif what == "entry":
        bt[entry_at] = 2**29
    return t, bt, sl


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_replayed_checked_table_call_checks_inside_its_launch():
    TABLE_MEMO, topk, block_table, seq_lens = _gpu_table_case(5, 2)
    first = mm3lab.build_sparse_block_table_decode(topk, block_table, seq_lens, 2)
    _valcheck.reset_stats()
    again = mm3lab.build_sparse_block_table_decode(topk, block_table, seq_lens, 2)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert _valcheck.stats() == {"launches": 0, "host_reads": 1}
    (entry,) = TABLE_MEMO._entries().values()
    assert entry.recording.replays == 1 and entry.info[0] is not None and entry.info[1] is None
    cases = [
        ("seq_len", r"seq_lens: request 1 has seq_len 641"),
        ("topk", r"topk_idx: head 1, row 3 selects block 5"),
        ("entry", r"block_table"),
    ]
    for what, match in cases:
        t, bt, sl = _spoiled(topk, block_table, seq_lens, what, (1, 641), (1, 3, 0), (0, 4))
        with pytest.raises(ValueError, match=match):
            mm3lab.build_sparse_block_table_decode(t, bt, sl, 2)
        again = mm3lab.build_sparse_block_table_decode(topk, block_table, seq_lens, 2)  # the flags were cleared
        assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert entry.recording.replays == 1 + 2 * len(cases)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_replayed_checked_table_call_into_a_callers_buffers_restores_them_when_rejected():
    TABLE_MEMO, topk, block_table, seq_lens = _gpu_table_case(6, 1)
    want = mm3lab.build_sparse_block_table_decode(topk, block_table, seq_lens)
    out = (torch.empty_like(want[0]), torch.empty_like(want[1]))
    mm3lab.build_sparse_block_table_decode(topk, block_table, seq_lens, out=out)  # recorded
    (entry,) = [e for e in TABLE_MEMO._entries().values() if e.info[1] is not None]
    for what in ("seq_len", "topk", "entry", None):
        t, bt, sl = _spoiled(topk, block_table, seq_lens, what, (0, 10**6), (0, 1, 0), (1, 4))
        poisoned = (torch.full_like(want[0], -7), torch.full_like(want[1], 3))
        for i in range(2):
            out[i].copy_(poisoned[i])
        _valcheck.reset_stats()
        if what is None:
            got = mm3lab.build_sparse_block_table_decode(t, bt, sl, out=out)
            assert got[0] is out[0] and torch.equal(out[0], want[0]) and torch.equal(out[1], want[1])
            assert _valcheck.stats() == {"launches": 0, "host_reads": 1}  # checked inside the table's launch
        else:
            with pytest.raises(ValueError):
                mm3lab.build_sparse_block_table_decode(t, bt, sl, out=out)
            # the launch wrote the table, then the call put the caller's buffers back before raising
            assert torch.equal(out[0], poisoned[0]) and torch.equal(out[1], poisoned[1]), what
    assert entry.recording.replays == 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_waiting_for_a_done_word_that_never_comes_falls_back_to_a_sync():
    device = torch.device("cuda")
    bufs = _valcheck._flags_buffers(device)
    torch.cuda._sleep(10**6)  # (queued work: the fallback waits for it)
    assert _valcheck.wait_done(bufs, device) == [0] * _valcheck.DONE
    assert bufs.view.tolist() == [0] * (_valcheck.DONE + 1)
