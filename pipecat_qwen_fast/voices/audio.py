"""Reference audio for voice cloning: read, check, mix down and resample to 24 kHz.

Files (WAV, FLAC, OGG, MP3 and whatever else libsndfile reads) are read with `soundfile`, whose
PyPI wheels bundle libsndfile >= 1.1 (MP3 included). Resampling is soxr's "HQ" preset followed by
zero-padding or cutting to ceil(n * 24000 / sr) samples, which is what the official package does
(`librosa.resample`, whose default is soxr_hq, with `fix=True`), so that a voice made here from a
44.1 kHz file gets the official reference codes and x-vector. Stereo is averaged to mono, as the
official loader does.
"""

from __future__ import annotations

import io
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipecat_qwen_fast.errors import InvalidInputError

TARGET_RATE = 24000
MIN_SECONDS = 1.0
MAX_SECONDS = 30.0
# Peak below -60 dBFS: nothing a speaker encoder can take a voice from.
SILENCE_PEAK = 1e-3
MAX_CHANNELS = 8

AudioInput = Any  # path | bytes | file object | array [samples] / [samples, channels] / [channels, samples] | (array, rate)


@dataclass(frozen=True)
class ReferenceAudio:
    wav: np.ndarray  # float32 mono at TARGET_RATE
    source_rate: int
    source_channels: int

    @property
    def duration_s(self) -> float:
        return self.wav.shape[0] / TARGET_RATE


def load_reference(audio: AudioInput, sample_rate: int | None = None) -> ReferenceAudio:
    """Any supported input -> checked 24 kHz mono float32 audio; InvalidInputError names what is wrong.

    Arrays need `sample_rate` (or come as an `(array, rate)` tuple); integer arrays are scaled from
    their full range to [-1, 1]. Files and bytes carry their own rate.
    """
    samples, rate, what = read_input(audio, sample_rate)
    mono, channels = to_mono(samples, what)
    check_audio(mono, rate, what)
    return ReferenceAudio(wav=resample_to_target(mono, rate), source_rate=rate, source_channels=channels)


def read_input(audio: AudioInput, sample_rate: int | None) -> tuple[np.ndarray, int, str]:
    if isinstance(audio, tuple):
        if len(audio) != 2:
            raise InvalidInputError("audio tuple must be (samples, sample_rate)")
        if sample_rate is not None and int(sample_rate) != int(audio[1]):
            raise InvalidInputError(f"sample_rate={sample_rate} contradicts the tuple's rate {audio[1]}")
        audio, sample_rate = audio
    if isinstance(audio, (str, os.PathLike)):
        path = Path(audio).expanduser()
        if not path.is_file():
            raise InvalidInputError(f"reference audio file {str(path)!r} does not exist")
        with path.open("rb") as f:
            samples, rate = read_file(f, f"reference audio file {str(path)!r}")
        return samples, rate, f"reference audio {path.name!r}"
    if isinstance(audio, (bytes, bytearray, memoryview)):
        samples, rate = read_file(io.BytesIO(bytes(audio)), "reference audio bytes")
        return samples, rate, "reference audio"
    if hasattr(audio, "read"):
        samples, rate = read_file(audio, "reference audio stream")
        return samples, rate, "reference audio"
    samples = as_float_array(audio)
    if sample_rate is None:
        raise InvalidInputError("reference audio given as an array needs sample_rate= (or an (array, rate) tuple)")
    return samples, check_rate(sample_rate), "reference audio"


def read_file(f, what: str) -> tuple[np.ndarray, int]:
    import soundfile

    try:
        samples, rate = soundfile.read(f, dtype="float32", always_2d=True)
    except (soundfile.LibsndfileError, RuntimeError, TypeError, ValueError, EOFError) as e:
        raise InvalidInputError(
            f"{what} cannot be read as audio ({e}); use WAV, FLAC, OGG or MP3"
        ) from None
    return samples, check_rate(rate)


