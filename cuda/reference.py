"""Plain-torch replica of the megakernel's instruction stream, plus random full-size talkers.

The kernel computes in fp32 on the checkpoint's bf16 weights: the same math as the torch modules
of `pipecat_qwen_fast.model.layers` run on an fp32 copy of the weights. This file spells that math out
phase by phase, one position at a time, so a mismatch can be pinned to one phase of one layer
(`stop_after`) instead of only showing up in the logits. Kernel and replica differ only in
summation order: ~5e-7 relative after a full talker step (H200).

Its sections follow the kernel's files (`cuda/phases/`, included in this order by
`cuda/qwen_mk.cu`), and its functions are named after the kernel's phases (`Kind` in
phases/schedule.cuh):

  phases/matvec.cuh     a matrix phase's operand and dot products   rms_norm, matvec
  phases/stack.cuh      a layer's phases, one grid barrier each      qkv (K_QKV), o_proj (K_O),
                                                                     layer_step, stack_step
  phases/attention.cuh  the attention phase (mk_attention.cuh)       inv_freq, rope, attention (K_ATTN)
  phases/mlp.cuh        gate/up + SiLU, down                         gate_up (K_GU), down (K_DOWN)
  phases/pred_fused.cuh, talker_fused.cuh, pred_first.cuh: the same math in fewer phases (fused
                        attention + o_proj, split down, passes 0 and 1 together): no replica of
                        their own; tests/test_megakernel.py holds each to the phases it replaces
  phases/frame.cuh      talker step, codec head (K_HEAD_T), spec section 6 rules, the predictor's
                        passes (K_PROJ, layers, K_HEAD_P), the next talker input (publish_frame):
                        ReplicaDecoder
  mk_sample.cuh         the sampling draw                            kernel_uniform, inverse_cdf_draw

then the harness that runs kernel and fp32 PyTorch path side by side, and random talkers.

Used by tests/test_megakernel.py and bench/megakernel_check.py (imported by path: cuda/ is not a
package).
"""

from __future__ import annotations

import json
from importlib import resources

import torch
from torch import Tensor

# The names `stop_after` accepts: a layer's phases in the order phases/stack.cuh runs them
# ("mlp_in": gate/up + SiLU, the K_GU phase's output).
PHASES = ("qkv", "attention", "o_proj", "mlp_in", "down")


# ---------------------------------------------------------------------------------------------
# phases/matvec.cuh (mk_matvec.cuh): a matrix phase's operand, RMSNorm in fp32, and its dot products


def rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """Over the last dim (one vector, or one row per head), as RMSNorm does in fp32."""
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)) * w.float()


def matvec(w: Tensor, x: Tensor) -> Tensor:
    return w.float() @ x


# ---------------------------------------------------------------------------------------------
# phases/stack.cuh: the q/k/v phase (K_QKV), a matrix phase on the normed residual


def qkv(layer, x_in: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """The raw q [H, 128], k and v [KV, 128] projections of the layer's normed input."""
    a = layer.self_attn
    H, KV, HD = a.num_heads, a.num_kv_heads, a.head_dim
    n = rms_norm(x_in, layer.input_layernorm.weight, eps)
    q = matvec(a.q_proj.weight, n).view(H, HD)
    k = matvec(a.k_proj.weight, n).view(KV, HD)
    v = matvec(a.v_proj.weight, n).view(KV, HD)
    return q, k, v


# ---------------------------------------------------------------------------------------------
# phases/attention.cuh (mk_attention.cuh): QK-norm + RoPE, the K/V append, softmax over the cache


def inv_freq(theta: float, device, head_dim: int = 128) -> Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))


def rope(x: Tensor, pos: int, inv_freq: Tensor) -> Tensor:
    """x fp32 [heads, 128] -> rotate-half RoPE with the fp32 cos/sin of layers.rotary_cos_sin."""
    ang = torch.tensor([float(pos)], device=x.device)[:, None] * inv_freq[None, :]
    ang = torch.cat([ang, ang], dim=-1)[0]
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * ang.cos() + rot * ang.sin()


