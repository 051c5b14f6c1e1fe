"""Qwen3 decoder building blocks with a preallocated KV cache (the torch reference path).

Module and parameter names mirror the checkpoint (`input_layernorm`, `self_attn.q_proj`, ...), so the
talker and code predictor load their state dicts with strict=True and no renaming.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipecat_qwen_fast.config import DecoderStackConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype != torch.float32 and x.is_cuda:
            # One fused kernel instead of eight: on the GPU the frame is launch-bound. It multiplies
            # the weight before rounding to bf16 (the reference rounds first): within bf16 noise.
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # Normalise in fp32 and cast back before the weight multiply, as the checkpoint was trained.
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rotary_cos_sin(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos/sin tables [n, head_dim] for rotate-half RoPE at the given integer positions.

    The talker's interleaved M-RoPE reduces to this exactly: its three position rows are identical
    in TTS (spec §5).
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [heads, n, head_dim]; cos/sin: [n, head_dim]."""
    return x * cos + _rotate_half(x) * sin


class KVCache:
    """Static per-stack K/V storage for one sequence: [layers, kv_heads, max_len, head_dim]."""

    def __init__(self, cfg: DecoderStackConfig, max_len: int, device: torch.device, dtype: torch.dtype):
        shape = (cfg.num_layers, cfg.num_kv_heads, max_len, cfg.head_dim)
        self.k = torch.empty(shape, device=device, dtype=dtype)
        self.v = torch.empty(shape, device=device, dtype=dtype)
        self.max_len = max_len
        self.length = 0  # positions filled

    @classmethod
    def over(cls, k: Tensor, v: Tensor) -> KVCache:
        """A cache view over existing [layers, kv_heads, max_len, head_dim] tensors (a pool slot),
        filled from position 0."""
        cache = cls.__new__(cls)
        cache.k, cache.v = k, v
        cache.max_len, cache.length = k.shape[2], 0
        return cache

    def reset(self) -> None:
        self.length = 0


class Attention(nn.Module):
    def __init__(self, cfg: DecoderStackConfig):
        super().__init__()
        d, h, kvh, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(d, h * hd, bias=False)
        self.k_proj = nn.Linear(d, kvh * hd, bias=False)
        self.v_proj = nn.Linear(d, kvh * hd, bias=False)
        self.o_proj = nn.Linear(h * hd, d, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.num_heads, self.num_kv_heads, self.head_dim = h, kvh, hd
        self.qkv_weight: Tensor | None = None  # set by fuse_projections

    def project_qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """[..., D] -> q [..., H, hd], k and v [..., KVH, hd]."""
        lead = x.shape[:-1]
        if self.qkv_weight is not None:
            q, k, v = F.linear(x, self.qkv_weight).split(
                [self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.num_kv_heads * self.head_dim], -1
            )
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return (q.reshape(*lead, self.num_heads, self.head_dim), k.reshape(*lead, self.num_kv_heads, self.head_dim),
                v.reshape(*lead, self.num_kv_heads, self.head_dim))

    def heads(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x: [n, D] -> q [H, n, hd], k and v [KVH, n, hd]: QK-norm per head, before RoPE."""
        q, k, v = self.project_qkv(x)
        q = apply_rotary(self.q_norm(q).transpose(0, 1), cos, sin)
        k = apply_rotary(self.k_norm(k).transpose(0, 1), cos, sin)
        return q, k, v.transpose(0, 1)

    def attend(self, q: Tensor, keys: Tensor, values: Tensor, attn_mask: Tensor | None = None,
               is_causal: bool = False) -> Tensor:
        """q [H, n, hd] over keys / values [KVH, m, hd] (each KV head serves H / KVH query heads),
        then o_proj: [n, D]."""
        n = q.shape[1]
        rep = self.num_heads // self.num_kv_heads
        keys = keys.repeat_interleave(rep, dim=0)
        values = values.repeat_interleave(rep, dim=0)
        out = F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=attn_mask,
                                             is_causal=is_causal)[0]
        return self.o_proj(out.transpose(0, 1).reshape(n, self.num_heads * self.head_dim))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: KVCache, layer: int, start: int) -> Tensor:
        """x: [n, D] new positions start..start+n-1; attends to cache[:start] and itself (causal)."""
        n = x.shape[0]
        q, k, v = self.heads(x, cos, sin)
        end = start + n
        cache.k[layer, :, start:end] = k
        cache.v[layer, :, start:end] = v
        # A cache wider than the compute (the megakernel's fp32 cache filled by a bf16 prefill) is
        # read back at the compute dtype; a no-op when they match.
        keys = cache.k[layer, :, :end].to(q.dtype)
        values = cache.v[layer, :, :end].to(q.dtype)
        # Causal over the new block, full view of everything cached before it.
        mask = None if n == 1 else torch.ones(n, end, dtype=torch.bool, device=x.device).tril(diagonal=start)
        return self.attend(q, keys, values, attn_mask=mask)


class MLP(nn.Module):
    def __init__(self, cfg: DecoderStackConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up_weight: Tensor | None = None  # set by fuse_projections

    def forward(self, x: Tensor) -> Tensor:
        if self.gate_up_weight is not None:
            gate, up = F.linear(x, self.gate_up_weight).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


@torch.no_grad()
def fuse_projections(module: nn.Module) -> None:
    """Concatenate q/k/v and gate/up weights so each is one matmul (fewer launches on the GPU).

    The original parameters become views of the fused tensors: no extra memory, and code that
    uses the separate projections sees the same values.
    """
    for m in module.modules():
        if isinstance(m, Attention) and m.qkv_weight is None:
            fused = torch.cat([m.q_proj.weight, m.k_proj.weight, m.v_proj.weight])
            nq, nk = m.q_proj.weight.shape[0], m.k_proj.weight.shape[0]
            m.q_proj.weight = nn.Parameter(fused[:nq], requires_grad=False)
            m.k_proj.weight = nn.Parameter(fused[nq : nq + nk], requires_grad=False)
            m.v_proj.weight = nn.Parameter(fused[nq + nk :], requires_grad=False)
            m.qkv_weight = fused
        elif isinstance(m, MLP) and m.gate_up_weight is None:
            fused = torch.cat([m.gate_proj.weight, m.up_proj.weight])
            ni = m.gate_proj.weight.shape[0]
            m.gate_proj.weight = nn.Parameter(fused[:ni], requires_grad=False)
            m.up_proj.weight = nn.Parameter(fused[ni:], requires_grad=False)
            m.gate_up_weight = fused


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderStackConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: KVCache, layer: int, start: int) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, layer, start)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderStack(nn.Module):
    """`layers` + final `norm`; embeddings and heads belong to the owning model."""

    def __init__(self, cfg: DecoderStackConfig):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: Tensor, cache: KVCache) -> Tensor:
        """Run new positions x [n, D] after cache.length; returns post-norm hidden states [n, D]."""
        n = x.shape[0]
        start = cache.length
        if start + n > cache.max_len:
            raise RuntimeError(f"KV cache overflow: {start + n} positions > capacity {cache.max_len}")
        positions = torch.arange(start, start + n, device=x.device)
        cos, sin = rotary_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache, i, start)
        cache.length = start + n
        return self.norm(x)
