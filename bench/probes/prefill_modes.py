"""What the megakernel's fp32 prefill costs, against the bf16 one, in one engine:
`python bench/probes/prefill_modes.py --out DIR [--commit C] [--rounds K] [--backend auto|megakernel]`.

Random 0.6B CustomVoice checkpoint (EOS row zeroed), warmed up in full. The megakernel's prefill
modes (backends/megakernel.py PREFILL_MODES: fp32 with exact bf16-term products, fp32 on an fp32
copy of the layers, bf16 as before issue 34), each with its compiled, captured graphs, are
switched in turn, K rounds forward and then in reverse (host drift shows as a difference between
the two passes). For each: the GPU time of one captured prefill per bucket (CUDA events, median
of 50, a prompt 3 short of the bucket) and the warm TTFC over `bench_texts.UTTERANCES` (the
bench's requests; their prompt lengths are recorded); once per mode, the K/V and last hidden state
against the eager stack in fp32 for prompts of 12, 29 and 100 positions, and the device memory the
graphs (and the copy) of each mode other than the loaded one hold. Writes DIR/prefill_modes.json."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: megakernel_check, cuda_timing
from megakernel_check import git_commit, random_engine, warm_ttfc
from prefill_ab import prefill_ms  # the GPU time of a captured prefill per bucket

from pipecat_qwen_fast.backends.megakernel import PREFILL_MODES
from pipecat_qwen_fast.backends.prefill_graphs import stack_copy
from pipecat_qwen_fast.bench import texts
from pipecat_qwen_fast.model.layers import KVCache
from pipecat_qwen_fast.model.prompt import PREFILL, build_prompt


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def prepare_modes(mb) -> dict:
    """mode -> (graphs, stack, bytes held): the backend's own graphs for its mode, the others made
    and captured (compiled) here on the same weights."""
    modes = {}
    for mode in PREFILL_MODES:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        if mode == mb.prefill_mode:
            modes[mode] = (mb.prefills, mb._prefill_stack, None)
            continue
        saved = mb.prefill_mode, mb._prefill_stack
        mb.prefill_mode = mode
        mb._prefill_stack = stack_copy(mb.talker.model, torch.float32) if mode == "fp32-copy" else mb.talker.model
        graphs = mb.new_prefill_graphs()
        graphs.capture_all()
        torch.cuda.synchronize()
        modes[mode] = (graphs, mb._prefill_stack, torch.cuda.memory_allocated() - before)
        mb.prefill_mode, mb._prefill_stack = saved
    return modes


def use(mb, mode: str, graphs, stack) -> None:
    """The backend's prefill and its prompts as the mode makes them (what QWEN_FAST_MK_PREFILL sets at load)."""
    mb.prefill_mode, mb.prefills, mb._prefill_stack = mode, graphs, stack
    mb.talker.prompt_dtype = None if mode == "bf16" else torch.float32


@torch.no_grad()
def errors_against_fp32(graphs, talker, ref) -> dict:
    """`ref`: the fp32 model's stack, the eager reference."""
    g = torch.Generator(device="cuda").manual_seed(0)
    out = {}
    for n in (12, 29, 100):
        embeds = (torch.randn(n, talker.cfg.hidden_size, generator=g, device="cuda") * 0.05).to(torch.bfloat16)
        k, v, h = (t.clone() for t in graphs.run(embeds.to(graphs.dtype)))
        cache = KVCache(talker.cfg.stack, n, embeds.device, torch.float32)
        h32 = ref(embeds.float(), cache)[-1]
        out[str(n)] = {"k": rel(k[:, :, :n], cache.k), "v": rel(v[:, :, :n], cache.v), "hidden": rel(h, h32)}
    return out


def prompt_len(engine, text: str) -> int:
    with torch.no_grad():
        return build_prompt(engine.model.talker, engine.tokenizer, engine.config, text=text,
                            speaker=engine.default_voice, language="auto", instruct=None, text_mode=PREFILL,
                            voice_clone=None).embeds.shape[0]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--commit", default=None)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--backend", default="auto", choices=["auto", "megakernel"])
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict = {"date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "commit": args.commit or git_commit(), "script": "bench/probes/prefill_modes.py",
                    "gpu": torch.cuda.get_device_name(), "rounds": []}
    with random_engine(backend=args.backend) as (engine, load_s):
        engine.finish_warmup()
        mb = getattr(engine.backend, "fast", engine.backend)
        result |= {"load_s": load_s, "backend": engine.backend.name, "default_mode": mb.prefill_mode}
        result["prompt_positions"] = sorted(prompt_len(engine, text) for text in texts.UTTERANCES)
        modes = prepare_modes(mb)
        result["memory_mib_beside_the_loaded_mode"] = {m: None if b is None else b / 2**20
                                                       for m, (_, _, b) in modes.items()}
        result["compiled"] = {m: g.compile for m, (g, _, _) in modes.items()}
        ref = stack_copy(mb.talker.model, torch.float32)
        result["rel_err_vs_fp32"] = {m: errors_against_fp32(g, mb.talker, ref) for m, (g, _, _) in modes.items()}
        del ref
        print("relative errors against the fp32 stack:", json.dumps(result["rel_err_vs_fp32"]), flush=True)
        order = list(PREFILL_MODES) * args.rounds
        for mode in order + order[::-1]:
            use(mb, mode, *modes[mode][:2])
            graphs = modes[mode][0]
            row = {"mode": mode, "prefill_ms": prefill_ms(graphs, mb.tcfg.hidden_size), "ttfc_warm_ms": warm_ttfc(engine)}
            result["rounds"].append(row)
            t = row["ttfc_warm_ms"]
            print(f"{mode}: prefill ms by bucket {json.dumps(row['prefill_ms'])}; warm TTFC p50 {t['p50']:.2f} ms, "
                  f"p95 {t['p95']:.2f}", flush=True)
        use(mb, result["default_mode"], *modes[result["default_mode"]][:2])
    (args.out / "prefill_modes.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
