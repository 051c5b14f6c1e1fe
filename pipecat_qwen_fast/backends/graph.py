"""CUDA-graph backend: the torch modules' frame, batched over sessions, captured and replayed.

Eager PyTorch spends ~90 ms per frame on the H200 launching ~3000 tiny kernels (docs/journal/NOTES.md).
Here one frame for up to B sessions at once (talker step, codec head, logits processing, 15
predictor steps, next talker input) is written against static buffers, with every per-session value
read from device memory, so one captured graph per (batch bucket, attention bucket, sampling
settings) serves every session; a batch of sessions reads the weights once.

* Per-session device state lives in pools indexed by a slot id: the pending talker input, the
  prefill's last hidden state and the set of code-0 ids seen (repetition penalty). The talker's K/V
  lives in pages of `page_size` positions, `[layers, pages, kv_heads, page_size, head_dim]`; a slot's
  row of `page_table` names its pages in position order. A session reserves the pages its
  `max_positions` needs when it opens (prompt + its frame budget, which a request's `max_frames`
  bounds), so K/V memory follows what calls use rather than `capacity` per slot, a call never runs
  out of pages mid-stream, and slots are cheap (1024 by default). The graph gathers and scatters
  rows by slot. Slot `max_sessions` is a scratch row for padding; its table points at a scratch page,
  as do the entries past each session's reservation.
* Per-row scalars (slot, position, frame, first-frame flag) arrive in one host-to-device copy, the
  text vector of the step into a static buffer. Sampling draws the megakernel's inverse-CDF draw
  from its counter-based uniform of (the slot's seed, frame, code group), computed inside the
  graph for every row at once: a seeded session repeats exactly whatever else is batched with
  it, with no launch per session (each session's generator filling a vocabulary of noise cost
  two launches a session a frame, 7.5 % of the engine thread at 384 calls).
* Attention reads a fixed bucket of positions with a mask, one graph per bucket length.
* On a GPU each layer of the talker step and of every predictor pass is one `torch.compile`d
  step (`decode_layer`), compiled for every layer, batch and bucket (a few compiles at a cold load,
  ~20 s on the H200, most of it won back by graphs that capture faster than the plain ones).
  Its attention is written as products and sums over the pool rows picked by slot, which the
  compiler fuses into its loads: the K/V rows are read in place where the plain graphs gather
  each layer's bucket per row first (6.1 of 18.2 ms a round for 64 calls at 512 positions), and
  the norms, RoPE and residual adds become a few fused kernels where the plain layer launches
  ~30 (docs/journal/NOTES.md, "The batched round compiled"). `QWEN_FAST_COMPILE_BATCH=0` keeps the
  plain layers (`plain_decode_layer`, the gather and SDPA), which are also the fallback when the
  compiler fails.

On a CPU the same functions run eagerly (no capture): CI checks this backend against TorchBackend.
Over 500 lines: the pools, the captured frame and its compiled layer step share slot and bucket
bookkeeping that must change together.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from pipecat_qwen_fast.backends.base import SessionSnapshot
from pipecat_qwen_fast.backends.paged_attention import (
    paged_attention_reference,
    paged_attention_triton,
)
from pipecat_qwen_fast.backends.prefill_graphs import (
    PREFILL_BUCKETS,
    PrefillGraphs,
    prefill_layer_rows,
)
from pipecat_qwen_fast.errors import NoFreeSlotError, QwenTTSError
from pipecat_qwen_fast.model.layers import (
    DecoderLayer,
    KVCache,
    apply_rotary,
    fuse_projections,
    rotary_cos_sin,
)
from pipecat_qwen_fast.model.sampling import (
    SamplingParams,
    counter_uniform,
    sample_code0,
    sample_residual,
    seed_as_int64,
    session_seed,
    talker_suppress_mask,
)
from pipecat_qwen_fast.model.talker import Talker
from pipecat_qwen_fast.utils.cuda_graphs import GraphCapturer, compile_blocker, recompile_limit
from pipecat_qwen_fast.utils.host_copy import to_device_ints
from pipecat_qwen_fast.utils.phases import phase

logger = logging.getLogger("pipecat_qwen_fast")

ATTN_BUCKETS = (128, 256, 512, 1024, 2048, 4096, 8192)
# The batched (eager) prefill costs ~20 ms on the H200 whatever the number of calls (launch-bound);
# a captured one-by-one prefill ~3 ms a call: batching pays from ~7 calls on
# (bench/results/prefill_profile_h200_2026-11-23.json).
BATCHED_PREFILL_MIN = 8
# Fewer calls than that, opened in one round (a busy engine opens at most 4 a round), share a
# captured prefill of this many rows, for prompts within its buckets; captured in the background
# warm-up unless QWEN_FAST_ROW_PREFILL=0 (until then, and for longer prompts, one captured replay
# a call). H200, 32 live calls: 2-4 opens in 3.3-4.9 ms against 4.7-9.4 (row_prefill_ab.py,
# bench/results/2026-11-28-h200-session30/).
ROW_PREFILL_ROWS = 4
ROW_PREFILL_BUCKETS = (16, 32, 64)
# cuDNN's attention builds a plan for every new (calls, length) shape, ~70-90 ms each: every
# burst has a new shape, so the batched prefill uses the other kernels.
PREFILL_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# 64 positions: the attention buckets are whole pages, a page of the 0.6B's K/V is 7.3 MB, and a
# short reply wastes at most one page.
PAGE_SIZE = 64
# Slots are only a row of small pools (pending input, hidden state, code-0 history, seed): cheap,
# so a session is bounded by K/V pages, not slots.
MAX_SESSIONS = 1024
ROW_SLOT, ROW_STEP_SLOT, ROW_POS, ROW_FRAME, ROW_FIRST = range(5)


__all__ = ["GraphBackend", "GraphState", "NoFreeSlotError", "decode_layer", "plain_decode_layer"]


def _offset_zeros(shape: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> Tensor:
    """Zeros of `shape` starting two rows of its second dimension into a larger buffer: no layer's
    view then starts at storage offset 0 or 1, which dynamo would specialise (a second compile of
    the fused step for layer 0)."""
    row = math.prod(shape[2:])
    return torch.zeros(2 * row + math.prod(shape), device=device, dtype=dtype)[2 * row:].view(shape)


def _heads(layer: DecoderLayer, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """x [bb, D] -> q [bb, H, hd], k and v [bb, KVH, hd]: QK-norm per head, then RoPE (cos/sin
    [bb, 1, hd], each row at its own position)."""
    a = layer.self_attn
    q, k, v = a.project_qkv(layer.input_layernorm(x))
    return apply_rotary(a.q_norm(q), cos, sin), apply_rotary(a.k_norm(k), cos, sin), v


def _mlp_residual(layer: DecoderLayer, x: Tensor, attn_out: Tensor) -> Tensor:
    x = x + layer.self_attn.o_proj(attn_out)
    return x + layer.mlp(layer.post_attention_layernorm(x))


def plain_decode_layer(layer: DecoderLayer, x: Tensor, cos: Tensor, sin: Tensor, k_pool: Tensor, v_pool: Tensor,
                       pages: Tensor, wpage: Tensor, woff: Tensor, pos: Tensor, valid: Tensor,
                       kv_heads: Tensor) -> Tensor:
    """One decoder layer for one new position of each row: x [bb, D]. K/V live in pages (k_pool /
    v_pool [pages, KVH, P, hd]); row r writes its new K/V at page `wpage[r]`, offset `woff[r]`, then
    attends over its pages `pages[r]` ([bb, np], in position order) where `valid` [bb, 1, 1, np, P]
    holds. Each row's pages are gathered, then SDPA: the reference for `decode_layer`."""
    a = layer.self_attn
    bb, np_, P = x.shape[0], pages.shape[1], k_pool.shape[2]
    q, k, v = _heads(layer, x, cos, sin)
    idx = (wpage[:, None], kv_heads[None], woff[:, None])
    k_pool.index_put_(idx, k)
    v_pool.index_put_(idx, v)
    kvh, hd = k_pool.shape[1], k_pool.shape[3]
    keys = k_pool[pages].transpose(1, 2).reshape(bb, kvh, np_ * P, hd)  # [bb, KVH, attn, hd]
    values = v_pool[pages].transpose(1, 2).reshape(bb, kvh, np_ * P, hd)
    mask = valid.reshape(bb, 1, 1, np_ * P)
    out = F.scaled_dot_product_attention(q[:, :, None], keys, values, attn_mask=mask, enable_gqa=True)
    return _mlp_residual(layer, x, out.reshape(bb, a.num_heads * a.head_dim))


