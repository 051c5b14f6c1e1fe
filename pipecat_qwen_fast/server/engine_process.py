"""The engine in a process of its own, behind the server's sockets (issue 37).

In one process the event loop's socket work (handshakes, JSON, WebSocket frames: ~4 ms of CPU an
utterance) and the engine thread's host work share one GIL, and at a few hundred callers the
engine's rounds stretched by half. Here the server's process keeps the sockets and the engine runs
in a child process that holds only the engine thread and a small loop that relays streams over one
pipe: its GIL is the engine's.

The server sees :class:`EngineProcess`, which answers for an ``EngineService`` in everything the
routes use (streams, text streams, voices, readiness, round metrics). Messages are pickled tuples:

    server -> engine   ("open", sid, request, text_stream, idle_timeout_s), ("append", sid, text),
                       ("end", sid), ("close", sid), ("call", cid, method, args, kwargs), ("stop",)
    engine -> server   ("state", dict), ("chunk", sid, pcm, frame_index, num_frames, words),
                       ("end", sid, error | None, words), ("closed", sid),
                       ("reply", cid, ok, value, library names)

Plain ``pickle`` on ``send_bytes``: multiprocessing's own pickler would share tensors through
shared memory and CUDA IPC, and the server's process must never touch the GPU.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import concurrent.futures
import dataclasses
import faulthandler
import itertools
import logging
import multiprocessing
import pickle
import signal
import threading
from typing import Any

import numpy as np

from pipecat_qwen_fast.engine.heap import freeze_heap, release_heap
from pipecat_qwen_fast.errors import EngineClosedError, InvalidInputError
from pipecat_qwen_fast.utils.threads import thread_cpu_seconds

logger = logging.getLogger("pipecat_qwen_fast.server")

# How often the engine process reports its round metrics, warmth and garbage collections.
STATE_INTERVAL_S = 0.2
# How long closing a stream may wait for the engine to free its session.
CLOSE_TIMEOUT_S = 30.0
# How long the engine process gets to close its engine when the server stops.
STOP_TIMEOUT_S = 30.0
# The engine's own calls (a voice from a recording, the library's changes).
CALL_TIMEOUT_S = 120.0


# The EngineService figures each state report carries (by attribute name), with what the server
# answers before the first report.
REPORTED: dict[str, Any] = {"rounds": 0, "round_seconds": 0.0, "round_streams": 0, "round_ms": 0.0,
                            "low_slack_chunks": 0, "lowest_slack_ms": None, "admitted_streams": 0,
                            "refusals": {}, "thread_cpu": {}}


def _reported(name: str) -> property:
    """EngineProcess's answer for the EngineService attribute `name`: its last reported value."""
    return property(lambda self: self._state.get(name, REPORTED[name]))


# Where an "end" and a "reply" carry their exception.
ERROR_AT = {"end": 2, "reply": 3}


def dumps(msg: tuple) -> bytes:
    try:
        return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        at = ERROR_AT.get(msg[0])
        if at is None or not isinstance(msg[at], BaseException):
            raise
        exc = msg[at]  # one that does not pickle travels as its text
        return dumps((*msg[:at], RuntimeError(f"{type(exc).__name__}: {exc}"), *msg[at + 1:]))


def pump(conn: Any, loop: asyncio.AbstractEventLoop, on_batch: Any, on_eof: Any,
         take: Any = None) -> None:
    """A reader thread's body: messages off ``conn`` to ``on_batch(list)`` on ``loop``, batched
    into one hop while more are waiting, then ``on_eof()`` once the pipe closes. ``take(msg)``
    sees each message here first, in this thread."""
    while True:
        try:
            batch = [pickle.loads(conn.recv_bytes())]
            while len(batch) < 64 and conn.poll():
                batch.append(pickle.loads(conn.recv_bytes()))
        except (EOFError, OSError):
            break
        if take is not None:
            for msg in batch:
                take(msg)
        try:
            loop.call_soon_threadsafe(on_batch, batch)
        except RuntimeError:  # the loop has closed
            return
    try:
        loop.call_soon_threadsafe(on_eof)
    except RuntimeError:
        pass


# -- the server's side -------------------------------------------------------------------------


@dataclasses.dataclass
class RemoteChunk:
    """An AudioChunk as the server reads it (the codes stay in the engine process)."""

    pcm: np.ndarray
    frame_index: int
    num_frames: int


class _Record:
    opened = False


