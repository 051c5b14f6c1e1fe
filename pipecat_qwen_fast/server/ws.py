"""WebSocket ``/v1/audio/speech/stream``: vLLM-Omni's Qwen3-TTS streaming protocol.

It is the protocol LiveKit's ``Qwen3TTS`` client (livekit-plugins-baseten) speaks, so that client
works against this server unchanged::

    client -> {"type": "session.config", "voice": ..., ...}   sticky for the socket's life
    client -> {"type": "input.text", "text": "Hel"} ...      pieces of a turn's text
    client -> {"type": "input.done"}                          a flush, not a close
    server <- {"type": "audio.start", "sentence_index": 0, "sentence_text": ..., "format": "pcm",
               "sample_rate": 24000}
    server <- binary frames: int16 little-endian mono PCM, as the engine makes it
    server <- {"type": "audio.timestamps", ...}                word times as they are read (async)
    server <- {"type": "audio.done", "sentence_index": 0, "total_bytes": n, "error": false}
    server <- {"type": "session.done", "total_sentences": k}  one per input.done
    server <- {"type": "error", "message": ..., "code": ...}
    client -> {"type": "session.close"}                       the socket is closed

An ``input.done`` with no text before it answers ``session.done`` at once (the client's
keepalive). A turn is spoken one of two ways, by the turn's text mode (``non_streaming_mode``, else
the model's default, as for /v1/audio/speech and in-process, so a text sounds the same by every
path):

* dual-track (Base models; ``non_streaming_mode: false``): the whole turn is one engine
  streaming-text session. Each ``input.text`` piece is appended as it arrives, ``input.done`` ends
  it. The protocol's per-sentence framing carries it as one sentence: ``audio.start`` (index 0)
  before its audio, ``audio.done`` after it (with the turn's text, and with ``timestamp_info`` when
  word timestamps were asked for with the "sync" transport), ``session.done`` with
  ``total_sentences`` 1. With the "async" transport the word times come while the turn is spoken
  instead: an ``audio.timestamps`` event before each piece of audio, naming the words its frames
  read. The engine does not know sentence ends ahead of its audio, and LiveKit's client needs
  only the byte offset at ``audio.start`` to place the word times.
* prefill (``non_streaming_mode: true``; CustomVoice's default): the model needs a sentence's
  whole text in its prompt, so text is cut at sentence ends and each finished sentence is one
  engine stream, spoken while the rest of the turn arrives.

A socket that sends something that is not this protocol (binary, broken JSON, an unknown
message type, a field of the wrong type) gets an error event and is closed, and whatever it had
in flight is cancelled in the engine. A request the server cannot serve (unknown voice,
overload, a turn too long) gets an error event and the socket stays open.

Over 500 lines: one socket's state machine (config, turns as sentences or as one streamed-text
session, cancels on close, word timings) reads as one; field checks live in speech.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from dataclasses import dataclass, field

from fastapi import APIRouter, WebSocket
from fastapi.responses import JSONResponse
from starlette.websockets import WebSocketDisconnect, WebSocketState

from pipecat_qwen_fast import InvalidInputError
from pipecat_qwen_fast.model.prompt import DUAL_TRACK, PREFILL

from .api_errors import ApiError, bad_request, from_engine_error
from .context import ServerContext, context_of
from .inline_voices import InlineClone, parse_voice
from .metrics import PlayoutClock
from .speech import (
    MAX_CHUNK_FRAMES,
    MAX_FIRST_CHUNK_FRAMES,
    SpeechOptions,
    check_fields,
    check_speed,
    frame_cap,
    optional_bool,
    optional_int,
    optional_str,
)
from .streams import AudioStream, Slot

logger = logging.getLogger("pipecat_qwen_fast.server")

router = APIRouter()

MESSAGE_TYPES = ("session.config", "input.text", "input.done", "session.close")
# Every field vLLM-Omni's session.config takes, and those LiveKit's client adds for word timings.
# Unknown fields are refused, as vLLM-Omni does, so a misspelt option is not silently ignored.
CONFIG_FIELDS = frozenset({
    "type", "model", "voice", "task_type", "language", "instructions", "response_format", "speed",
    "max_new_tokens", "initial_codec_chunk_frames", "stream_audio", "non_streaming_mode",
    "streaming_mode", "word_timestamps", "timestamp_type", "timestamp_transport_strategy",
    "ref_audio", "ref_text", "x_vector_only_mode", "speaker_embedding", "seed",
    # This server's extensions (the remote adapters send them): the engine's request options.
    "greedy", "chunk_frames", "max_chunk_frames", "chunk_growth",
})
# Close codes (RFC 6455): 1003 a data type not accepted, 1007 data inconsistent with its type,
# 1008 a policy violation, 1009 a message too big, 1001 going away (the server is draining).
CLOSE_BINARY, CLOSE_BAD_DATA, CLOSE_POLICY, CLOSE_TOO_BIG, CLOSE_GOING_AWAY = (
    1003, 1007, 1008, 1009, 1001)
# Sentence ends: terminal punctuation followed by a space, CJK terminal punctuation, a newline.
SENTENCE_END = re.compile(r"(?<=[.!?;…])\s+|(?<=[。！？；])|\n+")
FRAME_SECONDS = 0.08  # one codec frame of audio


class ProtocolError(Exception):
    """The client broke the protocol: it is told why, then the socket is closed."""

    def __init__(self, close_code: int, message: str) -> None:
        super().__init__(message)
        self.close_code = close_code


class ClientGone(Exception):
    """The client closed the socket (or asked to, with session.close)."""


class SentenceBuffer:
    """A turn's text not yet spoken; hands out whole sentences as soon as they are complete."""

    def __init__(self) -> None:
        self._text = ""

    def __len__(self) -> int:
        return len(self._text)

    def push(self, text: str) -> list[str]:
        self._text += text
        parts = SENTENCE_END.split(self._text)
        # The last part has no end after it yet: more of its sentence may come.
        self._text = parts.pop()
        return [p.strip() for p in parts if p.strip()]

    def flush(self) -> list[str]:
        text, self._text = self._text.strip(), ""
        return [text] if text else []


