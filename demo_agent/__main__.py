"""Entry point: ``python -m demo_agent pipecat|livekit ...``.

    python -m demo_agent pipecat [--port 7860]               # browser demo on http://localhost:7860/
    python -m demo_agent livekit console [--text]            # LiveKit console, local audio
    python -m demo_agent livekit dev                         # LiveKit server from LIVEKIT_URL

Text-to-speech options (both): --model (hub id or local folder), --voice, --language, --device,
--dtype, --backend, --seed, --max-frames. Everything after the LiveKit options goes to LiveKit's
own CLI.
"""

from __future__ import annotations

import argparse
import logging
import sys

from .options import add_tts_arguments, load_engine_service, tts_options_from_args


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m demo_agent",
        description="Talk to a voice agent that speaks with self-hosted Qwen3-TTS.",
        allow_abbrev=False,
    )
    parser.add_argument("--log-level", default="INFO", help="Python logging level (default INFO)")
    commands = parser.add_subparsers(dest="framework", required=True, metavar="FRAMEWORK")

    pipecat = commands.add_parser(
        "pipecat",
        help="Pipecat bot with the prebuilt browser UI (SmallWebRTC)",
        allow_abbrev=False,
    )
    pipecat.add_argument(
        "--host", default="localhost", help="address to serve on (default localhost)"
    )
    pipecat.add_argument("--port", type=int, default=7860, help="HTTP port (default 7860)")
    pipecat.add_argument(
        "--greeting",
        default=None,
        help='what the bot says when a client connects; "" for nothing (default: a short hello)',
    )
    pipecat.add_argument(
        "--idle-timeout",
        type=float,
        default=300.0,
        help="seconds without activity before a session is closed (default 300)",
    )
    add_tts_arguments(pipecat)

    livekit = commands.add_parser(
        "livekit",
        help="LiveKit agent; then a LiveKit CLI command: console [--text], dev, start, connect",
        allow_abbrev=False,
    )
    add_tts_arguments(livekit)
    return parser


def configure_logging(level: str, *, own_handler: bool) -> None:
    fmt = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    if not own_handler:
        logging.basicConfig(level=level, format=fmt)
        return
    # LiveKit's CLI installs its own root handler later; ours would print every line twice.
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(fmt))
    for name in ("demo_agent", "pipecat_qwen_fast"):
        named = logging.getLogger(name)
        named.addHandler(handler)
        named.setLevel(level)
        named.propagate = False


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.framework == "pipecat" and rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    configure_logging(args.log_level.upper(), own_handler=args.framework == "livekit")
    options = tts_options_from_args(args)

    from pipecat_qwen_fast.errors import QwenTTSError

    try:
        service = load_engine_service(options)
    except QwenTTSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    if args.framework == "pipecat":
        from .pipecat_bot import BotConfig, serve

        config = BotConfig(
            tts=options,
            service=service,
            greeting=args.greeting,
            idle_timeout_s=args.idle_timeout,
        )
        serve(config, host=args.host, port=args.port)
        return 0

    from .livekit_agent import run

    run(options, service, rest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
