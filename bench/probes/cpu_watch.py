"""Which processes use the machine's CPUs while a benchmark runs, and what the CPUs are.

The fleet through a server (issue 37) ran its engine's rounds ~24 % longer than in process on the
same GPU, with the engine alone in its process. One candidate is CPU: four caller processes and the
server's process beside the engine thread, on 16 logical CPUs that may be 8 cores' hyperthreads.
This samples every process's CPU use (utime + stime from /proc, as a share of one CPU) every
`--every` seconds until killed, and writes the CPU topology once, as JSON lines:

    python3 bench/probes/cpu_watch.py --out $OUT/cpu.jsonl &   # beside the run; kill it after

Linux only (reads /proc and /sys); no dependency.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def topology() -> dict:
    """Logical CPUs, physical cores, and sockets, from /sys."""
    cores, packages, siblings = set(), set(), set()
    for cpu in Path("/sys/devices/system/cpu").glob("cpu[0-9]*"):
        top = cpu / "topology"
        try:
            package = (top / "physical_package_id").read_text().strip()
            cores.add((package, (top / "core_id").read_text().strip()))
            packages.add(package)
            siblings.add((top / "thread_siblings_list").read_text().strip())
        except OSError:
            continue
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"logical_cpus": os.cpu_count(), "usable_cpus": len(os.sched_getaffinity(0)),
            "physical_cores": len(cores), "sockets": len(packages),
            "thread_sibling_sets": sorted(siblings)[:4], "model": model}


def cpu_ticks() -> dict[int, tuple[int, int, str]]:
    """pid -> (utime + stime in ticks, ppid, command line's first 80 characters)."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            # The command name is in parentheses and may hold spaces: split after its end.
            fields = stat[stat.rindex(")") + 2:].split()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, ValueError):
            continue
        out[int(entry.name)] = (int(fields[11]) + int(fields[12]), int(fields[1]), cmd[:80])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--every", type=float, default=5.0, help="seconds between samples")
    p.add_argument("--min-share", type=float, default=0.05, help="processes under this share of a CPU are left out")
    args = p.parse_args()
    stop = False

    def finish(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, finish)
    signal.signal(signal.SIGINT, finish)
    with args.out.open("a") as f:
        f.write(json.dumps({"topology": topology()}) + "\n")
        f.flush()
        before, t_before = cpu_ticks(), time.monotonic()
        while not stop:
            time.sleep(args.every)
            now, t_now = cpu_ticks(), time.monotonic()
            dt = t_now - t_before
            procs = []
            for pid, (ticks, ppid, cmd) in now.items():
                share = (ticks - before.get(pid, (0,))[0]) / TICK / dt
                if share >= args.min_share:
                    procs.append({"pid": pid, "ppid": ppid, "cpu": round(share, 3), "cmd": cmd})
            procs.sort(key=lambda p: -p["cpu"])
            f.write(json.dumps({"t": round(time.time(), 1), "total_cpu": round(sum(p["cpu"] for p in procs), 2),
                                "procs": procs[:12]}) + "\n")
            f.flush()
            before, t_before = now, t_now


if __name__ == "__main__":
    main()
