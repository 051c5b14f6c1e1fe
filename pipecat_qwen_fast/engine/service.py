"""EngineService: one GPU thread per loaded engine, many interleaved sessions, an asyncio API.

The engine is not thread-safe and owns one device, so every engine call (load, open_session, step,
close_session) happens on a single dedicated thread. That thread serves all sessions round-robin,
one frame per session per round, so concurrent streams all progress and a long utterance cannot
starve a short one. Adapters (Pipecat, LiveKit) talk to it from any event loop:

    service = await get_shared_service("Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice")
    async for chunk in service.stream(SynthesisRequest("Hello.", voice="ryan")):
        play(chunk.pcm)

Leaving the loop early (break, ``aclose()``, task cancellation) asks the thread to stop that
session; it checks before every frame, so at most the frame already running completes. Engines
are shared process-wide through a registry keyed by (model, device, dtype, backend), so a Pipecat
pipeline and a LiveKit agent in one process load the weights once.

Over 500 lines because the engine thread's loop, the streams it feeds and the shutdown and fault
paths share one lock and one set of invariants (a stream ends exactly once, its session is freed
on every path); streamed-text turns are in text_service.py, round timing in round_timing.py.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import concurrent.futures
import contextlib
import itertools
import logging
import math
import os
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Self

import numpy as np

from pipecat_qwen_fast.engine.deferred_audio import DeferredChunk
from pipecat_qwen_fast.engine.heap import freeze_heap, release_heap
from pipecat_qwen_fast.engine.request import SynthesisRequest, chunk_target, round_budget_ms
from pipecat_qwen_fast.engine.slack import MIN_SLACK_MS, PlaybackClock, SlackWatch, describe_slack
from pipecat_qwen_fast.engine.stack_samples import start_from_env as start_stack_samples
from pipecat_qwen_fast.engine.text_session import DEFAULT_IDLE_TIMEOUT_S
from pipecat_qwen_fast.errors import EngineClosedError, EngineOverloadedError, NoFreeSlotError
from pipecat_qwen_fast.utils.threads import thread_cpu_seconds

if TYPE_CHECKING:
    from pipecat_qwen_fast.engine.request import AudioChunk

logger = logging.getLogger("pipecat_qwen_fast.engine.service")

# Audio chunks a stream may hold unread before its session is paused: enough to ride out event-loop
# hiccups, small enough that a stalled consumer holds a few seconds of audio at most.
DEFAULT_MAX_BUFFERED_CHUNKS = 16
# Finished streams kept for inspection (tests, debugging); each record is a few ints per frame.
HISTORY_SIZE = 64
# Round timings kept while timing is on (time_rounds): minutes of rounds at a few hundred a second,
# a few MB; a reader that drains them (popleft) never reaches the bound.
ROUND_TIMINGS_KEPT = 200_000
# How often the engine thread looks at a stream paused by backpressure while nothing else wakes it:
# one whose consumer's event loop has closed will never be read again, and is released.
PAUSED_POLL_S = 0.25
# Deadline scheduling (docs/PERFORMANCE.md, "A fleet"): once more than CONTENTION_ROWS streams are
# ready in a round, those more than MAX_LEAD_S of audio ahead of their playback (assumed to start
# at their first chunk, in real time) sit the round out, so the calls that are due (new ones
# first: they have no audio yet) get shorter rounds. Below it every ready stream runs: a lone
# caller is never slowed to real time.
MAX_LEAD_S = 1.0
CONTENTION_ROWS = 64
# A stream sits a round out only while its lead also covers the rest of the chunk it is making at
# this many times the current round time: at 384 fleet callers (H200, baf3b4b) 151 of 417 late
# utterances were first late at their 32-frame chunk, begun with ~1 s of lead and 27-48 ms rounds.
LEAD_SAFETY = 1.5
# While streams are live, at most this many new calls open in one round; the rest open in the next
# rounds, first in line. At 384-512 callers the slowest rounds opened 6-27 calls (18-91 ms of
# prefill), and most late utterances were first late at their second chunk, due 80 ms after the
# first: one long round makes every new call's second chunk late. An open costs ~2.8 ms.
MAX_OPENS_PER_ROUND = 4
# Admission on a GPU: while streams are live, at most this many admitted calls wait to open (four
# rounds of opens, ~80 ms). At 768 fleet callers on the H200 (twice the capacity) the refused
# callers' retries came back together whenever admission reopened, the waiting calls grew to
# first audio of 262-303 ms p50, and opening them 4 a round made most of the late second chunks.
# At the capacity's ~1.5 arrivals a round, 16 waiting takes a burst rarer than 1 in 2,500 four-round spans.
MAX_QUEUED_STREAMS = 4 * MAX_OPENS_PER_ROUND
# Admission on a GPU: a call is refused while the smoothed round takes longer than this share of
# the default schedule's round budget (request.round_budget_ms: 40.6 ms, in which a stream's
# 32-frame chunk after 32 sent, at one frame a round, must follow 2.56 s of audio). The margin is
# for rounds longer than the mean (a round that opens calls or vocodes many chunks): 32.5 ms.
ROUND_MARGIN = 0.8
MAX_ROUND_MS = ROUND_MARGIN * round_budget_ms(SynthesisRequest(""))
ROUND_EWMA = 0.2  # weight of the newest round in the smoothed round time
# A round counts at most this many times the limit in the smoothed time: one stall (a 630 ms round
# in the H200's fleet at 256 callers) then moves it a step, not past the limit for the ~0.1 s of
# arrivals that queued behind the stall (46 refusals), while rounds over the limit round after
# round still cross it as soon as before.
ROUND_SAMPLE_CAP = 2.0
FRAME_S = 0.08


def check_admission(*, max_round_ms: Any = "auto", min_slack_ms: Any = "auto",
                    max_queued_streams: Any = "auto") -> None:
    """Refuse (ValueError) admission settings an EngineService cannot take, naming the valid ones."""
    if not (max_round_ms is None or max_round_ms == "auto" or (_is_finite_number(max_round_ms) and max_round_ms > 0)):
        raise ValueError(f"max_round_ms must be > 0, 'auto' or None, got {max_round_ms!r}")
    if not (min_slack_ms is None or min_slack_ms == "auto" or _is_finite_number(min_slack_ms)):
        raise ValueError(f"min_slack_ms must be a number, 'auto' or None, got {min_slack_ms!r}")
    if not (max_queued_streams is None or max_queued_streams == "auto"
            or (isinstance(max_queued_streams, int) and not isinstance(max_queued_streams, bool)
                and max_queued_streams >= 1)):
        raise ValueError(f"max_queued_streams must be an int >= 1, 'auto' or None, got {max_queued_streams!r}")


def parse_admission(name: str, text: str) -> float | int | str | None:
    """A command line's value for admission setting `name` (max_round_ms, min_slack_ms,
    max_queued_streams): "auto", "off" (None) or a number, checked as EngineService checks it."""
    value: float | int | str | None
    if text in ("auto", "off"):
        value = None if text == "off" else text
    else:
        try:
            value = int(text) if name == "max_queued_streams" else float(text)
        except ValueError:
            value = text
    try:
        check_admission(**{name: value})
    except ValueError as exc:
        raise ValueError(f"{exc} (on the command line: auto, off or a number)") from None
    return value


def smoothed_round_ms(previous: float, ms: float, limit: float | None) -> float:
    """The admission signal after a round of `ms` (0.0 before the first round)."""
    if limit is not None:
        ms = min(ms, ROUND_SAMPLE_CAP * limit)
    return ms if previous == 0.0 else previous + ROUND_EWMA * (ms - previous)


# At exit, how long a model still loading is waited for (see _stop_services_at_exit).
LOAD_EXIT_WAIT_S = 10.0

# Every service whose thread may still run (the thread holds its service until it ends).
_live_services: weakref.WeakSet[EngineService] = weakref.WeakSet()


def _stop_services_at_exit() -> None:
    """Stop every engine thread before the interpreter finalizes.

    The engine thread is a daemon, so that a forgotten service never keeps a process alive. But at
    finalization Python ends a daemon thread that asks for the GIL back with pthread_exit, and when
    that thread is inside a torch op (which releases the GIL), the forced unwind runs through
    torch's noexcept gil_scoped_release destructor: std::terminate, "terminate called without an
    active exception", exit 134. So at exit each service is closed and its thread joined, which
    takes at most the frame in flight. A load still running is waited for up to LOAD_EXIT_WAIT_S
    (a download or a long compile must not hold the exit for minutes); past that the process exits
    as before, with the same risk.
    """
    services = list(_live_services)
    for service in services:
        service._closing = True
        service._wake.set()
    for service in services:
        if service._thread is threading.current_thread():
            continue
        loading = not service._ready.done()
        service._thread.join(LOAD_EXIT_WAIT_S if loading else None)
        if service._thread.is_alive():
            logger.warning("exiting while the TTS model still loads (after %.0f s)", LOAD_EXIT_WAIT_S)


# threading's exit hooks run before atexit's and before any daemon thread is ended; `atexit`
# where that (private) hook is missing.
getattr(threading, "_register_atexit", atexit.register)(_stop_services_at_exit)


@dataclass
class StreamRecord:
    """What the engine thread did for one stream, kept after the stream finishes.

    ``frames_decoded`` is the engine session's own frame count when the session was closed;
    ``frames_at_cancel`` is that count at the moment cancellation was requested, so
    ``frames_decoded - frames_at_cancel`` is the work done after a barge-in (0 or 1).
    ``ticks`` are the service-wide step numbers at which this stream's frames were decoded:
    interleaved streams have interleaved ticks.
    """

    stream_id: int
    frames_decoded: int = 0
    frames_at_cancel: int | None = None
    stop_reason: str | None = None
    error: BaseException | None = None
    opened: bool = False
    closed: bool = False
    ticks: list[int] = field(default_factory=list)
    submitted_at: float = field(default_factory=time.monotonic)
    first_chunk_at: float | None = None


class _End:
    """Terminal item of a stream's queue: normal end (error None) or the error to raise."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException | None) -> None:
        self.error = error


