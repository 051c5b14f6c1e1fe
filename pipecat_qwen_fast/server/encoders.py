"""Compressed response formats of ``POST /v1/audio/speech`` (mp3, opus, aac, flac), encoded as
the engine's chunks arrive, through PyAV (FFmpeg's encoders and muxers; LiveKit's agents already
depend on it). Each chunk's packets leave with it: the muxers flush every packet, and Ogg closes
a page every 20 ms instead of every second, so first audio waits for the encoder's own
look-ahead (a frame or two), not for a buffer to fill. pcm and wav stay the cheap formats: an
encoder costs the event loop 0.4 (flac) to 5 (mp3) ms of CPU a second of audio on the 2-core
development machine (bench/probes/encoder_cost.py, bench/results/2026-11-28-cpu-session30-encoders/).
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np

# response_format -> (muxer, encoder, media type, encoder rate; None: the model's)
CODECS: dict[str, tuple[str, str, str, int | None]] = {
    "mp3": ("mp3", "libmp3lame", "audio/mpeg", None),
    "opus": ("ogg", "libopus", "audio/ogg", 48000),  # Opus runs at 48 kHz
    "aac": ("adts", "aac", "audio/aac", None),
    "flac": ("flac", "flac", "audio/flac", None),
}


class _Sink(io.RawIOBase):
    """Where the muxer writes: not seekable, so nothing already sent is rewritten."""

    def __init__(self) -> None:
        super().__init__()
        self._out = bytearray()

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self._out += data
        return len(data)

    def take(self) -> bytes:
        out = bytes(self._out)
        self._out.clear()
        return out


class StreamEncoder:
    """One response's encoder: `encode` each chunk of int16 PCM, then `finish` for the tail;
    `close` if it ends early."""

    def __init__(self, fmt: str, sample_rate: int) -> None:
        import av

        muxer, codec, _, rate = CODECS[fmt]
        self._av = av
        self._sample_rate = sample_rate
        self._sink = _Sink()
        options = {"flush_packets": "1"}
        if muxer == "ogg":
            options["page_duration"] = "20000"  # microseconds
        self._container = av.open(self._sink, mode="w", format=muxer, options=options)
        self._stream = self._container.add_stream(codec, rate=rate or sample_rate, layout="mono")
        self._resampler = av.AudioResampler(format=self._stream.codec_context.format.name,
                                            layout="mono", rate=rate or sample_rate)
        self._open = True

    def encode(self, pcm: bytes) -> bytes:
        frame = self._av.AudioFrame.from_ndarray(np.frombuffer(pcm, dtype="<i2")[None], format="s16",
                                                 layout="mono")
        frame.sample_rate = self._sample_rate
        self._mux(self._resampler.resample(frame))
        return self._sink.take()

    def finish(self) -> bytes:
        """What the resampler and encoder still hold, and the container's trailer."""
        self._mux(self._resampler.resample(None))
        for packet in self._stream.encode(None):
            self._container.mux(packet)
        self.close()
        return self._sink.take()

    def close(self) -> None:
        if self._open:
            self._open = False
            self._container.close()

    def _mux(self, frames: list) -> None:
        for frame in frames:
            for packet in self._stream.encode(frame):
                self._container.mux(packet)
