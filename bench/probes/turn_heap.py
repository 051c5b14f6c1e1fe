"""What stays in the collector's reach after the first turns of each kind: the H200's in-process
fleet had ~6,000 unfrozen objects after a level of whole texts and ~58,000 after the first level
of streamed turns (session 43, `heap_after`), and each full collection walked them (44-63 ms).

The heap frozen as the engine freezes it once warm; then whole-text turns, then streamed-text
turns, through the in-process fleet endpoint (as the fleet benchmark runs them), each followed by
a full collection and a census of what survived it: the growth by type, and the functions and
`inspect.Parameter` objects by the module that made them. Tiny random checkpoint, CPU, seconds:

    python3 bench/probes/turn_heap.py [--turns 6]
"""

from __future__ import annotations

import argparse
import collections
import gc
import inspect

from tiny_cpu import print_measured  # beside this file

from pipecat_qwen_fast.bench import fleet_callers
from pipecat_qwen_fast.bench.fleet_workload import fleet_replies
from pipecat_qwen_fast.engine.heap import freeze_heap, heap_census
from pipecat_qwen_fast.engine.service import EngineService


def unfrozen_by_kind() -> collections.Counter:
    """Every tracked object outside the frozen heap after a full collection, by type, with
    functions by module."""
    gc.collect()
    kinds: collections.Counter = collections.Counter()
    for obj in gc.get_objects():
        if inspect.isfunction(obj):
            kinds[f"function in {obj.__module__}"] += 1
        else:
            kinds[f"{type(obj).__module__}.{type(obj).__qualname__}"] += 1
    return kinds


async def measure(engine, model: str, turns: int) -> dict:
    service = EngineService.for_engine(engine)
    await service.wait_ready()
    replies = fleet_replies()
    voice = engine.default_voice

    async def speak(streamed: bool) -> None:
        endpoint = fleet_callers.InProcessEndpoint(service, voice, "dual_track", streamed)
        for i in range(turns):
            async for _ in endpoint.speak(fleet_callers.Reply(replies[i].text, 6), seed=i):
                pass
        await endpoint.settle()

    out: dict = {"turns": turns}
    freeze_heap(collect=True)
    before = unfrozen_by_kind()
    out["after_freeze"] = heap_census(top=0)["unfrozen"]
    for name, streamed in (("whole", False), ("streamed", True), ("streamed_again", True)):
        await speak(streamed)
        now = unfrozen_by_kind()
        grew = now - before
        out[name] = {"unfrozen": heap_census(top=0)["unfrozen"], "grew": sum(grew.values()),
                     "grew_most": grew.most_common(12)}
        before = now
    await service.aclose()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--turns", type=int, default=6)
    args = p.parse_args()
    print_measured(lambda engine, model: measure(engine, model, args.turns))


if __name__ == "__main__":
    main()
