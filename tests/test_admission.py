"""Admission control (issue 34): a service at its `max_streams` refuses the next request with
EngineOverloadedError at once, serves again once a stream ends, and the LiveKit plugin passes the
refusal on as a retryable error. Real engine, tiny checkpoint, CPU."""

from __future__ import annotations

import asyncio
import time

import pytest
from helpers_service import open_together, recording_opens

from pipecat_qwen_fast import EngineOverloadedError, QwenTTSEngine, SynthesisRequest
from pipecat_qwen_fast.engine.service import EngineService, smoothed_round_ms
from pipecat_qwen_fast.engine.slack import SLACK_HOLD_S, PlaybackClock, SlackWatch, describe_slack

CPU = {"device": "cpu", "dtype": "float32", "backend": "torch"}
TIMEOUT = 120


@pytest.fixture
def engine(endless_model):
    return QwenTTSEngine.from_pretrained(endless_model, progress=False, **CPU)


async def test_a_full_service_refuses_at_once_and_serves_again_when_a_stream_ends(engine):
    async with EngineService.for_engine(engine, max_streams=2, max_buffered_chunks=1) as service:
        await service.wait_ready()
        # Two long streams nobody reads: admitted, and paused by backpressure, not finished.
        held = [service.open_stream(SynthesisRequest(f"Held {i}.", seed=i, max_frames=200)) for i in range(2)]
        assert service.admitted_streams == 2
        with pytest.raises(EngineOverloadedError, match="limit of 2 streams") as err:
            service.open_stream(SynthesisRequest("One too many.", seed=9, max_frames=3))
        assert err.value.retry_after_s > 0 and err.value.reason == "max_streams"
        with pytest.raises(EngineOverloadedError):
            service.open_text_stream(SynthesisRequest("", seed=9, max_frames=3))
        assert service.refusals == {"max_streams": 2}  # counted by the setting that refused them
        held[0].cancel()
        await asyncio.wait_for(held[0].wait_closed(), TIMEOUT)
        pcm = await asyncio.wait_for(service.synthesize(SynthesisRequest("Next.", seed=3, max_frames=3)), TIMEOUT)
        assert len(pcm) == 3 * 1920
        held[1].cancel()
        await asyncio.wait_for(held[1].wait_closed(), TIMEOUT)
        assert service.admitted_streams == 0


def test_max_streams_must_be_positive(engine):
    with pytest.raises(ValueError, match="max_streams"):
        EngineService.for_engine(engine, max_streams=0)


def test_livekit_gets_a_retryable_error_for_a_refusal():
    from livekit.agents import APIConnectionError
    from livekit.plugins.qwen_fast.errors import to_api_error

    from pipecat_qwen_fast import InvalidInputError

    refused = to_api_error(EngineOverloadedError("the TTS engine is serving its limit of 2 streams"))
    assert isinstance(refused, APIConnectionError) and refused.retryable
    assert not to_api_error(InvalidInputError("unknown voice 'x'; valid voices: ryan")).retryable


async def test_slow_rounds_refuse_new_streams_while_streams_are_live(engine):
    # A limit every CPU round exceeds: with a stream live, the next is refused, naming the round
    # time and the limit; once nothing is live, a stream is admitted again.
    async with EngineService.for_engine(engine, max_round_ms=1e-3) as service:
        await service.wait_ready()
        live = service.open_stream(SynthesisRequest("Live.", seed=1, max_frames=200))
        await asyncio.wait_for(live.__anext__(), TIMEOUT)
        await asyncio.wait_for(live.__anext__(), TIMEOUT)  # rounds have run and been timed
        with pytest.raises(EngineOverloadedError, match="max_round_ms") as err:
            service.open_stream(SynthesisRequest("Refused.", seed=2, max_frames=3))
        assert err.value.retry_after_s > 0 and err.value.reason == "max_round_ms"
        assert service.refusals == {"max_round_ms": 1}
        await live.aclose()
        pcm = await asyncio.wait_for(service.synthesize(SynthesisRequest("Next.", seed=3, max_frames=3)), TIMEOUT)
        assert len(pcm) == 3 * 1920
    # "auto" is no limit off a GPU, and the limit is checked.
    async with EngineService.for_engine(engine) as service:
        await service.wait_ready()
        assert service.max_round_ms is None
    with pytest.raises(ValueError, match="max_round_ms"):
        EngineService.for_engine(engine, max_round_ms=0)


