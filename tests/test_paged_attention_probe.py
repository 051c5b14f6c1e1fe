"""Both forms of the paged decode-attention kernel (backends/paged_attention.py) against the torch
reference on a CPU, through bench/probes/paged_attention_ab.py --check-only under Triton's
interpreter, in a process of its own (the interpreter is chosen when the kernels are defined).
Triton ships with CUDA builds of torch, not with the CPU one CI installs: without it this skips,
and the GPU test (tests/test_graph_backend.py) checks the compiled kernels in bf16 too."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = Path(__file__).resolve().parents[1] / "bench" / "probes" / "paged_attention_ab.py"


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="triton is not installed (CPU torch): the kernels' interpreter check needs it")
@pytest.mark.timeout(600)
def test_both_kernels_match_the_reference_under_the_interpreter(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, str(PROBE), "--out", str(tmp_path), "--check-only"], env=env,
                         capture_output=True, text=True, timeout=540, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    checks = json.loads((tmp_path / "paged_attention_ab.json").read_text())["checks"]
    assert {(c["kernel"], c["dtype"], c["page"]) for c in checks} == {
        (k, d, p) for k in ("loop", "dot") for d in ("float32", "float16") for p in (64, 16)}
    for c in checks:
        # fp32: products and sums in fp32; fp16: the output's rounding (one unit in the last place near 1).
        assert c["max_error"] < (1e-5 if c["dtype"] == "float32" else 1e-3), c
