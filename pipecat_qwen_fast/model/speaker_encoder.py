"""The ECAPA-TDNN speaker encoder of Base models: 24 kHz audio -> x-vector [D] (spec §8.4).

Variant without BatchNorm: every conv has a bias, is followed by ReLU in the TDNN blocks, and pads
"same" by reflection. Module names equal the checkpoint's `speaker_encoder.*` tensors, so the
weights load with strict=True once the prefix is dropped. Widths are not in config.json; they are
the fixed ECAPA constants in checkpoints/layout.py, the output width is `enc_dim` (= talker D).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

from pipecat_qwen_fast.checkpoints.layout import (
    ECAPA_ATTENTION_CHANNELS,
    ECAPA_CHANNELS,
    ECAPA_DILATIONS,
    ECAPA_KERNEL_SIZES,
    ECAPA_MEL_DIM,
    ECAPA_RES2NET_SCALE,
    ECAPA_SE_CHANNELS,
)
from pipecat_qwen_fast.model.mel import SPEAKER_MEL, log_mel

CHECKPOINT_PREFIX = "speaker_encoder."
# Attentive pooling's standard deviations are floored here before the square root.
STD_FLOOR = 1e-12


def same_conv(c_in: int, c_out: int, kernel: int, dilation: int = 1) -> nn.Conv1d:
    return nn.Conv1d(c_in, c_out, kernel, dilation=dilation, padding="same", padding_mode="reflect")


class TDNN(nn.Module):
    def __init__(self, c_in: int, c_out: int, kernel: int, dilation: int = 1):
        super().__init__()
        self.conv = same_conv(c_in, c_out, kernel, dilation)

    def forward(self, x: Tensor) -> Tensor:
        return torch.relu(self.conv(x))


class Res2Net(nn.Module):
    """Channels split into `scale` groups; group i > 0 goes through its own TDNN after adding the
    previous group's output (group 1 has no predecessor to add), group 0 passes through."""

    def __init__(self, channels: int, kernel: int, dilation: int, scale: int):
        super().__init__()
        width = channels // scale
        self.scale = scale
        self.blocks = nn.ModuleList(TDNN(width, width, kernel, dilation) for _ in range(scale - 1))

    def forward(self, x: Tensor) -> Tensor:
        parts = torch.chunk(x, self.scale, dim=1)
        outs = [parts[0]]
        for i, block in enumerate(self.blocks, start=1):
            outs.append(block(parts[i] if i == 1 else parts[i] + outs[-1]))
        return torch.cat(outs, dim=1)


class SqueezeExcite(nn.Module):
    def __init__(self, channels: int, bottleneck: int):
        super().__init__()
        self.conv1 = same_conv(channels, bottleneck, 1)
        self.conv2 = same_conv(bottleneck, channels, 1)

    def forward(self, x: Tensor) -> Tensor:
        gate = torch.sigmoid(self.conv2(torch.relu(self.conv1(x.mean(dim=2, keepdim=True)))))
        return x * gate


class SERes2NetBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, kernel: int, dilation: int):
        super().__init__()
        self.tdnn1 = TDNN(c_in, c_out, 1)
        self.res2net_block = Res2Net(c_out, kernel, dilation, ECAPA_RES2NET_SCALE)
        self.tdnn2 = TDNN(c_out, c_out, 1)
        self.se_block = SqueezeExcite(c_out, ECAPA_SE_CHANNELS)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.se_block(self.tdnn2(self.res2net_block(self.tdnn1(x))))


def weighted_stats(x: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
    """Mean and standard deviation over time of x [B, C, T] under weights summing to 1 over T."""
    mean = (weights * x).sum(dim=2)
    var = (weights * (x - mean[..., None]).pow(2)).sum(dim=2)
    return mean, var.clamp(min=STD_FLOOR).sqrt()


class AttentivePooling(nn.Module):
    """Attention over time conditioned on the utterance's own mean and std; returns [B, 2C, 1]."""

    def __init__(self, channels: int, attention: int):
        super().__init__()
        self.tdnn = TDNN(channels * 3, attention, 1)
        self.conv = same_conv(attention, channels, 1)

    def forward(self, x: Tensor) -> Tensor:
        frames = x.shape[-1]
        uniform = torch.full((1, 1, frames), 1.0 / frames, device=x.device, dtype=x.dtype)
        mean, std = weighted_stats(x, uniform)
        context = torch.cat([x, mean[..., None].expand_as(x), std[..., None].expand_as(x)], dim=1)
        attention = torch.softmax(self.conv(torch.tanh(self.tdnn(context))), dim=2)
        mean, std = weighted_stats(x, attention)
        return torch.cat([mean, std], dim=1)[..., None]


class SpeakerEncoder(nn.Module):
    def __init__(self, enc_dim: int):
        super().__init__()
        ch, ks, ds = ECAPA_CHANNELS, ECAPA_KERNEL_SIZES, ECAPA_DILATIONS
        self.blocks = nn.ModuleList([TDNN(ECAPA_MEL_DIM, ch[0], ks[0], ds[0])])
        for i in range(1, len(ch) - 1):
            self.blocks.append(SERes2NetBlock(ch[i - 1], ch[i], ks[i], ds[i]))
        self.mfa = TDNN(ch[-1], ch[-1], ks[-1], ds[-1])  # ch[-1] = sum of the SE blocks' widths
        self.asp = AttentivePooling(ch[-1], ECAPA_ATTENTION_CHANNELS)
        self.fc = same_conv(ch[-1] * 2, enc_dim, 1)

    @classmethod
    def from_state_dict(cls, enc_dim: int, state_dict: Mapping[str, Tensor], device: torch.device | str,
                        ) -> SpeakerEncoder:
        """Built on `device` in float32 from `speaker_encoder.*` (or prefix-less) tensors; frozen."""
        weights = {k.removeprefix(CHECKPOINT_PREFIX): v.to(device=device, dtype=torch.float32)
                   for k, v in state_dict.items()}
        with torch.device("meta"):
            net = cls(enc_dim)
        net.load_state_dict(weights, strict=True, assign=True)
        return net.requires_grad_(False).eval()

    def forward(self, mel: Tensor) -> Tensor:
        """log-mel [B, frames, 128] -> x-vectors [B, enc_dim]."""
        x = mel.transpose(1, 2)
        outs = []
        for block in self.blocks:
            x = block(x)
            outs.append(x)
        x = self.mfa(torch.cat(outs[1:], dim=1))
        return self.fc(self.asp(x))[..., 0]

    @torch.no_grad()
    def embed(self, wav: Tensor) -> Tensor:
        """One 24 kHz waveform [samples] (any device) -> its x-vector [enc_dim] (float32)."""
        device = self.fc.weight.device
        return self(log_mel(wav.to(device=device, dtype=torch.float32)[None], SPEAKER_MEL))[0]
