"""What a caller asks for and gets back: the request, its audio chunks, the whole result, and the
chunk schedule that decides how many frames each chunk holds."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipecat_qwen_fast.model.prompt import VoiceClonePrompt
from pipecat_qwen_fast.model.sampling import SamplingParams

SAMPLE_RATE = 24000


# The default of SynthesisRequest.chunk_growth: from the third chunk on, a chunk holds at most
# this many times the frames already sent. A chunk of n frames after S sent reaches the player in
# time while the decoder runs at >= ~(n / S + 1)x real time. Growth 1 (1, 1, 2, 4, ...) asks at
# most 2x of every chunk; growth 2 after a second chunk of 2 (1, 2, 4, ...) asks 3x. With 4x growth
# (1, 4, 16) the third chunk asked 4.2x and 16 concurrent torch-backend streams (4.5x each) ran out
# of audio by 1 ms where 1, 4, 4 did not (H200 full run at c332932).
CHUNK_GROWTH = 1
# The request fields that make its chunk schedule (chunk_target), for the doors that carry them.
CHUNK_FIELDS = ("first_chunk_frames", "chunk_frames", "max_chunk_frames", "chunk_growth")

def chunk_target(request: SynthesisRequest, frames_sent: int) -> int:
    """Frames in the chunk that starts after `frames_sent` frames of audio.

    From the third chunk on, chunks double from `chunk_frames` (1, 1, 2, 4, 8, 16, 32, 32, ... by
    default) as far as growth and `max_chunk_frames` allow, so a default stream uses a handful of
    sizes, each a compiled vocoder graph. A vocoder call costs nearly the same for 1 to 16 frames:
    a 32-frame chunk costs 0.076 ms a frame against 0.12 for 16 and 0.38 for 4 (docs/journal/NOTES.md,
    "Chunk schedule 1, 4, 8, 16, 32").
    """
    if frames_sent == 0:
        return request.first_chunk_frames
    n = request.chunk_frames
    most = request.max_chunk_frames
    if most is not None and frames_sent > request.first_chunk_frames:
        limit = min(most, request.chunk_growth * frames_sent)
        while 2 * n <= limit:
            n *= 2
        if most <= limit:  # the cap itself, where doubling does not land on it
            n = max(n, most)
    return n


def round_budget_ms(request: SynthesisRequest, frame_ms: float = 80.0) -> float:
    """The longest engine round (one frame per stream per round) with which every chunk of
    `request`'s schedule still reaches its player in time. The player starts at the first chunk,
    made in the round of the stream's frame `first_chunk_frames - 1`; the chunk that ends with
    frame T - 1 (T sent after it) comes T - first_chunk_frames rounds later, and must not come
    after the S frames sent before it have played: rounds <= S x 80 ms / (T - first). For the
    default 1, 1, 2, 4, ... 80 ms for the second chunk, 53.3 for the third, and towards 40 ms for
    the later ones, as any schedule that doubles must; 1, 2, 4, ... binds at 40 ms at every chunk;
    1, 3, 6, ... at 26.7 ms (its second chunk)."""
    budget, sent = float("inf"), 0
    first = request.first_chunk_frames
    while True:
        n = chunk_target(request, sent)
        if sent:
            budget = min(budget, frame_ms * sent / (sent + n - first))
        if sent >= _steady_from(request):
            return budget  # the steady chunk asks less and less from here on
        sent += n


def _steady_from(request: SynthesisRequest) -> int:
    """Frames sent after which every chunk is the steady size: the first chunk and four of the
    largest (a size may repeat before, as in 1, 2, 2, 4 with chunk_growth=1)."""
    return 4 * (request.max_chunk_frames or request.chunk_frames) + request.first_chunk_frames


def schedule_sizes(request: SynthesisRequest) -> tuple[int, ...]:
    """The chunk sizes a long stream of `request` sends (its last chunk may be any smaller size)."""
    sizes, sent = set(), 0
    while sent < _steady_from(request):
        n = chunk_target(request, sent)
        sizes.add(n)
        sent += n
    return tuple(sorted(sizes | {chunk_target(request, sent)}))


@dataclass
class SynthesisRequest:
    text: str
    # CustomVoice: a speaker name. Base: a cloned voice's library name, its .voice file path, or
    # the Voice itself (voices/library.py).
    voice: object | None = None
    language: str | None = "auto"
    instruct: str | None = None
    seed: int | None = None
    greedy: bool = False
    text_mode: str | None = None  # None: the official default of the variant
    voice_clone: VoiceClonePrompt | None = None
    first_chunk_frames: int = 1
    # A stream asks ~(n / S + 1)x real time for a chunk of n after S sent, and the second chunk
    # asks the most: 4x for 3 frames (at 16 concurrent streams on an H200 4 frames starved every
    # stream, docs/journal/NOTES.md, "Second chunk of 3 frames"), 3x for 2, 2x for 1. The default
    # 1, 1, 2, 4, ... 32 (with chunk_growth=1) sends a new call's second chunk one round after its
    # first, not two, so it keeps 80 ms less one round of slack where 1, 2, 4, ... kept 80 less
    # two, at one more vocoder call an utterance. Every low-slack chunk of the H200's fleet at
    # 256-384 callers was a second chunk (session 34); with this schedule 384 callers were refused
    # 19 calls instead of 417 (docs/PERFORMANCE.md, sessions 34-35).
    chunk_frames: int = 1
    # From the third chunk on, chunks double up to this, each at most chunk_growth x the frames
    # already sent (chunk_target); None (or <= chunk_frames): every later chunk is chunk_frames.
    max_chunk_frames: int | None = 32
    chunk_growth: int = CHUNK_GROWTH
    max_frames: int | None = None
    sampling: SamplingParams | None = None  # overrides generation_config.json
    vocode: bool = True


@dataclass
class AudioChunk:
    pcm: np.ndarray  # int16 mono at 24 kHz
    frame_index: int  # index of the first frame in this chunk
    num_frames: int
    codes: np.ndarray  # [num_frames, 16] int64

    @property
    def duration_s(self) -> float:
        return len(self.pcm) / SAMPLE_RATE


@dataclass
class SynthesisResult:
    pcm: np.ndarray  # int16
    codes: np.ndarray  # [T, 16]
    stop_reason: str | None
    sample_rate: int = SAMPLE_RATE

    @property
    def audio(self) -> np.ndarray:
        """The waveform as float32 in [-1, 1]."""
        return self.pcm.astype(np.float32) / 32767

    @property
    def duration_s(self) -> float:
        return len(self.pcm) / self.sample_rate
