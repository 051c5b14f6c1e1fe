"""Capturing CUDA graphs: one warm-up run on a side stream, then the capture into a shared pool."""

from __future__ import annotations

from collections.abc import Callable

import torch


class GraphCapturer:
    """Captures graphs for one owner (a backend, the vocoder) into one memory pool."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pool = None
        # One warm-up stream for every capture: the allocator's cache for a stream serves only that
        # stream, so a new stream per capture kept ~1 GB each (OOM after ~80 captures on the H200).
        self.side: torch.cuda.Stream | None = None

    @torch.no_grad()
    def capture(self, fn: Callable[[], object]) -> tuple[torch.cuda.CUDAGraph, object]:
        """Run `fn` once for real (cuBLAS workspaces, lazy state), then capture it.

        Returns the graph and what `fn` returned during the capture (tensors living in the pool,
        rewritten by every replay).
        """
        if self.side is None:
            self.side = torch.cuda.Stream(self.device)
        current = torch.cuda.current_stream(self.device)
        self.side.wait_stream(current)
        with torch.cuda.stream(self.side):
            fn()
        current.wait_stream(self.side)
        graph = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        return graph, out
