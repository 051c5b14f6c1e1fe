"""Where a batched round of the `torch` backend goes: `python bench/probes/batch_round_profile.py --out DIR`.

At 16 and 64 streams `auto` runs the batched CUDA graph (`GraphBackend`), ~10 ms a round plus
~0.4 ms a call on the H200 (docs/journal/NOTES.md, "Auto backend"); this script takes a round apart.
A random 0.6B CustomVoice engine (`backend="torch"`, no warm-up), then `max(--batches)` sessions
with random prompts of ~60 positions, advanced to talker position ~`--position`. Per batch size:

* the graph's replay alone and `decode_frames` (host preparation included), CUDA-event medians;
* the same frame run outside a graph under torch.profiler (the compiled step's code where it
  compiles): kernel count, summed kernel time, and the kernels grouped by kind (matmul, K/V
  gather, attention, sampling, pointwise...), top 25 by time;

for each layer step in --variants (`GraphBackend.layer_step`: "fused", compiled, or "plain"), from
the same positions, with each variant's `capture_all` timed (the first fused one compiles).

Writes `batch_round_profile.json` under --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

# This folder (the other probes), bench/ (megakernel_check, cuda_timing) and the repository.
sys.path[:0] = [str(Path(__file__).resolve().parents[i]) for i in range(3)]
from cuda_timing import event_times_ms
from megakernel_check import build_random_checkpoint

from pipecat_qwen_fast import QwenTTSEngine
from pipecat_qwen_fast.model.sampling import SamplingParams

# Kernel kinds by substrings of the kernel's name, first match wins.
KINDS = (
    ("triton (compiled, fused)", ("triton",)),
    ("matmul", ("gemm", "gemv", "cutlass", "xmma", "nvjet", "splitk")),
    ("attention", ("fmha", "flash", "attention", "efficient")),
    ("gather/scatter", ("index", "gather", "scatter", "put_")),
    ("sampling", ("topk", "sort", "radix", "exponential", "argmax", "softmax", "bitonic")),
    ("norm", ("rms", "norm")),
    ("copy", ("copy", "cat", "stack")),
    ("reduce", ("reduce",)),
    ("pointwise", ("elementwise", "vectorized", "unrolled")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    return next((k for k, keys in KINDS if any(s in low for s in keys)), "other")


def kernel_profile(fn, runs: int = 3) -> dict:
    """Kernels of `fn` (median of `runs` profiled calls after one unprofiled)."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            fn()
        torch.cuda.synchronize()
    per_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time > 0:
            slot = per_name[ev.name]
            slot[0] += ev.device_time / runs
            slot[1] += 1 / runs
    by_kind: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for name, (us, n) in per_name.items():
        k = by_kind[kind_of(name)]
        k[0] += us
        k[1] += n
    top = sorted(per_name.items(), key=lambda kv: -kv[1][0])[:25]
    return {
        "kernels": round(sum(n for _, n in per_name.values())),
        "kernel_us": round(sum(us for us, _ in per_name.values()), 1),
        "by_kind": {k: {"us": round(us, 1), "kernels": round(n)} for k, (us, n) in
                    sorted(by_kind.items(), key=lambda kv: -kv[1][0])},
        "top": [{"name": name[:160], "us": round(us, 1), "count": round(n)} for name, (us, n) in top],
    }


def measure_variant(be, states, base, kind: str, batches: list[int], params: SamplingParams, iters: int) -> dict:
    """One layer step ("fused" or "plain"): its captures timed (the first fused one compiles), then
    each batch size's rounds from the same positions (the states are rewound before each)."""
    be._choose_layer_step(kind)
    t0 = time.perf_counter()
    be.capture_all([params])
    out = {"layer_step": be.layer_step, "compiled": be.compiled, "capture_all_s": round(time.perf_counter() - t0, 1),
           "graphs": len(be.graphs), "rounds": {}}
    for bb in batches:
        part = states[:bb]
        for s, (position, frame) in zip(part, base):
            s.position, s.frame = position, frame  # the same positions for every variant
        be.decode_frames(part)
        attn = be._attn_bucket(max(s.position for s in part) + 1)
        graph = be.graphs[(bb, attn, params)]
        replay = event_times_ms(graph.replay, iters)
        for s, (position, frame) in zip(part, base):
            s.position, s.frame = position, frame
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            be.decode_frames(part)
        torch.cuda.synchronize()
        host_round = (time.perf_counter() - t0) / iters * 1e3
        be.use_graphs = False
        try:
            eager = kernel_profile(lambda bb=bb, attn=attn: be._frame(bb, attn, params))
        finally:
            be.use_graphs = True
        row = {"attn_bucket": attn, "replay_ms": round(statistics.median(replay), 3),
               "decode_frames_ms": round(host_round, 3), "kernels": eager}
        out["rounds"][bb] = row
        print(f"{kind} batch {bb}: replay {row['replay_ms']} ms, decode_frames {row['decode_frames_ms']} ms, "
              f"{eager['kernels']} kernels {eager['kernel_us']} us: "
              + ", ".join(f"{k} {v['us']}" for k, v in eager["by_kind"].items()), flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit", default="")
    ap.add_argument("--batches", default="1,4,16,32,64")
    ap.add_argument("--position", type=int, default=150)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--model", default=None, help="a checkpoint folder (default: a random 0.6B built here)")
    ap.add_argument("--variants", default="fused,plain,fused", help="layer steps to measure, in this order")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    res: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": args.commit,
                 "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "position": args.position}
    with tempfile.TemporaryDirectory(prefix="round-ckpt-") as tmp:
        t0 = time.perf_counter()
        if args.model is None:
            build_random_checkpoint(Path(tmp))
        engine = QwenTTSEngine.from_pretrained(args.model or tmp, device="cuda", backend="torch", warmup=False,
                                               progress=False)
        res["load_s"] = round(time.perf_counter() - t0, 1)
    be = engine.backend
    d = be.cfg.hidden_size
    params = SamplingParams()
    gen = torch.Generator(device="cuda").manual_seed(0)
    states = []
    for i in range(max(batches)):
        trailing = 0.02 * torch.randn(400, d, device="cuda", generator=gen)
        # Paged K/V: each state reserves what it reaches, so 512 of them fit the pool.
        st = be.new_state(max_positions=args.position + 80, params=params, seed=i, trailing=trailing, pad_vec=trailing[-1])
        be.prefill(st, 0.02 * torch.randn(60 + i % 8, d, device="cuda", generator=gen))
        states.append(st)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    be._choose_layer_step("plain")  # advancing compiles nothing
    while states[0].position < args.position:
        be.decode_frames(states)
    torch.cuda.synchronize()
    res["advance_s"] = round(time.perf_counter() - t0, 1)
    res["positions"] = [min(s.position for s in states), max(s.position for s in states)]
    base = [(s.position, s.frame) for s in states]
    res["variants"] = []
    for kind in args.variants.split(","):
        res["variants"].append(measure_variant(be, states, base, kind, batches, params, args.iters))
    for s in states:
        be.release(s)
    engine.close()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "batch_round_profile.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
