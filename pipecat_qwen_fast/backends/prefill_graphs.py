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
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from torch import Tensor

from pipecat_qwen_fast.model.layers import DecoderLayer, rotary_cos_sin
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


def mark_length_dynamic(e: dict) -> None:
    """The bucket's length symbolic in a compiled step's inputs: one compile for every bucket
    (where dynamo keeps it so; it would recompile per bucket otherwise)."""
    for t in (e["embeds"], *e["rope"]):
        torch._dynamo.maybe_mark_dynamic(t, 0)
    for kv in e["layer_kv"]:
        for t in kv:
            torch._dynamo.maybe_mark_dynamic(t, 1)


class PrefillGraphs:
    def __init__(self, talker: Talker, device: torch.device, dtype: torch.dtype, buckets=PREFILL_BUCKETS,
                 use_graphs: bool | None = None, compile: bool | None = None):
        self.talker = talker
        self.device = device
        self.dtype = dtype
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

    def prepare(self, bucket: int) -> dict:
        """Static buffers for prompts of up to `bucket` positions (no graph: CPU tests)."""
        stack = self.talker.cfg.stack
        kv_shape = (stack.num_layers, stack.num_kv_heads, bucket, stack.head_dim)
        e = {
            "embeds": torch.zeros(bucket, self.talker.cfg.hidden_size, device=self.device, dtype=self.dtype),
            "rope": rotary_cos_sin(torch.arange(bucket, device=self.device), stack.head_dim, stack.rope_theta, self.dtype),
            "last": torch.zeros(1, device=self.device, dtype=torch.long),
            "hidden": torch.zeros(self.talker.cfg.hidden_size, device=self.device, dtype=self.dtype),
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

    def _body(self, e: dict, step: Callable = prefill_layer) -> None:
        stack = self.talker.model
        x = e["embeds"]
        cos, sin = e["rope"]
        for layer, (k, v) in zip(stack.layers, e["layer_kv"]):
            x = step(layer, x, cos, sin, k, v)
        # The norm is per position: only the last real one is needed.
        e["hidden"].copy_(stack.norm(x.index_select(0, e["last"]))[0])

    def _compiled_layer(self, e: dict) -> Callable:
        """The compiled layer step, compiled now (outside any capture) if it was not yet."""
        if self._compiled is None:
            self._compiled = torch.compile(prefill_layer, dynamic=None)
        mark_length_dynamic(e)
        with recompile_limit(64):
            self._body(e, self._compiled)
        return self._compiled

    def _capture(self, bucket: int) -> dict:
        e = self.prepare(bucket)
        if self.capturer is not None:
            step: Callable = prefill_layer
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
                    step = prefill_layer
            with recompile_limit(64):
                e["graph"], _ = self.capturer.capture(lambda: self._body(e, step))
        return e
