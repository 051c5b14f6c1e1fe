"""The two encoders a voice is made with, loaded from a Base checkpoint onto one device.

They are loaded on first use (a CustomVoice or VoiceDesign engine never needs them, and a Base
engine only once something is cloned), always in float32 (see model/speech_encoder.py).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from pipecat_qwen_fast.checkpoints.load import load_state_dict, require_file
from pipecat_qwen_fast.config import ModelConfig, read_json
from pipecat_qwen_fast.errors import ModelLoadError
from pipecat_qwen_fast.model.speaker_encoder import SpeakerEncoder
from pipecat_qwen_fast.model.speech_encoder import SpeechEncoder, parse_speech_encoder_config
from pipecat_qwen_fast.voices.audio import TARGET_RATE


@contextlib.contextmanager
def cudnn_without_tf32():
    """Only the TF32 switch (cudnn.flags() would also reset benchmark mode, process-wide, under
    the engine thread's feet)."""
    before = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32 = before


@dataclass
class VoiceEncoders:
    speech: SpeechEncoder
    speaker: SpeakerEncoder
    device: torch.device

    @classmethod
    def load(cls, model_dir: Path, cfg: ModelConfig, device: torch.device) -> VoiceEncoders:
        if cfg.speaker_encoder_dim is None:
            raise ModelLoadError("this checkpoint has no speaker encoder (only Base models clone voices)")
        if cfg.speaker_encoder_sample_rate != TARGET_RATE:
            raise ModelLoadError(
                f"the speaker encoder expects {cfg.speaker_encoder_sample_rate} Hz audio; only {TARGET_RATE} Hz is supported"
            )
        st_dir = Path(model_dir) / "speech_tokenizer"
        st_cfg = parse_speech_encoder_config(read_json(require_file(st_dir / "config.json")))
        if st_cfg.sample_rate != TARGET_RATE:
            raise ModelLoadError(f"the speech tokenizer encodes {st_cfg.sample_rate} Hz audio; only {TARGET_RATE} Hz is supported")
        speech = SpeechEncoder.from_state_dict(
            st_cfg, load_state_dict(st_dir / "model.safetensors", prefix="encoder.", progress=False), device)
        speaker = SpeakerEncoder.from_state_dict(
            cfg.speaker_encoder_dim,
            load_state_dict(Path(model_dir) / "model.safetensors", prefix="speaker_encoder.", progress=False),
            device)
        return cls(speech=speech, speaker=speaker, device=device)

    @torch.no_grad()
    def encode(self, wav: np.ndarray, with_codes: bool) -> tuple[Tensor, Tensor | None]:
        """24 kHz mono float32 -> (x-vector [D] float32, ref codes [frames, 16] int64 or None), on the CPU.

        Both encoders read one copy of the audio on the device; the two results come back in one
        transfer each, at the end.
        """
        x = torch.from_numpy(np.ascontiguousarray(wav, dtype=np.float32)).to(self.device)
        # cuDNN runs float32 convs in TF32 by default (10-bit mantissa); the codes are nearest-
        # neighbour picks, so a voice made on a GPU should equal one made on the CPU. The encoders'
        # ~65 GFLOP for 10 s of audio cost a few ms in true float32.
        with cudnn_without_tf32():
            x_vector = self.speaker.embed(x)
            codes = self.speech.encode(x) if with_codes else None
        return x_vector.cpu(), None if codes is None else codes.cpu()
