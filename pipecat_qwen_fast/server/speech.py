"""Request fields shared by both endpoints: type checks, voices, languages and the text bound.

Every check names the field and the valid choices; none repeats the text to speak.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipecat_qwen_fast import SynthesisRequest
from pipecat_qwen_fast.engine.request import CHUNK_FIELDS

from .api_errors import bad_request

# Chunk sizes a request may ask for, as the engine's default schedule grows to (1, 3, ..., 32):
# the first chunk's, and on the stream endpoint the later ones' (chunk_frames, max_chunk_frames).
MAX_FIRST_CHUNK_FRAMES = 32
MAX_CHUNK_FRAMES = MAX_FIRST_CHUNK_FRAMES


def optional_str(body: dict, name: str) -> str | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise bad_request(f"'{name}' must be a string, got {json_type(value)}", name)
    return value


def required_str(body: dict, name: str) -> str:
    value = optional_str(body, name)
    if value is None:
        raise bad_request(f"'{name}' is required", name)
    return value


def optional_int(body: dict, name: str, *, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"'{name}' must be an integer, got {json_type(value)}", name)
    if value < low or (high is not None and value > high):
        bounds = f"between {low} and {high}" if high is not None else f">= {low}"
        raise bad_request(f"'{name}' must be {bounds}, got {value}", name)
    return value


def optional_bool(body: dict, name: str) -> bool | None:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise bad_request(f"'{name}' must be true or false, got {json_type(value)}", name)
    return value


def check_speed(body: dict) -> None:
    """Only natural speed: the engine has no rate control, and resampling would change pitch."""
    value = body.get("speed")
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise bad_request(f"'speed' must be a number, got {json_type(value)}", "speed")
    if value != 1.0:
        raise bad_request(f"'speed' must be 1.0 (this server speaks at natural speed), got "
                          f"{value}", "speed")


def check_fields(body: dict, known: frozenset[str], what: str) -> None:
    unknown = sorted(set(body) - known)
    if unknown:
        raise bad_request(f"unknown field(s) in {what}: {', '.join(map(repr, unknown))}; "
                          f"valid fields: {', '.join(sorted(known))}", unknown[0])


def json_type(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
             int: "a number", float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


@dataclass
class VoiceBook:
    """The engine's preset voices, its voice library's cloned ones (Base models), and the
    server's aliases for presets."""

    voices: list[str]
    aliases: dict[str, str]
    languages: list[str]
    # The engine's VoiceLibrary on a Base model (thread-safe; it changes as voices are uploaded).
    library: Any = None

    def names(self) -> list[str]:
        return self.voices + (self.library.names() if self.library is not None else [])

    def resolve_voice(self, voice: str | None) -> str | None:
        if voice is None:
            return None
        # Cloned names are case-sensitive, as the library stores them; presets are not.
        if self.library is not None and voice in self.library:
            return voice
        name = voice.strip().lower()
        name = self.aliases.get(name, name).lower()
        if name in self.voices:
            return name
        # A Base model's library would also read a voice file at any path it is given: from the
        # network only registered names are taken. Models with neither presets nor a library
        # (VoiceDesign) leave the voice to the engine.
        if self.voices or self.library is not None:
            choices = ", ".join(self.names()) or "(none yet; upload one: POST /v1/audio/voices)"
            if self.aliases:
                choices += "; aliases: " + ", ".join(sorted(self.aliases))
            raise bad_request(f"unknown voice {voice!r}; valid voices: {choices}", "voice")
        return name

    def resolve_language(self, language: str | None) -> str:
        if language is None:
            return "auto"
        name = language.strip().lower()
        if name not in self.languages:
            raise bad_request(f"unknown language {language!r}; valid languages: "
                              f"{', '.join(self.languages)}", "language")
        return name


TASK_TYPES = {"custom_voice": "CustomVoice", "voice_design": "VoiceDesign", "base": "Base"}


def check_task_type(body: dict, model_type: str) -> None:
    """vLLM-Omni's ``task_type``, where given, must name the one model this server runs."""
    expected = TASK_TYPES.get(model_type, model_type)
    task_type = optional_str(body, "task_type")
    if task_type is not None and task_type.lower() != expected.lower():
        raise bad_request(f"task_type {task_type!r} does not match this server's model, a "
                          f"{expected} model", "task_type")


def frame_cap(requested: int | None, server_cap: int | None) -> int | None:
    """A request's frame cap (vLLM-Omni's max_new_tokens), never above the server's."""
    if requested is None or server_cap is None:
        return requested if server_cap is None else server_cap
    return min(requested, server_cap)


def check_text(text: str, limit: int, name: str = "input") -> str:
    if len(text) > limit:
        raise bad_request(f"'{name}' is {len(text)} characters; the limit is {limit}", name)
    if not text.strip():
        raise bad_request(f"'{name}' is empty; there is nothing to say", name)
    return text


@dataclass
class SpeechOptions:
    """Everything of a request but its text."""

    voice: str | None = None
    language: str = "auto"
    instruct: str | None = None
    seed: int | None = None
    text_mode: str | None = None
    first_chunk_frames: int | None = None
    max_frames: int | None = None
    # The stream endpoint's extensions (what the remote adapters send); None: the engine's default.
    greedy: bool | None = None
    chunk_frames: int | None = None
    max_chunk_frames: int | None = None
    chunk_growth: int | None = None

    def request(self, text: str) -> Any:
        extra: dict[str, Any] = {}
        for name in ("greedy", *CHUNK_FIELDS):
            if getattr(self, name) is not None:
                extra[name] = getattr(self, name)
        return SynthesisRequest(text, voice=self.voice, language=self.language,
                                instruct=self.instruct, seed=self.seed, text_mode=self.text_mode,
                                max_frames=self.max_frames, **extra)
