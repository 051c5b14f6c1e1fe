# Copyright 2026 pipecat-qwen-fast authors
# SPDX-License-Identifier: Apache-2.0

"""LiveKit Agents TTS running Qwen3-TTS in-process on the pipecat-qwen-fast engine.

Every TTS instance naming the same model shares one loaded engine and its GPU thread (the
process-wide registry in :mod:`pipecat_qwen_fast.engine.service`), so a TTS shared by many
``AgentSession``s serves them concurrently, frame by frame.

With ``base_url="ws://host:port"`` the engine runs in a ``qwen-fast-tts serve`` process instead
(remote mode, :mod:`pipecat_qwen_fast.remote`): what LiveKit's process-per-job workers need,
since no job process then loads a model. A ``stream()`` is one WebSocket turn whose text is sent
as it is pushed (``synthesize()``, and ``stream()`` with ``streaming_text=False``: one turn a
sentence); closing a stream closes its socket, which stops the server's work for it.
"""

from __future__ import annotations

import asyncio
import os
import weakref
from dataclasses import replace
from typing import Any

from livekit import rtc
from livekit.agents import (
    APIConnectOptions,
    APIError,
    APITimeoutError,
    tokenize,
    tts,
    utils,
)
from livekit.agents.types import DEFAULT_API_CONNECT_OPTIONS, NOT_GIVEN, NotGivenOr
from livekit.agents.utils import is_given

from pipecat_qwen_fast.engine.request import SAMPLE_RATE, SynthesisRequest
from pipecat_qwen_fast.engine.service import EngineService, ServiceHandle
from pipecat_qwen_fast.errors import InvalidInputError, QwenTTSError
from pipecat_qwen_fast.remote import RemoteTTSClient

from .errors import to_api_error
from .models import DEFAULT_MODEL, TTSBackends, TTSLanguages, TTSModels, TTSVoices
from .options import checked_request, checked_sample_rate
from .streamed import run_streamed_text

NUM_CHANNELS = 1


