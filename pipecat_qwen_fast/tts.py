"""Pipecat text-to-speech service for self-hosted Qwen3-TTS (pipecat-qwen-fast engine).

Tested with Pipecat v1.14.0. Usage::

    from pipecat_qwen_fast import QwenFastTTSService

    tts = QwenFastTTSService(
        settings=QwenFastTTSService.Settings(
            model="Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice", voice="ryan", language="english"
        )
    )

All services in a process that name the same model share one loaded engine and one GPU thread
(see :mod:`pipecat_qwen_fast.engine.service`), so many pipelines can run side by side on one GPU.

With ``base_url="ws://host:port"`` the engine runs in a ``qwen-fast-tts serve`` process instead
(remote mode, :mod:`pipecat_qwen_fast.remote`): no model is loaded here, and each sentence (in
token mode, each assistant turn, its tokens sent as they come) is one WebSocket turn that an
interruption closes.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from loguru import logger

try:
    from pipecat.audio.utils import create_stream_resampler
    from pipecat.frames.frames import ErrorFrame, Frame, StartFrame, TTSAudioRawFrame
    from pipecat.processors.frame_processor import FrameProcessorSetup
    from pipecat.services.settings import TTSSettings
    from pipecat.services.tts_service import TextAggregationMode, TTSService
    from pipecat.transcriptions.language import Language, resolve_language
    from pipecat.utils.tracing.service_decorators import traced_tts
    from pipecat.utils.types import NOT_GIVEN, NotGiven
except ModuleNotFoundError as e:  # pragma: no cover - depends on the install
    logger.error(f"Exception: {e}")
    logger.error(
        'In order to use QwenFastTTSService, you need to `pip install "pipecat-qwen-fast[pipecat]"`.'
    )
    raise ImportError(f"Missing module: {e}") from e

from pipecat_qwen_fast.config import DEFAULT_MODEL
from pipecat_qwen_fast.engine.request import SynthesisRequest
from pipecat_qwen_fast.engine.service import EngineService, ServiceHandle, SynthesisStream
from pipecat_qwen_fast.engine.validation import check_options
from pipecat_qwen_fast.errors import (
    EngineClosedError,
    InvalidInputError,
    ModelLoadError,
    QwenTTSError,
)
from pipecat_qwen_fast.remote import RemoteTTSClient, RemoteUnavailableError
from pipecat_qwen_fast.tts_turns import TokenTurns

# How long Pipecat keeps an audio context open with no new audio. While the engine works on an
# utterance the context is kept open whatever this is (run_tts refreshes it), so it only bounds the
# waits for more text: a slow LLM between two sentences, or between two tokens in token mode, where
# Pipecat's 3 s would close a turn's context in the middle.
DEFAULT_STOP_FRAME_TIMEOUT_S = 10.0

_LANGUAGE_MAP = {
    Language.ZH: "chinese",
    Language.EN: "english",
    Language.DE: "german",
    Language.IT: "italian",
    Language.PT: "portuguese",
    Language.ES: "spanish",
    Language.JA: "japanese",
    Language.KO: "korean",
    Language.FR: "french",
    Language.RU: "russian",
}


def language_to_qwen_language(language: Language) -> str:
    """Map a Pipecat ``Language`` to a Qwen3-TTS language name ("english", "chinese", ...).

    Regional variants resolve through their base language (en-US -> "english"); languages
    Qwen3-TTS does not know resolve to their base code, which the engine then rejects with the
    list of valid names.
    """
    return resolve_language(language, _LANGUAGE_MAP, use_base_code=True)


@dataclass
class QwenFastTTSSettings(TTSSettings):
    """Runtime-updatable settings for :class:`QwenFastTTSService`.

    Parameters:
        model: Hugging Face id or local folder of a Qwen3-TTS checkpoint. Changing it at runtime
            loads (or reuses) that model's shared engine on the next utterance.
        voice: CustomVoice speaker name ("ryan", "serena", ...); None picks the model's default.
            On a Base model: a cloned voice's library name or its .voice file path.
        language: Qwen3-TTS language name or Pipecat ``Language``; "auto" lets the model decide.
        instruct: Style instruction (VoiceDesign, 1.7B CustomVoice); None for none.
    """

    instruct: str | None | NotGiven = field(default_factory=lambda: NOT_GIVEN)


class QwenFastTTSService(TokenTurns, TTSService):
    """Pipecat TTS service running Qwen3-TTS in-process on the pipecat-qwen-fast engine.

    Audio is int16 mono, produced at the engine's 24 kHz and resampled to the pipeline's output
    rate. The model starts loading on the engine's own thread when the service is constructed, so
    neither the constructor nor the pipeline's start waits for it and the event loop is never
    blocked: ``ready`` says whether it is loaded, ``await wait_ready()`` waits for it, and the first
    utterance waits for it if it must. An interruption stops the engine's work for the interrupted
    context before its next frame.

    With ``text_aggregation_mode=TextAggregationMode.TOKEN`` each assistant turn is one
    dual-track engine session fed token by token as the LLM writes (tts_turns.py), and word
    timestamps go through the base class; sentence mode synthesizes each sentence on its own.
    """

    Settings = QwenFastTTSSettings
    _settings: Settings

    def __init__(
        self,
        *,
        model: str | os.PathLike[str] | None = None,
        device: str = "auto",
        dtype: str = "auto",
        backend: str = "auto",
        seed: int | None = None,
        greedy: bool = False,
        text_mode: str | None = None,
        first_chunk_frames: int = 1,
        chunk_frames: int = 1,
        max_chunk_frames: int | None = 32,
        chunk_growth: int = 1,
        max_frames: int | None = None,
        engine_service: EngineService | None = None,
        base_url: str | None = None,
        api_key: str | None = None,
        stop_frame_timeout_s: float = DEFAULT_STOP_FRAME_TIMEOUT_S,
        settings: Settings | None = None,
        **kwargs: Any,
    ):
        """Initialize the service.

        Args:
            model: Shorthand for ``settings.model`` (a hub id or local checkpoint folder).
            device: "auto", "cuda", "cuda:N" or "cpu".
            dtype: "auto", "bfloat16", "float16" or "float32".
            backend: "auto", "megakernel", "torch" (CUDA graphs on a GPU) or "eager".
            seed: Sampling seed for every utterance (reproducible audio); None for fresh
                randomness.
            greedy: Decode greedily instead of sampling.
            text_mode: "prefill" (whole text in the prompt) or "dual_track" (streamed text);
                None uses the model variant's official default.
            first_chunk_frames: Codec frames (80 ms each) in the first audio chunk.
            chunk_frames: Codec frames in the second chunk.
            max_chunk_frames: From the third chunk on, chunks double up to this many frames,
                each at most ``chunk_growth`` times the audio already sent (1, 1, 2, 4, 8, 16,
                32, ... by default: fewer vocoder calls per second of audio); None keeps every later
                chunk at ``chunk_frames``.
            chunk_growth: See ``max_chunk_frames`` (1). The default 1, 1, 2, 4, ... sends a new
                call's second chunk one frame after its first, which leaves a busy engine more time
                before audio runs out; ``chunk_frames=2, chunk_growth=2`` (1, 2, 4, ...) makes one
                chunk fewer an utterance.
            max_frames: Cap on frames per utterance; None uses the model's limit.
            engine_service: Use this EngineService instead of the process-wide shared one.
            base_url: A ``qwen-fast-tts serve`` server ("ws://host:port") to synthesize on
                instead of in-process; the server's model is used (``model``, ``device``,
                ``dtype``, ``backend`` are then ignored), every other option is sent with each
                request (chunk sizes up to 32 frames), and token mode streams each turn's tokens
                to the server as they come. None: in-process.
            api_key: The server's API key, if it was started with one.
            stop_frame_timeout_s: How long a context waits for more text with no new audio
                before it is closed (never while the engine works on it).
            settings: Runtime-updatable settings (model, voice, language, instruct).
            **kwargs: Passed to Pipecat's ``TTSService`` (sample_rate, text_transforms, ...).
        """
        token_mode = kwargs.get("text_aggregation_mode") == TextAggregationMode.TOKEN or (
            kwargs.get("aggregate_sentences") is False
        )
        if token_mode and text_mode not in (None, "dual_track"):
            raise InvalidInputError(
                "token mode streams each turn into one dual-track session; "
                f"text_mode={text_mode!r} needs sentence mode"
            )
        # Token mode times words through the base class (add_word_timestamps); sentence mode
        # pushes each sentence's text after its audio.
        kwargs.setdefault("push_text_frames", not token_mode)
        default_settings = self.Settings(
            model=DEFAULT_MODEL, voice=None, language="auto", instruct=None
        )
        if model is not None:
            default_settings.model = os.fspath(model)
        if settings is not None:
            default_settings.apply_update(settings)

        super().__init__(
            push_start_frame=True,
            push_stop_frames=True,
            stop_frame_timeout_s=stop_frame_timeout_s,
            settings=default_settings,
            **kwargs,
        )
        self._generation = {
            "seed": seed,
            "greedy": greedy,
            "text_mode": text_mode,
            "first_chunk_frames": first_chunk_frames,
            "chunk_frames": chunk_frames,
            "max_chunk_frames": max_chunk_frames,
            "chunk_growth": chunk_growth,
            "max_frames": max_frames,
        }
        # A wrong one is refused here rather than at every utterance.
        check_options(SynthesisRequest("", **self._generation))
        self._remote = RemoteTTSClient(base_url, api_key) if base_url is not None else None
        if self._remote is not None:
            self._remote.open_stream(SynthesisRequest("", **self._generation))  # checks options
        self._services = ServiceHandle(engine_service, device=device, dtype=dtype, backend=backend)
        self._streams: dict[str, set[SynthesisStream]] = {}
        # A context is refreshed this often while its utterance's next chunk is being made: a
        # quarter of the timeout, so an event loop held up for up to 3/4 of it (a loaded host)
        # still refreshes in time; a refresh is one put_nowait.
        self._keepalive_s = max(0.05, stop_frame_timeout_s / 4)
        self._load_watch: asyncio.Task | None = None
        self._load_failure_reported: EngineService | None = None
        self._init_token_turns()
        # Loading starts now, on the engine thread, as Pipecat's local services load when built;
        # StartFrame then passes at once (Pipecat gives a processor 1 s by default in tests).
        if self._remote is None:
            self._acquire_service()

    @property
    def engine_service(self) -> EngineService | None:
        """The EngineService this Pipecat service synthesizes with (its model may still be loading)."""
        return self._services.service

    @property
    def ready(self) -> bool:
        """Whether the model is loaded (the first utterance then starts without waiting for it)."""
        if self._remote is not None:
            return self._remote.ready
        service = self._services.service
        return service is not None and service.ready

    @property
    def remote(self) -> RemoteTTSClient | None:
        """The server's client in remote mode (``base_url``); None in-process."""
        return self._remote

    async def wait_ready(self) -> None:
        """Wait until the model is loaded; raise its load error (ModelLoadError, say) if it failed.
        In remote mode: until the server is ready (RemoteUnavailableError if it cannot be reached)."""
        if self._remote is not None:
            await self._remote.wait_ready()
            return
        await self._acquire_service().wait_ready()

    def can_generate_metrics(self) -> bool:
        """TTFB, TTFA, processing and usage (characters) metrics are all reported."""
        return True

    def language_to_service_language(self, language: Language) -> str | None:
        """Map a Pipecat ``Language`` to a Qwen3-TTS language name."""
        return language_to_qwen_language(language)

    #
    # Lifecycle
    #

    async def setup(self, setup: FrameProcessorSetup):
        """Make sure the model is loading (it started in the constructor; returns at once)."""
        await super().setup(setup)
        if self._remote is None:
            self._acquire_service()

    async def start(self, frame: StartFrame):
        """Let StartFrame pass at once; a task reports a load failure, a permanent error for this
        service, as soon as it happens rather than at the first utterance."""
        await super().start(frame)
        if self._remote is not None:
            return
        self._load_watch = self.create_task(self._wait_for_service(), name="qwen_fast.watch_load")

    async def on_audio_context_interrupted(self, context_id: str):
        """Stop the engine's work for an interrupted context before its next frame."""
        self._cancel_streams(context_id)
        await super().on_audio_context_interrupted(context_id)

    async def cleanup(self):
        """Stop this service's streams; the shared engine stays loaded for other users."""
        if self._load_watch is not None:
            await self.cancel_task(self._load_watch)
            self._load_watch = None
        for context_id in list(self._streams):
            self._cancel_streams(context_id)
        if self._remote is not None:
            await self._remote.aclose()
        await super().cleanup()

    def _cancel_streams(self, context_id: str) -> None:
        for stream in self._streams.pop(context_id, set()):
            stream.cancel()

    async def _update_settings(self, delta: Settings) -> dict[str, Any]:
        """Voice, language and instruct apply from the next sentence; a new model is loaded
        (or found already loaded) on the engine thread without blocking."""
        changed = await super()._update_settings(delta)
        if "model" in changed and self._remote is not None:
            self._warn_unhandled_updated_settings({"model": changed["model"]})
        elif "model" in changed:
            if self._services.model_changed():
                self._acquire_service()
            else:
                self._warn_unhandled_updated_settings({"model": changed["model"]})
        if changed.keys() & {"model", "voice", "language", "instruct"}:
            await self._check_settings()
        return changed

    async def _check_settings(self) -> None:
        """Report a voice, language or instruct the model cannot take when it is set, rather than
        at the next utterance (which would fail the same way, ending its context at once). Not a
        permanent error: the next update may fix it. Before the model is loaded, each utterance's
        request is checked by the engine as it opens."""
        service = self._services.service
        if service is None or not service.ready:
            return
        try:
            # Off the event loop: a Base model's voice may be a file to read.
            await asyncio.to_thread(service.check_request, self._build_request("."))
        except QwenTTSError as e:
            await self.push_error(f"{self}: {e}", exception=e)

    def _acquire_service(self) -> EngineService:
        return self._services.acquire(self._settings.model or DEFAULT_MODEL)

    async def _wait_for_service(self) -> EngineService | RemoteTTSClient | None:
        """The loaded service (the server's client in remote mode), or None after pushing a
        permanent error for a failed load."""
        if self._remote is not None:
            return self._remote
        service = self._acquire_service()
        try:
            return await service.wait_ready()
        except Exception as e:  # noqa: BLE001 - any load failure leaves the service unusable
            if self._load_failure_reported is not service:  # once per load attempt
                self._load_failure_reported = service
                await self.push_error(
                    f"{self}: could not load the Qwen3-TTS model: {e}",
                    exception=e,
                    force_treat_as_permanent=True,
                )
            return None

    #
    # Synthesis
    #

    def _build_request(self, text: str) -> Any:
        language = self._settings.language
        return SynthesisRequest(
            text,
            voice=self._settings.voice or None,
            language=str(language) if language else "auto",
            instruct=self._settings.instruct or None,
            **self._generation,
        )

    async def tts_process_generator(
        self, context_id: str, generator: AsyncGenerator[Frame | None, None]
    ):
        """Run one sentence's run_tts; its context then ends with the turn, audio or not."""
        await super().tts_process_generator(context_id, generator)
        if not self._is_streaming_tokens:
            # Sentence mode yields its audio inline, so the base closes the turn's context when the
            # turn completes, but only if the turn's last call yielded audio. A call that failed
            # (an unknown voice, say) left the context open until stop_frame_timeout_s, every later
            # context queued behind it, and Pipecat counting it as silent only after that.
            self._is_yielding_frames_synchronously = True

    async def _keeping_context_open(
        self, stream: SynthesisStream, context_id: str
    ) -> AsyncGenerator[Any, None]:
        """The stream's chunks, the audio context refreshed while the engine makes each one: a
        chunk can take longer than stop_frame_timeout_s (32 frames on a CPU, a cold start), and
        Pipecat would close the context mid-utterance, its later audio going out with no
        TTSStartedFrame."""
        chunks = stream.__aiter__()
        while True:
            nxt = asyncio.ensure_future(chunks.__anext__())
            try:
                while not (await asyncio.wait({nxt}, timeout=self._keepalive_s))[0]:
                    # Pipecat's hook for a context still in use (private in 1.14, no public one).
                    self._refresh_audio_context(context_id)
            except asyncio.CancelledError:
                nxt.cancel()  # the stream stops its session (SynthesisStream.__anext__)
                raise
            try:
                chunk = nxt.result()
            except StopAsyncIteration:
                return
            yield chunk

    @traced_tts
    async def run_tts(self, text: str, context_id: str) -> AsyncGenerator[Frame | None, None]:
        """Synthesize one sentence; yields int16 mono ``TTSAudioRawFrame``s at the pipeline rate.

        Args:
            text: The sentence to speak.
            context_id: The audio context this sentence belongs to.
        """
        if self._is_streaming_tokens:
            async for frame in self._run_tts_token(text, context_id):
                yield frame
            return
        service = await self._wait_for_service()
        if service is None:
            return
        stream: Any = None  # a SynthesisStream, or a RemoteStream in remote mode
        try:
            stream = service.open_stream(self._build_request(text))
            self._streams.setdefault(context_id, set()).add(stream)
            await self.start_tts_usage_metrics(text)
            in_rate = service.sample_rate
            resampler = (
                # One resampler per utterance, flushed at its end; never cleared mid-way
                # (a slow first chunk must not drop the samples the filter holds).
                create_stream_resampler(clear_after_secs=None)
                if in_rate != self.sample_rate
                else None
            )
            async for chunk in self._keeping_context_open(stream, context_id):
                audio = chunk.pcm.tobytes()
                if resampler is not None:
                    audio = await resampler.resample(audio, in_rate, self.sample_rate)
                if audio:
                    await self.stop_ttfb_metrics()
                    yield TTSAudioRawFrame(audio, self.sample_rate, 1, context_id=context_id)
            if resampler is not None and (tail := await resampler.flush()):
                yield TTSAudioRawFrame(tail, self.sample_rate, 1, context_id=context_id)
        except RemoteUnavailableError as e:
            # The server may be back for the next sentence (a restart, a drained replica).
            yield ErrorFrame(error=f"{self}: {e}")
        except (ModelLoadError, EngineClosedError) as e:
            await self.push_error(
                f"{self}: the Qwen3-TTS engine is unavailable: {e}",
                exception=e,
                force_treat_as_permanent=True,
            )
        except QwenTTSError as e:
            # A bad request (unknown voice, empty text, ...) says nothing about the service's
            # health: the next request may well be fine.
            yield ErrorFrame(error=f"{self}: {e}")
        except Exception as e:  # noqa: BLE001 - an engine fault becomes an error frame
            logger.error(f"{self}: synthesis failed: {type(e).__name__}: {e}")
            yield ErrorFrame(error=f"{self}: synthesis failed: {type(e).__name__}: {e}")
        finally:
            if stream is not None:
                stream.cancel()
                streams = self._streams.get(context_id)
                if streams is not None:
                    streams.discard(stream)
                    if not streams:
                        del self._streams[context_id]
            await self.stop_ttfb_metrics()
