"""Timed load phases: what a load spent its time on, what it is doing now, and where it failed.

A load opens a `PhaseLog`; code deep inside it (a backend's compile, the vocoder's captures) marks
its own work with `phase(name)` and needs no handle passed down: the active log is found through a
context variable. Outside a log, `phase` only runs its body, so library code marks phases freely.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from pipecat_qwen_fast.errors import ModelLoadError, QwenTTSError

_ACTIVE: contextvars.ContextVar[PhaseLog | None] = contextvars.ContextVar(
    "qwen_fast_phase_log", default=None
)


@dataclass
class PhaseTime:
    name: str
    seconds: float
    depth: int  # 0 for a top-level phase; nested phases are part of their parent's seconds


@dataclass
class PhaseLog:
    """Phases in the order they ended. `on_start(name, depth)` and `on_end(name, depth, seconds)`
    are called as each one begins and ends (the progress display); never for another thread's."""

    on_start: Callable[[str, int], None] | None = None
    on_end: Callable[[str, int, float], None] | None = None
    phases: list[PhaseTime] = field(default_factory=list)
    _stack: list[str] = field(default_factory=list)

    def top_level(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for p in self.phases:
            if p.depth == 0:
                out[p.name] = out.get(p.name, 0.0) + p.seconds
        return out

    def as_dict(self) -> list[dict]:
        return [
            {"name": p.name, "seconds": round(p.seconds, 4), "depth": p.depth} for p in self.phases
        ]

    @contextlib.contextmanager
    def activate(self) -> Iterator[PhaseLog]:
        token = _ACTIVE.set(self)
        try:
            yield self
        finally:
            _ACTIVE.reset(token)


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Time the body as phase `name` of the active log. A failure in a top-level phase becomes a
    ModelLoadError naming the phase and the cause; nested phases let the error reach it unchanged,
    so the message names the path of phases down to the one that failed."""
    log = _ACTIVE.get()
    if log is None:
        yield
        return
    depth = len(log._stack)
    path = " / ".join([*log._stack, name])
    if log.on_start is not None:
        log.on_start(name, depth)
    log._stack.append(name)
    t0 = time.perf_counter()
    try:
        yield
    except Exception as e:
        # The innermost phase names the step; the exception keeps its type on the way up, since
        # callers between here and the load may handle it (a compile failure falls back).
        with contextlib.suppress(AttributeError):
            if not hasattr(e, "qwen_fast_phase"):
                e.qwen_fast_phase = path
        if depth == 0:
            where = getattr(e, "qwen_fast_phase", path)
            if isinstance(e, QwenTTSError):  # our own errors keep their type (ConfigError, ...)
                raise type(e)(f"loading failed while {where}: {e}") from e
            raise ModelLoadError(f"loading failed while {where}: {type(e).__name__}: {e}") from e
        raise
    finally:
        log._stack.pop()
        log.phases.append(PhaseTime(name, time.perf_counter() - t0, depth))
        if log.on_end is not None:
            log.on_end(name, depth, log.phases[-1].seconds)
