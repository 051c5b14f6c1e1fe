"""Prometheus metrics of one server process, and the playout clock that judges chunk lateness.

Each app has its own registry, so several apps in one process (tests, a Ray Serve replica beside
its proxy) never clash over metric names.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import math
from collections.abc import Callable
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

CONTENT_TYPE = CONTENT_TYPE_LATEST

# First audio sits between ~10 ms (megakernel, H200) and seconds (CPU, or a full engine).
FIRST_AUDIO_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
                       0.75, 1.0, 2.0, 5.0)
ENDPOINTS = ("http", "ws")
# 0 is its own bucket: the share of chunks that arrived before the listener needed them.
LATENESS_BUCKETS = (0.0, 0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
# The event loop's lag: a task sleeps LOOP_LAG_INTERVAL_S again and again, and each wake-up's delay
# is observed. Sub-millisecond on an idle loop; every socket's chunks wait as long as it.
LOOP_LAG_INTERVAL_S = 0.01
# A collection holds the GIL: every stream and the engine thread wait it out. Young ones take
# ~0.1-3 ms; a full one over a loaded model's unfrozen heap 0.2-0.6 s (engine/heap.py).
GC_PAUSE_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
LOOP_LAG_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05,
                    0.075, 0.1, 0.2, 0.5, 1.0)


class ServerMetrics:
    """The server's metrics. ``active``/``queued``/``in_use`` are read when scraped."""

    def __init__(self, *, active: Callable[[], int], queued: Callable[[], int],
                 in_use: Callable[[], int], sockets: Callable[[], int], capacity: int,
                 ready: Callable[[], bool], service: Callable[[], Any] = lambda: None) -> None:
        r = self.registry = CollectorRegistry()
        r.register(EngineRounds(service))
        Gauge("qwen_tts_streams_active", "Engine streams being decoded now.", registry=r
              ).set_function(active)
        Gauge("qwen_tts_streams_queued", "Engine streams waiting for a free engine slot.",
              registry=r).set_function(queued)
        Gauge("qwen_tts_admitted_streams", "Streams admitted by the server's bound (HTTP "
              "requests and WebSocket turns in progress).", registry=r).set_function(in_use)
        Gauge("qwen_tts_max_streams", "The server's bound on admitted streams.", registry=r
              ).set(capacity)
        Gauge("qwen_tts_ready", "1 once the engine is loaded and warm, 0 while loading or "
              "draining.", registry=r).set_function(lambda: float(ready()))
        Gauge("qwen_tts_websockets_open", "Open stream WebSockets (a warm idle socket counts: "
              "one per connected agent).", registry=r).set_function(sockets)
        self.first_audio = Histogram(
            "qwen_tts_first_audio_seconds", "From a request (or a WebSocket flush) to its first "
            "audio chunk.", ["endpoint"], buckets=FIRST_AUDIO_BUCKETS, registry=r)
        self.lateness = Histogram(
            "qwen_tts_chunk_lateness_seconds", "How long after the audio sent before it had "
            "finished playing each later chunk was ready (0: in time).", ["endpoint"],
            buckets=LATENESS_BUCKETS, registry=r)
        self.underruns = Counter(
            "qwen_tts_underruns_total", "Chunks that came after a listener playing from the "
            "first chunk would have run out of audio.", ["endpoint"], registry=r)
        self.audio_seconds = Counter(
            "qwen_tts_audio_seconds_total", "Seconds of audio sent.", ["endpoint"], registry=r)
        self.refusals = Counter(
            "qwen_tts_refusals_total", "Requests refused with 503 or a WebSocket error event.",
            ["reason"], registry=r)
        self.errors = Counter(
            "qwen_tts_errors_total", "Requests that failed: bad_request, unauthorized, protocol "
            "(WebSocket garbage), engine.", ["kind"], registry=r)
        self.loop_lag = Histogram(
            "qwen_tts_event_loop_lag_seconds", "How late the server's event loop woke a task "
            f"sleeping {LOOP_LAG_INTERVAL_S * 1e3:g} ms, sampled all the time: what every "
            "socket's delivery waited then.", buckets=LOOP_LAG_BUCKETS, registry=r)
        self.gc_pauses = GcPauseHistogram(
            "qwen_tts_gc_pause_seconds", "Garbage collections and how long each held the GIL, by "
            "generation (2: a full one) and process: server (the app's), engine (the engine "
            "process's, where the engine runs in one).", GC_PAUSE_BUCKETS)
        r.register(self.gc_pauses)
        self.streams = Counter(
            "qwen_tts_streams_total", "Engine streams ended, by how: completed, cancelled "
            "(client left), failed.", ["endpoint", "outcome"], registry=r)
        # Labelled series appear only once touched; a counter absent until its first underrun
        # cannot be told from a broken scrape, and rate() over it misses that first one.
        for endpoint in ENDPOINTS:
            self.underruns.labels(endpoint)
            self.audio_seconds.labels(endpoint)

    def observe_gc(self, generation: int, seconds: float, process: str = "server") -> None:
        """Safe inside the garbage collector's callbacks (GcPauseHistogram)."""
        self.gc_pauses.observe(generation, seconds, process)

    def render(self) -> bytes:
        return generate_latest(self.registry)


