"""CUDA graphs for the streaming vocoder step, one per chunk size, shared by all sessions.

An eager `decode_stream` call launches ~800 small kernels and costs ~13 ms on the H200 whatever the
chunk size (bench/NOTES.md, "Vocoder"). A captured call replays them in one go. The graph works on
a static stream state: the session's state is copied in before the replay and out after it (a few
MB, two fused copies), so every session shares one graph per chunk size. Between the two
(`launch`, `commit`) the session's own state is untouched, so a call queued early can be dropped.

The sizes in `compile_sizes` (the engine passes its first two chunk sizes, 1 and 3) are captured
at warm-up from `torch.compile`d code for their own shape: inductor fuses ~400 of a call's
elementwise and copy kernels, which takes a bfloat16 1-frame call on the H200 from 2.5 to 1.7 ms
and a 4-frame call from 2.9 to 1.8 ms (bench/NOTES.md, "Vocoder graphs"). With `compile_dynamic`
every other size of 2 frames or more is captured from one more compiled step whose frame count is
symbolic: 0.0-0.2 ms slower a call than a step compiled for its size, but compiled once for all of
them (bench/NOTES.md, "Chunk schedule 1, 4, 8, 16, 32"). Compiling costs 30-55 s per step on a
cold inductor cache; it is skipped, with the reason logged, where it cannot run (no triton, no
compiler), and `QWEN_FAST_COMPILE_VOCODER=0` turns it off.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .cuda_graphs import GraphCapturer, compile_blocker, recompile_limit
from .vocoder import Vocoder, VocoderStream

logger = logging.getLogger(__name__)

MAX_GRAPHS = 48  # chunk sizes captured at most; other sizes run eagerly


@dataclass
class _Entry:
    codes: Tensor  # [1, Q, n]
    stream: VocoderStream
    out: Tensor | None = None
    graph: torch.cuda.CUDAGraph | None = None


def compile_unavailable_reason(device: torch.device) -> str | None:
    """Why the vocoder step will not be compiled here, or None."""
    return compile_blocker(device, "QWEN_FAST_COMPILE_VOCODER")


@contextlib.contextmanager
def _cudnn_benchmark(on: bool):
    """cuDNN times its candidate algorithms for each new convolution shape (at the capture's warm-up
    call, outside the capture) instead of taking its heuristic's first pick; restored afterwards, so
    the rest of the process keeps its own setting."""
    prev = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = on or prev
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = prev


class GraphedVocoder:
    def __init__(self, vocoder: Vocoder, device: torch.device, dtype: torch.dtype, use_graphs: bool | None = None,
                 compile_sizes: tuple[int, ...] = (), cudnn_benchmark: bool | tuple[int, ...] = True,
                 compile_dynamic: bool = False):
        self.vocoder = vocoder
        # True: every size's capture times cuDNN's algorithms; a tuple: only those sizes (each
        # timing costs ~0.7 s of load per size on the H200).
        self.cudnn_benchmark = cudnn_benchmark
        self.device = device
        self.dtype = dtype
        self.use_graphs = device.type == "cuda" if use_graphs is None else use_graphs
        self.entries: dict[int, _Entry] = {}
        self.capturer = GraphCapturer(device) if self.use_graphs else None
        reason = compile_unavailable_reason(device) if self.use_graphs else "no CUDA graphs"
        self.compile_sizes = set(compile_sizes) if reason is None else set()
        self.compile_dynamic = compile_dynamic and reason is None
        if reason is not None and (compile_sizes or compile_dynamic):
            logger.info("vocoder step not compiled: %s", reason)
        self._compiled: Callable | None = None  # compiled per shape (compile_sizes)
        self._generic: Callable | None = None  # one compiled step for the other sizes (compile_dynamic)
        self.compiled_sizes: set[int] = set()  # sizes whose graph holds compiled code

    def decode_stream(self, codes: Tensor, stream: VocoderStream) -> Tensor:
        """Same result as `vocoder.decode_stream(codes, stream)` for batch-1 streams."""
        launched = self.launch(codes, stream)
        if launched is None:
            return self.vocoder.decode_stream(codes, stream, check_values=False)
        entry, out = launched
        self.commit(entry, stream, codes.shape[-1])
        return out.clone()

    def launch(self, codes: Tensor, stream: VocoderStream) -> tuple[_Entry, Tensor] | None:
        """The call's work queued on the graph's own copy of the state: `stream` is untouched until
        `commit`, so a call queued before its last frame is known to be kept can be dropped. Returns
        the entry and its output (rewritten by the entry's next call), or None past MAX_GRAPHS
        sizes (the caller runs the eager step on its own state)."""
        n = codes.shape[-1]
        entry = self.entries.get(n)
        if entry is None:
            if len(self.entries) >= MAX_GRAPHS:
                return None
            entry = self._make(n)
        entry.stream.copy_from(stream)
        entry.codes.copy_(codes)
        if entry.graph is not None:
            entry.graph.replay()
            return entry, entry.out
        return entry, self.vocoder.decode_stream(entry.codes, entry.stream, check_values=False)

    @staticmethod
    def commit(entry: _Entry, stream: VocoderStream, n: int) -> None:
        """`stream` <- the state after the launched call of `n` frames; before any other call of
        the entry's size."""
        frames = stream.frames
        stream.copy_from(entry.stream)
        stream.frames = frames + n

    def capture(self, sizes: list[int]) -> None:
        """Capture the graphs of these chunk sizes now (warm-up): those in `compile_sizes` from a
        step compiled for their shape (first, so the shape-generic step never takes them), the
        others of 2 frames or more from the shape-generic one where `compile_dynamic`. A size first
        seen later never compiles (no compile stall in the middle of a stream): it takes the
        shape-generic step where its guards already cover it, else a plain graph."""
        for n in sorted(sizes, key=lambda n: n not in self.compile_sizes):
            if n not in self.entries:
                self._make(n, warmup=True)

    @torch.no_grad()
    def _make(self, n: int, warmup: bool = False) -> _Entry:
        voc = self.vocoder
        q = voc.cfg.num_quantizers
        entry = _Entry(
            codes=torch.zeros(1, q, n, dtype=torch.long, device=self.device),
            stream=voc.new_stream(batch=1, device=self.device, dtype=self.dtype),
        )
        if self.capturer is not None:
            timed = self.cudnn_benchmark if isinstance(self.cudnn_benchmark, bool) else n in self.cudnn_benchmark
            with _cudnn_benchmark(timed):
                self._capture(entry, n, warmup)
        self.entries[n] = entry
        return entry

    def _compiled_step(self, generic: bool) -> Callable:
        if generic:
            if self._generic is None:
                self._generic = torch.compile(self.vocoder.stream_step, dynamic=None)
            return self._generic
        if self._compiled is None:
            self._compiled = torch.compile(self.vocoder.stream_step, dynamic=False)
        return self._compiled

    def _capture(self, entry: _Entry, n: int, warmup: bool) -> None:
        """The entry's graph, from compiled code where asked and the compiler works."""
        step: Callable = self.vocoder.stream_step
        compiled = False
        per_shape = warmup and n in self.compile_sizes
        # After warm-up a size may only reuse the generic step's code, never compile.
        generic = not per_shape and self.compile_dynamic and n >= 2 and (warmup or self._generic is not None)
        if per_shape or generic:
            stance = contextlib.nullcontext() if warmup else torch.compiler.set_stance("fail_on_recompile")
            try:
                t0 = time.perf_counter()
                fn = self._compiled_step(generic)
                if generic:  # 1 would be specialised: dynamo treats sizes 0 and 1 as constants
                    torch._dynamo.mark_dynamic(entry.codes, 2)
                with recompile_limit(64), stance:
                    fn(entry.codes, entry.stream)  # compiles now where needed, outside any capture
                entry.stream.reset()
                step, compiled = fn, True
                logger.info("vocoder step for %d-frame chunks %s in %.1f s", n,
                            "compiled" if not generic else "from the shape-generic step", time.perf_counter() - t0)
            except Exception as e:  # noqa: BLE001 - any compiler failure: the plain graph still works
                if warmup:
                    logger.warning("compiling the vocoder step%s failed (%s: %s); using plain graphs",
                                   " (shape-generic)" if generic else "", type(e).__name__, str(e)[:300])
                    if generic:
                        self.compile_dynamic = False
                    else:
                        self.compile_sizes.clear()
                entry.stream.reset()
        with recompile_limit(64):
            entry.graph, entry.out = self.capturer.capture(lambda: step(entry.codes, entry.stream))
        if compiled:
            self.compiled_sizes.add(n)
