"""A streamed turn's first poll after its begin, with the segment's text vectors seeded from its
prompt (`text_session.SEED_ROWS`, the default) and without (the reference: the poll computes them
all): torch operations dispatched in that poll (each a kernel launch or more on a GPU, where the
poll runs between rounds with the GPU waiting) and the poll's time on this CPU.

Turns as a server gives them: the fleet's replies, each whole text appended and ended before its
begin, begun four at a time in one batched prefill. Tiny random checkpoint, CPU, ~20 s:

    python3 bench/probes/seed_rows.py
"""

from __future__ import annotations

import statistics
import time

from tiny_cpu import CountOps, print_measured  # beside this file

from pipecat_qwen_fast.bench.fleet_workload import fleet_replies
from pipecat_qwen_fast.engine import text_session
from pipecat_qwen_fast.engine.request import SynthesisRequest


def first_polls(engine, seed: bool) -> dict:
    text_session.SEED_ROWS = seed
    ops, us = [], []
    replies = fleet_replies()
    for at in range(0, len(replies), 4):
        sessions = []
        for reply in replies[at : at + 4]:
            s = engine.open_text_session(SynthesisRequest("", voice="ryan", greedy=True, max_frames=4))
            engine.append_text(s, reply.text)
            engine.end_text(s)
            sessions.append(s)
        assert engine.begin_text_sessions(sessions) == [None] * len(sessions)
        for s in sessions:
            with CountOps() as counted:
                t0 = time.perf_counter()
                assert engine.poll_text(s) is None  # its text is all there: it can step
                us.append((time.perf_counter() - t0) * 1e6)
            ops.append(counted.ops["all"])
        for s in sessions:
            engine.close_session(s)
    return {"turns": len(ops), "ops_mean": round(statistics.mean(ops), 2), "ops_max": max(ops),
            "poll_us_p50": round(statistics.median(us), 1)}


async def measure(engine, _folder: str) -> dict:
    first_polls(engine, True)  # warm both paths once
    first_polls(engine, False)
    return {"seeded": first_polls(engine, True), "computed_at_the_poll": first_polls(engine, False)}


if __name__ == "__main__":
    print_measured(measure)
