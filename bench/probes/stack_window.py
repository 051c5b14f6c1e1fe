"""Where each thread's time went in one window of a run, from a stack sampler's history.

    python3 bench/probes/stack_window.py OUT/stacks/stacks-PID.jsonl[.gz] --start 15:26:18 --end 15:26:40 [--top 25]

The history (pipecat_qwen_fast/engine/stack_samples.py, QWEN_FAST_STACK_SAMPLES) holds the counts
so far every 5 s (10 s in session 35); the window is the difference of the last line at or before --start and the
first at or after --end (times as epoch seconds, or HH:MM:SS UTC on the history's day, as
bench fleet's log prints them). Prints, per thread, its samples and the functions with the most
samples innermost ("self") and anywhere on the stack ("total"), as shares of its samples.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gzip
import json
from pathlib import Path


def when(text: str, day: dt.date) -> float:
    try:
        return float(text)
    except ValueError:
        clock = dt.time.fromisoformat(text)
        return dt.datetime.combine(day, clock, tzinfo=dt.UTC).timestamp()


def window(snapshots: list[dict], start: float, end: float) -> dict:
    """Per thread: samples, self and total counts between the two snapshots around the window."""
    before = [s for s in snapshots if s["t"] <= start]
    after = [s for s in snapshots if s["t"] >= end]
    first = before[-1] if before else {"t": None, "threads": {}}
    last = after[0] if after else snapshots[-1]
    out = {"from": first["t"], "to": last["t"], "threads": {}}
    for name, now in last["threads"].items():
        was = first["threads"].get(name, {"samples": 0, "self": {}, "total": {}})
        out["threads"][name] = {
            "samples": now["samples"] - was["samples"],
            **{kind: {k: v - was[kind].get(k, 0) for k, v in now[kind].items() if v > was[kind].get(k, 0)}
               for kind in ("self", "total")}}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("history")
    ap.add_argument("--start", default="0")
    ap.add_argument("--end", default="inf")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    path = Path(args.history)
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    snapshots = [json.loads(line) for line in text.splitlines() if line]
    day = dt.datetime.fromtimestamp(snapshots[0]["t"], dt.UTC).date()
    got = window(snapshots, when(args.start, day), when(args.end, day))
    print(f"window {got['from']} .. {got['to']}")
    for name, thread in sorted(got["threads"].items(), key=lambda kv: -kv[1]["samples"]):
        n = thread["samples"]
        if not n:
            continue
        print(f"\n## {name}: {n} samples")
        for kind in ("self", "total"):
            print(f"  {kind}:")
            for key, v in sorted(thread[kind].items(), key=lambda kv: -kv[1])[:args.top]:
                print(f"    {100 * v / n:5.1f} %  {key}")


if __name__ == "__main__":
    main()
