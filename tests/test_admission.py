"""Admission control (issue 34): a service at its `max_streams` refuses the next request with
EngineOverloadedError at once, serves again once a stream ends, and the LiveKit plugin passes the
refusal on as a retryable error. Real engine, tiny checkpoint, CPU."""

from __future__ import annotations

import asyncio

import pytest

from pipecat_qwen_fast import EngineOverloadedError, QwenTTSEngine, SynthesisRequest
from pipecat_qwen_fast.engine.service import EngineService

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
        assert err.value.retry_after_s > 0
        with pytest.raises(EngineOverloadedError):
            service.open_text_stream(SynthesisRequest("", seed=9, max_frames=3))
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
