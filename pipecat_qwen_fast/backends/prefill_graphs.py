"""The talker prefill captured as CUDA graphs, one per prompt-length bucket.

An eager prefill launches ~30 kernels per layer from Python and pays a per-shape cost on every new
prompt length (the benchmark measured ~40 ms more for a length not seen before). A captured prefill
runs a right-padded prompt of the bucket's length: causal attention keeps the real positions
independent of the padding, and the caller copies the K/V rows of the real positions into its own
cache (the megakernel's per-session cache, the CUDA-graph backend's slot pool).

On a GPU each layer runs one `torch.compile`d step (`prefill_layer`), compiled once for every
layer and every bucket (the layers share its code, the length is symbolic; ~10 s at a cold load).
A captured prefill of the eager layers is ~37 kernels a layer, ~1050 in all: 2.7-2.8 ms for a
short prompt on the H200, of ~8 ms to first audio; from the compiled step 1.6 ms (docs/journal/NOTES.md,
"The prefill compiled"). `QWEN_FAST_COMPILE_PREFILL=0` keeps the eager layers.

Graphs of several rows (`rows`, `run_rows`) prefill up to that many prompts in one replay, for
the few calls a busy batch engine opens in one round: the prefill is launch-bound, so four short
prompts cost about what one does (GraphBackend.prefill_many).

The megakernel's prefill runs in fp32 on the bf16 weights (`prefill_layer_fp32`), as its decode
does, so that a call's codes are the fp32 model's (issue 34). Its products are exact
(`exact_linear`): the fp32 activation is cut into three bf16 terms that sum to it, and each term
meets the bf16 weight on the tensor cores with fp32 accumulation, where an fp32 copy of the weights
would take the GPU's fp32 (non-tensor) units and twice the memory (docs/PERFORMANCE.md, "The
prefill in fp32").
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from pipecat_qwen_fast.config import TalkerConfig
from pipecat_qwen_fast.model.layers import (
    Attention,
    DecoderLayer,
    DecoderStack,
    KVCache,
    apply_rotary,
    fuse_projections,
    rotary_cos_sin,
)
from pipecat_qwen_fast.model.talker import Talker
from pipecat_qwen_fast.utils.cuda_graphs import (
    GraphCapturer,
    compile_blocker,
    plain_only,
    recompile_limit,
)

logger = logging.getLogger(__name__)

PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512)


def prefill_layer(layer: DecoderLayer, x: Tensor, cos: Tensor, sin: Tensor, k_out: Tensor, v_out: Tensor) -> Tensor:
    """`DecoderLayer.forward` over a whole prompt from position 0 (causal), its K/V rows written
    into k_out / v_out [kv_heads, n, head_dim]. The same math without the cache object and the
    layer index, so that one compiled copy serves every layer."""
    attn = layer.self_attn
    q, k, v = attn.heads(layer.input_layernorm(x), cos, sin)
    k_out.copy_(k)
    v_out.copy_(v)
    x = x + attn.attend(q, k, v, is_causal=True)  # the rows just written, at the same dtype
    return x + layer.mlp(layer.post_attention_layernorm(x))


def prefill_layer_rows(layer: DecoderLayer, x: Tensor, cos: Tensor, sin: Tensor, k_out: Tensor,
                       v_out: Tensor) -> Tensor:
    """`prefill_layer` over several prompts at once: x [B, L, D], each row a prompt from position 0
    (right-padded), its K/V rows into k_out / v_out [B, kv_heads, L, head_dim]. The same math a
    row at a time, so that a round's few new calls share one captured prefill: it is launch-bound
    (~480 kernels for ~1.3 ms of GPU at ~30 positions), so 4 prompts cost about what one does."""
    attn = layer.self_attn
    B, L = x.shape[:2]
    q, k, v = attn.project_qkv(layer.input_layernorm(x))  # [B, L, heads, hd]
    q = apply_rotary(attn.q_norm(q).transpose(1, 2), cos, sin)  # [B, H, L, hd]
    k = apply_rotary(attn.k_norm(k).transpose(1, 2), cos, sin)
    v = v.transpose(1, 2)
    k_out.copy_(k)
    v_out.copy_(v)
    rep = attn.num_heads // attn.num_kv_heads
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1),
                                         is_causal=True)
    x = x + attn.o_proj(out.transpose(1, 2).reshape(B, L, attn.num_heads * attn.head_dim))
    return x + layer.mlp(layer.post_attention_layernorm(x))


# ---------------------------------------------------------------------------------------------
# The fp32 layer step


def top_bits(x: Tensor) -> Tensor:
    """fp32 x cut to its sign, exponent and 7 leading mantissa bits: a bf16 value, x - top_bits(x)
    exact. A bit mask, not a cast: inductor computes a cast to bf16 inside a fused kernel in fp32,
    without the rounding."""
    return (x.view(torch.int32) & -65536).view(torch.float32)


def split_bf16(x: Tensor) -> Tensor:
    """fp32 x [n, K] as three bf16 terms whose sum is x exactly, stacked: [3n, K]. Each term takes
    the next 8 significant bits of x's 24, so the last one's ≤ 8 bits are exact in bf16."""
    hi = top_bits(x)
    rest = x - hi
    mid = top_bits(rest)
    return torch.cat([hi, mid, rest - mid]).to(torch.bfloat16)


def exact_linear(x: Tensor, weight: Tensor) -> Tensor:
    """x @ weight.T at fp32, x fp32 [n, K]. fp32 weights: the fp32 product. bf16 weights: each of
    x's three bf16 terms times the weight, products exact and summed at fp32 (the tensor cores' bf16
    product with an fp32 result), the terms' results added smallest first."""
    if weight.dtype == x.dtype:
        return F.linear(x, weight)
    n = x.shape[0]
    terms = split_bf16(x)
    if x.is_cuda:
        parts = torch.mm(terms, weight.t(), out_dtype=torch.float32)
    else:  # no bf16 product with an fp32 result on the CPU: the same exact products at fp32
        parts = torch.mm(terms.float(), weight.t().float())
    return parts[:n] + (parts[n : 2 * n] + parts[2 * n :])


