"""`qwen-fast-tts`: speak text to a WAV file, list voices, build random checkpoints, benchmark."""

from __future__ import annotations

import argparse
import sys
import time
import wave
from pathlib import Path

import numpy as np

from pipecat_qwen_fast.config import DEFAULT_MODEL
from pipecat_qwen_fast.errors import QwenTTSError
from pipecat_qwen_fast.server.cli import add_serve_parser
from pipecat_qwen_fast.voices.cli import add_voice_parser


def write_wav(path: str | Path, pcm: np.ndarray, sample_rate: int) -> None:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(np.ascontiguousarray(pcm, dtype="<i2").tobytes())


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help="local checkpoint folder or Hugging Face hub id")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16")
    p.add_argument("--backend", default="auto", help="auto | torch | megakernel")


def cmd_say(args: argparse.Namespace) -> int:
    from pipecat_qwen_fast.engine.engine import QwenTTSEngine

    engine = QwenTTSEngine.from_pretrained(args.model, device=args.device, dtype=args.dtype, backend=args.backend)
    text = args.text if args.text != "-" else sys.stdin.read()
    t0 = time.perf_counter()
    chunks = []
    first = None
    for chunk in engine.stream(
        text, voice=args.voice, language=args.language, instruct=args.instruct, seed=args.seed,
        greedy=args.greedy, text_mode=args.text_mode, max_frames=args.max_frames,
    ):
        if first is None:
            first = time.perf_counter() - t0
        chunks.append(chunk.pcm)
    wall = time.perf_counter() - t0
    pcm = np.concatenate(chunks) if chunks else np.zeros(0, np.int16)
    write_wav(args.output, pcm, engine.sample_rate)
    audio_s = len(pcm) / engine.sample_rate
    print(
        f"wrote {args.output}: {audio_s:.2f} s of audio in {wall:.2f} s "
        f"(first audio after {1000 * (first or 0):.0f} ms, RTF {wall / max(audio_s, 1e-9):.3f})",
        file=sys.stderr,
    )
    return 0


def cmd_voices(args: argparse.Namespace) -> int:
    from pipecat_qwen_fast.engine.engine import QwenTTSEngine

    engine = QwenTTSEngine.from_pretrained(args.model, device=args.device, dtype=args.dtype, backend="torch",
                                           warmup=False)
    print(f"model type: {engine.model_type}")
    print("voices:", ", ".join(engine.voices) or "(none: " + ("use instruct" if engine.model_type == "voice_design" else "clone a voice") + ")")
    print("languages:", ", ".join(engine.languages))
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    from pipecat_qwen_fast.engine.loading import prepare
    from pipecat_qwen_fast.utils.cache import cache_dir

    if args.model is None and not args.arch:
        print("error: name a --model to load and warm up, or --arch to build the megakernel only", file=sys.stderr)
        return 2
    log = prepare(args.model, device=args.device, backend=args.backend, archs=args.arch)
    for name, seconds in log.top_level().items():
        print(f"{seconds:8.1f} s  {name}", file=sys.stderr)
    print(f"cache folder: {cache_dir()}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="qwen-fast-tts", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    say = sub.add_parser("say", help="speak text into a WAV file")
    say.add_argument("text", help="text to speak ('-' reads standard input)")
    _add_model_args(say)
    say.add_argument("--voice", default=None,
                     help="speaker (CustomVoice models, see `qwen-fast-tts voices`) or a .voice file (Base models)")
    say.add_argument("--language", default="auto")
    say.add_argument("--instruct", default=None, help="voice / style description (VoiceDesign, 1.7B CustomVoice)")
    say.add_argument("--seed", type=int, default=None)
    say.add_argument("--greedy", action="store_true", help="argmax decoding instead of sampling")
    say.add_argument("--text-mode", default=None, choices=["prefill", "dual_track"])
    say.add_argument("--max-frames", type=int, default=None, help="hard cap on 80 ms frames")
    say.add_argument("-o", "--output", default="out.wav")
    say.set_defaults(func=cmd_say)

    voices = sub.add_parser("voices", help="list the voices and languages of a model")
    _add_model_args(voices)
    voices.set_defaults(func=cmd_voices)

    prep = sub.add_parser("prepare", help="do every one-time build and compile now (for images and new machines)",
                          description="Fill the cache folder ($QWEN_FAST_CACHE, default ~/.cache/pipecat_qwen_fast) "
                                      "with the megakernel library and torch's compiled code, so later starts are warm.")
    prep.add_argument("--model", default=None, help="checkpoint folder or hub id: load and warm it up once")
    prep.add_argument("--device", default="auto", help="auto | cuda | cuda:N (default: auto)")
    prep.add_argument("--backend", default="auto", help="auto | torch | megakernel | eager (default: auto)")
    prep.add_argument("--arch", nargs="*", default=None,
                      help="build only the megakernel for these GPU architectures (e.g. sm_90 sm_80); needs no GPU")
    prep.set_defaults(func=cmd_prepare)

    add_voice_parser(sub)
    add_serve_parser(sub)

    build = sub.add_parser("build-checkpoint", help="write a random-weight checkpoint (tests, benchmarks)",
                           add_help=False)
    build.set_defaults(func=None)

    bench = sub.add_parser("bench", help="run the GPU benchmark (see bench/README)", add_help=False)
    bench.set_defaults(func=None)

    args, rest = parser.parse_known_args(argv)
    if args.command == "build-checkpoint":
        from pipecat_qwen_fast.checkpoints.build import main as build_main

        return build_main(rest)
    if args.command == "bench":
        from pipecat_qwen_fast.bench.main import main as bench_main

        return bench_main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        return args.func(args)
    except QwenTTSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
