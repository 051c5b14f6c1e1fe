"""Remote mode of the adapters: the engine runs in ``qwen-fast-tts serve``, reached over its
WebSocket (``/v1/audio/speech/stream``, vLLM-Omni's Qwen3-TTS protocol; docs/SERVER.md).

An utterance holds one socket: session.config, input.text, input.done, then audio until
session.done. Cancelling is exact: closing the socket mid-turn makes the server cancel that
turn's engine stream at once, and no later turn can be confused with it. A socket whose turn
ended cleanly (session.done) is kept for the next utterance (`reuse_sockets`), which sends its
own session.config on it, as the protocol allows between turns; one idle longer than
SPARE_MAX_AGE_S is closed. A cancelled turn's socket is replaced ahead of the next utterance by a
spare (`spare_sockets`, default 1). Each handshake and close costs the server's event loop CPU
that its engine thread then waits for (docs/SERVER.md, "Performance").

A streamed-text turn (`RemoteTTSClient.open_text_stream`, the adapters' token mode) is one socket
too: each `append` is an input.text message as it comes, `end` is input.done, and the server
speaks the turn as one dual-track session, sending each word's time (audio.timestamps, the
"async" transport) before the audio that reads it.

Every request option travels in session.config: vLLM-Omni's fields where it has one (voice,
language, instructions, seed, initial_codec_chunk_frames, max_new_tokens, non_streaming_mode) and
the server's extensions for the rest (greedy, chunk_frames, max_chunk_frames, chunk_growth).

No framework imports here: the Pipecat service and the LiveKit plugin both use this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import numpy as np

from pipecat_qwen_fast.engine.request import CHUNK_FIELDS, SAMPLE_RATE, SynthesisRequest
from pipecat_qwen_fast.engine.text_stream import TextEndedError
from pipecat_qwen_fast.errors import EngineOverloadedError, InvalidInputError, QwenTTSError

STREAM_PATH = "/v1/audio/speech/stream"
_DEFAULTS = SynthesisRequest("")
# The largest chunk the server takes (server/speech.py MAX_CHUNK_FRAMES: the sizes its vocoder
# graphs cover); the client refuses more when the option is set, not at the first utterance.
MAX_CHUNK_FRAMES = 32
FRAME_SAMPLES = SAMPLE_RATE * 2 // 25  # one 80 ms codec frame
# A spare socket older than this is closed rather than used: the server closes a socket that sends
# no session.config within its ws_config_timeout_s (10 s by default).
SPARE_MAX_AGE_S = 5.0
# Error codes of requests the server will refuse again however often they are retried.
_INPUT_CODES = frozenset({"invalid_request_error", "input_too_long", "authentication_error",
                          "missing_api_key", "invalid_api_key", "protocol_error", "turn_ended"})


class RemoteError(QwenTTSError):
    """The TTS server failed a request; ``retryable`` says whether a retry can help."""

    retryable = True


class RemoteInputError(RemoteError, InvalidInputError):
    """The server refused the request's options (unknown voice, a wrong API key, ...)."""

    retryable = False


class RemoteUnavailableError(RemoteError):
    """The server cannot be reached, went away mid-stream, or is overloaded or draining."""


def stream_url(base_url: str) -> str:
    """The WebSocket URL of the stream endpoint, from a server's base URL (ws://, wss://,
    http:// or https://; the path may be given or left out)."""
    parts = urlsplit(base_url.strip())
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
    if scheme not in ("ws", "wss") or not parts.netloc:
        raise InvalidInputError(
            f"base_url must be a ws://, wss://, http:// or https:// URL of a qwen-fast-tts server "
            f"(ws://host:port), got {base_url!r}"
        )
    path = parts.path.rstrip("/")
    if not path.endswith(STREAM_PATH):
        path += STREAM_PATH
    return urlunsplit((scheme, parts.netloc, path, "", ""))


def http_url(base_url: str, path: str) -> str:
    """An HTTP endpoint of the same server (``/ready``, ``/metrics``)."""
    parts = urlsplit(stream_url(base_url))
    scheme = "https" if parts.scheme == "wss" else "http"
    return urlunsplit((scheme, parts.netloc, path, "", ""))


