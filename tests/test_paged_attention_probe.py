"""The paged decode-attention kernel (backends/paged_attention.py) against the torch
reference on a CPU, through bench/probes/paged_attention_ab.py --check-only under Triton's
interpreter, in a process of its own (the interpreter is chosen when the kernels are defined).
The CPU build of torch ships no Triton: scripts/setup_test_env.sh installs one into
.cache/triton-interp for this process alone, so the rest of the suite runs as a CPU user's would.
The GPU test (tests/test_graph_backend.py) checks the compiled kernels, in bf16 too."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROBE = ROOT / "bench" / "probes" / "paged_attention_ab.py"
TRITON_DIR = ROOT / ".cache" / "triton-interp"  # scripts/setup_test_env.sh


@pytest.mark.skipif(not (TRITON_DIR / "triton").is_dir() and importlib.util.find_spec("triton") is None,
                    reason="no Triton for its interpreter: run scripts/setup_test_env.sh")
@pytest.mark.timeout(600)
def test_the_kernel_matches_the_reference_under_the_interpreter(tmp_path):
    path = os.pathsep.join(p for p in (str(TRITON_DIR), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    run = subprocess.run([sys.executable, str(PROBE), "--out", str(tmp_path), "--check-only"], env=env,
                         capture_output=True, text=True, timeout=540, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    checks = json.loads((tmp_path / "paged_attention_ab.json").read_text())["checks"]
    assert {(c["dtype"], c["page"]) for c in checks} == {(d, p) for d in ("float32", "float16") for p in (64, 16)}
    for c in checks:
        # fp32: products and sums in fp32; fp16: the output's rounding (one unit in the last place near 1).
        assert c["max_error"] < (1e-5 if c["dtype"] == "float32" else 1e-3), c