def test_one_stall_moves_the_admission_signal_a_step_and_sustained_slow_rounds_cross_it():
    limit = 32.0
    steady = 13.0
    after_stall = smoothed_round_ms(steady, 630.0, limit)
    assert after_stall < limit  # the H200's 630 ms round counted as 64: 23.2 ms
    assert smoothed_round_ms(steady, 630.0, None) > limit  # without a limit nothing is capped
    # Rounds over the limit, round after round, cross it as soon as without the cap.
    for slow in (40.0, 100.0, 630.0):
        ms, rounds = steady, 0
        while ms <= limit:
            ms, rounds = smoothed_round_ms(ms, slow, limit), rounds + 1
        assert rounds <= 6, (slow, rounds)
    assert smoothed_round_ms(0.0, 20.0, limit) == 20.0  # the first round is taken as it is


async def test_one_stalled_round_does_not_refuse_the_next_call(engine):
    # A round stalled far past the limit (a collection, a recompile), the rounds around it quick:
    # the call that arrives after it is served. The limit is far above a CPU round's time.
    stall = {"next": False}
    step_many = engine.step_many

    def stalling_step_many(sessions, **kwargs):
        if stall["next"]:
            stall["next"] = False
            time.sleep(1.5)
        return step_many(sessions, **kwargs)

    engine.step_many = stalling_step_many
    async with EngineService.for_engine(engine, max_round_ms=200.0) as service:
        await service.wait_ready()
        live = service.open_stream(SynthesisRequest("Live.", seed=1, max_frames=200, chunk_frames=1))
        await asyncio.wait_for(live.__anext__(), TIMEOUT)
        rounds = service.rounds
        stall["next"] = True
        while service.rounds <= rounds + 1:  # the stalled round and one after it are counted
            await asyncio.sleep(0.01)
        assert service.round_ms < 200.0
        pcm = await asyncio.wait_for(service.synthesize(SynthesisRequest("Next.", seed=3, max_frames=3)), TIMEOUT)
        assert len(pcm) == 3 * 1920
        await live.aclose()


def test_a_chunks_slack_is_its_playback_time_less_its_arrival():
    clock = PlaybackClock()
    assert clock.arrive(10.0, 0.08) is None  # the first chunk starts playback: no slack
    assert clock.arrive(10.05, 0.16) == pytest.approx(0.03)  # due at 10.08
    assert clock.arrive(10.30, 0.32) == pytest.approx(-0.06)  # due at 10.24: 60 ms late
    # The listener resumed at the late chunk, so the next is due at 10.30 + 0.32, not 10.56.
    assert clock.arrive(10.50, 0.08) == pytest.approx(0.12)
    clock.restart()
    assert clock.arrive(20.0, 0.08) is None


def test_a_chunk_under_the_margin_holds_admission_for_a_while():
    watch = SlackWatch(0.02)
    watch.note(0.05, 100.0)
    assert watch.low_chunks == 0 and not watch.holding(100.0)
    watch.note(0.01, 100.1)
    assert watch.low_chunks == 1 and watch.last_low_s == 0.01
    assert watch.holding(100.1 + SLACK_HOLD_S - 0.01) and not watch.holding(100.1 + SLACK_HOLD_S)
    watch.note(-0.03, 100.4)  # a later one renews the hold
    assert watch.low_chunks == 2 and watch.holding(100.4 + SLACK_HOLD_S - 0.01)
    # The lowest slack of the last one to two 1 s windows.
    assert watch.lowest_ms(100.5) == pytest.approx(-30.0)
    assert watch.lowest_ms(101.05) == pytest.approx(-30.0)
    watch.note(0.2, 101.1)  # opens a window; the one before still counts for a second
    assert watch.lowest_ms(101.2) == pytest.approx(-30.0)
    assert watch.lowest_ms(102.2) == pytest.approx(200.0)
    assert watch.lowest_ms(103.2) is None
    off = SlackWatch(None)  # no margin: watched, never low, never holding
    off.note(-1.0, 5.0)
    assert off.low_chunks == 0 and not off.holding(5.0) and off.lowest_ms(5.0) == pytest.approx(-1000.0)
    assert describe_slack(-0.012) == "12.0 ms after its playback time"
    assert describe_slack(0.0155) == "15.5 ms before its playback time"


