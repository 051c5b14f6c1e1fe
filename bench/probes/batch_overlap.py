"""Does a round's vocoder call run beside the next frame's batched decode? On two CUDA streams:
`python bench/probes/batch_overlap.py --model DIR --out DIR [--rows 64,128] [--vocoder 32x2,2x32]`.

Why: at 384-512 fleet callers a round of ~100 rows took ~30 ms, of which the decode 10-11 ms and
the vocoder 10-11 ms, one after the other on one stream (docs/PERFORMANCE.md). Neither fills the
H200: the decode is a graph of ~1000 small launch-bound kernels (6.7 ms at 1 row, 10.4 at 128),
the vocoder's calls are ~1.5 ms of mostly fixed cost plus ~0.06 ms a frame. The vocoder has no
part in the next frame's decode (the talker never reads audio), so round k's vocoder could run
on a second stream while round k+1 decodes. The megakernel's frame left no room beside it
(vocoder_overlap.py: 128 persistent blocks); the batch path's kernels may. If two streams take
close to the longer of the two, an engine that overlaps them saves up to the shorter one a round
(~10 ms of ~30 at 512 callers); if they take the sum, there is nothing to build.

The engine loads as `bench fleet` loads it (`from_pretrained`, `finish_warmup()`). For each
rows R and vocoder call K x N, max(R, K) fresh calls are placed on the batch path and stepped
`--prestep` frames; then, per vocoder call K x N (K rows of N frames, random codes, through the first K calls' own vocoder
streams, as `_vocode_round` calls `decode_many`), CUDA-event medians over `--repeats`, each from
one event on the main stream to the end of the GPU work, host preparation included:

* `decode`: `decode_frames` of R calls (the round's frame), alone;
* `vocoder`: the K x N call alone;
* `serial`: the call, then the frame, on the main stream (today's round);
* `overlap`: the call on a second stream (which waits for the main stream's event first), the
  frame on the main stream: until both are done.

`hidden` = (serial - overlap) / min(decode, vocoder): 1 when the shorter hides wholly, 0 when
nothing runs beside. On a CPU (tests/test_batch_overlap_probe.py: `run` on the tiny checkpoint
with a GraphBackend, no graphs) the same calls run with host clocks and no second stream: nothing
is claimed there.

Writes OUT/batch_overlap.json and OUT/batch_overlap.md (the table, also printed).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent)]  # round_common beside this file
from round_common import batch_path, header, probe_main, summary, write

from pipecat_qwen_fast.bench import texts
from pipecat_qwen_fast.engine.request import SynthesisRequest

NAME = "batch_overlap"
RESULT = f"{NAME}.json"
MARKDOWN = f"{NAME}.md"
WAYS = ("decode", "vocoder", "serial", "overlap")


def log(msg: str) -> None:
    print(f"[batch_overlap {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse_calls(spec: str) -> list[tuple[int, int]]:
    """'32x2,2x32' -> [(32, 2), (2, 32)]: rows x frames."""
    out = []
    for part in spec.split(","):
        k, _, n = part.partition("x")
        out.append((int(k), int(n)))
    return out


class Clock:
    """CUDA events on the device (the GPU's time from `start` until the streams given are done),
    host clocks on a CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device

    def start(self):
        if not self.cuda:
            return time.perf_counter()
        torch.cuda.synchronize(self.device)
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def stop(self, start, streams=()) -> float:
        if not self.cuda:
            return 1e3 * (time.perf_counter() - start)
        ends = []
        for s in (torch.cuda.current_stream(self.device), *streams):
            e = torch.cuda.Event(enable_timing=True)
            e.record(s)
            ends.append(e)
        torch.cuda.synchronize(self.device)
        return max(start.elapsed_time(e) for e in ends)


def vocoder_call(engine, codes, streams) -> None:
    with torch.no_grad():
        if engine.vocoder_graphs is not None:
            engine.vocoder_graphs.decode_many(codes, streams)
        else:
            engine.vocoder.decode_streams(codes, streams, check_values=False)


def measure(engine, bulk, states, call, clock: Clock, side, way: str) -> float:
    codes, streams = call
    t0 = clock.start()
    if way == "decode":
        bulk.decode_frames(states)
        return clock.stop(t0)
    if way == "vocoder":
        vocoder_call(engine, codes, streams)
        return clock.stop(t0)
    if way == "serial" or side is None:
        vocoder_call(engine, codes, streams)
        bulk.decode_frames(states)
        return clock.stop(t0)
    side.wait_event(t0)  # the call starts where the round would launch it
    with torch.cuda.stream(side):
        vocoder_call(engine, codes, streams)
    bulk.decode_frames(states)
    return clock.stop(t0, (side,))


def markdown(result: dict) -> str:
    lines = [(f"# Vocoder beside the batched decode ({result['device_name'] or result['device']}, commit "
             f"{result['commit']}, {result['date_utc']})"), "",
             ("Medians in ms (GPU time from one event to the end of the work); hidden = (serial - overlap) / "
             "min(decode, vocoder)."), "",
             "| rows | vocoder call | decode | vocoder | serial | overlap | hidden |", "|---|---|---|---|---|---|---|"]
    for r in result["cells"]:
        m = {w: r[w]["median"] for w in WAYS}
        lines.append(f"| {r['rows']} | {r['call']} | {m['decode']:.2f} | {m['vocoder']:.2f} | {m['serial']:.2f} | "
                     f"{m['overlap']:.2f} | {r['hidden']:.2f} |")
    if result["cuda_skipped"]:
        lines += ["", f"CUDA parts skipped: {result['cuda_skipped']}"]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="a checkpoint folder")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rows", default="64,128", help="calls in the decoded frame, comma-separated")
    p.add_argument("--vocoder", default="32x2,8x8,2x32",
                   help="vocoder calls as ROWSxFRAMES, comma-separated (the fleet's: many short chunks, a few long)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--prestep", type=int, default=3, help="frames the calls are stepped before timing")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--commit", default=os.environ.get("BENCH_COMMIT"))
    args = p.parse_args(argv)
    try:
        args.row_counts = [int(r) for r in args.rows.split(",")]
        args.calls = parse_calls(args.vocoder)
    except ValueError:
        p.error(f"--rows takes integers, --vocoder ROWSxFRAMES items, comma-separated; got {args.rows!r}, "
                f"{args.vocoder!r}")
    if (any(r < 1 for r in args.row_counts) or any(k < 1 or n < 1 for k, n in args.calls) or args.repeats < 1
            or args.prestep < 0):
        p.error("--rows and --vocoder sizes must be >= 1, --repeats >= 1, --prestep >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    return probe_main(parse_args(argv), run, log)


def run(engine, args: argparse.Namespace) -> dict:
    """The table on a loaded engine whose batch path (the auto backend's, or the backend itself) has
    `decode_frames`; writes and returns the result."""
    args.out.mkdir(parents=True, exist_ok=True)
    backend, bulk = batch_path(engine, "decode_frames")
    clock = Clock(engine.device)
    side = torch.cuda.Stream(engine.device) if clock.cuda else None
    cuda_skipped = None if clock.cuda else (
        f"the engine runs on {engine.device.type}: host clocks, no second stream; nothing claimed")
    if cuda_skipped:
        print(f"batch_overlap: {cuda_skipped}", flush=True)
    need = max(max(args.row_counts), max(k for k, _ in args.calls))
    replies = sorted(texts.FLEET_REPLIES, key=len, reverse=True)  # the longest: room for every frame
    requests = [SynthesisRequest(replies[i % len(replies)], voice=engine.default_voice, seed=i) for i in range(need)]
    placed = getattr(backend, "placed", None)
    result: dict = {
        **header(NAME, engine, args, skip_args=("row_counts", "calls")),  # those two parsed from rows, vocoder
        "cuda_skipped": cuda_skipped,
        "cells": [],
    }
    g = torch.Generator(device=engine.device).manual_seed(0)
    groups = engine.config.talker.num_code_groups
    vocab = engine.config.predictor.vocab_size
    def open_calls(count: int) -> list:
        opened = []
        with placed(False) if placed is not None else contextlib.nullcontext():
            for s in engine.open_sessions(requests[:count]):
                if isinstance(s, Exception):
                    for t in opened:
                        engine.cancel(t)
                    raise s
                opened.append(s)
        return opened

    for rows in args.row_counts:
        for k, n in args.calls:
            # Fresh calls for each cell: their positions stay well inside what they reserved.
            sessions = open_calls(max(rows, k))
            try:
                states = [getattr(s.state, "inner", s.state) for s in sessions[:rows]]
                for _ in range(args.prestep):
                    bulk.decode_frames(states)
                call = (torch.randint(0, vocab, (k, groups, n), device=engine.device, generator=g),
                        [s.vocoder_state for s in sessions[:k]])
                times: dict[str, list[float]] = {w: [] for w in WAYS}
                for i in range(args.repeats + 1):  # the first round of each unmeasured
                    for way in WAYS if i % 2 else reversed(WAYS):
                        ms = measure(engine, bulk, states, call, clock, side, way)
                        if i:
                            times[way].append(ms)
            finally:
                for s in sessions:
                    engine.cancel(s)
            cell = {"rows": rows, "call": f"{k}x{n}", **{w: summary(v) for w, v in times.items()}}
            m = {w: cell[w]["median"] for w in WAYS}
            cell["hidden"] = (m["serial"] - m["overlap"]) / max(1e-9, min(m["decode"], m["vocoder"]))
            result["cells"].append(cell)
            log(f"rows {rows}, call {k}x{n}: " + ", ".join(f"{w} {m[w]:.2f}" for w in WAYS)
                + f", hidden {cell['hidden']:.2f}")
    write(args.out, NAME, result, markdown(result))
    return result


if __name__ == "__main__":
    sys.exit(main())
