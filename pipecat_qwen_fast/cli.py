"""`qwen-fast-tts`: speak text to a WAV file, list voices, build random checkpoints, benchmark."""

from __future__ import annotations

import argparse
import os
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
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    p.add_argument("--backend", default="auto",
                   help="auto | torch | megakernel | eager (eager: plain PyTorch, no CUDA graphs)")


class GrowingWav:
    """A WAV file written chunk by chunk, its header fixed up after every chunk (wave does that
    on each writeframes) and flushed: readable while it grows, and complete up to the last chunk
    if the run is interrupted. The file is created with the first chunk, so a run that fails
    before any audio leaves none."""

    def __init__(self, path: str | Path, sample_rate: int) -> None:
        self.path = path
        self.sample_rate = sample_rate
        self.samples = 0
        self._file = None
        self._wav: wave.Wave_write | None = None

    def write(self, pcm: np.ndarray) -> None:
        if self._wav is None:
            self._file = open(self.path, "wb")  # noqa: SIM115 - closed by close()
            self._wav = wave.open(self._file, "wb")
            self._wav.setnchannels(1)
            self._wav.setsampwidth(2)
            self._wav.setframerate(self.sample_rate)
        self._wav.writeframes(np.ascontiguousarray(pcm, dtype="<i2").tobytes())
        self._file.flush()
        self.samples += len(pcm)

    def close(self) -> None:
        if self._wav is not None:
            self._wav.close()
            self._file.close()
            self._wav = None


class Progress:
    """Audio made so far, on stderr: one line rewritten in place on a terminal; elsewhere (a log)
    a line at the first audio and then at most one a second."""

    def __init__(self, sample_rate: int) -> None:
        self.sample_rate = sample_rate
        self.tty = sys.stderr.isatty()
        self.start = time.perf_counter()
        self.first: float | None = None
        self._printed = 0.0

    def update(self, samples: int) -> None:
        now = time.perf_counter()
        line = f"{samples / self.sample_rate:.1f} s of audio in {now - self.start:.1f} s"
        if self.first is None:
            self.first = now - self.start
        elif not self.tty and now - self._printed < 1.0:
            return
        self._printed = now
        print(f"\r{line}" if self.tty else line, end="" if self.tty else "\n", file=sys.stderr, flush=True)

    def end(self) -> None:
        if self.tty and self.first is not None:
            print(file=sys.stderr)


def output_problem(path: str | Path) -> str | None:
    """Why a WAV cannot be written at `path` (None if it can): checked before the model loads."""
    p = Path(path)
    folder = p.parent
    if p.is_dir():
        return "it is a folder"
    if not folder.exists():
        return f"the folder {folder} does not exist"
    if not folder.is_dir():
        return f"{folder} is not a folder"
    if not os.access(folder, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        return "permission denied"
    return None


def cmd_say(args: argparse.Namespace) -> int:
    text = args.text if args.text != "-" else sys.stdin.read()
    problem = output_problem(args.output)
    if problem is not None:
        print(f"error: cannot write the audio to {args.output}: {problem}", file=sys.stderr)
        return 2
    wav: GrowingWav | None = None
    progress: Progress | None = None
    try:
        from pipecat_qwen_fast.engine.engine import QwenTTSEngine

        engine = QwenTTSEngine.from_pretrained(args.model, device=args.device, dtype=args.dtype,
                                               backend=args.backend)
        wav = GrowingWav(args.output, engine.sample_rate)
        progress = Progress(engine.sample_rate)
        for chunk in engine.stream(
            text, voice=args.voice, language=args.language, instruct=args.instruct, seed=args.seed,
            greedy=args.greedy, text_mode=args.text_mode, max_frames=args.max_frames,
        ):
            wav.write(chunk.pcm)
            progress.update(wav.samples)
    except KeyboardInterrupt:
        if progress is not None:
            progress.end()
        kept = f"kept {wav.samples / wav.sample_rate:.2f} s of audio in {args.output}" if wav and wav.samples else (
            "no audio written")
        print(f"interrupted: {kept}", file=sys.stderr)
        return 130
    finally:
        if wav is not None:
            wav.close()
    progress.end()
    wall = time.perf_counter() - progress.start
    if not wav.samples:  # the model ended at once: still a (silent) WAV, as asked
        write_wav(args.output, np.zeros(0, np.int16), engine.sample_rate)
    audio_s = wav.samples / engine.sample_rate
    print(
        f"wrote {args.output}: {audio_s:.2f} s of audio in {wall:.2f} s "
        f"(first audio after {1000 * (progress.first or 0):.0f} ms, RTF {wall / max(audio_s, 1e-9):.3f})",
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

    # Both show each option's default in their help.
    defaults_shown = argparse.ArgumentDefaultsHelpFormatter
    say = sub.add_parser("say", help="speak text into a WAV file", formatter_class=defaults_shown,
                         description="Speak text into a WAV file, written as the audio streams (an "
                                     "interrupted run keeps what was made), with progress on stderr.")
    say.add_argument("text", help="text to speak ('-' reads standard input)")
    _add_model_args(say)
    say.add_argument("--voice", default=None,
                     help="speaker (CustomVoice models, see `qwen-fast-tts voices`) or a .voice file (Base "
                          "models); None: the model's default speaker")
    say.add_argument("--language", default="auto", help="a language name (see `qwen-fast-tts voices`) or auto")
    say.add_argument("--instruct", default=None, help="voice / style description (VoiceDesign, 1.7B CustomVoice)")
    say.add_argument("--seed", type=int, default=None, help="sampling seed (None: a fresh one)")
    say.add_argument("--greedy", action="store_true", help="argmax decoding instead of sampling")
    say.add_argument("--text-mode", default=None, choices=["prefill", "dual_track"],
                     help="None: the model variant's official default")
    say.add_argument("--max-frames", type=int, default=None, help="hard cap on 80 ms frames (None: the model's)")
    say.add_argument("-o", "--output", default="out.wav", help="the WAV file to write (24 kHz, 16-bit mono)")
    say.set_defaults(func=cmd_say)

    voices = sub.add_parser("voices", help="list the voices and languages of a model", formatter_class=defaults_shown)
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
