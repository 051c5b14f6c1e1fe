"""Main-environment side of the oracle: run the official qwen-tts on a checkpoint, cache the results.

The official package needs transformers 4.57.3, so it runs in its own venv (setup_env.sh) as one
subprocess per checkpoint (run_official.py documents the case format). Results are cached under
``.cache/oracle-out/<key>/``, the key hashing the checkpoint files, the cases, the runner source and
the venv stamp, so an unchanged rerun costs nothing and any change reruns the oracle.

When the venv cannot be created (no network, say) the tests are skipped with the reason and the
setup command, unless ``QWEN_ORACLE_REQUIRED=1`` (set by CI), which turns that into a failure.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SETUP_SCRIPT = HERE / "setup_env.sh"
RUNNER = HERE / "run_official.py"
VENV = Path(os.environ.get("QWEN_ORACLE_VENV", ROOT / ".cache" / "oracle-venv"))
OUT_ROOT = ROOT / ".cache" / "oracle-out"
SETUP_COMMAND = f"bash {SETUP_SCRIPT.relative_to(ROOT)}"

# The tiny models are launch-overhead bound: one thread is several times faster than two threads
# contending with the test process on a 2-core machine.
RUNNER_THREADS = int(os.environ.get("QWEN_ORACLE_THREADS", "1"))
SETUP_TIMEOUT_S = 1200
RUN_TIMEOUT_S = 1200


class OracleUnavailable(RuntimeError):
    """The oracle venv could not be created (environmental, not a model bug)."""


def venv_python() -> Path:
    return VENV / "bin" / "python"


def log_tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


_setup_outcome: dict[str, str | OracleUnavailable] = {}


def ensure_venv() -> str:
    """Create or validate the venv (instant when its stamp is current); returns the stamp.

    The outcome, failure included, is kept for the process: a failing setup (no network, say)
    must not be retried, with pip's long timeouts, by every test.
    """
    if "result" not in _setup_outcome:
        try:
            _setup_outcome["result"] = run_setup()
        except OracleUnavailable as e:
            _setup_outcome["result"] = e
    result = _setup_outcome["result"]
    if isinstance(result, OracleUnavailable):
        raise result
    return result


def run_setup() -> str:
    env = dict(os.environ, QWEN_ORACLE_VENV=str(VENV), PYTHON=os.environ.get("PYTHON", sys.executable))
    try:
        proc = subprocess.run(["bash", str(SETUP_SCRIPT)], env=env, capture_output=True, text=True,
                              timeout=SETUP_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as e:
        raise OracleUnavailable(f"{SETUP_COMMAND} timed out after {e.timeout} s") from None
    if proc.returncode != 0:
        raise OracleUnavailable(
            f"{SETUP_COMMAND} failed (exit {proc.returncode}):\n{log_tail(proc.stdout + proc.stderr)}"
        )
    return (VENV / ".oracle-stamp").read_text().strip()


def require_oracle() -> str:
    """ensure_venv(), or skip the calling test (fail under QWEN_ORACLE_REQUIRED=1)."""
    try:
        return ensure_venv()
    except OracleUnavailable as e:
        message = f"official qwen-tts oracle venv unavailable; create it with `{SETUP_COMMAND}`.\n{e}"
    if os.environ.get("QWEN_ORACLE_REQUIRED") == "1":
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


def hash_checkpoint(ckpt_dir: Path, h) -> None:
    for path in sorted(p for p in ckpt_dir.rglob("*") if p.is_file()):
        h.update(str(path.relative_to(ckpt_dir)).encode() + b"\0")
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        h.update(b"\0")


def cache_key(ckpt_dir: Path, cases: list[dict], stamp: str) -> str:
    h = hashlib.sha256()
    h.update(RUNNER.read_bytes())
    h.update(stamp.encode())
    h.update(json.dumps(cases, sort_keys=True).encode())
    hash_checkpoint(ckpt_dir, h)
    return h.hexdigest()[:32]


def run_runner(ckpt_dir: Path, cases: list[dict], out_dir: Path) -> None:
    tmp = out_dir.with_name(f"{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    request = tmp / "request.json"
    request.write_text(json.dumps({"cases": cases}))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", TOKENIZERS_PARALLELISM="false")
    cmd = [str(venv_python()), str(RUNNER), "--ckpt", str(ckpt_dir), "--request", str(request),
           "--out", str(tmp), "--threads", str(RUNNER_THREADS)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                              check=False)
    except subprocess.TimeoutExpired:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"official runner timed out after {RUN_TIMEOUT_S} s on {ckpt_dir}") from None
    if proc.returncode != 0 or not (tmp / "done.json").exists():
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(
            f"official qwen-tts runner failed on {ckpt_dir} (exit {proc.returncode}):\n"
            f"{log_tail(proc.stdout + proc.stderr, 60)}"
        )
    (tmp / "log.txt").write_text(proc.stdout + proc.stderr)
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)


def load_case(path: Path) -> dict:
    with np.load(path) as data:
        out = {k: data[k] for k in data.files}
    if "json" in out:
        return json.loads(str(out["json"]))
    return out


def official_outputs(ckpt_dir: str | Path, cases: list[dict]) -> dict[str, dict]:
    """Run (or fetch from cache) the official package on every case of one checkpoint.

    Returns case id -> result: arrays for ``generate``/``decode`` cases, a dict for ``inspect``.
    Skips the calling test when the oracle venv cannot be created (see module docstring).
    """
    stamp = require_oracle()
    ckpt_dir = Path(ckpt_dir).resolve()
    out_dir = OUT_ROOT / cache_key(ckpt_dir, cases, stamp)
    if not (out_dir / "done.json").exists():
        run_runner(ckpt_dir, cases, out_dir)
    return {c["id"]: load_case(out_dir / f"{c['id']}.npz") for c in cases}
