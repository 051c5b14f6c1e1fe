"""How many objects the garbage collector tracks for a finished engine stream, and for a fleet
utterance record, if something keeps them.

`bench fleet` in process kept every stream of a level until its end; at 768 H200 callers the
level's full collections (up to 78 ms) held the engine thread. Tiny random checkpoint, CPU,
seconds:

    python3 bench/probes/stream_objects.py [--streams 40]
"""

from __future__ import annotations

import argparse
import gc

from tiny_cpu import print_measured  # beside this file

from pipecat_qwen_fast.bench.fleet_workload import Utterance
from pipecat_qwen_fast.engine.request import SynthesisRequest
from pipecat_qwen_fast.engine.service import EngineService


async def count(engine, n: int) -> dict:
    async with EngineService.for_engine(engine) as service:
        await service.wait_ready()

        async def one(i: int):
            stream = service.open_stream(SynthesisRequest("Hello there friend.", seed=i, max_frames=3))
            u = Utterance(caller=i, frames=3, submitted=0.0)
            async for chunk in stream:
                u.arrivals.append(0.0)
                u.samples.append(len(chunk.pcm))
            await stream.wait_closed()
            return stream, u

        await one(0)  # whatever the first stream makes once
        gc.collect()
        before = len(gc.get_objects())
        kept = [await one(i) for i in range(1, n + 1)]
        gc.collect()
        both = len(gc.get_objects()) - before
        utterances = [u for _, u in kept]
        del kept
        gc.collect()
        records = len(gc.get_objects()) - before
        del utterances
    return {"streams": n, "tracked_per_stream_and_record": round(both / n, 1),
            "tracked_per_record": round(records / n, 1),
            "tracked_per_stream": round((both - records) / n, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=40)
    args = p.parse_args()
    print_measured(lambda engine, _: count(engine, args.streams))


if __name__ == "__main__":
    main()
