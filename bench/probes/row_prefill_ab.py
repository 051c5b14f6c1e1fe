"""A round's few opens with and without the captured prefill of several rows, on one engine:
`python bench/probes/row_prefill_ab.py --model DIR --out DIR [--opens-per-round 1,2,3,4] [--repeats 30]`.

Why: at 384-512 fleet callers a round opened ~2 calls in ~6 ms ("opening calls" in the fleet's
round split), and the slowest rounds opened many; one open is 2.84 ms, of which the captured
prefill's replay 1.59 ms (481 kernels, 1.26 ms of GPU for ~30 positions: launch-bound, not
arithmetic-bound). GraphBackend.prefill_many now runs up to 4 prompts through one captured
graph of a batched layer step (`row_prefills`). Prediction (docs/PERFORMANCE.md): k opens in one
open_sessions() cost ~2.8 k ms one replay a call, and ~1.6 + 1.5 k ms with the rows (the prompt,
state and vocoder stream stay per call): 4 opens ~11.4 -> ~7.6 ms, 2 opens ~5.7 -> ~4.6 ms.

The engine loads as `bench fleet` loads it (`from_pretrained`, `finish_warmup()`: the batch path
warm; the row prefills captured then if QWEN_FAST_ROW_PREFILL=1, else by the probe), `--live` calls (default 32) are placed on the batch path and
stepped a frame, then for each k in `--opens-per-round`, `--repeats` times, alternately: k fleet
requests opened in one open_sessions() with the row graphs (`rows`), and with them set aside
(`one_by_one`: one captured replay a call, as before), each timed between device syncs, then
cancelled. A check first: k = 4 prompts' K/V and hidden state from the rows against each prompt
prefilled alone (relative error; bf16 on the GPU).

On a CPU (tests/test_row_prefill_probe.py: `run` on the tiny checkpoint's engine with a
GraphBackend, no graphs) the row graphs' eager body runs (prepared, not captured): no speed is
claimed there.

Writes OUT/row_prefill_ab.json and OUT/row_prefill_ab.md (the table, also printed).
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

NAME = "row_prefill_ab"
RESULT = f"{NAME}.json"
MARKDOWN = f"{NAME}.md"


def log(msg: str) -> None:
    print(f"[row_prefill_ab {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Requests:
    """The fleet's replies in turn, a seed each."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.replies = list(texts.FLEET_REPLIES)
        self.seed = 0

    def take(self, k: int) -> list[SynthesisRequest]:
        out = []
        for _ in range(k):
            text = self.replies[self.seed % len(self.replies)]
            self.seed += 1
            out.append(SynthesisRequest(text, voice=self.engine.default_voice, seed=self.seed,
                                        max_frames=texts.frames_for(text)))
        return out


@contextlib.contextmanager
def rows_off(bulk):
    """The row graphs set aside: prefill_many falls back to one captured replay a call."""
    entries, bulk.row_prefills.entries = bulk.row_prefills.entries, {}
    try:
        yield
    finally:
        bulk.row_prefills.entries = entries


def timed_open(engine, requests: list[SynthesisRequest], sync) -> tuple[float, list]:
    sync()
    t0 = time.perf_counter()
    opened = engine.open_sessions(requests)
    sync()
    return 1e3 * (time.perf_counter() - t0), opened


def check_rows(engine, bulk, reqs: Requests) -> dict:
    """k = 4 prompts through the rows against each alone: max relative error of K, V, hidden."""
    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()

    requests = reqs.take(bulk.row_prefills.rows)
    alone = []
    with rows_off(bulk):
        for r in requests:
            s = engine.open_session(r)
            state = getattr(s.state, "inner", s.state)  # the auto backend's batch side
            n = state.position
            alone.append((n, *[t.clone() for t in bulk.read_positions(state.slot, n)],
                          bulk.pool_hidden[state.slot].clone()))
            engine.cancel(s)
    passes = bulk.row_prefill_passes
    sessions = engine.open_sessions(requests)
    used = bulk.row_prefill_passes - passes
    errors = {"k": 0.0, "v": 0.0, "hidden": 0.0}
    for s, (n, k, v, h) in zip(sessions, alone):
        if isinstance(s, Exception):
            raise s
        state = getattr(s.state, "inner", s.state)
        k2, v2 = bulk.read_positions(state.slot, n)
        errors["k"] = max(errors["k"], rel(k2, k))
        errors["v"] = max(errors["v"], rel(v2, v))
        errors["hidden"] = max(errors["hidden"], rel(bulk.pool_hidden[state.slot], h))
        engine.cancel(s)
    return {"row_passes_used": used, "max_rel_error": errors}