def check_rate(rate: Any) -> int:
    try:
        value = int(rate)
    except (TypeError, ValueError):
        raise InvalidInputError(f"sample_rate must be a positive integer, got {rate!r}") from None
    if value <= 0 or value != rate:
        raise InvalidInputError(f"sample_rate must be a positive integer, got {rate!r}")
    return value


def as_float_array(audio: Any) -> np.ndarray:
    if hasattr(audio, "detach"):  # a torch tensor, on any device
        audio = audio.detach().cpu().numpy()
    try:
        arr = np.asarray(audio)
    except (TypeError, ValueError) as e:
        raise InvalidInputError(f"reference audio must be a path, bytes or an array of samples ({e})") from None
    if arr.dtype.kind in "iu":
        # PCM integers: full scale maps to [-1, 1); unsigned PCM is centred on half its range.
        half = float(2 ** (8 * arr.dtype.itemsize - 1))
        centred = arr.astype(np.float64) - (half if arr.dtype.kind == "u" else 0.0)
        return (centred / half).astype(np.float32)
    if arr.dtype.kind != "f":
        raise InvalidInputError(f"reference audio samples must be numbers, got dtype {arr.dtype}")
    return arr.astype(np.float32, copy=False)


def to_mono(samples: np.ndarray, what: str) -> tuple[np.ndarray, int]:
    """[samples], [samples, channels] or [channels, samples] -> ([samples], channels).

    For 2-D input the shorter axis is the channel axis; one second of audio outnumbers any
    plausible channel count by far.
    """
    if samples.ndim == 1:
        return samples, 1
    if samples.ndim != 2:
        raise InvalidInputError(f"{what} must be 1-D or 2-D (samples x channels), got shape {samples.shape}")
    if samples.shape[0] < samples.shape[1]:
        samples = samples.T
    channels = samples.shape[1]
    if channels > MAX_CHANNELS:
        raise InvalidInputError(f"{what} has {channels} channels; at most {MAX_CHANNELS} are mixed down")
    if channels == 1:
        return samples[:, 0], 1
    return samples.mean(axis=-1, dtype=np.float32), channels


def check_audio(mono: np.ndarray, rate: int, what: str) -> None:
    if mono.size == 0:
        raise InvalidInputError(f"{what} is empty")
    finite = np.isfinite(mono)
    if not finite.all():
        bad = int(mono.size - finite.sum())
        kind = "NaN" if np.isnan(mono).any() else "infinite"
        raise InvalidInputError(f"{what} contains {bad} {kind} sample(s)")
    seconds = mono.size / rate
    if seconds < MIN_SECONDS:
        raise InvalidInputError(f"{what} is {seconds:.2f} s long; a voice needs {MIN_SECONDS:.0f} to {MAX_SECONDS:.0f} s")
    if seconds > MAX_SECONDS:
        raise InvalidInputError(f"{what} is {seconds:.1f} s long; a voice needs {MIN_SECONDS:.0f} to {MAX_SECONDS:.0f} s "
                                "(cut it to the clearest stretch)")
    peak = float(np.abs(mono).max())
    if peak < SILENCE_PEAK:
        level = "digital silence" if peak == 0 else f"peak {20 * math.log10(peak):.0f} dBFS"
        raise InvalidInputError(f"{what} is silent ({level}); record the speaker louder")


def resample_to_target(mono: np.ndarray, rate: int) -> np.ndarray:
    if rate == TARGET_RATE:
        return np.ascontiguousarray(mono, dtype=np.float32)
    import soxr

    # The official length: ceil(n * ratio) with the ratio rounded first (44100 samples at 44.1 kHz
    # give 24001, not 24000).
    n = math.ceil(mono.shape[0] * (TARGET_RATE / rate))
    out = soxr.resample(np.ascontiguousarray(mono, dtype=np.float32), rate, TARGET_RATE, quality="HQ")
    if out.shape[0] >= n:
        return np.ascontiguousarray(out[:n], dtype=np.float32)
    return np.pad(out, (0, n - out.shape[0])).astype(np.float32)
