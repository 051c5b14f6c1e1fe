"""Command-line options shared by the Pipecat and LiveKit demos, and the model load."""

from __future__ import annotations

import argparse
import logging
import os
import time
from dataclasses import dataclass

from pipecat_qwen_fast.config import DEFAULT_MODEL

logger = logging.getLogger("demo_agent")


@dataclass(frozen=True)
class TTSOptions:
    """How the demo's TTS is built; one set per process, since the model loads once."""

    model: str = DEFAULT_MODEL
    voice: str | None = None
    language: str = "auto"
    device: str = "auto"
    dtype: str = "auto"
    backend: str = "auto"
    seed: int | None = None
    max_frames: int | None = None


def add_tts_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("text-to-speech")
    group.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"hub id or local folder of a Qwen3-TTS checkpoint (default: {DEFAULT_MODEL})",
    )
    group.add_argument(
        "--voice",
        default=None,
        help="CustomVoice speaker, e.g. ryan (default: the model's default)",
    )
    group.add_argument(
        "--language", default="auto", help="language name, e.g. english, or auto (default)"
    )
    group.add_argument("--device", default="auto", help="auto (default), cpu, cuda or cuda:N")
    group.add_argument(
        "--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"]
    )
    group.add_argument("--backend", default="auto", choices=["auto", "megakernel", "torch"])
    group.add_argument("--seed", type=int, default=None, help="sampling seed (reproducible audio)")
    group.add_argument(
        "--max-frames",
        type=_positive_int,
        default=None,
        help="cap on 80 ms codec frames per sentence (default: the model's limit)",
    )


def tts_options_from_args(args: argparse.Namespace) -> TTSOptions:
    return TTSOptions(
        model=args.model,
        voice=args.voice,
        language=args.language.lower(),
        device=args.device,
        dtype=args.dtype,
        backend=args.backend,
        seed=args.seed,
        max_frames=args.max_frames,
    )


def load_engine_service(options: TTSOptions):
    """Load the model once for this process (weights show a progress bar) and return its service.

    Blocks until the engine is ready, so the first request never pays for the load. A bad voice
    or language fails here, with the valid choices, rather than at the first sentence.
    """
    from pipecat_qwen_fast.engine.service import shared_service
    from pipecat_qwen_fast.errors import InvalidInputError

    logger.info("loading Qwen3-TTS model %s (device %s)", options.model, options.device)
    started = time.monotonic()
    service = shared_service(
        options.model, device=options.device, dtype=options.dtype, backend=options.backend
    ).wait_ready_blocking()
    voices = service.voices
    if options.voice is not None and voices and options.voice not in voices:
        raise InvalidInputError(
            f"unknown voice {options.voice!r} for this model; valid voices: {', '.join(voices)}"
        )
    if options.voice is not None and not voices:
        raise InvalidInputError(
            f"--voice was given but this {service.model_type} model has no named voices"
        )
    languages = service.languages
    if options.language.lower() not in languages:
        raise InvalidInputError(
            f"unknown language {options.language!r}; valid languages: {', '.join(languages)}"
        )
    logger.info(
        "model ready in %.1f s: %s, %d Hz, voices: %s",
        time.monotonic() - started,
        service.model_type,
        service.sample_rate,
        ", ".join(voices) or "none",
    )
    return service


def cloud_keys() -> tuple[str | None, str | None]:
    """(DEEPGRAM_API_KEY, OPENAI_API_KEY); an empty variable counts as unset."""
    return os.environ.get("DEEPGRAM_API_KEY") or None, os.environ.get("OPENAI_API_KEY") or None


def describe_modes(typed_input: str) -> str:
    """The startup log line: the keys that are set decide how turns come in and who answers."""
    deepgram_key, openai_key = cloud_keys()
    turns = "voice (Deepgram STT)" if deepgram_key else typed_input
    return f"input: {turns}; LLM: {'OpenAI' if openai_key else 'offline echo'}"


# What the demo does without each key, for the error that says how to get back there.
_WITHOUT_KEY = {
    "DEEPGRAM_API_KEY": "to type instead of talk",
    "OPENAI_API_KEY": "for the offline echo LLM",
}


def missing_package_error(key_name: str, install: str) -> RuntimeError:
    """The error for a cloud key that is set while the package that would use it is missing."""
    return RuntimeError(
        f"{key_name} is set but its package is missing: {install} "
        f"(or unset the key {_WITHOUT_KEY[key_name]})"
    )


def _positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return number
