"""The captured prefill from the compiled layer step against plain graphs, in one engine:
`python bench/probes/prefill_ab.py --out DIR [--commit C] [--rounds K]`.

Random 0.6B CustomVoice checkpoint, the default backend. After the load (which captures the
compiled prefill graphs and logs their compile time) it alternates the backends' prefill graphs,
compiled then plain (`PrefillGraphs(compile=False)`, captured on the spot), K rounds: for each,
the GPU time of one captured prefill per bucket (CUDA events, median of 50), the warm TTFC over
`bench_texts.UTTERANCES` and one streamed sentence. Also the compiled K/V and hidden state against
the plain graphs' and both against the eager stack in fp32 (relative errors). Writes DIR/prefill_ab.json."""

from __future__ import annotations

import argparse
import copy
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: megakernel_check, cuda_timing
from cuda_timing import event_times_ms
from megakernel_check import git_commit, random_engine, warm_ttfc

from pipecat_qwen_fast.backends.prefill_graphs import PrefillGraphs
from pipecat_qwen_fast.bench import engine as bench_engine
from pipecat_qwen_fast.bench import texts
from pipecat_qwen_fast.model.layers import KVCache


def holders(backend) -> list:
    """The backend objects that hold prefill graphs (a hybrid backend's two share one)."""
    out = [b for b in (backend, getattr(backend, "fast", None), getattr(backend, "bulk", None))
           if b is not None and getattr(b, "prefills", None) is not None]
    if not out:
        raise RuntimeError(f"backend {type(backend).__name__} holds no prefill graphs")
    return out


def prefill_ms(graphs: PrefillGraphs, hidden: int) -> dict:
    """GPU ms of one captured prefill per bucket (a prompt 3 short of the bucket)."""
    out = {}
    for b in graphs.buckets:
        embeds = (torch.randn(b - 3, hidden, device=graphs.device) * 0.5).to(graphs.dtype)
        times = event_times_ms(lambda e=embeds: graphs.run(e), 55, sync_each=True)
        out[str(b)] = statistics.median(times[5:])
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--commit", default=None)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict = {"date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "commit": args.commit or git_commit(), "script": "bench/probes/prefill_ab.py",
                    "gpu": torch.cuda.get_device_name(), "rounds": []}
    with random_engine() as (engine, load_s):
        result["load_s"] = load_s
        result["backend"] = engine.backend.name
        hold = holders(engine.backend)
        compiled = hold[0].prefills
        result["compiled_prefill"] = compiled.compile
        result["prefill_compile_s"] = compiled.compile_s
        t0 = time.perf_counter()
        plain = PrefillGraphs(compiled.talker, compiled.device, compiled.dtype, compiled.buckets, compile=False)
        plain.capture_all()
        result["plain_capture_s"] = time.perf_counter() - t0
        hidden = compiled.talker.cfg.hidden_size
        # Both against the eager stack in fp32 (the reference path's precision), same inputs.
        ref = copy.deepcopy(compiled.talker).float()
        for m in ref.modules():  # the fused bf16 matrices are plain attributes: use the fp32 parameters
            for name in ("qkv_weight", "gate_up_weight"):
                if getattr(m, name, None) is not None:
                    setattr(m, name, None)
        g = torch.Generator(device="cuda").manual_seed(0)
        errs = {}
        for n in (12, 29, 100):
            embeds = (torch.randn(n, hidden, generator=g, device="cuda") * 0.5).to(compiled.dtype)
            a = [t.clone() for t in compiled.run(embeds)]
            b = [t.clone() for t in plain.run(embeds)]
            cache = KVCache(ref.cfg.stack, n, embeds.device, torch.float32)
            with torch.no_grad():
                h32 = ref.model(embeds.float(), cache)[-1]
            want = (cache.k, cache.v, h32)
            errs[str(n)] = {
                name: {"compiled_vs_plain": rel(a[i][..., :n, :] if i < 2 else a[i], b[i][..., :n, :] if i < 2 else b[i]),
                       "compiled_vs_fp32": rel(a[i][..., :n, :] if i < 2 else a[i], want[i]),
                       "plain_vs_fp32": rel(b[i][..., :n, :] if i < 2 else b[i], want[i])}
                for i, name in enumerate(("k", "v", "hidden"))
            }
        del ref
        result["rel_err"] = errs
        print("prefill relative errors:", json.dumps(errs), flush=True)
        for k in range(2 * args.rounds):
            graphs = compiled if k % 2 == 0 else plain
            for h in hold:
                h.prefills = graphs
            row = {"compiled": graphs is compiled, "prefill_ms": prefill_ms(graphs, hidden),
                   "ttfc_warm_ms": warm_ttfc(engine),
                   "streaming": bench_engine.measure_stream(engine, texts.RTF_TEXT, texts.RTF_FRAMES, 200)}
            result["rounds"].append(row)
            t = row["ttfc_warm_ms"]
            print(f"compiled={row['compiled']}: prefill ms by bucket {json.dumps(row['prefill_ms'])}; warm TTFC "
                  f"p50 {t['p50']:.2f} ms, p95 {t['p95']:.2f}; streaming TTFC {row['streaming']['ttfc_ms']:.2f} ms, "
                  f"RTF {row['streaming']['rtf']:.5f}", flush=True)
        for h in hold:
            h.prefills = compiled
    (args.out / "prefill_ab.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
