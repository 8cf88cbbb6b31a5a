"""The call memos of the indexer entry points, :func:`mm3lab.topk_blocks` and
:func:`mm3lab.insert_index_cache` (``mm3lab._replay.memo_call``): a repeated call shape on a GPU is
checked once and its launches replayed with the call's own tensors in place. Every call is
bit-identical to the normal path, returns its own new outputs, and still runs its value checks
(a bad ``seq_len``, request id, position, table entry or slot put in place after replayed calls is
rejected with its message, and a rejected insert writes nothing). On the CPU the memos never
apply; the recording path (``memo_on_cpu``) must still return what each call computed."""

from __future__ import annotations

import pytest
import torch

import mm3lab
from mm3lab import _replay, reference
from mm3lab.index_cache import _MEMO as INSERT_MEMO
from mm3lab.indexer import _MEMO as INDEXER_MEMO
from mm3lab.indexer import _TOPK_MEMO

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
H, DI, B, M, TOPK = 4, 64, 3, 6, 4
ENTRIES = [
    "index_topk_decode",
    "index_topk_block_table_decode",
    "index_scores_decode",
    "index_topk_prefill",
    "index_topk_block_table_prefill",
    "index_scores_prefill",
]


class _replay_off:
    """Run the enclosed calls with the memos off (the normal path)."""

    def __enter__(self):
        _replay.ENABLED = False

    def __exit__(self, *exc):
        _replay.ENABLED = True


@pytest.fixture
def memo_on_cpu(monkeypatch):
    """Let the memos key CPU calls: the first call of a shape then takes the recording path, which on
    the CPU records nothing (the interpreter and the PyTorch paths launch no compiled kernels)."""
    real = _replay.Memo.key

    def key(per_call, caches, scalars):
        got = real(per_call, caches, scalars)
        if got is not None or not isinstance(per_call[0], torch.Tensor):
            return got
        cheap = ("cpu", tuple(scalars), tuple(t is None for t in per_call))
        return _replay.CallKey(cheap, tuple(t for t in per_call if t is not None))

    monkeypatch.setattr(_replay.Memo, "key", staticmethod(key))
    monkeypatch.setattr(_replay, "supported", lambda: True)


def _cache(device, dtype, fp8, seed=0):
    """An index cache of ``B * M + 2`` blocks, every slot written (FP8: quantized by the insert)."""
    g = torch.Generator().manual_seed(seed)
    blocks = B * M + 2
    cache = mm3lab.allocate_index_cache(blocks, DI, dtype=torch.float8_e4m3fn if fp8 else dtype, device=device)
    scale = mm3lab.allocate_index_scale(blocks, device=device) if fp8 else None
    keys = torch.randn(blocks * 128, DI, generator=g).to(dtype).to(device)
    with _replay_off():
        mm3lab.insert_index_cache(keys, cache, torch.arange(blocks * 128, device=device), index_scale=scale)
    table = torch.randperm(blocks, generator=g)[: B * M].view(B, M).to(torch.int32).to(device)
    return cache, scale, table


def _rows(entry, step, device):
    """The rows of one call: decode ``seq_lens`` (2 draft queries per request) or prefill ids and
    positions (a padded row among them), different values at every step."""
    g = torch.Generator().manual_seed(100 + step)
    if entry.endswith("decode"):
        seq_lens = torch.randint(2, M * 128 + 1, (B,), generator=g, dtype=torch.int32)
        return {"seq_lens": seq_lens.to(device), "decode_query_len": 2}, 2 * B
    n = 7
    req = torch.randint(0, B, (n,), generator=g, dtype=torch.int32)
    pos = torch.randint(0, M * 128, (n,), generator=g, dtype=torch.int32)
    pos[3] = -1  # a padded row
    return {"query_req_id": req.to(device), "query_abs_pos": pos.to(device)}, n


def _call(entry, step, cache, scale, table, device, dtype, rows=None):
    g = torch.Generator().manual_seed(step)
    rows_args, n = rows if rows is not None else _rows(entry, step, device)
    q = torch.randn(n, H, DI, generator=g).to(dtype).to(device)
    extra = {} if "scores" in entry else {"topk": TOPK}
    if "scores" in entry:
        extra["forced"] = step % 2 == 0  # (another call shape every other step)
    return getattr(mm3lab, entry)(q, cache, table, **rows_args, **extra, index_scale=scale)


