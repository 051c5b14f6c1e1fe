"""`qwen-fast-tts bench fleet`: how many voice-agent callers one engine carries (issue 34).

Closed loop: callers speak one agent reply each (25-75 frames), play it at real time, listen
0.3-1.5 s, speak again; their first utterances are spread over --stagger seconds. Open loop:
requests arrive as a Poisson process at each --rates value. Each level runs --duration seconds
against one engine loaded once, in this process, behind one EngineService (as a deployment loads
it). Per level: first audio p50/p95/p99 from submission, utterances with an underrun and the worst
lateness, frames/s, refusals (EngineOverloadedError), and the engine's rounds split into decode,
vocoder, prefill and host time. The capacity is the most callers (the highest rate) whose level
met its bar: p95 first audio <= --bar-ms with no underrun (open loop: <= --open-bar-ms), and no
refused, failed or silent request. By default the sweep stops after the first level that misses.
Each level also gives the event loops' lag (how late a task sleeping 10 ms wakes): the callers'
process's own, and a server's from its /metrics. Against a running server (--server-url) the
callers can be split over --caller-processes OS processes, as a fleet of agent processes is.

Writes fleet.json after every level, fleet.md and fleet.png (without matplotlib: no plot, and the
JSON and markdown say why) into --out, all within --budget seconds from the start, build included.

    qwen-fast-tts bench fleet --build-size 0.6b --out bench/results/fleet --budget 540
    qwen-fast-tts bench fleet --model DIR --out /tmp/f --mode both --levels 16,64,128 --rates 5,10,20
    qwen-fast-tts bench fleet --build-size tiny --device cpu --backend torch --levels 2 --duration 3 --out /tmp/f
    qwen-fast-tts bench fleet --model DIR --through server --text-mode dual_track --out /tmp/f   # via the server
    qwen-fast-tts bench fleet --model DIR --through both --text-mode dual_track --out /tmp/f     # both, side by side
    qwen-fast-tts bench fleet --model DIR --text-mode dual_track --in-process-turns streamed --out /tmp/f  # the server's engine path
    qwen-fast-tts bench fleet --server-url http://HOST:8000 --voice ryan --out /tmp/f         # a running server
    qwen-fast-tts bench fleet --server-url http://HOST:8000 --caller-processes 4 --out /tmp/f  # callers in 4 processes
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipecat_qwen_fast.bench import fleet_report
from pipecat_qwen_fast.bench.ceilings import describe_device
from pipecat_qwen_fast.bench.engine import Report
from pipecat_qwen_fast.bench.fleet_callers import (
    CallerProcesses,
    Endpoint,
    InProcessEndpoint,
    LevelPlan,
    ServerEndpoint,
    merge_shares,
    run_share,
)
from pipecat_qwen_fast.bench.fleet_workload import (
    Reply,
    Utterance,
    capacity,
    compare_early_chunks,
    fleet_replies,
    gc_near_low_slack,
    histogram_lag,
    labelled,
    place_low_slack,
    served_gc,
    served_rounds,
    server_rounds,
    summarize_level,
    summarize_rounds,
    verdict,
)
from pipecat_qwen_fast.bench.main import build_checkpoint, git_commit, log
from pipecat_qwen_fast.engine.heap import GcPauses, heap_census
from pipecat_qwen_fast.engine.service import EngineService, parse_admission

RESULT = "fleet.json"
# A level is started only with this much time left beyond its --duration: the shortest drain
# worth having plus writing the result and closing the engine.
LEVEL_MARGIN_S = 8.0
CLOSE_S = 3.0


def _floats(value: str, flag: str, cast=float) -> list:
    try:
        items = [cast(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"{flag}: expected a comma list of numbers, got {value!r}") from None
    if not items or any(v <= 0 for v in items):
        raise SystemExit(f"{flag}: expected positive numbers, got {value!r}")
    return items


def _admission(name: str):
    """An argparse type for EngineService admission setting `name` (auto, off or a number)."""
    def parse(value: str) -> float | int | str | None:
        try:
            return parse_admission(name, value)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return parse


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="qwen-fast-tts bench fleet", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", type=Path, help="an existing checkpoint folder (its EOS row should be zeroed)")
    src.add_argument("--build-size", choices=["tiny", "0.6b", "1.7b"], help="build a random checkpoint first")
    src.add_argument("--server-url", help="a running server (qwen-fast-tts serve, or Ray Serve's proxy): callers on "
                                          "its WebSocket, no engine in this process (its checkpoint's EOS row zeroed)")
    p.add_argument("--voice", default=None, help="with --server-url: the voice callers ask for (default: the server's)")
    p.add_argument("--server-metrics", action=argparse.BooleanOptionalAction, default=True,
                   help="with --server-url: read the server's /metrics before and after each level (its rounds, "
                        "refusals, loop lag); --no-server-metrics behind a proxy over several replicas, where "
                        "each read reaches one of them")
    p.add_argument("--caller-processes", type=int, default=1,
                   help="with --server-url: split each level's callers over this many OS processes (spawned), "
                        "each with its own event loop and client, all starting the level at one instant")
    p.add_argument("--variant", default="custom_voice", choices=["custom_voice"],
                   help="checkpoint variant to build (callers speak with a CustomVoice speaker)")
    p.add_argument("--checkpoint-dir", type=Path, default=Path("/tmp/qwen-fast-fleet-ckpt"))
    p.add_argument("--out", type=Path, required=True, help="folder for fleet.json, fleet.md, fleet.png")
    p.add_argument("--device", default="cuda", help="cuda | cuda:N | cpu")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU) | bfloat16 | float32")
    p.add_argument("--backend", default="auto", help="auto | torch | megakernel | eager")
    p.add_argument("--mode", default="closed", choices=["closed", "open", "both"])
    p.add_argument("--through", default="engine", choices=["engine", "server", "both"],
                   help="engine: callers use the EngineService; server: the same engine behind "
                        "the server on loopback, callers on its WebSocket (a socket an utterance); "
                        "both: each level in process, then through the server, one engine loaded "
                        "once (OUT/engine, OUT/server, and OUT/comparison.md side by side)")
    p.add_argument("--text-mode", default=None, choices=["prefill", "dual_track"],
                   help="the requests' text mode (default: the variant's); dual_track makes a "
                        "server turn one engine stream, as in-process")
    p.add_argument("--in-process-turns", default="whole", choices=["whole", "streamed", "both"],
                   help="in process: whole (each reply opened with its text, open_stream) or streamed "
                        "(a streamed-text turn given the whole reply and ended at once, the engine "
                        "path of a server's dual-track WebSocket turn; needs --text-mode dual_track); "
                        "both: each level whole, then streamed, one engine loaded once (OUT/engine, "
                        "OUT/engine-streamed)")
    p.add_argument("--levels", default="16,32,64,128,256,512,768", help="closed loop: callers per level")
    p.add_argument("--rates", default="5,10,15,20,30,40,60,80,120,160", help="open loop: requests/s per level")
    p.add_argument("--duration", type=float, default=30.0, help="seconds a level submits requests")
    p.add_argument("--stagger", type=float, default=5.0,
                   help="closed loop: callers' first utterances are spread over this many seconds")
    p.add_argument("--listen", default="0.3,1.5", help="closed loop: min,max seconds a caller listens")
    p.add_argument("--drain", type=float, default=15.0,
                   help="seconds after a level's duration before its unfinished utterances are cut")
    p.add_argument("--warmup", type=float, default=5.0,
                   help="seconds of closed-loop callers (at the first level, at most 16) before the sweep, not judged")
    p.add_argument("--bar-ms", type=float, default=100.0, help="closed loop: p95 first audio bar")
    p.add_argument("--open-bar-ms", type=float, default=80.0, help="open loop: p95 first audio bar")
    p.add_argument("--keep-going", action="store_true", help="run every level, past the first that misses its bar")
    # Off by default: its synchronizations cost the engine its overlaps, and a level of capacity on
    # the H200 (docs/PERFORMANCE.md, session 36); on, for where a round's time goes.
    p.add_argument("--round-timing", action=argparse.BooleanOptionalAction, default=False,
                   help="split each round's time into decode, vocoder, prefill and host (synchronizes the "
                        "device around each timed call, which lowers the capacity measured)")
    p.add_argument("--max-round-ms", type=_admission("max_round_ms"), default="auto",
                   help="in process: the EngineService's round limit (auto: 32.5 ms on a GPU; a number of ms; "
                        "off: none), for an A/B of it")
    p.add_argument("--min-slack-ms", type=_admission("min_slack_ms"), default="auto",
                   help="in process: the EngineService's admission by slack (auto: 20 ms on a GPU; a number "
                        "of ms; off: none), for an A/B of the margin")
    p.add_argument("--chunk-frames", type=int, default=None,
                   help="in process: the requests' chunk_frames (frames in the second chunk; default the "
                        "request's), for an A/B of the chunk schedule")
    p.add_argument("--chunk-growth", type=int, default=None,
                   help="in process: the requests' chunk_growth (a chunk after the second holds at most this "
                        "many times the frames sent; default the request's). --chunk-frames 2 --chunk-growth 2: "
                        "1, 2, 4, ... 32, the default before session 35")
    p.add_argument("--schedule-ab", action="store_true",
                   help="with --chunk-frames/--chunk-growth: each level with the requests' default schedule, "
                        "then with the one given, one engine loaded once (OUT/engine, OUT/engine-schedule)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget", type=float, default=540.0, help="seconds for everything, checkpoint build included")
    p.add_argument("--commit", default=os.environ.get("BENCH_COMMIT"),
                   help="commit measured (default: $BENCH_COMMIT, else git HEAD where there is one)")
    args = p.parse_args(argv)
    args.levels = _floats(args.levels, "--levels", int)
    args.rates = _floats(args.rates, "--rates")
    listen = _floats(args.listen, "--listen")
    if len(listen) != 2 or listen[0] > listen[1]:
        raise SystemExit(f"--listen: expected min,max seconds, got {args.listen!r}")
    args.listen = tuple(listen)
    if args.in_process_turns != "whole" and args.text_mode != "dual_track":
        raise SystemExit(f"--in-process-turns {args.in_process_turns} needs --text-mode dual_track")
    if args.in_process_turns == "both" and args.through != "engine":
        raise SystemExit("--in-process-turns both needs --through engine (it is the A/B of the in-process turns)")
    if args.duration <= 0 or args.stagger < 0 or args.drain < 0 or args.warmup < 0:
        raise SystemExit("--duration must be > 0; --stagger, --drain and --warmup >= 0")
    if (args.chunk_frames is not None or args.chunk_growth is not None) and (args.server_url or args.through != "engine"):
        raise SystemExit("--chunk-frames and --chunk-growth set the in-process requests: they need --through engine "
                         "and no --server-url")
    if args.schedule_ab and (args.in_process_turns == "both" or not request_schedule(args)):
        raise SystemExit("--schedule-ab needs --chunk-frames or --chunk-growth, and one kind of in-process turn")
    for name in ("chunk_frames", "chunk_growth"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')}: expected an integer >= 1, got {getattr(args, name)}")
    if args.caller_processes < 1:
        raise SystemExit(f"--caller-processes: expected 1 or more, got {args.caller_processes}")
    if args.caller_processes > 1 and not args.server_url:
        raise SystemExit("--caller-processes needs --server-url: with --model or --build-size the engine and "
                         "its callers stay in one process")
    return args


def request_schedule(args: argparse.Namespace) -> dict:
    """The chunk schedule fields the in-process requests set (none: the request's defaults)."""
    return {name: getattr(args, name) for name in ("chunk_frames", "chunk_growth") if getattr(args, name) is not None}


def _modes(args: argparse.Namespace) -> list[str]:
    return ["closed", "open"] if args.mode == "both" else [args.mode]


def frames_compiled() -> int:
    """Frames torch.compile has compiled in this process so far: one mid-level is a recompile
    (a new shape), seconds of the GIL."""
    from torch._dynamo.utils import counters

    return counters["frames"]["total"]


def _peak_memory_gib(device: torch.device | None) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device is not None and device.type == "cuda" else None


@dataclass
class Run:
    """One endpoint's sweep and the report it writes."""

    name: str
    endpoint: Endpoint
    report: Report
    save: Callable[[], None]
    stopped: bool = False  # this mode's sweep ended for it (a missed bar)
    processes: CallerProcesses | None = None  # its callers' processes; None: the callers run here


async def run_callers(run: Run, replies: list[Reply], plan: LevelPlan) -> tuple[list[Utterance], float, list[dict]]:
    """A level's (or the warm-up's) callers, here or split over the run's caller processes: their
    utterances, the level's wall time, and each caller process's utterances and loop lag."""
    if run.processes is not None:
        shares = await run.processes.run(plan)
    else:
        shares = [await run_share(run.endpoint, replies, plan, (0, 1))]
    return merge_shares(shares)


async def sweep(args: argparse.Namespace, runs: list[Run], device: torch.device | None, deadline: float,
                after_level: Callable[[], None] = lambda: None) -> None:
    """Every level of each mode, for each run in turn (so several endpoints are measured at the
    same levels, side by side in time): a run stops at its first missed bar unless --keep-going."""
    replies = fleet_replies()
    # Warm-up only where it leaves room for a level after it, for every run.
    room = deadline - time.monotonic() - CLOSE_S - len(runs) * (args.warmup + args.drain)
    warmup_fits = room > len(runs) * (args.duration + 2 * LEVEL_MARGIN_S)
    for run in runs:
        if args.warmup and not warmup_fits:
            run.report.put("warmup", {"skipped": "time budget"})
        elif args.warmup:
            warm = min(16, args.levels[0]) if args.mode != "open" else 8
            utts, wall, _ = await run_callers(run, replies, LevelPlan(
                closed=True, value=warm, duration=args.warmup, stagger=min(args.stagger, args.warmup / 2),
                listen=args.listen, drain=args.drain, seed=args.seed - 1))
            run.endpoint.take_rounds()
            run.report.put("warmup", {"callers": warm, "wall_s": wall, **summarize_level(utts, args.warmup)})
            log(f"{run.name} warm-up: {warm} callers, {len(utts)} utterances in {wall:.1f} s")
    for mode in _modes(args):
        closed = mode == "closed"
        key, cap_key = ("callers", "capacity_callers") if closed else ("rate_rps", "capacity_rps")
        bar_ms = args.bar_ms if closed else args.open_bar_ms
        sections = {}
        for run in runs:
            run.stopped = False
            sections[run.name] = {
                "bar": (f"p95 first audio <= {bar_ms:g} ms" + (", no underrun" if closed else "")
                        + ", no refused, failed or silent request"),
                "bar_ms": bar_ms, "levels": [], cap_key: None,
            }
            run.report.put(mode, sections[run.name])
        values = args.levels if closed else args.rates
        for i, value in enumerate(values):
            for run in runs:
                section = sections[run.name]
                if run.stopped:
                    continue
                going = [r for r in runs if not r.stopped and len(sections[r.name]["levels"]) == i]
                left = deadline - time.monotonic() - CLOSE_S
                # Each run still to measure this level needs its time: a level is measured by all
                # or none, and no run goes on to a level another could not measure.
                if left < len(going) * (args.duration + LEVEL_MARGIN_S):
                    for other in runs:
                        if other.stopped:
                            continue
                        other.stopped = True
                        rest_section = sections[other.name]
                        for rest in values[len(rest_section["levels"]):]:
                            rest_section["levels"].append({key: rest, "skipped": f"time budget ({left:.0f} s left)"})
                        rest_section["stopped"] = "the time budget ran out"
                        other.report.put(mode, rest_section)
                        other.save()
                    break
                drain = min(args.drain, left - len(going) * args.duration - LEVEL_MARGIN_S / 2)
                if device is not None and device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                run.endpoint.take_rounds()  # rounds of the previous level's tail belong to no level
                # A server's /metrics (its rounds, its loop's lag) before and after the level.
                read_metrics = getattr(run.endpoint, "read_metrics", None)
                served_before = await read_metrics() if read_metrics is not None else None
                # This process's collections and compiles (in process: the engine thread's rounds
                # and the callers' loop stall on both, the GIL held).
                compiled_before = frames_compiled()
                low_before = low_slack_chunks(run.endpoint, served_before)
                counted_before, _ = counted_rounds(run.endpoint, served_before)
                refusals_before = engine_refusals(run.endpoint, served_before)
                cpu_before = engine_thread_cpu(run.endpoint, served_before)
                # New calls whose first frame ran alone before a round (backends/hybrid.py; in process).
                alone_service = _counting_service(run.endpoint, "first_frames_alone")
                alone_before = alone_service.first_frames_alone if alone_service is not None else None
                level_t0 = time.monotonic()
                # bench scaleout kills a replica a set time after this line.
                log(f"{run.name} level {value} starts")
                with GcPauses() as gc_pauses:
                    utts, wall, caller_lag = await run_callers(run, replies, LevelPlan(
                        closed=closed, value=value, duration=args.duration, stagger=args.stagger,
                        listen=args.listen, drain=drain, seed=args.seed))
                served_after = await read_metrics() if read_metrics is not None else None
                rounds = run.endpoint.take_rounds()
                summary = summarize_rounds(rounds, wall) if rounds is not None else None
                if summary is None and counted_before is not None:
                    counted_after, source = counted_rounds(run.endpoint, served_after)
                    summary = served_rounds(counted_before, counted_after, wall, source)
                level = {key: value, "duration_s": args.duration, "drain_s": drain, "wall_s": wall,
                         **summarize_level(utts, args.duration),
                         "rounds": summary,
                         "loop_lag": {"server": histogram_lag(served_before, served_after), "callers": caller_lag},
                         "peak_gpu_memory_gib": _peak_memory_gib(device),
                         "gc_pauses": gc_pauses.summary(),
                         "server_gc_pauses": served_gc(served_before, served_after),
                         "frames_compiled": frames_compiled() - compiled_before}
                low_after = low_slack_chunks(run.endpoint, served_after)
                # Chunks that came within the engine's min_slack_ms of their playback, each
                # refusing new calls for a moment: which of the refusals the slack made.
                level["low_slack_chunks"] = (None if low_before is None or low_after is None
                                             else int(low_after - low_before))
                # Which of the engine's admission settings refused the level's calls.
                level["refused_by"] = count_delta(refusals_before, engine_refusals(run.endpoint, served_after))
                # How busy the engine's threads were (the engine thread's share against its rounds'
                # wall time: the rest is waiting, for the GPU or for the GIL).
                level["thread_cpu"] = cpu_shares(cpu_before, engine_thread_cpu(run.endpoint, served_after), wall)
                level["first_frames_alone"] = (None if alone_before is None
                                               else alone_service.first_frames_alone - alone_before)
                # Where in their streams those chunks came, the rounds before them, and whether a long
                # collection in this process (the engine's) came just before them (in process).
                low_events = getattr(run.endpoint.service, "low_slack_events", None)
                if low_events is not None:
                    events = low_events(level_t0)
                    if rounds:
                        level["low_slack"] = place_low_slack(events, rounds)
                    level["low_slack_gc"] = gc_near_low_slack(events, gc_pauses.pauses, gc_pauses.ended_at, wall)
                # Every second and third chunk, whole texts beside streamed turns (in process).
                early_events = getattr(run.endpoint.service, "early_chunk_events", None)
                if early_events is not None:
                    level["early_chunks"] = compare_early_chunks(early_events(level_t0))
                # What the level's full collections walked, where the engine's process is this
                # one (a service here): taken after the level, where no caller waits on it.
                if run.endpoint.service is not None:
                    level["heap_after"] = heap_census()
                level["misses"] = verdict(level, bar_ms, underruns_count=closed)
                level["meets_bar"] = not level["misses"]
                section["levels"].append(level)
                section[cap_key] = capacity(section["levels"], key)
                run.report.put(mode, section)
                run.save()
                after_level()
                fa = level["first_audio_ms"]
                prefix = f"{run.name}: " if len(runs) > 1 else ""
                log(f"{prefix}{mode} {key} {value}: {level['utterances']} utterances, first audio p50/p95 "
                    f"{fa['p50'] or 0:.1f}/{fa['p95'] or 0:.1f} ms, {level['underrun_utterances']} underran, "
                    f"{level['frames_per_s']:.0f} frames/s, {level['refused']} refused{fleet_report.refused_why(level)}, "
                    f"{fleet_report.lag_text(level['loop_lag'])}; {fleet_report.gc_text(level['gc_pauses'])}"
                    + (f" (server's: {fleet_report.served_gc_text(level['server_gc_pauses'])})"
                       if level["server_gc_pauses"] else "") + ", "
                    f"{level['frames_compiled']} frames compiled"
                    + fleet_report.thread_cpu_text(level.get("thread_cpu")) + ": "
                    + ("bar met" if level["meets_bar"] else "bar missed"))
                if level["misses"] and not args.keep_going:
                    section["stopped"] = f"{key} {value} missed the bar (--keep-going runs the levels after it)"
                    run.stopped = True
            if all(r.stopped for r in runs):
                break
        for run in runs:
            run.report.put(mode, sections[run.name])
            run.save()
        after_level()
    for run in runs:
        close = getattr(run.endpoint, "aclose", None)
        if close is not None:  # the server endpoint's client, on this loop
            await close()


def _counting_service(endpoint, attr: str) -> Any:
    """The endpoint's EngineService where it is in this process and counts `attr`, else None."""
    service = getattr(endpoint, "service", None)
    return service if service is not None and hasattr(service, attr) else None


def engine_count(endpoint, metrics: dict[str, float] | None, attr: str, from_metrics: Callable[[dict], Any]) -> Any:
    """An engine counter so far: its service's `attr` in process, `from_metrics(samples)` of its
    /metrics through a server; None where neither is there."""
    service = _counting_service(endpoint, attr)
    if service is not None:
        return getattr(service, attr)
    return None if metrics is None else from_metrics(metrics)


def low_slack_chunks(endpoint, metrics: dict[str, float] | None) -> float | None:
    """The engine's chunks under its min_slack_ms so far."""
    return engine_count(endpoint, metrics, "low_slack_chunks",
                        lambda m: m.get("qwen_tts_engine_low_slack_chunks_total"))


def engine_thread_cpu(endpoint, metrics: dict[str, float] | None) -> dict[str, float] | None:
    """CPU seconds so far of the engine's threads (the engine's; through a server whose engine
    runs in a process of its own, also that process's relay and pipe reader)."""
    return engine_count(endpoint, metrics, "thread_cpu",
                        lambda m: labelled(m, "qwen_tts_engine_thread_cpu_seconds_total", "thread"))


def cpu_shares(before: dict[str, float] | None, after: dict[str, float] | None, wall_s: float) -> dict | None:
    """Each thread's CPU time over a level as a share of the level's wall time (1.0: a core's
    whole time), where it was read on both sides."""
    if not before or not after or wall_s <= 0:
        return None
    return {name: round((after[name] - before[name]) / wall_s, 3) for name in sorted(after) if name in before}


def counted_rounds(endpoint, metrics: dict[str, float] | None) -> tuple[tuple[float, float, float | None] | None, str]:
    """The engine's rounds so far, their summed seconds and the streams they stepped, and where
    they were read: its service's counters in process (no device synchronization: what a level
    without round timing still reports), its /metrics through a server."""
    service = _counting_service(endpoint, "round_streams")
    if service is not None:
        return (service.rounds, service.round_seconds, service.round_streams), "engine counters"
    return server_rounds(metrics), "server /metrics"


def engine_refusals(endpoint, metrics: dict[str, float] | None) -> dict[str, float] | None:
    """The engine's refusals so far by the setting that made them (EngineOverloadedError.reason)."""
    return engine_count(endpoint, metrics, "refusals",
                        lambda m: labelled(m, "qwen_tts_engine_refusals_total", "reason"))


def count_delta(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, int] | None:
    """What each count grew by (those that grew), or None where either side is unknown."""
    if before is None or after is None:
        return None
    return {k: int(v - before.get(k, 0)) for k, v in sorted(after.items()) if v > before.get(k, 0)}


def workload(args: argparse.Namespace, replies: list) -> dict:
    return {"replies": len(replies), "frames_range": [min(r.frames for r in replies), max(r.frames for r in replies)],
            "listen_s": list(args.listen), "stagger_s": args.stagger, "duration_s": args.duration,
            "drain_s": args.drain, "seed": args.seed, "caller_processes": args.caller_processes}


def sweep_server(args: argparse.Namespace, deadline: float, report: Report, save, started: float) -> int:
    """The sweep against a server of another process or machine: what its clients see, with no
    view of its engine (no round timing, no GPU memory)."""
    endpoint = ServerEndpoint(args.server_url, args.voice, args.text_mode, metrics=args.server_metrics)
    n = args.caller_processes
    report.put("endpoint", f"a server at {args.server_url} (WebSocket)"
               + (f", the callers split over {n} processes" if n > 1 else ""))
    replies = fleet_replies()
    report.put("workload", workload(args, replies))
    processes = None
    try:
        if n > 1:
            t0 = time.monotonic()
            processes = CallerProcesses(n, args.server_url, args.voice, args.text_mode)
            processes.wait_ready(max(1.0, min(120.0, deadline - time.monotonic())))
            report.put("caller_processes_start_s", time.monotonic() - t0)
            log(f"{n} caller processes started in {time.monotonic() - t0:.1f} s")
        asyncio.run(sweep(args, [Run("server", endpoint, report, save, processes=processes)], None, deadline))
    except BaseException as exc:
        report.put("error", f"{type(exc).__name__}: {exc}")
        raise
    finally:
        if processes is not None:
            processes.close()
        report.put("total_wall_s", time.monotonic() - started)
        save()
    print((args.out / fleet_report.MARKDOWN).read_text())
    return 0


def _report(args: argparse.Namespace, out: Path) -> tuple[Report, Callable[[], None]]:
    out.mkdir(parents=True, exist_ok=True)
    report = Report(out / RESULT, {
        "benchmark": "fleet",
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": args.commit or git_commit(),
        "args": vars(args),
        "round_timing": args.round_timing,
    })

    def save() -> None:
        fleet_report.write(report.data, out)
        report.save()

    return report, save


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    deadline = started + args.budget
    logging.basicConfig(level=logging.WARNING)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.server_url:
        return sweep_server(args, deadline, *_report(args, args.out), started)
    # --through both: each endpoint's report in its own folder, and the two side by side.
    # --in-process-turns both: the two kinds of turn level by level, each in its own folder.
    names = (["engine", "server"] if args.through == "both"
             else ["engine", "engine-streamed"] if args.in_process_turns == "both"
             else ["engine", "engine-schedule"] if args.schedule_ab else [args.through])
    compared = args.through == "both"  # in process against the server: a comparison.md
    outs = {name: args.out / name if len(names) > 1 else args.out for name in names}
    reports = {name: _report(args, outs[name]) for name in names}

    def put(key: str, value) -> None:
        for report, _ in reports.values():
            report.put(key, value)

    def compare() -> None:
        if compared:
            fleet_report.write_comparison({n: r.data for n, (r, _) in reports.items()}, args.out)

    if args.build_size:
        put("checkpoint", build_checkpoint(args.build_size, args.variant, args.checkpoint_dir))
        model = args.checkpoint_dir
    else:
        put("checkpoint", {"path": str(args.model), "zero_eos": "as built (not checked here)"})
        model = args.model

    def load():
        from pipecat_qwen_fast.engine.engine import QwenTTSEngine

        engine = QwenTTSEngine.from_pretrained(model, device=args.device, dtype=args.dtype, backend=args.backend,
                                               progress=False)
        # A fleet is measured at steady state: the batch path's deferred warm-up done before the
        # first level, not during it (engine/warmup.py).
        engine.finish_warmup()
        return engine

    t0 = time.monotonic()
    service = EngineService(load, name="fleet", min_slack_ms=args.min_slack_ms, max_round_ms=args.max_round_ms)
    server = None
    try:
        service.wait_ready_blocking(timeout=max(1.0, deadline - time.monotonic()))
        engine = service.engine
        put("load_s", time.monotonic() - t0)
        # Where a load's time goes once the batch path is warmed too (the slowest queued steps).
        steps = sorted(engine._warmup.timings, key=lambda t: -t[1])
        put("warmup_steps_s", {"total": round(sum(t for _, t in steps), 1),
                               "slowest": [[name, round(t, 2)] for name, t in steps[:15]]})
        put("backend_name", engine.backend.name)
        put("device_info", describe_device(engine.device))
        # The engine switches an A/B turns (device_run.sh fleet2, FLEET2_ENV): which side this is.
        put("engine_switches", {"overlap_vocoder": service.overlap_vocoder, "min_slack_ms": service.min_slack_ms,
                                "max_round_ms": service.max_round_ms,
                                "merge_vocoder_sizes": getattr(engine, "merge_vocoder_sizes", None),
                                "prepare_opens": service.prepare_opens,
                                "first_alone_below": getattr(engine.backend, "first_alone_below", None)})
        if args.round_timing:
            service.time_rounds()
        runs = []
        for name in names:
            report, save = reports[name]
            if name == "server":
                from pipecat_qwen_fast.bench.server_latency import serve_in_thread

                # No limit of the server's own: the engine's capacity is what is measured.
                server, server_thread, port = serve_in_thread(service, model, args.device, args.backend,
                                                              max_streams=100_000)
                endpoint = ServerEndpoint(f"http://127.0.0.1:{port}", engine.default_voice, args.text_mode,
                                          service)
                report.put("endpoint", "the server on loopback (WebSocket) over one EngineService")
            else:
                streamed = args.in_process_turns == "streamed" or name == "engine-streamed"
                endpoint = InProcessEndpoint(service, engine.default_voice, args.text_mode, streamed,
                                             schedule=request_schedule(args)
                                             if name != "engine" or not args.schedule_ab else None)
                report.put("endpoint", "in process: one EngineService" + (
                    ", streamed-text turns (the server's engine path)" if streamed else "") + (
                    f", requests with {endpoint.schedule}" if endpoint.schedule else ""))
                report.put("request_schedule", endpoint.schedule or "defaults")
            runs.append(Run(name, endpoint, report, save))
        put("workload", workload(args, fleet_replies()))
        log(f"engine loaded in {time.monotonic() - t0:.1f} s ({engine.backend.name} on {engine.device}); "
            f"{deadline - time.monotonic():.0f} s left for the sweep")
        asyncio.run(sweep(args, runs, engine.device, deadline, after_level=compare))
        side = getattr(engine, "vocoder_side", None)
        if side is not None:  # with overlap_vocoder: how many calls ran beside the next frame
            put("deferred_vocoder_calls", {"resolved": side.resolved_calls,
                                           "beside_a_frame": side.resolved_beside_a_frame})
        if server is not None:
            server.should_exit = True
            server_thread.join(10)
    except BaseException as exc:
        put("error", f"{type(exc).__name__}: {exc}")
        raise
    finally:
        service.close()
        put("total_wall_s", time.monotonic() - started)
        for _, save in reports.values():
            save()
        compare()
    for name in names:
        out = outs[name]
        log(f"wrote {out / RESULT}, {out / fleet_report.MARKDOWN}; plot: {reports[name][0].data['plot']}")
        print((out / fleet_report.MARKDOWN).read_text())
    if compared:
        print((args.out / fleet_report.COMPARISON).read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
