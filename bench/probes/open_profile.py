"""What opening one call costs on the batch path, phase by phase:
`python bench/probes/open_profile.py --model DIR --out DIR [--opens N] [--text-mode prefill|dual_track]`.

Why: in the H200 fleet run (bench/results/2026-11-26-h200-wave3/run6-fleet-warm), a round's
"prefill" time (engine/round_timing.py: all of `QwenTTSEngine.open_sessions`, between two device
syncs) came to ~3 ms per opened call at 192-512 callers, where the captured prefill's replay is
said to take ~0.6 ms; at 512 callers ~100 calls open a second, ~30 % of the GPU's time.

The engine is loaded as `bench fleet` loads it (`from_pretrained`, then `finish_warmup()`: the
batch path warm), and every call goes to the batch path (`HybridBackend.placed(False)`, where the
backend has it): `--live` calls (default 32) are opened there first and stepped `--prestep`
frames, so that the state is a busy engine's. Then calls are opened one open_sessions() at a time
(`--per-round` requests each, default 1, as a fleet round opens one or two), texts from the fleet
workload (bench/texts.FLEET_REPLIES, the fleet's requests: default voice, seed, max_frames); after
each open the live calls and the new one are stepped one round, the oldest retired past `--live`,
and finished ones replaced (none of that is measured). After `--warm-opens` unmeasured opens:

* plain: `--opens` opens timed whole, a device sync on either side, as round_timing times them;
* split: as many opens, alternating with the plain ones, the engine's own methods shadowed by instance attributes (as
  round_timing does) that time each phase between device syncs: `validate` (`_new_session`:
  request checks, text normalization, the segments object; the text is tokenized later),
  `prompt` (`_begin_segment` less the backend state: the segment's text, tokenizing, the prompt's
  embeddings), `backend_state` (`backend.new_state`: slot, pages, generator, text rows, noise),
  `prefill` (`_prefill`: the backend's `prefill_many`/`prefill`; inside it `prefill.graph`, the
  captured prefill's `PrefillGraphs.run` with its input copies, and `prefill.kv_write`, the K/V
  rows into the slot's pages), `vocoder_stream` (`_start_vocoder`: `Vocoder.new_stream`), and
  `other` (the rest of open_sessions). The inner syncs cost a little: the split open is slower
  than the plain one by about their number times a sync;
* profile: `--profile-opens` opens (after one thrown away) under torch.profiler, CPU and CUDA
  activities, the same phases marked with record_function: per phase and per open the CUDA
  kernels run (graph replays' kernels included), the host's launch calls, cudaMemcpy*/cudaMemset*
  calls, the synchronizations the engine's code makes (stream and event syncs; the probe's own
  device syncs are counted apart), the GPU's busy time, and the top 15 ops by count and by host
  time. Every phase is bracketed by device syncs, so an event is the phase's whose time range
  holds its start (the innermost one).

`--gil-busy-ms B` adds a thread that runs pure Python for B ms, sleeps `--gil-idle-ms`, and so
on, while everything runs: a stand-in for the fleet's event loop, which shares the interpreter
with the engine thread (in-process callers). Each device sync releases the GIL; when the other
thread is waiting, the engine thread gets it back only after that thread's turn (at most the
switch interval, 5 ms by default): a fleet's phase times may hold such waits, this probe's do not
unless asked.

On a CPU (the tiny checkpoint: tests/test_open_profile_probe.py) the same runs without device
syncs and the profile has CPU ops only: the CUDA parts are skipped and the reason printed.

Writes OUT/open_profile.json (per-open records, phase medians/p90/means in ms, the profile) and
OUT/open_profile.md (the table, also printed).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import functools
import json
import logging
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[2])]  # the repository
from pipecat_qwen_fast.bench import texts
from pipecat_qwen_fast.bench.main import git_commit
from pipecat_qwen_fast.engine.request import SynthesisRequest
from pipecat_qwen_fast.model.prompt import prompt_dtype

RESULT = "open_profile.json"
MARKDOWN = "open_profile.md"
# The phases of an open that do not nest in one another: their times sum to at most the open's.
PHASES = ("validate", "prompt", "backend_state", "prefill", "vocoder_stream")
PHASE_DEFINITIONS = {
    "validate": "QwenTTSEngine._new_session: request checks, text normalization, voice/language, sampling, "
                "the segments object (the text is tokenized later, in prompt)",
    "prompt": "QwenTTSEngine._begin_segment less backend_state: the segment's text, tokenizing, build_prompt",
    "backend_state": "backend.new_state (the auto backend's, which calls its batch side's)",
    "prefill": "QwenTTSEngine._prefill: backend.prefill_many / prefill",
    "prefill.graph": "PrefillGraphs.run of the batch side: input copies and the captured prefill's replay",
    "prefill.kv_write": "GraphBackend._write_positions: the prompt's K/V rows into the slot's pages",
    "prefill.rest": "prefill less its subphases (the prompt's dtype cast, the hidden state's copy, Python)",
    "vocoder_stream": "QwenTTSEngine._start_vocoder: Vocoder.new_stream (and an ICL voice's priming)",
    "other": "open_sessions less the phases above",
}
# Inside `prefill` (where the backend has them): the captured prefill and the K/V write.
SUBPHASES = ("prefill.graph", "prefill.kv_write")
TOP = 15
_MISSING = object()


def log(msg: str) -> None:
    print(f"[open_profile {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- phase timing


class PhaseTimer:
    """Shadows engine methods by instance attributes that time them between device syncs.

    Only while `active`: the root (`open_sessions`) opens a record, each phase inside adds its
    inclusive and exclusive (less the phases timed inside it) seconds to it. With `inner` False,
    only the root is timed (the plain pass). With `annotate`, each timed call is also a
    record_function range "phase::NAME" (the profile pass), its trailing sync inside the range so
    that the GPU work it launched lies in it."""

    def __init__(self, device: torch.device) -> None:
        self.sync = functools.partial(torch.cuda.synchronize, device) if device.type == "cuda" else None
        self.active = False
        self.inner = True
        self.annotate = False
        self.record: dict[str, list[float]] | None = None
        self.stack: list[list] = []
        self.patched: list[tuple[object, str, object]] = []

    def wrap(self, owner: object, attr: str, name: str, root: bool = False) -> bool:
        fn = getattr(owner, attr, None)
        if fn is None:
            return False
        previous = owner.__dict__.get(attr, _MISSING)

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.active or (not root and (not self.inner or self.record is None)):
                return fn(*args, **kwargs)
            if root:
                self.record = {}
            if self.sync is not None:
                self.sync()
            frame = [name, 0.0]
            self.stack.append(frame)
            annotation = torch.profiler.record_function(f"phase::{name}") if self.annotate else contextlib.nullcontext()
            t0 = time.perf_counter()
            try:
                with annotation:
                    try:
                        return fn(*args, **kwargs)
                    finally:
                        if self.sync is not None:
                            self.sync()
            finally:
                dt = time.perf_counter() - t0
                self.stack.pop()
                if self.stack:
                    self.stack[-1][1] += dt
                acc = self.record.setdefault(name, [0.0, 0.0])
                acc[0] += dt
                acc[1] += dt - frame[1]

        setattr(owner, attr, timed)
        self.patched.append((owner, attr, previous))
        return True

    def take(self) -> dict[str, list[float]]:
        record, self.record = self.record or {}, None
        return record

    def remove(self) -> None:
        for owner, attr, previous in reversed(self.patched):
            if previous is _MISSING:
                delattr(owner, attr)
            else:
                setattr(owner, attr, previous)
        self.patched = []


def install(timer: PhaseTimer, engine) -> list[str]:
    """The phases' wrappers on this engine; returns the subphases its backend has."""
    backend = engine.backend
    bulk = getattr(backend, "bulk", backend)  # the batch side of the auto backend
    timer.wrap(engine, "open_sessions", "open", root=True)
    timer.wrap(engine, "_new_session", "validate")
    timer.wrap(engine, "_begin_segment", "prompt")  # reported less backend_state (exclusive)
    timer.wrap(backend, "new_state", "backend_state")
    timer.wrap(engine, "_prefill", "prefill")
    timer.wrap(engine, "_start_vocoder", "vocoder_stream")
    subs = []
    prefills = getattr(bulk, "prefills", None)
    if prefills is not None and timer.wrap(prefills, "run", "prefill.graph"):
        subs.append("prefill.graph")
    if timer.wrap(bulk, "_write_positions", "prefill.kv_write"):
        subs.append("prefill.kv_write")
    return subs


