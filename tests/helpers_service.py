"""Shared by the service tests that need several streams in one engine round: opened together, and
read to the end."""

from __future__ import annotations

import asyncio
import threading


def open_together(service, requests) -> list:
    """Streams for `requests`, all in the engine thread's inbox before it next takes it: it takes the
    inbox under the service's lock, held here (made reentrant, for open_stream's own use) until all
    are queued. Then one round opens them all and later rounds batch the same rows, run after run."""
    service._lock = threading.RLock()
    with service._lock:
        return [service.open_stream(r) for r in requests]


async def collect_all(streams, timeout: float) -> list[list]:
    """Every stream's chunks, read concurrently."""

    async def collect(stream):
        return [c async for c in stream]

    return await asyncio.wait_for(asyncio.gather(*(collect(s) for s in streams)), timeout)
