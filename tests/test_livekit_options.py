"""LiveKit plugin options and logs (issue 32, items 4 and 5): language codes, checks at construction
and update, every runtime option updatable, an output sample rate, conn_options.timeout, and no
user text in any log record. The real engine on tiny random checkpoints (CPU)."""

from __future__ import annotations

import asyncio
import logging
import time

import numpy as np
import pytest

pytest.importorskip("livekit.agents")

from livekit.agents import APIConnectOptions, APIError, APITimeoutError
from livekit.plugins import qwen_fast

from pipecat_qwen_fast import InvalidInputError, QwenTTSEngine, SynthesisRequest
from pipecat_qwen_fast.engine.service import EngineService, get_shared_service

CPU = {"device": "cpu", "dtype": "float32", "backend": "torch"}
TIMEOUT = 120
NO_RETRY = APIConnectOptions(max_retry=0, timeout=TIMEOUT)
MARKER = "Zanzibar quokka marmalade"


async def make_tts(model, **kw) -> qwen_fast.TTS:
    await asyncio.wait_for(get_shared_service(model, **CPU), TIMEOUT)
    kw.setdefault("seed", 1)
    return qwen_fast.TTS(model=model, **CPU, **kw)


async def collect(stream):
    async with stream:
        return [ev async for ev in stream]


def pcm_of(events) -> np.ndarray:
    return np.concatenate([np.frombuffer(bytes(ev.frame.data), dtype="<i2") for ev in events])


# -- item 4: languages --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "name"),
    [("en", "english"), ("en-US", "english"), ("EN_gb", "english"), ("fr", "french"),
     ("zh-CN", "chinese"), ("cmn-Hans-CN", "chinese"), ("pt-BR", "portuguese"), ("ja", "japanese"),
     ("English", "english"), ("german", "german"), ("multi", "auto"), ("auto", "auto")],
)
def test_language_codes_become_qwen_names(given, name):
    tts = qwen_fast.TTS(model="unused", language=given, **CPU)
    assert tts.language == name


@pytest.mark.parametrize("bad", ["klingon", "xx-YY", "nl", ""])
def test_unknown_language_is_refused_at_construction_naming_the_choices(bad):
    with pytest.raises(InvalidInputError) as info:
        qwen_fast.TTS(model="unused", language=bad, **CPU)
    message = str(info.value)
    assert "english" in message and "en-US" in message


async def test_a_language_code_speaks(endless_model):
    tts = await make_tts(endless_model, language="en-US", max_frames=3)
    events = await asyncio.wait_for(collect(tts.synthesize("Hello there.", conn_options=NO_RETRY)), TIMEOUT)
    assert len(pcm_of(events)) >= 3 * 1920


# -- item 4: checks and updates -----------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [{"voice": 123}, {"max_frames": 2.5}, {"seed": "7"}, {"first_chunk_frames": 0}, {"greedy": "yes"},
     {"text_mode": "fast"}, {"sample_rate": 0}, {"sample_rate": 16000.5}, {"instruct": 3}],
)
def test_bad_options_are_refused_at_construction(options):
    with pytest.raises(InvalidInputError):
        qwen_fast.TTS(model="unused", **CPU, **options)


async def test_update_options_covers_every_runtime_option_and_checks_them(endless_model):
    tts = await make_tts(endless_model, max_frames=6)
    changes = dict(voice="serena", language="fr-FR", instruct=None, seed=5, greedy=True,
                   text_mode="dual_track", first_chunk_frames=2, chunk_frames=2, max_chunk_frames=None,
                   chunk_growth=2, max_frames=3)
    tts.update_options(**changes)
    events = await asyncio.wait_for(collect(tts.synthesize("Bonjour.", conn_options=NO_RETRY)), TIMEOUT)
    service = await get_shared_service(endless_model, **CPU)
    expected = await service.synthesize(SynthesisRequest("Bonjour.", **dict(changes, language="french")))
    assert np.array_equal(pcm_of(events)[: len(expected)], expected)

    for bad in ({"max_frames": 2.5}, {"language": "klingon"}, {"voice": 123}, {"chunk_frames": 0},
                {"chunk_growth": 0}):
        with pytest.raises(InvalidInputError):
            tts.update_options(**bad)
    # A refused update changes nothing: the last good options still hold.
    events = await asyncio.wait_for(collect(tts.synthesize("Bonjour.", conn_options=NO_RETRY)), TIMEOUT)
    assert np.array_equal(pcm_of(events)[: len(expected)], expected)


async def test_update_options_checks_the_voice_against_the_loaded_model(endless_model):
    tts = await make_tts(endless_model, max_frames=2)
    tts.prewarm()
    await tts.engine_service.wait_ready()
    with pytest.raises(InvalidInputError, match="serena"):
        tts.update_options(voice="nobody")


# -- item 4: sample rate ------------------------------------------------------------------------


