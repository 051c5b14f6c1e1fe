"""CUDA-event timing shared by the bench scripts."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def event_times_ms(fn: Callable[[], object], iters: int, sync_each: bool = False) -> list[float]:
    """Device time of each of `iters` calls of `fn` in ms, from CUDA events recorded around it.

    Calls run back to back and are read after the last one, unless `sync_each`: then each call
    starts on an idle GPU, so its time includes the host's launch latency (what a streaming caller
    that waits for every chunk sees).
    """
    evs = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        if sync_each:
            e.synchronize()
        evs.append((s, e))
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in evs]


def host_launch_us(fn: Callable[[], object], iters: int) -> float:
    """Median host time of one call of `fn` in us, each started on an idle GPU: what launching
    it costs the host when nothing queued ahead makes it wait."""
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6