@dataclass
class SessionConfig:
    """A session.config: the synthesis options and how its turns are spoken."""

    options: SpeechOptions
    streamed: bool  # dual-track: one streaming-text engine session per turn
    word_timestamps: bool = False
    timestamps_async: bool = False  # word times as audio.timestamps events, not in audio.done
    clone: InlineClone | None = None  # the voice is cloned from this (configure sets it)


@dataclass
class Turn:
    """The text between two input.done messages, and what it holds while it is spoken."""

    options: SpeechOptions
    slot: Slot | None  # None: refused (the client was told why)
    clock: PlayoutClock = field(default_factory=PlayoutClock)
    sentences: int = 0
    dropped: bool = False  # cut short (too long): its remaining text and sentences are not spoken
    streamed: bool = False
    word_timestamps: bool = False
    timestamps_async: bool = False
    started_at: float = 0.0
    audio: AudioStream | None = None  # a streamed turn's engine session, open from its first word
    chars: int = 0
    pending: str = ""  # leading whitespace: it opens no engine session on its own
    text: list[str] = field(default_factory=list)

    @property
    def speaking(self) -> bool:
        return self.slot is not None and not self.dropped

    def end(self) -> None:
        if self.slot is not None:
            self.slot.release()
            self.slot = None

    async def close(self) -> None:
        """Free everything the turn holds; a streamed turn's engine session is cancelled if it has
        not finished."""
        if self.audio is not None:
            await self.audio.aclose()
        self.end()


@dataclass
class StreamedTurn:
    turn: Turn


@dataclass
class Sentence:
    turn: Turn
    index: int
    text: str
    queued_at: float


@dataclass
class TurnDone:
    turn: Turn | None  # None: an input.done with no text before it


