"""How long a full garbage collection of the server's process takes, before and after gc.freeze().

With `serve --engine-process` the server's process holds no engine, but it still imports torch and
the app: its full collections stall every socket's audio at once. Prints the object count and the
time of two full collections, then one after freezing (what EngineProcess does once the engine is
ready). No GPU; seconds.

    python3 bench/probes/server_heap.py
"""

from __future__ import annotations

import gc
import json
import platform
import time

started = time.perf_counter()
import pipecat_qwen_fast.server.app  # what the server's process imports
import pipecat_qwen_fast.server.engine_process  # noqa: F401

result = {"import_s": round(time.perf_counter() - started, 2), "machine": platform.machine(),
          "objects": len(gc.get_objects()), "full_gc_ms": []}
for _ in range(2):
    t = time.perf_counter()
    gc.collect()
    result["full_gc_ms"].append(round((time.perf_counter() - t) * 1e3, 2))
gc.freeze()
t = time.perf_counter()
gc.collect()
result["frozen_full_gc_ms"] = round((time.perf_counter() - t) * 1e3, 3)
result["frozen"] = gc.get_freeze_count()
print(json.dumps(result))
