"""CPU time by thread: how much of a thread's wall time was its own work, not waiting (for the
GPU, a socket or the GIL)."""

from __future__ import annotations

import threading
import time


def thread_cpu_seconds(threads: dict[str, threading.Thread | None]) -> dict[str, float]:
    """Each started, live thread's CPU seconds so far, by name (Linux and other platforms with
    pthread_getcpuclockid; elsewhere, or for a thread that has ended, left out)."""
    out = {}
    for name, thread in threads.items():
        ident = getattr(thread, "ident", None)
        if ident is None or not thread.is_alive():
            continue
        try:
            out[name] = time.clock_gettime(time.pthread_getcpuclockid(ident))
        except (AttributeError, OSError):  # no per-thread clock here, or the thread just ended
            continue
    return out
