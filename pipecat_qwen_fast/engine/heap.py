"""The garbage collector around a loaded engine: freezing the heap, and timing its pauses.

With torch, the model, compiled graphs and CUDA graphs loaded, a process holds ~1.8 million
objects the collector tracks (the H200 server's count, 2026-11-28). A full collection walks all of
them holding the GIL: ~170 ms on the 2-core development machine, and a 630 ms host stall in one round of the H200's
in-process fleet at 256 callers (bench/results/2026-11-28-h200-session30/), every stream late at
once. The objects a fleet's streams make set one off every few seconds. `gc.freeze()` moves what
is alive now out of the collector's reach, so later collections walk only what came after.
"""

from __future__ import annotations

import gc
import threading
import time
from typing import Self

_holders: set[int] = set()  # who froze the heap and has not let go (EngineService ids)
_lock = threading.Lock()


def freeze_heap(*, collect: bool, holder: int | None = None) -> int:
    """Move every object alive now out of the collector's reach; the frozen count. `collect` first
    frees what is already garbage, so that it is not kept for good (a full collection: only where
    no stream is waiting). A `holder` gives it back with `release_heap`."""
    with _lock:
        if holder is not None:
            _holders.add(holder)
        if collect:
            gc.collect()
        gc.freeze()
        return gc.get_freeze_count()


def release_heap(holder: int) -> None:
    """`holder` no longer needs the heap frozen; once no holder does, the frozen objects go back to
    the collector, so a closed engine's memory can be freed."""
    with _lock:
        if holder in _holders:
            _holders.discard(holder)
            if not _holders:
                gc.unfreeze()


class GcPauses:
    """Each collection's generation and duration while installed (`with GcPauses() as pauses:`),
    from the collector's own callbacks: what a round's host time holds when the collector runs."""

    def __init__(self) -> None:
        self.pauses: list[tuple[int, float]] = []  # (generation, ms)
        self._started: float | None = None

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self.pauses.append((info["generation"], (time.perf_counter() - self._started) * 1e3))
            self._started = None

    def __enter__(self) -> Self:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)

    def summary(self) -> dict:
        """Per generation: collections, total and longest ms."""
        out = {}
        for gen in (0, 1, 2):
            ms = [d for g, d in self.pauses if g == gen]
            out[f"gen{gen}"] = {"collections": len(ms), "total_ms": round(sum(ms), 2),
                                "max_ms": round(max(ms), 2) if ms else 0.0}
        return out
