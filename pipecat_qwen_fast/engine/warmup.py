"""Warm-up in two parts: what the first call needs before the engine is ready, and the rest.

Measured on the H200 (bench/results/2026-11-26-h200-startup/), a warm start spent 60 of its 74 s
warming up: 32 s capturing batched vocoder graphs, 19 s capturing a vocoder graph for each of 33
chunk sizes, 9 s capturing the batch backend's frames. A single call needs none of the batched
work and only the vocoder sizes a default stream sends first. So `ready` waits for the single-call
path alone (the megakernel with its captured prefills, the first chunk sizes' vocoder graphs, one
greedy and one sampled session), and the rest runs later as small steps: `EngineService` runs
them while its engine thread is idle, `finish()` runs them all at once (`prepare`, tests).

Until the batch path is warm the auto backend keeps every call on the megakernel (`bulk_ready`),
which takes any number of calls at ~440 frames/s in all: a burst during the first seconds is
served, more slowly, rather than stalled behind a capture. A chunk size whose graph is not yet
captured is captured when first sent (as any size past the warm-up list always was).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from pipecat_qwen_fast.engine.request import SynthesisRequest, schedule_sizes
from pipecat_qwen_fast.model.prompt import VoiceClonePrompt
from pipecat_qwen_fast.model.sampling import SamplingParams
from pipecat_qwen_fast.utils.cuda_graphs import plain_first
from pipecat_qwen_fast.utils.phases import phase

if TYPE_CHECKING:
    from pipecat_qwen_fast.engine.engine import QwenTTSEngine

logger = logging.getLogger("pipecat_qwen_fast")

Step = tuple[str, Callable[[], None]]


class Warmup:
    def __init__(self, engine: QwenTTSEngine):
        self.engine = engine
        self.pending: deque[Step] = deque()
        self.timings: list[tuple[str, float]] = []  # (step, seconds) of the queued steps run so far

    @property
    def done(self) -> bool:
        return not self.pending

    @torch.no_grad()
    def start(self, defer: bool) -> None:
        """Run what the first call needs; queue the rest (or run it too unless `defer`). Deferred,
        the first call's graphs are captured plain (utils/cuda_graphs.plain_first) and their
        compiled versions come first among the queued steps."""
        now, later = self.plan(defer)
        backend = self.engine.backend
        if later and hasattr(backend, "bulk_ready"):
            backend.bulk_ready = False
        for name, step in now:
            with phase(name), plain_first() if defer else contextlib.nullcontext():
                step()
        self.pending.extend(later)
        if not defer:
            self.finish()

    @torch.no_grad()
    def step(self) -> bool:
        """Run one queued step (each well under a second on the H200); False when none is left."""
        if not self.pending:
            return False
        name, step = self.pending.popleft()
        t0 = time.perf_counter()
        try:
            step()
        except Exception as e:
            # A device fault is the engine's to handle; anything else costs only this step's
            # speed-up (what it would have captured runs on the path it already has).
            accelerator_error = getattr(torch, "AcceleratorError", None)
            if accelerator_error is not None and isinstance(e, accelerator_error):
                raise
            logger.warning(
                "background warm-up step %r failed, skipped: %s: %s", name, type(e).__name__, e
            )
            return True
        self.timings.append((name, time.perf_counter() - t0))
        logger.debug(
            "background warm-up: %s (%.2f s, %d steps left)",
            name,
            time.perf_counter() - t0,
            len(self.pending),
        )
        return True

    def finish(self) -> None:
        while self.step():
            pass

    def plan(self, defer: bool = False) -> tuple[list[Step], list[Step]]:
        e = self.engine
        backend = e.backend
        defaults = SamplingParams.from_defaults(e.generation)
        params = [defaults, defaults.greedy()]
        capture = getattr(backend, "capture_all", None)
        hybrid = hasattr(backend, "bulk_ready")
        now: list[Step] = []
        later: list[Step] = []
        if capture is not None and not hybrid:
            # The batch backend alone (backend="torch"): its batch of one is the single call.
            now.append(("capturing the batch graphs", lambda: capture(params, (1,))))
        now.append(("preparing the engine thread", e.prepare_thread))
        # The megakernel's fp32 prefill has graphs of its own beside the batch's bf16 ones.
        prefills = {
            id(p): p
            for b in (backend, getattr(backend, "fast", None), getattr(backend, "bulk", None))
            if (p := getattr(b, "prefills", None)) is not None
        }
        if defer:
            later += [("compiled prefill graphs", p.compile_plain) for p in prefills.values()]
        if e.vocoder_graphs is not None:
            first = list(schedule_sizes(SynthesisRequest("")))
            now.append(("capturing the vocoder graphs", lambda: e.vocoder_graphs.capture(first)))
            if defer:
                later += [
                    (
                        f"compiled vocoder graph of {n} frames",
                        lambda n=n: e.vocoder_graphs.compile_plain([n]),
                    )
                    for n in first
                ]
            # The tails a default stream may end on, and synthesize()'s 25.
            rest = [
                n for n in (*range(1, SynthesisRequest.max_chunk_frames + 1), 25) if n not in first
            ]
            later += [
                (f"vocoder graph of {n} frames", lambda n=n: self.vocoder_size(n)) for n in rest
            ]
        if hybrid:
            now.append(("warm-up sessions (megakernel)", lambda: self.sessions(True)))
        else:
            now.append(("warm-up sessions", lambda: self.sessions(None)))
        if capture is not None:
            buckets = getattr(getattr(backend, "bulk", backend), "batch_buckets", ())
            later += [
                (f"batch graphs of {b} rows", lambda b=b: capture(params, (b,)))
                for b in buckets
                if hybrid or b != 1
            ]
        rows = getattr(backend, "max_batch", 1)
        if (
            e.vocoder_graphs is not None
            and getattr(backend, "decode_frames", None) is not None
            and rows > 1
        ):
            # Sessions decoded in one batch finish chunks in the same rounds: their calls share
            # batched graphs for the sizes a default stream sends.
            sizes = list(schedule_sizes(SynthesisRequest("")))
            later += [
                (
                    f"batched vocoder graphs of {n} frames",
                    lambda n=n: e.vocoder_graphs.capture_batched([n], rows),
                )
                for n in sizes
            ]
        if hybrid:
            later.append(("warm-up sessions (batch)", lambda: self.sessions(False)))
            later.append(("the batch path is ready", lambda: setattr(backend, "bulk_ready", True)))
        # A busy engine's few opens a round share one captured prefill (GraphBackend.prefill_many);
        # until these are captured each open replays its own, so they come last.
        row_prefills = getattr(getattr(backend, "bulk", backend), "capture_row_prefills", None)
        if row_prefills is not None:
            later.append(("prefill graphs of several calls", row_prefills))
        return now, later

    def vocoder_size(self, n: int) -> None:
        """Size n's compiled graph: captured now, or recaptured if a stream captured it plain first."""
        graphs = self.engine.vocoder_graphs
        if n in graphs.entries:
            graphs.compile_plain([n])
        else:
            graphs.capture([n])

    def sessions(self, place: bool | None) -> None:
        """A greedy and a sampled session, on one path of a backend that places calls (`place`)."""
        e = self.engine
        voice = e.voices[0] if e.voices else None
        vc = None
        if e.config.model_type == "base":
            vc = VoiceClonePrompt(x_vector=torch.zeros(e.config.talker.hidden_size))
        placed = getattr(e.backend, "placed", None)
        with (
            placed(place) if placed is not None and place is not None else contextlib.nullcontext()
        ):
            for greedy in (True, False):
                req = SynthesisRequest(
                    "Hello there, this warms the engine up.",
                    voice=voice,
                    greedy=greedy,
                    seed=0,
                    voice_clone=vc,
                    max_frames=6,
                )
                s = e.open_session(req)
                try:
                    while not s.done:
                        e.step(s)
                finally:
                    e.close_session(s)
