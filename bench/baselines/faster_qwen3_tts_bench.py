"""Baseline: faster-qwen3-tts 0.5.4 (CUDA-graphed talker and predictor over qwen-tts-hf).

Used as its README shows: `FasterQwen3TTS.from_pretrained(dir)` then
`generate_custom_voice_streaming(text, speaker, language, chunk_size=...)` (streaming; default
chunk 12 and its smallest, 1) and `generate_custom_voice(...)` (whole utterance). Frames are fixed
by `max_new_tokens` on a checkpoint whose EOS row is zeroed.

Per-frame split (one extra instrumented whole-utterance run, so the timed runs carry no extra
synchronizes): its `predictor_graph.run` and `talker_graph.run`, each bracketed by a synchronize.

Usage: python bench/baselines/faster_qwen3_tts_bench.py --model DIR --texts texts.json --out out.json
"""

from __future__ import annotations

import sys
import time
import warnings

import driver_common as dc
import numpy as np
import torch

DEFAULT_CHUNK = 12
SMALLEST_CHUNK = 1


def stream(model, text: str, speaker: str, frames: int, chunk: int, first_only: bool = False) -> dict:
    t0 = time.perf_counter()
    gen = model.generate_custom_voice_streaming(text, speaker=speaker, language="Auto", max_new_tokens=frames,
                                                chunk_size=chunk)
    arrivals, durations = [], []
    try:
        for audio, sr, _timing in gen:
            arrivals.append(time.perf_counter() - t0)
            durations.append(len(audio) / sr)
            if first_only:
                break
    finally:
        gen.close()
    audio_s = sum(durations)
    out = {"ttfc_ms": 1e3 * arrivals[0], "chunks": len(arrivals)}
    if not first_only:
        out.update(
            frames=round(audio_s * dc.FRAME_RATE_HZ),
            wall_s=arrivals[-1],
            audio_s=audio_s,
            rtf=arrivals[-1] / audio_s,
            chunk_gap_ms_median=1e3 * float(np.median(np.diff(arrivals))) if len(arrivals) > 1 else None,
            underrun_ms=1e3 * dc.max_underrun(arrivals, durations),
        )
    return out


def whole(model, text: str, speaker: str, frames: int) -> dict:
    t0 = time.perf_counter()
    wavs, sr = model.generate_custom_voice(text, speaker=speaker, language="Auto", max_new_tokens=frames)
    wall = time.perf_counter() - t0
    samples = len(wavs[0])
    return {"frames": dc.frames_of(samples), "wall_s": wall, "ttfc_ms": 1e3 * wall, "audio_s": samples / sr,
            "rtf": wall / (samples / sr)}


def split(model, text: str, speaker: str, frames: int) -> dict:
    predictor = dc.CallTimer(model.predictor_graph, "run")
    talker = dc.CallTimer(model.talker_graph, "run")
    vocoder = dc.CallTimer(model.model.model.speech_tokenizer, "decode")
    try:
        run = whole(model, text, speaker, frames)
    finally:
        predictor.restore(), talker.restore(), vocoder.restore()
    n = run["frames"]
    pred_ms = 1e3 * sum(predictor.seconds) / n
    talk_ms = 1e3 * sum(talker.seconds) / n
    frame_ms = 1e3 * (run["wall_s"] - sum(vocoder.seconds)) / n
    return {"frames": n, "frame_ms_instrumented": frame_ms, "predictor_graph_ms": pred_ms, "talker_graph_ms": talk_ms,
            "glue_ms": frame_ms - pred_ms - talk_ms, "vocoder_s": sum(vocoder.seconds)}


def main(argv: list[str] | None = None) -> int:
    args = dc.parse_args(argv, budget_s=150.0)
    budget = dc.Budget(args.budget)
    spec = dc.load_texts(args.texts)
    report = dc.Report(args.out, {"implementation": "faster-qwen3-tts", "attn": "sdpa", "dtype": "bfloat16"})

    warnings.filterwarnings("ignore")
    import faster_qwen3_tts
    import qwen_tts
    import transformers
    from faster_qwen3_tts import FasterQwen3TTS

    report.put("versions", {"faster_qwen3_tts": faster_qwen3_tts.__version__, "qwen_tts": qwen_tts.__version__,
                            "transformers": transformers.__version__, "torch": torch.__version__})
    report.put("rope_fix", dc.fix_rope_init_for_transformers5())

    t0 = time.perf_counter()
    model = FasterQwen3TTS.from_pretrained(args.model, device=args.device, dtype=torch.bfloat16,
                                           attn_implementation="sdpa")
    dc.sync()
    report.put("load_s", time.perf_counter() - t0)
    speaker = dc.pick_speaker(model.model.get_supported_speakers())
    report.put("speaker", speaker)

    # First request after load (CUDA graphs are captured inside it), default chunk size.
    first_text, first_frames = spec["utterances"][1]
    report.put("first_request", stream(model, first_text, speaker, first_frames, DEFAULT_CHUNK))

    frames, runs = spec["rtf_frames"], spec["runs"]
    whole_runs: list[dict] = []
    for _ in range(runs):
        whole_runs.append(whole(model, spec["rtf_text"], speaker, frames))
        report.put("whole", {"runs": whole_runs, "rtf_median": dc.median([r["rtf"] for r in whole_runs])})

    for chunk in (DEFAULT_CHUNK, SMALLEST_CHUNK):
        key = f"streaming_chunk{chunk}"
        ttfc = []
        for text, n in spec["utterances"]:
            if budget.left() < 30:
                break
            ttfc.append({"words": len(text.split()), "ms": stream(model, text, speaker, n, chunk, first_only=True)["ttfc_ms"]})
        result = {"chunk_size": chunk, "ttfc_warm_ms": {**dc.summarize([t["ms"] for t in ttfc]), "per_utterance": ttfc}}
        report.put(key, result)
        stream_runs: list[dict] = []
        for _ in range(runs):
            if budget.left() < (stream_runs[-1]["wall_s"] if stream_runs else whole_runs[-1]["wall_s"] * 1.5) + 15:
                break
            stream_runs.append(stream(model, spec["rtf_text"], speaker, frames, chunk))
            result.update(runs=stream_runs, rtf_median=dc.median([r["rtf"] for r in stream_runs]))
            report.put(key, result)

    if budget.left() > whole_runs[-1]["wall_s"] * 1.5 + 5:
        report.put("breakdown", split(model, spec["rtf_text"], speaker, frames))
    report.put("peak_gpu_memory_gib", dc.peak_memory_gib())
    report.put("finished", True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
