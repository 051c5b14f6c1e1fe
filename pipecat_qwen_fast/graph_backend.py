"""CUDA-graph backend: the torch modules' frame, captured once and replayed for every session.

Eager PyTorch spends ~90 ms per frame on the H200 launching ~3000 tiny kernels (bench/NOTES.md).
Here one frame (talker step, codec head, logits processing, 15 predictor steps, next talker input)
is written against static buffers with all per-session values read from device memory, so a single
captured graph serves every session:

* K/V of every session live in one pool `[layers, slots, kv_heads, capacity, head_dim]`; the graph
  reads the session's slot and position from device scalars (index_put / index_select), and
  attends over a fixed bucket of positions with a mask (one graph per bucket length).
* Small per-session state (pending input, seen code-0 set, frame counter, text vector, sampling
  noise) is copied into the static buffers before a replay and back after it.
* Sampling uses noise drawn from the session's own generator before the replay, so seeded
  sessions repeat exactly whatever else runs on the GPU.

On a CPU the same functions run eagerly (no capture): that is how CI checks this backend's frame
against `TorchBackend`, the reference.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from .errors import QwenTTSError
from .layers import KVCache, apply_rotary, fuse_projections, rotary_cos_sin
from .sampling import SamplingParams, process_talker_logits, talker_suppress_mask, warp_logits
from .talker import Talker

logger = logging.getLogger("pipecat_qwen_fast")

BUCKETS = (128, 256, 512, 1024, 2048, 4096, 8192)
PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512)  # prompt lengths served by a captured prefill


class NoFreeSlotError(QwenTTSError, RuntimeError):
    """Every KV slot is in use; close a session first (the EngineService queues instead)."""


@dataclass
class GraphState:
    slot: int
    capacity: int
    params: SamplingParams
    generator: torch.Generator | None
    trailing: Tensor
    pad_vec: Tensor
    seen: Tensor  # bool [vocab]
    hidden: Tensor  # [D] post-norm talker hidden of the newest position (frame 0 input)
    pending: Tensor  # [D] next talker input
    position: int = 0  # positions written so far
    frame: int = 0
    released: bool = field(default=False)


class _Static:
    """The buffers a captured frame reads and writes."""

    def __init__(self, talker: Talker, device: torch.device, dtype: torch.dtype):
        d = talker.cfg.hidden_size
        v = talker.cfg.vocab_size
        pv = talker.code_predictor.cfg.vocab_size
        g = talker.cfg.num_code_groups
        self.x = torch.zeros(d, device=device, dtype=dtype)
        self.hidden = torch.zeros(d, device=device, dtype=dtype)
        self.text_vec = torch.zeros(d, device=device, dtype=dtype)
        self.seen = torch.zeros(v, device=device, dtype=torch.bool)
        self.slot = torch.zeros(1, device=device, dtype=torch.long)
        self.pos = torch.zeros(1, device=device, dtype=torch.long)
        self.frame = torch.zeros(1, device=device, dtype=torch.long)
        self.noise0 = torch.ones(v, device=device, dtype=torch.float32)
        self.noise = torch.ones(g - 1, pv, device=device, dtype=torch.float32)
        self.codes = torch.zeros(g, device=device, dtype=torch.long)
        self.x_next = torch.zeros(d, device=device, dtype=dtype)


class GraphBackend:
    name = "torch-cudagraph"

    def __init__(
        self,
        talker: Talker,
        device: torch.device,
        dtype: torch.dtype,
        *,
        max_sessions: int = 64,
        capacity: int = 4096,
        use_graphs: bool | None = None,
    ):
        self.talker = talker
        self.device = device
        self.dtype = dtype
        self.cfg = talker.cfg
        stack = talker.cfg.stack
        self.eos_id = talker.cfg.codec_eos_id
        self.num_groups = talker.cfg.num_code_groups
        self.capacity = capacity
        self.max_sessions = max_sessions
        self.use_graphs = device.type == "cuda" if use_graphs is None else use_graphs
        if device.type == "cuda":
            fuse_projections(talker)
        shape = (stack.num_layers, max_sessions, stack.num_kv_heads, capacity, stack.head_dim)
        self.pool_k = torch.zeros(shape, device=device, dtype=dtype)
        self.pool_v = torch.zeros(shape, device=device, dtype=dtype)
        self.free_slots = list(range(max_sessions - 1, -1, -1))
        self.suppress = talker_suppress_mask(talker.cfg.vocab_size, self.eos_id, device)
        cos, sin = rotary_cos_sin(torch.arange(capacity, device=device), stack.head_dim, stack.rope_theta, dtype)
        self.rope_cos, self.rope_sin = cos, sin
        self.kv_heads = torch.arange(stack.num_kv_heads, device=device)
        pred = talker.code_predictor.cfg
        self.pred_cache = KVCache(pred.stack, pred.num_code_groups, device, dtype)
        self.static = _Static(talker, device, dtype)
        # Constants made before any capture: a capture may not copy host values to the device.
        self.eos_frame = torch.zeros(self.num_groups, dtype=torch.long, device=device)
        self.eos_frame[0] = self.eos_id
        self.is_eos = torch.arange(talker.cfg.vocab_size, device=device) == self.eos_id
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.prefills: dict[int, dict] = {}
        self.pool = None

    @classmethod
    def for_device(cls, talker: Talker, device: torch.device, dtype: torch.dtype, capacity: int = 2048,
                   max_sessions: int = 64, memory_fraction: float = 0.25) -> GraphBackend:
        """Size the KV pool to at most `memory_fraction` of the GPU memory still free."""
        stack = talker.cfg.stack
        per_slot = 2 * stack.num_layers * stack.num_kv_heads * capacity * stack.head_dim * dtype.itemsize
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            max_sessions = max(1, min(max_sessions, int(free * memory_fraction // per_slot)))
        return cls(talker, device, dtype, max_sessions=max_sessions, capacity=capacity)

    @property
    def max_positions(self) -> int:
        return self.capacity

    # -------------------------------------------------------------- protocol

    def new_state(
        self, *, max_positions: int, params: SamplingParams, seed: int | None, trailing: Tensor, pad_vec: Tensor
    ) -> GraphState:
        if max_positions > self.capacity:
            raise QwenTTSError(f"a session needs {max_positions} positions; this backend holds {self.capacity}")
        if not self.free_slots:
            raise NoFreeSlotError(f"all {self.max_sessions} sessions are in use")
        generator = None
        if params.do_sample or params.subtalker_do_sample:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seed if seed is not None else torch.seed())
        d = self.cfg.hidden_size
        return GraphState(
            slot=self.free_slots.pop(),
            capacity=max_positions,
            params=params,
            generator=generator,
            trailing=trailing.to(self.device, self.dtype),
            pad_vec=pad_vec.to(self.device, self.dtype),
            seen=torch.zeros(self.cfg.vocab_size, dtype=torch.bool, device=self.device),
            hidden=torch.zeros(d, device=self.device, dtype=self.dtype),
            pending=torch.zeros(d, device=self.device, dtype=self.dtype),
        )

    @torch.no_grad()
    def prefill(self, state: GraphState, embeds: Tensor) -> None:
        n = embeds.shape[0]
        bucket = next((b for b in PREFILL_BUCKETS if n <= b and b <= self.capacity), None)
        if bucket is not None and bucket in self.prefills:
            self._prefill_graphed(state, embeds, bucket)
            return
        # The eager stack writes straight into this session's slot of the pool through a view.
        cache = KVCache.__new__(KVCache)
        cache.k = self.pool_k[:, state.slot]
        cache.v = self.pool_v[:, state.slot]
        cache.max_len = self.capacity
        cache.length = 0
        hidden = self.talker.model(embeds.to(self.device, self.dtype), cache)
        state.hidden.copy_(hidden[-1])
        state.position = embeds.shape[0]

    @torch.no_grad()
    def decode_frame(self, state: GraphState) -> Tensor:
        if state.released:
            raise RuntimeError("decode_frame on a released state")
        st = self.static
        first = state.frame == 0
        if first:
            st.hidden.copy_(state.hidden)
        else:
            st.x.copy_(state.pending)
            st.pos.fill_(state.position)
        st.slot.fill_(state.slot)
        st.frame.fill_(state.frame)
        st.seen.copy_(state.seen)
        t = state.frame
        st.text_vec.copy_(state.trailing[t] if t < state.trailing.shape[0] else state.pad_vec)
        p = state.params
        if p.do_sample:
            st.noise0.exponential_(1, generator=state.generator)
        if p.subtalker_do_sample:
            st.noise.exponential_(1, generator=state.generator)
        bucket = 0 if first else self._bucket(state.position + 1)
        self._run(bucket, p)
        state.pending.copy_(st.x_next)
        state.seen.copy_(st.seen)
        if not first:
            state.position += 1
        state.frame += 1
        return st.codes.clone()

    def _prefill_graphed(self, state: GraphState, embeds: Tensor, bucket: int) -> None:
        entry = self.prefills[bucket]
        n = embeds.shape[0]
        # Right padding is harmless: causal attention keeps positions < n independent of it, and
        # each later decode step overwrites its own K/V row before attending up to it.
        entry["embeds"][:n].copy_(embeds)
        entry["embeds"][n:].zero_()
        entry["last"].fill_(n - 1)
        entry["slot"].fill_(state.slot)
        if entry["graph"] is not None:
            entry["graph"].replay()
        else:  # CPU: the same body, run eagerly (tests)
            self._prefill_body(entry)
        state.hidden.copy_(entry["hidden"])
        state.position = n

    def _prefill_body(self, e: dict) -> None:
        bucket = e["embeds"].shape[0]
        cache = KVCache.__new__(KVCache)
        cache.k, cache.v = e["k"], e["v"]
        cache.max_len, cache.length = bucket, 0
        hidden = self.talker.model(e["embeds"], cache)
        e["hidden"].copy_(hidden.index_select(0, e["last"])[0])
        self.pool_k[:, :, :, :bucket].index_copy_(1, e["slot"], e["k"][:, None])
        self.pool_v[:, :, :, :bucket].index_copy_(1, e["slot"], e["v"][:, None])

    def make_prefill_entry(self, bucket: int) -> dict:
        """Static buffers of the prefill for prompts of up to `bucket` positions (no graph yet)."""
        stack = self.cfg.stack
        d = self.cfg.hidden_size
        kv_shape = (stack.num_layers, stack.num_kv_heads, bucket, stack.head_dim)
        e = {
            "embeds": torch.zeros(bucket, d, device=self.device, dtype=self.dtype),
            "last": torch.zeros(1, device=self.device, dtype=torch.long),
            "slot": torch.full((1,), self.max_sessions - 1, device=self.device, dtype=torch.long),
            "hidden": torch.zeros(d, device=self.device, dtype=self.dtype),
            "k": torch.zeros(kv_shape, device=self.device, dtype=self.dtype),
            "v": torch.zeros(kv_shape, device=self.device, dtype=self.dtype),
            "graph": None,
        }
        self.prefills[bucket] = e
        return e

    def _capture_prefill(self, bucket: int) -> dict:
        """Only at load (capture_all): the warm-up run writes into the last slot's K/V."""
        e = self.make_prefill_entry(bucket)
        # Warm-up writes zeros-derived K/V into the last slot; a session in that slot prefills
        # (overwriting it) before it decodes, so nothing reads them.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._prefill_body(e)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self.pool):
            self._prefill_body(e)
        e["graph"] = graph
        return e

    def release(self, state: GraphState) -> None:
        if state.released:
            return
        state.released = True
        self.free_slots.append(state.slot)

    # -------------------------------------------------------------- graphs

    def _bucket(self, length: int) -> int:
        for b in BUCKETS:
            if length <= b and b <= self.capacity:
                return b
        return self.capacity

    def _run(self, bucket: int, params: SamplingParams) -> None:
        if not self.use_graphs:
            self._frame(bucket, params)
            return
        key = (bucket, params)
        graph = self.graphs.get(key)
        if graph is None:
            graph = self._capture(bucket, params)
        graph.replay()

    def _capture(self, bucket: int, params: SamplingParams) -> torch.cuda.CUDAGraph:
        # Warm up on a side stream (cuBLAS handles, lazy module state), then capture. The warm-up
        # really runs the frame on the current static inputs: its K/V write is the very row the
        # replay writes next, but the static outputs and the seen set must be put back.
        st = self.static
        saved = {name: getattr(st, name).clone() for name in vars(st)}
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._frame(bucket, params)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self.pool):
            self._frame(bucket, params)
        for name, value in saved.items():
            getattr(st, name).copy_(value)
        self.graphs[(bucket, params)] = graph
        logger.debug("captured frame graph (bucket %d, %s)", bucket, "sample" if params.do_sample else "greedy")
        return graph

    def capture_all(self, params_list: list[SamplingParams]) -> None:
        """Capture every bucket for the given sampling settings (load-time warm-up)."""
        if not self.use_graphs:
            return
        for bucket in PREFILL_BUCKETS:
            if bucket <= self.capacity and bucket not in self.prefills:
                self._capture_prefill(bucket)
        for params in params_list:
            for bucket in (0, *sorted({self._bucket(b) for b in BUCKETS})):
                if (bucket, params) not in self.graphs:
                    self._capture(bucket, params)

    # -------------------------------------------------------------- the frame

    def _frame(self, bucket: int, params: SamplingParams) -> None:
        """One frame on the static buffers. bucket 0: frame 0 (no talker step, hidden given)."""
        st = self.static
        talker = self.talker
        h = st.hidden if bucket == 0 else self._talker_step(bucket)
        logits = talker.codec_head(h).float()
        logits = self._process_code0_logits(logits, params)
        if params.do_sample:
            logits = warp_logits(logits, params.temperature, params.top_k, params.top_p)
            c0 = torch.argmax(logits.softmax(-1) / st.noise0).view(1)
        else:
            c0 = torch.argmax(logits).view(1)
        st.seen.index_fill_(0, c0, True)
        codes = self._predict(h, c0, params)
        st.codes.copy_(torch.where(c0 == self.eos_id, self.eos_frame, codes))
        st.x_next.copy_(talker.embed_frames(codes[None])[0] + st.text_vec)

    def _process_code0_logits(self, logits: Tensor, params: SamplingParams) -> Tensor:
        st = self.static
        # min_new_tokens from the device frame counter: a graph cannot branch on a host int.
        eos_blocked = (st.frame < params.min_new_tokens) & self.is_eos
        logits = process_talker_logits(logits, st.seen, self.suppress, params.min_new_tokens, self.eos_id, params)
        return logits.masked_fill(eos_blocked, float("-inf"))

    def _talker_step(self, bucket: int) -> Tensor:
        st = self.static
        model = self.talker.model
        cfg = model.cfg
        x = st.x[None]
        cos = self.rope_cos.index_select(0, st.pos)
        sin = self.rope_sin.index_select(0, st.pos)
        valid = (torch.arange(bucket, device=x.device) <= st.pos)[None, None]  # [1, 1, bucket]
        slot = st.slot
        for i, layer in enumerate(model.layers):
            attn = layer.self_attn
            hn = layer.input_layernorm(x)
            q, k, v = attn.project_qkv(hn)
            q = apply_rotary(attn.q_norm(q).transpose(0, 1), cos, sin)  # [H, 1, hd]
            k = apply_rotary(attn.k_norm(k).transpose(0, 1), cos, sin)  # [KVH, 1, hd]
            heads = self.kv_heads
            idx = (slot.expand_as(heads), heads, st.pos.expand_as(heads))
            self.pool_k[i].index_put_(idx, k[:, 0])
            self.pool_v[i].index_put_(idx, v[0])
            keys = self.pool_k[i, :, :, :bucket].index_select(0, slot)[0]  # [KVH, bucket, hd]
            values = self.pool_v[i, :, :, :bucket].index_select(0, slot)[0]
            out = F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=valid, enable_gqa=True)[0]
            x = x + attn.o_proj(out.transpose(0, 1).reshape(1, cfg.num_heads * cfg.head_dim))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return model.norm(x)[0]

    def _predict(self, h: Tensor, c0: Tensor, params: SamplingParams) -> Tensor:
        st = self.static
        cp = self.talker.code_predictor
        cache = self.pred_cache
        cache.reset()
        x = torch.cat([h[None], self.talker.embed_codec(c0)])
        out = cp.model(cp.small_to_mtp_projection(x), cache)
        codes = [c0]
        code = self._sample_residual(cp.lm_head[0](out[-1]), 0, params)
        codes.append(code)
        for g in range(2, self.num_groups):
            x = cp.model.codec_embedding[g - 2](code)
            out = cp.model(cp.small_to_mtp_projection(x), cache)
            code = self._sample_residual(cp.lm_head[g - 1](out[-1]), g - 1, params)
            codes.append(code)
        return torch.cat(codes).long()

    def _sample_residual(self, logits: Tensor, i: int, params: SamplingParams) -> Tensor:
        logits = logits.float()
        if not params.subtalker_do_sample:
            return torch.argmax(logits).view(1)
        warped = warp_logits(logits, params.subtalker_temperature, params.subtalker_top_k, params.subtalker_top_p)
        return torch.argmax(warped.softmax(-1) / self.static.noise[i]).view(1)
