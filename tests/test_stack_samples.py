"""The stack sampler (engine/stack_samples.py) beside a real engine on CPU: the engine thread's
round shows up under its own name, innermost frames within their stacks, the file complete."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

from pipecat_qwen_fast import QwenTTSEngine, SynthesisRequest
from pipecat_qwen_fast.engine import stack_samples
from pipecat_qwen_fast.engine.service import EngineService

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench" / "probes"))
import stack_window

CPU = {"device": "cpu", "dtype": "float32", "backend": "torch"}
TIMEOUT = 120


async def test_samples_name_the_engine_threads_round(endless_model, tmp_path):
    engine = QwenTTSEngine.from_pretrained(endless_model, progress=False, **CPU)
    sampler = stack_samples.StackSampler(tmp_path, interval_s=0.001).start()
    try:
        async with EngineService.for_engine(engine, name="sampled") as service:
            await service.wait_ready()
            pcm = await asyncio.wait_for(service.synthesize(
                SynthesisRequest("Sampled while it speaks.", seed=1, max_frames=40)), TIMEOUT)
            assert len(pcm) == 40 * 1920
    finally:
        sampler.stop()
    report = json.loads(sampler.path.read_text())
    engine_thread = report["threads"]["qwen-fast-sampled"]
    assert engine_thread["samples"] >= 5
    # An innermost frame is also on its stack (where both lists, each cut at TOP, keep it); the
    # round loop is on (nearly) every one.
    both = engine_thread["self"].keys() & engine_thread["total"].keys()
    assert both and all(engine_thread["total"][key] >= engine_thread["self"][key] for key in both)
    loop = [key for key in engine_thread["total"] if key.startswith("EngineService._run (service.py:")]
    assert loop and engine_thread["total"][loop[0]] >= 0.9 * engine_thread["samples"]
    assert "qwen-stack-sampler" not in report["threads"]  # it does not sample itself
    # The history's last line holds the same counts; a window over all of it, the same again.
    history = [json.loads(line) for line in sampler.history.read_text().splitlines()]
    assert history[-1]["threads"]["qwen-fast-sampled"]["samples"] == engine_thread["samples"]
    whole = stack_window.window(history, 0.0, float("inf"))["threads"]["qwen-fast-sampled"]
    assert whole["samples"] == engine_thread["samples"] and whole["total"][loop[0]] == engine_thread["total"][loop[0]]


def test_a_process_samples_only_where_the_environment_asks(tmp_path):
    # In a fresh interpreter: nothing without the variable; with it, one sampler for the process,
    # its file written by the time the process exits.
    code = ("from pipecat_qwen_fast.engine import stack_samples as s; import time; "
            "a = s.start_from_env(); b = s.start_from_env(); time.sleep(0.05); "
            "print(a is b, a is not None)")
    env_off = {k: v for k, v in os.environ.items() if k != stack_samples.ENV}
    off = subprocess.run([sys.executable, "-c", code], check=True, env=env_off, capture_output=True, text=True, timeout=60)
    assert off.stdout.split() == ["True", "False"]
    on = subprocess.run([sys.executable, "-c", code], check=True, env={**env_off, stack_samples.ENV: str(tmp_path)},
                        capture_output=True, text=True, timeout=60)
    assert on.stdout.split() == ["True", "True"]
    (written,) = tmp_path.glob("stacks-*.json")
    assert json.loads(written.read_text())["threads"]["MainThread"]["samples"] >= 1
