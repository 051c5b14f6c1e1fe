"""The speaker encoder's log-mel front end (spec §8.4).

24 kHz audio -> reflect padding of (n_fft - hop) / 2 on both sides -> STFT (n_fft 1024, hop 256,
periodic Hann window of 1024, no centring) -> magnitude sqrt(re² + im² + 1e-9) -> Slaney mel
filterbank (128 bands, 0-12 kHz, Slaney area normalisation) -> log(max(·, 1e-5)).

The filterbank is built here in float64 and rounded to float32 at the points where the reference
(librosa's `filters.mel`, which the official package calls) stores float32, so the two agree to the
last bit rather than to ~1e-7.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
from torch import Tensor


@dataclass(frozen=True)
class MelConfig:
    sample_rate: int = 24000
    n_fft: int = 1024
    hop: int = 256
    win: int = 1024
    n_mels: int = 128
    fmin: float = 0.0
    fmax: float = 12000.0
    magnitude_eps: float = 1e-9
    log_floor: float = 1e-5


SPEAKER_MEL = MelConfig()

# The Slaney scale: linear below 1 kHz (200/3 Hz per mel), logarithmic above (27 mels per factor 6.4).
_SLANEY_HZ_PER_MEL = 200.0 / 3.0
_SLANEY_BREAK_HZ = 1000.0
_SLANEY_LOG_STEP = float(np.log(6.4)) / 27.0


def hz_to_slaney_mel(hz: np.ndarray) -> np.ndarray:
    hz = np.asarray(hz, dtype=np.float64)
    mel = hz / _SLANEY_HZ_PER_MEL
    break_mel = _SLANEY_BREAK_HZ / _SLANEY_HZ_PER_MEL
    high = hz >= _SLANEY_BREAK_HZ
    mel = np.where(high, break_mel + np.log(np.maximum(hz, 1e-300) / _SLANEY_BREAK_HZ) / _SLANEY_LOG_STEP, mel)
    return mel


def slaney_mel_to_hz(mel: np.ndarray) -> np.ndarray:
    mel = np.asarray(mel, dtype=np.float64)
    break_mel = _SLANEY_BREAK_HZ / _SLANEY_HZ_PER_MEL
    hz = mel * _SLANEY_HZ_PER_MEL
    return np.where(mel >= break_mel, _SLANEY_BREAK_HZ * np.exp(_SLANEY_LOG_STEP * (mel - break_mel)), hz)


@lru_cache(maxsize=4)
def slaney_filterbank(cfg: MelConfig = SPEAKER_MEL) -> np.ndarray:
    """[n_mels, n_fft // 2 + 1] float32 triangular filters, area-normalised (Slaney)."""
    bins = np.fft.rfftfreq(cfg.n_fft, d=1.0 / cfg.sample_rate)
    lo, hi = hz_to_slaney_mel(np.array([cfg.fmin, cfg.fmax]))
    edges = slaney_mel_to_hz(np.linspace(lo, hi, cfg.n_mels + 2))  # band edges and centres, Hz
    widths = np.diff(edges)
    weights = np.zeros((cfg.n_mels, bins.size), dtype=np.float32)
    for m in range(cfg.n_mels):
        rising = (bins - edges[m]) / widths[m]
        falling = (edges[m + 2] - bins) / widths[m + 1]
        weights[m] = np.maximum(0.0, np.minimum(rising, falling))
    # Each triangle scaled to unit area over its Hz span (in float64 on the float32 triangle).
    weights *= (2.0 / (edges[2:] - edges[:-2]))[:, None]
    return weights


def log_mel(wav: Tensor, cfg: MelConfig = SPEAKER_MEL) -> Tensor:
    """float waveform [B, samples] at cfg.sample_rate -> log-mel [B, frames, n_mels] (float32).

    Runs on the waveform's device; frames = (samples + 2 * pad - n_fft) // hop + 1.
    """
    wav = wav.float()
    pad = (cfg.n_fft - cfg.hop) // 2
    padded = torch.nn.functional.pad(wav[:, None], (pad, pad), mode="reflect")[:, 0]
    window = torch.hann_window(cfg.win, device=wav.device, dtype=torch.float32)
    spec = torch.stft(padded, cfg.n_fft, hop_length=cfg.hop, win_length=cfg.win, window=window,
                      center=False, normalized=False, onesided=True, return_complex=True)
    magnitude = torch.sqrt(torch.view_as_real(spec).pow(2).sum(-1) + cfg.magnitude_eps)
    basis = torch.from_numpy(slaney_filterbank(cfg)).to(wav.device)
    mel = torch.matmul(basis, magnitude)  # [B, n_mels, frames]
    return torch.log(torch.clamp(mel, min=cfg.log_floor)).transpose(1, 2)