def mark_batch_dynamic(x: Tensor, cos: Tensor, sin: Tensor, k_pool: Tensor, v_pool: Tensor, pages: Tensor,
                       wpage: Tensor, woff: Tensor, valid: Tensor) -> None:
    """The batch, the bucket, the page size and the pool's shape symbolic in a compiled step's
    inputs: one compile serves every batch of 2 or more rows, bucket and layer, the talker's and
    (same width) the predictor's; dynamo would otherwise recompile at each new one until it
    guessed them."""
    for t in (x, cos, sin, pages, wpage, woff, valid):
        torch._dynamo.maybe_mark_dynamic(t, 0)
    torch._dynamo.maybe_mark_dynamic(pages, 1)
    torch._dynamo.maybe_mark_dynamic(valid, 3)
    torch._dynamo.maybe_mark_dynamic(valid, 4)
    for t in (k_pool, v_pool):
        torch._dynamo.maybe_mark_dynamic(t, 0)
        torch._dynamo.maybe_mark_dynamic(t, 2)


def decode_layer(layer: DecoderLayer, x: Tensor, cos: Tensor, sin: Tensor, k_pool: Tensor, v_pool: Tensor,
                 pages: Tensor, wpage: Tensor, woff: Tensor, pos: Tensor, valid: Tensor, kv_heads: Tensor) -> Tensor:
    """`plain_decode_layer`'s math with the attention as fp32 products and sums over the rows'
    pages, indexed where they lie: compiled, the indexing becomes the reductions' loads and no
    bucket is copied (eagerly it materialises, so it only pays compiled). The softmax runs over
    (page, offset) without flattening them, so no shape needs np * P == attn proven symbolically."""
    a = layer.self_attn
    bb, hd = x.shape[0], a.head_dim
    kvh = a.num_kv_heads
    rep = a.num_heads // kvh
    q, k, v = _heads(layer, x, cos, sin)
    idx = (wpage[:, None], kv_heads[None], woff[:, None])
    k_pool.index_put_(idx, k)
    v_pool.index_put_(idx, v)
    keys = k_pool[pages].transpose(1, 2).float()  # [bb, KVH, np, P, hd]
    values = v_pool[pages].transpose(1, 2).float()
    q = q.float().view(bb, kvh, rep, 1, 1, hd)
    scores = (q * keys[:, :, None]).sum(-1) * hd**-0.5  # [bb, KVH, rep, np, P]
    scores = scores.masked_fill(~valid, float("-inf"))
    e = (scores - scores.amax((-2, -1), keepdim=True)).exp()
    p = e / e.sum((-2, -1), keepdim=True)
    out = (p[..., None] * values[:, :, None]).sum((-3, -2))  # [bb, KVH, rep, hd]
    return _mlp_residual(layer, x, out.reshape(bb, a.num_heads * hd).to(x.dtype))


def _attention_inputs(layer: DecoderLayer, x: Tensor, cos: Tensor, sin: Tensor, k_pool: Tensor, v_pool: Tensor,
                      wpage: Tensor, woff: Tensor, kv_heads: Tensor) -> Tensor:
    """The layer up to its attention: q [bb, H, hd]; the new K/V written into their pages."""
    q, k, v = _heads(layer, x, cos, sin)
    idx = (wpage[:, None], kv_heads[None], woff[:, None])
    k_pool.index_put_(idx, k)
    v_pool.index_put_(idx, v)
    return q


