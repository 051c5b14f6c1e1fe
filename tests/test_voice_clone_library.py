"""The engine's voice library on a tiny random Base checkpoint: making voices in both modes, the
voice file, using a voice by name, path or object, the primed vocoder cache, and refusals."""

from __future__ import annotations

import contextlib
import math

import numpy as np
import pytest
import torch

from pipecat_qwen_fast.bench.voice_clone import synthetic_speech
from pipecat_qwen_fast.errors import InvalidInputError, UnsupportedFeatureError
from pipecat_qwen_fast.model.prompt import VoiceClonePrompt
from pipecat_qwen_fast.voices import Voice, load_voice

REF_TEXT = "This is the reference voice."
TEXT = "Hello there, how are you today?"
SAMPLES_PER_FRAME = 1920


@contextlib.contextmanager
def counted_primes(library):
    """Counts the library's reference decodes (vocoder priming) inside the block."""
    calls = []
    original = library.vocoder.prime_stream

    def counting(codes, stream):
        calls.append(tuple(codes.shape))
        return original(codes, stream)

    library.vocoder.prime_stream = counting
    try:
        yield calls
    finally:
        del library.vocoder.prime_stream


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    from pipecat_qwen_fast.engine.engine import QwenTTSEngine

    return QwenTTSEngine.from_pretrained(tiny_checkpoint("base"), device="cpu", dtype="float32",
                                         backend="torch", progress=False)


@pytest.fixture(scope="module")
def reference() -> np.ndarray:
    return synthetic_speech(2.3, 24000, seed=3)


@pytest.fixture(scope="module")
def alice(engine, reference) -> Voice:
    return engine.create_voice(reference, ref_text=REF_TEXT, name="alice", sample_rate=24000)


@pytest.fixture(scope="module")
def bob(engine, reference) -> Voice:
    return engine.create_voice(reference, name="bob", sample_rate=24000)


def test_icl_and_x_vector_voices(engine, alice, bob, reference):
    d = engine.config.talker.hidden_size
    assert (alice.mode, bob.mode) == ("icl", "x_vector")
    assert alice.prompt.x_vector.shape == (d,) and alice.prompt.x_vector.dtype == torch.float32
    assert torch.equal(alice.prompt.x_vector, bob.prompt.x_vector)  # same audio, same speaker vector
    frames = math.ceil(reference.size / SAMPLES_PER_FRAME)
    codes = alice.prompt.ref_codes
    assert codes.shape == (frames, 16) and codes.dtype == torch.int64
    assert int(codes.min()) >= 0 and int(codes.max()) < 2048
    assert alice.prompt.ref_text == REF_TEXT and bob.prompt.ref_codes is None and bob.ref_frames == 0
    assert alice.ref_seconds == pytest.approx(2.3, abs=1e-3)
    assert {"alice", "bob"} <= set(engine.voice_library.names())


def test_voice_file_round_trip(tmp_path, engine, alice, bob):
    for voice in (alice, bob):
        path = engine.voice_library.save(voice.name, tmp_path / f"{voice.name}.voice")
        assert path.stat().st_size < 8192  # a few KB: D floats + 16 codes a frame + the header
        back = load_voice(path)
        assert (back.name, back.mode, back.model_size, back.fingerprint) == (
            voice.name, voice.mode, voice.model_size, voice.fingerprint)
        assert torch.equal(back.prompt.x_vector, voice.prompt.x_vector)
        assert back.prompt.ref_text == voice.prompt.ref_text
        if voice.prompt.ref_codes is not None:
            assert torch.equal(back.prompt.ref_codes, voice.prompt.ref_codes)


@pytest.mark.parametrize("text_mode", ["dual_track", "prefill"])
@pytest.mark.parametrize("which", ["alice", "bob"])
def test_voice_by_name_path_and_object_equals_its_prompt(tmp_path, engine, alice, bob, which, text_mode):
    voice = {"alice": alice, "bob": bob}[which]
    path = voice.save(tmp_path / f"{which}.voice")
    kw = {"greedy": True, "max_frames": 12, "text_mode": text_mode}
    want = engine.generate_codes(TEXT, voice_clone=voice.prompt, **kw)
    for ref in (which, str(path), path, voice):
        assert torch.equal(engine.generate_codes(TEXT, voice=ref, **kw), want), ref


def test_icl_stream_continues_from_the_primed_reference(engine, alice):
    """Streamed audio of an ICL voice = the whole decode of reference + new frames, minus the
    reference part (spec §4.6), with the reference decoded once for the voice, not per request."""
    library = engine.voice_library
    with counted_primes(library) as primes:
        library.add(Voice(name="carol", prompt=alice.prompt, model_size=alice.model_size,
                          ref_seconds=alice.ref_seconds))  # same content as alice: already primed
        results = [engine.synthesize(TEXT, voice=name, seed=7, max_frames=10, first_chunk_frames=1,
                                     chunk_frames=3) for name in ("alice", "carol", "alice")]
    assert primes == []
    ref = alice.prompt.ref_codes
    for res in results:
        assert np.array_equal(res.pcm, results[0].pcm)
        full = engine.decode_codes(torch.cat([ref, torch.from_numpy(res.codes)]))
        tail = full[ref.shape[0] * SAMPLES_PER_FRAME:]
        assert np.abs(res.audio - tail).max() <= 1e-5 + 1 / 32767


