"""`qwen-fast-tts bench scaleout`: the fleet on Ray Serve, one replica, then one per GPU.

One run on one machine, in this order:

1. Ray starts here; Serve deploys the server (server/ray_serve.py) with one replica and routes to
   it through its ingress once the engine is warm.
2. First audio over the WebSocket through the ingress against a direct connection to the replica,
   request by request in turn.
3. The fleet benchmark (closed-loop callers, `bench fleet --server-url`) through the ingress at
   --one-levels.
4. Serve scales the deployment to --replicas (one engine per GPU; the first replica serves on);
   the fleet at --many-levels.
5. At --kill-level (default: the largest many-replica level that met the bar), a replica is killed
   --kill-after seconds into the level. Its callers' streams end with an error and they speak
   again; the other replica's callers play on. Ray's replacement is timed until it is warm, then
   the level runs again.

The ingress is Serve's HAProxy (RAY_SERVE_ENABLE_HA_PROXY=1, the default here): it hands each
socket to a replica's own server, so audio goes from the replica to the caller without passing
through Python in between. `--ingress proxy` uses Serve's Python proxy instead, which relays every
WebSocket message through an actor call.

Results: OUT/scaleout.json and OUT/scaleout.md; each fleet run's own folder (OUT/one, OUT/many,
OUT/kill, OUT/recovered) and log; the end of each Ray Serve log in OUT/ray-logs.

    qwen-fast-tts bench scaleout --model DIR --out /tmp/s --replicas 2 \\
        --one-levels 400,440 --many-levels 800,880
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from pipecat_qwen_fast.bench.engine import percentile
from pipecat_qwen_fast.bench.main import git_commit, log

APP = "qwen-tts"
RESULT = "scaleout.json"
MARKDOWN = "scaleout.md"
REPLICA_PORTS = range(30000, 30064)  # where Serve's direct ingress puts each replica's server
RATIO_BAR = 1.8
PROXY_BAR_MS = 3.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="qwen-fast-tts bench scaleout", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="checkpoint folder (its EOS row zeroed, as for bench fleet)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--replicas", type=int, default=2, help="replicas of the scaled-out runs (one per GPU)")
    p.add_argument("--replica-gpus", type=float, default=1.0, help="GPUs each replica asks Ray for")
    p.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs each replica asks Ray for")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--backend", default="auto")
    p.add_argument("--ingress", default="haproxy", choices=["haproxy", "proxy"])
    p.add_argument("--port", type=int, default=8000, help="the ingress's port on 127.0.0.1")
    p.add_argument("--one-levels", default="400,440", help="callers per level against one replica")
    p.add_argument("--many-levels", default="800,880", help="callers per level against --replicas")
    p.add_argument("--kill-level", type=int, default=None,
                   help="callers while a replica is killed (default: the largest many-replica level that met)")
    p.add_argument("--kill-after", type=float, default=8.0, help="seconds into the kill level")
    p.add_argument("--duration", type=float, default=20.0)
    p.add_argument("--drain", type=float, default=8.0)
    p.add_argument("--caller-processes", type=int, default=8)
    p.add_argument("--latency-requests", type=int, default=30,
                   help="first-audio requests each way (through the ingress, direct)")
    p.add_argument("--fleet-args", default="--text-mode dual_track",
                   help="more arguments for each `bench fleet` run")
    p.add_argument("--ready-timeout", type=float, default=900.0,
                   help="seconds a replica may take to load and warm")
    p.add_argument("--commit", default=os.environ.get("BENCH_COMMIT"))
    args = p.parse_args(argv)
    for name in ("one_levels", "many_levels"):
        try:
            setattr(args, name, [int(v) for v in getattr(args, name).split(",") if v.strip()])
        except ValueError:
            raise SystemExit(f"--{name.replace('_', '-')}: expected a comma list of caller counts") from None
    if args.replicas < 2:
        raise SystemExit(f"--replicas: expected 2 or more (the scaled-out runs), got {args.replicas}")
    return args


# -- the replicas, seen directly ------------------------------------------------------------------

def get_json(url: str, timeout: float = 2.0) -> tuple[int, dict, dict]:
    """(status, JSON body, headers) of a GET; status 0 where nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, json.load(r), dict(r.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, {}, dict(exc.headers or {})
    except (OSError, ValueError):
        return 0, {}, {}


def replicas_seen() -> dict[str, dict]:
    """Each replica's own server that answers /ready: {replica id: {"port", "ready", "fully_warm"}}."""
    from pipecat_qwen_fast.server.ray_serve import REPLICA_HEADER

    seen = {}
    for port in REPLICA_PORTS:
        status, body, headers = get_json(f"http://127.0.0.1:{port}/ready", timeout=0.5)
        replica = {k.lower(): v for k, v in headers.items()}.get(REPLICA_HEADER)
        if status and replica:
            seen[replica] = {"port": port, "ready": status == 200, "fully_warm": bool(body.get("fully_warm"))}
    return seen


def wait_warm(count: int, timeout: float) -> tuple[float, dict[str, dict]]:
    """Until `count` replicas answer fully warm on their own ports: (seconds waited, replicas)."""
    t0 = time.monotonic()
    while True:
        seen = replicas_seen()
        if sum(r["fully_warm"] for r in seen.values()) >= count:
            return time.monotonic() - t0, seen
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(f"{count} warm replicas expected within {timeout:.0f} s; seen: {seen}")
        time.sleep(1.0)


# -- first audio through the ingress and direct ---------------------------------------------------

async def first_audio(ports: dict[str, int], voice: str | None, requests: int, frames: int = 8) -> dict:
    """WebSocket first audio to each port in turn (a socket each, kept across turns, as LiveKit's
    client keeps it); the first three of each are warm-up."""
    import websockets

    from pipecat_qwen_fast.bench.server_latency import over_ws

    times: dict[str, list[float]] = {name: [] for name in ports}
    sockets = {name: await websockets.connect(f"ws://127.0.0.1:{port}/v1/audio/speech/stream", max_size=None)
               for name, port in ports.items()}
    try:
        for ws in sockets.values():
            await ws.send(json.dumps({"type": "session.config", "voice": voice, "max_new_tokens": frames,
                                      "seed": 0}))
        for i in range(requests + 3):
            for name, ws in sockets.items():
                t = await over_ws(ws, frames)
                if i >= 3:
                    times[name].append(1e3 * t)
    finally:
        for ws in sockets.values():
            await ws.close()
    out: dict[str, Any] = {name: {"p50_ms": statistics.median(v), "p95_ms": percentile(v, 95), "n": len(v)}
                           for name, v in times.items()}
    out["ingress_minus_direct_p50_ms"] = out["ingress"]["p50_ms"] - out["direct"]["p50_ms"]
    out["ingress_minus_direct_p95_ms"] = out["ingress"]["p95_ms"] - out["direct"]["p95_ms"]
    return out


# -- the fleet through the ingress ----------------------------------------------------------------

def run_fleet(args: argparse.Namespace, name: str, levels: list[int], *, warmup: bool = True,
              on_level_start=None) -> dict:
    """`bench fleet --server-url` through the ingress into OUT/name: its closed-loop section.
    `on_level_start()` is called when the (first) level's callers start."""
    out = args.out / name
    budget = 60 + (len(levels) + warmup) * (args.duration + args.drain + 15)
    cmd = [sys.executable, "-m", "pipecat_qwen_fast.cli", "bench", "fleet",
           "--server-url", f"http://127.0.0.1:{args.port}", "--no-server-metrics",
           "--caller-processes", str(args.caller_processes), "--levels", ",".join(map(str, levels)),
           "--duration", str(args.duration), "--drain", str(args.drain), "--keep-going",
           "--budget", str(budget), "--out", str(out), *args.fleet_args.split()]
    if not warmup:
        cmd += ["--warmup", "0"]
    if args.commit:
        cmd += ["--commit", args.commit]
    log(f"fleet {name}: levels {levels}")
    out.mkdir(parents=True, exist_ok=True)
    with open(args.out / f"{name}.log", "w") as logfile:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        started = False
        for line in proc.stdout:
            logfile.write(line)
            if not started and on_level_start is not None and " level " in line and line.rstrip().endswith("starts"):
                started = True
                on_level_start()
        proc.wait()
    result = json.loads((out / "fleet.json").read_text()) if (out / "fleet.json").exists() else {}
    closed = result.get("closed", {})
    closed["returncode"] = proc.returncode
    return closed


def level_row(level: dict) -> dict:
    keys = ("callers", "meets_bar", "misses", "utterances", "completed", "refused", "errors", "error_samples",
            "errored_callers", "errored_callers_heard_again", "underrun_utterances", "worst_lateness_ms",
            "frames_per_s", "skipped")
    row = {k: level[k] for k in keys if k in level}
    fa = level.get("first_audio_ms") or {}
    row.update({f"first_audio_{k}_ms": fa.get(k) for k in ("p50", "p95", "p99")})
    return row


# -- Ray -------------------------------------------------------------------------------------------

def deploy(args: argparse.Namespace) -> None:
    """One replica of the server, its count left to scale()."""
    from ray import serve

    from pipecat_qwen_fast.server.ray_serve import tts_app
    from pipecat_qwen_fast.server.settings import ServerSettings

    # As `qwen-fast-tts serve` runs: the engine in a child process, admission left to the engine
    # (max_streams far above what a level opens).
    settings = ServerSettings(model=args.model, device=args.device, dtype=args.dtype, backend=args.backend,
                              max_streams=100000, engine_process=True, log_level="warning")
    serve.run(tts_app(settings, num_replicas=1, num_gpus=args.replica_gpus, num_cpus=args.replica_cpus),
              name=APP, route_prefix="/", blocking=False, external_scaler_enabled=True)


def scale(replicas: int) -> None:
    """The deployment's replica count, the replicas running kept. A second serve.run with another
    count would be a new version of the app, and Serve replaces every replica of an old version
    (one engine load each); this is what Serve's REST scale endpoint asks of its controller."""
    import ray
    from ray import serve
    from ray.serve._private.common import DeploymentID

    from pipecat_qwen_fast.server.ray_serve import QwenTTSDeployment

    controller = serve.context._get_global_client()._controller
    ray.get(controller.update_deployment_replicas.remote(DeploymentID(name=QwenTTSDeployment.name, app_name=APP),
                                                         replicas))


def kill_replica(replica: str) -> None:
    import ray

    ray.kill(ray.get_actor(replica, namespace="serve"))


def keep_logs(out: Path, lines: int = 200) -> None:
    """The end of each Serve log (controller, ingress, replicas) into OUT/ray-logs."""
    logs = Path("/tmp/ray/session_latest/logs/serve")
    if not logs.is_dir():
        return
    dest = out / "ray-logs"
    dest.mkdir(exist_ok=True)
    for f in sorted(logs.glob("*.log")):
        text = f.read_text(errors="replace").splitlines()[-lines:]
        (dest / f.name).write_text("\n".join(text) + "\n")


# -- the run ---------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.ingress == "haproxy":
        # Read by Ray's processes as they start (the controller, the ingress, the replicas).
        os.environ["RAY_SERVE_ENABLE_HA_PROXY"] = "1"
    import ray
    from ray import serve

    report: dict[str, Any] = {
        "benchmark": "scaleout",
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": args.commit or git_commit(),
        "model": str(args.model), "replicas": args.replicas, "ingress": args.ingress,
        "ray": ray.__version__, "caller_processes": args.caller_processes,
        "level_s": {"duration": args.duration, "drain": args.drain}, "fleet_args": args.fleet_args,
        "bars": {"ratio": RATIO_BAR, "ingress_minus_direct_ms": PROXY_BAR_MS},
    }

    def save() -> None:
        (args.out / RESULT).write_text(json.dumps(report, indent=2))
        (args.out / MARKDOWN).write_text(render(report))

    t_start = time.monotonic()
    try:
        gpus = None
        if args.device.startswith("cuda"):
            import torch

            gpus = torch.cuda.device_count()
            report["gpus"] = [torch.cuda.get_device_name(i) for i in range(gpus)]
        ray.init(num_gpus=gpus, include_dashboard=False, log_to_driver=False)
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})

        t0 = time.monotonic()
        deploy(args)
        _, seen = wait_warm(1, args.ready_timeout)
        report["one_replica_warm_s"] = time.monotonic() - t0
        (replica, info), = seen.items()
        save()

        _, voices, _ = get_json(f"http://127.0.0.1:{info['port']}/v1/audio/voices")
        voice = (voices.get("voices") or [None])[0]
        report["first_audio"] = asyncio.run(first_audio({"ingress": args.port, "direct": info["port"]}, voice,
                                                        args.latency_requests))
        log(f"first audio: {json.dumps(report['first_audio'])}")
        save()

        one = run_fleet(args, "one", args.one_levels)
        report["one"] = {"capacity_callers": one.get("capacity_callers"),
                         "levels": [level_row(lv) for lv in one.get("levels", [])]}
        save()

        t0 = time.monotonic()
        scale(args.replicas)
        _, seen = wait_warm(args.replicas, args.ready_timeout)
        report["scaled_kept"] = replica in seen  # the first replica served on, not replaced
        report["scale_up_warm_s"] = time.monotonic() - t0
        many = run_fleet(args, "many", args.many_levels)
        report["many"] = {"capacity_callers": many.get("capacity_callers"),
                          "levels": [level_row(lv) for lv in many.get("levels", [])]}
        c1, cn = report["one"]["capacity_callers"], report["many"]["capacity_callers"]
        report["ratio"] = cn / c1 if c1 and cn else None
        save()

        kill_level = args.kill_level or cn or max(args.many_levels)
        victim = min(seen, key=lambda r: seen[r]["port"])
        killed: dict[str, float] = {}

        def kill() -> None:
            killed["at"] = time.monotonic()
            kill_replica(victim)
            log(f"killed replica {victim}")

        # Started when the level's callers start; cancelled if the fleet run ends before it fires.
        timer = threading.Timer(args.kill_after, kill)
        try:
            kill_run = run_fleet(args, "kill", [kill_level], warmup=False, on_level_start=timer.start)
        finally:
            timer.cancel()
        report["kill"] = {"callers": kill_level, "victim": victim, "after_s": args.kill_after,
                          "killed": "at" in killed,
                          "level": level_row(kill_run["levels"][0]) if kill_run.get("levels") else None}
        save()
        if "at" in killed:
            _, back = wait_warm(args.replicas, args.ready_timeout)
            report["kill"]["replacement_warm_s"] = time.monotonic() - killed["at"]
            report["kill"]["replicas_after"] = sorted(back)
            recovered = run_fleet(args, "recovered", [kill_level])
            report["recovered"] = level_row(recovered["levels"][0]) if recovered.get("levels") else None
    except BaseException as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        report["total_wall_s"] = time.monotonic() - t_start
        save()
        keep_logs(args.out)
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    print(render(report))
    return 0


