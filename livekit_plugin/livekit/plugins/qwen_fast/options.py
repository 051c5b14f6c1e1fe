# Copyright 2026 pipecat-qwen-fast authors
# SPDX-License-Identifier: Apache-2.0

"""The plugin's options, checked when they are given: language codes as LiveKit writes them, the
output sample rate, and the request fields (pipecat_qwen_fast.engine.validation)."""

from __future__ import annotations

import numbers
from dataclasses import replace

from livekit.agents.language import LanguageCode

from pipecat_qwen_fast.engine.request import SynthesisRequest
from pipecat_qwen_fast.engine.validation import check_options
from pipecat_qwen_fast.errors import InvalidInputError

# ISO 639-1 base codes of the languages Qwen3-TTS speaks, to its names for them. A regional or
# script variant speaks as its base language (en-GB and en-US are both "english"): the model has
# one voice per language, not per region.
QWEN_LANGUAGES = {
    "zh": "chinese",
    "en": "english",
    "de": "german",
    "it": "italian",
    "pt": "portuguese",
    "es": "spanish",
    "ja": "japanese",
    "ko": "korean",
    "fr": "french",
    "ru": "russian",
}
# "multi" is what LiveKit's STT and turn detectors call a multilingual session.
AUTO = ("auto", "multi")

MIN_SAMPLE_RATE = 8_000
MAX_SAMPLE_RATE = 192_000


def qwen_language(language: object) -> str:
    """A language as the engine names it, from its name ("english"), "auto", or any code LiveKit
    accepts for it (ISO 639-1 "en", BCP-47 "en-US" or "zh-Hans-CN", ISO 639-3 "eng")."""
    if not isinstance(language, str):
        raise InvalidInputError(f"language must be a string, got {type(language).__name__}")
    name = language.strip().lower()
    if name in AUTO:
        return "auto"
    if name in QWEN_LANGUAGES.values():
        return name
    base = LanguageCode(name).language if name else ""
    if base in QWEN_LANGUAGES:
        return QWEN_LANGUAGES[base]
    raise InvalidInputError(
        f"unknown language {language!r}; valid: auto, {', '.join(sorted(QWEN_LANGUAGES.values()))}, "
        f"or a code of one of them ({', '.join(sorted(QWEN_LANGUAGES))}, or with a region: en-US, "
        "zh-CN, pt-BR, ...)"
    )


def checked_request(request: SynthesisRequest) -> SynthesisRequest:
    """The plugin's request template (its text empty) with every field checked and its language
    as the engine names it."""
    return check_options(replace(request, language=qwen_language(request.language)))


def checked_sample_rate(sample_rate: object) -> int:
    if (
        isinstance(sample_rate, bool)
        or not isinstance(sample_rate, numbers.Integral)
        or not MIN_SAMPLE_RATE <= sample_rate <= MAX_SAMPLE_RATE
    ):
        raise InvalidInputError(
            f"sample_rate must be an integer from {MIN_SAMPLE_RATE} to {MAX_SAMPLE_RATE} Hz, "
            f"got {sample_rate!r}"
        )
    return int(sample_rate)