def open_record(raw: dict[str, list[float]], subs: list[str]) -> dict:
    """One open's times in ms: the phases, `other` (the open less its phases) and the subphases."""
    def incl(name):
        return 1e3 * raw.get(name, (0.0, 0.0))[0]

    def excl(name):
        return 1e3 * raw.get(name, (0.0, 0.0))[1]

    phases = {"validate": incl("validate"), "prompt": excl("prompt"), "backend_state": incl("backend_state"),
              "prefill": incl("prefill"), "vocoder_stream": incl("vocoder_stream")}
    rec = {"open_ms": incl("open"), "phases_ms": phases, "other_ms": excl("open")}
    if subs:
        rec["subphases_ms"] = {s: incl(s) for s in subs} | {"prefill.rest": excl("prefill")}
    return rec


def stats(values: list[float]) -> dict:
    if not values:
        return {"n": 0, "median": None, "p90": None, "mean": None}
    return {"n": len(values), "median": statistics.median(values), "p90": float(np.percentile(values, 90)),
            "mean": statistics.fmean(values), "min": min(values), "max": max(values)}


# ----------------------------------------------------------------------------- the workload


class Workload:
    """The live calls on the batch path and the fleet's requests, one seed each."""

    def __init__(self, engine, args: argparse.Namespace) -> None:
        self.engine = engine
        self.args = args
        self.replies = [(t, texts.frames_for(t)) for t in texts.FLEET_REPLIES]
        self.seed = 0
        self.live: collections.deque = collections.deque()
        self.refused = 0
        self.on_fast: collections.Counter = collections.Counter()  # the probe's own opens, by path
        self.voice_clone = None
        if engine.config.model_type == "base":  # no preset voice: a zero x-vector, as warm-up uses
            from pipecat_qwen_fast.model.prompt import VoiceClonePrompt

            self.voice_clone = VoiceClonePrompt(x_vector=torch.zeros(engine.config.talker.hidden_size))

    def request(self) -> tuple[SynthesisRequest, int]:
        i = self.seed % len(self.replies)
        text, frames = self.replies[i]
        self.seed += 1
        return SynthesisRequest(text, voice=self.engine.default_voice, voice_clone=self.voice_clone,
                                seed=self.seed, max_frames=frames, text_mode=self.args.text_mode), i

    def add(self, opened: list) -> list:
        sessions = []
        for s in opened:
            if isinstance(s, Exception):
                self.refused += 1
                log(f"an open was refused: {type(s).__name__}: {s}")
            else:
                sessions.append(s)
        self.live.extend(sessions)
        return sessions

    def refill(self) -> None:
        missing = self.args.live - len(self.live)
        if missing > 0:
            self.add(self.engine.open_sessions([self.request()[0] for _ in range(missing)]))

    def round(self) -> None:
        """One round of every live call (unmeasured), the finished ones dropped, the oldest
        retired past --live, the live set refilled."""
        while len(self.live) > self.args.live:
            self.engine.cancel(self.live.popleft())
        if self.live:
            self.engine.step_many(list(self.live))
        self.live = collections.deque(s for s in self.live if not s.done)
        self.refill()

    def open(self) -> tuple[list, list[int]]:
        """One open_sessions() of --per-round fleet requests (timed by whoever wraps it)."""
        reqs = [self.request() for _ in range(self.args.per_round)]
        sessions = self.add(self.engine.open_sessions([r for r, _ in reqs]))
        for s in sessions:
            self.on_fast[bool(getattr(s.state, "on_fast", False))] += 1
        return sessions, [i for _, i in reqs]

    def close(self) -> None:
        for s in self.live:
            self.engine.cancel(s)
        self.live.clear()


