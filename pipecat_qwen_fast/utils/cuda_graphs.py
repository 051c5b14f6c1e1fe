"""Capturing CUDA graphs: one warm-up run on a side stream, then the capture into a shared pool."""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Callable, Iterator

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


_PLAIN_FIRST: contextvars.ContextVar[bool] = contextvars.ContextVar("qwen_fast_plain_first", default=False)


@contextlib.contextmanager
def plain_first() -> Iterator[None]:
    """Inside, graphs are captured from the plain (uncompiled) step, with no cuDNN algorithm
    timing: a capture then costs a few milliseconds instead of seconds of tracing and compiling
    (warm cache) or a minute (cold). Their owners remember them, and `compile_plain()` replaces
    them with compiled ones later (engine/warmup.py: a fast start, full speed soon after)."""
    token = _PLAIN_FIRST.set(True)
    try:
        yield
    finally:
        _PLAIN_FIRST.reset(token)


def plain_only() -> bool:
    return _PLAIN_FIRST.get()


def compile_blocker(device: torch.device, env: str) -> str | None:
    """Why `torch.compile` will not be used for a captured step here, or None; `env` set to 0
    turns it off."""
    if os.environ.get(env, "1") == "0":
        return f"{env}=0"
    if device.type != "cuda":
        return "not on CUDA"
    try:
        import triton  # noqa: F401 - inductor's CUDA code generator
    except ImportError as e:
        return f"triton is not importable ({e})"
    return None


def recompile_limit(n: int):
    """A scope in which dynamo compiles up to `n` variants of one function (one per vocoder chunk
    size and per model in the process) instead of falling back to eager after its default 8."""
    cfg = torch._dynamo.config
    key = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    return cfg.patch(**{key: max(n, getattr(cfg, key))})