def test_stream_of_a_voice_file_primes_once(tmp_path, engine, reference):
    voice = engine.create_voice(reference[: 24000 * 3 // 2], ref_text="Short one.", name="dave",
                                sample_rate=24000, register=False)
    assert "dave" not in engine.voice_library
    path = voice.save(tmp_path / "dave.voice")
    with counted_primes(engine.voice_library) as primes:
        for _ in range(2):
            engine.synthesize(TEXT, voice=str(path), seed=1, max_frames=4)
    assert len(primes) == 1


def test_load_registers_under_the_stored_or_given_name(tmp_path, engine, bob):
    path = bob.save(tmp_path / "b.voice")
    library = engine.voice_library
    assert library.load(path, name="bob2").name == "bob2" and "bob2" in library
    library.remove("bob2")
    assert "bob2" not in library and "bob" in library
    with pytest.raises(InvalidInputError, match="unknown voice 'bob2'"):
        library.remove("bob2")


def test_default_name_comes_from_the_file(tmp_path, engine, reference):
    import soundfile as sf

    path = tmp_path / "Erin Smith.wav"
    sf.write(path, reference, 24000)
    voice = engine.create_voice(path, register=False)
    assert voice.name == "Erin_Smith"
    assert engine.create_voice(reference, sample_rate=24000, register=False).name.startswith("voice-")


# ---------------------------------------------------------------------- refusals


def test_unknown_voice_lists_the_library(engine, alice):
    with pytest.raises(InvalidInputError, match="unknown voice 'zoe'.*alice"):
        engine.generate_codes(TEXT, voice="zoe", max_frames=2)
    with pytest.raises(InvalidInputError, match="voice file .*nobody.voice.* does not exist"):
        engine.generate_codes(TEXT, voice="nobody.voice", max_frames=2)


def test_voice_of_another_model_width_is_refused(tmp_path, engine):
    d = engine.config.talker.hidden_size
    other = Voice(name="wide", prompt=VoiceClonePrompt(x_vector=torch.ones(2 * d)), model_size="1b7", ref_seconds=3.0)
    path = other.save(tmp_path / "wide.voice")
    with pytest.raises(InvalidInputError, match=f"x-vector of {2 * d}.*takes x-vectors of {d}"):
        engine.generate_codes(TEXT, voice=str(path), max_frames=2)
    with pytest.raises(InvalidInputError, match=f"x-vector of {2 * d}"):
        engine.voice_library.add(other)


def test_files_that_are_not_voices_are_refused(tmp_path, engine):
    from safetensors.torch import save_file

    junk = tmp_path / "junk.voice"
    junk.write_bytes(b"\x00" * 100)
    with pytest.raises(InvalidInputError, match="is not a voice file"):
        engine.generate_codes(TEXT, voice=str(junk), max_frames=2)
    plain = tmp_path / "plain.voice"
    save_file({"x_vector": torch.ones(4)}, str(plain), metadata={"voice": '{"format": "other"}'})
    with pytest.raises(InvalidInputError, match="is not a version-1 voice file"):
        load_voice(plain)


@pytest.mark.parametrize(("kw", "message"), [
    ({"ref_text": "   "}, "ref_text is empty"),
    ({"ref_text": 5}, "ref_text must be a string"),
    ({"name": "bad name!"}, "voice name 'bad name!' is not valid"),
    ({"name": "x.voice"}, "voice name 'x.voice' is not valid"),
])
def test_bad_create_arguments(engine, reference, kw, message):
    with pytest.raises(InvalidInputError, match=message):
        engine.create_voice(reference, sample_rate=24000, **kw)


def test_bad_audio_reaches_the_caller_unchanged(engine):
    with pytest.raises(InvalidInputError, match="is silent"):
        engine.create_voice(np.zeros(48000, np.float32), sample_rate=24000)


def test_custom_voice_model_does_not_clone(finite_model, reference):
    from pipecat_qwen_fast.engine.engine import QwenTTSEngine

    cv = QwenTTSEngine.from_pretrained(finite_model, device="cpu", dtype="float32", backend="torch", progress=False)
    with pytest.raises(UnsupportedFeatureError, match="voice cloning needs a Base model"):
        cv.create_voice(reference, sample_rate=24000)


def test_bench_timers_run_on_any_device(engine, alice):
    from pipecat_qwen_fast.bench.voice_clone import time_create_voice, time_first_audio

    before = engine.voice_library.names()
    icl = time_create_voice(engine, 1.5, icl=True, rate=16000, repeats=1, warmup=0)
    assert set(icl) >= {"create_voice", "read_resample", "encoders", "prime"} and icl["mode"] == "icl"
    assert all(icl[k]["n"] == 1 and icl[k]["p50_ms"] > 0 for k in ("create_voice", "encoders", "prime"))
    assert "prime" not in time_create_voice(engine, 1.5, icl=False, repeats=1, warmup=0)
    assert engine.voice_library.names() == before  # timing registers nothing
    first = time_first_audio(engine, "alice", repeats=2, warmup=0)
    assert first["n"] == 2 and first["p50_ms"] > 0
