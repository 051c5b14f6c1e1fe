"""The speech tokenizer's encoder: 24 kHz audio -> reference codes [frames, 16] (spec §8.4).

A Mimi encoder (SEANet convs at 25 Hz, an 8-layer transformer, a stride-2 conv to 12.5 Hz, split
residual quantizers) of which the first 16 of 32 quantizers are kept: the semantic one and the first
15 acoustic ones. Residual quantization is sequential, so the 16 kept codes do not depend on the 16
dropped ones and those are never computed.

Built from transformers' Mimi classes where they compute what the checkpoint was made with:
the SEANet encoder, the downsampling conv and the split quantizer (their submodule names are the
checkpoint's). The transformer is our own: the official package encodes with transformers 4.57,
whose Mimi transformer attends to *every* past frame (its SDPA path drops the config's 250-frame
sliding window), while transformers 5 applies the window, which changes the codes of references
longer than 10 s.

Everything runs in float32 whatever the engine's dtype: the codes are nearest-neighbour picks, and
the encoder runs once per voice.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipecat_qwen_fast.config import _get
from pipecat_qwen_fast.errors import ConfigError
from pipecat_qwen_fast.model.layers import apply_rotary, rotary_cos_sin

CHECKPOINT_PREFIX = "encoder."


@dataclass(frozen=True)
class EncoderTransformerConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float
    norm_eps: float


@dataclass(frozen=True)
class SpeechEncoderConfig:
    mimi: dict[str, Any]  # speech_tokenizer/config.json: encoder_config, as saved (transformers 4.57 keys)
    transformer: EncoderTransformerConfig
    sample_rate: int
    samples_per_frame: int  # encode_downsample_rate: 1920 at 24 kHz, 12.5 frames/s
    num_quantizers: int  # encoder_valid_num_quantizers: codes kept per frame (16)


def parse_speech_encoder_config(d: dict[str, Any]) -> SpeechEncoderConfig:
    """From the parsed `speech_tokenizer/config.json`."""
    w = "speech_tokenizer.encoder_config"
    e = _get(d, "encoder_config", "speech_tokenizer", dict)
    act = e.get("hidden_act", "gelu")
    if act != "gelu":
        raise ConfigError(f"'{w}.hidden_act' is {act!r}; only 'gelu' (exact erf GELU) is supported")
    if not e.get("use_causal_conv", True):
        raise ConfigError(f"'{w}.use_causal_conv' is false; the 12 Hz tokenizer's encoder is causal")
    transformer = EncoderTransformerConfig(
        hidden_size=_get(e, "hidden_size", w, int),
        num_layers=_get(e, "num_hidden_layers", w, int),
        num_heads=_get(e, "num_attention_heads", w, int),
        num_kv_heads=_get(e, "num_key_value_heads", w, int),
        head_dim=_get(e, "head_dim", w, int),
        intermediate_size=_get(e, "intermediate_size", w, int),
        rope_theta=float(e.get("rope_theta", 10000.0)),
        norm_eps=float(e.get("norm_eps", 1e-5)),
    )
    cfg = SpeechEncoderConfig(
        mimi=dict(e),
        transformer=transformer,
        sample_rate=_get(d, "input_sample_rate", "speech_tokenizer", int),
        samples_per_frame=_get(d, "encode_downsample_rate", "speech_tokenizer", int),
        num_quantizers=_get(d, "encoder_valid_num_quantizers", "speech_tokenizer", int),
    )
    total = _get(e, "num_quantizers", w, int)
    semantic = _get(e, "num_semantic_quantizers", w, int)
    if not semantic <= cfg.num_quantizers <= total:
        raise ConfigError(
            f"'speech_tokenizer.encoder_valid_num_quantizers' = {cfg.num_quantizers} must lie in "
            f"[{semantic}, {total}] (the encoder's semantic and total quantizers)"
        )
    return cfg


class LayerScale(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return self.scale * x


class EncoderAttention(nn.Module):
    def __init__(self, c: EncoderTransformerConfig):
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        b, n, _ = x.shape
        c = self.c
        q = self.q_proj(x).view(b, n, c.num_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, n, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, n, c.num_kv_heads, c.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if c.num_kv_heads != c.num_heads:
            k = k.repeat_interleave(c.num_heads // c.num_kv_heads, dim=1)
            v = v.repeat_interleave(c.num_heads // c.num_kv_heads, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))


class EncoderMLP(nn.Module):
    def __init__(self, c: EncoderTransformerConfig):
        super().__init__()
        self.fc1 = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.fc2 = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class EncoderLayer(nn.Module):
    def __init__(self, c: EncoderTransformerConfig):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(c.hidden_size, eps=c.norm_eps)
        self.self_attn = EncoderAttention(c)
        self.self_attn_layer_scale = LayerScale(c.hidden_size)
        self.post_attention_layernorm = nn.LayerNorm(c.hidden_size, eps=c.norm_eps)
        self.mlp = EncoderMLP(c)
        self.mlp_layer_scale = LayerScale(c.hidden_size)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(x), cos, sin))
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


class EncoderTransformer(nn.Module):
    """Pre-norm causal transformer over every past frame (see the module docstring)."""

    def __init__(self, c: EncoderTransformerConfig):
        super().__init__()
        self.c = c
        self.layers = nn.ModuleList(EncoderLayer(c) for _ in range(c.num_layers))

    def forward(self, x: Tensor) -> Tensor:
        """x: [B, frames, hidden]."""
        positions = torch.arange(x.shape[1], device=x.device)
        cos, sin = rotary_cos_sin(positions, self.c.head_dim, self.c.rope_theta, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return x


def mimi_config(cfg: SpeechEncoderConfig):
    from transformers import MimiConfig

    return MimiConfig(**cfg.mimi)


class SpeechEncoder(nn.Module):
    """Module names are the checkpoint's `encoder.*` tensors without the prefix."""

    def __init__(self, cfg: SpeechEncoderConfig):
        super().__init__()
        from transformers.models.mimi.modeling_mimi import (
            MimiConv1d,
            MimiEncoder,
            MimiSplitResidualVectorQuantizer,
        )

        mc = mimi_config(cfg)
        self.cfg = cfg
        self.encoder = MimiEncoder(mc)
        self.encoder_transformer = EncoderTransformer(cfg.transformer)
        # Present when the SEANet rate (25 Hz) is above the code rate (12.5 Hz); its edge padding
        # replicates the last column, unlike the SEANet convs' zeros.
        self.downsample = None
        if mc.frame_rate != mc.encodec_frame_rate:
            stride = int(mc.encodec_frame_rate / mc.frame_rate)
            self.downsample = MimiConv1d(mc, mc.hidden_size, mc.hidden_size, kernel_size=2 * stride,
                                         stride=stride, bias=False, pad_mode="replicate")
        self.quantizer = MimiSplitResidualVectorQuantizer(mc)

    @classmethod
    def from_state_dict(cls, cfg: SpeechEncoderConfig, state_dict: Mapping[str, Tensor],
                        device: torch.device | str) -> SpeechEncoder:
        """Built on `device` in float32 from `encoder.*` tensors (other tensors are ignored); frozen."""
        weights = {k.removeprefix(CHECKPOINT_PREFIX): v.float()
                   for k, v in state_dict.items() if k.startswith(CHECKPOINT_PREFIX)}
        # Built on the device itself (not on meta): the Mimi convs keep their kernel geometry in
        # non-persistent buffers that no state dict fills.
        with torch.device(device):
            net = cls(cfg)
        net.load_state_dict(weights, strict=True)
        return net.requires_grad_(False).eval()

    def _apply(self, fn, recurse=True):
        # Mimi codebooks cache their centroids on first use; a move must not keep the stale copy.
        for module in self.modules():
            if hasattr(module, "_embed"):
                module._embed = None
        return super()._apply(fn, recurse)

    def num_frames(self, samples: int) -> int:
        return math.ceil(samples / self.cfg.samples_per_frame)

    @torch.no_grad()
    def encode(self, wav: Tensor) -> Tensor:
        """One waveform [samples] at cfg.sample_rate (any device) -> codes [frames, num_quantizers]
        int64 on the encoder's device, frames = ceil(samples / samples_per_frame)."""
        device = next(self.parameters()).device
        x = wav.to(device=device, dtype=torch.float32).reshape(1, 1, -1)
        h = self.encoder(x)  # [1, hidden, 25 Hz frames]
        h = self.encoder_transformer(h.transpose(1, 2)).transpose(1, 2)
        if self.downsample is not None:
            h = self.downsample(h)
        codes = self.quantizer.encode(h, self.cfg.num_quantizers)  # [Q, 1, frames]
        return codes[:, 0, : self.num_frames(wav.shape[-1])].T.contiguous()
