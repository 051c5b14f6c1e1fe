"""Voices cloned inline, from ``ref_audio`` in a WebSocket session.config (as LiveKit's Qwen3TTS
client sends it) or a POST /v1/audio/speech body (vLLM-Omni's fields on both): the recording as
base64 (or a ``data:`` URL), with its transcript in ``ref_text`` for an in-context voice, or
``x_vector_only_mode`` for an x-vector one.

A voice is made once per recording and transcript and kept (the last MAX_KEPT), so a client that
sends the same reference on every socket, as LiveKit's does, pays the encoders once. At most
MAX_MAKING new recordings wait to be encoded; one more is refused (503, Retry-After) rather than
held, with its body, behind them. It is not
registered by name: GET /v1/audio/voices lists uploads only. Encoding runs on a worker thread,
one at a time with uploads (ServerContext.voice_upload_lock).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from pipecat_qwen_fast import InvalidInputError

from .api_errors import bad_request, from_engine_error, refused
from .speech import check_task_type, optional_bool, optional_str

logger = logging.getLogger("pipecat_qwen_fast.server")

MAX_KEPT = 32
# New recordings queued for the encoders at once (~25 ms each on the H200, ~1 s on a CPU).
MAX_MAKING = 8
# A message or body that carries a recording: 30 s of 16-bit 48 kHz WAV is 2.9 MB, 3.8 in base64.
MAX_INLINE_BYTES = 4 * 1024 * 1024
MAX_REF_TEXT_CHARS = 2000  # a reference's transcript, inline or uploaded


@dataclass(frozen=True)
class InlineClone:
    """A request's reference: the recording's bytes and, for an in-context voice, its
    transcript."""

    audio: bytes
    ref_text: str | None

    @property
    def key(self) -> str:
        digest = hashlib.sha256(self.audio)
        digest.update(b"\0" + (self.ref_text or "").encode("utf-8", "surrogatepass"))
        return digest.hexdigest() + ("-icl" if self.ref_text is not None else "-xvec")


def parse_inline_clone(msg: dict, model_type: str) -> InlineClone | None:
    """The reference a session.config clones its voice from; None when it names no reference.
    An ApiError says what cannot be served, naming the valid choices."""
    if msg.get("speaker_embedding") is not None:
        raise bad_request("speaker_embedding is not supported; send the recording as ref_audio "
                          "(base64) or upload it (POST /v1/audio/voices) and name it as voice",
                          "speaker_embedding")
    ref_audio = optional_str(msg, "ref_audio")
    ref_text = optional_str(msg, "ref_text")
    x_vector_only = optional_bool(msg, "x_vector_only_mode")
    if ref_audio is None:
        if ref_text is not None or x_vector_only:
            field = "ref_text" if ref_text is not None else "x_vector_only_mode"
            raise bad_request(f"{field} needs ref_audio, the recording to clone", field)
        return None
    if model_type != "base":
        raise bad_request(f"voice cloning (ref_audio) needs a Base model; this server runs a "
                          f"{model_type} model: use a preset voice (GET /v1/audio/voices)",
                          "ref_audio")
    if ref_audio.startswith(("http://", "https://")):
        raise bad_request("ref_audio as a URL is not fetched by this server; send the recording "
                          "as base64 (or a data: URL), or upload it (POST /v1/audio/voices)",
                          "ref_audio")
    if ref_audio.startswith("data:"):
        head, sep, ref_audio = ref_audio.partition(",")
        if not sep or not head.endswith(";base64"):
            raise bad_request("ref_audio as a data: URL must be base64 (data:audio/wav;base64,...)",
                              "ref_audio")
    try:
        audio = base64.b64decode(ref_audio, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request("ref_audio is not valid base64: send the recording's file bytes "
                          "(WAV, FLAC, OGG or MP3) base64-encoded", "ref_audio") from None
    if not audio:
        raise bad_request("ref_audio is empty", "ref_audio")
    check_ref_text(ref_text)
    # The official model's x_vector_only_mode: the speaker embedding alone, the transcript unused.
    return InlineClone(audio, None if x_vector_only or not ref_text else ref_text)


def parse_voice(body: dict, book: Any, model_type: str) -> tuple[str | None, InlineClone | None]:
    """A request's voice, for both endpoints: the recording to clone where it carries one (its
    ``voice`` then names nothing, as in vLLM-Omni, but must still be a string), else its named
    voice resolved by `book` (speech.VoiceBook). ``task_type`` is checked against the model."""
    check_task_type(body, model_type)
    clone = parse_inline_clone(body, model_type)
    voice = optional_str(body, "voice")
    return (None if clone is not None else book.resolve_voice(voice)), clone


def check_ref_text(ref_text: str | None) -> None:
    if ref_text is not None and len(ref_text) > MAX_REF_TEXT_CHARS:
        raise bad_request(f"'ref_text' is {len(ref_text)} characters; the limit is "
                          f"{MAX_REF_TEXT_CHARS}", "ref_text")


async def encode_voice(ctx: Any, audio: bytes, ref_text: str | None, param: str, **kw: Any) -> Any:
    """A Voice from a recording, made on a worker thread (streams on the event loop keep
    flowing); a 400 naming `param` if the engine cannot take the recording (its message says
    what is wrong with it, never the transcript), else the engine's failure."""
    try:
        return await asyncio.to_thread(ctx.require_ready().engine.create_voice, audio, ref_text,
                                       **kw)
    except InvalidInputError as exc:
        raise bad_request(str(exc), param) from None
    except Exception as exc:  # noqa: BLE001 - answered as the engine's failure
        raise from_engine_error(exc, ctx.settings.retry_after_s) from None


class InlineVoices:
    """Voices made from inline references, by reference; one encoding per reference at a time."""

    def __init__(self) -> None:
        self._kept: OrderedDict[str, Any] = OrderedDict()
        self._making: dict[str, asyncio.Future] = {}

    def __len__(self) -> int:
        return len(self._kept)

    async def voice(self, clone: InlineClone, ctx: Any) -> Any:
        """The Voice for `clone`, made now if it is not kept; an ApiError if the recording cannot
        be cloned (the engine's message names what is wrong with it, never the transcript)."""
        key = clone.key
        if key in self._kept:
            self._kept.move_to_end(key)
            return self._kept[key]
        making = self._making.get(key)
        if making is None:
            if len(self._making) >= MAX_MAKING:
                raise refused(f"{MAX_MAKING} recordings are already waiting to be cloned; retry, "
                              "or upload the voice once (POST /v1/audio/voices) and name it",
                              ctx.settings.retry_after_s, "overloaded")
            making = asyncio.ensure_future(self._make(clone, ctx))
            self._making[key] = making
            making.add_done_callback(lambda done: self._settle(key, done))
        # A socket that goes away while it waits leaves the voice to be made for the others.
        return await asyncio.shield(making)

    def _settle(self, key: str, done: asyncio.Future) -> None:
        self._making.pop(key, None)
        if not done.cancelled():
            done.exception()  # retrieved: every socket that waited for it has gone

    async def _make(self, clone: InlineClone, ctx: Any) -> Any:
        async with ctx.voice_upload_lock:
            voice = await encode_voice(ctx, clone.audio, clone.ref_text, "ref_audio",
                                       register=False)
        logger.info("inline voice created: %.1f s, %s", voice.ref_seconds,
                    "icl" if voice.prompt.icl else "x-vector")
        self._kept[clone.key] = voice
        while len(self._kept) > MAX_KEPT:
            self._kept.popitem(last=False)
        return voice
