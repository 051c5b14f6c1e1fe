"""OpenAI's speech API: ``POST /v1/audio/speech``, plus ``/v1/models`` (voices: :mod:`.voices_api`).

Beyond OpenAI's fields it takes vLLM-Omni's ``language``, ``max_new_tokens`` (a cap in 80 ms
frames), ``task_type`` and, on a Base model, a recording to clone (``ref_audio``, ``ref_text``,
``x_vector_only_mode``: :mod:`.inline_voices`), and a ``seed``. The body is parsed by hand
rather than by a pydantic model so that no error message can carry the input back (a validation
error would quote it), and so that a 1 MB body is refused before it is read whole. Audio streams back chunk by chunk as the engine makes
it: raw PCM, a WAV whose header announces an open length, or OpenAI's server-sent events
(``stream_format="sse"``, which LiveKit's OpenAI TTS asks for by default).
"""

from __future__ import annotations

import base64
import json
import logging
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.types import Receive, Scope, Send

from .api_errors import ApiError, bad_request, from_engine_error
from .context import ServerContext, context_of
from .encoders import CODECS, StreamEncoder
from .inline_voices import MAX_INLINE_BYTES, InlineClone, parse_voice
from .metrics import PlayoutClock
from .speech import (
    SpeechOptions,
    check_fields,
    check_speed,
    check_text,
    frame_cap,
    optional_int,
    optional_str,
    required_str,
)
from .streams import AudioStream

logger = logging.getLogger("pipecat_qwen_fast.server")

router = APIRouter()

FIELDS = frozenset({"model", "input", "voice", "instructions", "response_format", "speed",
                    "stream_format", "language", "seed", "max_new_tokens", "task_type",
                    "ref_audio", "ref_text", "x_vector_only_mode", "speaker_embedding"})
MEDIA_TYPES = {"pcm": "audio/pcm", "wav": "audio/wav",
               **{fmt: media for fmt, (_, _, media, _) in CODECS.items()}}
STREAM_FORMATS = ("audio", "sse")
# A JSON escape (backslash, u, four hex digits) takes 6 bytes a character; the rest is room
# for the other fields.
BODY_BYTES_PER_CHAR = 6
BODY_OVERHEAD = 16 * 1024


@router.post("/v1/audio/speech")
async def create_speech(request: Request) -> StreamingResponse:
    ctx = context_of(request)
    started = time.monotonic()
    ctx.authorize(request.headers)
    service = ctx.require_ready()
    # A Base model's request may carry a recording to clone.
    extra = MAX_INLINE_BYTES if service.model_type == "base" else 0
    body = await read_json_object(request, ctx.settings.max_input_chars, extra)
    check_fields(body, FIELDS, "the request")
    text, options, fmt, stream_format, clone = parse_speech(body, ctx)
    if clone is not None:  # before a slot is taken: encoding a new recording takes a while
        options.voice = await ctx.inline_voices.voice(clone, ctx)
    slot = ctx.gate.admit()
    stream: AudioStream | None = None
    try:
        stream = ctx.open_audio(options.request(text), "http", PlayoutClock(), started)
        # Pull the first chunk before answering, so that a request the engine refuses (bad voice
        # for this variant, overload) gets its 4xx/5xx instead of a 200 with an empty body.
        first = await stream.next_pcm()
    except ApiError:
        await close_quietly(stream)
        slot.release()
        raise
    except Exception as exc:
        await close_quietly(stream)
        slot.release()
        raise from_engine_error(exc, ctx.settings.retry_after_s) from None
    # A cloned voice's repr holds its transcript: never logged.
    logger.info("speech request: %d chars, voice=%s, format=%s/%s", len(text),
                "(inline clone)" if clone is not None else options.voice, fmt, stream_format)

    async def finish() -> None:
        await close_quietly(stream)
        slot.release()

    chunks = encode_chunks(stream, first or b"", fmt, stream_format, service.sample_rate, ctx)
    media_type = "text/event-stream" if stream_format == "sse" else MEDIA_TYPES[fmt]
    return AudioResponse(chunks, finish, media_type=media_type,
                         headers={"Cache-Control": "no-store"})


@router.get("/v1/models")
async def list_models(request: Request) -> JSONResponse:
    ctx = context_of(request)
    ctx.authorize(request.headers)
    return JSONResponse({"object": "list", "data": [
        {"id": ctx.settings.model_name, "object": "model", "owned_by": "pipecat-qwen-fast"}]})


