"""Timing of voice cloning (issue 36's targets): making a voice, and first audio with an ICL voice.

    python -m pipecat_qwen_fast.bench.voice_clone --model DIR --device cuda [--seconds 10] [--repeats 20]

Prints one JSON object. The reference is `seconds` of synthetic voiced audio (a glottal-like pulse
train through formant resonances, plus breath noise) at `--rate` Hz, handed over as an array, so a
file read is not part of the time; resampling is (when the rate is not 24 kHz).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np
import torch

from pipecat_qwen_fast.voices.audio import load_reference


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
    text = "This is the reference recording that the voice is cloned from." if icl else None
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


def main(argv: list[str] | None = None) -> int:
    from pipecat_qwen_fast.engine.engine import QwenTTSEngine

    ap = argparse.ArgumentParser(prog="python -m pipecat_qwen_fast.bench.voice_clone", description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a Base checkpoint folder or hub id")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--rate", type=int, default=24000, help="sample rate of the reference handed in")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args(argv)
    engine = QwenTTSEngine.from_pretrained(args.model, device=args.device, dtype=args.dtype, backend=args.backend)
    engine.finish_warmup()  # steady state: the compiled graphs a serving engine has once idle
    result = {
        "create_icl": time_create_voice(engine, args.seconds, icl=True, rate=args.rate, repeats=args.repeats),
        "create_x_vector": time_create_voice(engine, args.seconds, icl=False, rate=args.rate, repeats=args.repeats),
    }
    icl = engine.create_voice(synthetic_speech(args.seconds, args.rate), sample_rate=args.rate, name="bench-icl",
                              ref_text="This is the reference recording that the voice is cloned from.")
    result["first_audio_icl"] = time_first_audio(engine, icl.name, repeats=args.repeats)
    xvec = engine.create_voice(synthetic_speech(args.seconds, args.rate), sample_rate=args.rate, name="bench-xvec")
    result["first_audio_x_vector"] = time_first_audio(engine, xvec.name, repeats=args.repeats)
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
