"""In which round each chunk of a call reaches its stream, whole text against a streamed turn
given its whole text at once (a server's WebSocket turn), for calls joining a running batch.

On the H200 (session 41) the streamed turns' second and third chunks came within 20 ms of their
playback 50 times as often as whole texts' at 464 callers, on one engine, with the same rounds
before them. A chunk's slack is 80 ms a frame of audio before it less the time since the first
chunk, so a chunk that arrives one round later than its whole-text twin loses a round of slack.
This counts, per kind, the rounds between a call's first chunk and its next ones (and between its
open and its first chunk): a structural difference shows here on the CPU, where rounds are slow
but in the same order as on the GPU.

Tiny random checkpoint, CPU, the auto backend's shape (per-call eager side, the graph backend's
batched frame run eagerly), deferred vocoder calls as on a GPU, a minute or two:

    python3 bench/probes/chunk_rounds.py [--calls 12] [--batch 6]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import tempfile

from pipecat_qwen_fast import QwenTTSEngine, SynthesisRequest
from pipecat_qwen_fast.backends.graph import GraphBackend
from pipecat_qwen_fast.bench.fleet_callers import InProcessEndpoint
from pipecat_qwen_fast.backends.hybrid import HybridBackend
from pipecat_qwen_fast.checkpoints.build import build_checkpoint
from pipecat_qwen_fast.engine.service import EngineService, SynthesisStream


def hybrid_engine(folder: str, max_sessions: int) -> QwenTTSEngine:
    engine = QwenTTSEngine.from_pretrained(folder, device="cpu", dtype="float32", backend="eager", progress=False)
    bulk = GraphBackend(engine.model.talker, engine.device, engine.dtype, max_sessions=max_sessions, capacity=512,
                        use_graphs=False)
    # first_alone_below=0: a fleet's batch is far past the first-frame-alone limit (16).
    engine.backend = HybridBackend(engine.backend, bulk, fast_sessions=0, first_alone_below=0)
    return engine


def record_arrivals(service: EngineService) -> dict[int, list[int]]:
    """stream id -> the service's round count at each chunk's arrival (the slack's clock)."""
    arrivals: dict[int, list[int]] = collections.defaultdict(list)
    real = SynthesisStream._audio_arrived

    def arrived(self, frames: int) -> None:
        arrivals[self.record.stream_id].append(service.rounds)
        real(self, frames)

    SynthesisStream._audio_arrived = arrived
    return arrivals


def request(i: int, frames: int) -> SynthesisRequest:
    return SynthesisRequest(f"Caller number {i} says hello, how can I help you today?", voice="ryan", seed=i,
                            max_frames=frames, text_mode="dual_track")


async def drain(stream) -> None:
    async for _ in stream:
        pass


async def measure(service: EngineService, calls: int, batch: int) -> dict:
    arrivals = record_arrivals(service)
    opened_at: dict[int, int] = {}
    kinds: dict[int, str] = {}
    background = [service.open_stream(request(100 + i, 60)) for i in range(batch)]
    tasks = [asyncio.create_task(drain(s)) for s in background]
    while service.rounds < 4:
        await asyncio.sleep(0.01)
    for i in range(calls):
        kind = ("whole", "streamed")[i % 2]
        start = service.rounds
        stream = InProcessEndpoint(service, "ryan", streamed=kind == "streamed").open(request(i, 6))
        opened_at[stream.record.stream_id], kinds[stream.record.stream_id] = start, kind
        tasks.append(asyncio.create_task(drain(stream)))
        while service.rounds < start + 3:  # joins while the batch runs, one call at a time
            await asyncio.sleep(0.005)
    await asyncio.gather(*tasks)
    out: dict = {}
    for kind in ("whole", "streamed"):
        ids = [i for i, k in kinds.items() if k == kind]
        first = collections.Counter(arrivals[i][0] - opened_at[i] for i in ids)
        gaps = [collections.Counter(arrivals[i][c] - arrivals[i][0] for i in ids if len(arrivals[i]) > c)
                for c in (1, 2)]
        out[kind] = {"calls": len(ids),
                     "rounds open -> chunk 1": dict(sorted(first.items())),
                     "rounds chunk 1 -> chunk 2": dict(sorted(gaps[0].items())),
                     "rounds chunk 1 -> chunk 3": dict(sorted(gaps[1].items()))}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=12)
    p.add_argument("--batch", type=int, default=6)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        build_checkpoint(tmp, size="tiny", variant="custom_voice", zero_eos=True)
        engine = hybrid_engine(tmp, max_sessions=args.batch + args.calls + 2)

        async def run() -> dict:
            async with EngineService.for_engine(engine, overlap_vocoder=True) as service:
                await service.wait_ready()
                return await measure(service, args.calls, args.batch)

        try:
            print(json.dumps(asyncio.run(run()), indent=1))
        finally:
            engine.close()


if __name__ == "__main__":
    main()
