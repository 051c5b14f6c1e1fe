"""The fleet benchmark's callers, and the endpoint they speak through.

An `Endpoint` turns one reply into a stream of audio: it yields each chunk's sample count as the
chunk reaches the caller, and raises the engine's overload error (`EngineOverloadedError`) when
the request is refused. The callers (closed loop: each speaks, plays, listens, speaks again; open
loop: Poisson arrivals) only see that, so the same workload can drive the engine in this process
(`InProcessEndpoint`) or a server over its WebSocket protocol.

Against a server of another process the callers of a level can be split over several OS processes
(`CallerProcesses`), each with its own event loop and client, as a fleet of agent processes is:
each runs its share of the same schedule from the same instant and sends back its utterances.
"""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing
import multiprocessing.connection
import random
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

import aiohttp

from pipecat_qwen_fast import errors
from pipecat_qwen_fast.bench.fleet_workload import (
    COMPLETE,
    CUT,
    ERROR,
    REFUSED,
    Reply,
    Utterance,
    fleet_replies,
    lag_summary,
    parse_metrics,
    playback_end,
    poisson_arrivals,
)
from pipecat_qwen_fast.engine.request import SynthesisRequest


class Endpoint(Protocol):
    def speak(self, reply: Reply, seed: int) -> AsyncIterator[int]:
        """Yield the sample count of each audio chunk of `reply` as it arrives."""
        ...

    async def settle(self) -> None:
        """Return once every stream this endpoint opened has released its engine resources."""
        ...

    def take_rounds(self) -> list | None:
        """The engine's round timings recorded since the last call (None: not visible here)."""
        ...


def is_overload(exc: BaseException) -> bool:
    # Looked up at call time: the overload error is being added to the engine alongside this benchmark.
    overloaded = getattr(errors, "EngineOverloadedError", None)
    return overloaded is not None and isinstance(exc, overloaded)


class InProcessEndpoint:
    """The engine in this process, through its EngineService (as the Pipecat and LiveKit adapters use it).
    `streamed`: each reply is a streamed-text turn given its whole text and ended at once, the
    engine path of a server's dual-track WebSocket turn, so that a comparison with the server
    can tell the server's own cost from that path's. `schedule`: the requests' chunk schedule
    fields (chunk_frames, chunk_growth) where not the defaults, for an A/B of the schedule."""

    def __init__(self, service: Any, voice: str | None, text_mode: str | None = None,
                 streamed: bool = False, schedule: dict | None = None) -> None:
        self.service = service
        self.voice = voice
        self.text_mode = text_mode
        self.streamed = streamed
        self.schedule = schedule or {}
        self._streams: list[Any] = []

    def open(self, request: SynthesisRequest) -> Any:
        if not self.streamed:
            return self.service.open_stream(request)
        stream = self.service.open_text_stream(dataclasses.replace(request, text=""))
        stream.append(request.text)
        stream.end()
        return stream

    async def speak(self, reply: Reply, seed: int) -> AsyncIterator[int]:
        stream = self.open(SynthesisRequest(reply.text, voice=self.voice, seed=seed, max_frames=reply.frames,
                                            text_mode=self.text_mode, **self.schedule))
        try:
            async for chunk in stream:
                yield len(chunk.pcm)
        finally:
            stream.cancel()
            # Kept for settle() only while the engine has yet to close it: a finished engine
            # stream holds ~20 objects for the collector (CPU count), and in process the level's
            # thousands of them fed the full collections that held the engine thread (one of
            # 77.7 ms at 768 H200 callers, whose worst late chunk was 81.5 ms).
            # Only the streams cut at the level's end are still open here.
            if not getattr(stream, "done", False):
                self._streams.append(stream)

    async def settle(self) -> None:
        streams, self._streams = self._streams, []
        for stream in streams:
            await stream.wait_closed()

    def take_rounds(self) -> list | None:
        sink = self.service.round_timings
        rounds = []
        while sink:
            rounds.append(sink.popleft())
        return rounds


