"""Every request field is checked with a clear InvalidInputError, and text reaches the model as given
(issue 32, items 7, 12 and 16). Real engine, tiny random checkpoint, CPU."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from pipecat_qwen_fast import InvalidInputError, QwenTTSEngine, SynthesisRequest
from pipecat_qwen_fast.engine.service import EngineService
from pipecat_qwen_fast.model.sampling import SamplingParams

CPU = {"device": "cpu", "dtype": "float32", "backend": "torch"}


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return QwenTTSEngine.from_pretrained(tiny_checkpoint("custom_voice", zero_eos=True), progress=False, **CPU)


def codes_of(engine, text: str, **kw) -> np.ndarray:
    kw = {"voice": "ryan", "greedy": True, "max_frames": 3, **kw}
    return engine.generate_codes(text, **kw).numpy()


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("text", None, "text"),
        ("text", b"Hello.", "text"),
        ("voice", 123, "voice"),
        ("language", 5, "language"),
        ("instruct", ["calm"], "instruct"),
        ("seed", "1", "seed"),
        ("seed", 1.5, "seed"),
        ("seed", True, "seed"),
        ("seed", -1, "seed"),
        ("greedy", "yes", "greedy"),
        ("text_mode", 1, "text_mode"),
        ("text_mode", "streaming", "text_mode"),
        ("voice_clone", "alice", "voice_clone"),
        ("first_chunk_frames", 0, "first_chunk_frames"),
        ("first_chunk_frames", 1.0, "first_chunk_frames"),
        ("chunk_frames", "3", "chunk_frames"),
        ("chunk_growth", 0, "chunk_growth"),
        ("max_chunk_frames", 0, "max_chunk_frames"),
        ("max_chunk_frames", 2.5, "max_chunk_frames"),
        ("max_frames", 2.5, "max_frames"),
        ("max_frames", 0, "max_frames"),
        ("max_frames", False, "max_frames"),
        ("sampling", {"temperature": 0.5}, "sampling"),
        ("sampling", SamplingParams(top_k=2.5), "top_k"),
        ("sampling", SamplingParams(do_sample="no"), "do_sample"),
        ("sampling", SamplingParams(temperature="hot"), "temperature"),
        ("vocode", None, "vocode"),
    ],
)
def test_every_field_is_checked_with_a_clear_error(engine, field, value, named):
    request = SynthesisRequest("Hello there.", voice="ryan", max_frames=2)
    setattr(request, field, value)
    with pytest.raises(InvalidInputError) as info:
        engine.open_session(request)
    assert named in str(info.value)
    # The message names the field and what it takes, never the text.
    assert "Hello there." not in str(info.value)


def test_a_request_that_is_not_a_synthesis_request_is_refused(engine):
    with pytest.raises(InvalidInputError, match="SynthesisRequest"):
        engine.open_session({"text": "Hello."})


def test_numpy_integers_are_accepted(engine):
    s = engine.open_session(SynthesisRequest("Hello.", voice="ryan", seed=np.int64(3),
                                             max_frames=np.int32(2)))
    while not s.done:
        engine.step(s)
    assert s.frames_decoded == 2


async def test_bad_fields_reach_the_service_caller_as_invalid_input(engine):
    service = EngineService.for_engine(engine)
    try:
        await service.wait_ready()
        for bad in ({"voice": 123}, {"max_frames": 2.5}):
            with pytest.raises(InvalidInputError):
                await asyncio.wait_for(service.synthesize(SynthesisRequest("Hi.", **bad)), 60)
        pcm = await asyncio.wait_for(service.synthesize(SynthesisRequest("Hi.", voice="ryan", max_frames=2)), 60)
        assert len(pcm) == 2 * 1920
    finally:
        service.close()


# -- item 7: lone surrogates -----------------------------------------------------------------


def test_lone_surrogates_are_dropped_and_pairs_joined(engine):
    # A lone half of a UTF-16 pair carries no speech (it is what is left of an emoji cut in two);
    # a pair written as two halves is the character it encodes.
    assert np.array_equal(codes_of(engine, "Hello \ud800there."), codes_of(engine, "Hello there."))
    assert np.array_equal(codes_of(engine, "Hi \ud83d\ude00 there."), codes_of(engine, "Hi \U0001f600 there."))
    assert np.array_equal(codes_of(engine, "Calm.", instruct=None),
                          codes_of(engine, "Calm.\udfff", instruct=None))


def test_text_of_lone_surrogates_only_is_empty(engine):
    with pytest.raises(InvalidInputError, match="empty"):
        engine.open_session(SynthesisRequest("\ud800 \udc00", voice="ryan"))


# -- item 16: the text reaches the tokenizer as given ------------------------------------------


def test_text_is_kept_as_given(engine):
    """Leading and trailing whitespace and control characters are the caller's: the official
    package tokenizes them, so the engine does too (tests/test_oracle_text.py compares the codes)."""
    for text in ("  Hello there.  ", "Hello\tthere.\n", "Hello\x07 there.", "\nHello there."):
        s = engine.open_session(SynthesisRequest(text, voice="ryan", max_frames=1))
        try:
            assert s.segments[0] == text
        finally:
            engine.close_session(s)
    assert not np.array_equal(codes_of(engine, "  Hello there."), codes_of(engine, "Hello there."))
