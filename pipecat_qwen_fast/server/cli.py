"""`qwen-fast-tts serve`: the server of one model on one device, until SIGTERM drains it."""

from __future__ import annotations

import argparse
import logging
import sys

from pipecat_qwen_fast.config import DEFAULT_MODEL


def add_serve_parser(sub) -> None:
    serve = sub.add_parser(
        "serve", help="serve a model over HTTP and WebSocket (OpenAI and vLLM-Omni APIs)",
        description="POST /v1/audio/speech (OpenAI), WebSocket /v1/audio/speech/stream "
                    "(vLLM-Omni's Qwen3-TTS protocol), /health, /ready, /metrics. SIGTERM drains: "
                    "streams in flight finish, new ones get 503. See docs/SERVER.md.")
    serve.add_argument("--model", default=DEFAULT_MODEL,
                       help="local checkpoint folder or Hugging Face hub id")
    serve.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    serve.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16")
    serve.add_argument("--backend", default="auto", help="auto | torch | megakernel | eager")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: all)")
    serve.add_argument("--port", type=int, default=8000, help="port (0: any free port, logged)")
    serve.add_argument("--api-key", default=None,
                       help="require this key (default: $QWEN_FAST_API_KEY; unset: no key)")
    serve.add_argument("--max-streams", type=int, default=32,
                       help="streams served at once; more are refused with 503 (default 32)")
    serve.add_argument("--max-input-chars", type=int, default=4096,
                       help="longest input text (default 4096)")
    serve.add_argument("--max-frames", type=int, default=None,
                       help="longest audio a stream may make, in 80 ms frames "
                            "(default: the engine's cap)")
    serve.add_argument("--drain-timeout", type=float, default=30.0,
                       help="seconds streams in flight may take to finish after SIGTERM "
                            "(default 30)")
    serve.add_argument("--voice-alias", action="append", default=[], metavar="NAME=VOICE",
                       help="another name for a voice, e.g. alloy=ryan for clients that only send "
                            "OpenAI voice names (repeatable)")
    serve.add_argument("--served-model-name", default=None,
                       help="the model id /v1/models reports")
    serve.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                       help="run the engine in a child process, this one keeping the sockets, "
                            "so that socket work never holds up the engine (default: on; "
                            "--no-engine-process: one process)")
    # Parsed in cmd_serve (the engine's checks import torch; --help should not).
    serve.add_argument("--max-round-ms", default="auto", metavar="auto|off|MS",
                       help="refuse new streams while the engine's smoothed round takes longer "
                            "(default auto: 32.5 ms on a GPU, off elsewhere)")
    serve.add_argument("--min-slack-ms", default="auto", metavar="auto|off|MS",
                       help="refuse new streams for 0.5 s after a chunk came within this much of "
                            "its playback (default auto: 20 ms on a GPU, off elsewhere)")
    serve.add_argument("--max-queued-streams", default="auto", metavar="auto|off|N",
                       help="refuse new streams while this many admitted calls wait to open "
                            "(default auto: 16 on a GPU, off elsewhere)")
    serve.add_argument("--log-level", default="info",
                       choices=["critical", "error", "warning", "info", "debug", "trace"])
    serve.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        from .run import serve
        from .settings import ServerSettings, parse_voice_aliases
    except ImportError as exc:
        print(f"error: the server needs the 'server' extra (missing {exc.name}): "
              "pip install 'pipecat-qwen-fast[server]'", file=sys.stderr)
        return 2
    level = logging.DEBUG if args.log_level == "trace" else getattr(logging, args.log_level.upper())
    logging.basicConfig(level=level, format="%(levelname)s:     %(name)s: %(message)s")
    try:
        from pipecat_qwen_fast.engine.service import parse_admission

        admission = {name: parse_admission(name, getattr(args, name))
                     for name in ("max_round_ms", "min_slack_ms", "max_queued_streams")}
        settings = ServerSettings(
            model=args.model, device=args.device, dtype=args.dtype, backend=args.backend,
            host=args.host, port=args.port, api_key=args.api_key, max_streams=args.max_streams,
            max_input_chars=args.max_input_chars, max_frames=args.max_frames,
            drain_timeout_s=args.drain_timeout, voice_aliases=parse_voice_aliases(args.voice_alias),
            served_model_name=args.served_model_name, log_level=args.log_level,
            engine_process=args.engine_process, **admission)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return serve(settings)
