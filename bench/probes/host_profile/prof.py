"""Per-stream host cost of an EngineService round on CPU (tiny random checkpoint).

Usage: python3 bench/probes/host_profile/prof.py [--ns 8,32,64] [--frames 200] [--decode fake|real]
                                     [--overlap 1|0] [--profile 1|0] [--out /tmp/host_profile]
Two passes per N: (1) RoundTimer only (the repo's own host_s = wall - prefill - decode - vocoder),
(2) cProfile inside the engine thread over the steady rounds (attribution; cProfile inflates).
decode=fake: backend.decode_frames returns random non-EOS codes (no model) so rounds are short
and host dominates; it is timed as "decode" like the GPU's decode_frames, so host_s is unaffected.
"""
from __future__ import annotations

import argparse, asyncio, cProfile, json, pstats, statistics, sys, time, os
from pathlib import Path

import numpy as np
import torch

from pipecat_qwen_fast import QwenTTSEngine, SynthesisRequest
from pipecat_qwen_fast.engine.service import EngineService

REPO = Path(__file__).resolve().parents[3]
# The tiny random CustomVoice checkpoint the CPU tests build (tests/conftest.py), EOS row zeroed.
CKPT = REPO / ".cache/ckpt/tiny-custom_voice-default-eos0-s0-bfloat16-b9eb2e36d628d8d2"
torch.set_num_threads(1)


class ProfService(EngineService):
    """Turns a cProfile profiler on/off in the engine thread at round boundaries (in _take_opens,
    called once at the start of every round)."""
    prof_from = None  # round index to start
    prof_to = None
    prof: cProfile.Profile | None = None
    prof_rounds = 0
    prof_stepped = 0
    _on = False

    marks = None
    full_prof = False

    def _serve(self):
        if self.prof is not None and self.full_prof:
            self._on = True
            self.prof.enable()
            try:
                return super()._serve()
            finally:
                self.prof.disable()
                self._on = False
        return super()._serve()

    def _take_opens(self, streams):
        if self.marks is not None:
            self.marks.append((time.perf_counter(), time.thread_time(), self.rounds, self.round_streams))
        if self.prof is not None and not self.full_prof:
            r = self.rounds
            if not self._on and self.prof_from is not None and self.prof_from <= r < self.prof_to:
                self._on = True
                self._r0, self._s0 = r, self.round_streams
                self.prof.enable()
            elif self._on and r >= self.prof_to:
                self.prof.disable()
                self._on = False
                self.prof_rounds = r - self._r0
                self.prof_stepped = self.round_streams - self._s0
        return super()._take_opens(streams)


ACTIVE = {"svc": None}


def paused(fn):
    """Model compute: the profiler is off inside it (timed as decode/vocoder by the RoundTimer)."""
    def wrapper(*a, **k):
        svc = ACTIVE["svc"]
        on = svc is not None and svc._on and not svc.full_prof
        if on:
            svc.prof.disable()
        try:
            return fn(*a, **k)
        finally:
            if on:
                svc.prof.enable()
    return wrapper


def install_fake_vocoder(engine, mode):
    voc = engine.vocoder
    if mode == "fake":
        def decode_streams(codes, streams, check_values=True, valid=None):
            return torch.zeros(codes.shape[0], 1, codes.shape[-1] * 1920)

        def decode_stream(codes, stream, check_values=True):
            return torch.zeros(codes.shape[0], 1, codes.shape[-1] * 1920)
    else:
        decode_streams, decode_stream = voc.decode_streams, voc.decode_stream
    voc.decode_streams = paused(decode_streams)
    voc.decode_stream = paused(decode_stream)


def install_fake_decode(engine, mode):
    backend = engine.backend
    backend.max_batch = 4096
    if mode == "fake":
        gen = torch.Generator().manual_seed(0)

        def decode_frames(states, force=None):
            n = len(states)
            for s in states:
                s.frame += 1
            return torch.randint(0, 1024, (n, 16), generator=gen)
    else:
        def decode_frames(states, force=None):
            return torch.stack([backend.decode_frame(s) for s in states])
    backend.decode_frames = paused(decode_frames)


