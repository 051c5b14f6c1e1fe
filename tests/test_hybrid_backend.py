"""The auto backend's placement (first calls on one backend, the rest batched on the other), on CPU
over the two real PyTorch backends: the eager reference as the per-call side, the graph backend's
batched frame (run eagerly) as the batch. On a GPU the per-call side is the megakernel
(tests/test_megakernel.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers_service import step_until_done

from pipecat_qwen_fast import QwenTTSEngine, SynthesisRequest
from pipecat_qwen_fast.backends.eager import TorchBackend
from pipecat_qwen_fast.backends.graph import GraphBackend
from pipecat_qwen_fast.backends.hybrid import HybridBackend


def _hybrid_engine(path, fast_sessions=2, max_sessions=4):
    engine = QwenTTSEngine.from_pretrained(path, device="cpu", dtype="float32", backend="eager")
    bulk = GraphBackend(engine.model.talker, engine.device, engine.dtype, max_sessions=max_sessions, capacity=512,
                        use_graphs=False)
    # first_alone_below=0: the placement by load alone (a joining call's first frame on the
    # per-call side is tests/test_first_frame_alone.py's).
    engine.backend = HybridBackend(engine.backend, bulk, fast_sessions=fast_sessions, first_alone_below=0)
    return engine


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return _hybrid_engine(tiny_checkpoint("custom_voice", zero_eos=True))


def _request(i, frames=8):
    # Default sampling with a seed per call: every draw is the session's own, so a session's codes
    # do not depend on which others share its rounds.
    return SynthesisRequest(f"Caller number {i} speaking.", voice="aiden", seed=10 + i, max_frames=frames, vocode=False)


def _solo(engine, req, on_fast):
    with engine.backend.placed(on_fast):
        s = engine.open_session(req)
    assert s.state.on_fast is on_fast
    while not s.done:
        engine.step(s)
    return np.stack(s.codes)


def test_few_calls_on_fast_more_move_into_the_batch(engine):
    hb = engine.backend
    assert hb.name == "torch+torch-cudagraph" and hb.max_batch == 4 and hb.max_positions == 512 and hb.can_move
    sessions = [engine.open_session(_request(i)) for i in range(2)]
    assert [s.state.on_fast for s in sessions] == [True, True]
    moved = hb.moved
    sessions.append(engine.open_session(_request(2)))
    # The third call starts in the batch; the two fast calls move in with it before the next frame.
    assert [s.state.on_fast for s in sessions] == [True, True, False]
    engine.step_many(sessions)
    assert [s.state.on_fast for s in sessions] == [False, False, False]
    assert (hb.live_fast, hb.live_bulk, hb.moved - moved) == (0, 3, 2)
    engine.cancel(sessions[0])
    late = engine.open_session(_request(9))
    assert not late.state.on_fast, "while the batch has calls, new calls join it"
    for s in sessions[1:] + [late]:
        engine.cancel(s)
    assert (hb.live_fast, hb.live_bulk) == (0, 0)
    assert len(hb.bulk.free_slots) == 4, "closed batch sessions return their slots"
    s = engine.open_session(_request(5))
    assert s.state.on_fast, "once the batch drains, calls start on the fast side again"
    engine.cancel(s)


@pytest.mark.parametrize("run_ahead", [False, True])
def test_moved_calls_continue_exactly(engine, run_ahead):
    # Greedy in fp32: both sides give the same codes, so a call moved mid-utterance (K/V rows,
    # next input, code-0 history) must give the codes it gives alone. With run_ahead (the default
    # on a GPU) a call is moved with a frame already launched ahead on the per-call side: with 4-frame
    # second chunks, the frame after the 4th round completes no chunk, so it is launched ahead.
    reqs = [SynthesisRequest(f"Moved call {i}, a little longer.", voice="aiden", greedy=True, max_frames=10,
                             vocode=False, chunk_frames=4) for i in range(3)]
    solo = [engine.generate_codes(r.text, voice="aiden", greedy=True, max_frames=10).numpy() for r in reqs]
    engine.run_ahead = run_ahead
    first: list = []
    try:
        first += [engine.open_session(r) for r in reqs[:2]]
        for _ in range(4):
            if run_ahead:  # one call a round: a session alone in its round runs a frame ahead
                for s in first:
                    engine.step_many([s])
            else:
                engine.step_many(first)
        assert all(s.state.on_fast for s in first)
        assert all((s.ahead is not None) == run_ahead for s in first)
        moved = engine.backend.moved
        first.append(engine.open_session(reqs[2]))
        results = step_until_done(engine, first)
    finally:
        engine.run_ahead = False
        for s in first:  # a failed assertion must not leave calls live for the next test
            engine.cancel(s)
    assert engine.backend.moved - moved == 2
    for codes, expected in zip(results, solo):
        assert np.array_equal(codes, expected)


def test_moved_sampled_calls_repeat(engine):
    def scenario():
        first = [engine.open_session(_request(i)) for i in range(2)]
        for _ in range(3):
            engine.step_many(first)
        return step_until_done(engine, first + [engine.open_session(_request(2))])

    a, b = scenario(), scenario()
    assert all(np.array_equal(x, y) for x, y in zip(a, b)), "same seeds, same moment of the move: same codes"
    assert all(x.shape == (8, 16) and int(x.max()) < 2048 for x in a)


def test_mixed_rounds_equal_each_call_alone(engine):
    # Backends that cannot move a call share rounds: each call's codes are still its own.
    hb = engine.backend
    hb.can_move = False
    try:
        reqs = [_request(i) for i in range(4)]
        solo = [_solo(engine, r, on_fast=i < 2) for i, r in enumerate(reqs)]
        assert not np.array_equal(solo[0], solo[1]), "different seeds, different codes"
        with hb.placed(True):
            sessions = [engine.open_session(r) for r in reqs[:2]]
        with hb.placed(False):
            sessions += [engine.open_session(r) for r in reqs[2:]]
        for codes, expected in zip(step_until_done(engine, sessions), solo):
            assert np.array_equal(codes, expected)
    finally:
        hb.can_move = True
    assert (hb.live_fast, hb.live_bulk) == (0, 0)


def test_full_batch_overflows_to_fast(tiny_checkpoint):
    engine = _hybrid_engine(tiny_checkpoint("custom_voice", zero_eos=True), fast_sessions=0, max_sessions=2)
    sessions = [engine.open_session(_request(i, frames=2)) for i in range(3)]
    assert [s.state.on_fast for s in sessions] == [False, False, True]
    assert all(len(c) == 2 for c in step_until_done(engine, sessions))
    assert (engine.backend.live_fast, engine.backend.live_bulk) == (0, 0)


def test_move_stops_when_the_batch_is_full(tiny_checkpoint):
    engine = _hybrid_engine(tiny_checkpoint("custom_voice", zero_eos=True), fast_sessions=2, max_sessions=2)
    sessions = [engine.open_session(_request(i, frames=3)) for i in range(3)]
    engine.step_many(sessions)
    # The third call takes a slot, the first moves into the last one, the second stays.
    assert [s.state.on_fast for s in sessions] == [False, True, False]
    assert all(len(c) == 3 for c in step_until_done(engine, sessions))
    assert (engine.backend.live_fast, engine.backend.live_bulk) == (0, 0)


def test_warmup_runs_both_sides(engine):
    hb = engine.backend
    started, moved = dict(hb.started), hb.moved
    engine.warmup()
    assert hb.started["fast"] - started["fast"] == 2 and hb.started["bulk"] - started["bulk"] == 2
    assert hb.force is None and (hb.live_fast, hb.live_bulk) == (0, 0)
    assert hb.moved == moved, "warm-up moves nothing"


def test_released_state_and_double_release(engine):
    hb = engine.backend
    s = engine.open_session(_request(3, frames=4))
    state = s.state
    engine.cancel(s)
    with pytest.raises(RuntimeError, match="released"):
        hb.decode_frame(state)
    hb.release(state)  # a second release changes nothing
    assert (hb.live_fast, hb.live_bulk) == (0, 0)


def test_bad_fast_sessions():
    with pytest.raises(ValueError, match="fast_sessions"):
        HybridBackend(object(), object(), fast_sessions=-1)


def test_eager_bulk_without_decode_frames(tiny_checkpoint):
    # Any backend pair works: a batch side with no decode_frames is stepped one call at a time.
    engine = QwenTTSEngine.from_pretrained(tiny_checkpoint("custom_voice", zero_eos=True), device="cpu",
                                           dtype="float32", backend="eager")
    talker = engine.model.talker
    engine.backend = HybridBackend(engine.backend, TorchBackend(talker, engine.device, engine.dtype), fast_sessions=1,
                                   first_alone_below=0)
    sessions = [engine.open_session(SynthesisRequest("Two calls.", voice="ryan", greedy=True, max_frames=3,
                                                     vocode=False)) for _ in range(2)]
    assert [s.state.on_fast for s in sessions] == [True, False]
    while not all(s.done for s in sessions):
        engine.step_many(sessions)
    assert np.array_equal(np.stack(sessions[0].codes), np.stack(sessions[1].codes)), "greedy: same codes on both"
    assert torch.is_tensor(engine.generate_codes("One more.", voice="ryan", greedy=True, max_frames=2))


def test_burst_opened_together(engine):
    # Calls opened in one go are placed as one: a burst within the fast side's share stays there;
    # a larger one goes to the batch whole (one batched prefill, nothing to move).
    hb = engine.backend
    reqs = [SynthesisRequest(f"Burst call {i} of four.", voice="aiden", greedy=True, max_frames=5, vocode=False)
            for i in range(4)]
    solo = [engine.generate_codes(r.text, voice="aiden", greedy=True, max_frames=5).numpy() for r in reqs]
    pair = engine.open_sessions(reqs[:2])
    assert [s.state.on_fast for s in pair] == [True, True]
    for s in pair:
        engine.cancel(s)
    before, moved = hb.bulk.batched_prefills, hb.moved
    hb.bulk.batched_prefill_min = 2
    try:
        sessions = engine.open_sessions(reqs)
    finally:
        hb.bulk.batched_prefill_min = 8
    assert [s.state.on_fast for s in sessions] == [False] * 4 and hb.burst == 0
    assert hb.bulk.batched_prefills == before + 1
    for codes, expected in zip(step_until_done(engine, sessions), solo):
        assert np.array_equal(codes, expected)
    assert hb.moved == moved and (hb.live_fast, hb.live_bulk) == (0, 0)


def test_a_call_with_a_previewed_frame_stays_until_that_frame_has_run(tiny_checkpoint):
    # Streamed text sends frame 0 from a preview (engine/text_first_frame.py); the batch taking the
    # call before the frame ran would make frame 0 again. It moves once the frame has run, and
    # its codes are those of the call left on the per-call side.
    engine = _hybrid_engine(tiny_checkpoint("custom_voice", zero_eos=True), fast_sessions=1)
    hb = engine.backend
    req = SynthesisRequest("A previewed first frame.", voice="aiden", greedy=True, max_frames=8, vocode=False)
    want = _solo(engine, req, on_fast=True)
    s = engine.open_session(req)
    assert s.state.on_fast
    previewed = hb.fast.preview_frame(s.state.inner)
    other = engine.open_session(_request(1))  # the batch now has a call
    assert not other.state.on_fast
    moves = []
    adopt = hb.bulk.adopt_state
    hb.bulk.adopt_state = lambda snap: moves.append(snap.frame) or adopt(snap)
    try:
        engine.step_many([s, other])
    finally:
        del hb.bulk.adopt_state
    assert moves == [1], "moved before its previewed frame ran"
    assert torch.equal(torch.from_numpy(s.codes[0]), previewed.cpu())
    codes = step_until_done(engine, [s, other])[0]
    assert hb.moved >= 1 and np.array_equal(codes, want)
