"""Building blocks of the speech-tokenizer decoder (spec §8.2), each with two entry points.

``forward(x)`` is the whole-sequence pass (causal zero padding on the left); ``step(x, stream)`` is
the streaming pass, which takes the left context from the stream's per-module history instead of
zeros and updates that history in place. Both give the same numbers: the zero padding of the whole
pass is exactly the all-zero history of a fresh stream.

Attribute names follow the checkpoint (spec appendix) so that ``state_dict`` keys match it.
Tensors are channel-first ``[B, C, T]`` outside the transformer and ``[B, T, C]`` inside it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipecat_qwen_fast.model.layers import (
    RMSNorm,  # the talker's norm: fp32 math, one fused kernel for bf16 on CUDA
)
from pipecat_qwen_fast.vocoder.stream import VocoderStream

# Queries are attended in blocks so that a long whole-utterance pass never builds a T x T mask.
ATTENTION_QUERY_BLOCK = 256


def nhwc_friendly(conv: nn.Module) -> bool:
    """Whether cuDNN runs this convolution well with channels-innermost tensors (measured on the
    H200: not the grouped or dilated ones)."""
    return conv.groups == 1 and conv.dilation[0] == 1


def keep_history(history: Tensor, joined: Tensor, valid: Tensor | None, frame_cols: int) -> None:
    """``history [B, C, context]`` <- the last ``context`` columns of ``joined = cat(history, x)``
    up to each row's last valid column (``valid [B]`` frames of ``frame_cols`` columns each), or
    of all of ``joined`` where ``valid`` is None. A gather from index tensors, so a compiled step
    keeps rows and frames symbolic and a CUDA graph captures it (no host sync)."""
    context = history.shape[-1]
    if valid is None:
        history.copy_(joined[..., joined.shape[-1] - context :])
        return
    cols = (valid * frame_cols)[:, None] + torch.arange(context, device=joined.device)  # [B, context]
    history.copy_(joined.gather(-1, cols[:, None, :].expand(-1, joined.shape[1], -1)))


class CausalConv(nn.Module):
    """Stride-1 conv with ``(k - 1) * dilation`` columns of left context."""

    def __init__(self, in_ch: int, out_ch: int, kernel: int, dilation: int = 1, groups: int = 1):
        super().__init__()
        self.conv = nn.Conv1d(in_ch, out_ch, kernel, dilation=dilation, groups=groups)
        self.context = (kernel - 1) * dilation
        self.slot = -1  # index of this module's history in a VocoderStream; set by the Vocoder
        self.frame_cols = 1  # input columns per code frame; set by the Vocoder

    def forward(self, x: Tensor) -> Tensor:
        return self._conv(F.pad(x, (self.context, 0)))

    def step(self, x: Tensor, stream: VocoderStream) -> Tensor:
        if self.context == 0:
            return self._conv(x)
        history = stream.histories[self.slot]
        joined = torch.cat((history, x), dim=-1)
        keep_history(history, joined, stream.valid, self.frame_cols)
        return self._conv(joined)

    def _conv(self, x: Tensor) -> Tensor:
        # After a conv with channels-innermost weights (Vocoder.use_channels_last) x is
        # channels-innermost too; a dilated conv given that ran cuDNN's grouped direct kernel at
        # 17 ms for a 25-frame chunk on the H200 (0.5 ms from NCHW).
        if not nhwc_friendly(self.conv):
            x = x.contiguous()
        return self.conv(x)


class CausalTransConv(nn.Module):
    """ConvTranspose1d(kernel, stride) whose last ``kernel - stride`` outputs are dropped.

    Output column o depends on inputs j with ``j*stride <= o < j*stride + kernel``, so a chunk's
    outputs need ``ceil(kernel / stride) - 1`` earlier input columns; the streaming pass re-runs
    those columns and keeps only the outputs that belong to the chunk.
    """

    def __init__(self, in_ch: int, out_ch: int, kernel: int, stride: int):
        super().__init__()
        if kernel < stride:
            raise ValueError(f"transposed conv kernel {kernel} is smaller than its stride {stride}")
        self.conv = nn.ConvTranspose1d(in_ch, out_ch, kernel, stride=stride)
        self.stride = stride
        self.trim = kernel - stride
        self.context = math.ceil(kernel / stride) - 1
        self.slot = -1
        self.frame_cols = 1

    def forward(self, x: Tensor) -> Tensor:
        y = self.conv(x)
        return y[..., : y.shape[-1] - self.trim]

    def step(self, x: Tensor, stream: VocoderStream) -> Tensor:
        if self.context == 0:
            return self.forward(x)
        history = stream.histories[self.slot]
        joined = torch.cat((history, x), dim=-1)
        keep_history(history, joined, stream.valid, self.frame_cols)
        y = self.conv(joined)
        start = self.context * self.stride
        return y[..., start : start + x.shape[-1] * self.stride]


class SnakeBeta(nn.Module):
    """``x + sin(x * e^alpha)^2 / (e^beta + 1e-9)`` per channel; alpha and beta are log-scale.

    The per-channel factors are computed once by ``refresh`` (the Vocoder calls it after loading
    or moving), in the parameters' dtype as the reference does on every call: four fewer kernel
    launches per activation, 26 activations per decoded chunk.
    """

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))
        self.register_buffer("freq", torch.ones(1, channels, 1), persistent=False)
        self.register_buffer("inv_mag", torch.ones(1, channels, 1), persistent=False)
        self.refresh()

    @torch.no_grad()
    def refresh(self) -> None:
        self.freq = torch.exp(self.alpha)[None, :, None]
        self.inv_mag = 1.0 / (torch.exp(self.beta)[None, :, None] + 1e-9)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.inv_mag * torch.sin(x * self.freq).pow(2)

    def step(self, x: Tensor, stream: VocoderStream) -> Tensor:
        return self.forward(x)


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.dwconv = CausalConv(dim, dim, 7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6))

    def _pointwise(self, x: Tensor, mixed: Tensor) -> Tensor:
        h = self.pwconv2(F.gelu(self.pwconv1(self.norm(mixed.transpose(1, 2)))))
        return x + (self.gamma * h).transpose(1, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self._pointwise(x, self.dwconv(x))

    def step(self, x: Tensor, stream: VocoderStream) -> Tensor:
        return self._pointwise(x, self.dwconv.step(x, stream))


class ResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int):
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConv(dim, dim, 7, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConv(dim, dim, 1)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.conv2(self.act2(self.conv1(self.act1(x))))

    def step(self, x: Tensor, stream: VocoderStream) -> Tensor:
        return x + self.conv2(self.act2(self.conv1.step(self.act1(x), stream)))


class Sequence(nn.ModuleList):
    """A ModuleList run in order, in either mode (the checkpoint nests plain lists of modules)."""

    def forward(self, x: Tensor) -> Tensor:
        for m in self:
            x = m(x)
        return x

    def step(self, x: Tensor, stream: VocoderStream) -> Tensor:
        for m in self:
            x = m.step(x, stream)
        return x


class DecoderBlock(nn.Module):
    """SnakeBeta, x``rate`` transposed conv, three residual units (dilations 1, 3, 9)."""

    def __init__(self, in_dim: int, out_dim: int, rate: int):
        super().__init__()
        self.block = Sequence(
            [SnakeBeta(in_dim), CausalTransConv(in_dim, out_dim, 2 * rate, rate)]
            + [ResidualUnit(out_dim, d) for d in (1, 3, 9)]
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.block(x)

    def step(self, x: Tensor, stream: VocoderStream) -> Tensor:
        return self.block.step(x, stream)


# ---------------------------------------------------------------------------------------------
# Residual vector quantizer: only the parameters live here; the Vocoder derives one stacked
# codebook table from them at load time.


class Codebook(nn.Module):
    def __init__(self, size: int, dim: int):
        super().__init__()
        self.cluster_usage = nn.Parameter(torch.ones(size))
        self.embedding_sum = nn.Parameter(torch.zeros(size, dim))

    def vectors(self) -> Tensor:
        return self.embedding_sum / self.cluster_usage.clamp(min=1e-5)[:, None]


class VectorQuantizer(nn.Module):
    def __init__(self, size: int, dim: int):
        super().__init__()
        self._codebook = Codebook(size, dim)


class QuantizerStack(nn.Module):
    def __init__(self, count: int, size: int, dim: int):
        super().__init__()
        self.layers = nn.ModuleList(VectorQuantizer(size, dim) for _ in range(count))


class ResidualQuantizer(nn.Module):
    """``input_proj`` is encoder-side and unused when decoding; it is kept for strict loading."""

    def __init__(self, count: int, size: int, dim: int, outer_dim: int):
        super().__init__()
        self.input_proj = nn.Conv1d(outer_dim, dim, 1, bias=False)
        self.output_proj = nn.Conv1d(dim, outer_dim, 1, bias=False)
        self.vq = QuantizerStack(count, size, dim)


class SplitResidualQuantizer(nn.Module):
    def __init__(self, semantic: int, total: int, size: int, dim: int, outer_dim: int):
        super().__init__()
        self.rvq_first = ResidualQuantizer(semantic, size, dim, outer_dim)
        self.rvq_rest = ResidualQuantizer(total - semantic, size, dim, outer_dim)


# ---------------------------------------------------------------------------------------------
# Sliding-window transformer.


class LayerScale(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.scale = nn.Parameter(torch.full((dim,), 0.01))

    def forward(self, x: Tensor) -> Tensor:
        return self.scale * x


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rotary_cos_sin(inv_freq: Tensor, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos/sin tables ``[..., n, head_dim]`` for absolute ``positions [..., n]``, computed in fp32."""
    freqs = positions.float()[..., None] * inv_freq
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def window_attention(
    q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor, key_offset: int, window: int
) -> Tensor:
    """Causal sliding-window attention, ``window`` keys including the query's own position.

    ``q [B,H,n,D]`` sits at ``q_pos [n]`` or, one row each, ``[B, n]``; ``k, v [B,H,m,D]`` at
    ``k_pos [m]`` or ``[B, m]``, where query i and key ``i + key_offset`` share a position
    (``key_offset`` is static so no host sync is needed to slice). Keys at negative positions are
    empty history slots and are masked out.
    """
    n = q.shape[2]
    if n <= ATTENTION_QUERY_BLOCK:  # one block: no loop over n, so a compiled step can keep n symbolic
        return _window_block(q, k, v, q_pos, k_pos, key_offset, window, 0, n)
    outs = []
    for a in range(0, n, ATTENTION_QUERY_BLOCK):
        outs.append(_window_block(q, k, v, q_pos, k_pos, key_offset, window, a, min(n, a + ATTENTION_QUERY_BLOCK)))
    return torch.cat(outs, dim=2)


