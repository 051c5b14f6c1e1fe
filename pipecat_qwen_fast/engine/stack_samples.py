"""Where a process's threads spend their wall time, from samples of their Python stacks.

On the H200 the fleet's process (engine in process) and the server's engine process each used
one CPU's worth and no more (session 35, bench/probes/cpu_watch.py): either one thread's work
(the engine thread's, waiting on the device included where CUDA spins) or one GIL shared by the
engine thread and the event loop beside it. To see which, and where the seconds go under a real
load, set QWEN_FAST_STACK_SAMPLES=DIR:
each process that starts an EngineService samples all its threads' stacks every SAMPLE_S and
writes DIR/stacks-PID.json every WRITE_S (and when stopped), per thread the functions by the
samples in which each was the innermost frame ("self") and anywhere on the stack ("total"). It
also appends the whole counts so far, with the time, to DIR/stacks-PID.jsonl: the difference of
two lines is a window of the run, such as one benchmark level without the warm-up before it
(bench/probes/stack_window.py).

The sampler runs only when it holds the GIL, so a thread running Python is seen at its switch
points (every 5 ms by default) and a thread waiting in C (a device sync, a socket) where it
waits: good for where the seconds go, not for microseconds. Each sample holds the GIL while it
walks the stacks: ~0.14 ms of CPU on the 2-core CI machine, ~3 % of a CPU at 5 ms
(bench/probes/stack_sample_cost.py).
"""

from __future__ import annotations

import atexit
import collections
import functools
import json
import os
import sys
import threading
import time
from pathlib import Path

ENV = "QWEN_FAST_STACK_SAMPLES"
# A thread running Python is seen at its GIL switches (every 5 ms by default) anyway; sampling
# more often only adds to the sampler's cost (bench/probes/stack_sample_cost.py).
SAMPLE_S = 0.005
# A window (stack_window.py) is cut at these steps: at 10 s, session 35's 22 s levels came in
# 30 s windows, up to 20 % of them idle time around the level. A snapshot of the server's engine
# process was ~85 KB (7 MB for its 6 minutes at 10 s; ~2 MB gzipped).
WRITE_S = 5.0
TOP = 60  # functions kept per thread and kind in the file


@functools.lru_cache(maxsize=8192)
def frame_key(code) -> str:
    """A function as the report names it: qualified name (file:first line). Cached per code
    object: made afresh for every frame of every sample, the names were most of a sample's cost
    (~220 us of CPU for two threads' stacks on the 2-core CI machine against ~145 us cached)."""
    return f"{getattr(code, 'co_qualname', code.co_name)} ({Path(code.co_filename).name}:{code.co_firstlineno})"


class StackSampler:
    """Samples every other thread's stack on a thread of its own until stopped."""

    def __init__(self, out_dir: str | os.PathLike[str], interval_s: float = SAMPLE_S) -> None:
        self.path = Path(out_dir) / f"stacks-{os.getpid()}.json"
        self.history = self.path.with_suffix(".jsonl")
        self.interval_s = interval_s
        self.samples: collections.Counter[str] = collections.Counter()
        self.own: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self.total: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self._stop = threading.Event()
        self._lock = threading.Lock()  # the counts, between the sampler and a write from exit
        self._thread = threading.Thread(target=self._run, name="qwen-stack-sampler", daemon=True)
        self._started_at = time.monotonic()

    def start(self) -> StackSampler:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join()
        self.write()

    def _run(self) -> None:
        written = time.monotonic()
        while not self._stop.wait(self.interval_s):
            self.sample()
            if time.monotonic() - written >= WRITE_S:
                self.write()
                written = time.monotonic()

    def sample(self) -> None:
        names = {t.ident: t.name for t in threading.enumerate()}
        me = threading.get_ident()
        with self._lock:
            self._count(names, me)

    def _count(self, names: dict, me: int) -> None:
        for ident, frame in sys._current_frames().items():
            if ident == me:
                continue
            name = names.get(ident, f"thread {ident}")
            self.samples[name] += 1
            seen: set[str] = set()
            innermost = True
            while frame is not None:
                key = frame_key(frame.f_code)
                if innermost:
                    self.own[name][key] += 1
                    innermost = False
                if key not in seen:  # a recursive function counts once a sample
                    seen.add(key)
                    self.total[name][key] += 1
                frame = frame.f_back

    def report(self) -> dict:
        return {"pid": os.getpid(), "interval_s": self.interval_s,
                "seconds": time.monotonic() - self._started_at,
                "threads": {name: {"samples": n,
                                   "self": dict(self.own[name].most_common(TOP)),
                                   "total": dict(self.total[name].most_common(TOP))}
                            for name, n in self.samples.most_common()}}

    def write(self) -> None:
        with self._lock:
            self._write()

    def _write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.report(), indent=1))
        tmp.replace(self.path)  # a reader never sees half a file
        snapshot = {"t": time.time(), "threads": {name: {"samples": n, "self": dict(self.own[name]),
                                                         "total": dict(self.total[name])}
                                                  for name, n in self.samples.items()}}
        with self.history.open("a") as f:
            f.write(json.dumps(snapshot) + "\n")


_sampler: StackSampler | None = None
_lock = threading.Lock()


def start_from_env() -> StackSampler | None:
    """This process's sampler, started on the first call where QWEN_FAST_STACK_SAMPLES names a
    folder (None where it does not)."""
    global _sampler
    out = os.environ.get(ENV)
    if not out:
        return None
    with _lock:
        if _sampler is None:
            _sampler = StackSampler(out).start()
            atexit.register(_sampler.write)  # the last seconds too, where the process exits cleanly
        return _sampler