@pytest.mark.parametrize("streaming_text", [False, True])
async def test_sample_rate_option_resamples_the_engine_audio(endless_model, streaming_text):
    tts = await make_tts(endless_model, sample_rate=16000, max_frames=6, streaming_text=streaming_text)
    assert tts.sample_rate == 16000
    events = await asyncio.wait_for(collect(tts.synthesize("Hello there.", conn_options=NO_RETRY)), TIMEOUT)
    stream = tts.stream(conn_options=NO_RETRY)
    stream.push_text("Hello there.")
    stream.end_input()
    streamed = await asyncio.wait_for(collect(stream), TIMEOUT)
    for evs in (events, streamed):
        assert all(ev.frame.sample_rate == 16000 for ev in evs)
        n = len(pcm_of(evs))
        # 6 frames of 1920 samples at 24 kHz are 7,680 at 16 kHz (a trailing 10 ms marker aside).
        assert 7680 - 32 <= n <= 7680 + 160 + 32, n
        assert np.abs(pcm_of(evs)).max() > 0


# -- item 4: conn_options.timeout ---------------------------------------------------------------


@pytest.fixture
def slow_service(endless_model, monkeypatch):
    """A service whose engine takes 0.5 s a frame (latency injected around the real step)."""
    engine = QwenTTSEngine.from_pretrained(endless_model, progress=False, **CPU)
    real_step = engine.step

    def slow_step(session):
        time.sleep(0.5)
        return real_step(session)

    monkeypatch.setattr(engine, "step", slow_step)
    service = EngineService.for_engine(engine)
    yield service
    service.close()


async def test_conn_options_timeout_bounds_the_wait_for_the_engine(slow_service):
    tts = qwen_fast.TTS(model="unused", engine_service=slow_service, seed=1, max_frames=8,
                        first_chunk_frames=8, streaming_text=False)
    await slow_service.wait_ready()
    started = time.monotonic()
    with pytest.raises(APITimeoutError):
        await asyncio.wait_for(collect(tts.synthesize(
            "Slowly.", conn_options=APIConnectOptions(max_retry=0, timeout=0.6))), TIMEOUT)
    assert time.monotonic() - started < 3.0
    deadline = time.monotonic() + 10
    while not slow_service.history and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    (record,) = slow_service.history
    assert record.stop_reason == "cancelled" and record.frames_decoded < 8


# -- item 5: no user text in any log record -----------------------------------------------------


class Everything(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def leaks(self, text: str) -> list[str]:
        out = []
        for r in self.records:
            fields = [r.getMessage(), *(str(v) for v in vars(r).values())]
            if any(text in f for f in fields):
                out.append(f"{r.name}: {r.getMessage()[:120]}")
        return out


@pytest.fixture
def every_record():
    handler = Everything()
    root = logging.getLogger()
    old = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    for name in ("livekit", "livekit.agents", "livekit.plugins.qwen_fast"):
        logging.getLogger(name).setLevel(logging.DEBUG)
    yield handler
    root.removeHandler(handler)
    root.setLevel(old)


async def test_no_log_record_holds_the_text(endless_model, every_record):
    tts = await make_tts(endless_model, max_frames=3)
    await asyncio.wait_for(collect(tts.synthesize(f"{MARKER} one.", conn_options=NO_RETRY)), TIMEOUT)
    for streaming_text in (False, True):
        tts = await make_tts(endless_model, max_frames=3, streaming_text=streaming_text)
        stream = tts.stream(conn_options=NO_RETRY)
        stream.push_text(f"{MARKER} two. And three.")
        stream.end_input()
        await asyncio.wait_for(collect(stream), TIMEOUT)
    bad = await make_tts(endless_model, max_frames=3, voice="nobody")
    with pytest.raises(APIError):
        await asyncio.wait_for(collect(bad.synthesize(f"{MARKER} four.", conn_options=NO_RETRY)), TIMEOUT)
    assert every_record.records, "the handler saw nothing: it is not catching the plugin's records"
    assert not every_record.leaks(MARKER), every_record.leaks(MARKER)


async def test_text_that_makes_no_audio_is_our_error_without_the_text(endless_model, every_record):
    """LiveKit's base class raises "no audio frames were pushed for text: <the text>" and logs it
    on every retry; the plugin reports such a text itself, without it."""
    tts = await make_tts(endless_model, max_frames=3)
    text = "\udc00\ud83d"  # lone surrogate halves: nothing to say once they are dropped
    stream = tts.stream(conn_options=APIConnectOptions(max_retry=1, retry_interval=0.0, timeout=TIMEOUT))
    stream.push_text(text)
    stream.end_input()
    with pytest.raises(APIError) as info:
        await asyncio.wait_for(collect(stream), TIMEOUT)
    assert "no audio frames were pushed for text" not in str(info.value)
    assert text not in str(info.value)
    assert not every_record.leaks(text), every_record.leaks(text)
