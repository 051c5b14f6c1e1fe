"""The `auto` backend on a GPU: the megakernel for the first few concurrent calls, the batched CUDA
graph backend for the rest.

The two backends scale differently (README, "Concurrent streams"). The megakernel runs one session
per launch, ~2.9 ms an engine frame on the H200: the fastest first audio, but a fixed ~350 frames/s
for any number of calls. The graph backend replays one batch of every ready session, ~10 ms plus
~0.4 ms a session: slower alone, 1700+ frames/s at 64 calls. A session cannot move between them
(its K/V cache lives in one), so each is placed when it starts: on the megakernel while fewer than
`fast_sessions` sessions are live in total, else in the batch. A round then costs the megakernel
frames plus one batch replay; the megakernel's share is bounded by `fast_sessions` launches, and
its sessions drain as their utterances end, after which a busy server runs batches only.

When the batch has no free slot a new session goes to the megakernel instead, which allocates
per session: a full pool never turns a call away while memory lasts.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

from .errors import NoFreeSlotError
from .sampling import SamplingParams

# Up to this many concurrent calls the megakernel beats the batch on the H200 (per round: 2.9 ms a
# call against ~10 ms + 0.4 ms a call), and mixed rounds (its calls plus a batch) stay short
# enough that 16 calls keep up with the second audio chunk (bench/NOTES.md, "Auto backend").
FAST_SESSIONS = 2


@dataclass
class HybridState:
    inner: object
    on_fast: bool
    released: bool = False


class HybridBackend:
    """A DecodeBackend over two: `fast` (one session per call) and `bulk` (batched `decode_frames`)."""

    def __init__(self, fast, bulk, fast_sessions: int = FAST_SESSIONS):
        if fast_sessions < 0:
            raise ValueError(f"fast_sessions must be >= 0 (got {fast_sessions})")
        self.fast = fast
        self.bulk = bulk
        self.fast_sessions = fast_sessions
        self.name = f"{fast.name}+{bulk.name}"
        self.max_batch = getattr(bulk, "max_batch", 1)
        self.live_fast = 0
        self.live_bulk = 0
        self.force: bool | None = None  # placed(): every new session on one side (warm-up)
        self.started = {"fast": 0, "bulk": 0}  # sessions placed on each side since load

    @property
    def max_positions(self) -> int | None:
        limits = [x for x in (getattr(self.fast, "max_positions", None), getattr(self.bulk, "max_positions", None))
                  if x is not None]
        return min(limits) if limits else None

    def new_state(self, *, max_positions: int, params: SamplingParams, seed: int | None, trailing: Tensor,
                  pad_vec: Tensor) -> HybridState:
        kwargs = dict(max_positions=max_positions, params=params, seed=seed, trailing=trailing, pad_vec=pad_vec)
        to_bulk = self.live_fast + self.live_bulk >= self.fast_sessions if self.force is None else not self.force
        if to_bulk:
            try:
                state = HybridState(self.bulk.new_state(**kwargs), on_fast=False)
                self.live_bulk += 1
                self.started["bulk"] += 1
                return state
            except NoFreeSlotError:
                pass  # every batch slot is taken: this call goes to the megakernel
        state = HybridState(self.fast.new_state(**kwargs), on_fast=True)
        self.live_fast += 1
        self.started["fast"] += 1
        return state

    def _of(self, state: HybridState):
        if state.released:
            raise RuntimeError("decode_frame on a released state")
        return self.fast if state.on_fast else self.bulk

    def prefill(self, state: HybridState, embeds: Tensor) -> None:
        self._of(state).prefill(state.inner, embeds)

    def decode_frame(self, state: HybridState) -> Tensor:
        return self._of(state).decode_frame(state.inner)

    @torch.no_grad()
    def decode_frames(self, states: list[HybridState]) -> Tensor:
        """One frame for each state -> LongTensor [n, 16]: the megakernel's sessions one launch each,
        then the batch's in one replay, all queued on the device without a host read."""
        for s in states:
            self._of(s)
        fast = [i for i, s in enumerate(states) if s.on_fast]
        bulk = [i for i, s in enumerate(states) if not s.on_fast]
        rows: list[Tensor | None] = [None] * len(states)
        for i in fast:
            rows[i] = self.fast.decode_frame(states[i].inner)
        batched = getattr(self.bulk, "decode_frames", None)
        if bulk and batched is not None:
            codes = batched([states[i].inner for i in bulk])
            for j, i in enumerate(bulk):
                rows[i] = codes[j]
        else:
            for i in bulk:
                rows[i] = self.bulk.decode_frame(states[i].inner)
        return torch.stack(rows)

    def release(self, state: HybridState) -> None:
        if state.released:
            return
        state.released = True
        if state.on_fast:
            self.live_fast -= 1
            self.fast.release(state.inner)
        else:
            self.live_bulk -= 1
            self.bulk.release(state.inner)

    @contextmanager
    def placed(self, on_fast: bool) -> Iterator[None]:
        """Sessions started inside go to `fast` (True) or `bulk` (False): warm-up runs both paths."""
        prev, self.force = self.force, on_fast
        try:
            yield
        finally:
            self.force = prev

    def capture_all(self, params_list: list[SamplingParams], batches: tuple[int, ...] | None = None) -> None:
        for backend in (self.fast, self.bulk):
            capture = getattr(backend, "capture_all", None)
            if capture is not None:
                capture(params_list, batches)
