"""Where an EngineService round's time goes: opening sessions, decode, vocoder, and the host rest.

Off by default. `EngineService.time_rounds()` turns it on from the engine thread's next round; the
service then appends one `RoundTiming` per round that opened or stepped a session to its
`round_timings` deque, which a benchmark drains with `popleft()` (thread-safe) or reads whole.

While on, the engine's entry points for each kind of work are shadowed by instance attributes
that time them, each call bracketed by device synchronizations: the GPU work a call launches is
counted in that call, not in whatever host code next waits for the device. The price is every
overlap the engine has: a frame launched ahead (a stream alone in its round), a round's vocoder
calls on their own stream beside the next frame (deferred_audio.py), the host preparing work while
the GPU runs. On the H200 a fleet carried 448 callers with timing off and 320 with it on (session
36, docs/PERFORMANCE.md), so `bench fleet` times rounds only when asked (`--round-timing`). Off,
the service pays one attribute comparison a round.
"""

from __future__ import annotations

import collections
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Which engine calls count as which kind of work. A call made inside another timed call counts for
# the outer one only (the vocoder graphs fall back on the vocoder; a segment's prefill runs in a step).
_TIMED = (
    ("engine", "open_sessions", "prefill"),
    ("engine", "open_text_session", "prefill"),
    ("engine", "begin_text_sessions", "prefill"),
    ("engine", "_prefill", "prefill"),
    ("backend", "decode_frame", "decode"),
    ("backend", "decode_frames", "decode"),
    ("engine", "_vocode_round", "vocoder"),
    ("vocoder_graphs", "launch", "vocoder"),
    ("vocoder_graphs", "decode_stream", "vocoder"),
    ("vocoder", "decode_stream", "vocoder"),
    ("vocoder", "decode_streams", "vocoder"),
)
# Calls opened, per timed call: whole-text requests given together, a streamed turn alone (its
# prefill runs when it begins, in begin_text_sessions or its first poll).
_COUNTS = {"open_sessions": len, "open_text_session": lambda request, *_: 1}
_MISSING = object()


@dataclass(slots=True)
class RoundTiming:
    """One round of the engine thread, in seconds.

    ``prefill_s`` is the time opening sessions (prompts and prefills; for a streamed-text turn its
    open and the begin of its first segment in `begin_text_sessions`), ``decode_s`` the frames'
    decode calls, ``vocoder_s`` the vocoder calls; ``host_s`` is the rest of the round's wall time
    (scheduling, EOS checks, chunk bookkeeping, copies, posting chunks to callers).
    """

    started: float  # time.monotonic() at the round's start
    wall_s: float
    prefill_s: float
    decode_s: float
    vocoder_s: float
    opened: int  # calls opened: requests given to open_sessions, streamed turns to open_text_session
    stepped: int  # sessions stepped one frame

    @property
    def host_s(self) -> float:
        return self.wall_s - self.prefill_s - self.decode_s - self.vocoder_s


class RoundTimer:
    """Times one engine's rounds into `sink`; only the engine thread may use it."""

    def __init__(self, engine: Any, sink: collections.deque[RoundTiming]) -> None:
        self._sink = sink
        self._sync: Callable[[], None] | None = None
        if engine.device.type == "cuda":
            import torch

            device_wide = functools.partial(torch.cuda.synchronize, engine.device)

            def sync() -> None:
                # With the vocoder's calls on a stream of their own (engine/deferred_audio.py), a
                # device-wide wait would end the overlap it measures: wait for the main stream
                # only, so a round's vocoder time is its launch, the GPU's running beside.
                if getattr(engine, "defer_vocoder_audio", False):
                    torch.cuda.current_stream(engine.device).synchronize()
                else:
                    device_wide()

            self._sync = sync
        self._spent = {"prefill": 0.0, "decode": 0.0, "vocoder": 0.0}
        self._opened = 0
        self._inside = False
        self._started: float | None = None
        self._t0 = 0.0
        self._patched: list[tuple[object, str, object]] = []
        owners = {"engine": engine, "backend": engine.backend, "vocoder": engine.vocoder,
                  "vocoder_graphs": getattr(engine, "vocoder_graphs", None)}
        for owner_name, attr, kind in _TIMED:
            owner = owners[owner_name]
            if owner is None or getattr(owner, attr, None) is None:
                continue
            previous = owner.__dict__.get(attr, _MISSING)
            setattr(owner, attr, self._timed(getattr(owner, attr), kind, counts=_COUNTS.get(attr)))
            self._patched.append((owner, attr, previous))

    def _timed(self, fn: Callable[..., Any], kind: str, counts: Callable[..., int] | None) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._inside:
                return fn(*args, **kwargs)
            if counts is not None and args:
                self._opened += counts(*args)
            self._inside = True
            try:
                if self._sync is not None:
                    self._sync()
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    if self._sync is not None:
                        self._sync()
                    self._spent[kind] += time.perf_counter() - t0
            finally:
                self._inside = False

        return timed

    def begin(self) -> None:
        self._started = time.monotonic()
        self._t0 = time.perf_counter()
        for kind in self._spent:
            self._spent[kind] = 0.0
        self._opened = 0

    def end(self, stepped: int) -> None:
        """Close the round begun last; a round that neither opened nor stepped a session is dropped."""
        if self._started is None:
            return
        started, self._started = self._started, None
        if not stepped and not self._opened:
            return
        if self._sync is not None:
            self._sync()
        s = self._spent
        self._sink.append(RoundTiming(
            started=started, wall_s=time.perf_counter() - self._t0, prefill_s=s["prefill"], decode_s=s["decode"],
            vocoder_s=s["vocoder"], opened=self._opened, stepped=stepped,
        ))

    def remove(self) -> None:
        """Give the engine its own methods back."""
        for owner, attr, previous in reversed(self._patched):
            if previous is _MISSING:
                delattr(owner, attr)
            else:
                setattr(owner, attr, previous)
        self._patched = []