def attention(layer, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, pos: int,
              inv_freq: Tensor, eps: float) -> Tensor:
    """The attention phase (K_ATTN) at `pos`: QK-norm and RoPE of the raw q/k, k and v appended to
    the layer's caches [KV, max_pos, 128], softmax attention over positions 0..pos. Returns the
    heads' outputs, flattened [H * 128]."""
    a = layer.self_attn
    H, KV, HD = a.num_heads, a.num_kv_heads, a.head_dim
    qn, kn = rms_norm(q, a.q_norm.weight, eps), rms_norm(k, a.k_norm.weight, eps)
    q, k = rope(qn, pos, inv_freq), rope(kn, pos, inv_freq)
    k_cache[:, pos] = k
    v_cache[:, pos] = v
    keys, values = k_cache[:, : pos + 1].float(), v_cache[:, : pos + 1].float()
    rep = H // KV
    scores = torch.einsum("hd,htd->ht", q, keys.repeat_interleave(rep, 0)) / HD**0.5
    return torch.einsum("ht,htd->hd", scores.softmax(-1), values.repeat_interleave(rep, 0)).flatten()


# ---------------------------------------------------------------------------------------------
# phases/stack.cuh: the o_proj phase (K_O), o_proj plus the residual


def o_proj(layer, x_in: Tensor, attn: Tensor) -> Tensor:
    """The residual after attention."""
    return x_in + matvec(layer.self_attn.o_proj.weight, attn)


# ---------------------------------------------------------------------------------------------
# phases/mlp.cuh: gate/up + SiLU (K_GU) and down (K_DOWN; split over the gate/up units with
# qmk_stack.split_down, the same sum in another order)


def gate_up(layer, resid: Tensor, eps: float) -> Tensor:
    """The MLP's activations silu(gate) * up of the normed residual after attention."""
    mlp = layer.mlp
    n = rms_norm(resid, layer.post_attention_layernorm.weight, eps)
    g, u = matvec(mlp.gate_proj.weight, n), matvec(mlp.up_proj.weight, n)
    return g * torch.sigmoid(g) * u


def down(layer, resid: Tensor, act: Tensor) -> Tensor:
    """The layer's output: the residual after attention plus the down projection."""
    return resid + matvec(layer.mlp.down_proj.weight, act)


# ---------------------------------------------------------------------------------------------
# phases/stack.cuh: a stack's layers at one position, phase after phase (run_stack)


@torch.no_grad()
def layer_step(layer, x_in: Tensor, k_cache: Tensor, v_cache: Tensor, pos: int, inv_freq: Tensor, eps: float,
               stop_after: str | None = None) -> Tensor:
    """One decoder layer at one position. x_in: fp32 [D]; caches fp32 [KV, max_pos, 128] (this
    layer) are appended at `pos`. Returns the new residual (or the named phase's output)."""
    q, k, v = qkv(layer, x_in, eps)
    if stop_after == "qkv":
        return torch.cat([q.flatten(), k.flatten(), v.flatten()])
    attn = attention(layer, q, k, v, k_cache, v_cache, pos, inv_freq, eps)
    if stop_after == "attention":
        return attn
    resid = o_proj(layer, x_in, attn)
    if stop_after == "o_proj":
        return resid
    act = gate_up(layer, resid, eps)
    if stop_after == "mlp_in":
        return act
    return down(layer, resid, act)


@torch.no_grad()
def stack_step(stack, x: Tensor, k_cache: Tensor, v_cache: Tensor, pos: int, inv_freq: Tensor,
               layers: int | None = None) -> tuple[Tensor, Tensor]:
    """All (or the first `layers`) layers at `pos`; returns (residual, post-final-norm hidden).
    k_cache/v_cache: fp32 [layers, KV, max_pos, 128], appended at `pos`."""
    eps = stack.cfg.rms_norm_eps
    x = x.float()
    n = len(stack.layers) if layers is None else layers
    for i in range(n):
        x = layer_step(stack.layers[i], x, k_cache[i], v_cache[i], pos, inv_freq, eps)
    return x, rms_norm(x, stack.norm.weight, eps)


# ---------------------------------------------------------------------------------------------
# phases/frame.cuh: a frame (qmk_frame_kernel): talker step, codec head, code 0, the predictor's
# passes with their heads, the next talker input


