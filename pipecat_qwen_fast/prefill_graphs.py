"""The talker prefill captured as CUDA graphs, one per prompt-length bucket.

An eager prefill launches ~30 kernels per layer from Python and pays a per-shape cost on every new
prompt length (the benchmark measured ~40 ms more for a length not seen before). A captured prefill
runs a right-padded prompt of the bucket's length: causal attention keeps the real positions
independent of the padding, and the caller copies the K/V rows of the real positions into its own
cache (the megakernel's per-session cache, the CUDA-graph backend's slot pool).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .cuda_graphs import GraphCapturer
from .layers import KVCache
from .talker import Talker

PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512)


class PrefillGraphs:
    def __init__(self, talker: Talker, device: torch.device, dtype: torch.dtype, buckets=PREFILL_BUCKETS,
                 use_graphs: bool | None = None):
        self.talker = talker
        self.device = device
        self.dtype = dtype
        self.buckets = tuple(buckets)
        self.use_graphs = device.type == "cuda" if use_graphs is None else use_graphs
        self.entries: dict[int, dict] = {}
        self.capturer = GraphCapturer(device) if self.use_graphs else None

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
            "last": torch.zeros(1, device=self.device, dtype=torch.long),
            "hidden": torch.zeros(self.talker.cfg.hidden_size, device=self.device, dtype=self.dtype),
            "k": torch.zeros(kv_shape, device=self.device, dtype=self.dtype),
            "v": torch.zeros(kv_shape, device=self.device, dtype=self.dtype),
            "graph": None,
        }
        self.entries[bucket] = e
        return e

    @torch.no_grad()
    def capture_all(self) -> None:
        for bucket in self.buckets:
            if bucket not in self.entries:
                self._capture(bucket)

    def _body(self, e: dict) -> None:
        hidden = self.talker.model(e["embeds"], KVCache.over(e["k"], e["v"]))
        e["hidden"].copy_(hidden.index_select(0, e["last"])[0])

    def _capture(self, bucket: int) -> dict:
        e = self.prepare(bucket)
        if self.capturer is not None:
            e["graph"], _ = self.capturer.capture(lambda: self._body(e))
        return e
