"""Each utterance's timeline, stamped with time.monotonic (one clock for every process on Linux),
keyed by its seed: in the callers' process (due, connect, sent, first audio, every chunk's
arrival) and in the server's (TCP accept, session.config, input.text handled, the engine thread
opening the stream and posting each chunk, the socket handler reading and sending it). Garbage
collections are timed too. Written as JSON at exit to $TRACE_OUT (and $TRACE_OUT.gc).

install_server() in the server process; install_callers(in_process) in the fleet benchmark's.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import time

T: dict = {}
GC: list = []
_accepted: dict[int, float] = {}  # TCP accept time by the peer's port


def mark(key, event: str, t: float | None = None) -> None:
    events = T.setdefault(key, {})
    if event not in events:
        events[event] = time.monotonic() if t is None else t


def add(key, event: str) -> None:
    T.setdefault(key, {}).setdefault(event, []).append(time.monotonic())


def _dump() -> None:
    out = os.environ.get("TRACE_OUT")
    if out:
        with open(out, "w") as f:
            json.dump(T, f)
        with open(out + ".gc", "w") as f:
            json.dump(GC, f)


def _time_gc() -> None:
    started: dict[str, float] = {}

    def callback(phase: str, info: dict) -> None:
        if phase == "start":
            started["t"] = time.perf_counter()
        elif "t" in started:
            GC.append((time.monotonic(), info["generation"], (time.perf_counter() - started["t"]) * 1e3))

    gc.callbacks.append(callback)
    atexit.register(_dump)


def _engine_marks() -> None:
    from pipecat_qwen_fast.engine import service as svc

    open_streams = svc.EngineService._open

    def _open(self, streams):
        t = time.monotonic()
        for s in streams:
            if getattr(s, "_trace_key", None) is not None:
                mark(s._trace_key, "eng_open", t)
        return open_streams(self, streams)

    post = svc.SynthesisStream._post

    def _post(self, item):
        key = getattr(self, "_trace_key", None)
        if key is not None and getattr(item, "num_frames", None) is not None:
            mark(key, "eng_post")
            add(key, "posts")
        return post(self, item)

    anext_ = svc.SynthesisStream.__anext__

    async def __anext__(self):
        item = await anext_(self)
        if getattr(self, "_trace_key", None) is not None:
            mark(self._trace_key, "deq")
        return item

    svc.EngineService._open = _open
    svc.SynthesisStream._post = _post
    svc.SynthesisStream.__anext__ = __anext__


def install_server() -> None:
    _time_gc()
    _engine_marks()
    from uvicorn.protocols.http import httptools_impl

    from pipecat_qwen_fast.server import streams, ws

    made = httptools_impl.HttpToolsProtocol.connection_made

    def connection_made(self, transport):
        peer = transport.get_extra_info("peername")
        if peer:
            _accepted[peer[1]] = time.monotonic()
        return made(self, transport)

    httptools_impl.HttpToolsProtocol.connection_made = connection_made
    configure = ws.SpeechSocket.configure

    async def _configure(self, msg):
        key = msg.get("seed")
        mark(key, "srv_cfg")
        peer = self.ws.client
        if peer and peer[1] in _accepted:
            mark(key, "srv_tcp", _accepted.pop(peer[1]))
        return await configure(self, msg)

    take_text = ws.SpeechSocket.take_text

    async def _take_text(self, msg):
        key = self.options.seed if self.options is not None else None
        self._trace_key = key
        mark(key, "srv_text")
        return await take_text(self, msg)

    init = streams.AudioStream.__init__

    def _init(self, service, request, **kw):
        init(self, service, request, **kw)
        self._stream._trace_key = request.seed

    send_bytes = ws.SpeechSocket.send_bytes

    async def _send_bytes(self, data):
        await send_bytes(self, data)
        if getattr(self, "_trace_key", None) is not None:
            mark(self._trace_key, "srv_sent")

    ws.SpeechSocket.configure = _configure
    ws.SpeechSocket.take_text = _take_text
    streams.AudioStream.__init__ = _init
    ws.SpeechSocket.send_bytes = _send_bytes


def install_callers(in_process: bool) -> None:
    _time_gc()
    from pipecat_qwen_fast.bench import fleet_callers

    hear = fleet_callers.hear

    async def _hear(endpoint, reply, seed, u, clock):
        mark(seed, "due", clock.t0 + u.submitted)
        mark(seed, "level", clock.t0)
        try:
            return await hear(endpoint, reply, seed, u, clock)
        finally:
            if u.arrivals:
                mark(seed, "cli_first", clock.t0 + u.arrivals[0])
                T[seed]["arrivals"] = [clock.t0 + a for a in u.arrivals]
                T[seed]["samples"] = list(u.samples)

    fleet_callers.hear = _hear
    if in_process:
        _engine_marks()
        open_ = fleet_callers.InProcessEndpoint.open

        def _open(self, request):
            stream = open_(self, request)
            stream._trace_key = request.seed
            mark(request.seed, "cli_sent")
            return stream

        fleet_callers.InProcessEndpoint.open = _open
        return
    from pipecat_qwen_fast import remote

    open_remote = remote.RemoteStream._open

    async def _open_remote(self):
        key = self._config.get("seed")
        mark(key, "cli_connect")
        ws = await open_remote(self)
        mark(key, "cli_sent")
        return ws

    remote.RemoteStream._open = _open_remote
