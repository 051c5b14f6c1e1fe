"""The last level of a proxy run: where each utterance's first audio went (the median and p95 of
each step of its timeline), the chunks' slack (a chunk's playback time less its arrival, the
least of each utterance's), the garbage collections within the level, the engine's rounds
(period, GIL and timer waits), and each busy thread's CPU an utterance.

    python analyze.py DIR      # DIR from run.sh: callers.json, and server.json in a server run
"""

import itertools
import json
import os
import statistics
import sys

STEPS = ["due", "cli_connect", "srv_tcp", "srv_cfg", "srv_text", "cli_sent", "eng_open",
         "eng_post", "deq", "srv_sent", "cli_first"]


def pct(values, p):
    v = sorted(values)
    if not v:
        return float("nan")
    k = (len(v) - 1) * p / 100
    i = int(k)
    j = min(i + 1, len(v) - 1)
    return v[i] + (v[j] - v[i]) * (k - i)


def load(path):
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def main(folder):
    T = {}
    for name in ("callers.json", "server.json"):
        for key, events in (load(os.path.join(folder, name)) or {}).items():
            T.setdefault(key, {}).update(events)
    last = max(d["level"] for d in T.values() if "level" in d)
    rows = [d for d in T.values() if d.get("level") == last and "cli_first" in d]
    end = max(d["cli_first"] for d in rows)
    out = {"utterances": len(rows), "steps_ms": {}}
    print(f"{folder}: last level, {len(rows)} utterances with audio")
    present = [e for e in STEPS if sum(e in d for d in rows) > 0.9 * len(rows)]
    for a, b in itertools.pairwise(present):
        v = [(d[b] - d[a]) * 1e3 for d in rows if a in d and b in d]
        out["steps_ms"][f"{a}->{b}"] = {"p50": pct(v, 50), "p95": pct(v, 95)}
        print(f"  {a:>12} -> {b:<12} p50 {pct(v, 50):7.2f}  p95 {pct(v, 95):7.2f} ms")
    first = [(d["cli_first"] - d["due"]) * 1e3 for d in rows]
    out["first_audio_ms"] = {"p50": pct(first, 50), "p95": pct(first, 95), "p99": pct(first, 99)}
    print(f"  first audio p50 {pct(first, 50):.1f}  p95 {pct(first, 95):.1f}  p99 {pct(first, 99):.1f} ms")
    slack = []
    for d in rows:
        arrivals, samples = d.get("arrivals"), d.get("samples")
        if arrivals and len(arrivals) > 1:
            play, least = arrivals[0], float("inf")
            for i in range(1, len(arrivals)):
                play += samples[i - 1] / 24000
                least = min(least, play - arrivals[i])
            slack.append(least * 1e3)
    out["least_slack_ms"] = {"min": min(slack), "p1": pct(slack, 1), "p5": pct(slack, 5),
                             "underran": sum(s < -1e-3 for s in slack)}
    print(f"  least slack: min {min(slack):.1f}  p1 {pct(slack, 1):.1f}  p5 {pct(slack, 5):.1f} ms;"
          f" {out['least_slack_ms']['underran']} underran")
    for name in ("callers.json", "server.json"):
        if not os.path.exists(os.path.join(folder, name)):
            continue
        collections = load(os.path.join(folder, name + ".gc")) or []
        by_gen: dict[int, list[float]] = {}
        for t, gen, ms in collections:
            if last <= t <= end:
                by_gen.setdefault(gen, []).append(ms)
        out[f"gc_{name}"] = {g: {"n": len(v), "max_ms": max(v)} for g, v in sorted(by_gen.items())}
        print(f"  {name} collections (generation: count, longest ms): "
              + ", ".join(f"{g}: {len(v)}, {max(v):.1f}" for g, v in sorted(by_gen.items())))
        rounds = [r for r in load(os.path.join(folder, name + ".rounds")) or [] if last <= r[0] <= end]
        if len(rounds) > 2:
            period = (rounds[-1][0] - rounds[0][0]) / (len(rounds) - 1) * 1e3
            wait = [r[3] for r in rounds]
            out["rounds"] = {"period_ms": period, "rows": statistics.mean(r[2] for r in rounds),
                             "wait_ms_mean": statistics.mean(wait), "wait_ms_p95": pct(wait, 95),
                             "posting_ms_mean": statistics.mean(r[4] for r in rounds)}
            print(f"  rounds: {period:.2f} ms apart, {out['rounds']['rows']:.1f} rows, waits past the model"
                  f" {statistics.mean(wait):.2f} (p95 {pct(wait, 95):.2f}) ms a round")
        cpu = load(os.path.join(folder, name + ".cpu"))
        inside = [r for r in cpu or [] if last <= r[0] <= end]
        if len(inside) >= 2:
            a, b = inside[0], inside[-1]
            n = sum(1 for d in rows if a[0] <= d["due"] <= b[0])
            # /proc lists a process's threads in creation order, the main one (the loop) first;
            # the smallest id is not it once thread ids have wrapped.
            main_tid = next(iter(cpu[0][1]))
            used = {tid: [b[1][tid][i] - a[1].get(tid, [0, 0])[i] for i in (0, 1)] for tid in b[1]}
            busy = sorted(used.items(), key=lambda kv: -kv[1][1])[:2]
            out[f"cpu_{name}"] = {("main" if t == main_tid else "other"): v[1] / max(1, n) * 1e3
                                  for t, v in busy}
            print(f"  {name} CPU an utterance: " + ", ".join(
                f"{'event loop' if t == main_tid else 'thread ' + t} {v[1] / max(1, n) * 1e3:.2f} ms"
                f" ({v[1] / (b[0] - a[0]) * 100:.0f} % of a core)" for t, v in busy))
    with open(os.path.join(folder, "summary.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