class TTS(tts.TTS):
    def __init__(
        self,
        *,
        model: TTSModels | str | os.PathLike[str] = DEFAULT_MODEL,
        voice: TTSVoices | str | None = None,
        language: TTSLanguages | str = "auto",
        instruct: str | None = None,
        device: str = "auto",
        dtype: str = "auto",
        backend: TTSBackends | str = "auto",
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
        sentence_tokenizer: NotGivenOr[tokenize.SentenceTokenizer] = NOT_GIVEN,
        streaming_text: bool = True,
        sample_rate: int = SAMPLE_RATE,
    ) -> None:
        """Create a Qwen3-TTS text-to-speech for LiveKit Agents.

        Args:
            model: Hugging Face id or local folder of a Qwen3-TTS checkpoint.
            voice: CustomVoice speaker ("ryan", "serena", ...); None picks the model's default.
                On a Base model: a cloned voice's library name or its .voice file path.
            language: Qwen3-TTS language name ("english"), or a code as LiveKit writes it
                ("en", "en-US", "zh-CN", "fr", ...); "auto" (or "multi") lets the model decide.
            instruct: Style instruction (VoiceDesign and 1.7B CustomVoice models).
            device: "auto", "cuda", "cuda:N" or "cpu".
            dtype: "auto", "bfloat16", "float16" or "float32".
            backend: "auto", "megakernel", "torch" (CUDA graphs on a GPU) or "eager".
            seed: Sampling seed for every utterance (reproducible audio); None for fresh
                randomness.
            greedy: Decode greedily instead of sampling.
            text_mode: "prefill" or "dual_track"; None uses the model variant's default.
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
                instead of in-process. The server's model is used (``model``, ``device``,
                ``dtype``, ``backend`` are ignored); every other option is sent with each request
                (chunk sizes up to 32 frames), and ``streaming_text`` streams the pushed text to
                the server, the timed transcript coming back with the audio. None: in-process.
            api_key: The server's API key, if it was started with one.
            sentence_tokenizer: Splits streamed text into sentences (default: blingfire) when
                ``streaming_text`` is off.
            streaming_text: ``stream()`` feeds the pushed text into one dual-track engine session
                per stream as it arrives, with a timed transcript (``aligned_transcript``);
                False synthesizes it sentence by sentence, each sentence its own request.
            sample_rate: Output rate in Hz. The engine makes 24 kHz; any other rate is resampled
                in the plugin with LiveKit's own resampler (livekit.rtc.AudioResampler, soxr).

        Every option is checked here (and in ``update_options``): a wrong one raises
        InvalidInputError (a ValueError) naming it and what it takes.
        """
        _check_text_mode(streaming_text, text_mode)
        self._streaming_text = streaming_text
        super().__init__(
            capabilities=tts.TTSCapabilities(streaming=True, aligned_transcript=streaming_text),
            sample_rate=checked_sample_rate(sample_rate),
            num_channels=NUM_CHANNELS,
        )
        self._model = os.fspath(model)
        # Every field but the text; each sentence's request is a copy with its text filled in.
        # Updates replace it whole, so a stream's reference is a snapshot.
        self._request = checked_request(SynthesisRequest(
            "",
            voice=voice,
            language=language,
            instruct=instruct,
            seed=seed,
            greedy=greedy,
            text_mode=text_mode,
            first_chunk_frames=first_chunk_frames,
            chunk_frames=chunk_frames,
            max_chunk_frames=max_chunk_frames,
            chunk_growth=chunk_growth,
            max_frames=max_frames,
        ))
        self._services = ServiceHandle(engine_service, device=device, dtype=dtype, backend=backend)
        self._remote = RemoteTTSClient(base_url, api_key) if base_url is not None else None
        if self._remote is not None:
            self._remote.open_stream(self._request)  # refuses options the protocol cannot carry
        self._sentence_tokenizer = (
            sentence_tokenizer
            if is_given(sentence_tokenizer)
            else tokenize.blingfire.SentenceTokenizer()
        )
        self._streams: weakref.WeakSet[ChunkedStream | SynthesizeStream] = weakref.WeakSet()

    @property
    def model(self) -> str:
        return self._model

    @property
    def provider(self) -> str:
        return "qwen-fast"

    @property
    def engine_service(self) -> EngineService | None:
        """The EngineService this TTS synthesizes with (None until first use or prewarm)."""
        return self._services.service

    @property
    def remote(self) -> RemoteTTSClient | None:
        """The server's client in remote mode (``base_url``); None in-process."""
        return self._remote

    @property
    def language(self) -> str:
        """The language requests are made in, as the engine names it ("english", "auto", ...)."""
        return str(self._request.language)

    def update_options(
        self,
        *,
        model: NotGivenOr[TTSModels | str] = NOT_GIVEN,
        voice: NotGivenOr[TTSVoices | str | None] = NOT_GIVEN,
        language: NotGivenOr[TTSLanguages | str] = NOT_GIVEN,
        instruct: NotGivenOr[str | None] = NOT_GIVEN,
        seed: NotGivenOr[int | None] = NOT_GIVEN,
        greedy: NotGivenOr[bool] = NOT_GIVEN,
        text_mode: NotGivenOr[str | None] = NOT_GIVEN,
        first_chunk_frames: NotGivenOr[int] = NOT_GIVEN,
        chunk_frames: NotGivenOr[int] = NOT_GIVEN,
        max_chunk_frames: NotGivenOr[int | None] = NOT_GIVEN,
        chunk_growth: NotGivenOr[int] = NOT_GIVEN,
        max_frames: NotGivenOr[int | None] = NOT_GIVEN,
    ) -> None:
        """Change options for later requests; requests already running keep their snapshot.

        The options are checked together first (and, once the model is loaded, against it: its
        voices and languages); a wrong one raises InvalidInputError and changes nothing.
        """
        given = {
            "voice": voice, "language": language, "instruct": instruct, "seed": seed,
            "greedy": greedy, "text_mode": text_mode, "first_chunk_frames": first_chunk_frames,
            "chunk_frames": chunk_frames, "max_chunk_frames": max_chunk_frames,
            "chunk_growth": chunk_growth, "max_frames": max_frames,
        }
        request = checked_request(
            replace(self._request, **{name: value for name, value in given.items() if is_given(value)})
        )
        _check_text_mode(self._streaming_text, request.text_mode)
        if self._remote is not None:
            self._remote.open_stream(request)
        new_model = os.fspath(model) if is_given(model) else self._model
        service = self._services.service
        if new_model == self._model and service is not None and service.ready:
            service.check_request(request)
        if new_model != self._model:
            self._model = new_model
            self._services.model_changed()
        self._request = request

    def prewarm(self) -> None:
        """Start loading the model on the engine thread without waiting for it (remote mode:
        nothing to load here)."""
        if self._remote is None:
            self._acquire_service()

    def synthesize(
        self, text: str, *, conn_options: APIConnectOptions = DEFAULT_API_CONNECT_OPTIONS
    ) -> ChunkedStream:
        stream = ChunkedStream(tts=self, input_text=text, conn_options=conn_options)
        self._streams.add(stream)
        return stream

    def stream(
        self, *, conn_options: APIConnectOptions = DEFAULT_API_CONNECT_OPTIONS
    ) -> SynthesizeStream:
        stream = SynthesizeStream(tts=self, conn_options=conn_options)
        self._streams.add(stream)
        return stream

    async def aclose(self) -> None:
        """Close this TTS's open streams; the shared engine stays loaded for other users."""
        for stream in list(self._streams):
            await stream.aclose()
        self._streams.clear()
        if self._remote is not None:
            await self._remote.aclose()

    def _acquire_service(self) -> EngineService:
        return self._services.acquire(self._model)

    async def _ready_service(self) -> EngineService | RemoteTTSClient:
        if self._remote is not None:
            return self._remote
        service = self._acquire_service()
        try:
            return await service.wait_ready()
        except Exception as e:  # noqa: BLE001 - every load failure becomes an APIError
            # A missing folder, a bad config or an unknown hub id stays broken on retry.
            detail = str(e) if isinstance(e, QwenTTSError) else f"{type(e).__name__}: {e}"
            raise APIError(
                f"could not load the Qwen3-TTS model: {detail}", retryable=False
            ) from None