async def run_one(engine, n, frames, overlap, profile, out):
    cls = ProfService
    if profile == 2:
        cls = type("FullProf", (ProfService,), {"prof": cProfile.Profile(), "full_prof": True})
    svc = cls(lambda: engine, owns_engine=False, overlap_vocoder=overlap, max_streams=None,
                      max_queued_streams=None, max_round_ms=None, min_slack_ms=None)
    await svc.wait_ready()
    ACTIVE["svc"] = svc
    if profile == 1:
        svc.prof = cProfile.Profile()
        # steady window: after the opens and the first chunks, before the ends
        svc.prof_from, svc.prof_to = int(frames * 0.15), int(frames * 0.9)
    svc.marks = []
    svc.time_rounds(True)
    streams = [svc.open_stream(SynthesisRequest(f"Stream number {i} says hello.", seed=i, max_frames=frames))
               for i in range(n)]
    t0 = time.perf_counter()

    async def consume(st):
        k = 0
        async for _ in st:
            k += 1
        return k

    chunks = await asyncio.gather(*(consume(s) for s in streams))
    wall = time.perf_counter() - t0
    rt = list(svc.round_timings)
    await svc.aclose()
    steady = [r for r in rt if r.opened == 0 and r.stepped > 0]
    # steady: rounds with all n stepped (excludes tail/opens)
    full = [r for r in steady if r.stepped == n]
    res = {
        "n": n, "rounds": len(rt), "full_rounds": len(full), "chunks": sum(chunks), "wall_s": wall,
        "host_ms_mean": 1e3 * statistics.fmean(r.host_s for r in full),
        "host_ms_median": 1e3 * statistics.median(r.host_s for r in full),
        "wall_ms_mean": 1e3 * statistics.fmean(r.wall_s for r in full),
        "decode_ms_mean": 1e3 * statistics.fmean(r.decode_s for r in full),
        "vocoder_ms_mean": 1e3 * statistics.fmean(r.vocoder_s for r in full),
        "host_us_per_round": [round(1e6 * r.host_s, 1) for r in rt if r.opened == 0 and r.stepped > 0],
        "open_round_ms": [round(1e3 * r.wall_s, 2) for r in rt if r.opened][:3],
    }
    m = [x for x in svc.marks if 0.15 * frames <= x[2] <= 0.9 * frames]
    if len(m) > 2:
        dr = m[-1][2] - m[0][2]
        res["loop_wall_ms_per_round"] = 1e3 * (m[-1][0] - m[0][0]) / dr
        res["loop_cpu_ms_per_round"] = 1e3 * (m[-1][1] - m[0][1]) / dr
    if profile == 2:
        svc.prof_rounds = svc.rounds
        svc.prof_stepped = svc.round_streams
    if profile and svc.prof_rounds:
        st = pstats.Stats(svc.prof)
        funcs = {}
        for (fn, line, name), (cc, nc, tt, ct, callers) in st.stats.items():
            key = f"{os.path.relpath(fn, REPO) if fn.startswith(str(REPO)) else fn}:{line}({name})"
            funcs[key] = {"ncalls": nc, "tottime_us_per_round": 1e6 * tt / svc.prof_rounds,
                          "cumtime_us_per_round": 1e6 * ct / svc.prof_rounds}
        res["prof_rounds"] = svc.prof_rounds
        res["prof_stepped_per_round"] = svc.prof_stepped / svc.prof_rounds
        res["funcs"] = funcs
        st.dump_stats(str(out / f"prof_n{n}.pstats"))
    return res