@router.websocket("/v1/audio/speech/stream")
async def speech_stream(websocket: WebSocket) -> None:
    ctx = context_of(websocket)
    try:
        ctx.authorize(websocket.headers)
    except ApiError as error:
        ctx.count_failure(error)
        # Refused before the handshake completes: the client sees an HTTP 403 (or 401 where the
        # server supports denial responses), and no socket is opened.
        if "websocket.http.response" in websocket.scope.get("extensions", {}):
            await websocket.send_denial_response(
                JSONResponse(error.body(), status_code=error.status, headers=error.headers()))
        else:
            await websocket.close(code=CLOSE_POLICY, reason=error.message)
        return
    await websocket.accept()
    await SpeechSocket(websocket, ctx).run()


class SpeechSocket:
    """One client connection: reads messages, buffers text, speaks sentences in order."""

    def __init__(self, websocket: WebSocket, ctx: ServerContext) -> None:
        self.ws = websocket
        self.ctx = ctx
        self.options: SpeechOptions | None = None
        self.config: SessionConfig | None = None
        self.buffer = SentenceBuffer()
        self.turn: Turn | None = None
        self.queue: asyncio.Queue[Sentence | StreamedTurn | TurnDone] = asyncio.Queue()
        self.unfinished = 0  # queued items the speaker has not finished
        self._send_lock = asyncio.Lock()
        limit = ctx.settings.max_input_chars
        # Room for a whole turn's text in one message, JSON-escaped, plus the other fields.
        self.max_message_chars = limit * 6 + 16 * 1024

    @property
    def idle(self) -> bool:
        return self.turn is None and self.unfinished == 0

    async def run(self) -> None:
        speaker = asyncio.create_task(self.speak_queued(), name="qwen-tts-ws-speaker")
        self.ctx.open_sockets += 1
        try:
            await self.receive_messages(speaker)
        except ProtocolError as error:
            self.ctx.metrics.errors.labels("protocol").inc()
            await self.send_error(str(error), "protocol_error")
            await self.close(error.close_code, "protocol error")
        except (ClientGone, WebSocketDisconnect):
            pass
        except Exception as exc:  # noqa: BLE001 - a failed send or receive ends only this socket
            logger.warning("stream socket ended by %s", type(exc).__name__)
        finally:
            speaker.cancel()
            # The speaker's own finally closes the engine stream it was reading.
            with contextlib.suppress(BaseException):
                await speaker
            for turn in self.unfinished_turns():
                with contextlib.suppress(BaseException):
                    await turn.close()
            await self.close(1000, "")
            self.ctx.open_sockets -= 1

    # -- reading --------------------------------------------------------------------------------

    async def receive_messages(self, speaker: asyncio.Task) -> None:
        settings = self.ctx.settings
        drain = asyncio.ensure_future(self.ctx.gate.drain_event.wait())
        receive: asyncio.Future | None = None
        try:
            while True:
                if receive is None:
                    receive = asyncio.ensure_future(self.ws.receive())
                timeout = (settings.ws_config_timeout_s if self.options is None
                           else settings.ws_idle_timeout_s)
                done, _ = await asyncio.wait({receive, drain, speaker}, timeout=timeout,
                                             return_when=asyncio.FIRST_COMPLETED)
                if speaker in done:
                    speaker.result()  # its error ends the connection
                    return
                if receive in done:
                    message, receive = receive.result(), None
                    await self.handle(self.parse(message))
                    continue
                if drain in done and self.idle:
                    await self.send_error("the server is shutting down; reconnect to another "
                                          "server", "draining")
                    await self.close(CLOSE_GOING_AWAY, "server draining")
                    return
                if drain in done:
                    # Finish this turn first; look again once the speaker has moved on.
                    drain = asyncio.ensure_future(asyncio.sleep(0.05))
                    continue
                if not done and self.idle:
                    what = "session.config" if self.options is None else "a message"
                    await self.send_error(f"no {what} within {timeout:g} s; closing", "timeout")
                    await self.close(1000, "idle timeout")
                    return
        finally:
            for task in (receive, drain):
                if task is not None:
                    task.cancel()

    def parse(self, message: dict) -> dict:
        if message["type"] == "websocket.disconnect":
            raise ClientGone()
        if message.get("bytes") is not None:
            raise ProtocolError(CLOSE_BINARY, "binary messages are not part of this protocol; "
                                "send JSON text messages")
        text = message.get("text") or ""
        try:
            msg = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ProtocolError(CLOSE_BAD_DATA,
                                f"a message is not valid JSON ({exc.msg})") from None
        if not isinstance(msg, dict):
            raise ProtocolError(CLOSE_BAD_DATA, "messages must be JSON objects")
        # A session.config may carry a recording (ref_audio; uvicorn bounds every message at
        # inline_voices.MAX_INLINE_BYTES); any other message is bounded by the text it may hold.
        if len(text) > self.max_message_chars and msg.get("type") != "session.config":
            raise self.too_big(text)
        kind = msg.get("type")
        if kind not in MESSAGE_TYPES:
            named = isinstance(kind, str) and len(kind) <= 40
            shown = repr(kind) if named else "missing or invalid"
            raise ProtocolError(CLOSE_POLICY, f"message type {shown} is not part of this protocol; "
                                f"valid types: {', '.join(MESSAGE_TYPES)}")
        return msg

    def too_big(self, text: str) -> ProtocolError:
        return ProtocolError(CLOSE_TOO_BIG, f"a message of {len(text)} characters is over the "
                             f"limit of {self.max_message_chars} (a session.config with "
                             "ref_audio may be larger)")

    async def handle(self, msg: dict) -> None:
        kind = msg["type"]
        if kind == "session.close":
            raise ClientGone()
        if kind == "session.config":
            await self.configure(msg)
        elif kind == "input.text":
            await self.take_text(msg)
        else:
            self.finish_turn()

    async def configure(self, msg: dict) -> None:
        if not self.idle or len(self.buffer):
            await self.send_error("session.config cannot change a turn in progress; send it "
                                  "after session.done", "turn_in_progress")
            return
        try:
            config = parse_config(msg, self.ctx)
            if config.clone is not None:
                config.options.voice = await self.ctx.inline_voices.voice(config.clone, self.ctx)
            self.config, self.options = config, config.options
        except ApiError as error:
            self.ctx.count_failure(error)
            await self.send_error(error.message, error.code or error.kind)

    async def take_text(self, msg: dict) -> None:
        if self.options is None:
            raise ProtocolError(CLOSE_POLICY, "send session.config before input.text")
        text = msg.get("text")
        if not isinstance(text, str):
            raise ProtocolError(CLOSE_BAD_DATA, "input.text needs a string 'text'")
        if not text:
            return
        if self.turn is None:
            self.turn = await self.start_turn(self.options)
        if not self.turn.speaking:
            return  # refused or cut short: the client was told; text is dropped until input.done
        if self.turn.streamed:
            await self.stream_text(self.turn, text)
            return
        limit = self.ctx.settings.max_input_chars
        if len(self.buffer) + len(text) > limit:
            # Cut the turn short rather than hold unbounded text.
            self.ctx.count_failure(bad_request("turn too long"))
            await self.send_error(f"the text waiting to be spoken would be over {limit} "
                                  "characters; the rest of this turn is dropped", "input_too_long")
            self.buffer = SentenceBuffer()
            self.turn.dropped = True
            return
        for sentence in self.buffer.push(text):
            self.enqueue(sentence)

    async def start_turn(self, options: SpeechOptions) -> Turn:
        config = self.config
        assert config is not None
        shape = {"streamed": config.streamed, "word_timestamps": config.word_timestamps,
                 "timestamps_async": config.timestamps_async, "started_at": time.monotonic()}
        try:
            self.ctx.require_ready()
            return Turn(options, self.ctx.gate.admit(), **shape)
        except ApiError as error:
            self.ctx.count_failure(error)
            await self.send_error(error.message, error.code or error.kind)
            return Turn(options, None, **shape)

    async def stream_text(self, turn: Turn, text: str) -> None:
        """Append a piece to the turn's engine session, opening it at the first word."""
        limit = self.ctx.settings.max_input_chars
        if turn.chars + len(text) > limit:
            self.ctx.count_failure(bad_request("turn too long"))
            await self.send_error(f"this turn's text would be over {limit} characters; the rest "
                                  "of this turn is dropped", "input_too_long")
            await self.cut_short(turn)
            return
        turn.chars += len(text)
        turn.text.append(text)
        if turn.audio is None:
            turn.pending += text
            if not turn.pending.strip():
                return
            text, turn.pending = turn.pending, ""
            try:
                turn.audio = self.ctx.open_audio(turn.options.request(""), "ws", turn.clock,
                                                 turn.started_at, text_stream=True)
            except Exception as exc:  # noqa: BLE001 - told to the client; the socket goes on
                await self.report_failure(exc, "opening a turn")
                turn.dropped = True
                return
            self.queue.put_nowait(StreamedTurn(turn))
            turn.sentences = 1
            self.unfinished += 1
        # Audio the listener ran out of while the text was late is the client's gap, not an
        # underrun: start the playout clock afresh.
        turn.clock.restart_if_played(time.monotonic())
        try:
            turn.audio.engine_stream.append(text)
        except InvalidInputError as exc:  # ended already: the engine's idle timeout
            await self.send_error(f"{exc}; the rest of this turn is dropped", "turn_ended")
            await self.cut_short(turn)

    async def cut_short(self, turn: Turn) -> None:
        turn.dropped = True
        if turn.audio is not None:
            turn.audio.engine_stream.end()  # what it has is still spoken

    def enqueue(self, text: str) -> None:
        turn = self.turn
        assert turn is not None
        self.queue.put_nowait(Sentence(turn, turn.sentences, text, time.monotonic()))
        turn.sentences += 1
        self.unfinished += 1

    def finish_turn(self) -> None:
        turn = self.turn
        if turn is not None and turn.streamed:
            if turn.audio is not None:
                turn.audio.engine_stream.end()
        elif turn is not None and turn.speaking:
            for sentence in self.buffer.flush():
                self.enqueue(sentence)
        self.buffer = SentenceBuffer()
        self.queue.put_nowait(TurnDone(turn))
        self.unfinished += 1
        self.turn = None

    def unfinished_turns(self) -> list[Turn]:
        turns = [self.turn] if self.turn is not None else []
        while not self.queue.empty():
            item = self.queue.get_nowait()
            if isinstance(item, TurnDone | StreamedTurn) and item.turn is not None \
                    and all(item.turn is not t for t in turns):
                turns.append(item.turn)
        return turns

    # -- speaking -------------------------------------------------------------------------------

    async def speak_queued(self) -> None:
        while True:
            waited = self.queue.empty()
            item = await self.queue.get()
            if isinstance(item, TurnDone):
                turn = item.turn
                try:
                    await self.send_json({"type": "session.done",
                                          "total_sentences": turn.sentences if turn else 0})
                finally:
                    # A client gone while session.done is sent (one that hung up on a refused
                    # turn's error, say) must not keep the turn's slot: it left the queue already.
                    if turn is not None:
                        turn.end()
            elif isinstance(item, StreamedTurn):
                await self.speak_turn(item.turn)
            elif item.turn.speaking:
                if waited:
                    item.turn.clock.restart_if_played(time.monotonic())
                await self.speak(item)
            self.unfinished -= 1

    async def speak(self, sentence: Sentence) -> None:
        turn = sentence.turn
        await self.send_json({"type": "audio.start", "sentence_index": sentence.index,
                              "sentence_text": sentence.text, "format": "pcm",
                              "sample_rate": self.ctx.require_ready().sample_rate})
        # First audio is timed for a turn's first sentence, which the listener is waiting for.
        waited_since = sentence.queued_at if sentence.index == 0 else None
        stream: AudioStream | None = None
        failed = False
        try:
            stream = self.ctx.open_audio(turn.options.request(sentence.text), "ws", turn.clock,
                                         waited_since)
            while (pcm := await stream.next_pcm()) is not None:
                await self.send_bytes(pcm)
        except (WebSocketDisconnect, ClientGone, asyncio.CancelledError):
            raise
        except Exception as exc:
            failed = True
            await self.report_failure(exc, f"sentence {sentence.index}")
        finally:
            if stream is not None:
                await stream.aclose()
        await self.send_json({"type": "audio.done", "sentence_index": sentence.index,
                              "total_bytes": stream.bytes_sent if stream else 0, "error": failed})

    async def speak_turn(self, turn: Turn) -> None:
        """A streamed turn: one engine session, framed as the protocol's sentence 0."""
        stream = turn.audio
        assert stream is not None
        await self.send_json({"type": "audio.start", "sentence_index": 0, "sentence_text": "",
                              "format": "pcm", "sample_rate": self.ctx.require_ready().sample_rate})
        failed = False
        timed = 0  # words sent in audio.timestamps events (the async transport)
        try:
            while (pcm := await stream.next_pcm()) is not None:
                if turn.word_timestamps and turn.timestamps_async:
                    timed = await self.send_word_times(stream, timed)
                await self.send_bytes(pcm)
        except (WebSocketDisconnect, ClientGone, asyncio.CancelledError):
            raise
        except Exception as exc:  # noqa: BLE001 - told to the client; the socket goes on
            failed = True
            await self.report_failure(exc, "a streamed turn")
        finally:
            await stream.aclose()
        done = {"type": "audio.done", "sentence_index": 0,
                "sentence_text": "".join(turn.text).strip(), "total_bytes": stream.bytes_sent,
                "error": failed}
        if turn.word_timestamps and not turn.timestamps_async and not failed:
            done["timestamp_info"] = {"word_alignment": word_alignment(
                stream.engine_stream.words(), stream.seconds_sent)}
        await self.send_json(done)

    async def send_word_times(self, stream: AudioStream, sent: int) -> int:
        """An audio.timestamps event for the turn's words read by the audio about to be sent (its
        frames up to ``stream.frames_sent``) and not yet sent; returns how many are sent now."""
        words = [w for w in stream.engine_stream.words()[sent:] if w.frame < stream.frames_sent]
        if words:
            alignment = word_alignment(words, stream.frames_sent * FRAME_SECONDS)
            # An extension LiveKit's client ignores: where whitespace stood before each word, so
            # a client can rebuild the text (a CJK turn has none between its words).
            alignment["word_space_before"] = [w.space_before for w in words]
            await self.send_json({"type": "audio.timestamps", "sentence_index": 0,
                                  "word_alignment": alignment})
        return sent + len(words)

    async def report_failure(self, exc: Exception, what: str) -> None:
        error = exc if isinstance(exc, ApiError) else from_engine_error(
            exc, self.ctx.settings.retry_after_s)
        self.ctx.count_failure(error)
        # A refusal under overload is the admission working, counted on /metrics: at 2x capacity
        # it came thousands of times a minute, a warning each (session 32's server log: 4,507).
        level = logging.DEBUG if error.code == "overloaded" else logging.WARNING
        logger.log(level, "stream socket: %s failed: %s", what, error.message)
        await self.send_error(error.message, error.code or error.kind)

    # -- sending --------------------------------------------------------------------------------

    async def send_json(self, event: dict) -> None:
        async with self._send_lock:
            await self.ws.send_text(json.dumps(event))

    async def send_bytes(self, data: bytes) -> None:
        async with self._send_lock:
            await self.ws.send_bytes(data)

    async def send_error(self, message: str, code: str) -> None:
        with contextlib.suppress(Exception):
            await self.send_json({"type": "error", "message": message, "code": code})

    async def close(self, code: int, reason: str) -> None:
        if self.ws.application_state == WebSocketState.DISCONNECTED:
            return
        with contextlib.suppress(Exception):
            await self.ws.close(code=code, reason=reason)