def positions(session) -> int | None:
    """The prompt's length as the backend holds it (before any frame)."""
    st = getattr(session.state, "inner", session.state)
    pos = getattr(st, "position", None)
    if pos is None:
        cache = getattr(st, "talker_cache", None)
        pos = getattr(cache, "length", None)
    return int(pos) if pos is not None else None


def measured_opens(work: Workload, timer: PhaseTimer, n: int, subs: list[str]) -> tuple[list[dict], list[dict]]:
    """`n` plain and `n` split opens, alternately (drift in the engine's state or the host's
    speed falls on both passes alike): (plain records, split records)."""
    plain, split = [], []
    for i in range(2 * n):
        inner = i % 2 == 1
        timer.active, timer.inner = True, inner
        try:
            sessions, idx = work.open()
        finally:
            timer.active = False
        rec = open_record(timer.take(), subs if inner else [])
        if not inner:
            rec = {"open_ms": rec["open_ms"]}
        rec["texts"] = idx
        rec["prompt_positions"] = [positions(s) for s in sessions]
        (split if inner else plain).append(rec)
        work.round()
    return plain, split


# ----------------------------------------------------------------------------- the profile


def _runtime(name: str) -> bool:
    """A CUDA runtime or driver API call (cudaLaunchKernel, cuLaunchKernel, cudaMemcpyAsync, ...)."""
    return name.startswith("cuda") or (name.startswith("cu") and name[2:3].isupper())