def _as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("fp8", [False, True])
def test_repeated_indexer_calls_replay_bit_identical(entry, fp8):
    assert _replay.supported(), "recorded launches are verified for this Triton; the test expects them on"
    INDEXER_MEMO.clear()
    cache, scale, table = _cache("cuda", torch.bfloat16, fp8)
    kept = []
    for step in range(6):
        got = _as_tuple(_call(entry, step, cache, scale, table, "cuda", torch.bfloat16))
        with _replay_off():
            want = _as_tuple(_call(entry, step, cache, scale, table, "cuda", torch.bfloat16))
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b), (entry, step)
        kept.append((got, [t.clone() for t in want]))
    for step, (got, want) in enumerate(kept):  # each call returned its own outputs
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), f"step {step} overwritten"
    entries = INDEXER_MEMO._entries().values()
    assert all(e.recording is not None for e in entries)
    shapes = 2 if "scores" in entry else 1  # (forced and raw scores: two call shapes)
    assert len(entries) == shapes and sum(e.recording.replays for e in entries) == 6 - shapes


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("entry", ["index_topk_block_table_decode", "index_topk_decode", "index_topk_prefill"])
@pytest.mark.parametrize("queue", [True, False])
@pytest.mark.parametrize("fused", [True, False])
def test_a_replayed_indexer_call_still_checks_values(entry, queue, fused, monkeypatch):
    """Decode rows: the checks inside the scores launch (``fused``, the default), or a check launch of
    their own, as prefill rows always have, with the call's launches queued while it runs (the
    default) or after its flags are read."""
    if entry == "index_topk_decode" and not fused:
        pytest.skip("index_topk_block_table_decode covers the check launch of decode rows")
    monkeypatch.setattr(_replay, "QUEUE_DURING_CHECKS", queue)
    monkeypatch.setattr(mm3lab.indexer, "FUSED_CHECKS", fused)
    INDEXER_MEMO.clear()
    cache, scale, table = _cache("cuda", torch.bfloat16, False)
    rows_args, n = _rows(entry, 0, "cuda")
    for step in range(3):
        _call(entry, step, cache, scale, table, "cuda", torch.bfloat16, rows=(rows_args, n))
    (kept,) = INDEXER_MEMO._entries().values()
    assert kept.recording is not None and kept.recording.replays == 2
    assert (kept.info is not None) == (fused and entry.endswith("decode"))  # (a kept checking launch)
    bad_table = table.clone()
    if entry.endswith("decode"):
        rows_args["seq_lens"][1] = M * 128 + 1  # in place: the same addresses, a kept check launch
        with pytest.raises(ValueError, match=r"seq_lens"):
            _call(entry, 3, cache, scale, table, "cuda", torch.bfloat16, rows=(rows_args, n))
        rows_args["seq_lens"][1] = M * 128
        bad_table[1, M - 1] = cache.shape[0]  # a block the last block of request 1 reads, past the cache
    else:
        req = rows_args["query_req_id"]
        saved = int(req[0])
        req[0] = B  # a live row's request outside the table
        with pytest.raises(ValueError, match=r"query_req_id"):
            _call(entry, 3, cache, scale, table, "cuda", torch.bfloat16, rows=(rows_args, n))
        req[0] = saved
        pos = rows_args["query_abs_pos"]
        pos[1] = M * 128  # past the table
        with pytest.raises(ValueError, match=r"query_abs_pos"):
            _call(entry, 3, cache, scale, table, "cuda", torch.bfloat16, rows=(rows_args, n))
        pos[1] = M * 128 - 1
        bad_table[int(req[1]), M - 1] = cache.shape[0]
    with pytest.raises(ValueError, match=r"block_table"):
        _call(entry, 4, cache, scale, bad_table, "cuda", torch.bfloat16, rows=(rows_args, n))
    got = _call(entry, 5, cache, scale, table, "cuda", torch.bfloat16, rows=(rows_args, n))
    with _replay_off():
        want = _call(entry, 5, cache, scale, table, "cuda", torch.bfloat16, rows=(rows_args, n))
    assert all(torch.equal(a, b) for a, b in zip(_as_tuple(got), _as_tuple(want), strict=True))


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("how", ["contiguous", "transposed"])
def test_repeated_topk_blocks_calls_replay_bit_identical(how):
    """A contiguous score tensor is read through a view, a transposed one through a copy made by every
    call (the copy is the call's own, not part of the replayed launch)."""
    _TOPK_MEMO.clear()
    kept = []
    for step in range(4):
        g = torch.Generator(device="cuda").manual_seed(step)
        scores = torch.randn(3, 5, 300, generator=g, device="cuda")
        if how == "transposed":
            scores = torch.randn(3, 300, 5, generator=g, device="cuda").transpose(1, 2)
        got = mm3lab.topk_blocks(scores, 7)
        with _replay_off():
            want = mm3lab.topk_blocks(scores, 7)
        assert torch.equal(got, want) and torch.equal(got.long(), reference.topk_blocks(scores, 7).long()), step
        kept.append((got, want.clone()))
    assert all(torch.equal(a, b) for a, b in kept)
    (entry,) = _TOPK_MEMO._entries().values()
    assert entry.recording is not None and entry.recording.replays == 3


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("queue", [True, False])
@pytest.mark.parametrize("n", [9, 100])
@pytest.mark.parametrize("checking", [True, False])
def test_repeated_inserts_replay_and_check_their_slots(fp8, queue, n, checking, monkeypatch):
    """An insert checks its own slots in its one launch (``checking``; one program along the tokens at
    9 keys, four at 100); without that launch, a small replayed insert is gated on its check's flags:
    queued while the check runs (the default) or after the flags are read; a larger one (more than
    ``GATED_TOKENS`` keys) waits for the flags. Every way, a rejected call writes nothing; the next
    good call is exact."""
    from mm3lab.index_cache import kernel

    assert (n <= mm3lab.index_cache.GATED_TOKENS) == (n == 9) and kernel.checks_in_launch(n, DI, fp8)
    if not checking:
        monkeypatch.setattr(mm3lab.index_cache, "SELF_CHECK", False)
    monkeypatch.setattr(_replay, "QUEUE_DURING_CHECKS", queue)
    INSERT_MEMO.clear()
    blocks = 4
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    caches = [mm3lab.allocate_index_cache(blocks, DI, dtype=dtype, device="cuda", fill=0.0) for _ in range(2)]
    scales = [mm3lab.allocate_index_scale(blocks, device="cuda") if fp8 else None for _ in range(2)]
    for step in range(4):
        g = torch.Generator(device="cuda").manual_seed(step)
        keys = torch.randn(n, DI, generator=g, device="cuda").to(torch.bfloat16)
        slots = torch.randperm(blocks * 128, generator=g, device="cuda")[:n]
        slots[2] = -1  # padding
        mm3lab.insert_index_cache(keys, caches[0], slots, index_scale=scales[0])
        with _replay_off():
            mm3lab.insert_index_cache(keys, caches[1], slots, index_scale=scales[1])
        assert torch.equal(caches[0].view(torch.uint8), caches[1].view(torch.uint8)), step
        if fp8:
            assert torch.equal(scales[0], scales[1]), step
    (entry,) = INSERT_MEMO._entries().values()
    assert entry.recording is not None and entry.recording.replays == 3
    assert (entry.info is not None) == checking  # (a kept checking launch: its flags' buffers)
    before = caches[0].clone()
    slots[5] = blocks * 128  # past the cache, in place
    keys = keys + 1.0  # (new keys: a write would show)
    for _ in range(2):  # (twice: the flags are clear again after a rejected call)
        with pytest.raises(ValueError, match=r"slot_mapping: row 5"):
            mm3lab.insert_index_cache(keys, caches[0], slots, index_scale=scales[0])
        torch.cuda.synchronize()
        assert torch.equal(caches[0].view(torch.uint8), before.view(torch.uint8))  # nothing written
    slots[5] = -1
    mm3lab.insert_index_cache(keys, caches[0], slots, index_scale=scales[0])
    with _replay_off():
        mm3lab.insert_index_cache(keys, caches[1], slots, index_scale=scales[1])
    assert torch.equal(caches[0].view(torch.uint8), caches[1].view(torch.uint8))
    assert entry.recording.replays >= 4


