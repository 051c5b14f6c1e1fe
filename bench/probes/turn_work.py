"""What the engine does for one turn, whole text against streamed text, counted: a server's
dual-track WebSocket turn is a streamed-text turn in the engine (given its whole reply and ended
at once), the in-process fleet's is a whole text, and through the server the fleet carried 384
callers against 448 in process (session 36). Which work does the streamed turn add?

Per turn, over the fleet's replies, dual-track, a few turns at once and staggered as callers are:
prefill calls and rows, prompts built, backend states made, text polls (and their time) and
batched begins, rounds and streams a round, the engine thread's CPU time, the calling thread's
CPU time to open the turn (a streamed turn's text given and ended included), and the torch
operations the engine thread dispatched, between rounds and in the window it overlaps with the
GPU's frame (tiny model on the CPU: the counts carry to the GPU, where each operation is a launch
or more, except the decode's, which the GPU replays as graphs; the times only say where Python
grows). Tiny random checkpoint, CPU, a minute:

    python3 bench/probes/turn_work.py [--turns 48] [--at-once 8] [--frames 12] [--no-seed-rows]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import statistics
import time

from tiny_cpu import CountOps, print_measured  # beside this file

from pipecat_qwen_fast.bench.fleet_workload import fleet_replies
from pipecat_qwen_fast.engine import engine as engine_module
from pipecat_qwen_fast.engine import text_session
from pipecat_qwen_fast.engine.request import SynthesisRequest
from pipecat_qwen_fast.engine.service import EngineService


def count_calls(counts: collections.Counter, owner, name: str, rows=None, times: list | None = None) -> None:
    """Wrap `owner.name` to count its calls (and `rows(*args)` of work, where given; and each
    call's microseconds into `times`, where given)."""
    real = getattr(owner, name)

    def counted(*args, **kwargs):
        counts[name] += 1
        if rows is not None:
            counts[f"{name}_rows"] += rows(*args, **kwargs)
        if times is None:
            return real(*args, **kwargs)
        t0 = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            times.append((time.perf_counter() - t0) * 1e6)

    setattr(owner, name, counted)


def count_engine_ops(service_class) -> CountOps:
    """Count the engine thread's torch operations: the service's thread runs `_serve` inside the
    mode, counting under "critical" (between rounds, the GPU waiting on them), its `_prepare_opens`
    under "prepare" (the window overlapped with the GPU's frame). Call before the service starts."""
    counter = CountOps("critical")
    serve, prepare = service_class._serve, service_class._prepare_opens

    def counted_serve(self):
        with counter:
            return serve(self)

    def counted_prepare(self):
        counter.window = "prepare"
        try:
            return prepare(self)
        finally:
            counter.window = "critical"

    service_class._serve, service_class._prepare_opens = counted_serve, counted_prepare
    return counter


def engine_cpu_s(service: EngineService) -> float:
    return time.clock_gettime(time.pthread_getcpuclockid(service._thread.ident))


async def run_turns(service, kind: str, turns: int, at_once: int, frames: int) -> float:
    """Runs the turns; returns the calling thread's CPU seconds spent opening them (a streamed
    turn's text given and ended included): the caller's share, beside the engine thread's."""
    replies = fleet_replies()
    gate = asyncio.Semaphore(at_once)
    caller_s = 0.0

    async def one(i: int) -> None:
        nonlocal caller_s
        async with gate:
            request = SynthesisRequest(replies[i % len(replies)].text, voice="ryan", seed=i,
                                       max_frames=frames, text_mode="dual_track")
            t0 = time.thread_time()
            if kind == "whole":
                stream = service.open_stream(request)
            else:  # as the server's WebSocket turn: opened, given the whole reply, ended
                stream = service.open_text_stream(SynthesisRequest("", **{
                    k: getattr(request, k) for k in ("voice", "seed", "max_frames", "text_mode")}))
                stream.append(request.text)
                stream.end()
            caller_s += time.thread_time() - t0
            async for _ in stream:
                pass
            await stream.wait_closed()

    async def staggered(i: int) -> None:
        await asyncio.sleep(0.002 * i)
        await one(i)

    await asyncio.gather(*(staggered(i) for i in range(turns)))
    return caller_s


async def measure(engine, _folder: str, turns: int, at_once: int, frames: int) -> dict:
    counts: collections.Counter = collections.Counter()
    count_calls(counts, engine, "_prefill", rows=lambda sessions, embeds: len(sessions))
    count_calls(counts, engine.backend, "new_state")
    # A turn's first poll may begin it (its prefill); the rest only check that its text is there.
    poll_us: list[float] = []
    count_calls(counts, engine, "poll_text", times=poll_us)
    count_calls(counts, engine, "begin_text_sessions", rows=lambda sessions: len(sessions))
    for module in (engine_module, text_session):  # each imported build_prompt by name
        count_calls(counts, module, "build_prompt")
    out = {"turns": turns, "at_once": at_once, "frames": frames}
    ops = count_engine_ops(EngineService)
    async with EngineService.for_engine(engine, prepare_opens=True) as service:
        await service.wait_ready()
        await run_turns(service, "whole", at_once, at_once, frames)  # what the first turns make once
        await run_turns(service, "streamed", at_once, at_once, frames)
        for kind in ("whole", "streamed"):
            counts.clear()
            poll_us.clear()
            ops.ops.clear()
            rounds, streams, cpu = service.rounds, service.round_streams, engine_cpu_s(service)
            caller_s = await run_turns(service, kind, turns, at_once, frames)
            per_turn = {k: round(v / turns, 2) for k, v in sorted(counts.items())}
            if poll_us:
                per_turn["poll_text_us_p50_p90"] = [round(statistics.quantiles(poll_us, n=10)[i], 2) for i in (4, 8)]
            per_turn["rounds"] = round((service.rounds - rounds) / turns, 2)
            per_turn["streams_a_round"] = round(
                (service.round_streams - streams) / max(1, service.rounds - rounds), 2)
            per_turn["engine_cpu_ms"] = round((engine_cpu_s(service) - cpu) * 1e3 / turns, 2)
            per_turn["caller_open_cpu_ms"] = round(caller_s * 1e3 / turns, 3)
            # Each a launch or more on a GPU: between rounds the GPU waits on them.
            per_turn["engine_ops_between_rounds"] = round(ops.ops["critical"] / turns, 1)
            per_turn["engine_ops_overlapped"] = round(ops.ops["prepare"] / turns, 1)
            out[kind] = per_turn
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--turns", type=int, default=48)
    p.add_argument("--at-once", type=int, default=8)
    p.add_argument("--frames", type=int, default=12)
    p.add_argument("--no-seed-rows", action="store_true",
                   help="a streamed turn's first poll computes its text vectors (text_session.SEED_ROWS off)")
    args = p.parse_args()
    text_session.SEED_ROWS = not args.no_seed_rows
    print_measured(lambda engine, folder: measure(engine, folder, args.turns, args.at_once, args.frames))


if __name__ == "__main__":
    main()
