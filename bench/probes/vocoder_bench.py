"""Vocoder speed and exactness at full size (random weights): `python bench/probes/vocoder_bench.py`.

Prints, per dtype: max |stream - whole| for a few chunkings (float64 too), whole-utterance
decode time for a few lengths, and the per-call time of `decode_stream` for a few chunk sizes
(eager PyTorch, no CUDA graphs). Needs CUDA for meaningful numbers; on CPU use small --frames.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from pipecat_qwen_fast.checkpoints.tiny_configs import speech_tokenizer_config_dict
from pipecat_qwen_fast.config import parse_vocoder_config, read_json
from pipecat_qwen_fast.vocoder.vocoder import Vocoder


def build(config: Path | None, device: str) -> Vocoder:
    raw = read_json(config) if config else speech_tokenizer_config_dict("0.6b")
    cfg = parse_vocoder_config(raw)
    voc = Vocoder(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in voc.named_parameters():
            if name.endswith("embedding_sum"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith(("alpha", "beta")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    voc.refresh_derived()
    return voc.to(device).eval()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_call(fn, device: str, repeat: int) -> float:
    fn()
    sync(device)
    t = time.perf_counter()
    for _ in range(repeat):
        fn()
    sync(device)
    return (time.perf_counter() - t) / repeat


def stream_all(voc: Vocoder, codes: torch.Tensor, n: int) -> torch.Tensor:
    st = voc.new_stream()
    return torch.cat([voc.decode_stream(codes[..., t:t + n], st, check_values=False)
                      for t in range(0, codes.shape[-1], n)], dim=-1)


def count_kernels(voc: Vocoder, chunk: torch.Tensor, device: str) -> int | None:
    """Device kernels launched by one decode_stream call (what a CUDA graph would replay)."""
    if device != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    st = voc.new_stream()
    voc.decode_stream(chunk, st, check_values=False)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        voc.decode_stream(chunk, st, check_values=False)
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if e.device_type.name == "CUDA")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", type=Path, help="speech_tokenizer config.json (default: released)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--frames", type=int, nargs="+", default=[50, 300, 1000])
    ap.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4, 8, 12])
    ap.add_argument("--check-frames", type=int, default=400)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--no-tf32", action="store_true", help="disable TF32 convolutions (cuDNN)")
    args = ap.parse_args()
    dev = args.device
    if args.no_tf32:
        torch.backends.cudnn.allow_tf32 = False
    base = build(args.config, dev)
    spf = base.samples_per_frame
    results = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
               "cudnn_tf32": torch.backends.cudnn.allow_tf32, "runs": []}
    print(json.dumps({k: v for k, v in results.items() if k != "runs"}))
    # float64 only checks exactness (stream == whole up to rounding); it is not timed.
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        voc = base.to(dtype)
        g = torch.Generator().manual_seed(1)
        q, size = voc.cfg.num_quantizers, voc.cfg.codebook_size
        codes = torch.randint(0, size, (1, q, max(args.frames + [args.check_frames])), generator=g).to(dev)
        run = {"dtype": str(dtype).removeprefix("torch."), "stream_vs_whole": {}, "whole_ms": {},
               "stream_ms_per_call": {}}
        with torch.no_grad():
            ref = voc.decode(codes[..., :args.check_frames])
            run["peak"] = float(ref.abs().max())
            for n in (1, 4, 7):
                diff = (stream_all(voc, codes[..., :args.check_frames], n) - ref).abs().max()
                run["stream_vs_whole"][n] = float(diff)
            if dtype == torch.float64:
                print(json.dumps(run), flush=True)
                results["runs"].append(run)
                continue
            for t in args.frames:
                ms = 1e3 * time_call(lambda: voc.decode(codes[..., :t], check_values=False), dev, 3)
                run["whole_ms"][t] = round(ms, 2)
            run["kernels_per_call"] = count_kernels(voc, codes[..., :1], dev)
            for n in args.chunks:
                st = voc.new_stream()
                chunk = codes[..., :n]
                ms = 1e3 * time_call(lambda: voc.decode_stream(chunk, st, check_values=False), dev, 20)
                run["stream_ms_per_call"][n] = {
                    "ms": round(ms, 3), "audio_ms": n * spf / voc.cfg.sample_rate * 1e3,
                    "rtf": round(ms / (n * spf / voc.cfg.sample_rate * 1e3), 4)}
        print(json.dumps(run, indent=1), flush=True)
        results["runs"].append(run)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
