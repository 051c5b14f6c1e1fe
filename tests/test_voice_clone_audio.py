"""Reference audio for voice cloning: formats, mix-down, resampling to 24 kHz, and every bad input."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import soundfile as sf
from scipy.signal import resample_poly

from pipecat_qwen_fast.bench.voice_clone import synthetic_speech
from pipecat_qwen_fast.errors import InvalidInputError
from pipecat_qwen_fast.voices.audio import TARGET_RATE, load_reference

LOSSLESS = [("wav", {"subtype": "FLOAT"}), ("flac", {})]
LOSSY = [("ogg", {"format": "OGG", "subtype": "VORBIS"}), ("mp3", {"format": "MP3"})]


def band_limited(seconds: float, rate: int) -> np.ndarray:
    """Tones well below 12 kHz: what any two good resamplers must agree on."""
    t = np.arange(int(seconds * rate)) / rate
    x = sum(a * np.sin(2 * np.pi * f * t + p) for a, f, p in ((0.3, 310.0, 0.1), (0.2, 1234.5, 1.0), (0.1, 4567.0, 2.0)))
    return (x * (0.6 + 0.4 * np.sin(2 * np.pi * 1.3 * t))).astype(np.float32)


def write_stereo(path, seconds: float, rate: int, **kw) -> np.ndarray:
    x = band_limited(seconds, rate)
    sf.write(path, np.stack([x, 0.5 * x], axis=1), rate, **kw)
    return x


def independent_resample(x: np.ndarray, rate: int) -> np.ndarray:
    """A polyphase resampler (scipy), independent of the soxr one under test."""
    g = math.gcd(rate, TARGET_RATE)
    return resample_poly(x.astype(np.float64), TARGET_RATE // g, rate // g)


@pytest.mark.parametrize(("ext", "kw"), LOSSLESS)
def test_lossless_files_are_mixed_down_and_resampled(tmp_path, ext, kw):
    path = tmp_path / f"ref.{ext}"
    x = write_stereo(path, 2.0, 44100, **kw)
    ref = load_reference(path)
    assert (ref.source_rate, ref.source_channels) == (44100, 2)
    assert ref.wav.dtype == np.float32 and ref.wav.shape == (math.ceil(x.size * (TARGET_RATE / 44100)),)
    want = independent_resample(0.75 * x, 44100)[: ref.wav.size]  # mean of x and 0.5 x
    inner = slice(200, ref.wav.size - 200)  # the two filters' edge transients differ
    # The two filters differ by ~3e-4 on 0.45 peak (-63 dB); a wrong ratio, a one-sample shift or
    # a wrong mix-down is off by ~0.1.
    assert np.abs(ref.wav[inner] - want[inner]).max() < 1e-3


@pytest.mark.parametrize(("ext", "kw"), LOSSY)
def test_lossy_files_are_read(tmp_path, ext, kw):
    path = tmp_path / f"ref.{ext}"
    x = write_stereo(path, 2.0, 48000, **kw)
    ref = load_reference(path)
    assert (ref.source_rate, ref.source_channels) == (48000, 2)
    assert abs(ref.duration_s - 2.0) < 0.08  # codec padding / priming samples
    rms = float(np.sqrt(np.mean(ref.wav**2)))
    assert 0.8 < rms / float(np.sqrt(np.mean((0.75 * x) ** 2))) < 1.25


def test_24k_mono_is_taken_as_it_is():
    x = synthetic_speech(1.5, TARGET_RATE)
    ref = load_reference(x, sample_rate=TARGET_RATE)
    assert np.array_equal(ref.wav, x) and ref.source_channels == 1


def test_resampled_length_rounds_like_the_official_package():
    # librosa computes ceil(n * (24000 / sr)) with the ratio rounded first: 44100 -> 24001.
    assert load_reference(synthetic_speech(1.0, 44100), sample_rate=44100).wav.size == 24001
    assert load_reference(synthetic_speech(1.5, 16000), sample_rate=16000).wav.size == 36000


def test_bytes_tuple_tensor_and_channel_first_inputs_agree(tmp_path):
    import torch

    path = tmp_path / "ref.wav"
    x = write_stereo(path, 1.5, 22050, subtype="FLOAT")
    from_path = load_reference(path).wav
    stereo = np.stack([x, 0.5 * x], axis=1)
    for audio, kw in ((path.read_bytes(), {}), (io.BytesIO(path.read_bytes()), {}), ((stereo, 22050), {}),
                      (stereo.T.copy(), {"sample_rate": 22050}),
                      (torch.from_numpy(stereo.T.copy()), {"sample_rate": 22050})):
        assert np.array_equal(load_reference(audio, **kw).wav, from_path)


def test_integer_pcm_is_scaled_to_unit_range():
    x = synthetic_speech(1.2, TARGET_RATE)
    pcm = np.round(x * 32767).astype(np.int16)
    ref = load_reference(pcm, sample_rate=TARGET_RATE)
    assert np.abs(ref.wav - x).max() < 2 / 32768
    unsigned = (pcm.astype(np.int32) + 32768).astype(np.uint16)
    assert np.array_equal(load_reference(unsigned, sample_rate=TARGET_RATE).wav, ref.wav)


# ---------------------------------------------------------------------- bad inputs, one each


def test_missing_file_is_named(tmp_path):
    with pytest.raises(InvalidInputError, match=r"no-such\.wav.*does not exist"):
        load_reference(tmp_path / "no-such.wav")


@pytest.mark.parametrize("content", [b"this is plain text, not audio" * 10, b"RIFF\x10\x00\x00\x00WAVEfmt "])
def test_unreadable_file_is_named(tmp_path, content):
    path = tmp_path / "broken.wav"
    path.write_bytes(content)
    with pytest.raises(InvalidInputError, match=r"broken\.wav.*cannot be read as audio"):
        load_reference(path)


def test_unreadable_bytes():
    with pytest.raises(InvalidInputError, match="cannot be read as audio"):
        load_reference(b"\x00\x01" * 500)


def test_too_short(tmp_path):
    path = tmp_path / "short.flac"
    sf.write(path, synthetic_speech(0.5, 16000), 16000)
    with pytest.raises(InvalidInputError, match=r"short\.flac.* is 0\.50 s long; a voice needs 1 to 30 s"):
        load_reference(path)


def test_too_long():
    with pytest.raises(InvalidInputError, match=r"is 31\.0 s long; a voice needs 1 to 30 s"):
        load_reference(synthetic_speech(31.0, 8000), sample_rate=8000)


@pytest.mark.parametrize(("scale", "detail"), [(0.0, "digital silence"), (10 ** (-70 / 20), "peak -70 dBFS")])
def test_silence(scale, detail):
    x = synthetic_speech(2.0, TARGET_RATE)
    x = x / np.abs(x).max() * scale
    with pytest.raises(InvalidInputError, match=f"is silent \\({detail}\\)"):
        load_reference(x, sample_rate=TARGET_RATE)


@pytest.mark.parametrize(("value", "kind"), [(np.nan, "NaN"), (np.inf, "infinite")])
def test_non_finite_samples(tmp_path, value, kind):
    x = synthetic_speech(2.0, TARGET_RATE)
    x[1000:1003] = value
    with pytest.raises(InvalidInputError, match=f"contains 3 {kind} sample"):
        load_reference(x, sample_rate=TARGET_RATE)
    path = tmp_path / "nan.wav"  # a float WAV can carry them too
    sf.write(path, x, TARGET_RATE, subtype="FLOAT")
    with pytest.raises(InvalidInputError, match=f"nan\\.wav.*contains 3 {kind} sample"):
        load_reference(path)


@pytest.mark.parametrize(("audio", "kw", "message"), [
    (np.zeros(24000, np.float32), {}, "needs sample_rate="),
    (np.ones(24000, np.float32), {"sample_rate": 0}, "sample_rate must be a positive integer"),
    (np.ones(24000, np.float32), {"sample_rate": 22050.5}, "sample_rate must be a positive integer"),
    ((np.ones(24000, np.float32), 24000, 1), {}, r"must be \(samples, sample_rate\)"),
    (np.ones((2, 2, 24000), np.float32), {"sample_rate": 24000}, "must be 1-D or 2-D"),
    (np.ones((24000, 12), np.float32), {"sample_rate": 24000}, "has 12 channels"),
    (np.array(["a", "b"]), {"sample_rate": 24000}, "samples must be numbers"),
])
def test_malformed_arrays(audio, kw, message):
    with pytest.raises(InvalidInputError, match=message):
        load_reference(audio, **kw)