def session_config(request: SynthesisRequest) -> dict[str, Any]:
    """A request's options as the protocol's session.config message. What the server cannot take
    is refused here (InvalidInputError): a chunk over MAX_CHUNK_FRAMES, custom sampling
    parameters, a voice that is not a name, an inline cloned voice."""
    if request.sampling is not None:
        raise InvalidInputError("sampling parameters cannot be sent to a server: it samples with "
                                "the model's generation_config (greedy and seed can be set)")
    if request.voice_clone is not None or not isinstance(request.voice, str | None):
        raise InvalidInputError("a server takes a voice by name: upload a cloned voice "
                                "(POST /v1/audio/voices) and pass its name as voice")
    for name in CHUNK_FIELDS:
        value = getattr(request, name)
        if value is not None and value > MAX_CHUNK_FRAMES:
            raise InvalidInputError(f"{name} must be at most {MAX_CHUNK_FRAMES} in remote mode "
                                    f"(the server's bound), got {value}")
    config: dict[str, Any] = {"type": "session.config"}
    if request.voice is not None:
        config["voice"] = str(request.voice)
    if request.language and str(request.language) != "auto":
        config["language"] = str(request.language)
    if request.instruct:
        config["instructions"] = request.instruct
    if request.seed is not None:
        config["seed"] = request.seed
    if request.text_mode is not None:
        config["non_streaming_mode"] = request.text_mode == "prefill"
    if request.first_chunk_frames != _DEFAULTS.first_chunk_frames:
        config["initial_codec_chunk_frames"] = request.first_chunk_frames
    if request.max_frames is not None:
        config["max_new_tokens"] = request.max_frames
    if request.greedy:
        config["greedy"] = True
    if request.chunk_frames != _DEFAULTS.chunk_frames:
        config["chunk_frames"] = request.chunk_frames
    if request.max_chunk_frames != _DEFAULTS.max_chunk_frames:
        # None (fixed chunks) is the same schedule as a cap of chunk_frames (chunk_target).
        config["max_chunk_frames"] = request.max_chunk_frames or request.chunk_frames
    if request.chunk_growth != _DEFAULTS.chunk_growth:
        config["chunk_growth"] = request.chunk_growth
    return config


def text_stream_config(request: SynthesisRequest) -> dict[str, Any]:
    """session.config for a streamed-text turn: dual-track, word times as they are read."""
    config = session_config(request)
    config.update(non_streaming_mode=False, word_timestamps=True, timestamp_type="word",
                  timestamp_transport_strategy="async")
    return config


class RemoteOverloadedError(RemoteUnavailableError, EngineOverloadedError):
    """The server refused the stream at its limit (code "overloaded"): retry, or another server."""


def _server_error(event: dict) -> RemoteError:
    code = str(event.get("code") or "")
    message = f"the TTS server refused the request: {event.get('message', 'no reason given')}"
    if code in _INPUT_CODES:
        return RemoteInputError(message)
    if code == "overloaded":
        return RemoteOverloadedError(message)
    return RemoteUnavailableError(message)


@dataclass
class RemoteChunk:
    """One binary frame of the server's audio: int16 mono PCM at ``SAMPLE_RATE``, its first frame
    and its frames counted from the stream's start (80 ms each, as the engine's AudioChunk)."""

    pcm: np.ndarray
    frame_index: int = 0
    num_frames: int = 0


@dataclass
class RemoteWord:
    """A word of a streamed-text turn and when it starts in the turn's audio, as the server read
    it (the fields of the engine's WordTiming)."""

    text: str
    start_s: float
    frame: int
    space_before: bool


