"""The engine's voice library: voices made once from a recording, then used by name or file path.

    voice = engine.create_voice("ref.wav", ref_text="What the speaker says.", name="alice")  # ICL
    voice = engine.create_voice("ref.wav", name="bob")                                         # x-vector only
    engine.voice_library.save("alice", "alice.voice")
    engine.voice_library.load("alice.voice")            # registers it under its stored name
    engine.stream("Hello.", voice="alice")              # or voice="alice.voice", or voice=<Voice>

No framework imports: the Pipecat service, the LiveKit plugin, the CLI and an HTTP server all call
this through the engine. Safe to call from any thread (one lock guards the tables); creating a voice
runs the encoders on the calling thread.

An ICL voice's reference frames are run through a streaming vocoder state once, when the voice is
added, and every request with that voice starts from a copy of it (spec §4.6: the talker continues
right after the reference, and so does the vocoder), so no request decodes the reference again.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from pathlib import Path

import torch

from pipecat_qwen_fast.config import ModelConfig
from pipecat_qwen_fast.errors import InvalidInputError, ModelLoadError, UnsupportedFeatureError
from pipecat_qwen_fast.model.prompt import VoiceClonePrompt
from pipecat_qwen_fast.vocoder.stream import VocoderStream
from pipecat_qwen_fast.vocoder.vocoder import Vocoder
from pipecat_qwen_fast.voices.audio import AudioInput, load_reference
from pipecat_qwen_fast.voices.encoders import VoiceEncoders
from pipecat_qwen_fast.voices.voice import (
    NAME_PATTERN,
    VOICE_SUFFIX,
    Voice,
    check_name,
    fingerprint_of,
    load_voice,
)

# Voices loaded by path stay cached by (path, mtime, size); primed vocoder states by fingerprint.
# A primed state of the full-size vocoder is ~3 MB in bf16.
MAX_FILE_VOICES = 64
MAX_PRIMED = 64


class VoiceLibrary:
    def __init__(self, *, config: ModelConfig, model_dir: Path | None, vocoder: Vocoder,
                 device: torch.device, dtype: torch.dtype):
        self.config = config
        self.model_dir = model_dir
        self.vocoder = vocoder
        self.device = device
        self.dtype = dtype
        self._lock = threading.RLock()
        self._voices: dict[str, Voice] = {}
        self._files: OrderedDict[tuple, Voice] = OrderedDict()
        self._primed: OrderedDict[str, VocoderStream] = OrderedDict()
        self._encoders: VoiceEncoders | None = None

    # ------------------------------------------------------------------ making voices

    def encoders(self) -> VoiceEncoders:
        """The speech and speaker encoders, loaded on first call (also a way to load them ahead)."""
        self._require_base()
        with self._lock:
            if self._encoders is None:
                if self.model_dir is None:
                    raise ModelLoadError("this engine was not loaded from a checkpoint folder, so its encoders cannot be read")
                self._encoders = VoiceEncoders.load(self.model_dir, self.config, self.device)
            return self._encoders

    def create(self, audio: AudioInput, ref_text: str | None = None, *, name: str | None = None,
               sample_rate: int | None = None, register: bool = True) -> Voice:
        """A voice from a 1-30 s recording: in-context (ICL) with its transcript `ref_text`,
        x-vector only without. Registered under `name` (default: the file's stem, else 'voice-'
        and a content hash) unless register=False; an existing voice of that name is replaced."""
        self._require_base()
        if name is not None:
            check_name(name)
        text = None
        if ref_text is not None:
            if not isinstance(ref_text, str):
                raise InvalidInputError(f"ref_text must be a string or None, got {type(ref_text).__name__}")
            text = ref_text.strip() or None
            if text is None:
                raise InvalidInputError("ref_text is empty; pass the transcript of the reference audio, or None for an x-vector-only voice")
        ref = load_reference(audio, sample_rate)
        x_vector, codes = self.encoders().encode(ref.wav, with_codes=text is not None)
        prompt = VoiceClonePrompt(x_vector=x_vector, ref_codes=codes, ref_text=text)
        fingerprint = fingerprint_of(prompt)
        voice = Voice(name=name or default_name(audio, fingerprint), prompt=prompt,
                      model_size=self.config.model_size, ref_seconds=round(ref.duration_s, 3),
                      fingerprint=fingerprint)
        return self.add(voice) if register else self._checked(voice)

    # ------------------------------------------------------------------ the table

    def add(self, voice: Voice) -> Voice:
        """Register `voice` under its name (replacing one of that name) and prime its vocoder state."""
        self._checked(voice)
        with self._lock:
            self._voices[voice.name] = voice
        self.primed_stream(voice)
        return voice

    def load(self, path: str | os.PathLike[str], name: str | None = None) -> Voice:
        """Read a voice file and register it (under `name`, default the name stored in the file)."""
        voice = load_voice(path)
        if name is not None:
            voice = Voice(name=check_name(name), prompt=voice.prompt, model_size=voice.model_size,
                          ref_seconds=voice.ref_seconds, created_at=voice.created_at, fingerprint=voice.fingerprint)
        return self.add(voice)

    def save(self, name: str, path: str | os.PathLike[str]) -> Path:
        return self.get(name).save(path)

    def get(self, name: str) -> Voice:
        with self._lock:
            voice = self._voices.get(name)
        if voice is None:
            raise InvalidInputError(f"unknown voice {name!r}; this engine's voices: {', '.join(self.names()) or '(none)'}")
        return voice

    def remove(self, name: str) -> None:
        with self._lock:
            voice = self._voices.pop(name, None)
            if voice is None:
                raise InvalidInputError(f"unknown voice {name!r}")
            if all(v.fingerprint != voice.fingerprint for v in self._voices.values()):
                self._primed.pop(voice.fingerprint, None)

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._voices)

    def __contains__(self, name: object) -> bool:
        with self._lock:
            return name in self._voices

    def __len__(self) -> int:
        with self._lock:
            return len(self._voices)

    # ------------------------------------------------------------------ use

    def resolve(self, voice: str | os.PathLike[str] | Voice) -> Voice:
        """A voice argument -> Voice: a Voice as it is, a registered name, or a voice file's path
        (anything ending in .voice, or naming an existing file)."""
        if isinstance(voice, Voice):
            return self._checked(voice)
        if not isinstance(voice, (str, os.PathLike)):
            raise InvalidInputError(f"voice must be a name, a .voice file path or a Voice, got {type(voice).__name__}")
        text = os.fspath(voice)
        with self._lock:
            known = self._voices.get(text)
        if known is not None:
            return known
        path = Path(text).expanduser()
        if text.endswith(VOICE_SUFFIX) or os.sep in text or path.is_file():
            return self._from_file(path)
        raise InvalidInputError(
            f"unknown voice {text!r}; this Base model's voices: {', '.join(self.names()) or '(none)'}. "
            "Create one with engine.create_voice(audio, ref_text, name=...) or pass a .voice file path"
        )

    def primed_stream(self, voice: Voice) -> VocoderStream | None:
        """The vocoder state after the voice's reference frames (ICL voices; None otherwise),
        made once and kept: copy it, never decode into it."""
        if not voice.prompt.icl:
            return None
        with self._lock:
            stream = self._primed.get(voice.fingerprint)
            if stream is not None:
                self._primed.move_to_end(voice.fingerprint)
                return stream
        stream = self.vocoder.new_stream(batch=1, device=self.device, dtype=self.dtype)
        with torch.no_grad():
            self.vocoder.prime_stream(voice.prompt.ref_codes.to(self.device), stream)
        with self._lock:
            self._primed[voice.fingerprint] = stream
            while len(self._primed) > MAX_PRIMED:
                self._primed.popitem(last=False)
        return stream

    # ------------------------------------------------------------------ helpers

    def _require_base(self) -> None:
        if self.config.model_type != "base":
            raise UnsupportedFeatureError(
                f"voice cloning needs a Base model; this one is {self.config.model_type}"
                + (" (use voice= with one of its speakers)" if self.config.model_type == "custom_voice" else
                   " (describe the voice with instruct=)")
            )

    def _checked(self, voice: Voice) -> Voice:
        self._require_base()
        d = self.config.talker.hidden_size
        if voice.dim != d:
            raise InvalidInputError(
                f"voice {voice.name!r} was made with a {voice.model_size} model (x-vector of {voice.dim}); "
                f"this {self.config.model_size} model takes x-vectors of {d}: create the voice again with this model"
            )
        return voice

    def _from_file(self, path: Path) -> Voice:
        try:
            st = path.stat()
        except OSError:
            raise InvalidInputError(f"voice file {str(path)!r} does not exist") from None
        key = (str(path.resolve()), st.st_mtime_ns, st.st_size)
        with self._lock:
            cached = self._files.get(key)
            if cached is not None:
                self._files.move_to_end(key)
                return cached
        voice = self._checked(load_voice(path))
        self.primed_stream(voice)
        with self._lock:
            self._files[key] = voice
            while len(self._files) > MAX_FILE_VOICES:
                self._files.popitem(last=False)
        return voice


def default_name(audio: AudioInput, fingerprint: str) -> str:
    """The recording's file stem where it makes a valid name, else 'voice-' and the content hash."""
    if isinstance(audio, (str, os.PathLike)):
        stem = "".join(c if c.isalnum() or c in "_-." else "_" for c in Path(audio).stem)[:64]
        if NAME_PATTERN.match(stem) and not stem.endswith(VOICE_SUFFIX):
            return stem
    return f"voice-{fingerprint[:8]}"
