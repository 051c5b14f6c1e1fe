"""Per-thread CPU seconds (user, user+system) of process PID every 0.25 s until it exits, as JSON
[[monotonic time, {tid: [user, total]}], ...] in OUT. CPU time, unlike wall time, does not count
a thread's waits for the GIL or for a core, so it compares runs on a machine others share."""

import json
import os
import sys
import time

pid, out = int(sys.argv[1]), sys.argv[2]
hz = os.sysconf("SC_CLK_TCK")
rows = []
try:
    while os.path.exists(f"/proc/{pid}"):
        snap = {}
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            snap[tid] = [int(fields[11]) / hz, (int(fields[11]) + int(fields[12])) / hz]
        rows.append([time.monotonic(), snap])
        time.sleep(0.25)
finally:
    with open(out, "w") as f:
        json.dump(rows, f)
