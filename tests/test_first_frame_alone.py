"""A new call's first frame made alone on the per-call side while the batch is small (issue 34's
64-caller first audio; backends/hybrid.py, FIRST_ALONE_BELOW): the call is placed on the per-call
side, the service steps it by itself before the round's batched frame, it moves into the batch
after that frame, and it speaks as the same call left on either side. A burst, a batch past the
limit or the switch at 0 keep the old placement. Real engine on CPU: the eager reference as the
per-call side (the megakernel on a GPU), the graph backend's batched frame run eagerly as the batch."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
from helpers_service import collect_all, inbox_held, open_staggered, step_until_done

from pipecat_qwen_fast import QwenTTSEngine, SynthesisRequest
from pipecat_qwen_fast.backends.graph import GraphBackend
from pipecat_qwen_fast.backends.hybrid import HybridBackend
from pipecat_qwen_fast.engine.service import EngineService

TIMEOUT = 120


def hybrid_engine(path, first_alone_below: int = 16, max_sessions: int = 6) -> QwenTTSEngine:
    engine = QwenTTSEngine.from_pretrained(path, device="cpu", dtype="float32", backend="eager", progress=False)
    bulk = GraphBackend(engine.model.talker, engine.device, engine.dtype, max_sessions=max_sessions, capacity=512,
                        use_graphs=False)
    # fast_sessions=0: without a first frame alone every call goes to the batch, so any call on
    # the per-call side is there for its first frame.
    engine.backend = HybridBackend(engine.backend, bulk, fast_sessions=0, first_alone_below=first_alone_below)
    return engine


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return hybrid_engine(tiny_checkpoint("custom_voice", zero_eos=True))


def request(i: int, frames: int = 6) -> SynthesisRequest:
    return SynthesisRequest(f"Caller number {i} says hello.", voice="ryan", seed=i, max_frames=frames,
                            greedy=True, first_chunk_frames=1, chunk_frames=2, vocode=False)


def solo_codes(engine, req) -> np.ndarray:
    return engine.generate_codes(req.text, voice=req.voice, greedy=True, max_frames=req.max_frames).numpy()


def test_a_call_joining_a_small_batch_makes_its_first_frame_alone_then_moves(engine):
    hb = engine.backend
    reqs = [request(i, frames=5 + i) for i in range(2)]
    want = [solo_codes(engine, r) for r in reqs]
    first = engine.open_session(reqs[0])
    assert not first.state.on_fast, "with the batch empty and fast_sessions=0 a call goes to the batch"
    engine.step_many([first])
    alone, moved = hb.first_alone, hb.moved
    joining = engine.open_session(reqs[1])
    assert joining.state.on_fast and joining.state.alone_first and hb.first_alone == alone + 1
    assert engine.starts_alone(joining) and not engine.starts_alone(first)
    # A round with it still at frame 0 does not move it: its first frame runs on the per-call side.
    engine.step_many([joining])
    assert joining.state.on_fast and not engine.starts_alone(joining) and hb.moved == moved
    engine.step_many([first, joining])
    assert hb.moved == moved + 1 and not joining.state.on_fast
    codes = step_until_done(engine, [first, joining])
    for got, expected in zip(codes, want):
        np.testing.assert_array_equal(got, expected)
    assert (hb.live_fast, hb.live_bulk) == (0, 0)


def test_a_burst_or_a_batch_past_the_limit_goes_to_the_batch(tiny_checkpoint):
    engine = hybrid_engine(tiny_checkpoint("custom_voice", zero_eos=True), first_alone_below=2)
    hb = engine.backend
    # A pair opened together into an empty batch is not a call joining one: both go to the batch.
    live = engine.open_sessions([request(i) for i in range(2)])
    assert [s.state.on_fast for s in live] == [False, False] and hb.live_bulk == 2
    burst = engine.open_sessions([request(i) for i in range(2, 5)])  # three at once: one batched prefill
    assert [s.state.on_fast for s in burst] == [False] * 3
    past = engine.open_session(request(5))  # five in the batch, over first_alone_below=2
    assert not past.state.on_fast and hb.first_alone == 0
    for s in [*live, *burst, past]:
        engine.cancel(s)
    assert (hb.live_fast, hb.live_bulk) == (0, 0)


async def test_streamed_turns_opened_in_one_round_are_one_burst(tiny_checkpoint):
    # A server's calls are streamed turns, each opened on its own: the round's opens, whole texts
    # and turns together, are one burst for the backend, so three opened beside a live call go to
    # the batch as three whole texts would, and one opened alone makes its first frame alone.
    engine = hybrid_engine(tiny_checkpoint("custom_voice", zero_eos=True))
    hb = engine.backend

    def turn(service, i: int):
        stream = service.open_text_stream(SynthesisRequest("", voice="ryan", seed=i, greedy=True, max_frames=4,
                                                           text_mode="dual_track", vocode=False))
        stream.append(f"Caller number {i} says hello.")
        stream.end()
        return stream

    async with EngineService.for_engine(engine) as service:
        await service.wait_ready()
        live = service.open_stream(request(0, frames=40))
        await asyncio.wait_for(live.__anext__(), TIMEOUT)
        assert hb.live_bulk == 1
        with recording_places(hb) as places:
            with inbox_held(service):  # all four opened in one round
                burst = [turn(service, i) for i in (1, 2, 3)]
                burst.append(service.open_stream(request(4)))
            await asyncio.wait_for(collect_all(burst, TIMEOUT), TIMEOUT)
            assert places == [(4, False)] * 4, "a turn of a round's burst was placed to start alone"
            assert service.first_frames_alone == 0
            places.clear()
            await asyncio.wait_for(collect_all([turn(service, 5)], TIMEOUT), TIMEOUT)
            assert places == [(1, True)] and service.first_frames_alone == 1
        live.cancel()
        await asyncio.wait_for(live.wait_closed(), TIMEOUT)


@contextmanager
def recording_places(hb: HybridBackend) -> Iterator[list[tuple[int, bool]]]:
    """Each new_state of `hb` while inside: (the burst it was placed in, placed to start alone)."""
    places: list[tuple[int, bool]] = []
    new_state = hb.new_state

    def spy(**kwargs):
        burst = hb.burst_size
        state = new_state(**kwargs)
        places.append((burst, state.alone_first))
        return state

    hb.new_state = spy
    try:
        yield places
    finally:
        del hb.new_state


def test_switched_off_a_joining_call_goes_to_the_batch(tiny_checkpoint, monkeypatch):
    monkeypatch.setenv("QWEN_FAST_FIRST_ALONE_BELOW", "0")
    engine = hybrid_engine(tiny_checkpoint("custom_voice", zero_eos=True), first_alone_below=None)
    assert engine.backend.first_alone_below == 0
    sessions = [engine.open_session(request(i)) for i in range(2)]
    assert [s.state.on_fast for s in sessions] == [False, False] and not engine.starts_alone(sessions[1])
    for s in sessions:
        engine.cancel(s)


def test_a_bad_switch_names_itself(tiny_checkpoint, monkeypatch):
    monkeypatch.setenv("QWEN_FAST_FIRST_ALONE_BELOW", "some")
    with pytest.raises(ValueError, match="QWEN_FAST_FIRST_ALONE_BELOW must be a whole number"):
        HybridBackend(object(), object())
    with pytest.raises(ValueError, match="first_alone_below must be >= 0"):
        HybridBackend(object(), object(), first_alone_below=-1)


async def test_the_service_runs_a_joining_calls_first_frame_before_the_round(engine):
    hb = engine.backend
    requests = [request(i, frames=6 + i % 3) for i in range(4)]
    want = [solo_codes(engine, r) for r in requests]
    # Each step_many call: (session, frames it had decoded, placed for a first frame alone).
    rounds: list[list[tuple]] = []
    step_many = engine.step_many

    def spy(sessions, **kwargs):
        rounds.append([(s, s.frames_decoded, s.state.alone_first) for s in sessions])
        return step_many(sessions, **kwargs)

    engine.step_many = spy
    try:
        async with EngineService.for_engine(engine) as service:
            await service.wait_ready()
            out = await open_staggered(service, requests, TIMEOUT)
            alone = service.first_frames_alone
    finally:
        del engine.step_many
    assert alone >= 1, "no joining call made its first frame alone"
    assert hb.first_alone >= alone
    for i, (chunks, expected) in enumerate(zip(out, want)):
        assert not isinstance(chunks, Exception), (i, chunks)
        np.testing.assert_array_equal(np.concatenate([c.codes for c in chunks]), expected, err_msg=f"call {i}")
    # Each first frame made alone was a step of that call by itself, and the round that followed
    # (the batched frame of the others) did not step it again.
    solo = [k for k, r in enumerate(rounds) if len(r) == 1 and r[0][1] == 0 and r[0][2]]
    assert len(solo) == alone
    for k in solo:
        call = rounds[k][0][0]
        if k + 1 < len(rounds):
            assert all(s is not call for s, _, _ in rounds[k + 1]), "stepped again in the same round"
        later = [f for r in rounds[k + 1:] for s, f, _ in r if s is call]
        assert later[:1] == [1], "its second frame did not follow its first"
    assert (hb.live_fast, hb.live_bulk) == (0, 0)


async def test_a_call_whose_first_frame_ran_alone_goes_on_while_the_batch_waits_for_text(engine):
    # The batch's one call is a streamed turn waiting for its next words; a call joins and makes
    # its first frame alone, so the rest of that round steps nothing. The engine thread must go on
    # with the new call, not sleep until the turn's text or idle timeout (60 s here) or a reader
    # wakes it: this call's reader reads nothing until all its audio is made.
    req = SynthesisRequest("", voice="ryan", seed=1, greedy=True, text_mode="dual_track", first_chunk_frames=1,
                           chunk_frames=2, vocode=False)
    async with EngineService.for_engine(engine) as service:
        await service.wait_ready()
        turn = service.open_text_stream(req, idle_timeout_s=60)
        turn.append("Some first words of the reply, and then a pause")
        await asyncio.wait_for(turn.__anext__(), TIMEOUT)
        rounds = -1
        while service.rounds != rounds:  # until the turn has spoken its words and waits for more
            rounds = service.rounds
            await asyncio.sleep(0.3)
        assert not turn.done and engine.backend.live_bulk == 1
        joining = service.open_stream(request(1, frames=6))
        for _ in range(200):  # 20 s
            if joining.done:
                break
            await asyncio.sleep(0.1)
        assert joining.done, f"the call stopped after {joining.buffered} chunk(s)"
        assert service.first_frames_alone == 1
        assert sum(c.num_frames for c in [c async for c in joining]) == 6
        turn.cancel()
        await asyncio.wait_for(turn.wait_closed(), TIMEOUT)