class RemoteStream:
    """One engine stream seen from the server: async iteration of chunks; ``append``/``end`` for
    a text stream; ``cancel``/``aclose``. ``record.opened`` turns true with the first chunk (the
    engine process does not report the prefill's end separately)."""

    def __init__(self, owner: EngineProcess, sid: int) -> None:
        self._owner = owner
        self._sid = sid
        self._items: collections.deque = collections.deque()
        self._wake = asyncio.Event()
        self._ended = False  # the engine sent its end
        self._finished = False  # the reader took the end
        self._closed = asyncio.Event()
        self._close_sent = False
        self._words: list = []
        self.record = _Record()

    # engine -> here (on the server's loop)
    def _put(self, item: Any) -> None:
        self._items.append(item)
        self._wake.set()

    def _end(self, error: BaseException | None, words: list | None = None) -> None:
        if words:
            self._words.extend(words)
        self._ended = True
        self.record.opened = True
        self._put(error if error is not None else StopAsyncIteration())

    def _mark_closed(self) -> None:
        if not self._ended:
            self._end(None)
        self._closed.set()

    @property
    def done(self) -> bool:
        return self._ended

    def __aiter__(self) -> RemoteStream:
        return self

    async def __anext__(self) -> RemoteChunk:
        while not self._items:
            if self._finished:
                raise StopAsyncIteration
            self._wake.clear()
            await self._wake.wait()
        item = self._items.popleft()
        if isinstance(item, RemoteChunk):
            return item
        self._finished = True
        if isinstance(item, StopAsyncIteration):
            raise StopAsyncIteration
        raise item

    def append(self, text: str) -> None:
        if not isinstance(text, str):
            raise InvalidInputError(f"text must be a string, got {type(text).__name__}")
        if not self._ended:
            self._owner._send(("append", self._sid, text))

    def end(self) -> None:
        if not self._ended:
            self._owner._send(("end", self._sid))

    def words(self) -> list:
        return self._words

    def cancel(self) -> None:
        if self._close_sent or self._closed.is_set():
            return
        self._close_sent = True
        try:
            self._owner._send(("close", self._sid))
        except EngineClosedError:  # the engine process is gone: nothing left to free
            self._mark_closed()

    async def aclose(self) -> None:
        """Cancel the stream if it runs; return once the engine process has freed its session."""
        self.cancel()
        try:
            await asyncio.wait_for(self._closed.wait(), CLOSE_TIMEOUT_S)
        except TimeoutError:
            logger.warning("engine process did not confirm closing stream %d", self._sid)


class RemoteLibrary:
    """A Base model's voice library, as the routes use it: names, membership, removal."""

    def __init__(self, owner: EngineProcess) -> None:
        self._owner = owner

    def names(self) -> list[str]:
        return list(self._owner._state.get("library", []))

    def __contains__(self, name: object) -> bool:
        return name in self._owner._state.get("library", [])

    def remove(self, name: str) -> None:
        self._owner.call("remove_voice", name)


class _EngineView:
    """``service.engine`` for the routes: warmth, the voice library, making a voice."""

    def __init__(self, owner: EngineProcess) -> None:
        self._owner = owner
        self.voice_library = RemoteLibrary(owner) if owner.model_type == "base" else None

    @property
    def fully_warm(self) -> bool:
        return bool(self._owner._state.get("fully_warm", False))

    def create_voice(self, audio: Any, ref_text: str | None = None, **kw: Any) -> Any:
        return self._owner.call("create_voice", audio, ref_text, **kw)


