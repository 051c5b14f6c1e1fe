"""CUDA graphs for the streaming vocoder step, one per chunk size, shared by all sessions.

An eager `decode_stream` call launches ~800 small kernels and costs ~13 ms on the H200 whatever the
chunk size (bench/NOTES.md, "Vocoder"). A captured call replays them in one go. The graph works on
a static stream state: the session's state is copied in before the replay and out after it (a few
MB, two fused copies), so every session shares one graph per chunk size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .cuda_graphs import GraphCapturer
from .vocoder import Vocoder, VocoderStream

MAX_GRAPHS = 32  # chunk sizes captured at most; other sizes run eagerly


def copy_stream(dst: VocoderStream, src: VocoderStream) -> None:
    """dst <- src in one fused launch where torch offers it."""
    dsts = [*dst.histories, dst.keys, dst.values, dst.position]
    srcs = [*src.histories, src.keys, src.values, src.position]
    if hasattr(torch, "_foreach_copy_"):
        torch._foreach_copy_(dsts, srcs)
    else:  # older torch
        for d, s in zip(dsts, srcs):
            d.copy_(s)
    dst.frames = src.frames


@dataclass
class _Entry:
    codes: Tensor  # [1, Q, n]
    stream: VocoderStream
    out: Tensor | None = None
    graph: torch.cuda.CUDAGraph | None = None


class GraphedVocoder:
    def __init__(self, vocoder: Vocoder, device: torch.device, dtype: torch.dtype, use_graphs: bool | None = None):
        self.vocoder = vocoder
        self.device = device
        self.dtype = dtype
        self.use_graphs = device.type == "cuda" if use_graphs is None else use_graphs
        self.entries: dict[int, _Entry] = {}
        self.capturer = GraphCapturer(device) if self.use_graphs else None

    def decode_stream(self, codes: Tensor, stream: VocoderStream) -> Tensor:
        """Same result as `vocoder.decode_stream(codes, stream)` for batch-1 streams."""
        n = codes.shape[-1]
        entry = self.entries.get(n)
        if entry is None:
            if len(self.entries) >= MAX_GRAPHS:
                return self.vocoder.decode_stream(codes, stream, check_values=False)
            entry = self._make(n)
        copy_stream(entry.stream, stream)
        entry.codes.copy_(codes)
        if entry.graph is not None:
            entry.graph.replay()
            out = entry.out
        else:
            out = self.vocoder.decode_stream(entry.codes, entry.stream, check_values=False)
        frames = stream.frames
        copy_stream(stream, entry.stream)
        stream.frames = frames + n
        return out.clone()

    def capture(self, sizes: list[int]) -> None:
        for n in sizes:
            if n not in self.entries:
                self._make(n)

    @torch.no_grad()
    def _make(self, n: int) -> _Entry:
        voc = self.vocoder
        q = voc.cfg.num_quantizers
        entry = _Entry(
            codes=torch.zeros(1, q, n, dtype=torch.long, device=self.device),
            stream=voc.new_stream(batch=1, device=self.device, dtype=self.dtype),
        )
        if self.capturer is not None:
            entry.graph, entry.out = self.capturer.capture(
                lambda: voc.decode_stream(entry.codes, entry.stream, check_values=False)
            )
        self.entries[n] = entry
        return entry
