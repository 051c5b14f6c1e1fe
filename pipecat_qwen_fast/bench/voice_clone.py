"""Timing of voice cloning (issue 36's targets): making a voice, first audio with a cloned voice,
and the steady frame time of cloned voices against CustomVoice's.

    qwen-fast-tts bench voice-clone --model BASE_DIR --custom-voice-model CV_DIR --device cuda
    python -m pipecat_qwen_fast.bench.voice_clone --model DIR --device cuda [--seconds 10] [--repeats 20]

Prints one JSON object (and writes it to --out). The reference is `seconds` of synthetic voiced
audio (a glottal-like pulse train through formant resonances, plus breath noise) at `--rate` Hz,
handed over as an array, so a file read is not part of the time; resampling is (when the rate is
not 24 kHz).

Frame time (`frame_time`): one call at a time, greedy, `--frames` frames (the checkpoints' EOS
row zeroed, so every run reaches the cap), the default chunk schedule, each model in its default
text mode; per run the time from the first audio to the last over the frames after the first
chunk (vocoder included), p50 over `--frame-repeats` runs; also the p50 of each engine.step after
the first audio. An ICL voice (its 10 s reference in the prompt) and an x-vector voice on the Base
checkpoint, the default speaker on `--custom-voice-model` (a CustomVoice checkpoint of the same
size), and each cloned voice's ratio to CustomVoice (the bar: within 10 %).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from pipecat_qwen_fast.engine.request import SynthesisRequest
from pipecat_qwen_fast.voices.audio import load_reference

REF_TEXT = "This is the reference recording that the voice is cloned from."
# A text long enough that its frame cap is far above --frames (42 words, bench/texts.RTF_TEXT's length).
FRAME_TEXT = ("The quick brown fox jumps over the lazy dog while the band plays a slow song in the park, "
              "and everyone who walks by stops for a moment to listen before they go on with their "
              "busy day in the warm light of the late afternoon sun.")


def synthetic_speech(seconds: float, rate: int = 24000, seed: int = 0) -> np.ndarray:
    """Speech-like float32 audio: a pitch-varying pulse train through three formant resonators,
    with noise; deterministic for a seed."""
    rng = np.random.default_rng(seed)
    n = round(seconds * rate)
    t = np.arange(n) / rate
    f0 = 120 + 30 * np.sin(2 * np.pi * 0.7 * t) + 10 * np.sin(2 * np.pi * 3.1 * t)
    phase = 2 * np.pi * np.cumsum(f0) / rate
    source = np.sign(np.sin(phase)) * (0.5 + 0.5 * np.sin(2 * np.pi * 2.3 * t) ** 2)
    out = np.zeros(n)
    for formant, gain in ((700, 1.0), (1200, 0.6), (2600, 0.3)):
        out += gain * np.sin(2 * np.pi * formant * t) * (0.5 + 0.5 * source)
    out += 0.02 * rng.standard_normal(n)
    return (0.3 * out / np.abs(out).max()).astype(np.float32)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _summary(values: list[float]) -> dict:
    ordered = sorted(values)
    return {"p50_ms": 1e3 * statistics.median(ordered), "min_ms": 1e3 * ordered[0],
            "p95_ms": 1e3 * ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))], "n": len(ordered)}


def time_create_voice(engine, seconds: float = 10.0, *, icl: bool = True, rate: int = 24000,
                      repeats: int = 20, warmup: int = 3) -> dict:
    """engine.create_voice on `seconds` of audio (not registered, so not primed), and its stages:
    reading + checks + resampling, the two encoders, and priming the vocoder with the codes."""
    library = engine.voice_library
    audio = synthetic_speech(seconds, rate)
    text = REF_TEXT if icl else None
    device = engine.device
    library.encoders()  # loaded before timing
    stages: dict[str, list[float]] = {"create_voice": [], "read_resample": [], "encoders": [], "prime": []}
    for i in range(warmup + repeats):
        _sync(device)
        t0 = time.perf_counter()
        voice = engine.create_voice(audio, ref_text=text, sample_rate=rate, register=False)
        _sync(device)
        t1 = time.perf_counter()
        ref = load_reference(audio, rate)
        t2 = time.perf_counter()
        library.encoders().encode(ref.wav, with_codes=icl)
        _sync(device)
        t3 = time.perf_counter()
        if icl:
            stream = engine.vocoder.new_stream(batch=1, device=device, dtype=engine.dtype)
            with torch.no_grad():
                engine.vocoder.prime_stream(voice.prompt.ref_codes.to(device), stream)
            _sync(device)
        t4 = time.perf_counter()
        if i >= warmup:
            for key, dt in (("create_voice", t1 - t0), ("read_resample", t2 - t1), ("encoders", t3 - t2),
                            ("prime", t4 - t3)):
                stages[key].append(dt)
    out = {k: _summary(v) for k, v in stages.items() if v and (icl or k != "prime")}
    out.update(seconds=seconds, rate=rate, mode="icl" if icl else "x_vector", device=str(device))
    return out


def time_first_audio(engine, voice, text: str = "Hello, this is a cloned voice speaking.", *,
                     repeats: int = 20, warmup: int = 3) -> dict:
    """Time from engine.stream(text, voice=voice) to its first audio chunk (the default chunk
    schedule: one frame first)."""
    times = []
    for i in range(warmup + repeats):
        _sync(engine.device)
        t0 = time.perf_counter()
        stream = engine.stream(text, voice=voice, seed=i)
        next(stream)
        dt = time.perf_counter() - t0
        stream.close()
        if i >= warmup:
            times.append(dt)
    return _summary(times)


def time_frames(engine, voice, text: str = FRAME_TEXT, *, frames: int = 128, repeats: int = 5,
                warmup: int = 1) -> dict:
    """Steady frame time of one call (see the module docstring): greedy, `frames` frames, the
    default chunk schedule and text mode."""
    per_run, steps, produced_runs = [], [], []
    text_mode = None
    for i in range(warmup + repeats):
        session = engine.open_session(SynthesisRequest(text, voice=voice, greedy=True, max_frames=frames))
        text_mode = session.text_mode
        first_at = last_at = None
        first_frames = produced = 0
        run_steps = []
        try:
            while not session.done:
                t0 = time.perf_counter()
                chunks = engine.step(session)
                t1 = time.perf_counter()
                if first_at is not None:
                    run_steps.append(t1 - t0)
                for chunk in chunks:
                    if first_at is None:
                        first_at, first_frames = t1, chunk.num_frames
                    last_at = t1
                    produced += chunk.num_frames
        finally:
            engine.close_session(session)
        if i >= warmup and first_at is not None and produced > first_frames:
            per_run.append((last_at - first_at) / (produced - first_frames))
            steps += run_steps
            produced_runs.append(produced)
    if not per_run:
        raise RuntimeError("no run made more than one chunk of audio: raise --frames")
    return {"ms_per_frame": 1e3 * statistics.median(per_run), "ms_per_frame_runs": [1e3 * v for v in per_run],
            "step_ms_p50": 1e3 * statistics.median(steps), "frames": produced_runs, "text_mode": text_mode,
            "runs": len(per_run)}


def _load(model, args: argparse.Namespace):
    from pipecat_qwen_fast.engine.engine import QwenTTSEngine

    engine = QwenTTSEngine.from_pretrained(model, device=args.device, dtype=args.dtype, backend=args.backend,
                                           progress=False)
    engine.finish_warmup()  # steady state: the compiled graphs a serving engine has once idle
    return engine


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="qwen-fast-tts bench voice-clone", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a Base checkpoint folder or hub id")
    ap.add_argument("--custom-voice-model", default=None,
                    help="a CustomVoice checkpoint of the same size: its frame time is the bar's reference")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--rate", type=int, default=24000, help="sample rate of the reference handed in")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--frames", type=int, default=128, help="frames a frame-time run makes")
    ap.add_argument("--frame-repeats", type=int, default=5, help="frame-time runs per voice")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON to this file")
    args = ap.parse_args(argv)
    engine = _load(args.model, args)
    result: dict = {"backend": engine.backend.name, "device": str(engine.device)}

    def save() -> None:
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=2) + "\n")

    result["create_icl"] = time_create_voice(engine, args.seconds, icl=True, rate=args.rate, repeats=args.repeats)
    result["create_x_vector"] = time_create_voice(engine, args.seconds, icl=False, rate=args.rate,
                                                  repeats=args.repeats)
    save()
    icl = engine.create_voice(synthetic_speech(args.seconds, args.rate), sample_rate=args.rate, name="bench-icl",
                              ref_text=REF_TEXT)
    result["first_audio_icl"] = time_first_audio(engine, icl.name, repeats=args.repeats)
    xvec = engine.create_voice(synthetic_speech(args.seconds, args.rate), sample_rate=args.rate, name="bench-xvec")
    result["first_audio_x_vector"] = time_first_audio(engine, xvec.name, repeats=args.repeats)
    frame_time: dict = {"frames": args.frames, "reference_seconds": args.seconds}
    frame_time["icl"] = time_frames(engine, icl.name, frames=args.frames, repeats=args.frame_repeats)
    frame_time["x_vector"] = time_frames(engine, xvec.name, frames=args.frames, repeats=args.frame_repeats)
    result["frame_time"] = frame_time
    save()
    if args.custom_voice_model is not None:
        engine.close()
        del engine
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        cv = _load(args.custom_voice_model, args)
        if cv.model_type != "custom_voice":
            raise SystemExit(f"--custom-voice-model: {args.custom_voice_model} is a {cv.model_type} model")
        frame_time["custom_voice"] = time_frames(cv, cv.default_voice, frames=args.frames,
                                                 repeats=args.frame_repeats)
        frame_time["custom_voice_backend"] = cv.backend.name
        base = frame_time["custom_voice"]["ms_per_frame"]
        for mode in ("icl", "x_vector"):
            frame_time[f"{mode}_over_custom_voice"] = frame_time[mode]["ms_per_frame"] / base
        cv.close()
        save()
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