def word_alignment(words: list, audio_s: float) -> dict:
    """vLLM-Omni's word alignment for the turn's words heard within its audio. A word's start is
    when the model first read it (docs/STREAMING_TEXT.md: the earliest it can be heard); it ends
    where the next begins, the last at the end of the audio."""
    heard = [w for w in words if w.start_s < audio_s]
    starts = [round(w.start_s, 3) for w in heard]
    ends = [*starts[1:], round(audio_s, 3)]
    return {"words": [w.text for w in heard], "word_start_times_seconds": starts,
            "word_end_times_seconds": ends}


def parse_config(msg: dict, ctx: ServerContext) -> SessionConfig:
    """A session.config's fields as synthesis options; an ApiError names what cannot be served."""
    check_fields(msg, CONFIG_FIELDS, "session.config")
    service = ctx.require_ready()
    optional_str(msg, "model")  # one model per process: any name is served by it
    response_format = optional_str(msg, "response_format")
    if response_format not in (None, "pcm"):
        raise bad_request(f"response_format {response_format!r} is not supported on the stream "
                          "endpoint; valid choices: pcm", "response_format")
    if optional_bool(msg, "stream_audio") is False:
        raise bad_request("stream_audio=false is not supported: audio always streams as PCM",
                          "stream_audio")
    check_speed(msg)
    streaming_mode = optional_str(msg, "streaming_mode")
    if streaming_mode not in (None, "sentence"):
        raise bad_request(f"streaming_mode {streaming_mode!r} is not supported; valid choices: "
                          "sentence", "streaming_mode")
    non_streaming = optional_bool(msg, "non_streaming_mode")
    text_mode = None if non_streaming is None else (PREFILL if non_streaming else DUAL_TRACK)
    # The engine's own default for the variant (engine.open_session).
    streamed = (text_mode or (DUAL_TRACK if service.model_type == "base" else PREFILL)) \
        == DUAL_TRACK
    timestamp_type = optional_str(msg, "timestamp_type")
    if timestamp_type not in (None, "none", "word"):
        raise bad_request(f"timestamp_type {timestamp_type!r} is not supported; valid choices: "
                          "none, word", "timestamp_type")
    transport = optional_str(msg, "timestamp_transport_strategy")
    if transport not in (None, "sync", "async"):
        raise bad_request(f"timestamp_transport_strategy {transport!r} is not supported; valid "
                          "choices: sync (word times in audio.done), async (audio.timestamps "
                          "events as the words are read)", "timestamp_transport_strategy")
    word_timestamps = bool(optional_bool(msg, "word_timestamps")) or timestamp_type == "word"
    if word_timestamps and not streamed:
        raise bad_request("word timestamps come from streamed-text turns: send "
                          "non_streaming_mode=false with them", "word_timestamps")
    book = ctx.voice_book()
    voice, clone = parse_voice(msg, book, service.model_type)
    options = SpeechOptions(
        voice=voice,
        language=book.resolve_language(optional_str(msg, "language")),
        instruct=optional_str(msg, "instructions") or None,
        seed=optional_int(msg, "seed", low=0, high=2**63 - 1),
        # The official model's non_streaming_mode: True puts the whole text in the prompt.
        text_mode=text_mode,
        first_chunk_frames=optional_int(msg, "initial_codec_chunk_frames", low=1,
                                        high=MAX_FIRST_CHUNK_FRAMES),
        max_frames=frame_cap(optional_int(msg, "max_new_tokens", low=1), ctx.settings.max_frames),
        greedy=optional_bool(msg, "greedy"),
        chunk_frames=optional_int(msg, "chunk_frames", low=1, high=MAX_CHUNK_FRAMES),
        max_chunk_frames=optional_int(msg, "max_chunk_frames", low=1, high=MAX_CHUNK_FRAMES),
        chunk_growth=optional_int(msg, "chunk_growth", low=1, high=MAX_CHUNK_FRAMES),
    )
    return SessionConfig(options, streamed, word_timestamps, transport == "async", clone)