def innermost(ranges: list[tuple], t: float) -> str | None:
    """The innermost of the nested (start, end, name, thread) ranges, sorted by start, that holds t."""
    inner = None
    for start, end, name, _ in ranges:
        if start > t:
            break
        if t <= end:
            inner = name
    return inner


def merged(*buckets: dict) -> dict:
    """The sum of profile buckets (profile_opens)."""
    out = {"kernels": 0, "memcpy": 0, "memset": 0, "gpu_busy_us": 0.0,
           "runtime_calls": collections.defaultdict(lambda: [0, 0.0]),
           "ops": collections.defaultdict(lambda: [0, 0.0, 0.0]),
           "kernel_names": collections.defaultdict(lambda: [0, 0.0])}
    for b in buckets:
        for k in ("kernels", "memcpy", "memset", "gpu_busy_us"):
            out[k] += b[k]
        for k in ("runtime_calls", "ops", "kernel_names"):
            for name, values in b[k].items():
                out[k][name] = [x + y for x, y in zip(out[k][name], values)]
    return out


def attribute(events: list, per_phase: dict[str, dict]) -> None:
    """Add one profiled open's events (torch.profiler FunctionEvents) to `per_phase`, each to the
    innermost "phase::NAME" range that holds its start (exclusive): CPU ops of the phases' thread
    and CUDA runtime/driver calls of any; device events (kernels, memcpy, memset) by their time,
    which lies inside their phase since each phase ends with a device sync."""
    from torch.autograd import DeviceType

    ranges = sorted(((e.time_range.start, e.time_range.end, e.name.removeprefix("phase::"), e.thread)
                     for e in events if e.name.startswith("phase::") and e.device_type == DeviceType.CPU),
                    key=lambda r: r[0])
    threads = {r[3] for r in ranges}
    for e in events:
        if e.name.startswith("phase::") or getattr(e, "is_user_annotation", False):
            continue
        phase = innermost(ranges, e.time_range.start)
        if phase is None:
            continue
        dur = e.time_range.end - e.time_range.start
        if e.device_type == DeviceType.CPU:
            if _runtime(e.name):
                call = per_phase.setdefault(phase, merged())["runtime_calls"][e.name]
                call[0] += 1
                call[1] += dur
            elif e.thread in threads:
                op = per_phase.setdefault(phase, merged())["ops"][e.name]
                op[0] += 1
                op[1] += e.self_cpu_time_total
                op[2] += e.cpu_time_total
            continue
        b = per_phase.setdefault(phase, merged())
        b["gpu_busy_us"] += dur
        if e.name.startswith("Memcpy"):
            b["memcpy"] += 1
        elif e.name.startswith("Memset"):
            b["memset"] += 1
        else:
            b["kernels"] += 1
            k = b["kernel_names"][e.name]
            k[0] += 1
            k[1] += dur


