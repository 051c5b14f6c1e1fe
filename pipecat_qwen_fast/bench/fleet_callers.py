"""The fleet benchmark's callers, and the endpoint they speak through.

An `Endpoint` turns one reply into a stream of audio: it yields each chunk's sample count as the
chunk reaches the caller, and raises the engine's overload error (`EngineOverloadedError`) when
the request is refused. The callers (closed loop: each speaks, plays, listens, speaks again; open
loop: Poisson arrivals) only see that, so the same workload can drive the engine in this process
(`InProcessEndpoint`) or a server over its WebSocket protocol.
"""

from __future__ import annotations

import asyncio
import dataclasses
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
    can tell the server's own cost from that path's."""

    def __init__(self, service: Any, voice: str | None, text_mode: str | None = None,
                 streamed: bool = False) -> None:
        self.service = service
        self.voice = voice
        self.text_mode = text_mode
        self.streamed = streamed
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
                                            text_mode=self.text_mode))
        self._streams.append(stream)
        try:
            async for chunk in stream:
                yield len(chunk.pcm)
        finally:
            stream.cancel()

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
    server runs on an engine of this process, lends its round timings and its stream count."""

    def __init__(self, base_url: str, voice: str | None, text_mode: str | None = None,
                 service: Any = None) -> None:
        from pipecat_qwen_fast.remote import RemoteTTSClient

        super().__init__(service, voice, text_mode)
        self.client = RemoteTTSClient(base_url)

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

    async def read_rounds(self) -> tuple[float, float] | None:
        """The server's engine rounds so far and their summed seconds, from its /metrics (a
        server in another process), or None where it does not publish them."""
        from pipecat_qwen_fast.remote import http_url

        wanted = {"qwen_tts_engine_rounds_total": None, "qwen_tts_engine_round_seconds_total": None}
        try:
            async with self.client.http().get(http_url(self.client.base_url, "/metrics"),
                                              headers=self.client._headers) as response:
                if response.status != 200:
                    return None
                for line in (await response.text()).splitlines():
                    name, _, value = line.partition(" ")
                    if name in wanted:
                        wanted[name] = float(value)
        except (aiohttp.ClientError, ValueError):
            return None
        rounds, seconds = wanted.values()
        return None if rounds is None or seconds is None else (rounds, seconds)

    async def aclose(self) -> None:
        await self.client.aclose()


class LevelClock:
    def __init__(self) -> None:
        self.t0 = time.monotonic()

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
                      listen: tuple[float, float], drain: float, seed: int) -> tuple[list[Utterance], float]:
    """`callers` callers, the first utterance of each at a random time in [0, stagger); each plays
    its reply at real time, listens for a random time in `listen`, speaks again, until `duration`.
    A refused caller listens and tries again. Utterances still running `drain` seconds after
    `duration` are cut. Returns the utterances and the level's wall time."""
    clock = LevelClock()
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

    tasks = [asyncio.create_task(caller(i)) for i in range(callers)]
    wall = await _run(tasks, clock, duration + drain, endpoint)
    return utterances, wall


async def open_loop(endpoint: Endpoint, replies: list[Reply], *, rate: float, duration: float, drain: float,
                    seed: int) -> tuple[list[Utterance], float]:
    """Requests arriving as a Poisson process of `rate` per second for `duration` seconds, each
    from a new caller who plays it at real time. Returns the utterances and the level's wall time."""
    rng = random.Random(f"fleet-open:{seed}:{rate}")
    plan = [(t, rng.choice(replies), rng.randrange(2**31)) for t in poisson_arrivals(rate, duration, rng)]
    clock = LevelClock()
    utterances: list[Utterance] = []

    async def arrival(k: int, t: float, reply: Reply, utterance_seed: int) -> None:
        await clock.sleep_until(t)
        u = Utterance(caller=k, frames=reply.frames, submitted=t)
        utterances.append(u)
        await hear(endpoint, reply, utterance_seed, u, clock)

    tasks = [asyncio.create_task(arrival(k, *p)) for k, p in enumerate(plan)]
    wall = await _run(tasks, clock, duration + drain, endpoint)
    return utterances, wall