@pytest.mark.parametrize("backend", ["interpret", "torch"])
def test_the_recording_path_returns_what_each_call_computed_cpu(memo_on_cpu, backend):
    """On the CPU (nothing to record), every memoized entry point's first call of a shape goes through
    its recording path, with its outputs made by the memo: the results equal the reference's, and the
    shape is kept without a recording, so later calls take the normal path."""
    if backend == "interpret" and not mm3lab.backend.INTERPRETER:
        pytest.skip("the interpreter backend is the CPU's")
    for memo in (INDEXER_MEMO, _TOPK_MEMO, INSERT_MEMO):
        memo.clear()
    dtype = torch.float32
    cache, scale, table = _cache("cpu", dtype, False)
    with mm3lab.use_backend(backend):
        for entry in ENTRIES:
            for step in range(2):
                rows = _rows(entry, step, "cpu")
                got = _as_tuple(_call(entry, step, cache, scale, table, "cpu", dtype, rows=rows))
                with mm3lab.use_backend("torch"):
                    want = _as_tuple(_call(entry, step, cache, scale, table, "cpu", dtype, rows=rows))
                for a, b in zip(got, want, strict=True):
                    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, equal_nan=True)
        scores = torch.randn(2, 3, 40, generator=torch.Generator().manual_seed(0))
        assert torch.equal(mm3lab.topk_blocks(scores, 5).long(), reference.topk_blocks(scores, 5).long())
        target = mm3lab.allocate_index_cache(2, DI, device="cpu", fill=0.0)
        keys = torch.randn(3, DI, generator=torch.Generator().manual_seed(1))
        slots = torch.tensor([5, -1, 200])
        mm3lab.insert_index_cache(keys, target, slots)
        assert torch.equal(target[0, 5], keys[0]) and torch.equal(target[1, 72], keys[2])
        assert int(torch.count_nonzero(target.abs().sum(-1))) == 2  # (the padded row wrote nothing)
    for memo in (INDEXER_MEMO, _TOPK_MEMO, INSERT_MEMO):
        assert memo._entries() and all(e.recording is None for e in memo._entries().values())