def _check_text_mode(streaming_text: bool, text_mode: str | None) -> None:
    if streaming_text and text_mode not in (None, "dual_track"):
        raise InvalidInputError(
            f"streaming_text feeds one dual-track session per stream; text_mode={text_mode!r} "
            "needs streaming_text=False"
        )


async def _speak(
    tts_: TTS, request: SynthesisRequest, text: str, output: _Output, timeout: float
) -> None:
    """Synthesize one sentence into the output, mapping engine errors to LiveKit's APIError.

    Each wait for the engine's next chunk (the first included: queue and prefill) is bounded by
    `timeout` (conn_options.timeout): past it the session is stopped and APITimeoutError raised,
    retryable. The model's load is not: a cold start can take minutes, once (prewarm() starts it).
    """
    service = await tts_._ready_service()
    stream: Any = None  # a SynthesisStream, or a RemoteStream in remote mode
    try:
        stream = service.open_stream(replace(request, text=text))
        chunks = stream.__aiter__()
        while True:
            try:
                # A timeout cancels the wait, and with it the session (SynthesisStream.__anext__).
                chunk = await asyncio.wait_for(chunks.__anext__(), timeout)
            except StopAsyncIteration:
                break
            except TimeoutError:
                raise APITimeoutError(
                    f"the Qwen3-TTS engine made no audio for {timeout:g} s (conn_options.timeout)"
                ) from None
            output.push(chunk.pcm.tobytes())
    except APIError:
        raise
    except Exception as e:  # noqa: BLE001 - an engine fault must reach LiveKit as APIError
        raise to_api_error(e) from None
    finally:
        if stream is not None:
            stream.cancel()


class _Output:
    """A stream's AudioEmitter, fed the engine's 24 kHz audio: resampled to the TTS's rate where
    that differs, and counted per segment.

    The resampler is livekit.rtc.AudioResampler, what LiveKit's own TTS FallbackAdapter resamples
    TTS audio with: soxr in LiveKit's native library, already installed with livekit-agents, and
    stateful across pushes, so chunk boundaries leave no clicks. A segment's end flushes it (its
    filter holds the last few milliseconds) and the next segment starts a fresh one.
    """

    def __init__(self, emitter: tts.AudioEmitter, sample_rate: int, *, stream: bool) -> None:
        self._emitter = emitter
        self._rate = sample_rate
        self._resampler: rtc.AudioResampler | None = None
        self.segment_samples = 0  # engine samples pushed since the segment started
        emitter.initialize(
            request_id=utils.shortuuid(),
            sample_rate=sample_rate,
            num_channels=NUM_CHANNELS,
            mime_type="audio/pcm",
            stream=stream,
        )

    def push(self, pcm: bytes) -> None:
        self.segment_samples += len(pcm) // 2
        if self._rate == SAMPLE_RATE:
            self._emitter.push(pcm)
            return
        if self._resampler is None:
            self._resampler = rtc.AudioResampler(
                SAMPLE_RATE, self._rate, num_channels=NUM_CHANNELS,
                quality=rtc.AudioResamplerQuality.HIGH,
            )
        for frame in self._resampler.push(bytearray(pcm)):
            self._emitter.push(bytes(frame.data))

    def start_segment(self, *, segment_id: str) -> None:
        self.segment_samples = 0
        self._emitter.start_segment(segment_id=segment_id)

    def end_segment(self) -> None:
        self._drain()
        self._emitter.end_segment()

    def flush(self) -> None:
        self._drain()
        self._emitter.flush()

    def push_timed_transcript(self, delta_text) -> None:  # noqa: ANN001 - LiveKit's own types
        self._emitter.push_timed_transcript(delta_text)

    def _drain(self) -> None:
        if self._resampler is not None:
            for frame in self._resampler.flush():
                self._emitter.push(bytes(frame.data))
            self._resampler = None


