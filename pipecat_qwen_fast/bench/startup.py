"""`qwen-fast-tts bench startup`: how long an engine takes from process start to first audio.

Each start runs in a fresh process, so nothing of an earlier load is in memory; what carries over
is only what a real restart would find on disk:
- cold: an empty cache folder (the megakernel is built, every compile runs);
- warm: the same folder again, as a restarted server finds it;
- prepared: `qwen-fast-tts prepare` completes the folder in its own process (every warm-up step,
  the deferred ones too), the folder is copied (as to a container image or a bare GPU machine) and
  the engine starts from the copy.
The checkpoint's files are read once before the runs, so every start finds them in the page cache.
Each run writes its phases (engine.load_phases), the seconds from process start to engine ready
and to the first audio of one request, and the warm first-audio p50 of the requests after it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

RUNS = ("cold", "warm", "prepared")
TEXT = "Thanks for calling. Your table for four is booked for seven tonight."


def child(args: argparse.Namespace) -> int:
    """One start, timed from the parent's spawn (wall clock, passed in)."""
    spawned = args.spawned
    import torch

    from pipecat_qwen_fast import QwenTTSEngine

    imported = time.time()
    engine = QwenTTSEngine.from_pretrained(
        args.model, device=args.device, backend=args.backend, progress=False
    )
    ready = time.time()
    voice = engine.voices[0] if engine.voices else None

    def first_audio() -> float:
        t0 = time.perf_counter()
        for _ in engine.stream(TEXT, voice=voice, seed=0, max_frames=8):
            break
        return time.perf_counter() - t0

    first = first_audio()
    first_at = time.time()
    warm = [first_audio() for _ in range(args.requests)]
    out = {
        "import_s": imported - spawned,
        "ready_s": ready - spawned,
        "first_audio_s": first_at - spawned,
        "first_request_ms": first * 1e3,
        "warm_first_audio_p50_ms": statistics.median(warm) * 1e3 if warm else None,
        "phases": engine.load_phases.as_dict() if engine.load_phases else [],
        "top_level": engine.load_phases.top_level() if engine.load_phases else {},
        "device": torch.cuda.get_device_name() if engine.device.type == "cuda" else "cpu",
        "torch": torch.__version__,
    }
    Path(args.result).write_text(json.dumps(out, indent=2))
    engine.close()
    return 0


def run_child(model: Path, cache: Path, result: Path, args: argparse.Namespace) -> dict:
    env = dict(os.environ, QWEN_FAST_CACHE=str(cache))
    # The run must see only the cache folder under test, never torch's default folders.
    for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        env.pop(var, None)
    cmd = [
        sys.executable,
        "-m",
        "pipecat_qwen_fast.bench.startup",
        "child",
        "--model",
        str(model),
        "--device",
        args.device,
        "--backend",
        args.backend,
        "--requests",
        str(args.requests),
        "--result",
        str(result),
        "--spawned",
        repr(time.time()),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        return {"error": f"exit {proc.returncode}", "stderr_tail": proc.stderr[-3000:]}
    return json.loads(result.read_text())


def prepare_into(model: Path, cache: Path, args: argparse.Namespace) -> dict:
    env = dict(os.environ, QWEN_FAST_CACHE=str(cache))
    for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        env.pop(var, None)
    t0 = time.time()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipecat_qwen_fast.cli",
            "prepare",
            "--model",
            str(model),
            "--device",
            args.device,
            "--backend",
            args.backend,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=args.timeout,
    )
    out = {"prepare_s": time.time() - t0, "exit": proc.returncode}
    if proc.returncode != 0:
        out["stderr_tail"] = proc.stderr[-3000:]
    return out


def read_through(folder: Path) -> None:
    """Page the checkpoint in, so each start measures a server restart, not a cold disk."""
    for path in folder.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                while f.read(1 << 24):
                    pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="qwen-fast-tts bench startup",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="mode")
    c = sub.add_parser("child")
    c.add_argument("--model", required=True)
    c.add_argument("--device", default="cuda")
    c.add_argument("--backend", default="auto")
    c.add_argument("--requests", type=int, default=20)
    c.add_argument("--result", required=True)
    c.add_argument("--spawned", type=float, required=True)
    p.add_argument("--model", type=Path, help="checkpoint folder")
    p.add_argument("--out", type=Path, help="folder for startup.json")
    p.add_argument(
        "--work", type=Path, default=Path("/tmp/qwen-fast-startup"), help="cache folders live here"
    )
    p.add_argument("--runs", default=",".join(RUNS), help=f"comma list of {', '.join(RUNS)}")
    p.add_argument("--device", default="cuda")
    p.add_argument("--backend", default="auto")
    p.add_argument(
        "--requests", type=int, default=20, help="warm requests after the first, for the p50"
    )
    p.add_argument("--timeout", type=float, default=900.0, help="seconds allowed per process")
    args = p.parse_args(argv)
    if args.mode == "child":
        return child(args)
    if args.model is None or args.out is None:
        p.error("--model and --out are required")
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    bad = [r for r in runs if r not in RUNS]
    if bad:
        p.error(f"unknown run(s) {', '.join(bad)}; valid: {', '.join(RUNS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    read_through(args.model)
    report: dict = {
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "backend": args.backend,
        "model": str(args.model),
        "runs": {},
    }
    shared = args.work / "cache"  # cold fills it, warm reuses it
    for run in runs:
        result = args.work / f"{run}.json"
        if run == "prepared":
            # prepare completes the folder the earlier runs started (all of the warm-up, not only
            # the single-call part), and a copy of it stands for the image or the bare machine.
            report["prepare"] = prepare_into(args.model, shared, args)
            copy = args.work / "prepared-copy"
            shutil.copytree(shared, copy)
            report["runs"][run] = run_child(args.model, copy, result, args)
        else:
            report["runs"][run] = run_child(args.model, shared, result, args)
        (args.out / "startup.json").write_text(json.dumps(report, indent=2))
        r = report["runs"][run]
        print(
            f"{run:9s} ready {r.get('ready_s', float('nan')):7.1f} s  first audio "
            f"{r.get('first_audio_s', float('nan')):7.1f} s  {r.get('error', '')}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