class SynthesisStream:
    """Async iterator over the AudioChunks of one request, fed by the engine thread.

    Create it with :meth:`EngineService.open_stream` inside a running event loop. Iterating yields
    ``AudioChunk`` objects; an engine error is raised from the iteration. ``cancel()`` or
    ``aclose()`` stop the session's GPU work before its next frame.
    """

    def __init__(self, service: EngineService, request: Any, stream_id: int) -> None:
        self.request = request
        self.record = StreamRecord(stream_id=stream_id)
        self._service = service
        self._loop = asyncio.get_running_loop()
        self._items: collections.deque[Any] = collections.deque()
        self._ready = asyncio.Event()
        self._finished = False
        self._closed = concurrent.futures.Future[StreamRecord]()
        self._closed.set_running_or_notify_cancel()
        self.cancel_requested = False
        self.session: Any = None
        # Engine thread: what engine.prepare_session made (or raised) for it while a round
        # decoded, before its open; None until then, and again once an open took it.
        self.prepared: Any = None
        self._first_post_at: float | None = None  # engine thread: when its first chunk was posted
        self._audio_posted_s = 0.0
        self._playback = PlaybackClock()  # engine thread: for the slack of its chunks (slack.py)
        self._arrived = 0  # engine thread: chunks whose audio reached the stream
        self._first_round = 0  # engine thread: the service's round count when its first chunk arrived

    def lead(self, now: float) -> float:
        """Seconds of audio posted ahead of its playback, which starts at the first chunk and
        runs in real time (-inf before the first chunk: the most urgent)."""
        if self._first_post_at is None:
            return float("-inf")
        return self._first_post_at + self._audio_posted_s - now

    def frames_to_chunk(self) -> int:
        """Frames its session still decodes before its next chunk is sent (1 when unknown)."""
        session = self.session
        pending = getattr(session, "pending", None)
        if pending is None:
            return 1
        return max(1, chunk_target(session.request, session.chunk_start) - len(pending))

    def may_sit_out(self, now: float, min_lead_s: float, round_s: float) -> bool:
        """Whether skipping a round leaves it time to finish its chunk before its audio runs out."""
        return self.lead(now) >= max(min_lead_s, LEAD_SAFETY * (self.frames_to_chunk() + 1) * round_s)

    # -- engine thread hooks: a whole text's; a streamed-text turn overrides them -------------

    streams_text = False  # True for engine/text_service.TextStream: opened on its own, text fed later

    def can_step(self) -> bool:
        """Whether the stream's session decodes a frame this round."""
        return True

    def wake_deadline(self) -> float | None:
        """When the engine thread must look at this stream again without new input (None: never)."""
        return None

    # -- consumer side (event loop) ----------------------------------------------------------

    def __aiter__(self) -> SynthesisStream:
        return self

    async def __anext__(self) -> Any:
        while True:
            if self._finished:
                raise StopAsyncIteration
            try:
                # The next item, once there; a DeferredChunk once its audio is (deferred_audio.py).
                while not self._next_ready():
                    self._ready.clear()
                    if self._next_ready():
                        break
                    await self._ready.wait()
                    if self._finished:  # cancelled by someone else while we waited
                        raise StopAsyncIteration
            except asyncio.CancelledError:
                self.cancel()
                raise
            if self._finished and not isinstance(self._items[0], _End):
                raise StopAsyncIteration
            item = self._items.popleft()
            if not isinstance(item, DeferredChunk):
                break
            if item.chunk is not None:
                item = item.chunk
                break
            # Dropped (the engine failed before its audio was made): what follows says why.
        self._service._wake.set()  # a paused (backpressured) session may run again
        if isinstance(item, _End):
            self._finished = True
            if item.error is not None:
                raise item.error
            raise StopAsyncIteration
        return item

    def _next_ready(self) -> bool:
        if not self._items:
            return False
        head = self._items[0]
        return not isinstance(head, DeferredChunk) or head.settled

    def cancel(self) -> None:
        """Ask the engine thread to stop this session before its next frame (idempotent)."""
        if self._finished and self._closed.done():
            return
        if not self.cancel_requested:
            session = self.session  # read before the check: the engine thread clears it on close
            if not self._closed.done():  # a closed stream's record is final: nothing was cancelled
                self.record.frames_at_cancel = int(session.frames_decoded) if session is not None else 0
            self.cancel_requested = True
        self._finished = True
        self._service._wake.set()
        try:
            self._loop.call_soon_threadsafe(self._ready.set)  # end a pending __anext__
        except RuntimeError:
            pass  # the consumer's loop is closed: nobody is waiting

    async def aclose(self) -> StreamRecord:
        """Cancel if still running and wait until the engine thread has freed the session."""
        self.cancel()
        return await self.wait_closed()

    async def wait_closed(self) -> StreamRecord:
        """Wait until the engine thread has closed this stream's session; return its record."""
        return await asyncio.shield(asyncio.wrap_future(self._closed))

    @property
    def done(self) -> bool:
        """True once the engine thread has closed this stream's session."""
        return self._closed.done()

    @property
    def buffered(self) -> int:
        """Chunks decoded but not yet read (bounded by the service's max_buffered_chunks)."""
        return len(self._items)

    # -- producer side (engine thread) -------------------------------------------------------

    def _post(self, item: Any) -> None:
        frames = getattr(item, "num_frames", None)
        if frames is not None:
            if self._first_post_at is None:
                self._first_post_at = time.monotonic()
            self._audio_posted_s += frames * FRAME_S
        self._items.append(item)
        if isinstance(item, DeferredChunk) and not item.settled:
            # Its reader could not take it yet; its resolve wakes the reader (_deferred_resolved).
            # Waking now too cost a second loop wake-up a chunk (~15 us of the engine thread).
            return
        try:
            self._loop.call_soon_threadsafe(self._ready.set)
        except RuntimeError:
            # The consumer's loop is gone: nobody will read this stream again.
            self.cancel_requested = True

    def _buffered(self) -> int:
        return len(self._items)

    def _audio_arrived(self, frames: int) -> None:
        """Engine thread: a chunk's audio reached the stream (at its post, or at its resolve when
        deferred), before a reader can see it."""
        now = time.monotonic()
        if self.record.first_chunk_at is None:
            self.record.first_chunk_at = now
        chunk = self._arrived
        self._arrived = chunk + 1
        service = self._service
        if chunk == 0:
            self._first_round = service.rounds
        # A streamed-text turn's chunks wait for their text while it comes: their slack would
        # measure the text's arrival, not the engine, and refuse calls for it. Once the text has
        # ended (a server's WebSocket turn given its whole text at once, or the end of an LLM's
        # reply) only the engine stands between the turn and its listener: measured from then.
        if self.streams_text and self.ended_by != "end":
            self._playback.restart()
            return
        slack = self._playback.arrive(now, frames * FRAME_S)
        if slack is not None:
            service._slack.note(slack, now, chunk, self.streams_text, service.rounds - self._first_round)

    def _held_back(self) -> None:
        """Engine thread: the stream skips a round because its reader has not taken its chunks."""
        self._playback.restart()

    def _deferred_resolved(self, chunk: DeferredChunk) -> None:
        """Engine thread: a DeferredChunk posted earlier has its audio now (or was dropped)."""
        if chunk.chunk is not None:
            self._audio_arrived(chunk.num_frames)
        try:
            self._loop.call_soon_threadsafe(self._ready.set)
        except RuntimeError:
            self.cancel_requested = True  # the consumer's loop is gone


