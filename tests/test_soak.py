"""A bounded soak of the EngineService (issue 32, "what it must show"): 1,000 requests on the tiny
checkpoint on CPU, up to 8 in flight, with random cancels and bad inputs mixed in.

It asserts: no request hangs; every bad input is an InvalidInputError and leaves the service
working; every good request's audio and codes equal those of the same request run alone (greedy);
a cancelled request got a prefix of that audio and the engine stopped within one frame of the
cancel; and at the end no stream, session or K/V state is left (the backend's states are counted
as they are made and released, by wrapping its real calls).
"""

from __future__ import annotations

import asyncio
import random
import time

import numpy as np
import pytest
import torch
from helpers_faults import StateCount

from pipecat_qwen_fast import InvalidInputError, QwenTTSEngine, SynthesisRequest
from pipecat_qwen_fast.engine.service import EngineService

pytestmark = pytest.mark.slow

CPU = {"device": "cpu", "dtype": "float32", "backend": "torch"}
REQUESTS = 1000
IN_FLIGHT = 8
BAD_SHARE = 0.2
CANCEL_SHARE = 0.25
HANG_S = 60  # no request of at most 4 frames takes this long, even on a loaded 2-core machine

TEXTS = ["Hi.", "Hello there.", "How are you today?", "Fine, thanks.", "  See you soon!  ",
         "One \ud800two.", "Okay\u0007 then."]
VOICES = ["ryan", "serena", "eric"]


def good_pool() -> list[SynthesisRequest]:
    rng = random.Random(1)
    pool = []
    for i in range(24):
        pool.append(SynthesisRequest(
            TEXTS[i % len(TEXTS)], voice=VOICES[i % len(VOICES)], greedy=True, max_frames=1 + i % 4,
            first_chunk_frames=1, chunk_frames=rng.choice([1, 2, 3]), max_chunk_frames=rng.choice([None, 4]),
            text_mode=rng.choice(["prefill", "dual_track"]), language=rng.choice(["auto", "english"]),
        ))
    return pool


BAD = [
    {"voice": 123}, {"max_frames": 2.5}, {"voice": "nobody"}, {"text": "   "}, {"language": "klingon"},
    {"text": "\udfff \ud800"}, {"chunk_frames": 0}, {"seed": -1}, {"text": None}, {"greedy": "yes"},
]


async def run_alone(service, request) -> tuple[np.ndarray, np.ndarray]:
    chunks = [c async for c in service.open_stream(request)]
    return np.concatenate([c.pcm for c in chunks]), np.concatenate([c.codes for c in chunks])


async def test_soak_a_thousand_requests_with_cancels_and_bad_inputs(finite_model, monkeypatch):
    engine = QwenTTSEngine.from_pretrained(finite_model, progress=False, **CPU)
    # Greedy, the tiny model's random weights hardly ever pick EOS; its EOS row scaled up, they do
    # (from frame 2, min_new_tokens) for some requests: both ends, EOS and the frame cap, are soaked.
    eos = engine.config.talker.codec_eos_id
    with torch.no_grad():
        engine.model.talker.codec_head.weight[eos] *= 1e3
    count = StateCount(engine.backend, monkeypatch)
    sessions: list = []
    real_open = engine.open_sessions

    def open_sessions(requests, **kwargs):
        opened = real_open(requests, **kwargs)
        sessions.extend(s for s in opened if not isinstance(s, Exception))
        return opened

    monkeypatch.setattr(engine, "open_sessions", open_sessions)
    service = EngineService.for_engine(engine)
    await service.wait_ready()
    pool = good_pool()
    expected = [await asyncio.wait_for(run_alone(service, r), HANG_S) for r in pool]

    rng = random.Random(32)
    stats = {"good": 0, "cancelled": 0, "bad": 0, "eos": 0}
    gate = asyncio.Semaphore(IN_FLIGHT)

    async def one(n: int) -> None:
        async with gate:
            if rng.random() < BAD_SHARE:
                bad = rng.choice(BAD)
                request = SynthesisRequest(bad.get("text", "Bad one."), voice="ryan", max_frames=2)
                for field, value in bad.items():
                    setattr(request, field, value)
                with pytest.raises(InvalidInputError):
                    await asyncio.wait_for(run_alone(service, request), HANG_S)
                stats["bad"] += 1
                return
            k = rng.randrange(len(pool))
            want_pcm, want_codes = expected[k]
            stream = service.open_stream(pool[k])
            if rng.random() < CANCEL_SHARE:
                keep = rng.randrange(0, 3)  # chunks to read before leaving (0: at once)
                got = []
                async for chunk in stream:
                    got.append(chunk)
                    if len(got) >= keep:
                        break
                record = await asyncio.wait_for(stream.aclose(), HANG_S)
                pcm = np.concatenate([c.pcm for c in got]) if got else np.zeros(0, np.int16)
                assert np.array_equal(pcm, want_pcm[: len(pcm)]), f"request {n}: cancelled audio is not a prefix"
                if record.frames_at_cancel is not None:
                    assert record.frames_decoded - record.frames_at_cancel <= 1
                stats["cancelled"] += 1
                return
            chunks = [c async for c in stream]
            pcm = np.concatenate([c.pcm for c in chunks])
            codes = np.concatenate([c.codes for c in chunks])
            assert np.array_equal(codes, want_codes), f"request {n}: codes differ from the request alone"
            assert np.array_equal(pcm, want_pcm), f"request {n}: audio differs from the request alone"
            stats["good"] += 1
            stats["eos"] += stream.record.stop_reason == "eos"

    started = time.monotonic()
    try:
        await asyncio.wait_for(asyncio.gather(*(one(n) for n in range(REQUESTS))), REQUESTS * 2)
        elapsed = time.monotonic() - started
        print(f"soak: {REQUESTS} requests in {elapsed:.1f} s: {stats}, {count.made} K/V states made")
        assert sum(stats[k] for k in ("good", "cancelled", "bad")) == REQUESTS
        assert min(stats["good"], stats["cancelled"], stats["bad"], stats["eos"]) > 0, stats
        # Nothing left behind: no stream, no open session, no K/V state.
        deadline = time.monotonic() + 10
        while (service._active or service._inbox or service._waiting) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert not service._active and not service._inbox and not service._waiting
        assert all(s.state is None and s.done for s in sessions)
        assert not count.live, f"{len(count.live)} K/V states leaked"
        assert service.alive
    finally:
        service.close()
