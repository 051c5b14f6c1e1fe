"""What one stack sample costs (pipecat_qwen_fast/engine/stack_samples.py): the sampling thread's
CPU time per `sample()`, beside a real engine speaking on CPU (tiny checkpoint), and that cost as
a share of one CPU at the sampler's interval.

    python3 bench/probes/stack_sample_cost.py [--samples 300]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

from pipecat_qwen_fast import QwenTTSEngine, SynthesisRequest
from pipecat_qwen_fast.engine.service import EngineService
from pipecat_qwen_fast.engine.stack_samples import SAMPLE_S, StackSampler

REPO = Path(__file__).resolve().parents[2]
CKPT = REPO / ".cache/ckpt/tiny-custom_voice-default-eos0-s0-bfloat16-b9eb2e36d628d8d2"


async def measure(samples: int) -> dict:
    engine = QwenTTSEngine.from_pretrained(CKPT, progress=False, device="cpu", dtype="float32", backend="torch")
    sampler = StackSampler(tempfile.mkdtemp())
    async with EngineService.for_engine(engine, name="cost") as service:
        await service.wait_ready()
        speaking = asyncio.ensure_future(service.synthesize(
            SynthesisRequest("Measured while it speaks, for a while.", seed=1, max_frames=400)))
        await asyncio.sleep(0.5)
        costs = []
        for _ in range(samples):
            t0 = time.thread_time()  # this thread's CPU, not the GIL waits around it
            sampler.sample()
            costs.append(time.thread_time() - t0)
            await asyncio.sleep(SAMPLE_S)
        speaking.cancel()
    us = 1e6 * statistics.median(costs)
    return {"threads_sampled": len(sampler.samples), "sample_us_median": round(us, 1),
            "sample_us_p90": round(1e6 * sorted(costs)[int(0.9 * len(costs))], 1),
            "interval_s": SAMPLE_S, "share_of_one_cpu": round(us / (1e6 * SAMPLE_S), 4)}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=300)
    print(json.dumps(asyncio.run(measure(ap.parse_args().samples))))
