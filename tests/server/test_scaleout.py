"""`bench scaleout` on CPU: the whole run on Ray Serve with two replicas of the tiny checkpoint.

The GPU run (bench/scaleout_run.sh) needs a machine of two GPUs; this keeps the benchmark itself
working between such runs: the ingress and a replica's own port both answer, the deployment
scales from one replica to two keeping the first, a replica killed mid-level is replaced and the
level after it is served in full.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pipecat_qwen_fast.bench.server_latency import free_port

pytest.importorskip("ray.serve")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_scaleout_runs_every_phase_on_two_cpu_replicas(endless_path, tmp_path):
    out = tmp_path / "scaleout"
    port = free_port()  # the ingress's: any free one, not 8000
    cmd = [sys.executable, "-m", "pipecat_qwen_fast.cli", "bench", "scaleout", "--model", str(endless_path),
           "--out", str(out), "--device", "cpu", "--dtype", "float32", "--backend", "torch",
           "--replica-gpus", "0", "--replica-cpus", "0.25", "--one-levels", "2", "--many-levels", "4",
           "--duration", "3", "--drain", "3", "--caller-processes", "1", "--latency-requests", "3",
           "--kill-after", "1", "--port", str(port), "--fleet-args", "--text-mode dual_track --warmup 0",
           "--ready-timeout", "120"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=540)
    report = json.loads((out / "scaleout.json").read_text())
    assert done.returncode == 0, (report.get("error"), done.stdout[-3000:])

    fa = report["first_audio"]
    assert fa["ingress"]["n"] == fa["direct"]["n"] == 3
    for run in ("one", "many"):
        (level,) = report[run]["levels"]
        assert level["utterances"] > 0 and level["errors"] == 0, (run, level)
    assert report["scaled_kept"], "scaling to two replicas replaced the first"

    kill = report["kill"]
    assert kill["killed"] and kill["replacement_warm_s"] > 0
    assert len(kill["replicas_after"]) == 2 and kill["victim"] not in kill["replicas_after"]
    recovered = report["recovered"]
    assert recovered["utterances"] > 0 and recovered["errors"] == 0 and recovered["refused"] == 0
    assert (out / "scaleout.md").read_text().startswith("# Scale-out on Ray Serve")
