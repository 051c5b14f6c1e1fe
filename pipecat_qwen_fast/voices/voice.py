"""A cloned voice and its file: one safetensors file with the x-vector, the reference codes (ICL
voices) and a JSON header (name, mode, reference transcript, the model it was made with).

A voice is a few kilobytes: x-vector D floats, plus 16 int64 codes per 80 ms of reference.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from pipecat_qwen_fast.errors import InvalidInputError
from pipecat_qwen_fast.model.prompt import VoiceClonePrompt

VOICE_SUFFIX = ".voice"
FORMAT = "pipecat-qwen-fast/voice"
FORMAT_VERSION = 1
ICL = "icl"
X_VECTOR = "x_vector"
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


@dataclass(frozen=True)
class Voice:
    """A Base-model voice: pass it (or its library name, or its file path) as `voice=`."""

    name: str
    prompt: VoiceClonePrompt  # x_vector float32 [D] and, in ICL mode, ref_codes [T_ref, 16] + ref_text
    model_size: str  # "0b6" | "1b7" of the model that made it
    ref_seconds: float  # length of the reference audio
    created_at: float = field(default_factory=time.time)
    # Content hash: what the vocoder priming cache is keyed on (a re-created voice of the same name
    # gets a new one).
    fingerprint: str = ""

    def __post_init__(self) -> None:
        check_name(self.name)
        if not self.fingerprint:
            object.__setattr__(self, "fingerprint", fingerprint_of(self.prompt))

    @property
    def mode(self) -> str:
        return ICL if self.prompt.icl else X_VECTOR

    @property
    def dim(self) -> int:
        return int(self.prompt.x_vector.shape[0])

    @property
    def ref_frames(self) -> int:
        return 0 if self.prompt.ref_codes is None else int(self.prompt.ref_codes.shape[0])

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the voice file (atomically); returns its path."""
        return save_voice(self, path)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Voice:
        return load_voice(path)


def check_name(name: Any) -> str:
    if not isinstance(name, str) or not NAME_PATTERN.match(name) or name.endswith(VOICE_SUFFIX):
        raise InvalidInputError(
            f"voice name {name!r} is not valid: use 1-64 letters, digits, '_', '-' or '.', starting "
            f"with a letter or digit, not ending in {VOICE_SUFFIX!r}"
        )
    return name


def fingerprint_of(prompt: VoiceClonePrompt) -> str:
    h = hashlib.sha256()
    h.update(prompt.x_vector.detach().float().cpu().contiguous().numpy().tobytes())
    if prompt.ref_codes is not None:
        h.update(prompt.ref_codes.detach().long().cpu().contiguous().numpy().tobytes())
    h.update((prompt.ref_text or "").encode("utf-8"))
    return h.hexdigest()[:24]


def save_voice(voice: Voice, path: str | os.PathLike[str]) -> Path:
    from safetensors.torch import save_file

    path = Path(path).expanduser()
    tensors = {"x_vector": voice.prompt.x_vector.detach().float().cpu().contiguous()}
    if voice.prompt.ref_codes is not None:
        tensors["ref_codes"] = voice.prompt.ref_codes.detach().long().cpu().contiguous()
    header = {
        "format": FORMAT, "version": FORMAT_VERSION, "name": voice.name, "mode": voice.mode,
        "ref_text": voice.prompt.ref_text if voice.prompt.icl else None, "model_size": voice.model_size,
        "dim": voice.dim, "ref_seconds": voice.ref_seconds, "created_at": voice.created_at,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={"voice": json.dumps(header, ensure_ascii=False)})
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def load_voice(path: str | os.PathLike[str]) -> Voice:
    """Read a voice file; InvalidInputError says why a file is not one."""
    from safetensors import safe_open

    path = Path(path).expanduser()
    if not path.is_file():
        raise InvalidInputError(f"voice file {str(path)!r} does not exist")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is not a mapping
        header = json.loads(meta["voice"])
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types; a bad header KeyError/ValueError
        raise InvalidInputError(f"{str(path)!r} is not a voice file ({type(e).__name__}: {e})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT or header.get("version") != FORMAT_VERSION:
        header = header if isinstance(header, dict) else {}
        raise InvalidInputError(
            f"{str(path)!r} is not a version-{FORMAT_VERSION} voice file (format {header.get('format')!r}, "
            f"version {header.get('version')!r})"
        )
    return voice_from_parts(header, tensors, str(path))


def voice_from_parts(header: dict, tensors: dict[str, Tensor], where: str) -> Voice:
    x_vector = tensors.get("x_vector")
    if x_vector is None or x_vector.dim() != 1 or not x_vector.is_floating_point():
        raise InvalidInputError(f"voice file {where!r} has no 1-D float x_vector")
    if not torch.isfinite(x_vector).all():
        raise InvalidInputError(f"voice file {where!r} has a non-finite x_vector")
    ref_codes = tensors.get("ref_codes")
    mode = header.get("mode")
    if mode == ICL:
        if ref_codes is None or ref_codes.dim() != 2 or ref_codes.dtype != torch.int64:
            raise InvalidInputError(f"voice file {where!r} is an ICL voice without int64 ref_codes [frames, 16]")
        if not isinstance(header.get("ref_text"), str) or not header["ref_text"].strip():
            raise InvalidInputError(f"voice file {where!r} is an ICL voice without its reference transcript")
        prompt = VoiceClonePrompt(x_vector=x_vector.float(), ref_codes=ref_codes, ref_text=header["ref_text"])
    elif mode == X_VECTOR:
        prompt = VoiceClonePrompt(x_vector=x_vector.float())
    else:
        raise InvalidInputError(f"voice file {where!r} has mode {mode!r}; valid: {ICL}, {X_VECTOR}")
    return Voice(
        name=header.get("name"), prompt=prompt, model_size=str(header.get("model_size")),
        ref_seconds=float(header.get("ref_seconds") or 0.0), created_at=float(header.get("created_at") or 0.0),
    )
