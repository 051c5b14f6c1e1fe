"""The garbage collector around a loaded engine: freezing the heap, and timing its pauses.

With torch, the model, compiled graphs and CUDA graphs loaded, a process holds ~1.8 million
objects the collector tracks (the H200 server's count, 2026-11-28). A full collection walks all of
them holding the GIL: ~170 ms on the 2-core development machine, and a 630 ms host stall in one round of the H200's
in-process fleet at 256 callers (bench/results/2026-11-28-h200-session30/), every stream late at
once. The objects a fleet's streams make set one off every few seconds. `gc.freeze()` moves what
is alive now out of the collector's reach, so later collections walk only what came after.
"""

from __future__ import annotations

import collections
import gc
import threading
import time
from collections.abc import Callable
from types import FunctionType
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


def watch_gc(observe: Callable[..., None], *, collected: bool = False) -> Callable[[], None]:
    """Call `observe(generation, seconds)` after every collection (with `collected`, also the
    count of unreachable objects it found: `observe(generation, seconds, collected)`), from the
    collector's own callbacks (in whichever thread set it off, the GIL held); returns what stops it."""
    started: list[float] = []

    def callback(phase: str, info: dict) -> None:
        if phase == "start":
            started[:] = [time.perf_counter()]
        elif started:
            seconds = time.perf_counter() - started.pop()
            if collected:
                observe(info["generation"], seconds, info["collected"])
            else:
                observe(info["generation"], seconds)

    gc.callbacks.append(callback)
    return lambda: gc.callbacks.remove(callback)


class GcPauses:
    """Each collection's generation and duration while installed (`with GcPauses() as pauses:`):
    what a round's host time holds when the collector runs."""

    def __init__(self) -> None:
        self.pauses: list[tuple[int, float]] = []  # (generation, ms)
        self.ended_at: list[float] = []  # time.monotonic() at each one's end, in the same order
        self.collected: list[int] = []  # unreachable objects each one found, in the same order
        self._stop: Callable[[], None] | None = None

    def __enter__(self) -> Self:
        def observe(generation: int, seconds: float, collected: int) -> None:
            self.pauses.append((generation, seconds * 1e3))
            self.ended_at.append(time.monotonic())
            self.collected.append(collected)

        self._stop = watch_gc(observe, collected=True)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._stop is not None:
            self._stop()

    def summary(self) -> dict:
        """Per generation: collections, total and longest ms, and the unreachable objects they
        found (a full collection's time is the tracked objects it walks: those it frees, and the
        live ones `heap_census` counts)."""
        out = {}
        for gen in (0, 1, 2):
            ms = [d for g, d in self.pauses if g == gen]
            freed = sum(n for (g, _), n in zip(self.pauses, self.collected) if g == gen)
            out[f"gen{gen}"] = {"collections": len(ms), "total_ms": round(sum(ms), 2),
                                "max_ms": round(max(ms), 2) if ms else 0.0, "collected": freed}
        return out


def heap_census(top: int | None = 12) -> dict:
    """What a full collection would walk now: the tracked objects outside the frozen heap, by
    generation, and the `top` most common types among them (None: all). It lists every tracked
    object (tens of ms over a large heap): call it where no stream waits, such as after a
    benchmark's level."""
    gens = [gc.get_objects(generation=g) for g in (0, 1, 2)]
    types = collections.Counter(type(o) for objs in gens for o in objs)
    # Functions by the module that defined them: code compiled or imported after the freeze
    # (a lazily built graph, a late import) shows here by name.
    modules = collections.Counter(o.__module__ for objs in gens for o in objs if type(o) is FunctionType)
    counts = [len(objs) for objs in gens]
    del gens
    return {"unfrozen": counts, "frozen": gc.get_freeze_count(),
            "types": [[_type_name(kind), n] for kind, n in types.most_common(top)],
            "function_modules": [[str(m), n] for m, n in modules.most_common(top)]}


def _type_name(kind: type) -> str:
    return f"{getattr(kind, '__module__', '?')}.{getattr(kind, '__qualname__', kind.__name__)}"