class ServerEndpoint(InProcessEndpoint):
    """A server over its WebSocket protocol (`qwen-fast-tts serve`, or Ray Serve's proxy), through
    the remote adapters' client: a socket per utterance, closed by a cancel. `service`, where the
    server runs on an engine of this process, lends its round timings and its stream count.
    `metrics` False: its /metrics are not read (behind a proxy over several replicas each read
    reaches one of them, so a level's before and after need not be the same server's)."""

    def __init__(self, base_url: str, voice: str | None, text_mode: str | None = None,
                 service: Any = None, metrics: bool = True) -> None:
        from pipecat_qwen_fast.remote import RemoteTTSClient

        super().__init__(service, voice, text_mode)
        self.client = RemoteTTSClient(base_url)
        self.metrics = metrics

    def open(self, request: SynthesisRequest) -> Any:
        return self.client.open_stream(request)

    async def settle(self) -> None:
        await super().settle()
        if self.service is not None:  # the server's engine streams end a moment after their sockets
            for _ in range(200):
                if self.service.admitted_streams == 0:
                    break
                await asyncio.sleep(0.05)

    def take_rounds(self) -> list | None:
        return super().take_rounds() if self.service is not None else None

    async def read_metrics(self) -> dict[str, float] | None:
        """The server's /metrics samples now (series as written: name and labels), or None where
        it does not answer them."""
        from pipecat_qwen_fast.remote import http_url

        if not self.metrics:
            return None
        try:
            async with self.client.http().get(http_url(self.client.base_url, "/metrics"),
                                              headers=self.client._headers) as response:
                if response.status != 200:
                    return None
                return parse_metrics(await response.text())
        except aiohttp.ClientError:
            return None

    async def aclose(self) -> None:
        await self.client.aclose()


class LevelClock:
    def __init__(self, t0: float | None = None) -> None:
        self.t0 = time.monotonic() if t0 is None else t0

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def sleep_until(self, t: float) -> None:
        delay = t - self.now()
        if delay > 0:
            await asyncio.sleep(delay)


async def hear(endpoint: Endpoint, reply: Reply, seed: int, u: Utterance, clock: LevelClock) -> None:
    """Speak `reply` and record what the caller hears into `u`."""
    chunks = endpoint.speak(reply, seed)
    try:
        async for samples in chunks:
            u.arrivals.append(clock.now())
            u.samples.append(samples)
        u.outcome = COMPLETE
    except asyncio.CancelledError:
        u.outcome = CUT
        raise
    except Exception as exc:  # noqa: BLE001 - every failure is counted in the level's figures
        u.outcome = REFUSED if is_overload(exc) else ERROR
        if u.outcome == ERROR:
            u.error = f"{type(exc).__name__}: {exc}"[:200]
    finally:
        u.ended = clock.now()
        await chunks.aclose()


async def _run(tasks: list[asyncio.Task], clock: LevelClock, until: float, endpoint: Endpoint) -> float:
    """Wait for the callers until `until`, cut whatever still runs; returns the level's wall time."""
    if tasks:
        await asyncio.wait(tasks, timeout=max(0.0, until - clock.now()))
    wall = clock.now()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await endpoint.settle()
    return wall


async def closed_loop(endpoint: Endpoint, replies: list[Reply], *, callers: int, duration: float, stagger: float,
                      listen: tuple[float, float], drain: float, seed: int, share: tuple[int, int] = (0, 1),
                      start: float | None = None) -> tuple[list[Utterance], float]:
    """`callers` callers, the first utterance of each at a random time in [0, stagger); each plays
    its reply at real time, listens for a random time in `listen`, speaks again, until `duration`.
    A refused caller listens and tries again. Utterances still running `drain` seconds after
    `duration` are cut. Returns the utterances and the level's wall time.

    `share` (part, parts): only callers i with i % parts == part, on the schedule they have among
    all `callers`; `start`: the level's clock starts then (time.monotonic(); default now)."""
    clock = LevelClock(start)
    utterances: list[Utterance] = []

    async def caller(i: int) -> None:
        rng = random.Random(f"fleet:{seed}:{callers}:{i}")
        t = rng.uniform(0.0, stagger)
        while t < duration:
            await clock.sleep_until(t)
            reply = rng.choice(replies)
            u = Utterance(caller=i, frames=reply.frames, submitted=t)
            utterances.append(u)
            await hear(endpoint, reply, rng.randrange(2**31), u, clock)
            heard_until = playback_end(u.arrivals, u.durations) if u.outcome == COMPLETE else clock.now()
            t = max(heard_until, clock.now()) + rng.uniform(*listen)

    tasks = [asyncio.create_task(caller(i)) for i in range(share[0], callers, share[1])]
    wall = await _run(tasks, clock, duration + drain, endpoint)
    return utterances, wall


