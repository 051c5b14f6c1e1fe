"""Round trip: a Base checkpoint speaks a WAV, a voice is made from that WAV through the CLI, saved,
loaded, and spoken with through the CLI, Pipecat and LiveKit, each giving the engine's own audio
for that voice (so the voice really was used, not a default or an error)."""

from __future__ import annotations

import asyncio
import wave
from pathlib import Path

import numpy as np
import pytest
import torch

from pipecat_qwen_fast.cli import main as cli_main
from pipecat_qwen_fast.cli import write_wav
from pipecat_qwen_fast.engine.service import get_shared_service
from pipecat_qwen_fast.model.prompt import VoiceClonePrompt
from pipecat_qwen_fast.voices import load_voice

CPU = {"device": "cpu", "dtype": "float32", "backend": "torch"}
CPU_ARGS = ["--device", "cpu", "--dtype", "float32", "--backend", "torch"]
TIMEOUT = 120
FRAMES = 4
SEED = 5
REF_TEXT = "A sentence spoken by the random model."
SAY = "Hello from a cloned voice."


def read_wav(path: Path) -> np.ndarray:
    with wave.open(str(path), "rb") as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 24000)
        return np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")


@pytest.fixture(scope="module")
def model(tiny_checkpoint) -> Path:
    # EOS never fires: every utterance runs to its frame cap, so lengths are known.
    return tiny_checkpoint("base", zero_eos=True)


@pytest.fixture(scope="module")
def engine(model):
    from pipecat_qwen_fast.engine.engine import QwenTTSEngine

    return QwenTTSEngine.from_pretrained(model, progress=False, **CPU)


@pytest.fixture(scope="module")
def voice_file(tmp_path_factory, model, engine) -> Path:
    """The model's own speech (random x-vector) as a 1.9 s WAV, made into an ICL voice by the CLI."""
    out = tmp_path_factory.mktemp("roundtrip")
    speaker = VoiceClonePrompt(x_vector=torch.randn(engine.config.talker.hidden_size,
                                                    generator=torch.Generator().manual_seed(0)))
    spoken = engine.synthesize("Some words to clone a voice from.", voice_clone=speaker, seed=0, max_frames=24)
    assert spoken.stop_reason == "frame_cap" and np.abs(spoken.pcm).max() > 100
    ref = out / "ref.wav"
    write_wav(ref, spoken.pcm, 24000)
    voice = out / "alice.voice"
    assert cli_main(["voice", "create", str(ref), "--text", REF_TEXT, "--name", "alice", "-o", str(voice),
                     "--model", str(model), "--device", "cpu", "--dtype", "float32"]) == 0
    return voice


@pytest.fixture(scope="module")
def expected(engine, voice_file) -> np.ndarray:
    """The engine's streamed audio for SAY with the voice (the reference every adapter must
    reproduce bit for bit: they all stream with the default chunk schedule)."""
    chunks = engine.stream(SAY, voice=str(voice_file), seed=SEED, max_frames=FRAMES)
    return np.concatenate([c.pcm for c in chunks])


def test_voice_file_holds_the_reference(voice_file):
    voice = load_voice(voice_file)
    assert (voice.name, voice.mode, voice.prompt.ref_text) == ("alice", "icl", REF_TEXT)
    assert voice.ref_frames == 24 and voice.ref_seconds == pytest.approx(24 * 0.08)


def test_cli_says_with_the_voice_file(tmp_path, model, voice_file, expected):
    out = tmp_path / "said.wav"
    assert cli_main(["say", SAY, "--voice", str(voice_file), "--seed", str(SEED), "--max-frames", str(FRAMES),
                     "-o", str(out), "--model", str(model), *CPU_ARGS]) == 0
    assert np.array_equal(read_wav(out), expected)


def test_cli_refuses_a_bad_reference(tmp_path, model, capsys):
    bad = tmp_path / "bad.wav"
    bad.write_bytes(b"not audio at all" * 20)
    assert cli_main(["voice", "create", str(bad), "-o", str(tmp_path / "x.voice"), "--model", str(model),
                     "--device", "cpu", "--dtype", "float32"]) == 2
    assert "cannot be read as audio" in capsys.readouterr().err


async def test_pipecat_speaks_with_the_voice_by_path_and_by_name(model, voice_file, expected):
    from pipecat.frames.frames import ErrorFrame, TTSAudioRawFrame, TTSSpeakFrame
    from pipecat.tests.utils import run_test

    from pipecat_qwen_fast import QwenFastTTSService

    service = await asyncio.wait_for(get_shared_service(model, **CPU), TIMEOUT)
    service.engine.voice_library.load(voice_file, name="alice-pc")
    for voice in (str(voice_file), "alice-pc"):
        tts = QwenFastTTSService(model=model, settings=QwenFastTTSService.Settings(voice=voice), seed=SEED,
                                 max_frames=FRAMES, **CPU)
        down, up = await asyncio.wait_for(
            run_test(tts, frames_to_send=[TTSSpeakFrame(SAY)], start_timeout=30), TIMEOUT)
        assert not [f for f in up if isinstance(f, ErrorFrame)]
        audio = b"".join(f.audio for f in down if isinstance(f, TTSAudioRawFrame))
        assert np.array_equal(np.frombuffer(audio, dtype="<i2"), expected), voice


async def test_livekit_speaks_with_the_voice_by_path_and_by_name(model, voice_file, expected):
    from livekit.agents import APIConnectOptions
    from livekit.plugins import qwen_fast

    service = await asyncio.wait_for(get_shared_service(model, **CPU), TIMEOUT)
    service.engine.voice_library.load(voice_file, name="alice-lk")
    for voice in (str(voice_file), "alice-lk"):
        tts = qwen_fast.TTS(model=model, voice=voice, seed=SEED, max_frames=FRAMES, **CPU)
        async with tts.synthesize(SAY, conn_options=APIConnectOptions(max_retry=0, timeout=TIMEOUT)) as stream:
            events = [ev async for ev in stream]
        pcm = np.concatenate([np.frombuffer(bytes(ev.frame.data), dtype="<i2") for ev in events])
        # LiveKit may end with a 10 ms silent marker frame.
        assert np.array_equal(pcm[: expected.size], expected) and not pcm[expected.size:].any(), voice
        await tts.aclose()
