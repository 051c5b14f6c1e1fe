"""`qwen-fast-tts bench`: our engine and the two baselines, in one run, on one random checkpoint.

Each implementation runs in its own process (separate imports, separate GPU memory, a crash or a
hang costs only its own row) under a share of the overall time budget; every phase rewrites its
JSON after each stage, so a phase cut short still reports what it measured. At the end the phases
are merged into `results.json` and `results.md` in --out.

    qwen-fast-tts bench --build-size 0.6b --out results/        # builds the checkpoint first
    qwen-fast-tts bench --model DIR --out results/ --baselines none
    qwen-fast-tts bench --build-size tiny --device cpu --quick --out /tmp/b   # CPU smoke run

`qwen-fast-tts bench fleet ...` is the fleet benchmark instead: many voice-agent callers on one
engine (pipecat_qwen_fast/bench/fleet.py; `qwen-fast-tts bench fleet --help`).
`qwen-fast-tts bench streaming-text ...`: first audio after an LLM's first token, sentence mode
against token mode in Pipecat and LiveKit (pipecat_qwen_fast/bench/streaming_text.py).
`qwen-fast-tts bench scaleout ...`: the fleet on Ray Serve, one replica then one per GPU, and a
replica killed mid-level (pipecat_qwen_fast/bench/scaleout.py).
`qwen-fast-tts bench voice-clone ...`: voice creation, cloned first audio and frame time
(pipecat_qwen_fast/bench/voice_clone.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from pipecat_qwen_fast.bench import texts

REPO_ROOT = Path(__file__).resolve().parents[2]
BASELINE_DIR = REPO_ROOT / "bench" / "baselines"
BACKENDS = ("torch", "auto", "megakernel", "eager")
BASELINES = ("faster", "official")
# Relative shares of the time left when each phase starts; a phase that finishes early (an
# unavailable backend, say) leaves its time to the phases after it.
WEIGHTS = {"ceilings": 3, "torch": 40, "auto": 30, "faster": 22, "official": 30, "megakernel": 18, "eager": 12}
MIN_PHASE_S = {"ceilings": 10, "torch": 30, "auto": 30, "faster": 30, "official": 30, "megakernel": 30, "eager": 40}
EXIT_GRACE_S = 20  # a phase stops its own work at its budget; this is its time to exit


class Clock:
    def __init__(self, deadline: float):
        self.deadline = deadline

    def left(self) -> float:
        return self.deadline - time.time()


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run_phase(name: str, cmd: list[str], out_json: Path, timeout: float, env: dict | None = None) -> dict:
    """Run one phase process; return its JSON (partial if it was stopped), plus how it ended."""
    log(f"phase {name}: budget {timeout:.0f} s: {' '.join(cmd[1:4])} ...")
    t0 = time.time()
    status = "ok"
    try:
        proc = subprocess.run(cmd, timeout=timeout, env=env, cwd=REPO_ROOT, check=False)
        if proc.returncode != 0:
            status = f"exit code {proc.returncode}"
    except subprocess.TimeoutExpired:
        status = f"stopped at its {timeout:.0f} s budget"
    result: dict = {}
    if out_json.exists():
        try:
            result = json.loads(out_json.read_text())
        except json.JSONDecodeError as e:
            result = {"error": f"unreadable phase output: {e}"}
    result["phase_status"] = status
    result["phase_wall_s"] = round(time.time() - t0, 1)
    log(f"phase {name}: {status} after {result['phase_wall_s']} s")
    return result


def build_checkpoint(size: str, variant: str, out: Path) -> dict:
    t0 = time.time()
    cmd = [sys.executable, "-m", "pipecat_qwen_fast.checkpoints.build", "--size", size, "--variant", variant,
           "--out", str(out), "--zero-eos"]
    log(f"building the random {size} {variant} checkpoint (EOS row zeroed) in {out}")
    subprocess.run(cmd, check=True, cwd=REPO_ROOT)
    return {"size": size, "variant": variant, "zero_eos": True, "build_s": round(time.time() - t0, 1)}


def baseline_texts(quick: bool) -> dict:
    """What the baseline drivers speak: the same texts and frame counts as our engine."""
    return {
        "rtf_text": texts.RTF_TEXT,
        "rtf_frames": texts.rtf_frames_for(quick),
        "runs": texts.runs_for(quick),
        "utterances": [[u, texts.frames_for(u)] for u in texts.utterances_for(quick)],
    }


def share(clock: Clock, phase: str, remaining: list[str]) -> float:
    total = sum(WEIGHTS[p] for p in remaining)
    return max(0.0, clock.left() * WEIGHTS[phase] / total)


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, cwd=REPO_ROOT,
                             timeout=10, check=False)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="qwen-fast-tts bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", type=Path, help="an existing checkpoint folder (its EOS row should be zeroed)")
    src.add_argument("--build-size", choices=["tiny", "0.6b", "1.7b"], help="build a random checkpoint first")
    p.add_argument("--variant", default="custom_voice", choices=["custom_voice"],
                   help="checkpoint variant to build (the benchmark speaks with a CustomVoice speaker)")
    p.add_argument("--checkpoint-dir", type=Path, default=Path("/tmp/qwen-fast-bench-ckpt"))
    p.add_argument("--out", type=Path, required=True, help="folder for results.json and results.md")
    p.add_argument("--work-dir", type=Path, default=None, help="folder for per-phase JSONs (default: OUT/phases)")
    p.add_argument("--device", default="cuda", help="cuda | cuda:N | cpu")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU) | bfloat16 | float32")
    p.add_argument("--backends", default="torch,auto,eager",
                   help="comma list of: torch (CUDA graphs on CUDA), auto (the default: megakernel for the first "
                        "calls, torch batches beyond), megakernel, eager (the plain PyTorch reference)")
    p.add_argument("--baselines", default="faster,official", help="comma list of: faster, official; or none")
    p.add_argument("--budget", type=float, default=540.0, help="seconds for everything after the checkpoint build")
    p.add_argument("--deadline", type=float, default=None, help="absolute UNIX time to finish by (overrides --budget)")
    p.add_argument("--baseline-pythonpath", default=os.environ.get("BENCH_BASELINE_PYTHONPATH", ""),
                   help="extra sys.path for the baseline processes (where the carried wheels were installed)")
    p.add_argument("--commit", default=os.environ.get("BENCH_COMMIT"), help="commit measured (default: git HEAD)")
    p.add_argument("--quick", action="store_true", help="few utterances, short runs (CPU smoke test)")
    args = p.parse_args(argv)
    args.backends = _choices(args.backends, BACKENDS, "--backends")
    args.baselines = [] if args.baselines == "none" else _choices(args.baselines, BASELINES, "--baselines")
    return args


def _choices(value: str, valid: tuple[str, ...], flag: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in valid]
    if bad:
        raise SystemExit(f"{flag}: unknown {', '.join(bad)}; valid: {', '.join(valid)}")
    return items


def main(argv: list[str] | None = None) -> int:
    from pipecat_qwen_fast.bench.report import write_reports

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["server-latency"]:
        from pipecat_qwen_fast.bench.server_latency import main as server_latency_main

        return server_latency_main(argv[1:])
    if argv[:1] == ["startup"]:
        from pipecat_qwen_fast.bench.startup import main as startup_main

        return startup_main(argv[1:])
    if argv[:1] == ["streaming-text"]:
        from pipecat_qwen_fast.bench.streaming_text import main as streaming_text_main

        return streaming_text_main(argv[1:])
    if argv[:1] == ["fleet"]:
        from pipecat_qwen_fast.bench.fleet import main as fleet_main

        return fleet_main(argv[1:])
    if argv[:1] == ["scaleout"]:
        from pipecat_qwen_fast.bench.scaleout import main as scaleout_main

        return scaleout_main(argv[1:])
    if argv[:1] == ["voice-clone"]:
        from pipecat_qwen_fast.bench.voice_clone import main as voice_clone_main

        return voice_clone_main(argv[1:])
    args = parse_args(argv)
    started = time.time()
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work_dir or args.out / "phases"
    work.mkdir(parents=True, exist_ok=True)
    results: dict = {
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": args.commit or git_commit(),
        "quick": args.quick,
        "texts": {
            "rtf_text_words": texts.word_count(texts.RTF_TEXT),
            "rtf_frames": texts.rtf_frames_for(args.quick),
            "ttfc_utterances": len(texts.UTTERANCES),
            "ttfc_words_range": [min(map(texts.word_count, texts.UTTERANCES)),
                                 max(map(texts.word_count, texts.UTTERANCES))],
            "frames_per_word": texts.FRAMES_PER_WORD,
        },
        "phases": {},
    }

    def save() -> None:
        (args.out / "results.json").write_text(json.dumps(results, indent=2))
        write_reports(results, args.out)

    if args.build_size:
        results["checkpoint"] = build_checkpoint(args.build_size, args.variant, args.checkpoint_dir)
        model = args.checkpoint_dir
    else:
        results["checkpoint"] = {"path": str(args.model), "zero_eos": "as built (not checked here)"}
        model = args.model
    clock = Clock(args.deadline if args.deadline else time.time() + args.budget)
    save()
    texts_json = work / "texts.json"
    texts_json.write_text(json.dumps(baseline_texts(args.quick)))

    # Our default backend, then the baselines, then the others (the new kernel, then the slow eager
    # reference): a kernel that hangs or faults then costs only its own share, never a baseline row.
    ours_first = [b for b in args.backends if b == "torch"]
    ours_last = [b for b in ("auto", "megakernel", "eager") if b in args.backends]
    phases = ["ceilings", *ours_first, *args.baselines, *ours_last]
    py = sys.executable
    base_env = dict(os.environ, PYTHONUNBUFFERED="1")
    quick = ["--quick"] if args.quick else []
    for i, phase in enumerate(phases):
        budget = share(clock, phase, phases[i:])
        if budget < MIN_PHASE_S[phase]:
            results["phases"][phase] = {"phase_status": "skipped: no time left in the run's budget"}
            save()
            continue
        out_json = work / f"phase_{phase}.json"
        if phase == "ceilings":
            cmd = [py, "-m", "pipecat_qwen_fast.bench.ceilings", "--device", args.device, "--out", str(out_json), *quick]
            env = base_env
        elif phase in BACKENDS:
            bw = results["phases"].get("ceilings", {}).get("copy_bandwidth_gbs")
            cmd = [py, "-m", "pipecat_qwen_fast.bench.engine", "--model", str(model), "--device", args.device,
                   "--dtype", args.dtype, "--backend", phase, "--budget", str(budget - EXIT_GRACE_S),
                   "--out", str(out_json), *quick]
            if bw:
                cmd += ["--bandwidth-gbs", str(bw)]
            env = base_env
        else:
            script = BASELINE_DIR / ("faster_qwen3_tts_bench.py" if phase == "faster" else "official_qwen_tts_bench.py")
            cmd = [py, str(script), "--model", str(model), "--device", args.device,
                   "--budget", str(budget - EXIT_GRACE_S), "--out", str(out_json), "--texts", str(texts_json)]
            extra = [p for p in (args.baseline_pythonpath, base_env.get("PYTHONPATH", "")) if p]
            env = dict(base_env, PYTHONPATH=os.pathsep.join(extra)) if extra else base_env
        results["phases"][phase] = run_phase(phase, cmd, out_json, timeout=budget, env=env)
        save()
    results["total_wall_s"] = round(time.time() - started, 1)
    save()
    log(f"wrote {args.out / 'results.json'} and {args.out / 'results.md'}")
    print((args.out / "results.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