class ReplicaDecoder:
    """Greedy frames through the replica: talker step, codec head, spec §6 processing, 15
    predictor passes (run as 16 single positions, like the kernel), next input, all fp32. Starts
    from a prefill (fp32 KV cache + post-norm hidden), as the megakernel backend does. Its methods
    are the frame's phases, in the kernel's order (decode_frame)."""

    def __init__(self, talker, k_cache: Tensor, v_cache: Tensor, length: int, hidden: Tensor, trailing: Tensor,
                 pad_vec: Tensor, min_new_tokens: int = 2, repetition_penalty: float = 1.05):
        self.t = talker
        self.k = k_cache.to(torch.float32, copy=True)
        self.v = v_cache.to(torch.float32, copy=True)
        self.length = length
        self.hidden = hidden.float()
        self.trailing, self.pad_vec = trailing, pad_vec
        cp = talker.code_predictor
        ps = cp.cfg.stack
        shape = (ps.num_layers, ps.num_kv_heads, cp.cfg.num_code_groups, ps.head_dim)
        self.pk = torch.zeros(shape, device=k_cache.device, dtype=torch.float32)
        self.pv = torch.zeros_like(self.pk)
        self.freq_t = inv_freq(talker.cfg.stack.rope_theta, k_cache.device)
        self.freq_p = inv_freq(ps.rope_theta, k_cache.device)
        self.seen = torch.zeros(talker.cfg.vocab_size, dtype=torch.bool, device=k_cache.device)
        self.frame = 0
        self.pending: Tensor | None = None
        self.min_new, self.penalty = min_new_tokens, repetition_penalty
        self.pred_hidden = torch.zeros((cp.cfg.num_code_groups, ps.hidden_size), device=k_cache.device)

    def talker_step(self) -> None:
        """The talker's layers at the next position (run_stack / run_talker_fused), from the
        previous frame's next input; the first frame's hidden is the prefill's."""
        if self.frame > 0:
            _, self.hidden = stack_step(self.t.model, self.pending, self.k, self.v, self.length, self.freq_t)
            self.length += 1

    def codec_head(self) -> Tensor:
        """The codec head phase (K_HEAD_T): code 0's logits."""
        return matvec(self.t.codec_head.weight, self.hidden)

    def talker_rules(self, logits: Tensor) -> Tensor:
        """Spec §6 on code 0's logits, as the kernel's sampling applies them (mk_sample.cuh
        TalkerRules): repetition penalty on seen ids, no EOS before min_new_tokens, the control ids
        other than EOS suppressed."""
        cfg = self.t.cfg
        logits = torch.where(self.seen, torch.where(logits < 0, logits * self.penalty, logits / self.penalty), logits)
        if self.frame < self.min_new:
            logits[cfg.codec_eos_id] = float("-inf")
        logits[cfg.vocab_size - 1024:] = torch.where(
            torch.arange(cfg.vocab_size - 1024, cfg.vocab_size, device=logits.device) == cfg.codec_eos_id,
            logits[cfg.vocab_size - 1024:], torch.full_like(logits[cfg.vocab_size - 1024:], float("-inf")))
        return logits

    def project(self, x: Tensor) -> Tensor:
        """The projection phase (K_PROJ): a pass's input to the predictor's width (the 1.7B's)."""
        proj = self.t.code_predictor.small_to_mtp_projection
        if isinstance(proj, torch.nn.Identity):
            return x
        return matvec(proj.weight, x) + proj.bias.float()

    def predictor_pass(self, p: int, fed: list[int]) -> Tensor:
        """Predictor pass p at position p: its input (the talker hidden for pass 0, else the
        embedding of the code fed back for group p - 1), projected, through the predictor's layers;
        returns the post-norm hidden."""
        t, cp = self.t, self.t.code_predictor
        if p == 0:
            src = self.hidden
        elif p == 1:
            src = t.model.codec_embedding.weight[fed[0]].float()
        else:
            src = cp.model.codec_embedding[p - 2].weight[fed[p - 1]].float()
        _, h = stack_step(cp.model, self.project(src), self.pk, self.pv, p, self.freq_p)
        return h

    def lm_head(self, p: int, h: Tensor) -> Tensor:
        """Pass p's head phase (K_HEAD_P): code group p's logits."""
        return matvec(self.t.code_predictor.lm_head[p - 1].weight, h)

    def publish_frame(self, fed: list[int]) -> None:
        """The next talker input (publish_frame): the fed codes' embeddings summed in
        Talker.embed_frames' order (code 0's row, then groups 1..15), then the text vector."""
        t, cp = self.t, self.t.code_predictor
        total = t.model.codec_embedding.weight[fed[0]].float()
        for g in range(1, t.cfg.num_code_groups):
            total = total + cp.model.codec_embedding[g - 1].weight[fed[g]].float()
        text = self.trailing[self.frame] if self.frame < self.trailing.shape[0] else self.pad_vec
        self.pending = total + text.float()

    @torch.no_grad()
    def decode_frame(self, force: Tensor | None = None) -> Tensor:
        self.talker_step()
        logits = self.talker_rules(self.codec_head())
        codes = [int(torch.argmax(logits))]
        fed = [int(force[0]) if force is not None else codes[0]]
        self.seen[fed[0]] = True
        for p in range(self.t.cfg.num_code_groups):
            h = self.predictor_pass(p, fed)
            if p == 0:
                continue
            self.pred_hidden[p] = h
            c = int(torch.argmax(self.lm_head(p, h)))
            codes.append(c)
            fed.append(int(force[p]) if force is not None else c)
        self.publish_frame(fed)
        self.frame += 1
        return torch.tensor(codes, device=self.hidden.device)


