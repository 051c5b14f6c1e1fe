"""Batched prefill (`GraphBackend.prefill_many`) on the GPU: wall time of the first and second pass
at each (calls, longest prompt) shape, per attention kernel choice, against the captured one-by-one
prefill. `python bench/probes/prefill_profile.py --json FILE` (random 0.6B talker, bf16)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from pipecat_qwen_fast.backends.graph import GraphBackend
from pipecat_qwen_fast.model.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
SHAPES = [(4, 40), (4, 57), (16, 50), (16, 57), (64, 60), (64, 61)]
KERNELS = {
    "default": None,
    "no_cudnn": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
    "math": [SDPBackend.MATH],
}


def load_reference():
    spec = importlib.util.spec_from_file_location("mk_reference", ROOT / "cuda" / "reference.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    ref = load_reference()
    dev = torch.device("cuda")
    talker, _ = ref.random_talker("0.6b", dev, seed=0)
    gb = GraphBackend(talker, dev, torch.bfloat16, max_sessions=64, capacity=2048)
    gb.prefills.capture_all()
    D = talker.cfg.hidden_size
    gen = torch.Generator(device=dev).manual_seed(0)
    params = SamplingParams()

    def states_and_embeds(b, longest):
        lengths = [longest - (i * 7) % 11 for i in range(b)]
        embeds = [(torch.randn(n, D, device=dev, generator=gen) * 0.1).to(torch.bfloat16) for n in lengths]
        states = [gb.new_state(max_positions=n + 8, params=params, seed=0, trailing=torch.zeros(1, D, device=dev),
                               pad_vec=torch.zeros(D, device=dev)) for n in lengths]
        return states, embeds

    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "runs": []}
    for name, kernels in [("one_by_one_captured", None), *KERNELS.items()]:
        for b, longest in SHAPES:
            times = []
            for _ in range(3):
                states, embeds = states_and_embeds(b, longest)
                if name == "one_by_one_captured":
                    ms = timed(lambda st=states, em=embeds: [gb.prefill(s, e) for s, e in zip(st, em)])
                elif kernels is None:
                    ms = timed(lambda st=states, em=embeds: gb.prefill_many(st, em))
                else:
                    with sdpa_kernel(kernels):
                        ms = timed(lambda st=states, em=embeds: gb.prefill_many(st, em))
                times.append(round(ms, 2))
                for s in states:
                    gb.release(s)
            row = {"variant": name, "calls": b, "longest": longest, "ms_first_second_third": times}
            print(row, flush=True)
            out["runs"].append(row)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