class EngineProcess:
    """An EngineService in a child process, answering for it in the server's process.

    Create it on the server's running event loop. The child loads the model as ``serve`` would
    (``load_settings``), freezes its heap and warms up; ``wait_ready`` resolves once it is ready.
    If the child dies, every open stream ends with EngineClosedError and ``alive`` turns false
    (``/health`` answers 503 "failed").
    """

    def __init__(self, load_settings: Any, *, on_gc: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        ctx = multiprocessing.get_context("spawn")
        self._conn, child_conn = ctx.Pipe(duplex=True)
        # Not a daemon: the engine's compiler starts worker processes of its own.
        self._proc = ctx.Process(target=run_engine_process, args=(child_conn, load_settings),
                                 name="qwen-tts-engine")
        self._proc.start()
        child_conn.close()
        self._state: dict[str, Any] = {}
        self._ready: asyncio.Future = self._loop.create_future()
        self._streams: dict[int, RemoteStream] = {}
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._ids = itertools.count(1)
        self._send_lock = threading.Lock()
        self._alive = True
        self._stopping = False
        self._on_gc = on_gc
        self._view: _EngineView | None = None
        self._reader = threading.Thread(
            target=pump, args=(self._conn, self._loop, self._dispatch, self._gone, self._take),
            name="qwen-tts-engine-pipe", daemon=True)
        self._reader.start()
        atexit.register(self._kill)
        logger.info("engine process started (pid %d)", self._proc.pid)

    # -- the EngineService surface the server uses -------------------------------------------

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    @property
    def ready(self) -> bool:
        return self._ready.done() and not self._ready.cancelled() and self._ready.exception() is None

    @property
    def alive(self) -> bool:
        return self._alive and not self._state.get("failed") and self._state.get("alive", True)

    async def wait_ready(self) -> EngineProcess:
        await asyncio.shield(self._ready)
        return self

    @property
    def engine(self) -> _EngineView:
        if self._view is None:
            self._view = _EngineView(self)
        return self._view

    def _info(self, key: str) -> Any:
        if key not in self._state:
            raise EngineClosedError("the TTS engine is not loaded yet")
        return self._state[key]

    @property
    def model_type(self) -> str:
        return self._info("model_type")

    @property
    def voices(self) -> list[str]:
        return list(self._info("voices"))

    @property
    def languages(self) -> list[str]:
        return list(self._info("languages"))

    @property
    def sample_rate(self) -> int:
        return self._info("sample_rate")

    # The engine's figures as of its last report (every STATE_INTERVAL_S), named as on an
    # EngineService (REPORTED).
    rounds = _reported("rounds")
    round_seconds = _reported("round_seconds")
    round_streams = _reported("round_streams")
    round_ms = _reported("round_ms")
    low_slack_chunks = _reported("low_slack_chunks")
    lowest_slack_ms = _reported("lowest_slack_ms")
    admitted_streams = _reported("admitted_streams")
    refusals = _reported("refusals")
    # The engine process's threads: the engine's, the relay's (this module's loop: streams in,
    # chunks out, a streamed turn's text cut into tokens) and the pipe reader's, which share its GIL.
    thread_cpu = _reported("thread_cpu")

    def open_stream(self, request: Any) -> RemoteStream:
        return self._open(request, False, None)

    def open_text_stream(self, request: Any, *, idle_timeout_s: float | None = None) -> RemoteStream:
        return self._open(request, True, idle_timeout_s)

    def _open(self, request: Any, text_stream: bool, idle_timeout_s: float | None) -> RemoteStream:
        if not self.alive:
            raise EngineClosedError("the TTS engine process has stopped")
        sid = next(self._ids)
        stream = self._streams[sid] = RemoteStream(self, sid)
        self._send(("open", sid, request, text_stream, idle_timeout_s))
        return stream

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run one of the engine's calls (``create_voice``, ``remove_voice``) in the engine
        process; blocks until the engine process answers, so call it from a worker thread."""
        if not self.alive:
            raise EngineClosedError("the TTS engine process has stopped")
        cid = next(self._ids)
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._calls[cid] = future
        self._send(("call", cid, method, args, kwargs))
        try:
            return future.result(CALL_TIMEOUT_S)
        finally:
            self._calls.pop(cid, None)

    async def aclose(self) -> None:
        """Close the engine (streams still open are cancelled) and wait for the process."""
        if self._stopping:
            return
        self._ask_to_stop()
        await asyncio.to_thread(self._join)

    def close(self) -> None:
        self._ask_to_stop()
        self._join()

    def _ask_to_stop(self) -> None:
        self._stopping = True
        if self._alive:
            try:
                self._send(("stop",))
            except EngineClosedError:  # gone already: _join reaps it
                pass

    # -- plumbing ------------------------------------------------------------------------------

    def _send(self, msg: tuple) -> None:
        data = dumps(msg)
        with self._send_lock:
            try:
                self._conn.send_bytes(data)
            except (OSError, ValueError) as exc:  # the engine process is gone
                raise EngineClosedError("the TTS engine process has stopped") from exc

    def _take(self, msg: tuple) -> None:
        """In the reader thread: a reply resolves its call here, whose waiter blocks a worker
        thread (or, for a short call, the loop itself)."""
        if msg[0] != "reply":
            return
        if msg[4] is not None:  # before the caller sees the result
            self._state["library"] = msg[4]
        future = self._calls.get(msg[1])
        if future is not None and not future.done():
            if msg[2]:
                future.set_result(msg[3])
            else:
                future.set_exception(msg[3])

    def _dispatch(self, batch: list) -> None:
        streams = self._streams
        for msg in batch:
            kind = msg[0]
            if kind == "chunk":
                stream = streams.get(msg[1])
                if stream is not None:
                    stream.record.opened = True
                    if msg[5]:
                        stream._words.extend(msg[5])
                    stream._put(RemoteChunk(np.frombuffer(msg[2], dtype="<i2"), msg[3], msg[4]))
            elif kind == "end":
                stream = streams.get(msg[1])
                if stream is not None:
                    stream._end(msg[2], msg[3])
            elif kind == "closed":
                stream = streams.pop(msg[1], None)
                if stream is not None:
                    stream._mark_closed()
            elif kind == "state":
                self._on_state(msg[1])

    def _on_state(self, state: dict) -> None:
        gc_pauses = state.pop("gc", ())
        self._state.update(state)
        if self._on_gc is not None:
            for generation, seconds in gc_pauses:
                self._on_gc(generation, seconds)
        if self._ready.done():
            return
        if state.get("failed"):
            self._ready.set_exception(state["error"])
        elif state.get("ready"):
            # This process's own heap (torch and the app imported: ~400k objects) frozen too,
            # before any stream: a full collection of it stalls every socket's audio at once
            # (the H200's first engine-process run had 100-200 ms ones, 2026-11-28).
            frozen = freeze_heap(collect=True, holder=id(self))
            logger.info("server process: %d objects frozen out of the garbage collector's reach",
                        frozen)
            self._ready.set_result(None)

    def _gone(self) -> None:
        self._alive = False
        error = EngineClosedError("the TTS engine process has stopped")
        if not self._stopping:
            logger.error("engine process exited (code %s)", self._proc.exitcode)
        if not self._ready.done():
            self._ready.set_exception(error)
        for stream in list(self._streams.values()):
            if not stream.done:
                stream._end(error)
            stream._mark_closed()
        self._streams.clear()
        for future in list(self._calls.values()):
            if not future.done():
                future.set_exception(error)

    def _join(self) -> None:
        release_heap(id(self))
        self._proc.join(STOP_TIMEOUT_S)
        if self._proc.is_alive():
            logger.warning("engine process did not stop in %.0f s; killing it", STOP_TIMEOUT_S)
            self._proc.kill()
            self._proc.join(5)
        self._close_pipe()

    def _close_pipe(self) -> None:
        # Once the child is gone its end is closed and the reader ends on EOF; closing the pipe
        # under a reader still in recv_bytes would fail it with a TypeError (a None handle).
        self._reader.join(5)
        if not self._reader.is_alive():
            self._conn.close()

    def _kill(self) -> None:
        # At interpreter exit (before multiprocessing joins its children): never leave the
        # engine process running after the server.
        if self._proc.is_alive():
            timeout = STOP_TIMEOUT_S if self._stopping else 2
            self._ask_to_stop()
            self._proc.join(timeout)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(5)
            self._close_pipe()


# -- the engine's side -------------------------------------------------------------------------


def run_engine_process(conn: Any, load_settings: Any) -> None:
    """The child's main: the engine thread plus a loop that relays streams over ``conn``."""
    # The server drains on SIGINT/SIGTERM and then stops this process; a Ctrl-C or a SIGTERM
    # sent to the whole group must not end the engine under the streams still draining.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # `kill -USR1 <engine pid>` prints every thread's stack to stderr: where a stuck engine is.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    level = getattr(logging, str(getattr(load_settings, "log_level", "info")).upper(), logging.INFO)
    logging.basicConfig(level=level, format="%(levelname)s:     %(name)s [engine]: %(message)s")
    asyncio.run(EngineHost(conn, load_settings).serve())


class EngineHost:
    """The engine process's loop: one EngineService, its streams relayed to the server."""

    def __init__(self, conn: Any, load_settings: Any) -> None:
        self.conn = conn
        self.settings = load_settings
        self.streams: dict[int, Any] = {}
        self.relays: dict[int, asyncio.Task] = {}
        self.gc_pauses: list[tuple[int, float]] = []
        self.reader: threading.Thread | None = None  # the pipe reader (serve)
        self.stopped = asyncio.Event()

    def send(self, msg: tuple) -> None:
        try:
            self.conn.send_bytes(dumps(msg))
        except (OSError, ValueError):  # the server is gone
            self.stopped.set()

    async def serve(self) -> None:
        from pipecat_qwen_fast.engine.heap import watch_gc

        from .app import load_engine_service

        loop = asyncio.get_running_loop()
        stop_gc_watch = watch_gc(lambda generation, s: self.gc_pauses.append((generation, s)))
        self.service = load_engine_service(self.settings)
        reader = self.reader = threading.Thread(
            target=pump, args=(self.conn, loop, self.handle, self.stopped.set), name="qwen-tts-server-pipe",
            daemon=True)
        reader.start()
        reporter = asyncio.create_task(self.report())
        try:
            await self.stopped.wait()
        finally:
            reporter.cancel()
            for sid in list(self.streams):
                await self.close(sid)
            await self.service.aclose()
            stop_gc_watch()
            self.conn.close()

    def handle(self, batch: list) -> None:
        for msg in batch:
            self.handle_one(msg)

    def handle_one(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "open":
            self.open(*msg[1:])
        elif kind == "append":
            stream = self.streams.get(msg[1])
            if stream is not None:
                try:
                    stream.append(msg[2])
                except Exception as exc:  # noqa: BLE001 - the turn ends with it, as in-process
                    stream.cancel()
                    self.send(("end", msg[1], exc, None))
        elif kind == "end":
            stream = self.streams.get(msg[1])
            if stream is not None:
                stream.end()
        elif kind == "close":
            asyncio.ensure_future(self.close(msg[1]))
        elif kind == "call":
            asyncio.ensure_future(self.call(*msg[1:]))
        elif kind == "stop":
            self.stopped.set()

    def open(self, sid: int, request: Any, text_stream: bool, idle_timeout_s: float | None) -> None:
        service = self.service
        try:
            stream = (service.open_text_stream(request, idle_timeout_s=idle_timeout_s)
                      if text_stream else service.open_stream(request))
        except Exception as exc:  # noqa: BLE001 - refused or closed: the server raises it
            self.send(("end", sid, exc, None))
            return
        self.streams[sid] = stream
        self.relays[sid] = asyncio.ensure_future(self.relay(sid, stream, text_stream))

    async def relay(self, sid: int, stream: Any, text_stream: bool) -> None:
        words_sent = 0
        error: BaseException | None = None
        try:
            async for chunk in stream:
                words: list = []
                if text_stream:
                    words = stream.words()[words_sent:]
                    words_sent += len(words)
                pcm = np.ascontiguousarray(chunk.pcm, dtype="<i2").tobytes()
                self.send(("chunk", sid, pcm, chunk.frame_index, chunk.num_frames, words))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - the server's reader raises it
            error = exc
        # Words read after the last chunk (the turn's end) go with the end.
        self.send(("end", sid, error, stream.words()[words_sent:] if text_stream else None))

    async def close(self, sid: int) -> None:
        stream = self.streams.pop(sid, None)
        relay = self.relays.pop(sid, None)
        if stream is not None:
            await stream.aclose()
        if relay is not None:
            relay.cancel()
            await asyncio.gather(relay, return_exceptions=True)
        self.send(("closed", sid))

    async def call(self, cid: int, method: str, args: tuple, kwargs: dict) -> None:
        try:
            reply = (True, await asyncio.to_thread(self.run_call, method, args, kwargs))
        except Exception as exc:  # noqa: BLE001 - raised in the server's caller
            reply = (False, exc)
        library = self.service.engine.voice_library if self.service.model_type == "base" else None
        self.send(("reply", cid, *reply, library.names() if library is not None else None))

    def run_call(self, method: str, args: tuple, kwargs: dict) -> Any:
        engine = self.service.engine
        if method == "create_voice":  # its tensors are on the CPU (voices/encoders.py)
            return engine.create_voice(*args, **kwargs)
        if method == "remove_voice":
            engine.voice_library.remove(*args)
            return None
        raise ValueError(f"unknown engine call {method!r}")

    async def report(self) -> None:
        service = self.service
        try:
            await service.wait_ready()
        except Exception as exc:  # noqa: BLE001 - the server reports the failure
            self.send(("state", {"failed": True, "error": exc}))
            self.stopped.set()
            return
        engine = service.engine
        library = engine.voice_library if service.model_type == "base" else None
        # What does not change goes once; the library's names change only by the server's
        # calls, whose replies carry them.
        state = {"ready": True, "model_type": service.model_type, "voices": list(service.voices),
                 "languages": list(service.languages), "sample_rate": service.sample_rate,
                 "library": library.names() if library is not None else []}
        while True:
            pauses, self.gc_pauses = self.gc_pauses, []
            figures = {name: getattr(service, name) for name in REPORTED}
            # Beside the engine thread's CPU time, this process's other two threads'.
            figures["thread_cpu"] = {**figures["thread_cpu"], **thread_cpu_seconds(
                {"relay": threading.current_thread(), "pipe": self.reader})}
            self.send(("state", {**state, "alive": service.alive, **figures,
                                 "fully_warm": bool(getattr(engine, "fully_warm", True)),
                                 "gc": pauses}))
            state = {}
            if not service.alive:
                self.stopped.set()
                return
            await asyncio.sleep(STATE_INTERVAL_S)