def _no_audio_error() -> APIError:
    # LiveKit's base class raises its own error here, naming the text (and logs it on every
    # retry); this says the same without it. No retry helps: the text has nothing to say (lone
    # surrogates only, say), or the model ends it at once.
    return APIError("the engine made no audio for this text: nothing to say", retryable=False)


class ChunkedStream(tts.ChunkedStream):
    """One text in, its audio out."""

    def __init__(self, *, tts: TTS, input_text: str, conn_options: APIConnectOptions) -> None:
        super().__init__(tts=tts, input_text=input_text, conn_options=conn_options)
        self._tts: TTS = tts
        self._request = tts._request

    async def _run(self, output_emitter: tts.AudioEmitter) -> None:
        output = _Output(output_emitter, self._tts.sample_rate, stream=False)
        await _speak(self._tts, self._request, self._input_text, output, self._conn_options.timeout)
        if output.segment_samples == 0 and self._input_text.strip():
            raise _no_audio_error()
        output.flush()


class SynthesizeStream(tts.SynthesizeStream):
    """Streamed text in: one engine session per stream fed as the text arrives (streamed.py),
    or with ``streaming_text=False`` each flush closes one segment, synthesized sentence by
    sentence."""

    def __init__(self, *, tts: TTS, conn_options: APIConnectOptions) -> None:
        super().__init__(tts=tts, conn_options=conn_options)
        self._tts: TTS = tts
        self._request = tts._request
        self._has_text = False

    def push_text(self, token: str) -> None:
        # Whether LiveKit's base class would call a last segment with no audio an error.
        self._has_text = self._has_text or bool(token.strip())
        super().push_text(token)

    async def _run(self, output_emitter: tts.AudioEmitter) -> None:
        output = _Output(output_emitter, self._tts.sample_rate, stream=True)
        if self._tts._streaming_text:
            await run_streamed_text(self, output)
        else:
            await self._run_sentences(output)
        if self._has_text and output.segment_samples == 0:
            raise _no_audio_error()

    async def _run_sentences(self, output: _Output) -> None:
        segments = utils.aio.Chan[tokenize.SentenceStream]()
        opened: list[tokenize.SentenceStream] = []

        async def split_segments() -> None:
            sentences: tokenize.SentenceStream | None = None
            async for data in self._input_ch:
                if isinstance(data, self._FlushSentinel):
                    if sentences is not None:
                        sentences.end_input()
                        sentences = None
                    continue
                if sentences is None:
                    sentences = self._tts._sentence_tokenizer.stream()
                    opened.append(sentences)
                    segments.send_nowait(sentences)
                sentences.push_text(data)
            if sentences is not None:
                sentences.end_input()
            segments.close()

        async def speak_segments() -> None:
            async for sentences in segments:
                output.start_segment(segment_id=utils.shortuuid())
                async for ev in sentences:
                    if not ev.token.strip():
                        continue
                    self._mark_started()
                    await _speak(self._tts, self._request, ev.token, output, self._conn_options.timeout)
                output.end_segment()

        tasks = [
            asyncio.create_task(split_segments(), name="qwen_fast.split_segments"),
            asyncio.create_task(speak_segments(), name="qwen_fast.speak_segments"),
        ]
        try:
            await asyncio.gather(*tasks)
        finally:
            await utils.aio.cancel_and_wait(*tasks)
            for sentences in opened:
                await sentences.aclose()


__all__ = ["TTS", "ChunkedStream", "SynthesizeStream"]
