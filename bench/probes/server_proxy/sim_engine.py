"""A stand-in for the H200 engine, so that the server's cost under load can be measured on a CPU.

It keeps the tiny checkpoint's real engine for everything but the frames (voices, tokenizer,
request checks, the streamed-text feed), and replaces each round's GPU work by a sleep (the GIL
let go, as the engine thread lets it go while it waits for the device) and its host work by
Python spun in short pieces, each followed by a call that lets go of the GIL, as a torch call
does: the engine thread takes the GIL back many times a round, each time possibly behind the
server's event loop. Calibrated on the H200's wave-3 fleet (128 callers: rounds of 11.4 ms =
decode 7.2, vocoder 2.7, prefill 0.95, host 0.5 at ~15 rows; first audio p50/p95 23.3/35.9 ms in
process): the proxy gives 11.3-11.5 ms rounds and 21.8-22.2 / 31-32 ms in process.

Chunks are silent PCM of the request's chunk schedule (chunk_target); every utterance runs to
its max_frames. `install()` makes QwenTTSEngine.from_pretrained return one (device cpu).

Each round's record goes to $TRACE_OUT.rounds at exit: (start, end, rows, GIL and timer wait in
the round in ms, the service's posting of the round before in ms).
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import time

import numpy as np

from pipecat_qwen_fast.engine.request import AudioChunk, chunk_target

DECODE_MS, DECODE_ROW_MS = 6.7, 0.03
VOCODER_MS = 1.4  # a call per chunk size in the round
PREFILL_MS, PREFILL_ROW_MS = 2.5, 0.2
HOST_MS, HOST_ROW_MS = 0.15, 0.02
# GIL-releasing calls a round makes (kernel launches, graph replays, copies).
PREFILL_OPS, DECODE_OPS, DECODE_OPS_ROW, VOCODER_OPS = 15, 20, 2, 10
RELEASE_MS = 0.0026  # one sha1 of _BUF, measured
FRAME = 1920
_BUF = b"x" * 4096  # hashlib lets go of the GIL from 2 KB on

ROUNDS: list[tuple] = []
_wait = [0.0]  # seconds waited past the model in the current round
_posting = [0.0]  # seconds of the service's _after_step calls since the last round


def _spin(ms: float) -> None:
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


def _host(ops: int, ms: float) -> None:
    per = ms / max(1, ops)
    t = time.perf_counter()
    for _ in range(ops):
        _spin(per)
        hashlib.sha1(_BUF).digest()
    _wait[0] += time.perf_counter() - t - (ms + ops * RELEASE_MS) / 1e3


def _device(ms: float) -> None:
    t = time.perf_counter()
    time.sleep(ms / 1e3)
    _wait[0] += time.perf_counter() - t - ms / 1e3


class SimSession:
    def __init__(self, request, feed=None) -> None:
        self.request = request
        self.feed = feed
        self.frames_decoded = 0
        self.segment_frames = 0
        self.chunk_start = 0
        self.pending: list = []  # a frame each, as the real session's codes not yet vocoded
        self.done = False
        self.stop_reason: str | None = None
        self.begun = False
        self.cap = request.max_frames or 50


class SimEngine:
    fully_warm = True

    def __init__(self, real) -> None:
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)

    def warm_step(self) -> bool:
        return False

    def finish_warmup(self) -> None:
        pass

    def prepare_thread(self) -> None:
        pass

    def close(self) -> None:
        self._real.close()

    def open_sessions(self, requests):
        out = []
        for r in requests:
            try:
                self._real.check_request(r)
                out.append(SimSession(r))
            except Exception as e:  # noqa: BLE001 - that request's error, as the engine gives it
                out.append(e)
        opened = [s for s in out if isinstance(s, SimSession)]
        if opened:
            _host(PREFILL_OPS, HOST_MS * 0.3)
            _device(PREFILL_MS + PREFILL_ROW_MS * (len(opened) - 1))
            for s in opened:
                s.begun = True
        return out

    def open_text_session(self, request, *, idle_timeout_s=None, feed=None):
        self._real.check_request(request)
        s = SimSession(request, feed)
        feed.session = s
        return s

    def poll_text(self, s):
        with s.feed.turn.lock:
            ready = bool(s.feed.turn.segments) or s.feed.turn.ended
        return None if ready else []

    def close_session(self, s) -> None:
        s.done = True

    def step_many(self, sessions):
        t0 = time.monotonic()
        posting, _posting[0] = _posting[0], 0.0
        try:
            return self._round(sessions)
        finally:
            ROUNDS.append((t0, time.monotonic(), len(sessions), _wait[0] * 1e3, posting * 1e3))
            _wait[0] = 0.0

    def _round(self, sessions):
        live = [s for s in sessions if not s.done]
        opening = [s for s in live if not s.begun]
        n = len(live)
        if opening:  # a streamed-text turn's prefill runs in its first round
            _host(PREFILL_OPS, HOST_MS * 0.3)
            _device(PREFILL_MS + PREFILL_ROW_MS * (len(opening) - 1))
            for s in opening:
                s.begun = True
        _host(DECODE_OPS + DECODE_OPS_ROW * n, (HOST_MS + HOST_ROW_MS * n) * 0.5)
        _device(DECODE_MS + DECODE_ROW_MS * n)
        results, sizes = [], {}
        for s in sessions:
            if s.done:
                results.append([])
                continue
            s.frames_decoded += 1
            s.segment_frames += 1
            s.pending.append(None)
            last = s.frames_decoded >= s.cap
            if last or len(s.pending) >= chunk_target(s.request, s.chunk_start):
                k = len(s.pending)
                sizes[k] = sizes.get(k, 0) + 1
                results.append([AudioChunk(np.zeros(k * FRAME, dtype=np.int16), s.chunk_start, k,
                                           np.zeros((k, 16), dtype=np.int64))])
                s.chunk_start += k
                s.pending = []
            else:
                results.append([])
            if last:
                s.done = True
                s.stop_reason = "frame_cap"
        for rows in sizes.values():
            _host(VOCODER_OPS + rows, HOST_ROW_MS * rows)
            _device(VOCODER_MS)
        _spin((HOST_MS + HOST_ROW_MS * n) * 0.5)
        return results


def _dump() -> None:
    out = os.environ.get("TRACE_OUT")
    if out and ROUNDS:
        with open(out + ".rounds", "w") as f:
            json.dump(ROUNDS, f)


def install() -> None:
    from pipecat_qwen_fast.engine import engine as engine_module
    from pipecat_qwen_fast.engine import service

    cls = engine_module.QwenTTSEngine
    load = cls.from_pretrained.__func__

    def from_pretrained(klass, model, **kw):
        kw.update(warmup=False, device="cpu", backend="torch", dtype="float32")
        return SimEngine(load(klass, model, **kw))

    cls.from_pretrained = classmethod(from_pretrained)
    after_step = service.EngineService._after_step

    def timed_after_step(self, stream, result):
        t = time.perf_counter()
        try:
            return after_step(self, stream, result)
        finally:
            _posting[0] += time.perf_counter() - t

    service.EngineService._after_step = timed_after_step
    atexit.register(_dump)