async def test_a_chunk_near_its_playback_refuses_new_streams_while_streams_are_live(engine):
    # A margin no chunk meets: every chunk after a stream's first counts as low. With a stream
    # live, the next is refused, naming min_slack_ms; once nothing is live, one is admitted.
    async with EngineService.for_engine(engine, max_round_ms=None, min_slack_ms=1e7) as service:
        await service.wait_ready()
        live = service.open_stream(SynthesisRequest("Live.", seed=1, max_frames=200))
        for _ in range(3):
            await asyncio.wait_for(live.__anext__(), TIMEOUT)
        assert service.low_slack_chunks >= 2  # counted before a reader sees the chunk
        with pytest.raises(EngineOverloadedError, match="min_slack_ms") as err:
            service.open_stream(SynthesisRequest("Refused.", seed=2, max_frames=3))
        assert "playback time" in str(err.value) and err.value.retry_after_s > 0
        assert err.value.reason == "min_slack_ms" and service.refusals == {"min_slack_ms": 1}
        await live.aclose()
        pcm = await asyncio.wait_for(service.synthesize(SynthesisRequest("Next.", seed=3, max_frames=3)), TIMEOUT)
        assert len(pcm) == 3 * 1920
    # Off: the same sequence is admitted; slack is still watched.
    async with EngineService.for_engine(engine, max_round_ms=None, min_slack_ms=None) as service:
        await service.wait_ready()
        live = service.open_stream(SynthesisRequest("Live.", seed=1, max_frames=200))
        for _ in range(3):
            await asyncio.wait_for(live.__anext__(), TIMEOUT)
        admitted = service.open_stream(SynthesisRequest("Admitted.", seed=2, max_frames=3))
        assert sum([c.num_frames async for c in admitted]) == 3
        assert service.low_slack_chunks == 0 and service.lowest_slack_ms is not None
        await live.aclose()
    # "auto" is off away from a GPU, and the margin is checked.
    async with EngineService.for_engine(engine) as service:
        await service.wait_ready()
        assert service.min_slack_ms is None
    for bad in ("fast", float("nan"), True):
        with pytest.raises(ValueError, match="min_slack_ms"):
            EngineService.for_engine(engine, min_slack_ms=bad)


async def test_calls_waiting_to_start_are_bounded_while_streams_are_live(engine):
    # The three opens run back to back on this loop, microseconds apart; opening one takes the
    # engine thread milliseconds, so the first two still wait when the third comes.
    async with EngineService.for_engine(engine, max_round_ms=None, min_slack_ms=None,
                                        max_queued_streams=2) as service:
        await service.wait_ready()
        live = service.open_stream(SynthesisRequest("Live.", seed=1, max_frames=200))
        await asyncio.wait_for(live.__anext__(), TIMEOUT)
        waiting = [service.open_stream(SynthesisRequest(f"Wait {i}.", seed=2 + i, max_frames=3)) for i in range(2)]
        with pytest.raises(EngineOverloadedError, match="max_queued_streams") as err:
            service.open_stream(SynthesisRequest("Refused.", seed=9, max_frames=3))
        assert "wait to start" in str(err.value) and err.value.retry_after_s > 0
        assert err.value.reason == "max_queued_streams" and service.refusals == {"max_queued_streams": 1}
        for stream in waiting:  # the admitted ones are served
            assert sum([c.num_frames async for c in stream]) == 3
        assert service.queued_streams == 0
        await live.aclose()
        # A burst on an idle engine opens together, whatever its size.
        burst = [service.open_stream(SynthesisRequest(f"Burst {i}.", seed=i, max_frames=2)) for i in range(4)]
        for stream in burst:
            assert sum([c.num_frames async for c in stream]) == 2
    async with EngineService.for_engine(engine) as service:
        await service.wait_ready()
        assert service.max_queued_streams is None  # "auto": no limit away from a GPU
    for bad in (0, "many", True, 2.5):
        with pytest.raises(ValueError, match="max_queued_streams"):
            EngineService.for_engine(engine, max_queued_streams=bad)


async def test_a_reader_that_falls_behind_does_not_count_as_low_slack(engine):
    # One chunk buffered at most: each chunk waits for the slow reader, so the engine holds the
    # stream back and the next chunk starts its playback afresh rather than counting as late.
    async with EngineService.for_engine(engine, max_round_ms=None, min_slack_ms=1e7,
                                        max_buffered_chunks=1) as service:
        await service.wait_ready()
        stream = service.open_stream(SynthesisRequest("Slow reader.", seed=1, max_frames=12))
        frames = 0
        while True:
            # The engine sees a full buffer before each read: the chunk is there, then a round or
            # more pass (a loaded machine made the chunk later than a fixed 0.2 s wait allowed).
            for _ in range(int(TIMEOUT / 0.05)):
                if stream.buffered or stream.done:
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.2)
            try:
                frames += (await asyncio.wait_for(stream.__anext__(), TIMEOUT)).num_frames
            except StopAsyncIteration:
                break
        assert frames == 12
        assert service.low_slack_chunks == 0