def _layer_output(layer: DecoderLayer, x: Tensor, attn_out: Tensor) -> Tensor:
    return _mlp_residual(layer, x, attn_out.reshape(x.shape[0], -1))


class KernelLayerStep:
    """The layer as two compiled steps (norms, projections, RoPE and the K/V write; then o_proj and
    the MLP) around `paged_attention_triton`, which replaces `decode_layer`'s products and sums
    (the round's largest cost over pages: paged_attention.py). Off CUDA the reference attention
    runs instead (CPU tests: same signature and math as the other steps)."""

    def __init__(self, compiled: bool, device: torch.device):
        self.pre = torch.compile(_attention_inputs, dynamic=None) if compiled else _attention_inputs
        self.post = torch.compile(_layer_output, dynamic=None) if compiled else _layer_output
        self.attend = paged_attention_triton if device.type == "cuda" else paged_attention_reference

    def __call__(self, layer: DecoderLayer, x: Tensor, cos: Tensor, sin: Tensor, k_pool: Tensor, v_pool: Tensor,
                 pages: Tensor, wpage: Tensor, woff: Tensor, pos: Tensor, valid: Tensor, kv_heads: Tensor) -> Tensor:
        q = self.pre(layer, x, cos, sin, k_pool, v_pool, wpage, woff, kv_heads)
        return self.post(layer, x, self.attend(q.contiguous(), k_pool, v_pool, pages, pos))


@dataclass
class GraphState:
    slot: int
    params: SamplingParams
    trailing: Tensor
    pad_vec: Tensor
    position: int = 0  # positions written so far
    # trailing's rows as views, made once (set_trailing writes both): indexing a tensor per row per
    # frame cost ~4 us a row (2 ms a round at 512 rows).
    text_rows: tuple[Tensor, ...] = ()
    frame: int = 0
    released: bool = field(default=False)


