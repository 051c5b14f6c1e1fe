"""Baseline: the official implementation (`qwen_tts` from qwen-tts-hf 0.1.1.post1, transformers 5).

Used as its README shows: `Qwen3TTSModel.from_pretrained(dir, device_map=..., dtype=bf16,
attn_implementation="sdpa")` then `generate_custom_voice(text, speaker=..., language=...)`. It has
no streaming output, so its time to first audio is the whole call. Frames are fixed by
`max_new_tokens` on a checkpoint whose EOS row is zeroed.

Per-frame split: the talker's `code_predictor.generate` (called once per frame inside the talker's
forward) and the speech tokenizer's `decode` are timed with a synchronize on each side.

Usage: python bench/baselines/official_qwen_tts_bench.py --model DIR --texts texts.json --out out.json
"""

from __future__ import annotations

import sys
import time
import warnings

import driver_common as dc
import torch


def generate(tts, text: str, speaker: str, max_new_tokens: int):
    wavs, sr = tts.generate_custom_voice(text, speaker=speaker, language="Auto", max_new_tokens=max_new_tokens)
    return wavs[0], sr


def timed_run(tts, text: str, speaker: str, max_new_tokens: int, predictor: dc.CallTimer,
              vocoder: dc.CallTimer) -> dict:
    predictor.take(), vocoder.take()
    t0 = time.perf_counter()
    wav, sr = generate(tts, text, speaker, max_new_tokens)
    wall = time.perf_counter() - t0
    frames = dc.frames_of(len(wav))
    audio = len(wav) / sr
    pred = sum(predictor.take())
    voc = sum(vocoder.take())
    return {
        "frames": frames,
        "wall_s": wall,
        "ttfc_ms": 1e3 * wall,
        "audio_s": audio,
        "rtf": wall / audio if audio else None,
        "frame_ms": 1e3 * (wall - voc) / frames if frames else None,
        "predictor_ms_per_frame": 1e3 * pred / frames if frames else None,
        "vocoder_s": voc,
    }


def main(argv: list[str] | None = None) -> int:
    args = dc.parse_args(argv, budget_s=200.0)
    budget = dc.Budget(args.budget)
    spec = dc.load_texts(args.texts)
    report = dc.Report(args.out, {"implementation": "official qwen_tts (non-streaming)", "attn": "sdpa"})

    warnings.filterwarnings("ignore")
    import qwen_tts
    import transformers
    from qwen_tts import Qwen3TTSModel

    report.put("versions", {"qwen_tts": qwen_tts.__version__, "transformers": transformers.__version__,
                            "torch": torch.__version__})
    report.put("rope_fix", dc.fix_rope_init_for_transformers5())
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    report.put("dtype", str(dtype).removeprefix("torch."))

    t0 = time.perf_counter()
    tts = Qwen3TTSModel.from_pretrained(args.model, device_map=args.device, dtype=dtype, attn_implementation="sdpa")
    dc.sync()
    report.put("load_s", time.perf_counter() - t0)
    speaker = dc.pick_speaker(tts.get_supported_speakers())
    report.put("speaker", speaker)
    predictor = dc.CallTimer(tts.model.talker.code_predictor, "generate")
    vocoder = dc.CallTimer(tts.model.speech_tokenizer, "decode")

    # The first request after load, short: it also tells how max_new_tokens maps to frames.
    first_text, first_frames = spec["utterances"][1]
    first = timed_run(tts, first_text, speaker, first_frames, predictor, vocoder)
    report.put("first_request", first)
    extra = first_frames - first["frames"]  # 1 when the last new token is the one that stops
    report.put("max_new_tokens_minus_frames", extra)

    frames = spec["rtf_frames"]
    runs = []
    for _ in range(spec["runs"]):
        if runs and budget.left() < runs[-1]["wall_s"] * 1.2:
            break
        runs.append(timed_run(tts, spec["rtf_text"], speaker, frames + extra, predictor, vocoder))
        report.put("whole", {"runs": runs, "rtf_median": dc.median([x["rtf"] for x in runs]),
                             "frame_ms_median": dc.median([x["frame_ms"] for x in runs]),
                             "predictor_ms_median": dc.median([x["predictor_ms_per_frame"] for x in runs])})
    report.put("peak_gpu_memory_gib", dc.peak_memory_gib())
    report.put("finished", True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