def phase_entries(per_phase: dict[str, dict], counted: int, cuda: bool) -> dict:
    """The profile's report per phase, per open over `counted` opens: `prefill` with its
    subphases (as its time is), `prefill.rest` without them, `other` the open's own events."""
    per_phase = dict(per_phase)
    if any(sub in per_phase for sub in SUBPHASES):
        per_phase["prefill.rest"] = per_phase.get("prefill") or merged()
        per_phase["prefill"] = merged(per_phase["prefill.rest"], *(per_phase[s] for s in SUBPHASES if s in per_phase))
    out = {}
    for phase, b in per_phase.items():
        calls = {k: v[0] for k, v in b["runtime_calls"].items()}
        launches = sum(v for k, v in calls.items() if "LaunchKernel" in k or k in ("cudaGraphLaunch", "cuGraphLaunch"))
        memcpy_calls = sum(v for k, v in calls.items() if k.startswith(("cudaMemcpy", "cuMemcpy")))
        memset_calls = sum(v for k, v in calls.items() if k.startswith(("cudaMemset", "cuMemset")))
        # The probe's own syncs are device syncs (torch.cuda.synchronize); the engine's code syncs
        # streams or events (a blocking copy, .item(), an event's wait).
        syncs = {k: v for k, v in calls.items() if k.endswith("Synchronize") and k != "cudaDeviceSynchronize"}
        by_count = sorted(b["ops"].items(), key=lambda kv: -kv[1][0])
        by_time = sorted(b["ops"].items(), key=lambda kv: -kv[1][1])

        def op_rows(rows):
            return [{"op": k, "count_per_open": v[0] / counted, "self_host_us_per_open": round(v[1] / counted, 1),
                     "total_host_us_per_open": round(v[2] / counted, 1)} for k, v in rows[:TOP]]

        kernels = sorted(b["kernel_names"].items(), key=lambda kv: -kv[1][1])
        entry = {
            "ops_per_open": sum(v[0] for v in b["ops"].values()) / counted,
            "top_ops_by_count": op_rows(by_count),
            "top_ops_by_host_time": op_rows(by_time),
            # Host time in each CUDA runtime/driver call: a pageable copy or a sync waits inside its call.
            "runtime_calls_per_open": {k: {"count": v[0] / counted, "host_us": round(v[1] / counted, 1)}
                                       for k, v in sorted(b["runtime_calls"].items(), key=lambda kv: -kv[1][1])},
        }
        if cuda:
            entry |= {
                "kernels_per_open": b["kernels"] / counted,
                "memcpy_per_open": b["memcpy"] / counted,
                "memset_per_open": b["memset"] / counted,
                "gpu_busy_ms_per_open": b["gpu_busy_us"] / counted / 1e3,
                "launch_calls_per_open": launches / counted,
                "memcpy_calls_per_open": memcpy_calls / counted,
                "memset_calls_per_open": memset_calls / counted,
                "syncs_per_open": sum(syncs.values()) / counted,
                "syncs_by_kind_per_open": {k: v / counted for k, v in syncs.items()},
                "probe_device_syncs_per_open": calls.get("cudaDeviceSynchronize", 0) / counted,
                "top_kernels_by_gpu_time": [{"kernel": k[:160], "count_per_open": v[0] / counted,
                                             "gpu_us_per_open": round(v[1] / counted, 1)} for k, v in kernels[:TOP]],
            }
        out["other" if phase == "open" else phase] = entry
    return out