async def open_loop(endpoint: Endpoint, replies: list[Reply], *, rate: float, duration: float, drain: float,
                    seed: int, share: tuple[int, int] = (0, 1),
                    start: float | None = None) -> tuple[list[Utterance], float]:
    """Requests arriving as a Poisson process of `rate` per second for `duration` seconds, each
    from a new caller who plays it at real time. Returns the utterances and the level's wall time.
    `share` and `start` as closed_loop's: arrivals k with k % parts == part of the whole plan."""
    rng = random.Random(f"fleet-open:{seed}:{rate}")
    plan = [(t, rng.choice(replies), rng.randrange(2**31)) for t in poisson_arrivals(rate, duration, rng)]
    clock = LevelClock(start)
    utterances: list[Utterance] = []

    async def arrival(k: int, t: float, reply: Reply, utterance_seed: int) -> None:
        await clock.sleep_until(t)
        u = Utterance(caller=k, frames=reply.frames, submitted=t)
        utterances.append(u)
        await hear(endpoint, reply, utterance_seed, u, clock)

    tasks = [asyncio.create_task(arrival(k, *p)) for k, p in enumerate(plan) if k % share[1] == share[0]]
    wall = await _run(tasks, clock, duration + drain, endpoint)
    return utterances, wall


# How often a caller process's loop lag is sampled: as the server's (server/metrics.py), so that
# the two compare.
LAG_INTERVAL_S = 0.01


class LoopLag:
    """How late this process's event loop wakes a task that sleeps LAG_INTERVAL_S, sampled from
    construction to `stop` (the server's qwen_tts_event_loop_lag_seconds technique, every sample
    kept: the benchmark does without the server's prometheus_client). Make it on a running loop."""

    def __init__(self, interval: float = LAG_INTERVAL_S) -> None:
        self.interval = interval
        self.samples: list[float] = []
        self._task = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + self.interval
            await asyncio.sleep(self.interval)
            self.samples.append(max(0.0, loop.time() - due))

    async def stop(self) -> list[float]:
        self._task.cancel()
        await asyncio.wait([self._task])
        return self.samples


@dataclasses.dataclass(frozen=True)
class LevelPlan:
    """One level (or the warm-up) for the callers of every process: closed loop (`value` callers)
    or open loop (`value` requests/s), the same schedule everywhere, from `start`."""

    closed: bool
    value: float
    duration: float
    stagger: float
    listen: tuple[float, float]
    drain: float
    seed: int
    start: float | None = None  # wall clock (time.time()) when the level's clock starts; None: now


@dataclasses.dataclass
class Share:
    """What one caller process heard of a level."""

    part: int
    utterances: list[Utterance]
    wall_s: float
    lag_s: list[float]  # its loop's lag samples over the level
    started_late_s: float  # how long after the plan's start it got to start the level


async def run_share(endpoint: Endpoint, replies: list[Reply], plan: LevelPlan, share: tuple[int, int]) -> Share:
    """This process's share of a level's callers, its event loop's lag sampled while they run."""
    start = plan.start if plan.start is not None else time.time()
    t0 = time.monotonic() + (start - time.time())
    await asyncio.sleep(max(0.0, t0 - time.monotonic()))
    late = max(0.0, time.monotonic() - t0)
    lag = LoopLag()
    try:
        if plan.closed:
            utts, wall = await closed_loop(endpoint, replies, callers=int(plan.value), duration=plan.duration,
                                           stagger=plan.stagger, listen=plan.listen, drain=plan.drain,
                                           seed=plan.seed, share=share, start=t0)
        else:
            utts, wall = await open_loop(endpoint, replies, rate=plan.value, duration=plan.duration,
                                         drain=plan.drain, seed=plan.seed, share=share, start=t0)
    finally:
        samples = await lag.stop()
    return Share(share[0], utts, wall, samples, late)


