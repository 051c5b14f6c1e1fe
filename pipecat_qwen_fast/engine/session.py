"""A session: one utterance in flight inside the engine, and the host-side helpers its audio passes through."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from pipecat_qwen_fast.engine.request import SynthesisRequest
from pipecat_qwen_fast.engine.text import Segments
from pipecat_qwen_fast.model.sampling import SamplingParams
from pipecat_qwen_fast.vocoder.stream import VocoderStream


def to_pcm(wav: Tensor) -> Tensor:
    """float waveform -> int16 PCM, on its device."""
    return (wav.float().clamp(-1, 1) * 32767).round().to(torch.int16)


def to_host(t: Tensor) -> tuple[Tensor, torch.cuda.Event | None]:
    """A device tensor's copy into pinned host memory, queued, and the event after which it is
    complete; a CPU tensor as it is, with no event."""
    if t.device.type != "cuda":
        return t, None
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return host, done


@dataclass
class Session:
    """One utterance in flight. Created by `QwenTTSEngine.open_session`."""

    request: SynthesisRequest
    speaker: str | None
    language: str
    text_mode: str
    params: SamplingParams
    segments: Segments  # made as the session reaches each one (engine/text.py)
    seed: int
    segment_index: int = 0
    state: object | None = None
    frame_cap: int = 0
    segment_frames: int = 0
    frames_decoded: int = 0
    chunk_start: int = 0
    pending: list[Tensor] = field(default_factory=list)  # device codes [16] not yet vocoded
    codes: list[np.ndarray] = field(default_factory=list)  # host codes of every frame
    vocoder_state: object | None = None
    done: bool = False
    stop_reason: str | None = None  # "eos" | "frame_cap" | "cancelled" | "error"
    # The next frame, launched before this one was read (QwenTTSEngine.run_ahead): its device
    # codes, their host copy and the event that completes the copy. The state already holds it.
    ahead: tuple | None = None
    # The vocoder's call for the chunk that the frame in flight completes, queued behind that
    # frame before its codes were read (QwenTTSEngine.ahead_at_chunks); kept only if the chunk
    # is flushed as it was guessed.
    early: EarlyChunk | None = None
    # An open-ended session's text, which arrives while it runs (engine/text_session.py).
    feed: object | None = None
    # A library voice (Base models, voices/voice.py): an ICL one's vocoder state starts from its
    # primed copy instead of decoding the reference again.
    voice: object | None = None
    # The first segment's prompt (model/prompt.py's Prompt), built before the open by
    # QwenTTSEngine.prepare_session while a round decoded; used and cleared by the open.
    prompt: object | None = None


@dataclass
class EarlyChunk:
    start: int  # the chunk's first frame
    frames: int
    entry: object  # the vocoder graph entry holding the state after the call
    run: int  # the entry's call count after this call: another call since makes it stale
    pcm: Tensor  # host int16 (pinned on a GPU), complete once `done` is
    done: object | None  # torch.cuda.Event; None on the CPU


@dataclass
class VocoderJob:
    """A chunk flushed inside a batched round, its audio made at the round's end together with the
    other sessions' chunks of its size (`QwenTTSEngine._vocode_round`)."""

    stream: VocoderStream  # the session's (still held here after the session closes)
    codes: Tensor  # [16, n] on the device
    start: int
    host_codes: np.ndarray
    # The stream's last chunk: its vocoder state is not used again, so the round may pad it to
    # another chunk's size and vocode it in that call (only its own frames' audio is kept).
    final: bool = False