class RemoteTTSClient:
    """One server's client, shared by all the streams of one adapter instance (or of a fleet's
    callers). A socket whose turn ended cleanly is kept for the next utterance
    (`reuse_sockets`); after a cancelled turn, `spare_sockets` are connected ahead of the next
    one (0: the next utterance connects its own)."""

    sample_rate = SAMPLE_RATE

    def __init__(self, base_url: str, api_key: str | None = None, *,
                 connect_timeout_s: float = 10.0, close_timeout_s: float = 2.0,
                 spare_sockets: int = 1, reuse_sockets: bool = True) -> None:
        if spare_sockets < 0:
            raise ValueError(f"spare_sockets must be >= 0, got {spare_sockets}")
        self.url = stream_url(base_url)
        self.base_url = base_url
        self.api_key = api_key
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._connect_timeout_s = connect_timeout_s
        self._close_timeout_s = close_timeout_s
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.ready = False  # a stream or /ready has succeeded
        # Idle sockets for the next utterances (kept after a clean turn, or spares connected
        # after a cancelled one), with when each went idle; the freshest is taken first.
        self.spare_sockets = spare_sockets
        self.reuse_sockets = reuse_sockets
        self._sweeper: asyncio.Task | None = None
        self._spares: list[tuple[float, aiohttp.ClientWebSocketResponse]] = []
        self._spares_connecting = 0
        self._chores: set[asyncio.Task] = set()  # spares connecting or closing

    def open_stream(self, request: SynthesisRequest) -> RemoteStream:
        """A stream of the request's audio; it connects on its first read. Options the server
        cannot take are refused here (InvalidInputError)."""
        return RemoteStream(self, session_config(request), request.text)

    def open_text_stream(self, request: SynthesisRequest,
                         idle_timeout_s: float | None = None) -> RemoteTextStream:
        """A turn whose text is sent as it arrives (`append`, `end`), spoken by the server as one
        dual-track session; as the EngineService's `open_text_stream`. The server ends a turn left
        without text by its own idle timeout (its WebSocket idle timeout), not `idle_timeout_s`."""
        del idle_timeout_s
        return RemoteTextStream(self, text_stream_config(request))

    async def wait_ready(self) -> None:
        """Wait until the server answers /ready (its engine loaded and warm)."""
        url = http_url(self.base_url, "/ready")
        while True:
            try:
                async with self.http().get(url, headers=self._headers) as response:
                    if response.status == 200:
                        self.ready = True
                        return
            except aiohttp.ClientError as e:
                raise RemoteUnavailableError(self._unreachable(e)) from None
            await asyncio.sleep(0.2)

    def http(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        # A session belongs to the loop it was made in; tests and some apps run several loops.
        if self._session is None or self._session.closed or self._loop is not loop:
            self._session = aiohttp.ClientSession(
                # No cap on open connections: each stream holds its socket for the whole
                # utterance, and aiohttp's default of 100 made the 101st stream wait for one to
                # close (0.8 s p50 at 256 fleet callers) or fail at the connect timeout. The
                # server's admission control is what refuses load.
                connector=aiohttp.TCPConnector(limit=0),
                timeout=aiohttp.ClientTimeout(total=None, connect=self._connect_timeout_s))
            self._loop = loop
            self._spares = []  # the old session's
        return self._session

    async def socket(self) -> aiohttp.ClientWebSocketResponse:
        """A socket for one utterance: the freshest idle one if one is under SPARE_MAX_AGE_S old
        (no handshake: under load one took milliseconds of the server's event loop,
        docs/SERVER.md "Performance"), else a new one."""
        self.http()
        now = time.monotonic()
        while self._spares:
            idle_since, ws = self._spares.pop()
            if not ws.closed and now - idle_since < SPARE_MAX_AGE_S:
                return ws
            self._chore(_close(ws))  # the rest are older still: each is closed as it comes
        return await self.connect()

    def release(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        """A socket whose turn ended with session.done: kept for the next utterance, or closed
        (reuse off, or it belongs to a session or loop no longer this client's)."""
        loop = asyncio.get_running_loop()
        if (not self.reuse_sockets or ws.closed or self._session is None or self._session.closed
                or self._loop is not loop):
            self._chore(_close(ws))
            return
        self._spares.append((time.monotonic(), ws))
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = self._chore(self._sweep())

    async def _sweep(self) -> None:
        """Close idle sockets as they pass SPARE_MAX_AGE_S, so that none is left open once the
        utterances stop (the server would close it only after its idle timeout)."""
        while self._spares:
            await asyncio.sleep(SPARE_MAX_AGE_S)
            now = time.monotonic()
            stale = [ws for t, ws in self._spares if ws.closed or now - t >= SPARE_MAX_AGE_S]
            self._spares = [(t, ws) for t, ws in self._spares if ws not in stale]
            for ws in stale:
                self._chore(_close(ws))  # each waits for the server's reply: side by side

    def connect_spares(self) -> None:
        """Start connecting the spare sockets that are missing (after a cancelled turn); never
        waits. A spare that fails to connect is dropped: the next utterance connects on its own
        and reports the error."""
        session = self.http()
        for _ in range(self.spare_sockets - len(self._spares) - self._spares_connecting):
            self._spares_connecting += 1
            self._chore(self._connect_spare(session))

    async def _connect_spare(self, session: aiohttp.ClientSession) -> None:
        try:
            ws = await self.connect()
        except Exception:  # noqa: BLE001 - see connect_spares
            return
        finally:
            self._spares_connecting -= 1
        if self._session is not session or session.closed:  # closed, or another loop's session
            await _close(ws)
            return
        self._spares.append((time.monotonic(), ws))

    def _chore(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._chores.add(task)  # the loop keeps only a weak reference to a task
        task.add_done_callback(self._chores.discard)
        return task

    async def connect(self) -> aiohttp.ClientWebSocketResponse:
        try:
            return await self.http().ws_connect(
                self.url, headers=self._headers, autoping=True,
                timeout=aiohttp.ClientWSTimeout(ws_receive=None, ws_close=self._close_timeout_s),
            )
        except aiohttp.WSServerHandshakeError as e:
            if e.status in (401, 403):
                raise RemoteInputError(
                    f"the TTS server at {self.url} refused the API key (HTTP {e.status})"
                ) from None
            raise RemoteUnavailableError(self._unreachable(e)) from None
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            raise RemoteUnavailableError(self._unreachable(e)) from None

    def _unreachable(self, e: BaseException) -> str:
        detail = str(e) or type(e).__name__
        return f"cannot reach the TTS server at {self.url} ({detail}); is `qwen-fast-tts serve` running?"

    async def aclose(self) -> None:
        if self._session is not None and self._loop is asyncio.get_running_loop():
            chores = list(self._chores)
            for task in chores:
                task.cancel()
            await asyncio.gather(*chores, return_exceptions=True)
            # The cancelled sweeper keeps its CancelledError, whose traceback's frame holds self:
            # a cycle left to the collector unless the client lets go of the task.
            self._sweeper = None
            spares, self._spares = self._spares, []
            for _, ws in spares:
                await _close(ws)
            await self._session.close()
        self._session = None


class RemoteStream:
    """One utterance on its own socket; ``cancel()`` closes the socket, which cancels the
    server's engine stream for it."""

    streams_text = False

    def __init__(self, client: RemoteTTSClient, config: dict, text: str) -> None:
        self._client = client
        self._config = config
        self._text = text
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._done = False
        self._cancelled = False  # cancel() was called: the stream ends quietly, as the engine's does
        self._closing: asyncio.Task | None = None
        self._frames = 0  # frames of audio received

    def __aiter__(self) -> RemoteStream:
        return self

    async def __anext__(self) -> RemoteChunk:
        try:
            return await self._next()
        except BaseException:
            # An error, the end, or a cancelled read (a timeout, a barge-in): the socket goes now.
            self.cancel()
            raise

    async def _open(self) -> aiohttp.ClientWebSocketResponse | None:
        """The socket with the whole utterance sent on it; None if cancelled meanwhile."""
        ws = await self._client.socket()
        if self._cancelled:  # cancelled while connecting: nothing is sent
            await _close(ws)
            return None
        self._ws = ws
        for message in (self._config, {"type": "input.text", "text": self._text},
                        {"type": "input.done"}):
            await ws.send_str(json.dumps(message))
        return ws

    async def _next(self) -> RemoteChunk:
        if self._done:
            raise StopAsyncIteration
        ws = self._ws if self._ws is not None else await self._open()
        if ws is None or self._cancelled:
            raise StopAsyncIteration
        while True:
            msg = await ws.receive()
            if self._cancelled:
                raise StopAsyncIteration
            if msg.type == aiohttp.WSMsgType.BINARY:
                if msg.data:
                    pcm = np.frombuffer(msg.data, dtype=np.int16)
                    frames = len(pcm) // FRAME_SAMPLES
                    chunk = RemoteChunk(pcm, self._frames, frames)
                    self._frames += frames
                    return chunk
                continue
            if msg.type != aiohttp.WSMsgType.TEXT:
                raise RemoteUnavailableError(
                    f"the TTS server at {self._client.url} closed the stream before its end "
                    f"(close code {ws.close_code})"
                )
            event = json.loads(msg.data)
            kind = event.get("type")
            if kind == "error":
                raise _server_error(event)
            if kind == "audio.start" and event.get("sample_rate") not in (None, SAMPLE_RATE):
                raise RemoteUnavailableError(
                    f"the TTS server sends {event['sample_rate']} Hz audio; this client takes "
                    f"{SAMPLE_RATE} Hz"
                )
            if kind == "audio.timestamps":
                self._take_words(event.get("word_alignment") or {})
            if kind == "session.done":
                self._done = True
                self._client.ready = True
                self._ws = None
                await self._release(ws)
                raise StopAsyncIteration

    async def _release(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        """The turn ended cleanly: its socket goes back to the client for the next utterance."""
        self._client.release(ws)

    def _take_words(self, alignment: dict) -> None:
        """Word times of a streamed-text turn (RemoteTextStream keeps them)."""

    async def wait_closed(self) -> None:
        """Return once the socket's close (started by `cancel()` or the end) has completed."""
        if self._closing is not None:
            await self._closing

    async def aclose(self) -> None:
        """Cancel (if not finished) and wait until the socket is closed."""
        self.cancel()
        await self.wait_closed()

    def cancel(self) -> None:
        """Close the socket (idempotent, never blocks): the server sees the close at once."""
        if not self._done:
            self._cancelled = True
        self._done = True
        ws, self._ws = self._ws, None
        if ws is None or ws.closed:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop left (interpreter exit): the server sees the TCP drop
            return
        # Closing waits for the server's reply; that wait must not hold up the caller.
        self._closing = loop.create_task(_close(ws))
        # A socket lost mid-turn: the next utterance finds a spare connected instead.
        self._client.connect_spares()


class RemoteTextStream(RemoteStream):
    """A streamed-text turn on its own socket: `append` sends each piece as an input.text message
    as it comes, `end` sends input.done; the audio is read as for any stream, and `words()` holds
    the word times the server sent before the audio that reads them. `append` and `end` are
    called from the stream's event loop and never block: the messages go out in order from a
    task that opens the socket at the first of them."""

    streams_text = True

    def __init__(self, client: RemoteTTSClient, config: dict) -> None:
        super().__init__(client, config, "")
        self._outbox: list[dict] = []
        self._more, self._opened = asyncio.Event(), asyncio.Event()
        self._sender: asyncio.Task | None = None
        self._error: BaseException | None = None
        self._ended_by: str | None = None
        self._words: list[RemoteWord] = []

    @property
    def ended_by(self) -> str | None:
        """ "end" once `end()` was called (the server's idle timeout is told as an error)."""
        return self._ended_by

    def words(self) -> list[RemoteWord]:
        """The turn's words the server has timed so far."""
        return list(self._words)

    def append(self, text: str) -> None:
        """Send a piece of the turn's text (a token, a word, a sentence). TextEndedError after
        `end()`; text for a turn already cancelled is dropped."""
        if not isinstance(text, str):
            raise InvalidInputError(f"text must be a string, got {type(text).__name__}")
        if self._ended_by is not None:
            raise TextEndedError("text appended after the turn's end()")
        if self._cancelled or not text:
            return
        self._post({"type": "input.text", "text": text})

    def end(self) -> None:
        """The turn's text is complete: the server speaks the rest. Idempotent."""
        if self._ended_by is not None:
            return
        self._ended_by = "end"
        if not self._cancelled:
            self._post({"type": "input.done"})

    def _post(self, message: dict) -> None:
        self._start()
        self._outbox.append(message)
        self._more.set()

    def _start(self) -> None:
        if self._sender is None:
            self._sender = asyncio.get_running_loop().create_task(
                self._send_all(), name="qwen-fast-remote-text")

    async def _send_all(self) -> None:
        try:
            ws = await self._client.socket()
            if self._cancelled:
                await _close(ws)
                return
            self._ws = ws
        except Exception as e:  # noqa: BLE001 - handed to the reader, which raises it
            self._error = e
            return
        finally:
            self._opened.set()  # the reader goes on: to the socket, the error, or the end
        try:
            await ws.send_str(json.dumps(self._config))
            while True:
                await self._more.wait()
                self._more.clear()
                messages, self._outbox = self._outbox, []
                for message in messages:
                    await ws.send_str(json.dumps(message))
                    if message["type"] == "input.done":
                        return
        except (aiohttp.ClientError, ConnectionError, RuntimeError):
            return  # the socket went away: the reader reports how

    async def _release(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        # session.done answers input.done, the sender's last message: it is finishing, and the
        # socket must be free of it before the next utterance sends on it.
        if self._sender is not None:
            with contextlib.suppress(BaseException):
                await self._sender
        self._client.release(ws)

    async def _open(self) -> aiohttp.ClientWebSocketResponse | None:
        self._start()
        await self._opened.wait()
        if self._error is not None:
            raise self._error
        return None if self._cancelled else self._ws

    def _take_words(self, alignment: dict) -> None:
        spaces = alignment.get("word_space_before") or []
        for i, (text, start) in enumerate(zip(alignment.get("words") or [],
                                              alignment.get("word_start_times_seconds") or [],
                                              strict=False)):
            space = bool(spaces[i]) if i < len(spaces) else bool(self._words)
            frame = round(float(start) * SAMPLE_RATE / FRAME_SAMPLES)
            self._words.append(RemoteWord(str(text), float(start), frame, space))

    def cancel(self) -> None:
        super().cancel()
        if self._sender is not None and not self._sender.done():
            self._sender.cancel()

    async def wait_closed(self) -> None:
        if self._sender is not None:
            with contextlib.suppress(BaseException):
                await self._sender
        await super().wait_closed()


async def _close(ws: aiohttp.ClientWebSocketResponse) -> None:
    with contextlib.suppress(Exception):
        await ws.close()


def server_load(base_url: str, api_key: str | None = None, timeout_s: float = 2.0) -> float:
    """A server's stream load in [0, 1] from its Prometheus ``/metrics``: streams admitted over
    its bound on them, and 1.0 while it is not ready (loading or draining).

    Blocking: LiveKit calls ``load_fnc`` in a thread. Raises RemoteUnavailableError where the
    server cannot be read.
    """
    url = http_url(base_url, "/metrics")
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key}"}
                                     if api_key else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            text = response.read().decode()
    except (urllib.error.URLError, OSError, TimeoutError) as e:
        raise RemoteUnavailableError(f"cannot read the TTS server's load at {url} ({e})") from None
    values: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("qwen_tts_admitted_streams", "qwen_tts_max_streams", "qwen_tts_ready"):
            values[name] = float(value)
    if len(values) < 3:
        raise RemoteUnavailableError(f"{url} does not report the stream gauges of a "
                                     "qwen-fast-tts server")
    if values["qwen_tts_ready"] < 1:
        return 1.0
    capacity = values["qwen_tts_max_streams"]
    load = values["qwen_tts_admitted_streams"] / capacity if capacity > 0 else 1.0
    return min(1.0, max(0.0, load)) if math.isfinite(load) else 1.0