async def watch_loop_lag(observe: Callable[[float], None],
                         interval: float = LOOP_LAG_INTERVAL_S) -> None:
    """Sleep `interval` again and again on the running loop, observing how late each wake-up
    came (seconds), until cancelled."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + interval
        await asyncio.sleep(interval)
        observe(max(0.0, loop.time() - due))


class GcPauseHistogram:
    """Collections by generation (0-2) and how long each took, published as a histogram.

    `observe` runs inside the garbage collector, which an allocation anywhere sets off, also
    inside prometheus_client's own locked code: a Histogram's `labels(...).observe` there took the
    metric's lock again, held by the interrupted `labels()` of the same thread, and the server's
    event loop deadlocked (stop 49's CI, reproduced on the 2-core machine under load). So the
    counts are plain lists added to under the GIL, read when scraped; no lock anywhere.

    By process too: the engine process's collections stop the engine thread (its rounds, the
    slack of every chunk), the server's stop delivery; on the H200 the two summed were 4-5x the
    in-process benchmark's at 464 fleet callers (session 40). The server's series are always
    published, the engine process's once it has reported a collection."""

    PROCESSES = ("server", "engine")

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...]) -> None:
        self._name, self._documentation = name, documentation
        self._bounds = list(buckets)
        # process -> generation -> counts per bucket (the last: over every bound)
        self._counts = {p: [[0] * (len(buckets) + 1) for _ in range(3)] for p in self.PROCESSES}
        self._sums = {p: [0.0, 0.0, 0.0] for p in self.PROCESSES}

    def observe(self, generation: int, seconds: float, process: str = "server") -> None:
        self._counts[process][generation][bisect.bisect_left(self._bounds, seconds)] += 1
        self._sums[process][generation] += seconds

    def collect(self):
        family = HistogramMetricFamily(self._name, self._documentation, labels=["generation", "process"])
        for process in self.PROCESSES:
            counts = self._counts[process]
            if process != "server" and not any(map(any, counts)):
                continue
            for generation in range(3):
                cumulative = list(itertools.accumulate(list(counts[generation])))
                buckets = [(floatToGoString(b), float(c)) for b, c in zip(self._bounds, cumulative)]
                buckets.append(("+Inf", float(cumulative[-1])))
                family.add_metric([str(generation), process], buckets, self._sums[process][generation])
        yield family


class EngineRounds:
    """The engine thread's rounds, read from the service when scraped: the admission signals (the
    smoothed round, refused over `max_round_ms`; the chunks that came within `min_slack_ms` of
    their playback, and the lowest recent slack; the refusals by setting) and the count and summed wall time, whose deltas
    give the mean round over any interval (`bench fleet` through a server reads them per level)."""

    def __init__(self, service: Callable[[], Any]) -> None:
        self._service = service

    def collect(self):
        service = self._service()
        if service is None:  # still loading
            return
        rounds = CounterMetricFamily("qwen_tts_engine_rounds", "Engine rounds that ran frames.")
        rounds.add_metric([], float(service.rounds))
        yield rounds
        seconds = CounterMetricFamily("qwen_tts_engine_round_seconds",
                                      "Wall time of the engine rounds that ran frames.")
        seconds.add_metric([], float(service.round_seconds))
        yield seconds
        streams = CounterMetricFamily("qwen_tts_engine_round_streams",
                                      "Streams stepped a frame, summed over the engine rounds.")
        streams.add_metric([], float(service.round_streams))
        yield streams
        yield GaugeMetricFamily("qwen_tts_engine_round_ms", "The smoothed round wall time that "
                                "admission compares with max_round_ms.",
                                value=float(service.round_ms))
        low = CounterMetricFamily("qwen_tts_engine_low_slack_chunks", "Chunks whose audio reached "
                                  "their stream less than min_slack_ms before their playback time.")
        low.add_metric([], float(service.low_slack_chunks))
        yield low
        refused = CounterMetricFamily("qwen_tts_engine_refusals", "New streams the engine refused "
                                      "as overloaded, by the setting that refused them.", labels=["reason"])
        for reason, count in sorted(service.refusals.items()):
            refused.add_metric([reason], float(count))
        yield refused
        cpu = CounterMetricFamily("qwen_tts_engine_thread_cpu_seconds", "CPU time of the engine's "
                                  "threads: engine (its rounds), and where the engine runs in a "
                                  "process of its own, relay (streams and chunks to and from the "
                                  "server, streamed text cut into tokens) and pipe (the reader), "
                                  "which share that process's GIL.", labels=["thread"])
        for thread, seconds in sorted((getattr(service, "thread_cpu", None) or {}).items()):
            cpu.add_metric([thread], float(seconds))
        yield cpu
        lowest = service.lowest_slack_ms
        # NaN while no chunk was measured recently: a scrape can tell "none" from a missing metric.
        yield GaugeMetricFamily("qwen_tts_engine_lowest_slack_ms", "The lowest slack (playback time "
                                "less arrival) of the engine's chunks of the last 1-2 s; negative: late.",
                                value=math.nan if lowest is None else float(lowest))


class PlayoutClock:
    """When a listener who starts playing at the first chunk runs out of the audio sent so far.

    A chunk that comes after that moment is late by the difference (an underrun: the listener
    hears a gap); the listener then resumes from that chunk.
    """

    def __init__(self) -> None:
        self._end: float | None = None

    def restart_if_played(self, now: float) -> None:
        """Start afresh if the listener has already played everything sent: the next chunk then
        opens a new stretch of audio instead of counting as late (a WebSocket turn waiting for
        its next sentence's text, which the server cannot speak before it arrives)."""
        if self._end is not None and now >= self._end:
            self._end = None

    @property
    def started(self) -> bool:
        return self._end is not None

    def add(self, now: float, seconds: float) -> float | None:
        """Record a chunk of ``seconds`` ready at ``now``; its lateness (None for a first chunk)."""
        if self._end is None:
            self._end = now + seconds
            return None
        late = max(0.0, now - self._end)
        self._end = max(self._end, now) + seconds
        return late