def parse_speech(body: dict, ctx: ServerContext) -> tuple[str, SpeechOptions, str, str, InlineClone | None]:
    """The text, the synthesis options, the audio format, the stream format and the recording to
    clone (None: a named voice) of a request."""
    text = check_text(required_str(body, "input"), ctx.settings.max_input_chars)
    book = ctx.voice_book()
    voice, clone = parse_voice(body, book, ctx.require_ready().model_type)
    # One process serves one model, so 'model' names nothing to choose: clients send their own
    # defaults ('tts-1', 'gpt-4o-mini-tts') and are served the same.
    optional_str(body, "model")
    fmt = (optional_str(body, "response_format") or "wav").lower()
    if fmt not in MEDIA_TYPES:
        raise bad_request(f"response_format {fmt!r} is not supported; valid choices: "
                          f"{', '.join(MEDIA_TYPES)}", "response_format")
    stream_format = (optional_str(body, "stream_format") or "audio").lower()
    if stream_format not in STREAM_FORMATS:
        raise bad_request(f"stream_format {stream_format!r} is not supported; valid choices: "
                          f"{', '.join(STREAM_FORMATS)}", "stream_format")
    check_speed(body)
    options = SpeechOptions(
        voice=voice,
        language=book.resolve_language(optional_str(body, "language")),
        instruct=optional_str(body, "instructions") or None,
        seed=optional_int(body, "seed", low=0, high=2**63 - 1),
        max_frames=frame_cap(optional_int(body, "max_new_tokens", low=1), ctx.settings.max_frames),
    )
    return text, options, fmt, stream_format, clone


async def read_json_object(request: Request, max_chars: int, extra: int = 0) -> dict:
    """The body as a JSON object; refused before it is all read if it cannot fit the bound (the
    text's, plus `extra` bytes for a recording)."""
    limit = max_chars * BODY_BYTES_PER_CHAR + BODY_OVERHEAD + extra
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(int(declared), limit, extra)
    data = bytearray()
    async for piece in request.stream():
        data += piece
        if len(data) > limit:
            raise too_large(len(data), limit, extra)
    try:
        body = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        # The decoder's message holds a position, never the document.
        reason = exc.msg if isinstance(exc, json.JSONDecodeError) else "not UTF-8"
        raise bad_request(f"the request body is not valid JSON ({reason})") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body


def too_large(size: int, limit: int, extra: int = 0) -> ApiError:
    bound = "input is bounded by the server's max_input_chars"
    if extra:
        bound += f", ref_audio by {extra} bytes"
    return ApiError(413, f"the request body is {size} bytes or more; the limit is {limit} "
                    f"({bound})", code="body_too_large")


def wav_header(sample_rate: int) -> bytes:
    """A mono 16-bit WAV header for a stream of unknown length (sizes at their maximum)."""
    unknown = 0xFFFFFFFF
    return (b"RIFF" + struct.pack("<I", unknown) + b"WAVE"
            + b"fmt " + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16)
            + b"data" + struct.pack("<I", unknown))


def sse_event(event: dict) -> bytes:
    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"


class StreamAborted(Exception):
    """The engine failed after the response began: the body is cut off, not finished, so the
    client sees a truncated transfer rather than a short but complete file."""


async def encode_chunks(stream: AudioStream, first: bytes, fmt: str, stream_format: str,
                        sample_rate: int, ctx: ServerContext) -> AsyncIterator[bytes]:
    def framed(audio: bytes) -> bytes:
        if stream_format == "sse":
            return sse_event({"type": "speech.audio.delta", "audio": base64.b64encode(audio).decode()})
        return audio

    encoder = StreamEncoder(fmt, sample_rate) if fmt in CODECS else None
    try:
        header = wav_header(sample_rate) if fmt == "wav" else b""
        pending = encoder.encode(first) if encoder is not None else header + first
        while True:
            if pending:  # an encoder may hold a chunk's audio until the next
                yield framed(pending)
            try:
                pcm = await stream.next_pcm()
            except Exception as exc:
                error = from_engine_error(exc, ctx.settings.retry_after_s)
                ctx.count_failure(error)
                logger.error("speech stream failed after %d chunks: %s", stream.chunks, error.message)
                if stream_format == "sse":
                    yield sse_event({"type": "error", "error": error.body()["error"]})
                raise StreamAborted() from None
            if pcm is None:
                break
            pending = encoder.encode(pcm) if encoder is not None else pcm
        tail = encoder.finish() if encoder is not None else b""
        if tail:
            yield framed(tail)
        if stream_format == "sse":
            yield sse_event({"type": "speech.audio.done"})
    finally:
        if encoder is not None:
            encoder.close()


class AudioResponse(StreamingResponse):
    """A streaming response that frees its engine stream however it ends.

    Starlette leaves the body iterator suspended when the client goes away; here a disconnect
    cancels the send at once and ``on_close`` (close the engine stream, release the admission
    slot) always runs, so a listener who hangs up stops the engine's work for that stream.
    """

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]],
                 **kwargs) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream_then_stop() -> None:
                    await self.stream_response(send)
                    group.cancel_scope.cancel()

                group.start_soon(stream_then_stop)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        except* StreamAborted:
            # Returning without the final empty body makes the server drop the connection.
            pass
        except* OSError:
            pass  # the client went away mid-send
        finally:
            with anyio.CancelScope(shield=True):
                await self._on_close()


async def close_quietly(stream: AudioStream | None) -> None:
    if stream is not None:
        await stream.aclose()