# ---------------------------------------------------------------------------------------------
# mk_sample.cuh (and mk_util.cuh: uniform01): the kernel's sampling draw

M64 = (1 << 64) - 1


def splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def kernel_uniform(seed: int, frame: int, group: int) -> float:
    """The counter-based uniform every block draws for (seed, frame, group): exact in float64."""
    z = splitmix64((seed & M64) ^ splitmix64((frame << 8) | group))
    return (z >> 40) / 16777216.0


def inverse_cdf_draw(warped: Tensor, u: float) -> tuple[int, float]:
    """The first id, in id order, whose running mass exceeds u * total, over softmax weights of
    the finite entries of `warped` (logits after temperature and top-k), in float64. Also returns
    how close u * total lies to the nearest running-mass boundary, as a fraction of the total: the
    kernel sums in float32, so only a draw that close to a boundary may land one id over."""
    x = warped.double()
    keep = torch.isfinite(x)
    p = torch.where(keep, torch.exp(x - x[keep].max()), torch.zeros_like(x))
    cum = torch.cumsum(p, 0)
    total = float(cum[-1])
    r = u * total
    idx = int(torch.searchsorted(cum, torch.tensor([r], dtype=cum.dtype, device=cum.device), right=True)[0])
    idx = min(idx, int(keep.nonzero().max()))
    margin = float((cum[keep] - r).abs().min()) / total
    return idx, margin


# ---------------------------------------------------------------------------------------------
# Kernel against the fp32 PyTorch path (shared by tests/test_megakernel.py and
# bench/megakernel_check.py)

PROMPT_LEN = 12


@torch.no_grad()
def torch_predictor_hidden(talker, h: Tensor, codes: Tensor) -> Tensor:
    """The torch modules' own post-norm predictor hidden states [16, Dp] for a frame with the given
    codes, computed in h's dtype (the fp32 reference of the kernel's `pred_hidden`)."""
    from pipecat_qwen_fast.model.layers import KVCache

    cp = talker.code_predictor
    cache = KVCache(cp.cfg.stack, cp.cfg.num_code_groups, h.device, h.dtype)
    x = torch.stack([h, talker.embed_codec(codes[0].view(1))[0]])
    outs = [cp.model(cp.small_to_mtp_projection(x), cache)]
    for g in range(2, talker.cfg.num_code_groups):
        e = cp.model.codec_embedding[g - 2](codes[g - 1].view(1))
        outs.append(cp.model(cp.small_to_mtp_projection(e), cache))
    return torch.cat(outs)


def rel_err(a: Tensor, b: Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm())