def exact_products_blocker(device: torch.device) -> str | None:
    """Why `exact_linear`'s bf16 product with an fp32 result cannot run on `device`, or None (the
    CPU runs its own form)."""
    if device.type != "cuda":
        return None
    try:
        a = torch.ones(2, 8, device=device, dtype=torch.bfloat16)
        torch.mm(a, a.t(), out_dtype=torch.float32)
    except (RuntimeError, TypeError, NotImplementedError) as e:
        return f"{type(e).__name__}: {str(e)[:200]}"
    return None


def fused_qkv(attn: Attention) -> Tensor:
    if attn.qkv_weight is not None:
        return attn.qkv_weight
    return torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])


def causal_attention(attn: Attention, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """q [H, n, hd] over k / v [KVH, n, hd], causal, before o_proj: [n, H * hd]."""
    rep = attn.num_heads // attn.num_kv_heads
    out = F.scaled_dot_product_attention(q[None], k.repeat_interleave(rep, dim=0)[None],
                                         v.repeat_interleave(rep, dim=0)[None], is_causal=True)[0]
    return out.transpose(0, 1).reshape(q.shape[1], attn.num_heads * attn.head_dim)


def prefill_layer_fp32(layer: DecoderLayer, x: Tensor, cos: Tensor, sin: Tensor, k_out: Tensor,
                       v_out: Tensor) -> Tensor:
    """`prefill_layer` with its activations in fp32 (x, cos, sin, k_out, v_out fp32) on the layer's
    weights as they are: `DecoderLayer.forward`'s math as the fp32 model computes it, the norms'
    weights upcast by promotion, every product through `exact_linear`. Reads q/k/v as one matrix
    where they are fused (`fuse_projections`), else joins them on each call."""
    attn, mlp = layer.self_attn, layer.mlp
    n, hd = x.shape[0], attn.head_dim
    q, k, v = exact_linear(layer.input_layernorm(x), fused_qkv(attn)).split(
        [attn.num_heads * hd, attn.num_kv_heads * hd, attn.num_kv_heads * hd], dim=-1)
    q = apply_rotary(attn.q_norm(q.reshape(n, attn.num_heads, hd)).transpose(0, 1), cos, sin)
    k = apply_rotary(attn.k_norm(k.reshape(n, attn.num_kv_heads, hd)).transpose(0, 1), cos, sin)
    v = v.reshape(n, attn.num_kv_heads, hd).transpose(0, 1)
    k_out.copy_(k)
    v_out.copy_(v)
    x = x + exact_linear(causal_attention(attn, q, k, v), attn.o_proj.weight)
    h = layer.post_attention_layernorm(x)
    if mlp.gate_up_weight is not None:
        gate, up = exact_linear(h, mlp.gate_up_weight).chunk(2, dim=-1)
    else:
        gate, up = exact_linear(h, mlp.gate_proj.weight), exact_linear(h, mlp.up_proj.weight)
    return x + exact_linear(F.silu(gate) * up, mlp.down_proj.weight)


@torch.no_grad()
def prefill_from_start(stack: DecoderStack, x: Tensor, cache: KVCache, step: Callable = prefill_layer_fp32) -> Tensor:
    """A whole prompt x [n, D] from position 0 through `stack`, one `step` a layer, its K/V rows
    into cache positions 0..n-1 (any float dtype); the post-norm hidden of position n - 1. The
    eager form of the captured prefill, for prompts past its buckets."""
    n = x.shape[0]
    if n > cache.max_len:
        raise RuntimeError(f"KV cache overflow: {n} prefill positions > capacity {cache.max_len}")
    cos, sin = rotary_cos_sin(torch.arange(n, device=x.device), stack.cfg.head_dim, stack.cfg.rope_theta, x.dtype)
    for i, layer in enumerate(stack.layers):
        x = step(layer, x, cos, sin, cache.k[i, :, :n], cache.v[i, :, :n])
    cache.length = n
    return stack.norm(x[-1:])[0]


@contextlib.contextmanager
def fp32_matmuls() -> Iterator[None]:
    """fp32 matrix products at fp32, not TF32, whatever the process asked for (the fp32 reference
    computes them so); a captured graph keeps the kernels chosen inside."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


@dataclass
class StackOwner:
    """What PrefillGraphs reads of a Talker: its config and a decoder stack (an fp32 copy of the
    talker's, say)."""

    cfg: TalkerConfig
    model: DecoderStack


@torch.no_grad()
def stack_copy(stack: DecoderStack, dtype: torch.dtype) -> DecoderStack:
    """The layers and final norm of `stack` at `dtype`, without the embeddings a TalkerModel also
    holds, q/k/v and gate/up fused."""
    with torch.device("meta"):
        out = DecoderStack(stack.cfg)
    out = out.to_empty(device=stack.norm.weight.device).to(dtype)
    source = dict(stack.named_parameters())
    for name, p in out.named_parameters():
        p.requires_grad_(False).copy_(source[name])
    fuse_projections(out)
    return out.eval()


# ---------------------------------------------------------------------------------------------
# The graphs


def mark_length_dynamic(e: dict) -> None:
    """The bucket's length symbolic in a compiled step's inputs: one compile for every bucket
    (where dynamo keeps it so; it would recompile per bucket otherwise). The length is the
    second-last dimension of the prompt and of each K/V buffer, with or without a rows dimension."""
    for t in (e["embeds"], *e["rope"]):
        torch._dynamo.maybe_mark_dynamic(t, t.dim() - 2)
    for kv in e["layer_kv"]:
        for t in kv:
            torch._dynamo.maybe_mark_dynamic(t, t.dim() - 2)


class PrefillGraphs:
    """`talker`: a Talker, or a StackOwner; `dtype`: the activations' and K/V buffers'; `step`: the
    layer step (`prefill_layer`: the modules at their own dtype; `prefill_layer_fp32`); `kind`
    names the arithmetic, so that a backend shares only graphs that compute what its own would
    (default: the dtype's name). `rows` > 1: each graph prefills up to that many prompts at once
    (`run_rows`), with a step that takes them as [rows, L, D] (`prefill_layer_rows`)."""

    def __init__(self, talker: Talker | StackOwner, device: torch.device, dtype: torch.dtype, buckets=PREFILL_BUCKETS,
                 use_graphs: bool | None = None, compile: bool | None = None, step: Callable = prefill_layer,
                 kind: str | None = None, rows: int = 1):
        if rows < 1:
            raise ValueError(f"rows must be at least 1; got {rows}")
        self.rows = rows
        self.talker = talker
        self.device = device
        self.dtype = dtype
        self.step = step
        self.kind = kind or str(dtype).removeprefix("torch.")
        self.buckets = tuple(buckets)
        self.use_graphs = device.type == "cuda" if use_graphs is None else use_graphs
        self.entries: dict[int, dict] = {}
        self.capturer = GraphCapturer(device) if self.use_graphs else None
        reason = compile_blocker(device, "QWEN_FAST_COMPILE_PREFILL") if self.use_graphs else "no CUDA graphs"
        if compile is None:
            compile = reason is None
            if reason is not None and self.use_graphs:
                logger.info("the prefill's layers are not compiled: %s", reason)
        self.compile = compile
        self._compiled: Callable | None = None
        self.compile_s = 0.0  # seconds the compiled step took to compile and run, over all buckets
        self.plain_buckets: set[int] = set()  # captured plain inside plain_first(), to compile later

    def bucket_for(self, n: int) -> int | None:
        return next((b for b in self.buckets if n <= b), None)

    @torch.no_grad()
    def run(self, embeds: Tensor) -> tuple[Tensor, Tensor, Tensor] | None:
        """Prefill `embeds` [n, D]: (k, v [layers, kv_heads, bucket, head_dim], last hidden [D]).

        The tensors are static buffers, valid until the next call; rows >= n are padding. None when
        no prepared bucket fits (the caller then runs the eager prefill).
        """
        if self.rows != 1:
            raise RuntimeError("graphs of several rows prefill through run_rows")
        n = embeds.shape[0]
        bucket = self.bucket_for(n)
        if bucket is None or bucket not in self.entries:
            return None
        e = self.entries[bucket]
        e["embeds"][:n].copy_(embeds)
        e["embeds"][n:].zero_()
        e["last"].fill_(n - 1)
        if e["graph"] is not None:
            e["graph"].replay()
        else:  # CPU, or before capture: the same body, eagerly
            self._body(e)
        return e["k"], e["v"], e["hidden"]

    @torch.no_grad()
    def run_rows(self, embeds: list[Tensor]) -> tuple[Tensor, Tensor, Tensor] | None:
        """Prefill up to `rows` prompts [n_i, D] in one pass: (k, v [layers, rows, kv_heads, bucket,
        head_dim], last hiddens [rows, D]), row i for prompt i; rows past the prompts are padding.
        Static buffers, valid until the next call. None when no prepared bucket fits the longest."""
        if self.rows == 1:
            raise RuntimeError("graphs of one row prefill through run")
        if not 0 < len(embeds) <= self.rows:
            raise ValueError(f"run_rows takes 1 to {self.rows} prompts; got {len(embeds)}")
        bucket = self.bucket_for(max(x.shape[0] for x in embeds))
        if bucket is None or bucket not in self.entries:
            return None
        e = self.entries[bucket]
        x, last = e["embeds"], e["last"]
        x.zero_()  # every row's padding, and the rows past the prompts
        for i, prompt in enumerate(embeds):
            n = prompt.shape[0]
            x[i, :n].copy_(prompt)
            last[i].fill_(i * bucket + n - 1)  # a fill, not a copy from the host: no sync
        if e["graph"] is not None:
            e["graph"].replay()
        else:
            self._body(e)
        return e["k"], e["v"], e["hidden"]

    def prepare(self, bucket: int) -> dict:
        """Static buffers for prompts of up to `bucket` positions (no graph: CPU tests)."""
        stack = self.talker.cfg.stack
        d = self.talker.cfg.hidden_size
        rows = (self.rows,) if self.rows > 1 else ()  # graphs of one prompt keep its unbatched shapes
        kv_shape = (stack.num_layers, *rows, stack.num_kv_heads, bucket, stack.head_dim)
        e = {
            "embeds": torch.zeros(*rows, bucket, d, device=self.device, dtype=self.dtype),
            "rope": rotary_cos_sin(torch.arange(bucket, device=self.device), stack.head_dim, stack.rope_theta, self.dtype),
            # Flat positions (row x bucket + position) of each row's last real position.
            "last": torch.zeros(self.rows, device=self.device, dtype=torch.long),
            "hidden": torch.zeros(*rows, d, device=self.device, dtype=self.dtype),
            "k": torch.zeros(kv_shape, device=self.device, dtype=self.dtype),
            "v": torch.zeros(kv_shape, device=self.device, dtype=self.dtype),
            "graph": None,
        }
        # Each layer's K/V rows as views made once: the compiled step's dynamic-size marks stay on them.
        e["layer_kv"] = [(e["k"][i], e["v"][i]) for i in range(stack.num_layers)]
        self.entries[bucket] = e
        return e

    @torch.no_grad()
    def capture_all(self) -> None:
        for bucket in self.buckets:
            if bucket not in self.entries:
                self._capture(bucket)

    @torch.no_grad()
    def compile_plain(self) -> None:
        """Recapture the buckets captured plain (plain_first) from the compiled layer step."""
        for bucket in sorted(self.plain_buckets):
            self._capture(bucket)
        self.plain_buckets.clear()

    def _body(self, e: dict, step: Callable | None = None) -> None:
        step = step or self.step
        stack = self.talker.model
        x = e["embeds"]
        cos, sin = e["rope"]
        for layer, (k, v) in zip(stack.layers, e["layer_kv"]):
            x = step(layer, x, cos, sin, k, v)
        # The norm is per position: only each row's last real one is needed.
        last = x.reshape(-1, x.shape[-1]).index_select(0, e["last"])
        e["hidden"].copy_(stack.norm(last).view_as(e["hidden"]))

    def _compiled_layer(self, e: dict) -> Callable:
        """The compiled layer step, compiled now (outside any capture) if it was not yet."""
        if self._compiled is None:
            self._compiled = torch.compile(self.step, dynamic=None)
        mark_length_dynamic(e)
        with recompile_limit(64):
            self._body(e, self._compiled)
        return self._compiled

    def _capture(self, bucket: int) -> dict:
        with fp32_matmuls() if self.dtype == torch.float32 else contextlib.nullcontext():
            return self._capture_bucket(bucket)

    def _capture_bucket(self, bucket: int) -> dict:
        e = self.prepare(bucket)
        if self.capturer is not None:
            step: Callable = self.step
            if self.compile and plain_only():
                self.plain_buckets.add(bucket)
            elif self.compile:
                try:
                    t0 = time.perf_counter()
                    step = self._compiled_layer(e)
                    seconds = time.perf_counter() - t0
                    self.compile_s += seconds
                    logger.info("prefill of %d positions from the compiled layer step (%.1f s)", bucket, seconds)
                except Exception as e_:  # noqa: BLE001 - any compiler failure: the plain graphs still work
                    logger.warning("compiling the prefill's layer step failed (%s: %s); using plain graphs",
                                   type(e_).__name__, str(e_)[:300])
                    self.compile = False
                    step = self.step
            with recompile_limit(64):
                e["graph"], _ = self.capturer.capture(lambda: self._body(e, step))
        return e