def render(report: dict) -> str:
    def ms(v: Any) -> str:
        return "n/a" if v is None else f"{v:.1f}"

    lines = [f"# Scale-out on Ray Serve ({report.get('ingress')} ingress), {report.get('date_utc')}, "
             f"commit {report.get('commit')}", ""]
    if report.get("gpus"):
        lines += [f"GPUs: {', '.join(report['gpus'])}; Ray {report.get('ray')}; "
                  f"{report.get('caller_processes')} caller processes", ""]
    fa = report.get("first_audio")
    if fa:
        lines += ["## First audio, one replica idle (WebSocket, ms)", "",
                  "| path | p50 | p95 | n |", "|---|---|---|---|"]
        lines += [f"| {k} | {ms(fa[k]['p50_ms'])} | {ms(fa[k]['p95_ms'])} | {fa[k]['n']} |"
                  for k in ("ingress", "direct")]
        lines += ["", f"Ingress minus direct: p50 {fa['ingress_minus_direct_p50_ms']:+.2f} ms, "
                  f"p95 {fa['ingress_minus_direct_p95_ms']:+.2f} ms (bar {PROXY_BAR_MS:g} ms).", ""]
    rows = []
    for name, label in (("one", "1 replica"), ("many", f"{report.get('replicas')} replicas")):
        for lv in (report.get(name) or {}).get("levels", []):
            rows.append((label, lv))
    kill = report.get("kill") or {}
    if kill.get("level"):
        rows.append((f"a replica killed at {kill['after_s']:g} s", kill["level"]))
    if report.get("recovered"):
        rows.append(("after the replacement", report["recovered"]))
    if rows:
        lines += ["## The fleet through the ingress", "",
                  "| run | callers | p50 / p95 first audio ms | underruns | refused | errors (callers; heard again) "
                  "| frames/s | meets bar |", "|---|---|---|---|---|---|---|---|"]
        for label, lv in rows:
            if lv.get("skipped"):
                lines.append(f"| {label} | {lv.get('callers')} | skipped: {lv['skipped']} | | | | | |")
                continue
            lines.append(
                f"| {label} | {lv.get('callers')} | {ms(lv.get('first_audio_p50_ms'))} / "
                f"{ms(lv.get('first_audio_p95_ms'))} | {lv.get('underrun_utterances')} | {lv.get('refused')} | "
                f"{lv.get('errors')} ({lv.get('errored_callers')}; {lv.get('errored_callers_heard_again')}) | "
                f"{ms(lv.get('frames_per_s'))} | {'yes' if lv.get('meets_bar') else 'no'} |")
        lines.append("")
    c1 = (report.get("one") or {}).get("capacity_callers")
    cn = (report.get("many") or {}).get("capacity_callers")
    if "one" in report:
        ratio = report.get("ratio")
        lines += [f"Capacity: {c1 or 'none'} callers on one replica, {cn or 'none'} on {report.get('replicas')}: ratio "
                  f"{'n/a' if ratio is None else f'{ratio:.2f}'} (bar {RATIO_BAR:g}).", ""]
    if "scale_up_warm_s" in report:
        lines += [f"Scaled to {report.get('replicas')} replicas: warm {ms(report['scale_up_warm_s'])} s after the "
                  f"scale call; the first replica kept: {report.get('scaled_kept')}.", ""]
    if kill:
        lines.append(f"Kill: replica {kill.get('victim')} killed: {kill.get('killed')}; its replacement warm "
                     f"{ms(kill.get('replacement_warm_s'))} s after the kill.")
    if report.get("error"):
        lines += ["", f"Stopped by: {report['error']}"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