def _window_block(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor, key_offset: int, window: int,
                  a: int, b: int) -> Tensor:
    """window_attention for queries a .. b - 1."""
    ka = max(0, a + key_offset - (window - 1))
    kb = b + key_offset
    kp = k_pos[..., ka:kb]
    rel = q_pos[..., a:b, None] - kp[..., None, :]
    mask = (rel >= 0) & (rel < window) & (kp >= 0)[..., None, :]
    if mask.dim() == 3:  # positions per row: [B, n, m] -> [B, 1, n, m], shared by the heads
        mask = mask[:, None]
    return F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, ka:kb], v[:, :, ka:kb], attn_mask=mask)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, head_dim: int):
        super().__init__()
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(dim, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(dim, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(dim, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, dim, bias=False)

    def project(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``x [B,n,C]`` -> rotated q ``[B,H,n,D]``, rotated k and v ``[B,Hkv,n,D]``."""
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def attend(self, q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor,
               key_offset: int, window: int) -> Tensor:
        if self.kv_heads != self.heads:
            rep = self.heads // self.kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = window_attention(q, k, v, q_pos, k_pos, key_offset, window)
        b, _, n, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, n, self.heads * self.head_dim))


class TransformerLayer(nn.Module):
    def __init__(self, dim: int, hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float):
        super().__init__()
        self.self_attn = Attention(dim, heads, kv_heads, head_dim)
        self.mlp = Mlp(dim, hidden)
        self.input_layernorm = RMSNorm(dim, eps)
        self.post_attention_layernorm = RMSNorm(dim, eps)
        self.self_attn_layer_scale = LayerScale(dim)
        self.mlp_layer_scale = LayerScale(dim)

    def feed_forward(self, x: Tensor) -> Tensor:
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


class Transformer(nn.Module):
    """input_proj -> layers -> norm -> output_proj, on ``[B, T, C]``."""

    def __init__(self, latent: int, dim: int, hidden: int, layers: int, heads: int, kv_heads: int,
                 head_dim: int, eps: float, rope_theta: float, window: int):
        super().__init__()
        self.layers = nn.ModuleList(
            TransformerLayer(dim, hidden, heads, kv_heads, head_dim, eps) for _ in range(layers)
        )
        self.norm = RMSNorm(dim, eps)
        self.input_proj = nn.Linear(latent, dim)
        self.output_proj = nn.Linear(dim, latent)
        self.window = window
        self.head_dim = head_dim
        self.rope_theta = rope_theta
        self.register_buffer("inv_freq", self.compute_inv_freq(None), persistent=False)

    def compute_inv_freq(self, device: torch.device | None) -> Tensor:
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=device).float()
        return 1.0 / (self.rope_theta ** (exponents / self.head_dim))

    def forward(self, x: Tensor) -> Tensor:
        h = self.input_proj(x)
        pos = torch.arange(h.shape[1], device=h.device)
        cos, sin = rotary_cos_sin(self.inv_freq, pos, h.dtype)
        for layer in self.layers:
            q, k, v = layer.self_attn.project(layer.input_layernorm(h), cos, sin)
            a = layer.self_attn.attend(q, k, v, pos, pos, 0, self.window)
            h = layer.feed_forward(h + layer.self_attn_layer_scale(a))
        return self.output_proj(self.norm(h))

    def step(self, x: Tensor, stream: VocoderStream) -> Tensor:
        """Attends over the stream's last ``window - 1`` keys/values plus the chunk's own."""
        h = self.input_proj(x)
        n = h.shape[1]
        past = self.window - 1
        offsets = torch.arange(past + n, device=h.device)
        k_pos = stream.position[:, None] - past + offsets  # [B, past + n]: each row at its own position
        q_pos = k_pos[:, past:]
        cos, sin = rotary_cos_sin(self.inv_freq, q_pos, h.dtype)
        cos, sin = cos[:, None], sin[:, None]  # [B, 1, n, D], shared by the heads
        kept = self._kept_rows(stream.valid, stream.keys.shape[2:])
        for i, layer in enumerate(self.layers):
            q, k, v = layer.self_attn.project(layer.input_layernorm(h), cos, sin)
            k_all = torch.cat((stream.keys[i], k), dim=2)
            v_all = torch.cat((stream.values[i], v), dim=2)
            if kept is None:
                stream.keys[i].copy_(k_all[:, :, n:])
                stream.values[i].copy_(v_all[:, :, n:])
            else:
                stream.keys[i].copy_(k_all.gather(2, kept))
                stream.values[i].copy_(v_all.gather(2, kept))
            a = layer.self_attn.attend(q, k_all, v_all, q_pos, k_pos, past, self.window)
            h = layer.feed_forward(h + layer.self_attn_layer_scale(a))
        return self.output_proj(self.norm(h))

    @staticmethod
    def _kept_rows(valid: Tensor | None, shape: torch.Size) -> Tensor | None:
        """Where ``valid`` is set, the gather index ``[B, kv_heads, window - 1, head_dim]`` into
        the joined keys/values (``window - 1 + n`` of them) of the ``window - 1`` before each row's
        own end, ``valid`` frames into the chunk."""
        if valid is None:
            return None
        kv_heads, past, head_dim = shape
        idx = valid[:, None] + torch.arange(past, device=valid.device)  # [B, past]
        return idx[:, None, :, None].expand(-1, kv_heads, -1, head_dim)