def merge_shares(shares: list[Share]) -> tuple[list[Utterance], float, list[dict]]:
    """A level from its caller processes' shares: all their utterances, the longest wall time,
    and each process's utterance count, start and loop lag."""
    utts = [u for share in shares for u in share.utterances]
    wall = max(share.wall_s for share in shares)
    per_process = [{"process": share.part, "utterances": len(share.utterances),
                    "started_late_ms": 1e3 * share.started_late_s, "loop_lag": lag_summary(share.lag_s)}
                   for share in shares]
    return utts, wall, per_process


def caller_process(conn: multiprocessing.connection.Connection, base_url: str, voice: str | None,
                   text_mode: str | None, part: int, parts: int) -> None:
    """A caller process (spawned by CallerProcesses): its own event loop and client of the server;
    it runs its share of each plan it is sent and sends back a Share, until it is sent None."""
    with asyncio.Runner() as runner:
        endpoint = ServerEndpoint(base_url, voice, text_mode)
        replies = fleet_replies()
        try:
            conn.send(("ok", None))
            while (plan := conn.recv()) is not None:
                try:
                    share = runner.run(run_share(endpoint, replies, plan, (part, parts)))
                except Exception as exc:  # noqa: BLE001 - the parent raises it
                    conn.send(("error", f"{type(exc).__name__}: {exc}"[:300]))
                else:
                    conn.send(("ok", share))
        except (EOFError, BrokenPipeError, KeyboardInterrupt):
            pass  # the parent is gone or stopping
        finally:
            runner.run(endpoint.aclose())


class CallerProcesses:
    """A level's callers split over `n` OS processes (spawned), each with its own event loop and
    client of the server at `base_url`, as a fleet of agent processes is. Every process runs its
    share of the same schedule (callers, or arrivals, k with k % n == its part), all from one
    wall-clock instant, and sends its utterances back. `close` ends them."""

    LEAD_S = 0.5  # from sending a plan to the level's start: every process has it by then
    SETTLE_S = 30.0  # beyond a level's duration and drain, for its streams to close

    def __init__(self, n: int, base_url: str, voice: str | None, text_mode: str | None) -> None:
        context = multiprocessing.get_context("spawn")
        self._conns: list[multiprocessing.connection.Connection] = []
        self._procs: list[Any] = []
        try:
            for part in range(n):
                ours, theirs = context.Pipe()
                proc = context.Process(target=caller_process, args=(theirs, base_url, voice, text_mode, part, n),
                                       name=f"fleet-callers-{part}", daemon=True)
                proc.start()
                theirs.close()
                self._conns.append(ours)
                self._procs.append(proc)
        except BaseException:
            self.close()
            raise

    def wait_ready(self, timeout: float) -> None:
        """Block until every process has started (imported, its client made)."""
        self._gather(timeout)

    async def run(self, plan: LevelPlan) -> list[Share]:
        """Every process's share of `plan`, started LEAD_S from now."""
        plan = dataclasses.replace(plan, start=time.time() + self.LEAD_S)
        for conn in self._conns:
            conn.send(plan)
        return await asyncio.to_thread(self._gather, self.LEAD_S + plan.duration + plan.drain + self.SETTLE_S)

    def _gather(self, timeout: float) -> list[Any]:
        deadline = time.monotonic() + timeout
        results: dict[int, Any] = {}
        while len(results) < len(self._conns):
            waiting = {conn: part for part, conn in enumerate(self._conns) if part not in results}
            ready = multiprocessing.connection.wait(list(waiting), max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError(f"caller processes {sorted(waiting.values())} answered nothing in {timeout:.0f} s")
            for conn in ready:
                part = waiting[conn]
                try:
                    kind, payload = conn.recv()
                except EOFError:
                    self._procs[part].join(5)
                    raise RuntimeError(f"caller process {part} exited (code {self._procs[part].exitcode})") from None
                if kind == "error":
                    raise RuntimeError(f"caller process {part}: {payload}")
                results[part] = payload
        return [results[part] for part in range(len(self._conns))]

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for proc in self._procs:
            proc.join(10)
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
        for conn in self._conns:
            conn.close()
        self._conns, self._procs = [], []
