"""What the fleet benchmark records to tell a round-time underrun from a throughput one, and a
stall from a slow level: the first late chunk of each utterance, and the slowest rounds."""

from __future__ import annotations

import pytest

from pipecat_qwen_fast.bench.fleet_workload import (
    COMPLETE,
    CUT,
    Utterance,
    compare_early_chunks,
    place_low_slack,
    summarize_level,
    summarize_rounds,
)
from pipecat_qwen_fast.engine.round_timing import RoundTiming
from pipecat_qwen_fast.engine.slack import SlackWatch

FRAME = 1920


def utterance(arrivals, frames, outcome=COMPLETE, ended=None) -> Utterance:
    u = Utterance(caller=0, frames=sum(frames), submitted=0.0, outcome=outcome)
    u.arrivals, u.samples = list(arrivals), [FRAME * n for n in frames]
    u.ended = ended if ended is not None else arrivals[-1]
    return u


def test_first_late_chunk():
    on_time = utterance([0.0, 0.08, 0.24], [1, 2, 4])
    second = utterance([0.0, 0.12, 0.25], [1, 2, 4])  # due at 0.08
    third = utterance([0.0, 0.05, 0.30], [1, 2, 4])  # due at 0.24
    waiting = utterance([0.0], [1], outcome=CUT, ended=0.5)  # cut 420 ms after its audio ran out
    assert on_time.first_late_chunk is None
    assert second.first_late_chunk == 1 and third.first_late_chunk == 2
    assert waiting.first_late_chunk == -1
    level = summarize_level([on_time, second, third, waiting, utterance([0.0, 0.2], [1, 1])], window_s=1.0)
    assert level["underrun_utterances"] == 4
    assert level["first_late_chunk"] == {-1: 1, 1: 2, 2: 1}


def test_slowest_rounds_keep_their_split_and_time():
    rounds = [RoundTiming(started=10.0 + i * 0.02, wall_s=0.015, prefill_s=0.001, decode_s=0.008, vocoder_s=0.004,
                          opened=0, stepped=30) for i in range(50)]
    rounds[20] = RoundTiming(started=10.4, wall_s=1.5, prefill_s=0.001, decode_s=0.008, vocoder_s=0.004,
                             opened=2, stepped=31)
    slowest = summarize_rounds(rounds, level_wall_s=2.5)["slowest"]
    assert len(slowest) == 3
    assert slowest[0]["wall_ms"] == pytest.approx(1500) and slowest[0]["host_ms"] == pytest.approx(1487)
    assert slowest[0]["started_s"] == pytest.approx(0.4) and slowest[0]["opened"] == 2
    assert slowest[1]["wall_ms"] == pytest.approx(15)


def test_low_slack_chunks_are_placed_against_the_rounds_they_came_after():
    rounds = [RoundTiming(started=10.0 + i * 0.02, wall_s=0.015, prefill_s=0.001, decode_s=0.008, vocoder_s=0.004,
                          opened=0, stepped=30) for i in range(50)]
    rounds[19] = RoundTiming(started=10.38, wall_s=0.035, prefill_s=0.012, decode_s=0.008, vocoder_s=0.004,
                             opened=4, stepped=30)
    # The engine's record: the chunks under the margin only, each with its place in its stream.
    watch = SlackWatch(0.02)
    watch.note(0.05, 10.205, chunk=1, streamed=True)  # over the margin: not kept
    watch.note(0.012, 10.415, chunk=1, streamed=True)  # in round 20, after the slow round 19
    watch.note(0.018, 10.605, chunk=3, streamed=False)  # in round 30
    watch.note(0.015, 10.905, chunk=6, streamed=False)  # in round 45
    assert [e[2] for e in watch.low_events_since(10.4)] == [1, 3, 6]
    assert watch.low_events_since(10.5)[0][0] == pytest.approx(10.605)
    placed = place_low_slack(watch.low_events_since(0.0), rounds)
    assert placed["chunks"] == 3 and placed["streamed"] == 1
    assert placed["by_chunk"] == {"chunk 2": 1, "chunk 4": 1, "5th or later": 1}
    assert placed["slack_ms_min"] == pytest.approx(12.0)
    lowest = placed["lowest"][0]
    assert lowest["chunk"] == 2 and lowest["streamed"]
    # Rounds 18, 19 and 20: the slow one with its four opens in the middle.
    assert [r["wall_ms"] for r in lowest["rounds"]] == pytest.approx([15.0, 35.0, 15.0])
    assert lowest["rounds"][1]["opened"] == 4 and lowest["rounds"][1]["prefill_ms"] == pytest.approx(12.0)
    assert placed["last_3_rounds_mean"]["wall_ms"] == pytest.approx((65 + 45 + 45) / 3)
    assert placed["any_3_rounds_mean"]["wall_ms"] == pytest.approx(3 * (49 * 15 + 35) / 50)
    assert place_low_slack([], rounds) is None
    assert place_low_slack([(9.0, 0.01, 1, False)], rounds) is None  # before the level's first round


def test_early_chunks_of_whole_texts_and_streamed_turns_are_compared_whatever_their_slack():
    watch = SlackWatch(0.02)
    watch.note(0.050, 10.0, chunk=1, streamed=False, rounds=1)
    watch.note(0.045, 10.1, chunk=1, streamed=False, rounds=1)
    watch.note(0.130, 10.2, chunk=2, streamed=False, rounds=3)
    watch.note(0.010, 10.3, chunk=1, streamed=True, rounds=2)  # under the margin: in both records
    watch.note(0.040, 10.4, chunk=1, streamed=True, rounds=1)
    watch.note(0.020, 10.5, chunk=1, streamed=True, rounds=7)
    watch.note(0.300, 10.6, chunk=3, streamed=True, rounds=7)  # a fourth chunk: not an early one
    watch.note(0.300, 10.7, chunk=2, streamed=True)  # no round count given: not kept
    assert len(watch.low_events_since(0.0)) == 1
    events = watch.early_events_since(10.05)
    assert [e[0] for e in events] == pytest.approx([10.1, 10.2, 10.3, 10.4, 10.5])
    early = compare_early_chunks(watch.early_events_since(0.0))
    assert set(early) == {"whole", "streamed"}
    whole, streamed = early["whole"], early["streamed"]
    assert set(whole) == {"chunk 2", "chunk 3"} and set(streamed) == {"chunk 2"}
    assert whole["chunk 2"]["n"] == 2 and whole["chunk 2"]["rounds_since_first"] == {"1": 2}
    assert whole["chunk 3"]["rounds_since_first"] == {"3": 1}
    assert streamed["chunk 2"]["rounds_since_first"] == {"1": 1, "2": 1, "4+": 1}
    assert streamed["chunk 2"]["slack_ms_p50"] == pytest.approx(20.0)
    assert streamed["chunk 2"]["slack_ms_p5"] < 20.0
    assert compare_early_chunks([]) is None