async def test_streamed_text_turns_are_measured_once_their_text_has_ended(engine):
    # While text may still come, a turn's chunks wait for it, which says nothing about the engine.
    async with EngineService.for_engine(engine, max_round_ms=None, min_slack_ms=1e7) as service:
        await service.wait_ready()
        turn = service.open_text_stream(SynthesisRequest("", seed=1, max_frames=40))
        turn.append("Some words arrive while it speaks.")
        first = await asyncio.wait_for(turn.__anext__(), TIMEOUT)
        second = await asyncio.wait_for(turn.__anext__(), TIMEOUT)
        assert first.num_frames and second.num_frames
        assert service.low_slack_chunks == 0
        # Its text complete (a server's turn given it whole): from the next chunk on, the engine's.
        turn.end()
        rest = await asyncio.wait_for(collect(turn), TIMEOUT)
        assert len(rest) >= 3
        # The first chunk after the end starts the listener's clock afresh, the rest are measured
        # (one made before the end, if the engine ran that far ahead of the text, is not).
        assert 1 <= service.low_slack_chunks <= len(rest) - 1


async def test_every_second_and_third_chunk_is_kept_with_the_rounds_since_its_first(engine):
    # Whole texts beside streamed turns given their whole text (a server's WebSocket turns): the
    # benchmark compares their early chunks over a level, not only those under the margin.
    async with EngineService.for_engine(engine, max_round_ms=None, min_slack_ms=None) as service:
        await service.wait_ready()
        since = time.monotonic()
        whole = service.open_stream(SynthesisRequest("Hello there, how are you?", seed=1, max_frames=8))
        turn = service.open_text_stream(SynthesisRequest("", seed=2, max_frames=8))
        turn.append("Hello there, how are you?")
        turn.end()
        await asyncio.wait_for(asyncio.gather(collect(whole), collect(turn)), TIMEOUT)
        events = service.early_chunk_events(since)
        assert service.early_chunk_events(time.monotonic() + 1) == []
    # (arrival, slack, chunks before it, streamed turn, rounds since the first chunk): the default
    # schedule 1, 1, 2 sends the second chunk a round after the first, the third three rounds after.
    got = sorted((e[3], e[2], e[4]) for e in events)
    assert got == [(False, 1, 1), (False, 2, 3), (True, 1, 1), (True, 2, 3)]


async def collect(stream) -> list:
    return [c async for c in stream]


async def test_streams_ahead_of_playback_sit_out_rounds_under_contention(engine):
    # Contention from 2 ready streams on: a stream whose lead covers the rest of its chunk waits
    # while a new one (no audio yet) gets its frames; with nobody due, all run. Audio is unchanged.
    # "Ahead." opens with 16 frames and goes on in 2-frame chunks, so its lead (~1.4 s) covers
    # LEAD_SAFETY x 3 rounds of up to ~300 ms: a loaded CI machine's slow rounds keep it sitting out
    # (with 1, 2, 4, ... its ~0.2 s lead let rounds of 25 ms or more make it due: a failed CI run).
    rounds = []
    step_many = engine.step_many

    def spy(sessions, **kwargs):
        rounds.append({s.request.text for s in sessions})
        return step_many(sessions, **kwargs)

    engine.step_many = spy
    try:
        async with EngineService.for_engine(engine, max_lead_s=0.05, max_round_ms=None) as service:
            service.contention_rows = 1
            await service.wait_ready()
            ahead = service.open_stream(SynthesisRequest("Ahead.", seed=1, max_frames=60, first_chunk_frames=16,
                                                         max_chunk_frames=None))
            first = [await asyncio.wait_for(ahead.__anext__(), TIMEOUT) for _ in range(2)]
            new = service.open_stream(SynthesisRequest("New.", seed=2, max_frames=12))
            got_new = [c async for c in new]
            got_ahead = first + [c async for c in ahead]
    finally:
        del engine.step_many
    opened = next(i for i, r in enumerate(rounds) if "New." in r)
    assert rounds[opened] == {"New."}, rounds[opened - 2 : opened + 3]
    assert sum(c.num_frames for c in got_new) == 12 and sum(c.num_frames for c in got_ahead) == 60
    alone = engine.synthesize("New.", seed=2, max_frames=12, first_chunk_frames=1, chunk_frames=3, max_chunk_frames=32)
    assert len(alone.pcm) == sum(len(c.pcm) for c in got_new)


