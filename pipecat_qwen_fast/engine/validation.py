"""Checks of a SynthesisRequest's fields, before any of them reaches the model.

`checked_request` runs first in `QwenTTSEngine.open_session`: a wrong type or range anywhere in a
request is an InvalidInputError naming the field and what it takes (never the text itself), rather
than an AttributeError or a torch error from deep inside the prefill. What depends on the model
(which voices and languages exist) is checked after it, by the engine.

No framework imports: the adapters call `check_options` on their settings at construction and on
every update, so a wrong option is reported when it is set, not at the next utterance.
"""

from __future__ import annotations

import dataclasses
import numbers
import os
from typing import Any

from pipecat_qwen_fast.engine.request import SynthesisRequest
from pipecat_qwen_fast.engine.text import mend_surrogates
from pipecat_qwen_fast.errors import InvalidInputError
from pipecat_qwen_fast.model.prompt import TEXT_MODES, VoiceClonePrompt
from pipecat_qwen_fast.model.sampling import SamplingParams

# torch.Generator takes seeds in [-2**63, 2**64); each segment's seed is the request's plus
# 1_000_003 per segment, so below 2**63 leaves room for any number of segments.
MAX_SEED = 2**63 - 1

_INT_FIELDS = {"first_chunk_frames": "an integer >= 1", "chunk_frames": "an integer >= 1",
               "chunk_growth": "an integer >= 1"}
_OPTIONAL_INT_FIELDS = {
    "max_chunk_frames": ">= 1, or None for fixed chunks (an integer)",
    "max_frames": "an integer >= 1, or None for the model's limit",
}
_BOOL_FIELDS = ("greedy", "vocode")

_SAMPLING_BOOLS = ("do_sample", "subtalker_do_sample")
_SAMPLING_INTS = ("top_k", "subtalker_top_k", "min_new_tokens")
_SAMPLING_FLOATS = ("temperature", "top_p", "repetition_penalty", "subtalker_temperature", "subtalker_top_p")


def checked_request(request: object) -> SynthesisRequest:
    """The request with every field checked, integers of other types (numpy's) as Python ints and
    lone surrogates dropped from the instruct text; raises InvalidInputError naming the field."""
    if not isinstance(request, SynthesisRequest):
        raise InvalidInputError(f"a request must be a SynthesisRequest, got {type(request).__name__}")
    if not isinstance(request.text, str):
        raise InvalidInputError(f"text must be a string, got {type(request.text).__name__}")
    return check_options(request)


def check_options(request: SynthesisRequest) -> SynthesisRequest:
    """`checked_request` without the text: what an adapter's options hold between utterances."""
    changes: dict[str, Any] = {}
    _check_voice(request.voice)
    for name in ("language", "instruct"):
        value = getattr(request, name)
        if value is not None and not isinstance(value, str):
            raise InvalidInputError(f"{name} must be a string or None, got {type(value).__name__}")
    if request.instruct is not None:
        instruct = mend_surrogates(request.instruct)
        if instruct is not request.instruct:
            changes["instruct"] = instruct
    if request.seed is not None:
        changes["seed"] = _integer("seed", request.seed, 0, MAX_SEED, "an integer in [0, 2**63) or None")
    for name in _BOOL_FIELDS:
        if not isinstance(getattr(request, name), bool):
            raise InvalidInputError(f"{name} must be True or False, got {type(getattr(request, name)).__name__}")
    if request.text_mode is not None and (not isinstance(request.text_mode, str) or request.text_mode not in TEXT_MODES):
        raise InvalidInputError(f"unknown text_mode {request.text_mode!r}; valid: {', '.join(TEXT_MODES)}, or None")
    if request.voice_clone is not None and not isinstance(request.voice_clone, VoiceClonePrompt):
        raise InvalidInputError(
            f"voice_clone must be a VoiceClonePrompt or None, got {type(request.voice_clone).__name__}"
        )
    for name, takes in _INT_FIELDS.items():
        changes[name] = _integer(name, getattr(request, name), 1, None, takes)
    for name, takes in _OPTIONAL_INT_FIELDS.items():
        if getattr(request, name) is not None:
            changes[name] = _integer(name, getattr(request, name), 1, None, takes)
    if request.sampling is not None:
        _check_sampling(request.sampling)
    changes = {k: v for k, v in changes.items() if v is not getattr(request, k)}
    return dataclasses.replace(request, **changes) if changes else request


def _check_voice(voice: object) -> None:
    if voice is None or isinstance(voice, (str, os.PathLike)):
        return
    from pipecat_qwen_fast.voices.voice import Voice

    if not isinstance(voice, Voice):
        raise InvalidInputError(
            f"voice must be a name, a .voice file path, a Voice or None, got {type(voice).__name__}"
        )


def _integer(name: str, value: object, low: int, high: int | None, takes: str) -> int:
    # bool is an int to Python, but True frames or seed=False is a caller's mistake.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidInputError(f"{name} must be {takes}, got {type(value).__name__}")
    value = int(value)
    if value < low or (high is not None and value > high):
        raise InvalidInputError(f"{name} must be {takes}, got {value}")
    return value


def _check_sampling(params: object) -> None:
    if not isinstance(params, SamplingParams):
        raise InvalidInputError(f"sampling must be a SamplingParams or None, got {type(params).__name__}")
    for name in _SAMPLING_BOOLS:
        if not isinstance(getattr(params, name), bool):
            raise InvalidInputError(f"sampling.{name} must be True or False, got {type(getattr(params, name)).__name__}")
    for name in _SAMPLING_INTS:
        value = getattr(params, name)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise InvalidInputError(f"sampling.{name} must be an integer, got {type(value).__name__}")
    for name in _SAMPLING_FLOATS:
        value = getattr(params, name)
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise InvalidInputError(f"sampling.{name} must be a number, got {type(value).__name__}")
    params.validated()  # the ranges
