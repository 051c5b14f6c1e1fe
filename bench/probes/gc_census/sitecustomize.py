"""Which objects a process leaves as cyclic garbage (session 40, issue 37): put this folder on
PYTHONPATH and every interpreter started with it (the server, its spawned engine process)
keeps its cyclic garbage (gc.DEBUG_SAVEALL) instead of freeing it; `kill -USR2 PID` collects,
writes /tmp/gccensus/census-PID-MS.json (the garbage's count and its 40 commonest types,
gc.get_stats()) and clears it. Signal once before a run (the baseline), once after.

    mkdir -p /tmp/gccensus
    PYTHONPATH=bench/probes/gc_census qwen-fast-tts serve --model DIR --device cpu --backend torch --port 8177
    kill -USR2 <server pid> <engine pid>; qwen-fast-tts bench fleet --server-url http://127.0.0.1:8177 ...;
    kill -USR2 <server pid> <engine pid>

A probe, not product code: the garbage it keeps grows with the run."""

import collections
import gc
import json
import os
import signal
import sys
import time

OUT = "/tmp/gccensus"
gc.set_debug(gc.DEBUG_SAVEALL)


def _census(signum, frame):
    gc.collect()
    counts = collections.Counter(type(o).__module__ + "." + type(o).__qualname__ for o in gc.garbage)
    os.makedirs(OUT, exist_ok=True)
    with open(f"{OUT}/census-{os.getpid()}-{int(time.time() * 1000)}.json", "w") as f:
        json.dump({"pid": os.getpid(), "argv": sys.argv[:3], "total": len(gc.garbage), "stats": gc.get_stats(),
                   "top": counts.most_common(40)}, f)
    del gc.garbage[:]


signal.signal(signal.SIGUSR2, _census)
