# Copyright 2026 pipecat-qwen-fast authors
# SPDX-License-Identifier: Apache-2.0

"""Names the plugin accepts. Any local checkpoint folder works as a model too."""

from __future__ import annotations

from typing import Literal

TTSModels = Literal[
    "Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice",
    "Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice",
    "Qwen/Qwen3-TTS-12Hz-1.7B-VoiceDesign",
    "Qwen/Qwen3-TTS-12Hz-0.6B-Base",
    "Qwen/Qwen3-TTS-12Hz-1.7B-Base",
]

# CustomVoice speakers (spec §4.1); eric and dylan speak dialects when language is chinese/auto.
TTSVoices = Literal[
    "aiden", "dylan", "eric", "ono_anna", "ryan", "serena", "sohee", "uncle_fu", "vivian"
]

TTSLanguages = Literal[
    "auto",
    "chinese",
    "english",
    "german",
    "italian",
    "portuguese",
    "spanish",
    "japanese",
    "korean",
    "french",
    "russian",
]
# Dialects are not languages to choose: the CustomVoice speakers eric and dylan speak theirs when
# the language is chinese or auto. Codes such as "en", "en-US" or "zh-CN" are taken too
# (options.qwen_language).

TTSBackends = Literal["auto", "megakernel", "torch", "eager"]

DEFAULT_MODEL: TTSModels = "Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice"
