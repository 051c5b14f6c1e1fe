"""Sessions' vocoder states as rows of one pool (vocoder/pool.py): a batched call moves them by
index instead of copying each stream's buffers, and gives every stream what it gets alone.

Exactness in float64 on the CPU (the batched entries run their step eagerly; the gather and
scatter are the same indexed copies the GPU's graphs capture). tests/test_vocoder_graphs.py
checks the captured graphs on CUDA.
"""

from __future__ import annotations

import gc

import pytest
import test_vocoder
import torch
from test_vocoder import TINY
from test_vocoder_ragged import RAGGED, SPF, STARTS, state_gap

from pipecat_qwen_fast.vocoder import graphs as graphs_mod
from pipecat_qwen_fast.vocoder.graphs import GraphedVocoder
from pipecat_qwen_fast.vocoder.pool import StreamPool

one_thread, voc32, voc = test_vocoder.one_thread, test_vocoder.voc32, test_vocoder.voc


def _no_copies(*_a, **_k):
    raise AssertionError("a call over pooled streams copied their states")


def _advance(voc, streams, codes, starts):
    for i, t in enumerate(starts):
        if t:
            voc.decode_stream(codes[i : i + 1, :, :t], streams[i])


def test_pooled_calls_equal_each_stream_alone(voc, monkeypatch):
    """The ragged calls of test_vocoder_ragged over 4 pooled streams (a full 4-row entry), then 3
    of them (one padding row, the scratch row's), then all 4 and one more pooled stream (4 rows
    batched, 1 alone through the batch-1 entry's copy): each stream's audio and state as alone.
    Calls of 4 frames take the batched entry and move their rows by index (a copy would fail);
    the shorter ones have no batched entry and run batch-1."""
    graphs = GraphedVocoder(voc, torch.device("cpu"), torch.float64, use_graphs=False, pool_slots=6)
    graphs.capture_batched([4], max_rows=4)
    g = torch.Generator().manual_seed(4)
    codes = torch.randint(0, TINY.codebook_size, (5, TINY.num_quantizers, 120), generator=g)
    starts = (*STARTS, 9)
    pooled = [graphs.new_stream() for _ in starts]
    alone = [voc.new_stream() for _ in starts]
    assert sorted(st.slot for st in pooled) == [0, 1, 2, 3, 4] and all(st.slot is None for st in alone)
    _advance(voc, pooled, codes, starts)
    _advance(voc, alone, codes, starts)
    monkeypatch.setattr(graphs_mod, "copy_streams", _no_copies)
    at, worst = list(starts), 0.0
    plan = [(rows, lengths) for lengths in RAGGED for rows in ([0, 1, 2, 3], [3, 0, 2], [0, 1, 2, 3, 4])]
    for rows, lengths in plan:
        lengths = [lengths[j % 4] for j in range(len(rows))]
        n = max(lengths)
        c = torch.stack([codes[i, :, at[i] : at[i] + n] for i in rows])
        wav = graphs.decode_many(c, [pooled[i] for i in rows], valid=lengths)
        for j, (i, v) in enumerate(zip(rows, lengths)):
            own = voc.decode_stream(codes[i : i + 1, :, at[i] : at[i] + v], alone[i])
            worst = max(worst, float((wav[j, :, : v * SPF] - own[0]).abs().max()))
            at[i] += v
    assert worst <= 1e-12
    for p, a in zip(pooled, alone):
        assert state_gap(p, a) <= 1e-12
    batched = sum(max(lengths[j % 4] for j in range(len(rows))) == 4 for rows, lengths in plan)
    assert batched >= 9 and graphs.calls_pooled == batched and graphs.calls_copied == 0


def test_mixed_calls_copy_and_stay_exact(voc):
    """A call holding a stream of its own (the pool ran out) copies every row, pooled or not."""
    graphs = GraphedVocoder(voc, torch.device("cpu"), torch.float64, use_graphs=False, pool_slots=2)
    graphs.capture_batched([3], max_rows=4)
    streams = [graphs.new_stream() for _ in range(3)]
    assert [st.slot for st in streams] == [0, 1, None]
    alone = [voc.new_stream() for _ in range(3)]
    g = torch.Generator().manual_seed(7)
    codes = torch.randint(0, TINY.codebook_size, (3, TINY.num_quantizers, 9), generator=g)
    for t in range(0, 9, 3):
        wav = graphs.decode_many(codes[:, :, t : t + 3], streams)
        for i in range(3):
            assert (wav[i] - voc.decode_stream(codes[i : i + 1, :, t : t + 3], alone[i])[0]).abs().max() <= 1e-12
    assert all(state_gap(a, b) <= 1e-12 for a, b in zip(streams, alone))
    assert graphs.calls_copied == 3 and graphs.calls_pooled == 0


def test_rows_come_back_zeroed_when_their_streams_are_gone(voc):
    pool = StreamPool(voc, 2, torch.device("cpu"), torch.float64)
    a, b = pool.new_stream(), pool.new_stream()
    assert pool.new_stream() is None  # full: the engine then makes a stream of its own
    g = torch.Generator().manual_seed(1)
    voc.decode_stream(torch.randint(0, TINY.codebook_size, (1, TINY.num_quantizers, 5), generator=g), a)
    assert a.frames == 5 and float(a.keys.abs().max()) > 0 and int(a.position) == 5
    slot = a.slot
    kept = [a]  # a pending call's reference keeps the row taken
    del a
    gc.collect()
    assert pool.new_stream() is None
    kept.clear()
    c = pool.new_stream()
    assert c is not None and c.slot == slot and b.slot != slot
    assert int(c.position) == 0 and all(float(t.abs().max()) == 0 for t in (*c.histories, c.keys, c.values))
    assert pool.holds([b, c]) and not pool.holds([b, voc.new_stream()])
    assert not StreamPool(voc, 1, torch.device("cpu"), torch.float64).holds([b])
    with pytest.raises(ValueError, match="at least one slot"):
        StreamPool(voc, 0, torch.device("cpu"), torch.float64)


def test_pool_rows_from_the_environment(voc, monkeypatch):
    from pipecat_qwen_fast.vocoder.pool import pool_slots

    monkeypatch.setenv("QWEN_FAST_VOCODER_POOL", "0")
    assert pool_slots(voc, torch.device("cpu"), torch.float64, 64) == 0
    monkeypatch.setenv("QWEN_FAST_VOCODER_POOL", "12")
    assert pool_slots(voc, torch.device("cpu"), torch.float64, 64) == 12
    for bad in ("lots", "-1", ""):
        monkeypatch.setenv("QWEN_FAST_VOCODER_POOL", bad)
        with pytest.raises(ValueError, match="QWEN_FAST_VOCODER_POOL must be a number of rows"):
            pool_slots(voc, torch.device("cpu"), torch.float64, 64)
    monkeypatch.delenv("QWEN_FAST_VOCODER_POOL")
    assert pool_slots(voc, torch.device("cpu"), torch.float64, 64) == 64  # a CPU: one row a session
