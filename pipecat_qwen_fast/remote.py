"""Remote mode of the adapters: the engine runs in ``qwen-fast-tts serve``, reached over its
WebSocket (``/v1/audio/speech/stream``, vLLM-Omni's Qwen3-TTS protocol; docs/SERVER.md).

Each utterance is one socket: session.config, input.text, input.done, then audio until
session.done. A socket per utterance makes cancelling exact: closing it mid-turn makes the
server cancel that turn's engine stream at once, and no later turn can be confused with it. On
loopback or a LAN the handshake costs well under a millisecond next to the engine's first chunk.

No framework imports here: the Pipecat service and the LiveKit plugin both use this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import numpy as np

from pipecat_qwen_fast.engine.request import SAMPLE_RATE, SynthesisRequest
from pipecat_qwen_fast.errors import EngineOverloadedError, InvalidInputError, QwenTTSError

STREAM_PATH = "/v1/audio/speech/stream"
# Request fields the protocol has no room for: the server always uses the engine's defaults.
_DEFAULTS = SynthesisRequest("")
_UNSENDABLE = ("greedy", "chunk_frames", "max_chunk_frames")
# Error codes of requests the server will refuse again however often they are retried.
_INPUT_CODES = frozenset({"invalid_request_error", "input_too_long", "authentication_error",
                          "missing_api_key", "invalid_api_key", "protocol_error"})


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
    """A request's options as the protocol's session.config message."""
    unsendable = [name for name in _UNSENDABLE
                  if getattr(request, name) != getattr(_DEFAULTS, name)]
    if unsendable:
        raise InvalidInputError(
            f"{', '.join(unsendable)} cannot be set in remote mode: the server's protocol has no "
            "field for them and it uses the engine's defaults; leave them at their defaults"
        )
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
    """One binary frame of the server's audio: int16 mono PCM at ``SAMPLE_RATE``."""

    pcm: np.ndarray


class RemoteTTSClient:
    """One server's client, shared by all the streams of one adapter instance."""

    sample_rate = SAMPLE_RATE

    def __init__(self, base_url: str, api_key: str | None = None, *,
                 connect_timeout_s: float = 10.0, close_timeout_s: float = 2.0) -> None:
        self.url = stream_url(base_url)
        self.base_url = base_url
        self.api_key = api_key
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._connect_timeout_s = connect_timeout_s
        self._close_timeout_s = close_timeout_s
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.ready = False  # a stream or /ready has succeeded

    def open_stream(self, request: SynthesisRequest) -> RemoteStream:
        """A stream of the request's audio; it connects on its first read. Options the protocol
        cannot carry are refused here (InvalidInputError)."""
        return RemoteStream(self, session_config(request), request.text)

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
                timeout=aiohttp.ClientTimeout(total=None, connect=self._connect_timeout_s))
            self._loop = loop
        return self._session

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
            await self._session.close()
        self._session = None


class RemoteStream:
    """One utterance on its own socket; ``cancel()`` closes the socket, which cancels the
    server's engine stream for it."""

    def __init__(self, client: RemoteTTSClient, config: dict, text: str) -> None:
        self._client = client
        self._config = config
        self._text = text
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._done = False
        self._cancelled = False  # cancel() was called: the stream ends quietly, as the engine's does
        self._closing: asyncio.Task | None = None

    def __aiter__(self) -> RemoteStream:
        return self

    async def __anext__(self) -> RemoteChunk:
        try:
            return await self._next()
        except BaseException:
            # An error, the end, or a cancelled read (a timeout, a barge-in): the socket goes now.
            self.cancel()
            raise

    async def _next(self) -> RemoteChunk:
        if self._done:
            raise StopAsyncIteration
        if self._ws is None:
            ws = await self._client.connect()
            if self._cancelled:  # cancelled while connecting: nothing is sent
                await _close(ws)
                raise StopAsyncIteration
            self._ws = ws
            for message in (self._config, {"type": "input.text", "text": self._text},
                            {"type": "input.done"}):
                await ws.send_str(json.dumps(message))
        ws = self._ws
        while True:
            msg = await ws.receive()
            if self._cancelled:
                raise StopAsyncIteration
            if msg.type == aiohttp.WSMsgType.BINARY:
                if msg.data:
                    return RemoteChunk(np.frombuffer(msg.data, dtype=np.int16))
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
            if kind == "session.done":
                self._done = True
                self._client.ready = True
                raise StopAsyncIteration

    async def wait_closed(self) -> None:
        """Return once the socket's close (started by `cancel()` or the end) has completed."""
        if self._closing is not None:
            await self._closing

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