def profile_opens(work: Workload, timer: PhaseTimer, n: int, cuda: bool) -> dict:
    """`n` opens, each under a torch.profiler of its own (after one thrown away: the profiler's
    start-up), the live calls stepped between them unprofiled; per phase, per open."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    per_phase: dict[str, dict] = {}
    timer.annotate = True
    try:
        for i in range(n + 1):
            with profile(activities=activities, record_shapes=False) as prof:
                timer.active, timer.inner = True, True
                try:
                    work.open()
                finally:
                    timer.active = False
                timer.take()
            if i > 0:
                attribute(list(prof.events()), per_phase)
            work.round()
    finally:
        timer.annotate = False
    return {"opens": n, "cuda": cuda, "phases": phase_entries(per_phase, n, cuda)}


# ----------------------------------------------------------------------------- report


def summarize(plain: list[dict], split: list[dict], subs: list[str]) -> dict:
    s = {"open_plain_ms": stats([r["open_ms"] for r in plain]),
         "open_split_ms": stats([r["open_ms"] for r in split]),
         "phases_ms": {p: stats([r["phases_ms"][p] for r in split]) for p in PHASES}}
    s["phases_ms"]["other"] = stats([r["other_ms"] for r in split])
    if subs:
        s["subphases_ms"] = {k: stats([r["subphases_ms"][k] for r in split]) for k in (*subs, "prefill.rest")}
    return s


def markdown(result: dict) -> str:
    s = result["summary"]
    prof = result.get("profile") or {}
    pp = prof.get("phases", {})
    cuda = prof.get("cuda", False)
    split_mean = s["open_split_ms"]["mean"] or 0.0

    def f(v, fmt="{:.3f}"):
        return "-" if v is None else fmt.format(v)

    lines = [
        f"# Opening a call on the batch path ({result['backend_name']} on {result['device']})",
        "",
        (f"{result['args']['opens']} opens a pass, {result['args']['per_round']} request(s) an open, "
         f"{result['live_calls']} calls live in the batch; commit {result.get('commit')}."),
        "",
        (f"* whole open, syncs around it only (as round_timing): median {f(s['open_plain_ms']['median'])} ms, "
         f"p90 {f(s['open_plain_ms']['p90'])} ms"),
        (f"* whole open, phases split (a sync around each): median {f(s['open_split_ms']['median'])} ms, "
         f"p90 {f(s['open_split_ms']['p90'])} ms"),
    ]
    if result.get("gil_thread"):
        g = result["gil_thread"]
        lines.append(f"* a thread held the GIL {g['busy_ms']:g} ms at a time, {g['idle_ms']:g} ms apart (--gil-busy-ms)")
    if result.get("placement_counts", {}).get("probe_opens_on_megakernel"):
        lines.append(f"* **{result['placement_counts']['probe_opens_on_megakernel']} of the probe's opens went to the "
                     "megakernel**, not the batch")
    lines += [
        "",
        ("| phase | median ms | p90 ms | mean ms | share of open | kernels/open | launch calls/open "
         "| memcpy/open | syncs/open | GPU busy ms/open | host ops/open |"),
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows = [(p, s["phases_ms"][p]) for p in (*PHASES, "other")]
    rows += [(k, v) for k, v in s.get("subphases_ms", {}).items()]
    for name, st in rows:
        p = pp.get(name, {})
        share = f"{100 * st['mean'] / split_mean:.0f} %" if split_mean and st["mean"] is not None else "-"
        if name.startswith("prefill."):
            name = f"&nbsp;&nbsp;{name}"
        lines.append(
            f"| {name} | {f(st['median'])} | {f(st['p90'])} | {f(st['mean'])} | {share} "
            f"| {f(p.get('kernels_per_open'), '{:.1f}')} | {f(p.get('launch_calls_per_open'), '{:.1f}')} "
            f"| {f(p.get('memcpy_calls_per_open'), '{:.1f}')} | {f(p.get('syncs_per_open'), '{:.1f}')} "
            f"| {f(p.get('gpu_busy_ms_per_open'))} | {f(p.get('ops_per_open'), '{:.0f}')} |")
    lines.append("")
    lines.append("Subphases (indented) lie inside `prefill`; `other` is the open less its phases. Profile counts are "
                 f"per open over {prof.get('opens', 0)} profiled opens, each event in the innermost phase holding it.")
    if not cuda:
        lines.append("")
        lines.append(f"CUDA counts skipped: {result.get('cuda_skipped')}")
    if pp:
        lines += ["", "Top host ops by own time per open (us):", ""]
        for name in (*PHASES, "other"):
            top = pp.get(name, {}).get("top_ops_by_host_time", [])[:5]
            if top:
                lines.append(f"* {name}: " + ", ".join(f"{t['op']} x{t['count_per_open']:g} "
                                                       f"{t['self_host_us_per_open']:.0f}" for t in top))
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- main


def hold_gil(stop: threading.Event, busy_ms: float, idle_ms: float) -> None:
    """Pure Python for `busy_ms` (the GIL held but for the interpreter's forced switches), then a
    sleep of `idle_ms`, until `stop`."""
    while not stop.is_set():
        end = time.perf_counter() + busy_ms / 1e3
        n = 0
        while time.perf_counter() < end:
            n += 1
        time.sleep(idle_ms / 1e3)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="a checkpoint folder")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--opens", type=int, default=40, help="opens timed in each pass (plain, split)")
    p.add_argument("--text-mode", default=None, choices=["prefill", "dual_track"],
                   help="the requests' text mode (default: the variant's)")
    p.add_argument("--backend", default="auto", help="auto | torch | megakernel | eager")
    p.add_argument("--device", default="auto", help="auto | cuda | cuda:N | cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--live", type=int, default=32, help="calls live in the batch while calls are opened")
    p.add_argument("--prestep", type=int, default=3, help="frames the live calls are stepped before the first open")
    p.add_argument("--per-round", type=int, default=1, help="requests per open_sessions() call")
    p.add_argument("--warm-opens", type=int, default=None,
                   help="unmeasured opens first (default: one per fleet text, each prompt shape seen once)")
    p.add_argument("--profile-opens", type=int, default=5, help="opens under torch.profiler (0: no profile)")
    p.add_argument("--gil-busy-ms", type=float, default=0.0,
                   help="a thread holding the GIL this long at a time, pure Python, while opens run (0: none)")
    p.add_argument("--gil-idle-ms", type=float, default=1.0, help="that thread's sleep between its turns")
    p.add_argument("--commit", default=os.environ.get("BENCH_COMMIT"))
    args = p.parse_args(argv)
    if (args.opens < 1 or args.per_round < 1 or args.live < 0 or args.prestep < 0 or args.profile_opens < 0
            or args.gil_busy_ms < 0 or args.gil_idle_ms < 0):
        p.error("--opens and --per-round must be >= 1; --live, --prestep, --profile-opens and the --gil "
                "times >= 0")
    if args.warm_opens is None:
        args.warm_opens = len(texts.FLEET_REPLIES)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    args.out.mkdir(parents=True, exist_ok=True)
    from pipecat_qwen_fast.engine.engine import QwenTTSEngine

    t0 = time.perf_counter()
    engine = QwenTTSEngine.from_pretrained(args.model, device=args.device, dtype=args.dtype, backend=args.backend,
                                           progress=False)
    engine.finish_warmup()  # as bench fleet: the batch path warm before anything is measured
    engine.prepare_thread()
    load_s = time.perf_counter() - t0
    cuda = engine.device.type == "cuda"
    cuda_skipped = None if cuda else f"the engine runs on {engine.device.type} (no CUDA device): no device syncs, " \
                                     "no kernel, memcpy or synchronization counts; host times and CPU ops only"
    if cuda_skipped:
        print(f"open_profile: CUDA parts skipped: {cuda_skipped}", flush=True)
    log(f"engine loaded in {load_s:.1f} s: {engine.backend.name} on {engine.device}")
    backend = engine.backend
    placed = getattr(backend, "placed", None)
    placement = ("every call placed on the batch path (HybridBackend.placed(False))" if placed is not None else
                 f"backend {backend.name} places calls itself (no batch/megakernel choice)")
    if placed is not None and not getattr(backend, "bulk_ready", True):
        raise SystemExit("the batch path is not warm after finish_warmup() (bulk_ready is False)")
    result: dict = {
        "probe": "open_profile",
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": args.commit or git_commit(),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "device": str(engine.device),
        "device_name": torch.cuda.get_device_name(engine.device) if cuda else None,
        "torch": torch.__version__,
        "backend_name": backend.name,
        # fp32 where the megakernel prefills in fp32 (model/prompt.py): the batch path's prompts too.
        "prompt_dtype": str(prompt_dtype(engine.model.talker)),
        "load_s": load_s,
        "placement": placement,
        "phase_definitions": PHASE_DEFINITIONS,
        "cuda_skipped": cuda_skipped,
        "gil_thread": {"busy_ms": args.gil_busy_ms, "idle_ms": args.gil_idle_ms} if args.gil_busy_ms else None,
        "switch_interval_ms": 1e3 * sys.getswitchinterval(),
    }
    timer = PhaseTimer(engine.device)
    stop = threading.Event()
    rival = None
    if args.gil_busy_ms:
        rival = threading.Thread(target=hold_gil, args=(stop, args.gil_busy_ms, args.gil_idle_ms),
                                 name="gil-rival", daemon=True)
        rival.start()
    work = Workload(engine, args)
    started = dict(getattr(backend, "started", {}))
    try:
        with placed(False) if placed is not None else contextlib.nullcontext():
            work.refill()
            for _ in range(args.prestep):
                work.round()
            result["live_calls"] = len(work.live)
            subs = install(timer, engine)
            log(f"{len(work.live)} calls live; {args.warm_opens} warm-up opens")
            for _ in range(args.warm_opens):
                work.open()
                work.round()
            log(f"{args.opens} plain and {args.opens} split opens, alternately")
            plain, split = measured_opens(work, timer, args.opens, subs)
            if args.profile_opens:
                log(f"profile: {args.profile_opens} opens under torch.profiler")
                result["profile"] = profile_opens(work, timer, args.profile_opens, cuda)
    finally:
        timer.remove()
        stop.set()
        if rival is not None:
            rival.join()
        work.close()
    ended = dict(getattr(backend, "started", {}))
    result["placement_counts"] = {
        # Every open the probe timed or warmed with (not the live set's refills), by the path it took.
        "probe_opens_on_megakernel": work.on_fast[True], "probe_opens_on_batch_or_only_path": work.on_fast[False],
        "started_since_probe": {k: ended.get(k, 0) - started.get(k, 0) for k in ended},
        "refused": work.refused,
    }
    result["summary"] = summarize(plain, split, subs)
    result["plain_opens"] = plain
    result["split_opens"] = split
    (args.out / RESULT).write_text(json.dumps(result, indent=2))
    md = markdown(result)
    (args.out / MARKDOWN).write_text(md)
    print(md, flush=True)
    log(f"wrote {args.out / RESULT} and {args.out / MARKDOWN}")
    engine.close()
    if cuda:
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
