"""Device check of the CUDA-graph torch backend against the eager reference (one device call).

Builds a random 0.6B CustomVoice checkpoint (EOS row zeroed), then: greedy codes graph vs eager,
per-frame time of both, graph capture time, TTFC of a streamed utterance, and round-robin
throughput over many sessions. Writes JSON to $OUT/graph_check.json and prints a summary.

    python bench/probes/graph_check.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pipecat_qwen_fast import QwenTTSEngine, SynthesisRequest  # noqa: E402

TEXT = "The quick brown fox jumps over the lazy dog while the sun sets slowly behind the distant hills."


def sync() -> None:
    torch.cuda.synchronize()


def time_frames(engine: QwenTTSEngine, frames: int, greedy: bool) -> float:
    s = engine.open_session(SynthesisRequest(TEXT, voice="ryan", seed=0, greedy=greedy, max_frames=frames + 1, vocode=False))
    engine.step(s)  # frame 0 separately (no talker step)
    sync()
    t = time.perf_counter()
    n = 0
    while not s.done:
        engine.step(s)
        n += 1
    sync()
    return (time.perf_counter() - t) / max(n, 1) * 1000


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--ckpt", default="/tmp/ckpt-0.6b")
    args = ap.parse_args()
    res: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    t = time.perf_counter()
    if not Path(args.ckpt, "model.safetensors").exists():
        subprocess.run([sys.executable, "-m", "pipecat_qwen_fast.checkpoints.build", "--size", "0.6b", "--variant",
                        "custom_voice", "--out", args.ckpt, "--zero-eos"], check=True)
    res["build_s"] = time.perf_counter() - t

    t = time.perf_counter()
    graph = QwenTTSEngine.from_pretrained(args.ckpt, device="cuda", dtype="bfloat16", backend="torch", warmup=False)
    res["load_s"] = time.perf_counter() - t
    t = time.perf_counter()
    graph.warmup()
    res["warmup_capture_s"] = time.perf_counter() - t
    res["graphs_captured"] = len(getattr(graph.backend, "graphs", {}))
    res["mem_after_warmup_gb"] = torch.cuda.memory_reserved() / 1e9
    res["graph_backend"] = type(graph.backend).__name__
    res["max_sessions"] = getattr(graph.backend, "max_sessions", None)
    eager = QwenTTSEngine.from_pretrained(args.ckpt, device="cuda", dtype="bfloat16", backend="eager", warmup=False)

    a = eager.generate_codes(TEXT, voice="ryan", greedy=True, max_frames=60)
    b = graph.generate_codes(TEXT, voice="ryan", greedy=True, max_frames=60)
    same = (a == b).all(dim=1).tolist()
    res["greedy_prefix_identical_frames"] = same.index(False) if False in same else len(same)
    res["greedy_code0_agreement"] = float((a[:, 0] == b[:, 0]).float().mean())
    sampled = graph.generate_codes(TEXT, voice="ryan", seed=1, max_frames=60)
    res["sampled_max_code"] = int(sampled.max())
    res["sampled_repeat_exact"] = bool(torch.equal(sampled, graph.generate_codes(TEXT, voice="ryan", seed=1, max_frames=60)))

    pre = []
    for i in range(10):
        sync()
        t = time.perf_counter()
        s = graph.open_session(SynthesisRequest(TEXT, voice="ryan", seed=i, max_frames=2))
        sync()
        pre.append((time.perf_counter() - t) * 1000)
        graph.close_session(s)
    res["open_session_prefill_ms_p50"] = statistics.median(pre)
    res["eager_ms_per_frame_greedy"] = time_frames(eager, 20, True)
    res["graph_ms_per_frame_greedy"] = time_frames(graph, 200, True)
    res["graph_ms_per_frame_sampled"] = time_frames(graph, 200, False)

    ttfc = []
    for i in range(12):
        sync()
        t = time.perf_counter()
        it = graph.stream(TEXT, voice="ryan", seed=i, max_frames=30)
        next(it)
        sync()
        ttfc.append((time.perf_counter() - t) * 1000)
        for _ in it:
            pass
    res["ttfc_ms"] = ttfc
    res["ttfc_p50_ms"] = statistics.median(ttfc[2:])

    # Whole streamed utterance: wall / audio.
    sync()
    t = time.perf_counter()
    pcm = sum(len(c.pcm) for c in graph.stream(TEXT, voice="ryan", seed=0, max_frames=150))
    sync()
    res["stream_rtf"] = (time.perf_counter() - t) / (pcm / 24000)

    for n in (1, 4, 16, 64):
        if n > graph.backend.max_sessions:
            break
        sessions = [graph.open_session(SynthesisRequest(TEXT, voice="ryan", seed=i, max_frames=60)) for i in range(n)]
        sync()
        t = time.perf_counter()
        audio = 0
        first_chunk = {}
        while not all(s.done for s in sessions):
            for i, r in enumerate(graph.step_many(sessions)):
                assert not isinstance(r, Exception), r
                if r and i not in first_chunk:
                    first_chunk[i] = time.perf_counter() - t
                audio += sum(len(c.pcm) for c in r)
        sync()
        wall = time.perf_counter() - t
        res[f"batched_{n}"] = {
            "aggregate_rtf": wall / (audio / 24000),
            "per_stream_rtf": wall / (audio / 24000 / n),
            "ms_per_batch_frame": wall / 60 * 1000,
            "first_chunk_max_ms": max(first_chunk.values()) * 1000,
        }
    res["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 1e9

    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "graph_check.json").write_text(json.dumps(res, indent=2))
    for k, v in res.items():
        print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