def fit(xs, ys):
    a, b = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    return a, b


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ns", default="8,32,64")
    ap.add_argument("--frames", type=int, default=200)
    ap.add_argument("--decode", default="fake")
    ap.add_argument("--vocoder", default="fake")
    ap.add_argument("--overlap", type=int, default=1)
    ap.add_argument("--profile", type=int, default=2, help="0 off, 1 steady window (misses _serve self time), 2 whole run")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", default="/tmp/host_profile")
    a = ap.parse_args()
    out = Path(a.out); out.mkdir(parents=True, exist_ok=True)
    engine = QwenTTSEngine.from_pretrained(CKPT, progress=False, device="cpu", dtype="float32", backend="torch")
    install_fake_decode(engine, a.decode)
    install_fake_vocoder(engine, a.vocoder)
    ns = [int(x) for x in a.ns.split(",")]
    asyncio.run(run_one(engine, 4, 40, bool(a.overlap), False, out))  # warm
    timed = {}
    for rep in range(a.reps):
        for n in ns:
            r = asyncio.run(run_one(engine, n, a.frames, bool(a.overlap), False, out))
            timed.setdefault(n, []).append(r)
            print(f"[loop] n={n} engine-thread wall/round {r.get('loop_wall_ms_per_round', 0):.3f} ms, cpu/round {r.get('loop_cpu_ms_per_round', 0):.3f} ms")
            print(f"[timer] n={n} rep={rep} host/round {r['host_ms_mean']:.3f} ms (median {r['host_ms_median']:.3f}) "
                  f"wall {r['wall_ms_mean']:.3f} decode {r['decode_ms_mean']:.3f} vocoder {r['vocoder_ms_mean']:.3f} "
                  f"full_rounds {r['full_rounds']} chunks {r['chunks']}", flush=True)
    best = {n: min(rs, key=lambda r: r["host_ms_mean"]) for n, rs in timed.items()}
    slope, icpt = fit(ns, [best[n]["host_ms_mean"] for n in ns])
    mslope, micpt = fit(ns, [best[n]["host_ms_median"] for n in ns])
    print(f"[timer] host per round (mean, best of reps) = {icpt*1e3:.1f} us + {slope*1e3:.2f} us/stream; "
          f"median fit {micpt*1e3:.1f} us + {mslope*1e3:.2f} us/stream")
    summary = {"args": vars(a), "timer": {str(n): [{k: v for k, v in r.items() if k != 'funcs'} for r in rs] for n, rs in timed.items()},
               "host_fit_us": {"fixed": icpt * 1e3, "per_stream": slope * 1e3,
                               "fixed_median": micpt * 1e3, "per_stream_median": mslope * 1e3}}
    if a.profile:
        prof = {n: asyncio.run(run_one(engine, n, a.frames, bool(a.overlap), a.profile, out)) for n in ns}
        keys = set().union(*(p["funcs"].keys() for p in prof.values()))
        rows = []
        for k in keys:
            tt = [prof[n]["funcs"].get(k, {}).get("tottime_us_per_round", 0.0) for n in ns]
            ct = [prof[n]["funcs"].get(k, {}).get("cumtime_us_per_round", 0.0) for n in ns]
            nc = [prof[n]["funcs"].get(k, {}).get("ncalls", 0) / prof[n]["prof_rounds"] for n in ns]
            ts, ti = fit(ns, tt)
            cs, ci = fit(ns, ct)
            rows.append({"func": k, "tot_slope_us": ts, "tot_fixed_us": ti, "cum_slope_us": cs, "cum_fixed_us": ci,
                         "calls_per_round": nc, "tot_us": tt, "cum_us": ct})
        summary["profile"] = {"ns": ns, "prof_rounds": {n: prof[n]["prof_rounds"] for n in ns},
                              "stepped": {n: prof[n]["prof_stepped_per_round"] for n in ns}, "rows": rows}
        print("\n== cProfile: top by tottime slope (us per stream per round, profiled) ==")
        for r in sorted(rows, key=lambda r: -r["tot_slope_us"])[:45]:
            print(f"{r['tot_slope_us']:8.2f} us/st  fixed {r['tot_fixed_us']:8.1f}  cum/st {r['cum_slope_us']:8.2f}  "
                  f"calls/round {['%.1f' % c for c in r['calls_per_round']]}  {r['func']}")
        print("\n== cProfile: top by cumtime slope ==")
        for r in sorted(rows, key=lambda r: -r["cum_slope_us"])[:45]:
            print(f"{r['cum_slope_us']:8.2f} us/st  cum fixed {r['cum_fixed_us']:8.1f}  tot/st {r['tot_slope_us']:8.2f}  "
                  f"calls/round {['%.1f' % c for c in r['calls_per_round']]}  {r['func']}")
    (out / f"summary_{a.decode}_{a.vocoder}_ov{a.overlap}_p{a.profile}.json").write_text(json.dumps(summary, indent=1, default=str))


if __name__ == "__main__":
    main()
