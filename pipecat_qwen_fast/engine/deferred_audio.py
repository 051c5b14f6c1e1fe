"""A batched round's vocoder calls on a CUDA stream of their own, collected while the next round
decodes (`QwenTTSEngine.defer_vocoder_audio`, turned on by `EngineService(overlap_vocoder=True)`).

The talker never reads audio, so round k's vocoder calls need not finish before round k+1's frame
starts. With deferral on, `_vocode_round` launches them on the side stream (after everything the
main stream has queued: the codes they read) and hands each chunk back as a `DeferredChunk`
placeholder; the next round resolves them once its frame is launched, before reading its codes,
so the two run side by side on the GPU and a chunk reaches its caller about when it would have
without deferral; calls already finished are handed over earlier, before and after the next
round's opens (`resolve_finished`). A round that launches no batched frame resolves them at its
end, and an idle service at once. Every other vocoder use (a single call's chunk, early frame-0
audio, priming, a whole decode) stays on the main stream, ordered after the side stream's work
(`order_main`), so the graphs' static buffers and the sessions' vocoder states are never used by
both at once. Each call keeps its codes and vocoder streams alive until it is resolved: a session
closed meanwhile cannot hand memory the side stream still reads back to the allocator.

On a CPU there is no side stream: the calls run where they are launched, and only the hand-back
is deferred (which is what the CPU tests check: the same audio, in order, every chunk delivered).
Whether the two streams overlap on the H200 is `bench/probes/batch_overlap.py`'s question.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from pipecat_qwen_fast.engine.request import AudioChunk


def row_chunk(pcm: Tensor, row: int, call_frames: int, frame_index: int, num_frames: int,
              codes: np.ndarray) -> AudioChunk:
    """Row `row` of a vocoder call's host audio [rows, call_frames * 1920] as its chunk: only its
    own `num_frames` (a padded row's are the first), copied (pinned pages go back to the pool)."""
    per_frame = pcm.shape[1] // call_frames
    return AudioChunk(pcm[row, : per_frame * num_frames].numpy().copy(), frame_index, num_frames, codes)


@dataclass(eq=False)
class DeferredChunk:
    """A chunk whose audio is still being made: `chunk` is None until the engine resolves it,
    then calls `on_resolved(self)` (set by whoever posted the placeholder) on the engine's thread. A
    chunk whose call can no longer complete (a device fault) is `dropped` instead: a reader skips
    it rather than wait for it."""

    frame_index: int
    num_frames: int
    codes: np.ndarray
    chunk: AudioChunk | None = None
    dropped: bool = False
    on_resolved: Callable[[DeferredChunk], None] | None = None

    @property
    def settled(self) -> bool:
        return self.chunk is not None or self.dropped

    def resolve(self, pcm: Tensor, row: int, call_frames: int) -> None:
        """Its audio: row `row` of its call's host audio (row_chunk)."""
        self.chunk = row_chunk(pcm, row, call_frames, self.frame_index, self.num_frames, self.codes)
        self._notify()

    def drop(self) -> None:
        self.dropped = True
        self._notify()

    def _notify(self) -> None:
        if self.on_resolved is not None:
            self.on_resolved(self)


@dataclass(eq=False)
class _Call:
    pcm: Tensor  # host int16 [rows, frames * 1920] (pinned on a GPU), complete once `done` is
    done: object | None  # torch.cuda.Event on the side stream; None on a CPU
    frames: int  # the call's frames; a padded row keeps only its own
    rows: list[tuple[int, DeferredChunk]]
    keep: tuple = field(repr=False)  # what the side stream reads until `done`: codes, vocoder streams


class VocoderSide:
    """The side stream (None on a CPU) and the calls launched on it, not yet resolved."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream: torch.cuda.Stream | None = None  # made at the first deferred launch on a GPU
        self.calls: list[_Call] = []
        self.resolved_calls = 0  # calls resolved since load, and how many of them in a round
        self.resolved_beside_a_frame = 0  # after that round's frame was launched (the overlap)

    @contextlib.contextmanager
    def launching(self) -> Iterator[None]:
        """Where a round's deferred calls are launched: on the side stream, behind everything the
        main stream has queued."""
        if self.device.type != "cuda":
            yield
            return
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.device)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            yield

    def order_main(self) -> None:
        """Before vocoder work on the main stream: behind everything the side stream has queued
        (a wait on the GPU, not the host). With no call pending there is nothing to wait for (a
        resolved call's host wait covered all its side work), so deferral off costs nothing."""
        if self.stream is not None and self.calls:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def synchronize(self) -> None:
        """Wait on the host until the side stream has run everything queued on it."""
        if self.stream is not None:
            self.stream.synchronize()

    def add(self, pcm: Tensor, done: object | None, frames: int, rows: list[tuple[int, DeferredChunk]],
            keep: tuple) -> None:
        self.calls.append(_Call(pcm, done, frames, rows, keep))

    def resolve(self, count: int | None = None, beside_a_frame: bool = False) -> int:
        """Wait for the first `count` calls (all by default) and hand each chunk its audio, in
        launch order; returns how many were resolved."""
        n = len(self.calls) if count is None else min(count, len(self.calls))
        calls, self.calls = self.calls[:n], self.calls[n:]
        for k, call in enumerate(calls):
            try:
                if call.done is not None:
                    call.done.synchronize()
            except BaseException:
                # The device failed: nothing launched after this will complete either.
                self.calls = calls[k:] + self.calls
                self.drop()
                raise
            for j, chunk in call.rows:
                chunk.resolve(call.pcm, j, call.frames)
        self.resolved_calls += n
        if beside_a_frame:
            self.resolved_beside_a_frame += n
        return n

    def resolve_finished(self) -> int:
        """Resolve the leading calls whose audio is already on the host, without waiting (a round
        about to open calls first hands those over); on a CPU, with no event to ask, none: they
        wait for the next frame's launch."""
        n = 0
        for call in self.calls:
            if call.done is None or not call.done.query():
                break
            n += 1
        return self.resolve(n) if n else 0

    def drop(self) -> None:
        """Give up every pending call (the engine failed): their chunks are dropped, not awaited."""
        calls, self.calls = self.calls, []
        for call in calls:
            for _, chunk in call.rows:
                chunk.drop()
