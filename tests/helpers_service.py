"""Shared by the service tests that need several streams in one engine round: opened together, and
read to the end."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def inbox_held(service) -> Iterator[None]:
    """Streams opened inside are all in the engine thread's inbox before it next takes it: it takes
    the inbox under the service's lock, held here (made reentrant, for the opens' own use). Then one
    round opens them all."""
    service._lock = threading.RLock()
    with service._lock:
        yield


def open_together(service, requests) -> list:
    """Streams for `requests`, opened in one round (`inbox_held`); later rounds batch the same rows,
    run after run."""
    with inbox_held(service):
        return [service.open_stream(r) for r in requests]


async def collect_all(streams, timeout: float) -> list[list]:
    """Every stream's chunks, read concurrently."""

    async def collect(stream):
        return [c async for c in stream]

    return await asyncio.wait_for(asyncio.gather(*(collect(s) for s in streams)), timeout)


async def open_staggered(service, requests, timeout: float) -> list:
    """Each call opened once the one before it has its first chunk, so every open after the first
    arrives while rounds run; returns each stream's chunks, or the error it raised."""

    async def read(stream, first: asyncio.Event):
        chunks = []
        try:
            async for chunk in stream:
                chunks.append(chunk)
                first.set()
        except Exception as e:  # noqa: BLE001 - the test looks at it
            return e
        finally:
            first.set()
        return chunks

    tasks = []
    for r in requests:
        first = asyncio.Event()
        tasks.append(asyncio.create_task(read(service.open_stream(r), first)))
        await asyncio.wait_for(first.wait(), timeout)
    return await asyncio.wait_for(asyncio.gather(*tasks), timeout)


def step_until_done(engine, sessions) -> list:
    """Rounds of `engine.step_many` until every session is done (none may fail); each one's codes."""
    import numpy as np

    while not all(s.done for s in sessions):
        results = engine.step_many(sessions)
        assert not any(isinstance(r, Exception) for r in results), results
    return [np.stack(s.codes) for s in sessions]


@contextmanager
def recording_opens(engine) -> Iterator[list[list[str]]]:
    """`engine.open_sessions` spied on while inside: yields the list of each call's request texts."""
    opens: list[list[str]] = []
    open_sessions = engine.open_sessions

    def spy(requests, **kwargs):
        opens.append([r.text for r in requests])
        return open_sessions(requests, **kwargs)

    engine.open_sessions = spy
    try:
        yield opens
    finally:
        del engine.open_sessions