def markdown(result: dict) -> str:
    lines = [(f"# Row prefill A/B ({result['device_name'] or result['device']}, commit {result['commit']}, "
             f"{result['date_utc']})"), "",
             (f"{result['live_calls']} calls live on the batch path; each cell the median (p90) ms of one "
             "open_sessions() of k fleet requests, device syncs around it."), "",
             "| k opens | one replay a call | rows | rows per call | saved |", "|---|---|---|---|---|"]
    for k, row in result["per_k"].items():
        a, b = row["one_by_one_ms"], row["rows_ms"]
        lines.append(f"| {k} | {a['median']:.2f} ({a['p90']:.2f}) | {b['median']:.2f} ({b['p90']:.2f}) | "
                     f"{b['median'] / int(k):.2f} | {a['median'] - b['median']:.2f} |")
    c = result["check"]
    lines += ["", (f"Check (4 prompts through the rows against each alone): max relative error "
              f"K {c['max_rel_error']['k']:.2e}, V {c['max_rel_error']['v']:.2e}, "
              f"hidden {c['max_rel_error']['hidden']:.2e}; row passes used {c['row_passes_used']}.")]
    if result["cuda_skipped"]:
        lines += ["", f"CUDA parts skipped: {result['cuda_skipped']}"]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="a checkpoint folder")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--opens-per-round", default="1,2,3,4", help="values of k, comma-separated, each 1..8")
    p.add_argument("--repeats", type=int, default=30, help="timed opens of each k and each way")
    p.add_argument("--live", type=int, default=32, help="calls live on the batch path meanwhile")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--commit", default=os.environ.get("BENCH_COMMIT"))
    args = p.parse_args(argv)
    try:
        args.ks = [int(k) for k in args.opens_per_round.split(",")]
    except ValueError:
        p.error(f"--opens-per-round takes integers separated by commas; got {args.opens_per_round!r}")
    if not args.ks or any(not 1 <= k <= 8 for k in args.ks) or args.repeats < 1 or args.live < 0:
        p.error("--opens-per-round values must be 1..8, --repeats >= 1, --live >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    return probe_main(parse_args(argv), run, log)


def run(engine, args: argparse.Namespace) -> dict:
    """The check and the timed opens on a loaded engine whose batch path (the auto backend's, or
    the backend itself) is a GraphBackend; writes and returns the result."""
    args.out.mkdir(parents=True, exist_ok=True)
    backend, bulk = batch_path(engine, "row_prefills")
    cuda = engine.device.type == "cuda"
    cuda_skipped = None
    if cuda:
        def sync():
            torch.cuda.synchronize(engine.device)
        if not bulk.row_prefills.entries:  # off by default (QWEN_FAST_ROW_PREFILL): captured here
            bulk.capture_row_prefills(force=True)
    else:
        def sync():
            return None
        cuda_skipped = f"the engine runs on {engine.device.type}: the row graphs' eager body, no speed claimed"
        print(f"row_prefill_ab: {cuda_skipped}", flush=True)
        for b in bulk.row_prefills.buckets:
            bulk.row_prefills.prepare(b)
    placed = getattr(backend, "placed", None)
    reqs = Requests(engine)
    live: list = []
    result: dict = {
        **header(NAME, engine, args, skip_args=("ks",)),
        "row_prefill_rows": bulk.row_prefills.rows,
        "row_prefill_buckets": list(bulk.row_prefills.buckets),
        "cuda_skipped": cuda_skipped,
    }
    try:
        with placed(False) if placed is not None else contextlib.nullcontext():
            live = [s for s in engine.open_sessions(reqs.take(args.live)) if not isinstance(s, Exception)]
            if live:
                engine.step_many(live)
            result["live_calls"] = len(live)
            result["check"] = check_rows(engine, bulk, reqs)
            log(f"check: {result['check']}")
            per_k: dict = {}
            for k in args.ks:
                times: dict[str, list[float]] = {"one_by_one": [], "rows": []}
                for i in range(args.repeats + 1):  # the first of each way unmeasured
                    for way in ("rows", "one_by_one") if i % 2 else ("one_by_one", "rows"):
                        with rows_off(bulk) if way == "one_by_one" else contextlib.nullcontext():
                            ms, opened = timed_open(engine, reqs.take(k), sync)
                        for s in opened:
                            if isinstance(s, Exception):
                                raise s
                            engine.cancel(s)
                        if i:
                            times[way].append(ms)
                per_k[str(k)] = {f"{way}_ms": summary(v) for way, v in times.items()}
                log(f"k={k}: {per_k[str(k)]}")
            result["per_k"] = per_k
    finally:
        for s in live:
            engine.cancel(s)
        if not cuda:
            bulk.row_prefills.entries.clear()
    write(args.out, NAME, result, markdown(result))
    return result


if __name__ == "__main__":
    sys.exit(main())
