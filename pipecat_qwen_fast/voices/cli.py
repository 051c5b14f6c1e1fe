"""`qwen-fast-tts voice create REF --text "..." -o alice.voice`: make a voice file from a recording.

The file is then spoken with by path (`qwen-fast-tts say --voice alice.voice ...`, `voice=` in the
Pipecat and LiveKit services) or loaded into an engine's library (`engine.voice_library.load`).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from pipecat_qwen_fast.config import DEFAULT_MODEL


def add_voice_parser(sub) -> None:
    voice = sub.add_parser("voice", help="clone a voice from a recording (Base models)")
    actions = voice.add_subparsers(dest="voice_command", required=True)
    create = actions.add_parser(
        "create", help="make a .voice file from 1-30 s of speech (WAV, FLAC, OGG, MP3)",
        description="With --text (the recording's transcript) the voice clones in context (ICL); "
                    "without it, from the speaker vector only.")
    create.add_argument("audio", help="reference recording")
    text = create.add_mutually_exclusive_group()
    text.add_argument("--text", default=None, help="transcript of the recording (ICL voice)")
    text.add_argument("--text-file", type=Path, default=None, help="file holding the transcript")
    create.add_argument("--name", default=None, help="voice name (default: the recording's file name)")
    create.add_argument("-o", "--output", type=Path, default=None, help="voice file (default: NAME.voice)")
    create.add_argument("--model", default=DEFAULT_MODEL.replace("CustomVoice", "Base"),
                        help="Base checkpoint folder or Hugging Face hub id")
    create.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    create.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 (the encoders always run in float32)")
    create.set_defaults(func=cmd_voice_create)


def cmd_voice_create(args: argparse.Namespace) -> int:
    from pipecat_qwen_fast.engine.engine import QwenTTSEngine

    ref_text = args.text
    if args.text_file is not None:
        ref_text = args.text_file.read_text(encoding="utf-8")
    # Making a voice decodes nothing: the plain backend, no warm-up.
    engine = QwenTTSEngine.from_pretrained(args.model, device=args.device, dtype=args.dtype, backend="eager",
                                           warmup=False)
    t0 = time.perf_counter()
    voice = engine.create_voice(args.audio, ref_text=ref_text, name=args.name, register=False)
    seconds = time.perf_counter() - t0
    path = voice.save(args.output or Path(f"{voice.name}.voice"))
    detail = f"{voice.ref_frames} reference frames" if voice.mode == "icl" else "speaker vector only"
    print(f"wrote {path}: voice {voice.name!r}, {voice.mode} ({detail}), from {voice.ref_seconds:.1f} s of audio "
          f"in {1000 * seconds:.0f} ms", file=sys.stderr)
    return 0
