"""The `auto` backend on a GPU: the megakernel while few calls are live, the batched CUDA-graph
backend beyond.

The two scale differently (README, "Concurrent streams"). The megakernel runs one session per
launch, ~2.1 ms a frame on the H200: the fastest first audio, but ~440 frames/s whatever the number
of calls. The graph backend replays one batch of every ready session (compiled layers: 6.7 ms for
one call, 7.7 for 16, 11.2 for 64): slower alone, 2000+ frames/s at 64 calls. A round that runs both pays both (the batch's
fixed cost plus a launch per megakernel call), so rounds are kept pure:

* a new call goes to the megakernel while no call is in the batch and it makes at most
  `fast_sessions` there (calls opened together count together: a larger burst goes to the batch
  whole);
* otherwise it joins the batch, and before the next frame the megakernel's live calls move into
  the batch too: their K/V rows, hidden state, next input and code-0 history are copied
  (`SessionSnapshot`, a few MB per call, queued on the device like any other work).

While the batch is small (at most `first_alone_below` calls) a call opened alone or in a pair
makes its first frame on the megakernel all the same, and moves into the batch after it
(`starts_alone`): the service runs that frame by itself before the round's batched frame, so the
new call's first audio waits for a 2 ms megakernel frame instead of the batch's launch-bound one
(~6.7 ms at a few rows), at the price of that frame added to the others' round once.

Once the batch drains, new calls start on the megakernel again. A moved call's later draws use
the uniforms the megakernel would have (both hash the seed, frame and code group), but from the
batch's logits, whose rounding differs: a seeded sampled call repeats only under the same load;
`backend="megakernel"` or `"torch"` fixes the path. When the batch has no free slot a call goes
to (or stays on) the megakernel, which allocates per session: a full pool never turns a call
away while memory lasts.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

from pipecat_qwen_fast.errors import NoFreeSlotError
from pipecat_qwen_fast.model.sampling import SamplingParams

logger = logging.getLogger("pipecat_qwen_fast")

# Up to this many concurrent calls the megakernel's round is no longer than the batch's on the H200:
# 3 calls give the same frames/s on either side, 4 calls 11 % more in the batch since its layers are
# compiled (bench/results/fast_sessions_ab_h200_2026-11-24_d96dcbf.json; docs/journal/NOTES.md, "Auto
# backend" and "The batched round compiled").
FAST_SESSIONS = 3
# A new call makes its first frame alone on the megakernel while the batch holds at most this many
# calls (`starts_alone`; QWEN_FAST_FIRST_ALONE_BELOW, 0: never). At 64 fleet callers (H200, session
# 39) rounds were 7.7 ms for 5 streams and first audio p95 23.7 ms; issue 34 asks 15. Each such
# frame adds ~2 ms plus a 1-frame vocoder call to one round of the others, so it stays off where
# rounds carry many streams (a few hundred callers), whose slack it would spend.
FIRST_ALONE_BELOW = 16
# ... and only for a round's first two opens: a burst of more is one batched prefill and frame.
FIRST_ALONE_BURST = 2


@dataclass(eq=False)
class HybridState:
    inner: object
    on_fast: bool
    released: bool = False
    alone_first: bool = False  # on the megakernel for its first frame only (starts_alone)


class HybridBackend:
    """A DecodeBackend over two: `fast` (one session per call) and `bulk` (batched `decode_frames`)."""

    def __init__(self, fast, bulk, fast_sessions: int = FAST_SESSIONS, first_alone_below: int | None = None):
        if fast_sessions < 0:
            raise ValueError(f"fast_sessions must be >= 0 (got {fast_sessions})")
        if first_alone_below is None:
            first_alone_below = _env_count("QWEN_FAST_FIRST_ALONE_BELOW", FIRST_ALONE_BELOW)
        if first_alone_below < 0:
            raise ValueError(f"first_alone_below must be >= 0 (got {first_alone_below})")
        self.fast = fast
        self.bulk = bulk
        self.fast_sessions = fast_sessions
        self.first_alone_below = first_alone_below
        self.name = f"{fast.name}+{bulk.name}"
        self.max_batch = getattr(bulk, "max_batch", 1)
        # Moving calls needs a snapshot from one side and an adopter on the other.
        self.can_move = hasattr(fast, "export_state") and hasattr(bulk, "adopt_state")
        self.on_fast: list[HybridState] = []  # live calls on the megakernel, oldest first
        self.live_bulk = 0
        self.force: bool | None = None  # placed(): every new call on one side, nothing moved (warm-up, tests)
        self.started = {"fast": 0, "bulk": 0}  # calls placed on each side since load
        self.moved = 0  # calls moved from fast into the batch since load
        self.burst = 0  # calls of a burst being opened together (opening()) not placed yet
        self.burst_size = 0  # that burst's size
        self.bulk_before_burst: int | None = None  # calls in the batch when that burst began
        self.first_alone = 0  # calls placed to make their first frame alone since load
        # False while the batch path's graphs are still being captured (engine/warmup.py): every
        # call goes to the megakernel until then.
        self.bulk_ready = True

    @property
    def live_fast(self) -> int:
        return len(self.on_fast)

    @property
    def max_positions(self) -> int | None:
        limits = [x for x in (getattr(self.fast, "max_positions", None), getattr(self.bulk, "max_positions", None))
                  if x is not None]
        return min(limits) if limits else None

    def new_state(self, *, max_positions: int, params: SamplingParams, seed: int | None, trailing: Tensor,
                  pad_vec: Tensor) -> HybridState:
        kwargs = {"max_positions": max_positions, "params": params, "seed": seed, "trailing": trailing,
                  "pad_vec": pad_vec}
        if self.force is not None:
            to_bulk = not self.force
        else:
            # A burst larger than the megakernel's share goes to the batch whole: no megakernel
            # prefill just to move the call a frame later.
            to_bulk = self.bulk_ready and (
                self.live_bulk > 0 or self.live_fast + max(1, self.burst) > self.fast_sessions)
        self.burst = max(0, self.burst - 1)  # the calls of the burst still to place, this one excluded
        # The batch's calls before this burst: a pair opened into an empty batch is not joining one.
        in_batch = self.live_bulk if self.bulk_before_burst is None else self.bulk_before_burst
        alone = (to_bulk and self.force is None and self.can_move
                 and 0 < in_batch <= self.first_alone_below and self.burst_size <= FIRST_ALONE_BURST)
        if alone:
            state = HybridState(self.fast.new_state(**kwargs), on_fast=True, alone_first=True)
            self.on_fast.append(state)
            self.started["fast"] += 1
            self.first_alone += 1
            return state
        if to_bulk:
            try:
                state = HybridState(self.bulk.new_state(**kwargs), on_fast=False)
            except NoFreeSlotError:
                pass  # every batch slot is taken: this call goes to the megakernel
            else:
                self.live_bulk += 1
                self.started["bulk"] += 1
                return state
        state = HybridState(self.fast.new_state(**kwargs), on_fast=True)
        self.on_fast.append(state)
        self.started["fast"] += 1
        return state

    def _move_fast_calls(self) -> None:
        """While the batch has calls, every live megakernel call moves into it before its next
        frame (rounds stay pure). Done at decode time, so a call is moved after its prefill."""
        if not self.can_move or not self.on_fast or not self.live_bulk or self.force is not None:
            return
        before = self.moved
        for hs in list(self.on_fast):
            if self.starts_alone(hs):
                continue  # placed to make its first frame here; it moves after
            if getattr(hs.inner, "preview", None) is not None:
                # Its frame 0 was sent from a preview (streamed text, engine/text_first_frame.py):
                # that frame finishes here, with the codes already sent, and the call moves after.
                continue
            try:
                moved = self.bulk.adopt_state(self.fast.export_state(hs.inner))
            except NoFreeSlotError:
                break  # the batch is full: the rest stay where they are
            self.fast.release(hs.inner)
            hs.inner, hs.on_fast = moved, False
            self.on_fast.remove(hs)
            self.live_bulk += 1
            self.moved += 1
        logger.debug("moved %d calls from the megakernel into the batch (%d in the batch, %d left)",
                     self.moved - before, self.live_bulk, self.live_fast)

    def starts_alone(self, state: HybridState) -> bool:
        """Whether the call's next frame is its first, to be made alone on the megakernel before
        the round's batched frame (FIRST_ALONE_BELOW)."""
        return (state.alone_first and state.on_fast and not state.released and state.inner.frame == 0
                and getattr(state.inner, "preview", None) is None)

    def _of(self, state: HybridState):
        if state.released:
            raise RuntimeError("decode_frame on a released state")
        return self.fast if state.on_fast else self.bulk

    def prefill(self, state: HybridState, embeds: Tensor) -> None:
        self._of(state).prefill(state.inner, embeds)

    def prefill_many(self, states: list[HybridState], embeds: list[Tensor]) -> None:
        """Megakernel calls one by one (its captured prefill), the batch's calls in one pass."""
        bulk = []
        for s, e in zip(states, embeds):
            if s.on_fast:
                self.fast.prefill(self._inner(s), e)
            else:
                bulk.append((s, e))
        many = getattr(self.bulk, "prefill_many", None)
        if many is not None:
            many([self._inner(s) for s, _ in bulk], [e for _, e in bulk])
            return
        for s, e in bulk:
            self.bulk.prefill(self._inner(s), e)

    def _inner(self, state: HybridState):
        self._of(state)
        return state.inner

    def decode_frame(self, state: HybridState) -> Tensor:
        self._of(state)
        self._move_fast_calls()
        return self._of(state).decode_frame(state.inner)

    @torch.no_grad()
    def decode_frames(self, states: list[HybridState]) -> Tensor:
        """One frame for each state -> LongTensor [n, 16]: megakernel calls one launch each, the
        batch's in one replay, all queued on the device without a host read."""
        for s in states:
            self._of(s)
        self._move_fast_calls()
        rows: list[Tensor | None] = [None] * len(states)
        bulk = []
        for i, s in enumerate(states):
            if s.on_fast:
                rows[i] = self.fast.decode_frame(s.inner)
            else:
                bulk.append(i)
        batched = getattr(self.bulk, "decode_frames", None)
        if bulk and batched is not None:
            codes = batched([states[i].inner for i in bulk])
            for j, i in enumerate(bulk):
                rows[i] = codes[j]
        else:
            for i in bulk:
                rows[i] = self.bulk.decode_frame(states[i].inner)
        return torch.stack(rows)

    def set_trailing(self, state: HybridState, trailing: Tensor) -> None:
        self._of(state).set_trailing(state.inner, trailing)

    def release(self, state: HybridState) -> None:
        if state.released:
            return
        state.released = True
        if state.on_fast:
            self.on_fast.remove(state)
            self.fast.release(state.inner)
        else:
            self.live_bulk -= 1
            self.bulk.release(state.inner)

    def opening(self, n: int) -> None:
        """`n` calls are about to be opened together (0: done): they are placed as one burst."""
        self.burst = self.burst_size = n
        self.bulk_before_burst = self.live_bulk if n else None

    def prepare_thread(self, params: SamplingParams) -> None:
        prepare = getattr(self.bulk, "prepare_thread", None)
        if prepare is not None:
            prepare(params)

    @contextmanager
    def placed(self, on_fast: bool) -> Iterator[None]:
        """Calls started inside go to `fast` (True) or `bulk` (False), and none is moved: warm-up
        runs both paths."""
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


def _env_count(name: str, default: int) -> int:
    text = os.environ.get(name)
    if text is None or text.strip() == "":
        return default
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name} must be a whole number of calls (0: off); got {text!r}") from None
