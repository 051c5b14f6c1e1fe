"""CUDA-event timing shared by the bench scripts."""

from __future__ import annotations

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