class EngineService:
    """Owns one engine and the thread that runs it; serves many streams concurrently.

    Use :func:`get_shared_service` (or :func:`shared_service`) rather than constructing one
    directly, so every adapter in the process shares the loaded engine.

    Args:
        loader: called once on the engine thread to build the engine (so CUDA state and weights
            belong to that thread); its exception becomes the service's load error.
        name: thread name suffix, for debugging.
        max_buffered_chunks: unread chunks per stream before its session is paused.
        max_streams: streams admitted at once (queued, waiting for a slot or live); one more is
            refused with EngineOverloadedError instead of being served late. None: no limit.
        max_round_ms: a new stream is refused (EngineOverloadedError) while the smoothed round
            time exceeds this and streams are live: its chunks could not keep ahead of its
            playback. A round counts at most twice the limit, so one stall does not refuse the
            calls that queued behind it. "auto": MAX_ROUND_MS on a GPU, no limit elsewhere; None:
            no limit.
        min_slack_ms: a new stream is refused (EngineOverloadedError) for SLACK_HOLD_S after a
            chunk's audio reached its stream less than this before its playback time (the first
            chunk's arrival plus the audio before it; engine/slack.py), while streams are live:
            the engine is about to make underruns. Streamed-text turns are measured once their
            text has ended (before, their chunks wait for it). "auto": MIN_SLACK_MS on a GPU, off elsewhere; None: off.
        max_lead_s: under contention (more than CONTENTION_ROWS ready streams), streams this far
            ahead of their playback sit a round out (and far enough to finish their chunk in
            time, LEAD_SAFETY); None: every ready stream runs every round.
        max_opens_per_round: while streams are live, new calls opened in one round at most (the
            rest in the next rounds); None: every call that arrived.
        max_queued_streams: while streams are live, a new stream is refused (EngineOverloadedError)
            when this many admitted streams already wait to be opened (a burst on an idle engine
            opens together, whatever its size). "auto": MAX_QUEUED_STREAMS on a GPU, no limit
            elsewhere; None: no limit.
        overlap_vocoder: a batched round's vocoder calls run on a CUDA stream of their own beside
            the next round's frame, their chunks handed over once that frame is launched
            (engine/deferred_audio.py). None: QWEN_FAST_OVERLAP_VOCODER=0|1 where set, else on for
            an engine on a GPU (the H200's fleet: docs/journal/NOTES.md, "Three round switches").
        prepare_opens: while a batched round's frame runs on the GPU, the engine thread validates
            the next round's new calls and builds their prompts (engine.prepare_session; for
            streamed-text turns whose text is there, prepare_text_session), work it would
            otherwise do between rounds while the GPU waits; their opens then run only the
            states and prefills. None: on unless QWEN_FAST_PREPARE_OPENS=0.
        freeze_heap: freeze the process's heap out of the garbage collector's reach once the engine
            is loaded (a full collection first, before the service is ready) and again once it is
            fully warm (engine/heap.py: a full collection over the loaded model's objects stalled
            every stream for 0.6 s). Process-wide; objects made later are collected as usual, and
            the frozen ones go back to the collector once no service holds the heap frozen (after
            close). None: on for an engine on a GPU.
    """

    def __init__(
        self,
        loader: Callable[[], Any],
        *,
        name: str = "engine",
        max_buffered_chunks: int = DEFAULT_MAX_BUFFERED_CHUNKS,
        owns_engine: bool = True,
        max_streams: int | None = None,
        max_round_ms: float | str | None = "auto",
        min_slack_ms: float | str | None = "auto",
        max_lead_s: float | None = MAX_LEAD_S,
        max_opens_per_round: int | None = MAX_OPENS_PER_ROUND,
        max_queued_streams: int | str | None = "auto",
        overlap_vocoder: bool | None = None,
        prepare_opens: bool | None = None,
        freeze_heap: bool | None = None,
    ) -> None:
        if max_buffered_chunks < 1:
            raise ValueError(f"max_buffered_chunks must be >= 1, got {max_buffered_chunks}")
        if max_opens_per_round is not None and max_opens_per_round < 1:
            raise ValueError(f"max_opens_per_round must be >= 1 or None, got {max_opens_per_round}")
        if max_streams is not None and max_streams < 1:
            raise ValueError(f"max_streams must be >= 1 or None, got {max_streams}")
        self.max_streams = max_streams
        check_admission(max_round_ms=max_round_ms, min_slack_ms=min_slack_ms,
                        max_queued_streams=max_queued_streams)
        self._max_round_ms = max_round_ms
        self._min_slack_ms = min_slack_ms
        self._slack = SlackWatch()  # its limit is set once the engine is loaded ("auto")
        self.max_lead_s = max_lead_s
        self.contention_rows = CONTENTION_ROWS
        self.max_opens_per_round = max_opens_per_round
        self._max_queued_streams = max_queued_streams
        if overlap_vocoder is None and os.environ.get("QWEN_FAST_OVERLAP_VOCODER") in ("0", "1"):
            overlap_vocoder = os.environ["QWEN_FAST_OVERLAP_VOCODER"] == "1"
        self.overlap_vocoder = overlap_vocoder  # None until the engine loads: on for a GPU engine
        if prepare_opens is None:
            prepare_opens = os.environ.get("QWEN_FAST_PREPARE_OPENS", "1") != "0"
        self.prepare_opens = prepare_opens
        self.freeze_heap = freeze_heap
        self._warm_frozen = False  # frozen again once the engine was fully warm
        self.round_ms = 0.0  # smoothed wall time of the rounds that ran frames (engine thread)
        # Their count and summed wall time, for a server's /metrics: a scraper's mean round over
        # an interval is the quotient of the two deltas.
        self.rounds = 0
        self.first_frames_alone = 0  # new streams whose first frame ran by itself before a round
        self.round_seconds = 0.0
        self.round_streams = 0  # sessions stepped, summed over those rounds (streams a round: the quotient)
        # Streams handed in and not yet ended: counted here rather than from the lists, which a
        # stream leaves while the engine thread opens it.
        self._admitted = 0
        self._refusals: collections.Counter[str] = collections.Counter()
        self._loader = loader
        self._owns_engine = owns_engine
        self._max_buffered = max_buffered_chunks
        self._engine: Any = None
        self._ready = concurrent.futures.Future[Any]()
        self._ready.set_running_or_notify_cancel()  # awaiting callers must not cancel the load
        self._lock = threading.Lock()
        self._inbox: list[SynthesisStream] = []
        self._active: list[SynthesisStream] = []
        self._waiting: list[SynthesisStream] = []  # opened when a KV slot frees up
        self._wake = threading.Event()
        self._closing = False
        self._dead: BaseException | None = None
        self._ids = itertools.count(1)
        self._opened = 0
        self._tick = 0
        self.history: collections.deque[StreamRecord] = collections.deque(maxlen=HISTORY_SIZE)
        self.round_timings: collections.deque[Any] = collections.deque(maxlen=ROUND_TIMINGS_KEPT)
        self._round_timing = False
        self._round_timer: Any = None
        self._on_exit: Callable[[EngineService], None] | None = None
        self._thread = threading.Thread(target=self._run, name=f"qwen-fast-{name}", daemon=True)
        _live_services.add(self)
        self._thread.start()

    @classmethod
    def for_engine(cls, engine: Any, **kwargs: Any) -> EngineService:
        """Serve an engine that is already loaded (it must not be used by other threads).

        The caller keeps ownership: closing the service does not close the engine.
        """
        return cls(lambda: engine, owns_engine=False, **kwargs)

    # -- lifecycle ---------------------------------------------------------------------------

    async def wait_ready(self) -> EngineService:
        """Wait for the engine to load; raise its load error (e.g. ModelLoadError) if it failed."""
        await asyncio.shield(asyncio.wrap_future(self._ready))
        return self

    def wait_ready_blocking(self, timeout: float | None = None) -> EngineService:
        self._ready.result(timeout)
        return self

    @property
    def ready(self) -> bool:
        return self._ready.done() and self._ready.exception() is None

    @property
    def alive(self) -> bool:
        """False once closed, dead after a fatal fault, or failed to load."""
        if self._closing or self._dead is not None:
            return False
        return not (self._ready.done() and self._ready.exception() is not None)

    @property
    def engine(self) -> Any:
        """The loaded engine. Only the service thread may call its methods."""
        return self._ready.result(0) if self._ready.done() else None

    @property
    def sample_rate(self) -> int:
        return int(self._require_engine().sample_rate)

    @property
    def voices(self) -> list[str]:
        return list(self._require_engine().voices)

    @property
    def languages(self) -> list[str]:
        return list(self._require_engine().languages)

    @property
    def model_type(self) -> str:
        return str(self._require_engine().model_type)

    @property
    def streams_opened(self) -> int:
        """Streams opened so far; stream ids are 1, 2, ... in opening order."""
        return self._opened

    def records_since(self, stream_id: int) -> list[StreamRecord]:
        """Finished streams (in the bounded history) whose id is above ``stream_id``, by id."""
        return sorted(
            (r for r in list(self.history) if r.stream_id > stream_id), key=lambda r: r.stream_id
        )

    @property
    def steps_run(self) -> int:
        """Frames decoded by this service across all streams (one engine.step each)."""
        return self._tick

    def time_rounds(self, on: bool = True) -> None:
        """Record every round's time split (engine.round_timing.RoundTiming) into ``round_timings``,
        from the engine thread's next round; off by default. While on, each prefill, decode and
        vocoder call is bracketed by device synchronizations (see engine/round_timing.py)."""
        self._round_timing = on
        self._wake.set()

    def close(self, timeout: float | None = 30.0) -> None:
        """Stop accepting work, end every open stream with EngineClosedError, join the thread."""
        self._closing = True
        self._wake.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    async def aclose(self, timeout: float | None = 30.0) -> None:
        """Like close(), without blocking the event loop while the thread finishes its frame."""
        self._closing = True
        self._wake.set()
        await asyncio.to_thread(self._thread.join, timeout)

    async def __aenter__(self) -> Self:
        return await self.wait_ready()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- requests ----------------------------------------------------------------------------

    def open_text_stream(self, request: Any, *, idle_timeout_s: float | None = DEFAULT_IDLE_TIMEOUT_S) -> Any:
        """Open a turn whose text arrives while it is spoken (engine/text_service.py): returns a
        TextStream (`append`, `end`, async iteration of AudioChunks, `cancel`). Needs the engine
        loaded. A turn that gets no text for `idle_timeout_s` is ended (None: never)."""
        # Imported here: text_service builds its TextStream on this module's SynthesisStream.
        from pipecat_qwen_fast.engine.text_service import open_text_stream

        return open_text_stream(self, request, idle_timeout_s)

    def check_request(self, request: Any) -> None:
        """Raise the InvalidInputError that opening `request` would give for its options (its text
        aside), opening nothing. Needs the engine loaded; any thread may call it, and it may read a
        file (a Base model's voice named by path), so keep it off an event loop."""
        self._require_engine().check_request(request)

    def open_stream(self, request: Any) -> SynthesisStream:
        """Queue a request; return the stream its chunks arrive on. Needs a running loop.

        Validation and prefill run on the engine thread, so an invalid request surfaces as an
        exception from the first iteration (InvalidInputError etc. from the engine).
        """
        self._opened = stream_id = next(self._ids)
        return self._admit(SynthesisStream(self, request, stream_id))

    def _on_gpu(self, setting: Any, gpu_value: Any) -> Any:
        """A setting as given, or for "auto" `gpu_value` on an engine on a GPU and None elsewhere
        (and before the engine is loaded)."""
        if setting != "auto":
            return setting
        device = getattr(self._engine, "device", None)
        return gpu_value if getattr(device, "type", None) == "cuda" else None

    @property
    def max_round_ms(self) -> float | None:
        """The round time over which new streams are refused (None: none; "auto": MAX_ROUND_MS
        on a GPU)."""
        return self._on_gpu(self._max_round_ms, MAX_ROUND_MS)

    @property
    def max_queued_streams(self) -> int | None:
        """Admitted streams that may wait to be opened while streams are live (None: no limit;
        "auto": MAX_QUEUED_STREAMS on a GPU)."""
        return self._on_gpu(self._max_queued_streams, MAX_QUEUED_STREAMS)

    @property
    def queued_streams(self) -> int:
        """Admitted streams not yet live: waiting to open, being opened, or waiting for a slot."""
        return max(0, self._admitted - len(self._active))

    @property
    def min_slack_ms(self) -> float | None:
        """The slack under which a chunk refuses new streams for a while (None: none; "auto":
        MIN_SLACK_MS on a GPU)."""
        return self._on_gpu(self._min_slack_ms, MIN_SLACK_MS)

    @property
    def low_slack_chunks(self) -> int:
        """Chunks whose audio reached their stream less than `min_slack_ms` before its playback."""
        return self._slack.low_chunks

    def low_slack_events(self, since: float = float("-inf")) -> list[tuple[float, float, int, bool]]:
        """The latest chunks under `min_slack_ms` that arrived from `since` (time.monotonic()) on:
        (arrival, slack in seconds, chunks its stream had before it, whether a streamed-text turn)."""
        return self._slack.low_events_since(since)

    def early_chunk_events(self, since: float = float("-inf")) -> list[tuple[float, float, int, bool, int]]:
        """Every stream's second and third chunks that arrived from `since` (time.monotonic()) on,
        whatever their slack: (arrival, slack in seconds, chunks its stream had before it, whether
        a streamed-text turn, the service's rounds since its stream's first chunk arrived)."""
        return self._slack.early_events_since(since)

    @property
    def lowest_slack_ms(self) -> float | None:
        """The lowest slack of the chunks of the last 1-2 s (engine/slack.py; negative: late);
        None when no chunk was measured then."""
        return self._slack.lowest_ms(time.monotonic())

    @property
    def admitted_streams(self) -> int:
        """Streams queued, being opened, waiting for a slot, or live."""
        return self._admitted

    @property
    def thread_cpu(self) -> dict[str, float]:
        """CPU seconds the engine thread has used ({"engine": s}; empty where the platform cannot
        tell a thread's): beside the wall time of its rounds, how much of them is Python and
        launches rather than waiting for the GPU or for the GIL."""
        return thread_cpu_seconds({"engine": self._thread})

    def _admit(self, stream: SynthesisStream) -> SynthesisStream:
        """Hand a new stream to the engine thread, or refuse it: the service is closed, it
        already serves `max_streams`, its rounds are too slow, too many calls wait to start, or
        a chunk came too close to its playback a moment ago."""
        with self._lock:
            if not self.alive:
                raise self._closed_error()
            refusal = self._refusal()
            if refusal is not None:
                reason, why = refusal
                self._refusals[reason] += 1
                raise EngineOverloadedError(f"{why} ({reason}); retry shortly", reason=reason)
            self._inbox.append(stream)
            self._admitted += 1
        self._wake.set()
        return stream

    def _refusal(self) -> tuple[str, str] | None:
        """Under the lock: why a new stream is refused now (the setting's name, the reason in
        words), or None."""
        if self.max_streams is not None and self.admitted_streams >= self.max_streams:
            return "max_streams", f"the TTS engine is serving its limit of {self.max_streams} streams"
        if not self._active:
            return None
        limit = self.max_round_ms
        if limit is not None and self.round_ms > limit:
            return "max_round_ms", (f"the TTS engine is at capacity: its rounds take {self.round_ms:.1f} ms, "
                                    f"over the {limit:g} ms that keeps every stream ahead of its playback")
        most = self.max_queued_streams
        if most is not None and self.queued_streams >= most:
            return "max_queued_streams", (f"the TTS engine is at capacity: {self.queued_streams} calls already "
                                          f"wait to start, its limit of {most}")
        if self._slack.holding(time.monotonic()):
            return "min_slack_ms", (f"the TTS engine is at capacity: a stream's audio came "
                                    f"{describe_slack(self._slack.last_low_s)}, less than the "
                                    f"{self.min_slack_ms:g} ms ahead that keeps streams from running out")
        return None

    @property
    def refusals(self) -> dict[str, int]:
        """New streams refused so far, by the setting that refused them (EngineOverloadedError.reason)."""
        with self._lock:
            return dict(self._refusals)

    async def stream(self, request: Any) -> AsyncIterator[Any]:
        """Yield the request's AudioChunks; leaving the loop early cancels the session."""
        await self.wait_ready()
        stream = self.open_stream(request)
        try:
            async for chunk in stream:
                yield chunk
        finally:
            stream.cancel()

    async def synthesize(self, request: Any) -> np.ndarray:
        """Whole-utterance int16 PCM at ``sample_rate`` (concatenated stream chunks)."""
        parts = [chunk.pcm async for chunk in self.stream(request)]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int16)

    def _closed_error(self) -> EngineClosedError:
        if self._dead is not None:
            err = EngineClosedError(
                f"the TTS engine stopped after a fatal fault ({type(self._dead).__name__}: "
                f"{self._dead}); a new service must be created"
            )
            err.__cause__ = self._dead
            return err
        if self._ready.done() and (load_error := self._ready.exception()) is not None:
            err = EngineClosedError(f"the TTS engine failed to load: {load_error}")
            err.__cause__ = load_error
            return err
        return EngineClosedError("the TTS engine service is closed")

    def _require_engine(self) -> Any:
        if not self._ready.done():
            raise EngineClosedError("the TTS engine is still loading; await wait_ready() first")
        return self._ready.result()

    # -- engine thread -----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            engine = self._loader()
        except BaseException as exc:  # noqa: BLE001 - any load failure is the caller's error
            self._ready.set_exception(exc)
            self._finish_thread(None)
            return
        self._engine = engine
        start_stack_samples()  # only where QWEN_FAST_STACK_SAMPLES asks (engine/stack_samples.py)
        slack_ms = self.min_slack_ms
        self._slack.limit_s = None if slack_ms is None else slack_ms / 1e3
        # The first batched prefill in a new thread cost ~45 ms more (docs/journal/NOTES.md; likely GPU
        # library state made per thread, such as cuBLAS handles): pay it here, not in a burst's TTFC.
        prepare = getattr(engine, "prepare_thread", None)
        if prepare is not None:
            try:
                prepare()
            except Exception as exc:  # noqa: BLE001 - only a warm-up: the work itself will say what fails
                logger.warning("engine thread warm-up failed: %s: %s", type(exc).__name__, exc)
        on_gpu = getattr(getattr(engine, "device", None), "type", None) == "cuda"
        if self.freeze_heap is None:
            self.freeze_heap = on_gpu
        if self.freeze_heap:
            self._freeze("loaded", collect=True)  # nobody waits on this engine yet
        if self.overlap_vocoder is None:
            self.overlap_vocoder = on_gpu
        # Only engines that defer audio know the switch (a stand-in engine, say, does not).
        defers = self.overlap_vocoder and hasattr(engine, "defer_vocoder_audio")
        if defers:
            engine.defer_vocoder_audio = True
        self._ready.set_result(engine)
        fault: BaseException | None = None
        try:
            self._serve()
        except BaseException as exc:  # noqa: BLE001 - reported to every waiting caller below
            fault = exc
            self._dead = exc
            logger.error("engine thread died: %s: %s", type(exc).__name__, exc)
        finally:
            if defers:
                try:
                    if fault is None:
                        self._resolve_audio()
                finally:
                    engine.defer_vocoder_audio = False
                    engine.vocoder_side.drop()  # after a fault: what is left will not complete
            self._finish_thread(fault)

    def _serve(self) -> None:
        while True:
            self._wake.clear()
            with self._lock:
                new, self._inbox = self._inbox, []
                closing = self._closing
            if closing:
                self._resolve_audio()
                for stream in new:
                    self._end(stream, EngineClosedError("the TTS engine service is closed"))
                return
            # Switched here, after the inbox is taken: a stream opened after time_rounds() returns is timed.
            if self._round_timing != (self._round_timer is not None):
                self._switch_round_timer()
            timer = self._round_timer
            if timer is not None:
                timer.begin()
            waiting, self._waiting = self._waiting, []
            started = time.perf_counter()  # a round's time includes opening the new streams
            opens = self._take_opens(waiting + new)
            alone: list[SynthesisStream] = []
            if opens:
                # Audio deferred from the last round that is already made goes out before the
                # opens delay this round's frame (and with it the rest of that audio).
                self._resolve_audio(finished_only=True)
                alone = self._first_frames_alone(self._open(opens))
                self._resolve_audio(finished_only=True)
            self._begin_text_turns()
            ready = []
            for stream in list(self._active):
                if stream in alone:
                    continue  # its frame of this round is made
                if stream.cancel_requested or stream._loop.is_closed():
                    # A closed loop: no consumer will read or close this stream again.
                    stream.cancel_requested = True
                    self._finish(stream, None, reason="cancelled")
                elif stream._buffered() >= self._max_buffered:
                    stream._held_back()
                elif stream.can_step():
                    ready.append(stream)
            if len(ready) > self.contention_rows and self.max_lead_s is not None:
                now = time.monotonic()
                round_s = self.round_ms / 1e3
                due = [stream for stream in ready if not stream.may_sit_out(now, self.max_lead_s, round_s)]
                ready = due or ready  # nobody due: all run, the GPU never idles
            if ready or alone:
                # One frame for every ready session; the engine batches them where it can. A round
                # whose only frames ran alone is a round too: those streams go on at once, not
                # when something next wakes an idle engine.
                try:
                    meanwhile = self._prepare_opens if self.prepare_opens else None
                    results = (self._engine.step_many([stream.session for stream in ready], meanwhile=meanwhile)
                               if ready else [])
                except Exception as exc:
                    if _is_fatal(exc):
                        raise
                    # Not a device fault (an out-of-memory error, say): it ends the requests it
                    # touched; the engine and the other requests go on.
                    logger.warning("a batched step failed: %s: %s", type(exc).__name__, exc)
                    results = [exc] * len(ready)
                for stream, result in zip(ready, results):
                    self._after_step(stream, result)
                ms = (time.perf_counter() - started) * 1e3
                self.round_ms = smoothed_round_ms(self.round_ms, ms, self.max_round_ms)
                self.rounds += 1
                self.round_seconds += ms / 1e3
                self.round_streams += len(ready) + len(alone)
                if timer is not None:
                    timer.end(len(ready) + len(alone))
            elif self._waiting and not self._active:
                raise RuntimeError("a stream waits for a KV slot but no session holds one")
            else:
                if timer is not None:
                    timer.end(0)
                # No round follows at once: chunks still waiting for their vocoder calls go out now.
                self._resolve_audio()
                # Idle: a step of the deferred warm-up (each well under a second), then look again.
                if not self._engine.warm_step():
                    if self.freeze_heap and not self._warm_frozen:
                        # The background warm-up's graphs and compiled code are long-lived too.
                        self._warm_frozen = True
                        self._freeze("fully warm", collect=False)
                    self._wake.wait(self._idle_timeout())

    def _begin_text_turns(self) -> None:
        """Streamed-text turns whose first words are final begin together, one batched prefill
        (a server's turns are all streamed; opened one by one, each would otherwise prefill alone
        when first polled)."""
        turns = [st for st in self._active
                 if st.streams_text and not st.cancel_requested and not st.feed.begun]
        begin = getattr(self._engine, "begin_text_sessions", None)
        if len(turns) < 2 or begin is None:
            return
        for stream, error in zip(turns, begin([st.session for st in turns])):
            if error is not None:
                if _is_fatal(error):
                    raise error
                self._finish(stream, error)

    def _freeze(self, when: str, *, collect: bool) -> None:
        frozen = freeze_heap(collect=collect, holder=id(self))
        logger.info("engine %s: %d objects frozen out of the garbage collector's reach", when, frozen)

    def _resolve_audio(self, finished_only: bool = False) -> None:
        if self._engine is not None and getattr(self._engine, "defer_vocoder_audio", False):
            self._engine.resolve_deferred_audio(finished_only)

    def _end_cancelled(self, streams: list[SynthesisStream]) -> list[SynthesisStream]:
        """Ends the streams cancelled before they opened (they hold nothing yet); the rest."""
        rest = []
        for stream in streams:
            if stream.cancel_requested:
                self._end(stream, None, reason="cancelled")
            else:
                rest.append(stream)
        return rest

    def _take_opens(self, streams: list[SynthesisStream]) -> list[SynthesisStream]:
        """The streams to open this round: all of them on an idle engine (a burst opens together,
        one batched prefill), at most `max_opens_per_round` while streams are live; the rest go
        back to the front of the inbox, for the next rounds. A call cancelled while it waited ends
        now, wherever it stands in line: its caller's aclose() (a barge-in) waits for no opens."""
        streams = self._end_cancelled(streams)
        most = self.max_opens_per_round
        if most is None or not self._active or len(streams) <= most:
            return streams
        now, later = streams[:most], streams[most:]
        with self._lock:
            self._inbox = later + self._inbox
        self._wake.set()
        return now

    def _prepare_opens(self) -> None:
        """The next round's opens (the first `max_opens_per_round` of those waiting, as
        `_take_opens` will take them), validated and their prompts built now, on the engine thread
        while a batched frame runs; a request's input error is kept for its open to report. A
        streamed-text turn's first prompt is built too where its text is there. (A live turn
        whose text comes later begins at the next round's start, before any frame runs.)"""
        prepare = getattr(self._engine, "prepare_session", None)
        if prepare is None:
            return
        with self._lock:
            queued = self._waiting + self._inbox
        most = self.max_opens_per_round
        for stream in queued if most is None else queued[:most]:
            if stream.prepared is not None or stream.cancel_requested:
                continue
            try:
                if stream.streams_text:
                    stream.prepare(self._engine)
                else:
                    stream.prepared = prepare(stream.request)
            except Exception as e:  # noqa: BLE001 - reported to that stream's caller when it opens
                if _is_fatal(e):
                    raise
                stream.prepared = e

    def _idle_timeout(self) -> float | None:
        deadlines = [d for stream in self._active if (d := stream.wake_deadline()) is not None]
        timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
        if any(stream._buffered() >= self._max_buffered for stream in self._active):
            timeout = PAUSED_POLL_S if timeout is None else min(timeout, PAUSED_POLL_S)
        return timeout

    def _switch_round_timer(self) -> None:
        if self._round_timer is not None:
            self._round_timer.remove()
            self._round_timer = None
        else:
            from pipecat_qwen_fast.engine.round_timing import RoundTimer

            self._round_timer = RoundTimer(self._engine, self.round_timings)

    def _open_sessions(self, streams: list[SynthesisStream]) -> list[Any]:
        """Sessions for a round's new streams, in order: whole texts opened together (one batched
        prefill), each streamed-text turn on its own."""
        out: list[Any] = [None] * len(streams)
        whole = [i for i, st in enumerate(streams) if not st.streams_text]
        if whole:
            prepared = [streams[i].prepared for i in whole]
            for i in whole:
                streams[i].prepared = None  # used once: a call sent back to wait prepares again
            requests = [streams[i].request for i in whole]
            for i, opened in zip(whole, self._engine.open_sessions(requests, prepared=prepared)):
                out[i] = opened
        for i, st in enumerate(streams):
            if st.streams_text:
                try:
                    out[i] = st.open_session(self._engine)
                except Exception as e:  # noqa: BLE001 - reported to that stream's caller
                    out[i] = e
        return out

    def _first_frames_alone(self, opened: list[SynthesisStream]) -> list[SynthesisStream]:
        """The new streams whose first frame the engine makes alone (`QwenTTSEngine.starts_alone`:
        the auto backend's megakernel while the batch is small), stepped now, each by itself, so
        that their first chunks go out before the round's batched frame; returns them."""
        starts_alone = getattr(self._engine, "starts_alone", None)
        if starts_alone is None:
            return []
        alone = [stream for stream in opened if starts_alone(stream.session)]
        for stream in alone:
            try:
                result = self._engine.step_many([stream.session])[0]
            except Exception as exc:
                if _is_fatal(exc):
                    raise
                result = exc
            self._after_step(stream, result)
        self.first_frames_alone += len(alone)
        return alone

    def _open(self, streams: list[SynthesisStream]) -> list[SynthesisStream]:
        """Open every stream that arrived since the last round together: one batched prefill.
        Returns those opened."""
        live = self._end_cancelled(streams)  # cancelled since _take_opens: nothing to open
        if not live:
            return []
        # All of them one burst for the backend's placement (`QwenTTSEngine.placing`): a streamed
        # turn opened beside three others is not a call joining the batch alone.
        placing = getattr(self._engine, "placing", None)
        try:
            with placing(len(live)) if placing is not None else contextlib.nullcontext():
                results = self._open_sessions(live)
        except Exception as exc:  # the engine refused them all (closed, say)
            if _is_fatal(exc):
                raise
            results = [exc] * len(live)
        opened_now = []
        for stream, opened in zip(live, results):
            if isinstance(opened, NoFreeSlotError):
                # Every KV slot is taken: wait for a running session to finish.
                self._waiting.append(stream)
            elif isinstance(opened, Exception):
                if _is_fatal(opened):
                    raise opened
                self._end(stream, opened)
            else:
                stream.session = opened
                stream.record.opened = True
                self._active.append(stream)
                opened_now.append(stream)
        return opened_now

    def _after_step(self, stream: SynthesisStream, result: list[AudioChunk] | Exception) -> None:
        session = stream.session
        if isinstance(result, Exception):
            if _is_fatal(result):
                raise result
            self._finish(stream, result)
            return
        chunks = result
        self._tick += 1
        record = stream.record
        record.ticks.append(self._tick)
        record.frames_decoded = int(session.frames_decoded)
        for chunk in chunks:
            if isinstance(chunk, DeferredChunk) and chunk.chunk is None:
                chunk.on_resolved = stream._deferred_resolved  # its audio comes in a later round
            else:
                stream._audio_arrived(chunk.num_frames)
            stream._post(chunk)
        if session.done:
            self._finish(stream, None, reason=session.stop_reason)

    def _finish(
        self, stream: SynthesisStream, error: BaseException | None, *, reason: Any = None
    ) -> None:
        self._active.remove(stream)
        session = stream.session
        if session is not None:
            stream.record.frames_decoded = int(session.frames_decoded)
            if reason is None:
                reason = session.stop_reason
            try:
                self._engine.close_session(session)
            except Exception as exc:
                if _is_fatal(exc):
                    raise
                logger.warning("close_session failed: %s: %s", type(exc).__name__, exc)
        self._end(stream, error, reason=reason)

    def _end(
        self, stream: SynthesisStream, error: BaseException | None, *, reason: Any = None
    ) -> None:
        record = stream.record
        record.stop_reason = "cancelled" if stream.cancel_requested else reason
        if error is not None and record.stop_reason is None:
            record.stop_reason = "error"
        record.error = error
        record.closed = True
        stream.session = None
        self.history.append(record)
        with self._lock:
            self._admitted -= 1
        # Closed before the end marker is visible, so a consumer that sees the end never races
        # the thread into recording a cancellation.
        stream._closed.set_result(record)
        stream._post(_End(error))

    def _finish_thread(self, fault: BaseException | None) -> None:
        with self._lock:
            self._closing = True
            pending, self._inbox = self._inbox, []
        error = self._closed_error()
        waiting, self._waiting = self._waiting, []
        for stream in self._active + waiting + pending:
            # After a fault too: an engine served for its owner (for_engine) may be used again, and
            # must not keep dead sessions' K/V states. Releasing a state frees memory and launches
            # nothing, so even a poisoned device allows it; a failure is only logged.
            if stream.session is not None:
                try:
                    self._engine.close_session(stream.session)
                except Exception as exc:  # noqa: BLE001 - shutting down anyway
                    logger.warning("close_session failed: %s: %s", type(exc).__name__, exc)
            self._end(stream, error)
        self._active = []
        if self._round_timer is not None:  # an engine served for its owner goes back unwrapped
            self._round_timer.remove()
            self._round_timer = None
        if self._owns_engine and self._engine is not None and fault is None:
            try:
                self._engine.close()
            except Exception as exc:  # noqa: BLE001 - shutting down anyway
                logger.warning("engine close failed: %s: %s", type(exc).__name__, exc)
        self._engine = None
        release_heap(id(self))
        if self._on_exit is not None:
            self._on_exit(self)


