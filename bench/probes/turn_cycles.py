"""How many objects a finished turn leaves in reference cycles (freed only by the collector's
passes, which stop every thread), per path: whole-text and streamed-text streams of an
EngineService, the in-process fleet endpoint in both modes, and the server's WebSocket (its own
process's share: the server runs in this process, over the same service).

A streamed-text turn's session and text feed referred to each other (~35 objects a turn); a312410
breaks that at close. Tiny random checkpoint, CPU, seconds:

    python3 bench/probes/turn_cycles.py [--turns 6]
"""

from __future__ import annotations

import argparse
import asyncio
import gc

from tiny_cpu import print_measured  # beside this file

from pipecat_qwen_fast.bench import fleet_callers
from pipecat_qwen_fast.bench.fleet_workload import fleet_replies
from pipecat_qwen_fast.bench.server_latency import serve_in_thread
from pipecat_qwen_fast.engine.request import SynthesisRequest
from pipecat_qwen_fast.engine.service import EngineService


async def cyclic_per_turn(run, turns: int) -> float:
    """Objects found unreachable by a collection after `turns` turns, per turn (the collector off
    meanwhile, so that nothing is freed behind the count)."""
    await run(2)  # whatever the first turns make once
    await asyncio.sleep(0.2)
    gc.collect()
    gc.disable()
    try:
        await run(turns)
        await asyncio.sleep(0.5)  # the streams' closes, on the engine thread and the server's loop
        found = gc.collect()
    finally:
        gc.enable()
    return round(found / turns, 1)


async def measure(engine, model: str, turns: int) -> dict:
    service = EngineService.for_engine(engine)
    await service.wait_ready()
    reply = fleet_replies()[0]
    texts = [r.text for r in fleet_replies()]

    def direct(streamed: bool):
        async def run(n: int) -> None:
            for i in range(n):
                request = SynthesisRequest("" if streamed else texts[i], text_mode="dual_track", seed=i,
                                           max_frames=6)
                if streamed:
                    stream = service.open_text_stream(request)
                    stream.append(texts[i])
                    stream.end()
                else:
                    stream = service.open_stream(request)
                async for _ in stream:
                    pass
                await stream.aclose()
        return run

    def through(endpoint_of):
        async def run(n: int) -> None:
            endpoint = endpoint_of()
            try:
                for i in range(n):
                    async for _ in endpoint.speak(fleet_callers.Reply(reply.text, 6), seed=i):
                        pass
                await endpoint.settle()
            finally:
                if hasattr(endpoint, "aclose"):
                    await endpoint.aclose()
        return run

    voice = engine.default_voice
    out = {"turns": turns,
           "service_whole": await cyclic_per_turn(direct(False), turns),
           "service_streamed": await cyclic_per_turn(direct(True), turns),
           "fleet_endpoint_whole": await cyclic_per_turn(through(
               lambda: fleet_callers.InProcessEndpoint(service, voice, "dual_track", False)), turns),
           "fleet_endpoint_streamed": await cyclic_per_turn(through(
               lambda: fleet_callers.InProcessEndpoint(service, voice, "dual_track", True)), turns)}
    server, thread, port = serve_in_thread(service, model, "cpu", "torch", max_streams=100)
    try:
        out["server_websocket"] = await cyclic_per_turn(through(
            lambda: fleet_callers.ServerEndpoint(f"http://127.0.0.1:{port}", voice, "dual_track", service)),
            turns)
    finally:
        server.should_exit = True
        thread.join(10)
        await service.aclose()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--turns", type=int, default=6)
    args = p.parse_args()
    print_measured(lambda engine, model: measure(engine, model, args.turns))


if __name__ == "__main__":
    main()