class GraphBackend:
    name = "torch-cudagraph"

    def __init__(
        self,
        talker: Talker,
        device: torch.device,
        dtype: torch.dtype,
        *,
        max_sessions: int = 64,
        capacity: int = 2048,
        use_graphs: bool | None = None,
        layer_step: str | None = None,
        pages: int | None = None,
        page_size: int = PAGE_SIZE,
    ):
        """`capacity`: the most positions one session holds. `pages`: K/V pages of `page_size`
        positions shared by all sessions (None: enough for every slot at full capacity).
        `layer_step`: "kernel" (`KernelLayerStep`: compiled steps around the paged-attention
        kernel), "fused" (`decode_layer`, compiled where the compiler works) or "plain"
        (`plain_decode_layer` and the predictor's multi-position pass); None picks "kernel" where
        the compiler works, else "plain" (eagerly the fused step materialises what it indexes)."""
        if capacity % page_size or any(b % page_size for b in ATTN_BUCKETS if b <= capacity):
            raise ValueError(f"capacity {capacity} and the attention buckets must be whole pages of {page_size}")
        self.talker = talker
        self.device = device
        self.dtype = dtype
        self.cfg = talker.cfg
        stack = talker.cfg.stack
        self.eos_id = talker.cfg.codec_eos_id
        self.num_groups = talker.cfg.num_code_groups
        self.capacity = capacity
        self.max_sessions = max_sessions
        self.scratch = max_sessions  # padding rows read and write this slot
        self.use_graphs = device.type == "cuda" if use_graphs is None else use_graphs
        if device.type == "cuda":
            fuse_projections(talker)
        slots = max_sessions + 1
        d, v = talker.cfg.hidden_size, talker.cfg.vocab_size
        self.page_size = page_size
        self.pages_per_slot = capacity // page_size
        self.num_pages = max_sessions * self.pages_per_slot if pages is None else pages
        if self.num_pages < self.pages_per_slot:
            raise ValueError(f"{self.num_pages} K/V pages cannot hold one session of {capacity} positions")
        self.scratch_page = self.num_pages  # padding rows and unreserved table entries point here
        shape = (stack.num_layers, self.num_pages + 1, stack.num_kv_heads, page_size, stack.head_dim)
        self.pool_k = _offset_zeros(shape, device, dtype)
        self.pool_v = _offset_zeros(shape, device, dtype)
        self.page_table = torch.full((slots, self.pages_per_slot), self.scratch_page, device=device, dtype=torch.long)
        self.free_pages = list(range(self.num_pages - 1, -1, -1))
        self.slot_pages: dict[int, list[int]] = {}
        self.pool_pending = torch.zeros(slots, d, device=device, dtype=dtype)
        self.pool_hidden = torch.zeros(slots, d, device=device, dtype=dtype)
        self.pool_seen = torch.zeros(slots, v, device=device, dtype=torch.bool)
        self.free_slots = list(range(max_sessions - 1, -1, -1))
        self.batched_prefills = 0  # prefill_many passes run since load (tests read it)
        self.row_prefill_passes = 0  # captured prefills of several calls run since load
        self.batched_prefill_min = BATCHED_PREFILL_MIN

        self.max_batch = next((b for b in BATCH_BUCKETS if b >= max_sessions), BATCH_BUCKETS[-1])
        b = self.max_batch
        pred = talker.code_predictor.cfg
        pv = pred.vocab_size
        self.rows = torch.zeros(5, b, device=device, dtype=torch.long)
        self.rows_host = torch.zeros(5, b, dtype=torch.long, pin_memory=device.type == "cuda")
        # Recorded behind each frame's copy out of rows_host (see _writable_rows_host).
        self.rows_copied = torch.cuda.Event() if device.type == "cuda" else None
        self.text_vec = torch.zeros(b, d, device=device, dtype=dtype)
        self.pool_seed = torch.zeros(slots, device=device, dtype=torch.long)  # counter_uniform's seeds
        self.groups = torch.arange(self.num_groups, device=device)
        self.codes = torch.zeros(b, self.num_groups, device=device, dtype=torch.long)
        # Teacher forcing (fidelity tests): the codes fed back instead of the rows' own, and what a
        # forced frame keeps of each row's hidden states (talker; predictor passes 1-15) to compare.
        self.forced_codes = torch.zeros(b, self.num_groups, device=device, dtype=torch.long)
        self.forced_hidden = torch.zeros(b, d, device=device, dtype=dtype)
        ps = pred.stack
        self.forced_pred_hidden = torch.zeros(b, self.num_groups - 1, ps.hidden_size, device=device, dtype=dtype)
        pred_shape = (ps.num_layers, b, ps.num_kv_heads, pred.num_code_groups, ps.head_dim)
        self.pred_k = _offset_zeros(pred_shape, device, dtype)
        self.pred_v = _offset_zeros(pred_shape, device, dtype)

        # Constants made before any capture: a capture may not copy host values to the device.
        self.suppress = talker_suppress_mask(v, self.eos_id, device)
        self.eos_frame = torch.zeros(self.num_groups, dtype=torch.long, device=device)
        self.eos_frame[0] = self.eos_id
        self.rope_cos, self.rope_sin = rotary_cos_sin(
            torch.arange(capacity, device=device), stack.head_dim, stack.rope_theta, dtype
        )
        self.pred_cos, self.pred_sin = rotary_cos_sin(
            torch.arange(pred.num_code_groups, device=device), ps.head_dim, ps.rope_theta, dtype
        )
        self.kv_heads = torch.arange(stack.num_kv_heads, device=device)
        self.page_positions = torch.arange(capacity, device=device).view(self.pages_per_slot, page_size)
        # Per-layer views made once, and the predictor's per-position inputs for the fused step:
        # a compiled step sees the same inputs every frame, so it never recompiles after warm-up.
        self.talker_kv = [(self.pool_k[i], self.pool_v[i]) for i in range(stack.num_layers)]
        self.pred_kv = [(self.pred_k[i], self.pred_v[i]) for i in range(ps.num_layers)]
        # The predictor's inputs to the fused step per (batch bucket, position), made once as
        # tensors of their own: slices or views of one table would differ in their bases' shapes
        # from the talker's inputs, and dynamo would compile a variant for each (docs/journal/NOTES.md).
        self.pred_inputs: dict[tuple[int, int], tuple[Tensor, ...]] = {}
        groups = pred.num_code_groups
        rows = torch.arange(b, device=device)
        for bb in BATCH_BUCKETS:
            if bb > b:
                break
            for g in range(groups):
                # Row r's predictor K/V is one page of `groups` positions: pred_k[layer, r].
                self.pred_inputs[bb, g] = (
                    self.pred_cos[g].expand(bb, 1, ps.head_dim).clone(),
                    self.pred_sin[g].expand(bb, 1, ps.head_dim).clone(),
                    rows[:bb, None].clone(),
                    rows[:bb].clone(),
                    torch.full((bb,), g, device=device, dtype=torch.long),
                    (torch.arange(groups, device=device) <= g).expand(bb, 1, 1, 1, groups).clone(),
                )
        self.kv_heads_pred = torch.arange(ps.num_kv_heads, device=device)

        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.capturer = GraphCapturer(device) if self.use_graphs else None
        self._choose_layer_step(layer_step)
        # Captured prefill per prompt-length bucket; its K/V rows are copied into the session's slot.
        self.prefills = PrefillGraphs(talker, device, dtype, tuple(b for b in PREFILL_BUCKETS if b <= capacity),
                                      use_graphs=self.use_graphs)
        # The same, for up to ROW_PREFILL_ROWS calls at once (prefill_many); captured later.
        self.row_prefills = PrefillGraphs(talker, device, dtype, tuple(b for b in ROW_PREFILL_BUCKETS if b <= capacity),
                                          use_graphs=self.use_graphs, step=prefill_layer_rows, rows=ROW_PREFILL_ROWS)

    def _choose_layer_step(self, kind: str | None) -> None:
        if kind not in (None, "kernel", "fused", "plain"):
            raise ValueError(f"layer_step must be 'kernel', 'fused', 'plain' or None; got {kind!r}")
        reason = compile_blocker(self.device, "QWEN_FAST_COMPILE_BATCH") if self.use_graphs else "no CUDA graphs"
        if kind is None:
            kind = "kernel" if reason is None else "plain"
            if reason is not None and self.use_graphs:
                logger.info("the batched frame's layers are not compiled: %s", reason)
        self.layer_step = kind
        self.compiled = kind in ("kernel", "fused") and reason is None
        self._step = plain_decode_layer
        if kind == "fused":
            self._step = torch.compile(decode_layer, dynamic=None) if self.compiled else decode_layer
        elif kind == "kernel":
            self._step = KernelLayerStep(self.compiled, self.device)
        if self.graphs:  # captured from the previous step's code: dropped, and their memory pool
            self.graphs.clear()  # with them (a pool whose graphs are all gone cannot take a capture)
            self.capturer = GraphCapturer(self.device)

    @classmethod
    def for_device(cls, talker: Talker, device: torch.device, dtype: torch.dtype, capacity: int = 2048,
                   max_sessions: int = MAX_SESSIONS, memory_fraction: float = 0.4) -> GraphBackend:
        """K/V pages filling `memory_fraction` of the GPU memory still free (at least one session at
        full capacity; on a CPU, every slot at full capacity)."""
        pages = None
        if device.type == "cuda":
            stack = talker.cfg.stack
            per_page = 2 * stack.num_layers * stack.num_kv_heads * PAGE_SIZE * stack.head_dim * dtype.itemsize
            free, _ = torch.cuda.mem_get_info(device)
            pages = max(capacity // PAGE_SIZE, int(free * memory_fraction // per_page) - 1)
            pages = min(pages, max_sessions * (capacity // PAGE_SIZE))
        return cls(talker, device, dtype, max_sessions=max_sessions, capacity=capacity, pages=pages)

    def pages_needed(self, max_positions: int) -> int:
        return -(-max_positions // self.page_size)

    @property
    def free_positions(self) -> int:
        """Positions the free pages hold: what sessions opened now can still reserve."""
        return len(self.free_pages) * self.page_size

    @property
    def max_positions(self) -> int:
        return self.capacity

    @property
    def batch_buckets(self) -> tuple[int, ...]:
        return tuple(b for b in BATCH_BUCKETS if b <= self.max_batch)

    # -------------------------------------------------------------- protocol

    def new_state(
        self, *, max_positions: int, params: SamplingParams, seed: int | None, trailing: Tensor, pad_vec: Tensor
    ) -> GraphState:
        if max_positions > self.capacity:
            raise QwenTTSError(f"a session needs {max_positions} positions; this backend holds {self.capacity}")
        if not self.free_slots:
            raise NoFreeSlotError(f"all {self.max_sessions} sessions are in use")
        need = self.pages_needed(max_positions)
        if need > len(self.free_pages):
            raise NoFreeSlotError(f"the K/V pool has {len(self.free_pages)} pages free; a session of "
                                  f"{max_positions} positions needs {need}")
        seed = session_seed(seed)
        slot = self.free_slots.pop()
        pages = [self.free_pages.pop() for _ in range(need)]
        self.slot_pages[slot] = pages
        row = pages + [self.scratch_page] * (self.pages_per_slot - need)
        # Stream-ordered behind any frame still queued for the slot's or the pages' last owner,
        # and queued without the host waiting for them (from a pageable row CUDA syncs first).
        self.page_table[slot].copy_(to_device_ints(row, self.device))
        self.pool_seen[slot].zero_()
        self.pool_seed[slot].fill_(seed_as_int64(seed))
        state = GraphState(slot=slot, params=params, trailing=trailing, pad_vec=pad_vec.to(self.device, self.dtype))
        self.set_trailing(state, trailing)
        return state

    @torch.no_grad()
    def prefill(self, state: GraphState, embeds: Tensor) -> None:
        embeds = embeds.to(self.device, self.dtype)
        n = embeds.shape[0]
        captured = self.prefills.run(embeds)
        if captured is not None:
            k, v, hidden = captured
            self.pool_hidden[state.slot].copy_(hidden)
        else:
            # Longer prompts: the eager stack into a cache of their own, then into the pages.
            cache = KVCache(self.talker.cfg.stack, n, self.device, self.dtype)
            self.pool_hidden[state.slot].copy_(self.talker.model(embeds, cache)[-1])
            k, v = cache.k, cache.v
        self._write_positions(state.slot, k, v, n)
        state.position = n

    def read_positions(self, slot: int, n: int) -> tuple[Tensor, Tensor]:
        """The slot's K and V of positions 0..n-1: [layers, KVH, n, hd] each (copies; tests, moves)."""
        idx = self.page_table[slot, : self.pages_needed(n)]
        return tuple(pool.index_select(1, idx).transpose(1, 2).flatten(2, 3)[:, :, :n] for pool in (self.pool_k, self.pool_v))

    def _write_positions(self, slot: int, k: Tensor, v: Tensor, n: int) -> None:
        """Positions 0..n-1 of k / v [layers, KVH, >= n, hd] into the slot's pages: the whole pages
        in one indexed copy each for K and V, the partial last page in one more. Any dtype: the
        megakernel's snapshots hold fp32 K/V (index_copy_ converts nothing)."""
        P = self.page_size
        full, tail = divmod(n, P)
        if full:
            idx = self.page_table[slot, :full]
            for pool, src in ((self.pool_k, k), (self.pool_v, v)):
                pool.index_copy_(1, idx, src[:, :, : full * P].unflatten(2, (full, P)).transpose(1, 2).to(pool.dtype))
        if tail:
            page = self.slot_pages[slot][full]
            self.pool_k[:, page, :, :tail].copy_(k[:, :, full * P : n])
            self.pool_v[:, page, :, :tail].copy_(v[:, :, full * P : n])

    @torch.no_grad()
    def prefill_many(self, states: list[GraphState], embeds: list[Tensor]) -> None:
        """Several prompts in one batched pass, written straight into their slots: a burst of calls
        pays one launch-bound eager prefill (~20 ms on the H200), not one captured replay each (fewer than
        `batched_prefill_min` calls: captured replays, each of up to ROW_PREFILL_ROWS calls where
        their prompts fit `row_prefills`, else one a call). Prompts are
        right-padded to the longest; causal attention keeps the padding out of every real position,
        and the padding's K/V rows lie beyond each session's position, masked until overwritten."""
        if len(states) < self.batched_prefill_min:
            pairs = list(zip(states, embeds))
            rows = self.row_prefills.rows if self.row_prefills.entries else 1  # none captured: one a call
            for i in range(0, len(pairs), rows):
                group = pairs[i : i + rows]
                if len(group) == 1 or not self._prefill_rows(group):
                    for s, e in group:
                        self.prefill(s, e)
            return
        lengths = [e.shape[0] for e in embeds]
        longest = max(lengths)
        if longest > self.capacity:
            raise QwenTTSError(f"a prompt of {longest} positions does not fit this backend's {self.capacity}")
        x = torch.zeros(len(states), longest, self.cfg.hidden_size, device=self.device, dtype=self.dtype)
        for i, e in enumerate(embeds):
            x[i, : e.shape[0]].copy_(e)
        slots = to_device_ints([s.slot for s in states], self.device)
        with sdpa_kernel(PREFILL_ATTENTION):
            hidden = self._prefill_forward(x, self.page_table.index_select(0, slots))
        last = to_device_ints([n - 1 for n in lengths], self.device)
        self.pool_hidden.index_copy_(0, slots, hidden[torch.arange(len(states), device=self.device), last])
        for s, n in zip(states, lengths):
            s.position = n
        self.batched_prefills += 1

    def _prefill_rows(self, group: list[tuple[GraphState, Tensor]]) -> bool:
        """Up to ROW_PREFILL_ROWS prompts in one captured prefill, each row's K/V into its slot's
        pages; False (nothing written) when no captured bucket fits the longest."""
        embeds = [e.to(self.device, self.dtype) for _, e in group]
        out = self.row_prefills.run_rows(embeds)
        if out is None:
            return False
        k, v, hidden = out
        for i, ((state, _), e) in enumerate(zip(group, embeds)):
            n = e.shape[0]
            self.pool_hidden[state.slot].copy_(hidden[i])
            self._write_positions(state.slot, k[:, i], v[:, i], n)
            state.position = n
        self.row_prefill_passes += 1
        return True

    def capture_row_prefills(self, force: bool = False) -> None:
        """The row prefills' graphs (background warm-up: a compile and a capture a bucket), where
        `QWEN_FAST_ROW_PREFILL` is not 0, or `force` (the probe's A/B); else one replay a call.
        A failed capture leaves none: an entry without its graph would run the eager layers, far
        slower than one replay a call."""
        if not self.use_graphs or not (force or os.environ.get("QWEN_FAST_ROW_PREFILL", "1") != "0"):
            return
        try:
            self.row_prefills.capture_all()
        except BaseException:
            self.row_prefills.entries.clear()
            raise

    def prepare_thread(self, params: SamplingParams) -> None:
        """One batched prefill in the calling thread: its kernels' first use costs ~10-170 ms, and
        the first eager pass in a new thread ~45 ms more (docs/journal/NOTES.md, "Calls opened together")."""
        n = min(self.batched_prefill_min, len(self.free_slots))
        if n < 2:
            return
        d = self.cfg.hidden_size
        zeros = torch.zeros(1, d, device=self.device, dtype=self.dtype)
        states = [self.new_state(max_positions=16, params=params, seed=0, trailing=zeros, pad_vec=zeros[0])
                  for _ in range(n)]
        try:
            self.prefill_many(states, [torch.zeros(8 + i, d, device=self.device, dtype=self.dtype) for i in range(n)])
        finally:
            for s in states:
                self.release(s)

    def _prefill_forward(self, x: Tensor, tables: Tensor) -> Tensor:
        """Talker positions 0..L-1 of rows x [B, L, D] into the pages of `tables` [B, pages_per_slot]
        (positions past a row's reservation land in the scratch page): post-norm [B, L, D]."""
        model = self.talker.model
        B, L = x.shape[:2]
        P = self.page_size
        np_ = -(-L // P)
        dest = tables[:, :np_].reshape(-1)  # [B * np]
        cos, sin = self.rope_cos[:L], self.rope_sin[:L]  # [L, hd]
        for i, layer in enumerate(model.layers):
            a = layer.self_attn
            q, k, v = a.project_qkv(layer.input_layernorm(x))  # [B, L, heads, hd]
            q = apply_rotary(a.q_norm(q).transpose(1, 2), cos, sin)  # [B, H, L, hd]
            k = apply_rotary(a.k_norm(k).transpose(1, 2), cos, sin)
            v = v.transpose(1, 2)
            for pool, src in ((self.pool_k[i], k), (self.pool_v[i], v)):
                paged = F.pad(src, (0, 0, 0, np_ * P - L)).unflatten(2, (np_, P)).transpose(1, 2)
                pool.index_copy_(0, dest, paged.reshape(B * np_, *paged.shape[2:]))
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + a.o_proj(out.transpose(1, 2).reshape(B, L, a.num_heads * a.head_dim))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return model.norm(x)

    @torch.no_grad()
    def adopt_state(self, snap: SessionSnapshot) -> GraphState:
        """A session started elsewhere (SessionSnapshot), continued in this batch from its next frame."""
        n = snap.k.shape[2]
        if n + 1 > self.capacity:
            raise QwenTTSError(f"a session at position {n} does not fit this backend's {self.capacity} positions")
        # The pages its whole budget needs, as it had reserved where it started.
        need = min(self.capacity, max(n + 1, snap.max_positions or self.capacity))
        state = self.new_state(max_positions=need, params=snap.params, seed=snap.seed, trailing=snap.trailing,
                               pad_vec=snap.pad_vec)
        slot = state.slot
        self._write_positions(slot, snap.k, snap.v, n)
        self.pool_hidden[slot].copy_(snap.hidden)
        self.pool_pending[slot].copy_(snap.pending)
        self.pool_seen[slot].copy_(snap.seen)
        state.position, state.frame = n, snap.frame
        return state

    def decode_frame(self, state: GraphState) -> Tensor:
        return self.decode_frames([state])[0]

    @torch.no_grad()
    def decode_frames(self, states: list[GraphState], force: Tensor | None = None) -> Tensor:
        """One frame for each state (same sampling settings) -> LongTensor [n, 16] on the device.
        `force` (LongTensor [n, 16] on the device) teacher-forces the fed-back codes: each row's
        predictor passes, code-0 history and next talker input take them, while the codes returned
        are still the rows' own; the frame also keeps the rows' hidden states in `forced_hidden`
        and `forced_pred_hidden` until the next frame. Forced frames have graphs of their own, so
        the unforced ones are unchanged."""
        n = len(states)
        params = states[0].params
        if any(s.params != params for s in states):
            raise ValueError("decode_frames needs states with the same sampling settings")
        if any(s.released for s in states):
            raise RuntimeError("decode_frames on a released state")
        bb = next(b for b in BATCH_BUCKETS if b >= n)
        if bb > self.max_batch:
            raise ValueError(f"at most {self.max_batch} sessions per batch")
        # The rows' scalars built in numpy and copied into the pinned buffer at once: item
        # assignments into a tensor cost ~2 us each, five per row (~5 ms a round at 512 rows).
        table = np.zeros((5, bb), dtype=np.int64)
        table[ROW_SLOT] = table[ROW_STEP_SLOT] = self.scratch
        table[ROW_FIRST] = 1
        slots = [s.slot for s in states]
        frames = [s.frame for s in states]
        first = [f == 0 for f in frames]
        table[ROW_SLOT, :n] = slots
        table[ROW_STEP_SLOT, :n] = [self.scratch if f else sl for f, sl in zip(first, slots)]
        table[ROW_POS, :n] = [0 if f else s.position for f, s in zip(first, states)]
        table[ROW_FRAME, :n] = frames
        table[ROW_FIRST, :n] = first
        longest = max((s.position + 1 for f, s in zip(first, states) if not f), default=0)
        text = [s.text_rows[s.frame] if s.frame < len(s.text_rows) else s.pad_vec for s in states]
        rows = self._writable_rows_host()
        rows[:, :bb].copy_(torch.from_numpy(table))
        self.rows[:, :bb].copy_(rows[:, :bb], non_blocking=True)
        if self.rows_copied is not None:
            self.rows_copied.record(torch.cuda.current_stream(self.device))
        self.text_vec[:n].copy_(torch.stack(text))
        if force is not None:
            self.forced_codes[:n].copy_(force)
        attn = 0 if longest == 0 else self._attn_bucket(longest)
        self._run(bb, attn, params, force is not None)
        for s in states:
            if s.frame > 0:
                s.position += 1
            s.frame += 1
        return self.codes[:n].clone()

    def _writable_rows_host(self) -> Tensor:
        """rows_host once the GPU has read the last frame's rows out of it. At the largest batch
        bucket the slice copied is the whole pinned buffer, a true asynchronous DMA that reads it
        when the stream gets there (a smaller bucket's slice is strided, and torch stages it
        through a pageable copy at once). A caller that reads nothing back between frames (the
        fidelity test) queues frames ahead of the GPU; without the wait a queued frame would read
        a later frame's positions, past its own attention bucket: an out-of-bounds page gather,
        the 512-row device assert. The engine reads every round's codes back, so there the wait
        finds the copy done."""
        if self.rows_copied is not None:
            self.rows_copied.synchronize()
        return self.rows_host

    def set_trailing(self, state: GraphState, trailing: Tensor) -> None:
        """Replace the text vectors the state's frames add (streamed text grows them as it
        arrives); frame t reads row t when it runs, so only rows of frames not yet run may change."""
        state.trailing = trailing.to(self.device, self.dtype)
        state.text_rows = state.trailing.unbind(0)

    def release(self, state: GraphState) -> None:
        if state.released:
            return
        state.released = True
        self.free_slots.append(state.slot)
        self.free_pages += self.slot_pages.pop(state.slot)

    # -------------------------------------------------------------- graphs

    def _attn_bucket(self, length: int) -> int:
        return next((b for b in ATTN_BUCKETS if length <= b <= self.capacity), self.capacity)

    def _run(self, bb: int, attn: int, params: SamplingParams, forced: bool = False) -> None:
        if not self.use_graphs:
            self._frame(bb, attn, params, forced)
            return
        key = (bb, attn, params, True) if forced else (bb, attn, params)
        graph = self.graphs.get(key)
        if graph is None:
            graph = self._capture(bb, attn, params, forced)
        graph.replay()

    @torch.no_grad()
    def _capture(self, bb: int, attn: int, params: SamplingParams, forced: bool = False) -> torch.cuda.CUDAGraph:
        # The capturer's warm-up really runs the frame on the current inputs: its K/V writes are
        # the rows the replay writes next, but the per-session pools it updates must be put back.
        # That warm-up is also where the fused step compiles (never inside the capture: the
        # capture runs the same shapes right after it).
        saved = [t.clone() for t in (self.pool_pending, self.pool_seen, self.codes)]
        try:
            with recompile_limit(64):
                graph, _ = self.capturer.capture(lambda: self._frame(bb, attn, params, forced))
        except Exception as e:  # a compiler failure: the plain layers still work
            if not self.compiled:
                raise
            logger.warning("compiling the batched frame's layer step failed (%s: %s); using plain graphs",
                           type(e).__name__, str(e)[:300])
            self._choose_layer_step("plain")
            graph, _ = self.capturer.capture(lambda: self._frame(bb, attn, params, forced))
        finally:
            for dst, src in zip((self.pool_pending, self.pool_seen, self.codes), saved):
                dst.copy_(src)
        self.graphs[(bb, attn, params, True) if forced else (bb, attn, params)] = graph
        return graph

    @torch.no_grad()
    def capture_all(self, params_list: list[SamplingParams], batches: tuple[int, ...] | None = None) -> None:
        """Capture prefills and frames (every attention bucket; the given batch buckets) at load."""
        if not self.use_graphs:
            return
        with phase("capturing the prefill graphs"):
            self.prefills.capture_all()
        batches = batches or self.batch_buckets
        attn = (0, *sorted({self._attn_bucket(b) for b in ATTN_BUCKETS}))
        rows = self._writable_rows_host()
        for params in params_list:
            for bb in batches:
                rows.zero_()
                rows[ROW_SLOT].fill_(self.scratch)
                rows[ROW_STEP_SLOT].fill_(self.scratch)
                self.rows.copy_(rows)
                for a in attn:
                    if (bb, a, params) not in self.graphs:
                        self._capture(bb, a, params)

    # -------------------------------------------------------------- the frame

    def _frame(self, bb: int, attn: int, params: SamplingParams, forced: bool = False) -> None:
        """One frame for rows [0, bb). attn 0: every row is at frame 0 (no talker step). `forced`:
        the rows are fed `forced_codes` (decode_frames' `force`)."""
        talker = self.talker
        slot = self.rows[ROW_SLOT, :bb]
        first = (self.rows[ROW_FIRST, :bb] == 1)[:, None]
        hidden = self.pool_hidden.index_select(0, slot)
        h = hidden if attn == 0 else torch.where(first, hidden, self._talker_step(bb, attn))
        if forced:
            self.forced_hidden[:bb].copy_(h)
        seen = self.pool_seen.index_select(0, slot)
        frame = self.rows[ROW_FRAME, :bb]
        u = None  # [bb, 16]: code g's uniform in column g
        if params.do_sample or params.subtalker_do_sample:
            u = counter_uniform(self.pool_seed.index_select(0, slot)[:, None], frame[:, None], self.groups)
        c0 = sample_code0(talker.codec_head(h), seen, self.suppress, frame, self.eos_id, params,
                          None if u is None else u[:, 0])
        fed0 = self._fed(c0, 0, bb, forced)
        self.pool_seen.index_copy_(0, slot, seen.scatter(1, fed0[:, None], True))
        codes = self._predict(h, c0, bb, params, u, forced)
        self.codes[:bb].copy_(torch.where((c0 == self.eos_id)[:, None], self.eos_frame, codes))
        fed = self.forced_codes[:bb] if forced else codes
        self.pool_pending.index_copy_(0, slot, talker.embed_frames(fed) + self.text_vec[:bb])

    def _fed(self, code: Tensor, group: int, bb: int, forced: bool) -> Tensor:
        """The code of `group` that rows [0, bb) feed back: their own, or on a forced frame the teacher's."""
        return self.forced_codes[:bb, group] if forced else code

    def _talker_step(self, bb: int, attn: int) -> Tensor:
        model = self.talker.model
        slot = self.rows[ROW_STEP_SLOT, :bb]
        pos = self.rows[ROW_POS, :bb]
        x = self.pool_pending.index_select(0, self.rows[ROW_SLOT, :bb])
        # Tensors of their own, not views (see pred_inputs): [bb, 1, hd], [bb, np] and [bb, 1, 1, np, P].
        cos = self.rope_cos[:, None].index_select(0, pos)
        sin = self.rope_sin[:, None].index_select(0, pos)
        P = self.page_size
        pages = self.page_table.index_select(0, slot)[:, : attn // P].contiguous()
        wpage = pages.gather(1, (pos // P)[:, None])[:, 0]
        woff = pos % P
        valid = self.page_positions[: attn // P][None, None, None] <= pos[:, None, None, None, None]
        for layer, (k_pool, v_pool) in zip(model.layers, self.talker_kv):
            if self.compiled:
                mark_batch_dynamic(x, cos, sin, k_pool, v_pool, pages, wpage, woff, valid)
            x = self._step(layer, x, cos, sin, k_pool, v_pool, pages, wpage, woff, pos, valid, self.kv_heads)
        return model.norm(x)

    def _predict(self, h: Tensor, c0: Tensor, bb: int, params: SamplingParams, u: Tensor | None,
                 forced: bool = False) -> Tensor:
        """Codes 1-15 for rows [0, bb); `u` [bb, 16] the rows' uniforms (sampling) or None;
        `forced`: each pass is fed the teacher's code (see `_frame`)."""
        cp = self.talker.code_predictor
        proj = cp.small_to_mtp_projection
        fed0 = self._fed(c0, 0, bb, forced)
        if self.layer_step == "plain":
            x = torch.stack([h, self.talker.embed_codec(fed0)], dim=1)  # [bb, 2, D]
            out = self._predictor_forward(proj(x), 0, bb)[:, -1]
        else:  # the fused step takes one position at a time
            self._predictor_position(proj(h), 0, bb)
            out = self._predictor_position(proj(self.talker.embed_codec(fed0)), 1, bb)
        code = sample_residual(cp.lm_head[0](out), params, None if u is None else u[:, 1])
        codes = [c0, code]
        for g in range(2, self.num_groups):
            if forced:
                self.forced_pred_hidden[:bb, g - 2].copy_(out)
            e = cp.model.codec_embedding[g - 2](self._fed(code, g - 1, bb, forced))
            if self.layer_step == "plain":
                out = self._predictor_forward(proj(e[:, None]), g, bb)[:, -1]
            else:
                out = self._predictor_position(proj(e), g, bb)
            code = sample_residual(cp.lm_head[g - 1](out), params, None if u is None else u[:, g])
            codes.append(code)
        if forced:
            self.forced_pred_hidden[:bb, -1].copy_(out)
        return torch.stack(codes, dim=1).long()

    def _predictor_position(self, x: Tensor, g: int, bb: int) -> Tensor:
        """Predictor position g for rows [0, bb) through the fused step: x [bb, Dp] -> post-norm
        [bb, Dp]. Its inputs have the same shapes at every position, so it compiles once for all."""
        model = self.talker.code_predictor.model
        cos, sin, pages, wpage, woff, valid = self.pred_inputs[bb, g]
        for layer, (k_pool, v_pool) in zip(model.layers, self.pred_kv):
            if self.compiled:
                mark_batch_dynamic(x, cos, sin, k_pool, v_pool, pages, wpage, woff, valid)
            x = self._step(layer, x, cos, sin, k_pool, v_pool, pages, wpage, woff, woff, valid, self.kv_heads_pred)
        return model.norm(x)

    def _predictor_forward(self, x: Tensor, start: int, bb: int) -> Tensor:
        """Predictor positions start..start+n-1 for rows [0, bb): x [bb, n, Dp] -> post-norm [bb, n, Dp]."""
        model = self.talker.code_predictor.model
        n = x.shape[1]
        end = start + n
        cos, sin = self.pred_cos[start:end], self.pred_sin[start:end]  # [n, hd]
        for i, layer in enumerate(model.layers):
            a = layer.self_attn
            q, k, v = a.project_qkv(layer.input_layernorm(x))  # [bb, n, heads, hd]
            q = apply_rotary(a.q_norm(q).transpose(1, 2), cos, sin)  # [bb, H, n, hd]
            k = apply_rotary(a.k_norm(k).transpose(1, 2), cos, sin)
            self.pred_k[i, :bb, :, start:end] = k
            self.pred_v[i, :bb, :, start:end] = v.transpose(1, 2)
            keys, values = self.pred_k[i, :bb, :, :end], self.pred_v[i, :bb, :, :end]
            out = F.scaled_dot_product_attention(q, keys, values, is_causal=n > 1, enable_gqa=True)
            x = x + a.o_proj(out.transpose(1, 2).reshape(bb, n, a.num_heads * a.head_dim))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return model.norm(x)