def prompt_inputs(D: int, prompt_len: int = PROMPT_LEN, seed: int = 1):
    """Prompt embeds, trailing text vectors and pad vector, all bf16 values (what the engine makes
    and what the kernel reads for the text vectors)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    embeds = (torch.randn((prompt_len, D), device="cuda", generator=gen) * 0.05).to(torch.bfloat16)
    trailing = (torch.randn((4, D), device="cuda", generator=gen) * 0.05).to(torch.bfloat16)
    pad = (torch.randn(D, device="cuda", generator=gen) * 0.05).to(torch.bfloat16)
    return embeds, trailing, pad


def start_reference(tb, D: int, params, frames: int, seed: int = 0, prompt_len: int = PROMPT_LEN):
    """An fp32 TorchBackend state after its own fp32 prefill of the bf16-valued prompt."""
    embeds, trailing, pad = prompt_inputs(D, prompt_len)
    ts = tb.new_state(max_positions=prompt_len + frames + 2, params=params, seed=seed, trailing=trailing,
                      pad_vec=pad)
    tb.prefill(ts, embeds.float())
    return ts


def start_kernel_from(mb, ts, params, seed: int = 0):
    """A megakernel state that adopts the reference's prefill (call before the reference decodes):
    both then start from the very same fp32 KV cache and hidden state, so any difference is the
    decode's own."""
    ms = mb.new_state(max_positions=ts.talker_cache.max_len, params=params, seed=seed, trailing=ts.trailing,
                      pad_vec=ts.pad_vec)
    mb.load_prefill(ms, ts.talker_cache.k, ts.talker_cache.v, ts.talker_cache.length, ts.hidden)
    return ms


@torch.no_grad()
def teacher_forced(tb, mb, talker32, params, frames: int) -> dict:
    """The fp32 reference decodes freely, the kernel is fed its codes: worst talker hidden error
    (every frame), worst predictor hidden error (every 25 frames), argmax agreement."""
    ts = start_reference(tb, talker32.cfg.hidden_size, params, frames)
    ms = start_kernel_from(mb, ts, params)
    agree = total = 0
    worst_t = worst_p = 0.0
    for t in range(frames):
        codes_ref = tb.decode_frame(ts)
        codes = mb.decode_frame(ms, force=codes_ref)
        worst_t = max(worst_t, rel_err(ms.buffers["hidden"], ts.hidden))
        if t % 25 == 0:
            pred = torch_predictor_hidden(talker32, ts.hidden, codes_ref)
            worst_p = max(worst_p, rel_err(ms.buffers["pred_hidden"][1:], pred[1:]))
        agree += int((codes == codes_ref).sum())
        total += codes.numel()
    mb.release(ms)
    tb.release(ts)
    return {"teacher_forced_frames": frames, "talker_hidden_rel_err_max": worst_t,
            "predictor_hidden_rel_err_max": worst_p, "argmax_agreement": agree / total}


# ---------------------------------------------------------------------------------------------
# Random full-size checkpoints (speed does not depend on values; zeros would hide bugs)


def model_config(size: str = "0.6b"):
    from pipecat_qwen_fast.config import parse_model_config

    name = f"{size}-custom_voice.config.json"
    text = resources.files("pipecat_qwen_fast").joinpath("assets", "configs", name).read_text("utf-8")
    return parse_model_config(json.loads(text))


@torch.no_grad()
def random_talker(size: str = "0.6b", device: str | torch.device = "cuda", seed: int = 0, zero_eos: bool = True,
                  scaled_residual: bool = True):
    """A `Talker` with N(0, 0.02) matrices, N(0, 1)-ish embeddings scaled like real ones, and norm
    weights in [0.5, 1.5]. zero_eos zeroes the EOS row of the codec head so greedy runs never stop."""
    from pipecat_qwen_fast.model.talker import Talker

    cfg = model_config(size)
    with torch.device("meta"):
        talker = Talker(cfg.talker, cfg.predictor)
    talker = talker.to_empty(device=device).to(torch.bfloat16)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in talker.named_parameters():
        if "norm" in name and p.dim() == 1:
            p.copy_(torch.rand(p.shape, generator=gen, device=device) + 0.5)
        elif scaled_residual and name.endswith(("o_proj.weight", "down_proj.weight")):
            # GPT-2 style 1/sqrt(2 * layers) on the residual branches keeps the random stack from
            # being chaotic: with plain N(0, 0.02) every layer overwrites the residual stream and
            # one-ulp rounding differences grow ~10x over 28 layers.
            layers = cfg.talker.stack.num_layers if name.startswith("model.") else cfg.predictor.stack.num_layers
            p.copy_(torch.randn(p.shape, generator=gen, device=device) * (0.02 / (2 * layers) ** 0.5))
        else:
            p.copy_(torch.randn(p.shape, generator=gen, device=device) * 0.02)
    if zero_eos:
        talker.codec_head.weight[cfg.talker.codec_eos_id].zero_()
    talker.eval()
    return talker, cfg
