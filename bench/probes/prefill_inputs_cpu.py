"""Which bf16 inputs part the megakernel path's greedy codes from the fp32 model's?
`python bench/probes/prefill_inputs_cpu.py [--frames N] [--checkpoint DIR]` (CPU, ~15 min on 2 cores).

A random full-size 0.6B CustomVoice checkpoint (EOS row zeroed; built in a temporary folder unless
given). Every run decodes with the fp32 model eagerly (the megakernel's decode equals it, tests/
test_megakernel.py), from one input made as the fp32 model makes it except:
  T  the text vectors the decode adds (pad_vec here: CustomVoice's prefill mode) rounded to bf16,
     as the kernel read them before issue 34;
  E  the prompt's vectors rounded to bf16;
  P  the prompt computed by the bf16 model (text projection in bf16), the prefill in fp32;
  C  the prompt and the prefill in bf16: the megakernel path before issue 34.
For three bench texts, each run's first frame whose 16 codes differ from the fp32 model's."""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from pipecat_qwen_fast import QwenTTSEngine
from pipecat_qwen_fast.bench import texts
from pipecat_qwen_fast.model.prompt import PREFILL, build_prompt
from pipecat_qwen_fast.model.sampling import SamplingParams

GREEDY = SamplingParams(do_sample=False, subtalker_do_sample=False)


def bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).float()


def prompt(engine, text: str):
    with torch.no_grad():
        return build_prompt(engine.model.talker, engine.tokenizer, engine.config, text=text,
                            speaker=engine.default_voice, language="auto", instruct=None, text_mode=PREFILL,
                            voice_clone=None)


def state(tb32, tb16, frames: int, embeds, trailing, pad, prefill16: bool = False):
    """An fp32 decode state after a prefill of `embeds` in fp32, or in bf16 (its K/V and hidden upcast)."""
    st = tb32.new_state(max_positions=embeds.shape[0] + frames + 2, params=GREEDY, seed=0,
                        trailing=trailing.float(), pad_vec=pad.float())
    if not prefill16:
        tb32.prefill(st, embeds.float())
        return st
    n = embeds.shape[0]
    low = tb16.new_state(max_positions=n + 2, params=GREEDY, seed=0, trailing=trailing, pad_vec=pad)
    tb16.prefill(low, embeds.to(torch.bfloat16))
    st.talker_cache.k[:, :, :n] = low.talker_cache.k[:, :, :n].float()
    st.talker_cache.v[:, :, :n] = low.talker_cache.v[:, :, :n].float()
    st.talker_cache.length = n
    st.hidden = low.hidden.float()
    return st


def first_differences(e32, e16, text: str, frames: int) -> dict:
    tb32, tb16 = e32.backend, e16.backend
    p32, p16 = prompt(e32, text), prompt(e16, text)
    runs = {
        "T: text vectors rounded to bf16": state(tb32, tb16, frames, p32.embeds, bf16(p32.trailing), bf16(p32.pad_vec)),
        "E: prompt rounded to bf16": state(tb32, tb16, frames, bf16(p32.embeds), p32.trailing, p32.pad_vec),
        "P: prompt computed in bf16, fp32 prefill": state(tb32, tb16, frames, p16.embeds.float(),
                                                          p16.trailing.float(), p16.pad_vec.float()),
        "C: prompt and prefill in bf16": state(tb32, tb16, frames, p16.embeds, p16.trailing, p16.pad_vec,
                                               prefill16=True),
    }
    ref = state(tb32, tb16, frames, p32.embeds, p32.trailing, p32.pad_vec)
    first: dict = {name: None for name in runs}
    for f in range(frames):
        want = tb32.decode_frame(ref)
        for name in [k for k in runs if first[k] is None]:
            if not torch.equal(tb32.decode_frame(runs[name]), want):
                first[name] = f
        if all(v is not None for v in first.values()):
            break
    return {"positions": p32.embeds.shape[0], "first_difference": first}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--frames", type=int, default=100)
    ap.add_argument("--checkpoint", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory(prefix="ckpt-0.6b-") as tmp:
        path = args.checkpoint
        if path is None:
            from pipecat_qwen_fast.checkpoints.build import build_checkpoint

            path = build_checkpoint(Path(tmp), "0.6b", "custom_voice", seed=0, zero_eos=True, dtype="bfloat16")
        e32, e16 = (QwenTTSEngine.from_pretrained(path, device="cpu", dtype=d, backend="eager", progress=False)
                    for d in ("float32", "bfloat16"))
        for i in (4, 7, 13):
            t0 = time.time()
            r = first_differences(e32, e16, texts.UTTERANCES[i], args.frames)
            print(f"text {texts.UTTERANCES[i][:40]!r}: prompt {r['positions']} positions ({time.time() - t0:.0f} s)")
            for name, f in r["first_difference"].items():
                print(f"  {name}: first difference {f if f is not None else f'none in {args.frames}'}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