def _is_finite_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_fatal(exc: BaseException) -> bool:
    """Faults that poison the device for every session (sticky CUDA errors), not just one."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency
        return False
    accelerator_error = getattr(torch, "AcceleratorError", None)
    return accelerator_error is not None and isinstance(exc, accelerator_error)



# -- process-wide registry ----------------------------------------------------------------------

_registry: dict[tuple[str, str, str, str], EngineService] = {}
_registry_lock = threading.Lock()


def registry_key(
    model: str | os.PathLike[str], device: str, dtype: str, backend: str
) -> tuple[str, str, str, str]:
    """Local folders are keyed by their real path, so './m' and '/abs/m' share one engine."""
    name = os.fspath(model)
    expanded = os.path.expanduser(name)
    if os.path.exists(expanded):
        name = os.path.realpath(expanded)
    return (name, str(device), str(dtype), str(backend))


def shared_service(
    model: str | os.PathLike[str],
    *,
    device: str = "auto",
    dtype: str = "auto",
    backend: str = "auto",
) -> EngineService:
    """Return the process-wide service for this model, starting its load if needed.

    Does not block: loading runs on the service's own thread. Await ``wait_ready()`` (or use
    :func:`get_shared_service`) before reading ``sample_rate``/``voices``. A service that failed
    to load, died or was closed is replaced on the next call.
    """
    key = registry_key(model, device, dtype, backend)
    with _registry_lock:
        service = _registry.get(key)
        if service is not None and service.alive:
            return service

        def load() -> Any:
            from pipecat_qwen_fast.engine.engine import QwenTTSEngine

            return QwenTTSEngine.from_pretrained(
                key[0], device=device, dtype=dtype, backend=backend
            )

        service = EngineService(load, name=os.path.basename(key[0].rstrip("/")) or "engine")
        service._on_exit = _forget
        _registry[key] = service
        return service


async def get_shared_service(
    model: str | os.PathLike[str],
    *,
    device: str = "auto",
    dtype: str = "auto",
    backend: str = "auto",
) -> EngineService:
    """Shared service for this model, loaded (raises the load error, e.g. ModelLoadError)."""
    service = shared_service(model, device=device, dtype=dtype, backend=backend)
    return await service.wait_ready()


def _forget(service: EngineService) -> None:
    with _registry_lock:
        for key, value in list(_registry.items()):
            if value is service:
                del _registry[key]


async def close_shared_services() -> None:
    """Close every shared service (tests, process shutdown)."""
    with _registry_lock:
        services = list(_registry.values())
        _registry.clear()
    for service in services:
        await service.aclose()


class ServiceHandle:
    """The EngineService an adapter synthesizes with.

    Either the caller's own service (kept as given), or the process-wide shared one for the model
    and the handle's device, dtype and backend, looked up again when it has died or the model
    changed. Both the Pipecat service and the LiveKit plugin hold one.
    """

    def __init__(self, engine_service: EngineService | None, *, device: str, dtype: str, backend: str):
        self.explicit = engine_service
        self.service: EngineService | None = engine_service
        self.device, self.dtype, self.backend = device, dtype, backend

    def acquire(self, model: str | os.PathLike[str]) -> EngineService:
        """The service to use now; starts loading `model` (without waiting) if needed."""
        if self.service is None or (self.explicit is None and not self.service.alive):
            self.service = shared_service(model, device=self.device, dtype=self.dtype, backend=self.backend)
        return self.service

    def model_changed(self) -> bool:
        """Forget the shared service so the next acquire loads the new model. False when the
        caller's own service is in use: it cannot switch models (the adapter warns)."""
        if self.explicit is not None:
            return False
        self.service = None
        return True
