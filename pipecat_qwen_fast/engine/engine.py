"""QwenTTSEngine: load a Qwen3-TTS checkpoint and stream 24 kHz speech frame by frame.

The unit of work is a Session (one utterance): `open_session` validates the request, builds the
prompt and runs the prefill; each `step` decodes one 80 ms frame and, when a chunk is complete,
runs the streaming vocoder on it. Many sessions can be interleaved by one thread (EngineService
does this); `stream()` and `synthesize()` are the single-session conveniences. The engine is not
thread-safe: drive it from one thread at a time.

One file of ~700 lines on purpose: a frame's life (launch ahead, read the codes, queue the
chunk's vocoder call early, flush, end a segment) is one state machine over a Session, and split
across files its ordering rules would stop being visible together. Loading, warm-up, text, requests
and sessions live beside it (loading.py, warmup.py, text.py, request.py, session.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from pipecat_qwen_fast.backends.base import DecodeBackend
from pipecat_qwen_fast.config import GenerationDefaults, ModelConfig
from pipecat_qwen_fast.engine import text_session
from pipecat_qwen_fast.engine.deferred_audio import DeferredChunk, VocoderSide, row_chunk
from pipecat_qwen_fast.engine.loading import load_engine
from pipecat_qwen_fast.engine.request import (
    SAMPLE_RATE,
    AudioChunk,
    SynthesisRequest,
    SynthesisResult,
    chunk_target,
    schedule_sizes,
)
from pipecat_qwen_fast.engine.session import EarlyChunk, Session, VocoderJob, to_host, to_pcm
from pipecat_qwen_fast.engine.text import MAX_SEGMENT_TOKENS, Segments, normalize_text
from pipecat_qwen_fast.engine.text_stream import TurnSegments
from pipecat_qwen_fast.engine.validation import checked_request
from pipecat_qwen_fast.engine.warmup import Warmup
from pipecat_qwen_fast.errors import EngineClosedError, InvalidInputError, UnsupportedFeatureError
from pipecat_qwen_fast.model.prompt import (
    DUAL_TRACK,
    PREFILL,
    TEXT_MODES,
    Prompt,
    TextTokenizer,
    build_prompt,
    check_voice_clone,
    resolve_language,
    resolve_voice,
    supported_languages,
)
from pipecat_qwen_fast.model.sampling import SamplingParams
from pipecat_qwen_fast.model.talker import Qwen3TTSModel
from pipecat_qwen_fast.utils.phases import PhaseLog
from pipecat_qwen_fast.vocoder.graphs import GraphedVocoder, merge_sizes
from pipecat_qwen_fast.vocoder.pool import pool_slots
from pipecat_qwen_fast.vocoder.vocoder import Vocoder
from pipecat_qwen_fast.voices.library import VoiceLibrary
from pipecat_qwen_fast.voices.voice import Voice

logger = logging.getLogger("pipecat_qwen_fast")


# Frame cap from text length: real speech runs at roughly 3-5 frames per text token; 15 per token
# plus 8 s is far above anything the model ends by itself, and stops the rare runaway generation
# (spec §5, "EOS is intrinsically unreliable") long before the hard cap of 8191 frames (11 min).
FRAMES_PER_TOKEN_CAP = 15
FRAME_CAP_MARGIN = 100


class QwenTTSEngine(text_session.TextSessions):
    def __init__(
        self,
        *,
        config: ModelConfig,
        generation: GenerationDefaults,
        model: Qwen3TTSModel,
        vocoder: Vocoder,
        tokenizer: TextTokenizer,
        device: torch.device,
        dtype: torch.dtype,
        backend: DecodeBackend,
        model_dir: Path | None = None,
    ):
        self.config = config
        self.generation = generation
        self.model = model
        self.vocoder = vocoder
        self.tokenizer = tokenizer
        self.device = device
        self.dtype = dtype
        self.backend = backend
        self.model_dir = model_dir
        self.closed = False
        # Base models: cloned voices, used by name or file path as `voice=` (voices/library.py).
        self.voice_library = VoiceLibrary(config=config, model_dir=model_dir, vocoder=vocoder, device=device,
                                          dtype=dtype)
        self.load_phases: PhaseLog | None = None
        self._warmup = Warmup(self)
        self._prepared_threads: set[int] = set()  # prepare_thread() done in these threads
        # On a GPU, `step` launches the next frame before it reads this one's codes, so the GPU
        # never waits for the host's EOS check and bookkeeping between two frames. A frame that
        # completes a chunk gets the chunk's vocoder call queued behind it first (on the graph's
        # copy of the vocoder state, dropped if the frame turns out to be EOS), then the next
        # frame, so the GPU waits for the host neither before the vocoder nor after it
        # (`ahead_at_chunks`; without it, that frame waits for the chunk). A frame launched ahead
        # of an EOS is dropped with its state (the session or segment ends).
        self.run_ahead = device.type == "cuda"
        self.ahead_at_chunks = True
        # step_many clears it for a round of several sessions: a session stepped on its own that
        # kept a frame ahead every round would never rejoin the batch.
        self._ahead_allowed = True
        self.prepared_opens = 0  # sessions opened from a prepare_session made before their open
        self.prepared_begins = 0  # streamed-text segments begun from a prompt built ahead (prepare_text_session)
        self._placing = False  # inside placing(): the outermost burst's count holds
        # True inside a batched round: chunks flushed there come back as VocoderJobs, vocoded at
        # the round's end, one batched call per chunk size, instead of one call each, each waited for.
        self._defer_vocoder = False
        # The round's chunks of different sizes share calls, each padded to the call's frames and
        # committing its stream at its own end (_vocode_round, vocoder/graphs.py merge_sizes);
        # False (QWEN_FAST_VOCODER_MERGE=0): one call per size, for an A/B on the device.
        self.merge_vocoder_sizes = os.environ.get("QWEN_FAST_VOCODER_MERGE", "1") != "0"
        # A batched round's vocoder calls on a stream of their own, their chunks handed back as
        # DeferredChunks that the next round resolves once its frame is launched (deferred_audio.py).
        # Off unless a caller that resolves them (EngineService(overlap_vocoder=True)) turns it on.
        self.defer_vocoder_audio = False
        self.vocoder_side = VocoderSide(device)
        # On a GPU the streaming vocoder step replays one CUDA graph per chunk size, captured from
        # compiled code at warm-up for every size a default stream sends, with cuDNN's preferred
        # weight layout.
        self.vocoder_graphs = None
        if device.type == "cuda":
            vocoder.use_channels_last()
            # The first two chunks (1 and 3 frames: time to first audio) get steps compiled for
            # their shape; every later size, tails included, one shape-generic compiled step.
            # cuDNN times its algorithms for the sizes a default stream sends before its tail
            # (its heuristic's pick for 32 frames took 4.3 ms a call instead of 2.4); a tail is one
            # call per utterance, not worth ~0.7 s of load per size.
            first = SynthesisRequest("")
            # Batched calls (several sessions' chunks of one size in one round) come from one more
            # compiled step, rows symbolic: 1.1-1.7x faster than plain batched graphs at 2-64 rows,
            # which lose to batch-1 calls at 32 x 2 (docs/journal/NOTES.md, "Vocoder calls batched over a round").
            # Sessions' vocoder states are rows of one pool, a row each for as many sessions as the
            # backend decodes at once: a batched call moves them by index (vocoder/pool.py).
            sessions = getattr(getattr(backend, "bulk", backend), "max_sessions", 64)
            self.vocoder_graphs = GraphedVocoder(vocoder, device, dtype, compile_dynamic=True,
                                                 compile_sizes=(first.first_chunk_frames, first.chunk_frames),
                                                 cudnn_benchmark=schedule_sizes(first), compile_batched=True,
                                                 pool_slots=pool_slots(vocoder, device, dtype, sessions))

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_pretrained(
        cls,
        model: str | os.PathLike[str],
        *,
        device: str | torch.device = "auto",
        dtype: str | torch.dtype = "auto",
        backend: str = "auto",
        warmup: bool | None = None,
        progress: bool = True,
    ) -> QwenTTSEngine:
        """Load a checkpoint from a local folder (Hugging Face layout) or a hub id.

        device "auto" picks CUDA when available; dtype "auto" is bfloat16 on CUDA, float32 on CPU;
        backend "auto", where the megakernel is supported, runs up to 3 concurrent calls on it and
        more as one batch on the torch backend's CUDA graphs, moving live calls into the batch
        (hybrid_backend.py); elsewhere it logs why and uses "torch"; "megakernel" runs every call on the megakernel;
        "torch" is the PyTorch path (one batched CUDA graph per frame on a GPU); "eager" is the
        plain PyTorch reference without graphs.
        warmup (default: on for CUDA) warms what a single call needs before returning, so the first
        request is fast (`ready`); the batch path's graphs follow in small steps that EngineService
        runs while idle (`fully_warm`; `finish_warmup()` runs them at once).
        """
        return load_engine(cls, model, device=device, dtype=dtype, backend=backend, warmup=warmup,
                           progress=progress)

    def warmup(self, defer: bool = False) -> None:
        """Warm every run-time path (kernels, allocator, graphs). With `defer`, only what a single
        call needs runs now and the rest is queued for `warm_step` (engine/warmup.py)."""
        self._warmup.start(defer)

    def warm_step(self) -> bool:
        """Run one queued warm-up step; False when none is left. EngineService calls it while idle."""
        return self._warmup.step()

    def finish_warmup(self) -> None:
        """Run every queued warm-up step now."""
        self._warmup.finish()

    @property
    def ready(self) -> bool:
        """True from the moment `from_pretrained` returns (it returns once a single call is warm)
        until `close()`; `fully_warm` says when the background steps are done too."""
        return not self.closed

    @property
    def fully_warm(self) -> bool:
        return self._warmup.done

    @torch.no_grad()
    def prepare_thread(self) -> None:
        """Warm the calling thread's per-thread GPU state, once per thread: warm-up does it for the
        loading thread, the service for its engine thread."""
        prepare = getattr(self.backend, "prepare_thread", None)
        thread = threading.get_ident()
        if prepare is None or self.device.type != "cuda" or thread in self._prepared_threads:
            return
        prepare(SamplingParams.from_defaults(self.generation))
        self._prepared_threads.add(thread)

    # ------------------------------------------------------------------ introspection

    @property
    def sample_rate(self) -> int:
        return SAMPLE_RATE

    @property
    def model_type(self) -> str:
        return self.config.model_type

    @property
    def voices(self) -> list[str]:
        return sorted(self.config.talker.speaker_ids) if self.config.model_type == "custom_voice" else []

    @property
    def languages(self) -> list[str]:
        return supported_languages(self.config)

    @property
    def default_voice(self) -> str | None:
        if not self.voices:
            return None
        return "ryan" if "ryan" in self.voices else self.voices[0]

    # ------------------------------------------------------------------ sessions

    def check_request(self, request: SynthesisRequest) -> None:
        """Raise the error open_session would raise for the request's options, its text aside.
        Opens nothing and changes no engine state, so any thread may call it: adapters check
        their settings when they are set, not at the next utterance."""
        self._new_session(dataclasses.replace(checked_request(request), text="."))

    def open_session(self, request: SynthesisRequest) -> Session:
        """Validate the request, build the prompt of its first segment and run the prefill."""
        opened = self.open_sessions([request])[0]
        if isinstance(opened, Exception):
            raise opened
        return opened

    def prepare_session(self, request: SynthesisRequest) -> Session:
        """A request validated and its first segment's prompt built, with no backend state: what
        an open does before its prefill. A caller that would otherwise wait for the GPU (a round's
        frame decoding) prepares the next round's calls, and `open_sessions(..., prepared=)` then
        runs only their prefills. Raises what opening the request would raise for its input."""
        if self.closed:
            raise EngineClosedError("the engine is closed")
        s = self._new_session(request)
        s.prompt = self._segment_prompt(s)
        return s

    @contextlib.contextmanager
    def placing(self, n: int) -> Iterator[None]:
        """The `n` sessions opened inside, whole texts and streamed turns alike, are placed by the
        backend as one burst (the auto backend: a burst of more than FIRST_ALONE_BURST goes to
        the batch whole, and only a call opened alone or in a pair makes its first frame alone;
        backends/hybrid.py). Nested: the outermost count holds."""
        opening = getattr(self.backend, "opening", None)  # a backend that places calls by load
        if opening is None or self._placing:
            yield
            return
        self._placing = True
        opening(n)
        try:
            yield
        finally:
            opening(0)
            self._placing = False

    def open_sessions(self, requests: list[SynthesisRequest],
                      prepared: list[Session | Exception | None] | None = None) -> list[Session | Exception]:
        """Open several sessions at once: each is validated and given its state on its own, then
        their prefills run as one batched pass on a backend that has `prefill_many` (a burst of
        calls pays one prefill, not one each). `prepared` gives, per request, what
        `prepare_session` made or raised for it earlier (None: nothing). Returns, per request,
        its session or the exception that refused it (NoFreeSlotError when the backend is full);
        the others go on."""
        if self.closed:
            raise EngineClosedError("the engine is closed")
        out: list[Session | Exception | None] = [None] * len(requests)
        begun: list[tuple[int, Session, Tensor]] = []
        with self.placing(len(requests)):
            try:
                for i, request in enumerate(requests):
                    s = None
                    try:
                        ready = prepared[i] if prepared is not None else None
                        if isinstance(ready, Exception):
                            raise ready
                        s = ready if ready is not None else self._new_session(request)
                        self.prepared_opens += ready is not None
                        begun.append((i, s, self._begin_segment(s)))
                    except BaseException as e:
                        if s is not None:
                            self.close_session(s)
                        if not isinstance(e, Exception):
                            raise
                        out[i] = e  # reported to that request's caller
                try:
                    self._prefill([s for _, s, _ in begun], [e for _, _, e in begun])
                except Exception as e:  # noqa: BLE001 - the shared prefill failed
                    begun = self._prefill_alone(begun, out, e)
                for i, s, _ in begun:
                    try:
                        self._start_vocoder(s)
                        out[i] = s
                    except Exception as e:  # noqa: BLE001
                        self.close_session(s)
                        out[i] = e
            except BaseException:
                for _, s, _ in begun:
                    self.close_session(s)
                raise
        return out  # type: ignore[return-value]

    def _prefill_alone(self, begun: list[tuple[int, Session, Tensor]], out: list, error: Exception
                       ) -> list[tuple[int, Session, Tensor]]:
        """After a shared prefill failed: each session's prefill again on its own, from a fresh
        state (the failed pass may have written into the old ones), so that one request's fault
        (too long a prompt for the backend, say) ends only that request. Returns those that
        opened; the others' errors go into `out`."""
        if len(begun) == 1:
            (i, s, _), = begun
            self.close_session(s)
            out[i] = error
            return []
        kept = []
        for i, s, _ in begun:
            try:
                embeds = self._begin_segment(s)
                self._prefill([s], [embeds])
                kept.append((i, s, embeds))
            except Exception as e:  # noqa: BLE001 - reported to that request's caller
                self.close_session(s)
                out[i] = e
        return kept

    def _new_session(self, request: SynthesisRequest) -> Session:
        """A validated session with no backend state yet."""
        request = checked_request(request)
        text = normalize_text(request.text)
        cfg = self.config
        cloned = None
        if cfg.model_type == "base" and request.voice is not None:
            if request.voice_clone is not None:
                raise InvalidInputError("pass a cloned voice as voice= or voice_clone=, not both")
            cloned = self.voice_library.resolve(request.voice)
            request = dataclasses.replace(request, voice=None, voice_clone=cloned.prompt)
        voice = request.voice
        if voice is None and cfg.model_type == "custom_voice":
            voice = self.default_voice
        speaker = resolve_voice(cfg, voice, request.voice_clone)
        language = resolve_language(cfg, request.language)
        if request.instruct is not None and request.instruct.strip() and not cfg.accepts_instruct:
            raise UnsupportedFeatureError(
                f"this model ({cfg.model_size} {cfg.model_type}) ignores instruct; instruct works with "
                "VoiceDesign and 1.7B CustomVoice models"
            )
        if request.voice_clone is not None:
            check_voice_clone(cfg, request.voice_clone)
        text_mode = request.text_mode or (DUAL_TRACK if cfg.model_type == "base" else PREFILL)
        if text_mode not in TEXT_MODES:
            raise InvalidInputError(f"unknown text_mode {text_mode!r}; valid: {', '.join(TEXT_MODES)}")
        params = (request.sampling or SamplingParams.from_defaults(self.generation)).validated()
        if request.greedy:
            params = params.greedy()
        seed = request.seed if request.seed is not None else int.from_bytes(os.urandom(6), "little")
        return Session(
            request=request, speaker=speaker, language=language, text_mode=text_mode, params=params,
            segments=(TurnSegments if text_mode == DUAL_TRACK else Segments)(
                text, self.tokenizer, MAX_SEGMENT_TOKENS), seed=seed, voice=cloned,
        )

    def _start_vocoder(self, s: Session) -> None:
        if s.request.vocode:
            graphs = self.vocoder_graphs
            s.vocoder_state = (graphs.new_stream() if graphs is not None else
                               self.vocoder.new_stream(batch=1, device=self.device, dtype=self.dtype, packed=True))
            vc = s.request.voice_clone
            if vc is not None and vc.icl:
                # The talker continues right after the reference frames; so does the vocoder.
                primed = self.voice_library.primed_stream(s.voice) if s.voice is not None else None
                self.vocoder_side.order_main()
                if primed is not None:
                    s.vocoder_state.copy_from(primed)
                else:
                    self.vocoder.prime_stream(vc.ref_codes.to(self.device).T[None], s.vocoder_state)

    def _prefill(self, sessions: list[Session], embeds: list[Tensor]) -> None:
        many = getattr(self.backend, "prefill_many", None)  # it decides when batching pays
        if many is not None:
            many([s.state for s in sessions], embeds)
            return
        for s, e in zip(sessions, embeds):
            self.backend.prefill(s.state, e)

    def _start_segment(self, s: Session) -> None:
        self._prefill([s], [self._begin_segment(s)])

    def _begin_segment(self, s: Session) -> Tensor:
        """The prompt of the session's current segment and a fresh backend state for it; returns
        the prompt embeddings (the caller runs the prefill)."""
        if s.state is not None:
            self.backend.release(s.state)
            s.state = None
        s.ahead = None  # a frame launched past the previous segment's EOS went with its state
        s.early = None
        req = s.request
        prompt: Prompt = s.prompt if s.prompt is not None else self._segment_prompt(s)
        s.prompt = None
        # The official loop emits at most max_new_tokens - 1 frames; ours never runs past that either.
        s.frame_cap = min(self.generation.max_new_tokens - 1, FRAMES_PER_TOKEN_CAP * prompt.num_text_tokens + FRAME_CAP_MARGIN)
        s.segment_frames = 0
        capacity = getattr(self.backend, "max_positions", None)
        if capacity is not None:
            # A backend with a fixed KV capacity (CUDA graphs, megakernel) bounds the segment too;
            # 200-token segments leave room for far more speech than their text can take.
            s.frame_cap = max(1, min(s.frame_cap, capacity - prompt.embeds.shape[0] - 1))
        budget = s.frame_cap
        if req.max_frames is not None:
            budget = min(budget, req.max_frames - s.frames_decoded)
        # Each segment gets its own seed stream so a multi-segment text is reproducible.
        seed = s.seed + 1_000_003 * s.segment_index
        s.state = self.backend.new_state(
            max_positions=prompt.embeds.shape[0] + budget + 1, params=s.params, seed=seed,
            trailing=prompt.trailing, pad_vec=prompt.pad_vec,
        )
        return prompt.embeds

    def _segment_prompt(self, s: Session) -> Prompt:
        req = s.request
        with torch.no_grad():
            return build_prompt(
                self.model.talker, self.tokenizer, self.config, text=s.segments[s.segment_index],
                speaker=s.speaker, language=s.language, instruct=req.instruct, text_mode=s.text_mode,
                voice_clone=req.voice_clone,
            )

    def step(self, s: Session) -> list[AudioChunk]:
        """Decode one frame of `s`; returns the audio chunk completed by it, if any."""
        if s.done:
            return []
        try:
            if s.feed is not None and (waiting := text_session.poll(self, s)) is not None:
                return waiting  # its text is not there yet
            codes, host, copied = s.ahead if s.ahead is not None else self._launch(s)
            s.ahead = None
            if self.run_ahead and self._ahead_allowed and (
                self._may_run_ahead(s)
                # It completes a chunk: that chunk's vocoder call first, then the next frame.
                or (self.ahead_at_chunks and self._next_is_certain(s) and self._vocode_early(s, codes)
                    and self._ahead_of_chunk(s))
            ):
                s.ahead = self._launch(s)
            if copied is not None:
                copied.synchronize()  # the one host read per frame (EOS check); not the frame ahead
            return self._after_frame(s, codes, host.numpy())
        except BaseException:
            s.stop_reason = s.stop_reason or "error"
            self.close_session(s)
            raise

    def _launch(self, s: Session) -> tuple:
        """Launch the session's next frame; its codes on the device, their host copy, and (on a
        GPU) the event after which the copy is complete."""
        codes = self.backend.decode_frame(s.state)
        return (codes, *to_host(codes))

    def _next_is_certain(self, s: Session) -> bool:
        """Whether the frame just launched is certain to be followed by another of this state,
        unless it is EOS: it is not the segment's or the request's last allowed frame, and its
        text is there (streamed text)."""
        if s.feed is not None and not s.feed.allows(s.segment_frames + 1):
            return False
        if s.segment_frames + 1 >= s.frame_cap:
            return False
        return s.request.max_frames is None or s.frames_decoded + 1 < s.request.max_frames

    def _may_run_ahead(self, s: Session) -> bool:
        """`_next_is_certain`, and the frame just launched does not complete a chunk (whose
        vocoder call would queue behind the frame ahead)."""
        if not self._next_is_certain(s):
            return False
        if not s.request.vocode and self.ahead_at_chunks:
            return True  # a chunk of codes alone queues nothing on the GPU
        return len(s.pending) + 1 < chunk_target(s.request, s.chunk_start)

    @staticmethod
    def _ahead_of_chunk(s: Session) -> bool:
        """Whether to launch the frame after a chunk before the host has the chunk: not after the
        first, which a caller may well take and then cancel (a frame left running would delay
        the next request's prefill by up to a frame), and which sets the time to first audio
        whatever follows it."""
        return s.chunk_start > 0

    def _vocode_early(self, s: Session, codes: Tensor) -> bool:
        """Queue the vocoder call for the chunk that the frame in flight (`codes`) completes, and
        the copy of its audio to the host, before the frame's codes are read; True if queued."""
        if self.vocoder_graphs is None or not s.request.vocode:
            return False
        frames = [*s.pending, codes]
        if len(frames) < chunk_target(s.request, s.chunk_start):
            return False
        self.vocoder_side.order_main()
        with torch.no_grad():
            launched = self.vocoder_graphs.launch(torch.stack(frames).T[None], s.vocoder_state)
            if launched is None:
                return False
            entry, out = launched
            pcm, done = to_host(to_pcm(out[0, 0]))
        s.early = EarlyChunk(start=s.chunk_start, frames=len(frames), entry=entry, run=entry.runs, pcm=pcm,
                             done=done)
        return True

    def starts_alone(self, s: Session) -> bool:
        """Whether the session's next frame is its first and should run by itself, before a
        batched round (the auto backend's megakernel side while the batch is small:
        backends/hybrid.py, FIRST_ALONE_BELOW)."""
        check = getattr(self.backend, "starts_alone", None)
        return check is not None and not s.done and s.state is not None and check(s.state)

    def step_many(self, sessions: list[Session], meanwhile: Callable[[], None] | None = None
                  ) -> list[list[AudioChunk] | Exception]:
        """One frame for each session; batched on backends that can (one weight read per batch).

        `meanwhile`, if given, is called once while a batched frame runs on the GPU, before its
        codes are read (host work that would otherwise wait: the caller's next opens, say); not
        at all in a round with no batched frame.

        Returns, per session, its completed chunks or the exception that ended it (that session is
        closed; the others go on).
        """
        # Only a session alone in the round runs a frame ahead (_ahead_allowed).
        self._ahead_allowed = sum(not s.done for s in sessions) == 1
        try:
            return self._step_round(sessions, meanwhile)
        finally:
            self._ahead_allowed = True

    def _step_round(self, sessions: list[Session], meanwhile: Callable[[], None] | None = None
                    ) -> list[list[AudioChunk] | Exception]:
        results: list[list[AudioChunk] | Exception] = [[] for _ in sessions]
        batched = getattr(self.backend, "decode_frames", None)
        limit = getattr(self.backend, "max_batch", 1)
        groups: dict[SamplingParams, list[int]] = {}
        jobs: list[tuple[int, VocoderJob]] = []
        # Earlier rounds' deferred vocoder calls: resolved once this round's frame is launched,
        # so that they ran beside it (deferred_audio.py), or at the round's end.
        earlier = len(self.vocoder_side.calls)
        for i, s in enumerate(sessions):
            if s.done:
                continue
            if s.feed is not None and (waiting := text_session.poll_in_round(self, s)) is not None:
                results[i] = waiting  # its text is not there yet, or it failed
                continue
            if s.ahead is not None:  # its frame of this round is already running
                try:
                    results[i] = self.step(s)
                except Exception as e:  # noqa: BLE001 - reported to that session's caller
                    results[i] = e
                continue
            groups.setdefault(s.params, []).append(i)
        for idxs in groups.values():
            for start in range(0, len(idxs), limit):
                part = idxs[start : start + limit]
                if batched is None or len(part) == 1:
                    for i in part:
                        try:
                            results[i] = self.step(sessions[i])
                        except Exception as e:  # noqa: BLE001 - reported to that session's caller
                            results[i] = e
                    continue
                try:
                    codes = batched([sessions[i].state for i in part])
                    if earlier:
                        earlier -= self.vocoder_side.resolve(earlier, beside_a_frame=True)
                    if meanwhile is not None:
                        meanwhile, run = None, meanwhile
                        run()
                    host = codes.cpu().numpy()
                except Exception as e:  # noqa: BLE001 - the batch failed: each of its sessions ends
                    for i in part:
                        sessions[i].stop_reason = "error"
                        self.close_session(sessions[i])
                        results[i] = e
                    continue
                self._defer_vocoder = True  # the chunks these frames complete: vocoded together below
                try:
                    for j, i in enumerate(part):
                        try:
                            results[i] = self._after_frame(sessions[i], codes[j], host[j])
                        except Exception as e:  # noqa: BLE001
                            sessions[i].stop_reason = "error"
                            self.close_session(sessions[i])
                            results[i] = e
                finally:
                    self._defer_vocoder = False
                jobs += [(i, c) for i in part if isinstance(results[i], list)
                         for c in results[i] if isinstance(c, VocoderJob)]
        if earlier:
            self.vocoder_side.resolve(earlier)
        if jobs:
            self._vocode_round(sessions, results, jobs)
        return results

    def resolve_deferred_audio(self, finished_only: bool = False) -> int:
        """Hand every DeferredChunk still pending its audio (waiting for its vocoder call), or
        only those whose calls have finished (no wait); returns the calls resolved. A caller that
        turned `defer_vocoder_audio` on calls it whenever it will not step another round at once
        (idle, closing), and with `finished_only` before work that delays the next frame."""
        side = self.vocoder_side
        return side.resolve_finished() if finished_only else side.resolve()

    def _vocode_round(self, sessions: list[Session], results: list, jobs: list[tuple[int, VocoderJob]]) -> None:
        """The round's flushed chunks in as few vocoder calls as their sizes allow (batched graphs
        on a GPU): one per chunk size, or, with `merge_vocoder_sizes`, one per group of sizes
        that `merge_sizes` pads into one call; their audio copied to the host behind them, one
        wait for all. Each job in `results` is replaced by its AudioChunk (a DeferredChunk, not
        waited for, with `defer_vocoder_audio`); a failed call ends its sessions with the error."""
        # call frames -> [(result index, job)]
        by_size: dict[int, list[tuple[int, VocoderJob]]] = {}
        finals = []
        for i, job in jobs:
            if job.final:
                finals.append((i, job))
            else:
                by_size.setdefault(job.codes.shape[1], []).append((i, job))
        if self.merge_vocoder_sizes and by_size:
            # At a fleet's scale a round held up to six sizes of the schedule, a call each
            # (~1.5 ms, launch-bound, whatever its size).
            graphs = self.vocoder_graphs
            into = merge_sizes({n: len(g) for n, g in by_size.items()},
                               graphs.calls if graphs is not None else lambda n, k: 1)
            merged: dict[int, list[tuple[int, VocoderJob]]] = {}
            for n, group in by_size.items():
                merged.setdefault(into[n], []).extend(group)
            by_size = merged
        # A stream's last chunk has any length (a stream ends where its text does), so at a fleet's
        # scale each round had several sizes, a vocoder call each. Its state is not used again: it
        # joins the smallest call of this round that holds it, or of the default schedule (graphs
        # captured for them), padded and run as a chunk of that size; only its own frames' audio
        # is kept.
        for i, job in finals:
            n = job.codes.shape[1]
            size = next((m for m in sorted(by_size) if m >= n), None)
            size = size or next((m for m in schedule_sizes(sessions[i].request) if m >= n), n)
            by_size.setdefault(size, []).append((i, job))
        made = []
        defer = self.defer_vocoder_audio
        with self.vocoder_side.launching() if defer else contextlib.nullcontext():
            self._launch_vocoder_calls(by_size, sessions, results, made)
        if defer:
            for n, group, keep, pcm, done in made:
                rows = []
                for j, (i, job) in enumerate(group):
                    chunk = DeferredChunk(job.start, job.codes.shape[1], job.host_codes)
                    rows.append((j, chunk))
                    results[i] = [chunk if c is job else c for c in results[i]]
                self.vocoder_side.add(pcm, done, n, rows, keep)
            return
        for n, group, _, pcm, done in made:
            if done is not None:
                done.synchronize()
            for j, (i, job) in enumerate(group):
                # job.codes.shape[1] is fewer than n for a padded chunk
                chunk = row_chunk(pcm, j, n, job.start, job.codes.shape[1], job.host_codes)
                results[i] = [chunk if c is job else c for c in results[i]]

    def _launch_vocoder_calls(self, by_size: dict, sessions: list[Session], results: list, made: list) -> None:
        """One vocoder call per (merged) size, its audio's copy to the host queued behind it:
        (frames, group, what the call reads, host pcm, done event) into `made`."""
        for n, group in by_size.items():
            try:
                # Padded on the right (code 0): causal, so a row's own frames' audio is unchanged.
                rows = [job.codes for _, job in group]
                codes = torch.stack([c if c.shape[1] == n else F.pad(c, (0, n - c.shape[1])) for c in rows])
                streams = [job.stream for _, job in group]
                valid = [n if job.final else job.codes.shape[1] for _, job in group]
                # Only where a row's state commits short of n: otherwise the call is one size's.
                ragged = {"valid": valid} if min(valid) < n else {}
                with torch.no_grad():
                    if self.vocoder_graphs is not None:
                        wav = self.vocoder_graphs.decode_many(codes, streams, **ragged)
                    else:
                        wav = self.vocoder.decode_streams(codes, streams, check_values=False, **ragged)
                    made.append((n, group, (rows, codes, streams), *to_host(to_pcm(wav[:, 0]))))
            except Exception as e:  # noqa: BLE001 - reported to those sessions' callers
                if self.defer_vocoder_audio:
                    # What the failed call queued on the side stream is in no pending call: wait
                    # for it before its sessions' memory goes back to the allocator.
                    self.vocoder_side.synchronize()
                for i, _ in group:
                    sessions[i].stop_reason = "error"
                    self.close_session(sessions[i])
                    results[i] = e

    def _after_frame(self, s: Session, codes: Tensor, host: np.ndarray) -> list[AudioChunk]:
        if int(host[0]) == self.config.talker.codec_eos_id:
            return self._end_segment(s, "eos")
        s.pending.append(codes)
        s.codes.append(host)
        s.frames_decoded += 1
        s.segment_frames += 1
        if s.request.max_frames is not None and s.frames_decoded >= s.request.max_frames:
            return self._finish(s, "frame_cap")
        if s.segment_frames >= s.frame_cap:
            return self._end_segment(s, "frame_cap")
        if len(s.pending) >= chunk_target(s.request, s.chunk_start):
            # The session goes on, so its next frame is certain: launched between the vocoder's
            # work and the host's wait for the audio, it runs while the host takes the chunk.
            after = (self.run_ahead and self.ahead_at_chunks and self._ahead_allowed and s.ahead is None
                     and self._ahead_of_chunk(s) and (s.feed is None or s.feed.allows(s.segment_frames)))
            return self._flush(s, launch_next=after)
        return []

    def _end_segment(self, s: Session, reason: str) -> list[AudioChunk]:
        if s.feed is not None:
            return text_session.end_segment(self, s, reason)
        if s.segments.has(s.segment_index + 1):
            s.segment_index += 1
            self._start_segment(s)
            return []
        return self._finish(s, reason)

    def _finish(self, s: Session, reason: str) -> list[AudioChunk]:
        chunks = self._flush(s, final=True)
        s.stop_reason = reason
        self.close_session(s)
        return chunks

    def _flush(self, s: Session, launch_next: bool = False, final: bool = False) -> list[AudioChunk]:
        if not s.pending:
            return []
        n = len(s.pending)
        pending, s.pending = s.pending, []
        start = s.chunk_start
        s.chunk_start += n
        host_codes = np.stack(s.codes[start : start + n])
        early, s.early = s.early, None
        if early is not None and (early.start, early.frames, early.run) == (start, n, early.entry.runs):
            # Queued before the chunk's last frame was read (or, for a streamed turn's frame 0,
            # before its first token was final), that frame was kept, and no call of the entry's
            # size has run since.
            self.vocoder_side.order_main()
            self.vocoder_graphs.commit(early.entry, s.vocoder_state, n)
            pcm, done = early.pcm, early.done
        elif not s.request.vocode:
            pcm, done = torch.zeros(0, dtype=torch.int16), None
        elif self._defer_vocoder and not launch_next:
            # Replaced by its AudioChunk at the round's end (_step_round collects it from the results).
            return [VocoderJob(s.vocoder_state, torch.stack(pending).T, start, host_codes, final=final)]
        else:
            codes = torch.stack(pending).T[None]  # [1, 16, n]
            self.vocoder_side.order_main()
            with torch.no_grad():
                if self.vocoder_graphs is not None:
                    wav = self.vocoder_graphs.decode_stream(codes, s.vocoder_state)[0, 0]
                else:
                    wav = self.vocoder.decode_stream(codes, s.vocoder_state, check_values=False)[0, 0]
                pcm, done = to_host(to_pcm(wav))
        if launch_next:
            s.ahead = self._launch(s)
        if done is not None:
            done.synchronize()
        # A copy: the chunk outlives this call in the adapters' queues; pinned pages go back now.
        return [AudioChunk(pcm.numpy().copy(), start, n, host_codes)]

    def cancel(self, s: Session) -> None:
        """Stop a session now and free its state; later `step` calls return nothing."""
        if not s.done:
            s.stop_reason = "cancelled"
        self.close_session(s)

    def close_session(self, s: Session) -> None:
        """Free the session's KV cache and vocoder state (idempotent)."""
        s.done = True
        s.ahead = None
        s.early = None
        if s.state is not None:
            self.backend.release(s.state)
            s.state = None
        s.vocoder_state = None
        s.pending = []
        if s.feed is not None:
            text_session.detach(s)

    # ------------------------------------------------------------------ conveniences

    def create_voice(self, audio, ref_text: str | None = None, *, name: str | None = None,
                     sample_rate: int | None = None, register: bool = True) -> Voice:
        """Clone a voice from 1-30 s of audio (Base models): in-context with `ref_text`, the
        recording's transcript; x-vector only without. `audio` is a file path (WAV, FLAC, OGG, MP3),
        its bytes, or samples with `sample_rate`. Registered in `voice_library` under `name` unless
        register=False; then `voice=name` (or the Voice, or its saved .voice file) speaks with it."""
        if self.closed:
            raise EngineClosedError("the engine is closed")
        return self.voice_library.create(audio, ref_text, name=name, sample_rate=sample_rate, register=register)

    def stream(self, text: str, **kwargs) -> Iterator[AudioChunk]:
        """Yield int16 24 kHz chunks as frames are decoded (first chunk after `first_chunk_frames`)."""
        s = self.open_session(SynthesisRequest(text, **kwargs))
        try:
            while not s.done:
                yield from self.step(s)
        finally:
            self.cancel(s)

    def synthesize(self, text: str, **kwargs) -> SynthesisResult:
        kwargs.setdefault("first_chunk_frames", 25)
        kwargs.setdefault("chunk_frames", 25)
        kwargs.setdefault("max_chunk_frames", None)
        s = self.open_session(SynthesisRequest(text, **kwargs))
        chunks: list[AudioChunk] = []
        try:
            while not s.done:
                chunks.extend(self.step(s))
        finally:
            self.cancel(s)
        pcm = np.concatenate([c.pcm for c in chunks]) if chunks else np.zeros(0, np.int16)
        codes = np.stack(s.codes) if s.codes else np.zeros((0, self.config.talker.num_code_groups), np.int64)
        return SynthesisResult(pcm=pcm, codes=codes, stop_reason=s.stop_reason)

    def generate_codes(self, text: str, **kwargs) -> Tensor:
        """Codes [T, 16] of an utterance without running the vocoder (oracle comparisons)."""
        s = self.open_session(SynthesisRequest(text, vocode=False, **kwargs))
        try:
            while not s.done:
                self.step(s)
        finally:
            self.cancel(s)
        if not s.codes:
            return torch.zeros((0, self.config.talker.num_code_groups), dtype=torch.long)
        return torch.from_numpy(np.stack(s.codes)).long()

    @torch.no_grad()
    def decode_codes(self, codes: Tensor) -> np.ndarray:
        """Whole-utterance vocoder decode of codes [T, 16] -> float32 waveform [T * 1920]."""
        codes = torch.as_tensor(codes, dtype=torch.long, device=self.device)
        if codes.dim() != 2 or codes.shape[1] != self.config.talker.num_code_groups:
            raise InvalidInputError(f"codes must have shape [frames, {self.config.talker.num_code_groups}]")
        self.vocoder_side.order_main()
        return self.vocoder.decode(codes.T[None])[0, 0].float().cpu().numpy()

    def close(self) -> None:
        self.closed = True
