"""CUDA graphs for the streaming vocoder step, one per chunk size, shared by all sessions.

An eager `decode_stream` call launches ~800 small kernels and costs ~13 ms on the H200 whatever the
chunk size (docs/journal/NOTES.md, "Vocoder"). A captured call replays them in one go. The graph works on
a static stream state: the session's state is copied in before the replay and out after it (a few
MB, two fused copies), so every session shares one graph per chunk size. Between the two
(`launch`, `commit`) the session's own state is untouched, so a call queued early can be dropped.

The sizes in `compile_sizes` (the engine passes its first two chunk sizes, 1 and 3) are captured
at warm-up from `torch.compile`d code for their own shape: inductor fuses ~400 of a call's
elementwise and copy kernels, which takes a bfloat16 1-frame call on the H200 from 2.5 to 1.7 ms
and a 4-frame call from 2.9 to 1.8 ms (docs/journal/NOTES.md, "Vocoder graphs"). With `compile_dynamic`
every other size of 2 frames or more is captured from one more compiled step whose frame count is
symbolic: 0.0-0.2 ms slower a call than a step compiled for its size, but compiled once for all of
them (docs/journal/NOTES.md, "Chunk schedule 1, 4, 8, 16, 32"). Compiling costs 30-55 s per step on a
cold inductor cache; it is skipped, with the reason logged, where it cannot run (no triton, no
compiler), and `QWEN_FAST_COMPILE_VOCODER=0` turns it off.

Many sessions that each finish a chunk of the same size in the same round (the batched decode's
rounds) share one call: `decode_many` moves their states into the rows of a batched entry's
stream (each row at its own position), replays it once and moves them back. Streams that are
rows of the GraphedVocoder's pool (`new_stream`, vocoder/pool.py) move by index, in two more
captured graphs; any other stream is copied buffer by buffer. A batch-1 call is
~1.5 ms of mostly fixed cost on the H200 whatever its size (docs/journal/NOTES.md, "Chunk schedule"),
so 64 sessions' first chunks cost 64 of them one by one. Batched entries exist for the sizes and
row buckets that `capture_batched` captured at warm-up, up to `MAX_BATCH_FRAMES` rows x frames a
call (a graph's activations grow with both); other groups run batch-1. Chunks of different
sizes share a call too (`merge_sizes`): each row is padded on the right to the call's frames and
the entry's `valid` makes it commit its stream after its own frames.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from pipecat_qwen_fast.utils.cuda_graphs import (
    GraphCapturer,
    compile_blocker,
    plain_only,
    recompile_limit,
)
from pipecat_qwen_fast.utils.host_copy import copy_ints_into
from pipecat_qwen_fast.vocoder.pool import StreamPool
from pipecat_qwen_fast.vocoder.stream import VocoderStream, copy_streams, device_lengths
from pipecat_qwen_fast.vocoder.vocoder import Vocoder

logger = logging.getLogger(__name__)

MAX_GRAPHS = 48  # chunk sizes captured at most; other sizes run eagerly
BATCH_BUCKETS = (2, 4, 8, 16, 32, 64)  # rows of a batched entry; a group is padded up to one
# Rows x frames of one batched call: 64 first chunks, or two 32-frame chunks. Chunks merged across
# sizes (merge_sizes) fill calls of the larger size, so the device run tries 128 and 256 as well.
MAX_BATCH_FRAMES = int(os.environ.get("QWEN_FAST_VOCODER_BATCH_FRAMES", "64"))


@dataclass
class _Entry:
    codes: Tensor  # [rows, Q, n]
    stream: VocoderStream
    out: Tensor | None = None
    graph: torch.cuda.CUDAGraph | None = None
    rows: list[VocoderStream] | None = None  # batched entries: each row of `stream` as a batch-1 view
    # Calls made so far: a call queued ahead and committed later (engine.EarlyChunk) is valid
    # only while no other call of the entry's size has overwritten its state and output.
    runs: int = 0
    # Batched entries of a GraphedVocoder with a StreamPool: each row's pool row (padding rows the
    # scratch row), and the graphs that move those rows in and out of `stream` (None: eager).
    idx: Tensor | None = None
    gather: torch.cuda.CUDAGraph | None = None
    scatter: torch.cuda.CUDAGraph | None = None

    def run(self, vocoder: Vocoder) -> Tensor:
        """The call on the entry's own state: its graph's replay, or the eager step."""
        self.runs += 1
        if self.graph is not None:
            self.graph.replay()
            return self.out
        return vocoder.stream_step(self.codes, self.stream)


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


def merge_sizes(counts: dict[int, int], calls: Callable[[int, int], int]) -> dict[int, int]:
    """A round's chunk sizes (size -> chunks of it) -> the frames of the call each size's chunks
    join. A call costs nearly the same whatever its size (launch-bound), so from the largest size
    down a call of n frames takes the chunks of each size of at least n / 2 (at most 2x padded
    frames: 32 takes 16, 8 takes 4, 2 takes 1), wherever that makes fewer calls than their own
    (`calls(n, k)`: the calls for k rows of n frames; a size without batched entries, or with
    fewer rows a call than the smaller size, would make more)."""
    into: dict[int, int] = {}
    left = sorted(counts, reverse=True)
    while left:
        n = left.pop(0)
        into[n], rows = n, counts[n]
        for m in [m for m in left if 2 * m >= n]:
            if calls(n, rows + counts[m]) < calls(n, rows) + calls(m, counts[m]):
                into[m], rows = n, rows + counts[m]
                left.remove(m)
    return into


class GraphedVocoder:
    def __init__(self, vocoder: Vocoder, device: torch.device, dtype: torch.dtype, use_graphs: bool | None = None,
                 compile_sizes: tuple[int, ...] = (), cudnn_benchmark: bool | tuple[int, ...] = True,
                 compile_dynamic: bool = False, compile_batched: bool = False, pool_slots: int = 0):
        self.vocoder = vocoder
        # True: every size's capture times cuDNN's algorithms; a tuple: only those sizes (each
        # timing costs ~0.7 s of load per size on the H200).
        self.cudnn_benchmark = cudnn_benchmark
        self.device = device
        self.dtype = dtype
        self.use_graphs = device.type == "cuda" if use_graphs is None else use_graphs
        self.entries: dict[int, _Entry] = {}
        self.batched: dict[tuple[int, int], _Entry] = {}  # (frames, rows) -> entry (capture_batched)
        self.capturer = GraphCapturer(device) if self.use_graphs else None
        reason = compile_unavailable_reason(device) if self.use_graphs else "no CUDA graphs"
        self.compile_sizes = set(compile_sizes) if reason is None else set()
        self.compile_dynamic = compile_dynamic and reason is None
        if reason is not None and (compile_sizes or compile_dynamic):
            logger.info("vocoder step not compiled: %s", reason)
        self._compiled: Callable | None = None  # compiled per shape (compile_sizes)
        self._generic: Callable | None = None  # one compiled step for the other sizes (compile_dynamic)
        self.compile_batched = compile_batched and reason is None
        self._batched: Callable | None = None  # batched entries' compiled step (compile_batched)
        self.compiled_sizes: set[int] = set()  # sizes whose graph holds compiled code
        self.plain_sizes: set[int] = set()  # captured plain inside plain_first(), to compile later
        # Rows of the StreamPool that `new_stream` hands out, made with the first batched entries
        # (vocoder/pool.py: a batched call's states move by index, not one copy per buffer).
        self.pool_slots = pool_slots
        self.pool: StreamPool | None = None
        # Batched calls whose streams moved by index (all rows of the pool) and those that copied.
        self.calls_pooled = 0
        self.calls_copied = 0

    def new_stream(self) -> VocoderStream:
        """A session's fresh stream: a row of the pool where one is free, else a tensor of its own
        (its batched calls then copy it in and out)."""
        if self.pool is not None and (st := self.pool.new_stream()) is not None:
            return st
        return self.vocoder.new_stream(batch=1, device=self.device, dtype=self.dtype, packed=True)

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
        return entry, entry.run(self.vocoder)

    @staticmethod
    def commit(entry: _Entry, stream: VocoderStream, n: int) -> None:
        """`stream` <- the state after the launched call of `n` frames; before any other call of
        the entry's size."""
        frames = stream.frames
        stream.copy_from(entry.stream)
        stream.frames = frames + n

    def decode_many(self, codes: Tensor, streams: list[VocoderStream], valid: Sequence[int] | None = None) -> Tensor:
        """Row i of `codes [k, Q, n]` through the batch-1 stream `streams[i]`: `[k, 1, n * 1920]`,
        the same as k `decode_stream` calls. Batched where `capture_batched` made entries for n
        frames (the smallest bucket that takes the rows left, else the largest, repeatedly);
        batch-1 calls otherwise. `valid`: each row's own frames, the rest right padding, as in
        `Vocoder.decode_streams` (a row alone runs batch-1 on its own frames)."""
        k, n = len(streams), codes.shape[-1]
        if codes.shape[0] != k:
            raise ValueError(f"decode_many: {codes.shape[0]} rows of codes for {k} streams")
        lengths = [n] * k if valid is None else list(valid)
        on_device = None if valid is None else device_lengths(lengths, n, self.device)
        outs: list[Tensor] = []
        for i, take, b in self._split(n, k):
            if b is None:
                v = lengths[i]
                out = self.decode_stream(codes[i : i + 1, :, :v], streams[i])
                outs.append(out if v == n else F.pad(out, (0, (n - v) * self.vocoder.samples_per_frame)))
                continue
            entry = self.batched[(n, b)]
            if on_device is None:
                entry.stream.valid[:take].fill_(n)
            else:
                entry.stream.valid[:take].copy_(on_device[i : i + take])
            outs.append(self._run_batched(entry, codes[i : i + take], streams[i : i + take], lengths[i : i + take]))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _run_batched(self, entry: _Entry, codes: Tensor, part: list[VocoderStream], lengths: list[int]) -> Tensor:
        """One replay of a batched entry for these streams (its `valid` already set)."""
        take = len(part)
        pooled = entry.idx is not None and self.pool.holds(part)
        if pooled:
            self.calls_pooled += 1
            copy_ints_into(entry.idx, [st.slot for st in part] + [self.pool.scratch] * (len(entry.rows) - take))
            self._move(entry, entry.gather, self.pool.gather)
        else:
            self.calls_copied += 1
            rows = entry.rows[:take]
            copy_streams(rows, part)
        entry.codes[:take].copy_(codes)
        out = entry.run(self.vocoder)
        if pooled:
            self._move(entry, entry.scatter, self.pool.scatter)
        else:
            copy_streams(part, rows)
        for st, v in zip(part, lengths):
            st.frames += v
        return out[:take].clone()  # the next call of this entry rewrites `out`

    @staticmethod
    def _move(entry: _Entry, graph: torch.cuda.CUDAGraph | None, eager: Callable) -> None:
        if graph is not None:
            graph.replay()
        else:
            eager(entry.idx, entry.stream)

    def _split(self, n: int, k: int) -> Iterator[tuple[int, int, int | None]]:
        """decode_many's calls for k rows of n frames: (first row, rows, bucket), bucket None for
        a batch-1 call."""
        buckets = sorted(b for m, b in self.batched if m == n)
        i = 0
        while i < k:
            left = k - i
            b = next((b for b in buckets if b >= left), buckets[-1] if buckets else 1)
            if left == 1 or b == 1:
                yield i, 1, None
                i += 1
                continue
            yield i, min(b, left), b
            i += min(b, left)

    def calls(self, n: int, k: int) -> int:
        """How many calls `decode_many` makes for k rows of n frames."""
        return sum(1 for _ in self._split(n, k))

    def capture_batched(self, sizes: list[int], max_rows: int) -> None:
        """Batched entries (warm-up) for these chunk sizes: every bucket up to `max_rows` rows
        and `MAX_BATCH_FRAMES` rows x frames."""
        if self.pool is None and self.pool_slots > 0:
            self.pool = StreamPool(self.vocoder, self.pool_slots, self.device, self.dtype)
            logger.info("vocoder stream pool: %d rows, %.2f GB", self.pool_slots,
                        self.pool.row_bytes * (self.pool_slots + 1) / 1e9)
        for n in sizes:
            for b in BATCH_BUCKETS:
                if b <= max_rows and b * n <= MAX_BATCH_FRAMES and (n, b) not in self.batched:
                    self.batched[(n, b)] = self._make_batched(n, b)

    @torch.no_grad()
    def _make_batched(self, n: int, rows: int) -> _Entry:
        voc = self.vocoder
        entry = _Entry(
            codes=torch.zeros(rows, voc.cfg.num_quantizers, n, dtype=torch.long, device=self.device),
            stream=voc.new_stream(batch=rows, device=self.device, dtype=self.dtype),
        )
        entry.rows = [entry.stream.row(j) for j in range(rows)]
        # Every row's own frames (decode_many sets them before each call): a chunk of a smaller
        # size padded to n commits its state at its own end.
        entry.stream.valid = torch.full((rows,), n, dtype=torch.long, device=self.device)
        if self.capturer is not None:
            timed = self.cudnn_benchmark if isinstance(self.cudnn_benchmark, bool) else n in self.cudnn_benchmark
            with _cudnn_benchmark(timed), recompile_limit(64):
                step = self._batched_step(entry, n)
                entry.graph, entry.out = self.capturer.capture(lambda: step(entry.codes, entry.stream))
        if self.pool is not None:
            pool = self.pool
            entry.idx = torch.full((rows,), pool.scratch, dtype=torch.long, device=self.device)
            if self.capturer is not None:
                # Their warm-up runs move the scratch row only.
                entry.gather, _ = self.capturer.capture(lambda: pool.gather(entry.idx, entry.stream))
                entry.scatter, _ = self.capturer.capture(lambda: pool.scatter(entry.idx, entry.stream))
        return entry

    def _batched_step(self, entry: _Entry, n: int) -> Callable:
        """The step a batched entry's graph is captured from: one compiled step whose rows (and
        frames, from 2) are symbolic where `compile_batched`, else the plain step."""
        if not self.compile_batched:
            return self.vocoder.stream_step
        try:
            t0 = time.perf_counter()
            if self._batched is None:
                self._batched = torch.compile(self.vocoder.stream_step, dynamic=None)
            st = entry.stream
            for t in (entry.codes, *st.histories, st.position, st.valid):
                torch._dynamo.mark_dynamic(t, 0)
            for t in (st.keys, st.values):
                torch._dynamo.mark_dynamic(t, 1)
            if n >= 2:
                torch._dynamo.mark_dynamic(entry.codes, 2)
            self._batched(entry.codes, st)  # compiles now where needed, outside any capture
            st.reset()
            logger.info("batched vocoder step for %d x %d frames compiled in %.1f s", entry.codes.shape[0], n,
                        time.perf_counter() - t0)
            return self._batched
        except Exception as e:  # noqa: BLE001 - any compiler failure: plain batched graphs still work
            logger.warning("compiling the batched vocoder step failed (%s: %s); using plain graphs",
                           type(e).__name__, str(e)[:300])
            self.compile_batched = False
            entry.stream.reset()
            return self.vocoder.stream_step

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
            with _cudnn_benchmark(timed and not plain_only()):
                self._capture(entry, n, warmup)
        self.entries[n] = entry
        return entry

    @torch.no_grad()
    def compile_plain(self, sizes: list[int] | None = None) -> None:
        """Recapture sizes captured plain (plain_first) as warm-up would have: compiled, cuDNN timed."""
        todo = [n for n in (sizes if sizes is not None else list(self.plain_sizes)) if n in self.plain_sizes]
        for n in sorted(todo, key=lambda n: n not in self.compile_sizes):
            self.plain_sizes.discard(n)
            self._make(n, warmup=True)

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
        if plain_only() and (per_shape or generic):
            self.plain_sizes.add(n)
            per_shape = generic = False
        elif not warmup and not generic and self.compile_dynamic and n >= 2:
            self.plain_sizes.add(n)  # seen before the generic step exists: compiled when idle
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