async def test_a_stream_sits_out_only_while_its_lead_covers_the_rest_of_its_chunk(engine):
    # Paused by backpressure after its first chunk (8 frames, 640 ms), the stream's next chunk is
    # 2 frames away: it may sit a round out while its lead covers LEAD_SAFETY x (2 + 1) rounds.
    from pipecat_qwen_fast.engine.service import LEAD_SAFETY

    async with EngineService.for_engine(engine, max_buffered_chunks=1, max_round_ms=None) as service:
        await service.wait_ready()
        stream = service.open_stream(SynthesisRequest("Ahead.", seed=1, max_frames=60, first_chunk_frames=8,
                                                         chunk_frames=2))
        await asyncio.wait_for(stream.__anext__(), TIMEOUT)
        assert stream.frames_to_chunk() == 2
        now = stream._first_post_at + 0.1
        lead = stream.lead(now)
        assert lead == pytest.approx(0.54)
        edge = lead / (LEAD_SAFETY * 3)
        assert stream.may_sit_out(now, 0.0, 0.9 * edge)
        assert not stream.may_sit_out(now, 0.0, 1.1 * edge)
        assert not stream.may_sit_out(now, 0.6, 0.0)  # the floor still holds
        stream.cancel()
        await asyncio.wait_for(stream.wait_closed(), TIMEOUT)


async def test_a_busy_engine_opens_a_few_calls_a_round_and_the_rest_next(engine):
    # With a stream live, six calls arriving together open over two rounds (4, then 2), in order;
    # each gets its whole audio.
    with recording_opens(engine) as opens:
        async with EngineService.for_engine(engine, max_round_ms=None, max_opens_per_round=4) as service:
            await service.wait_ready()
            live = service.open_stream(SynthesisRequest("Live.", seed=1, max_frames=80))
            await asyncio.wait_for(live.__anext__(), TIMEOUT)
            texts = [f"Call {i}." for i in range(6)]
            streams = open_together(service, [SynthesisRequest(t, seed=i, max_frames=5) for i, t in enumerate(texts)])
            got = [await asyncio.wait_for(service_frames(s), TIMEOUT) for s in streams]
            live.cancel()
            await asyncio.wait_for(live.wait_closed(), TIMEOUT)
    assert got == [5] * 6
    assert opens[1:] == [texts[:4], texts[4:]], opens
    with pytest.raises(ValueError, match="max_opens_per_round"):
        EngineService.for_engine(engine, max_opens_per_round=0)


async def test_a_call_cancelled_while_it_waits_to_open_is_freed_at_the_next_round(engine):
    # With a stream live, calls open one a round; the last of twenty queued together is cancelled
    # (a barge-in on a call still in line) and is ended at the next round, not when its turn to
    # open comes 19 rounds later. The GPU fleet test's churn cancels queued calls by the hundred.
    with recording_opens(engine) as rounds:
        async with EngineService.for_engine(engine, max_round_ms=None, max_queued_streams=None,
                                            max_opens_per_round=1) as service:
            await service.wait_ready()
            live = service.open_stream(SynthesisRequest("Live.", seed=1, max_frames=400))
            await asyncio.wait_for(live.__anext__(), TIMEOUT)
            texts = [f"Call {i}." for i in range(20)]
            streams = open_together(service, [SynthesisRequest(t, seed=i, max_frames=3) for i, t in enumerate(texts)])
            record = await asyncio.wait_for(streams[-1].aclose(), TIMEOUT)
            opened_by_then = sum(t in opened for opened in rounds for t in texts)
            got = [await asyncio.wait_for(service_frames(s), TIMEOUT) for s in streams[:-1]]
            live.cancel()
            await asyncio.wait_for(live.wait_closed(), TIMEOUT)
    opens = [t for opened in rounds for t in opened]
    assert record.closed and not record.opened and record.stop_reason == "cancelled"
    assert opened_by_then < 10, f"{opened_by_then} calls ahead of it in line opened before it was freed"
    assert texts[-1] not in opens and got == [3] * 19


async def service_frames(stream) -> int:
    return sum([c.num_frames async for c in stream])
