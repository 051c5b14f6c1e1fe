"""One device call for the megakernel: build, correctness tests, timings, JSON under $OUT.

    python bench/megakernel_check.py [--skip-tests] [--size 0.6b|1.7b ...] [--out DIR]

Timings are CUDA-event medians of single frame launches on a random full-size talker (bf16), at
fixed talker positions. Floors divide the weight bytes each phase must stream by the measured
device-to-device copy bandwidth (read + write bytes; prior-art §6: 4.29 TB/s on the H200).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipecat_qwen_fast import megakernel as mk  # noqa: E402
from pipecat_qwen_fast.backend import TorchBackend  # noqa: E402
from pipecat_qwen_fast.sampling import SamplingParams  # noqa: E402


def load_reference():
    spec = importlib.util.spec_from_file_location("qmk_reference", ROOT / "cuda" / "reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (median of 20)."""
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    times = []
    for _ in range(25):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    del a, b
    return 2 * n / statistics.median(times[5:])


def stack_bytes(stack) -> int:
    return sum(p.numel() * p.element_size() for p in stack.layers.parameters()) + stack.norm.weight.numel() * 2


def weight_bytes(talker) -> dict[str, int]:
    cp = talker.code_predictor
    pred_pass = stack_bytes(cp.model)
    head = cp.lm_head[0].weight.numel() * 2
    proj = sum(p.numel() * 2 for p in cp.small_to_mtp_projection.parameters())
    return {
        "talker_step": stack_bytes(talker.model) + talker.codec_head.weight.numel() * 2,
        # 15 passes with their heads is the protocol's minimum; the kernel runs 16 single-token
        # passes (positions 0 and 1 separately), so it streams one extra predictor stack.
        "predictor_frame_min": 15 * (pred_pass + head + proj),
        "predictor_frame_kernel": 16 * (pred_pass + proj) + 15 * head,
    }


def time_launches(mb, st, f, iters: int) -> list[float]:
    """Per-launch device time in ms (events around each launch)."""
    evs = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        mb.launch(st, f)
        e.record()
        evs.append((s, e))
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in evs]


def summary(ms: list[float]) -> dict[str, float]:
    ms = sorted(ms)
    return {"median_ms": statistics.median(ms), "p10_ms": ms[len(ms) // 10], "p90_ms": ms[9 * len(ms) // 10],
            "min_ms": ms[0]}


PHASES = ["qkv", "attention", "o_proj", "mlp_in", "down", "head", "proj", "sample_sync", "start"]


def phase_profile(mb, st, f) -> dict:
    """One traced launch: block 0's clock at every grid barrier, summed per (stack, phase).

    A phase's time runs from the previous barrier to the end of its own; the sampling after a head
    has no barrier, so it lands in the next phase (predictor qkv / proj)."""
    trace = torch.zeros(3 * mk.TRACE_MAX, dtype=torch.int64, device="cuda")
    f.trace = trace.data_ptr()
    mb.launch(st, f)
    torch.cuda.synchronize()
    f.trace = 0
    t = trace.view(-1, 3).cpu()
    rows = t[: int((t[:, 0] != 0).sum())]
    print("trace phase ids seen:", sorted(set(int(x) for x in rows[:, 2])), flush=True)
    # SM clock from the same launch: cycles over the global nanosecond timer.
    total_cyc = int(rows[-1, 0] - rows[0, 0])
    total_ns = int(rows[-1, 1] - rows[0, 1])
    clock_hz = total_cyc / (total_ns * 1e-9)
    out: dict[str, dict[str, float]] = {}
    for i in range(1, rows.shape[0]):
        ph = int(rows[i, 2])
        stack = "predictor" if ph >= 16 else "talker"
        name = f"{stack}.{PHASES[ph % 16] if ph % 16 < len(PHASES) else f'id{ph}'}"
        cyc = int(rows[i, 0] - rows[i - 1, 0])
        e = out.setdefault(name, {"count": 0, "total_us": 0.0})
        e["count"] += 1
        e["total_us"] += cyc / clock_hz * 1e6
    for e in out.values():
        e["mean_us"] = e["total_us"] / e["count"]
    return {"phases": out, "barriers": rows.shape[0] - 1, "total_us_clock": total_cyc / clock_hz * 1e6,
            "total_us_globaltimer": total_ns / 1e3, "sm_clock_mhz": clock_hz / 1e6}


@torch.no_grad()
def quick_check(talker, mb, frames: int) -> dict:
    """Teacher-forced frames against the replica (cuda/reference.py) for any size: the 1.7B
    shapes (width 2048, MLP 6144, 2048->1024 projection) are checked here, the test suite runs 0.6B."""
    ref = load_reference()
    D = talker.cfg.hidden_size
    params = SamplingParams(do_sample=False, subtalker_do_sample=False)
    st = mb.new_state(max_positions=frames + 16, params=params, seed=0,
                      trailing=(torch.randn((4, D), device="cuda") * 0.05).to(torch.bfloat16),
                      pad_vec=(torch.randn(D, device="cuda") * 0.05).to(torch.bfloat16))
    mb.prefill(st, (torch.randn((12, D), device="cuda") * 0.05).to(torch.bfloat16))
    rep = ref.ReplicaDecoder(talker, st.talker_cache.k, st.talker_cache.v, st.talker_cache.length,
                             st.buffers["hidden"], st.trailing, st.pad_vec)
    agree = total = 0
    worst_t = worst_p = 0.0
    for _ in range(frames):
        codes_ref = rep.decode_frame()
        codes = mb.decode_frame(st, force=codes_ref)
        h = st.buffers["hidden"].float()
        worst_t = max(worst_t, float((h - rep.hidden).norm() / rep.hidden.norm()))
        ph = st.buffers["pred_hidden"][1:].float()
        worst_p = max(worst_p, float((ph - rep.pred_hidden[1:]).norm() / rep.pred_hidden[1:].norm()))
        agree += int((codes == codes_ref).sum())
        total += codes.numel()
    mb.release(st)
    return {"frames": frames, "talker_hidden_rel_err_max": worst_t, "predictor_hidden_rel_err_max": worst_p,
            "argmax_agreement": agree / total}


def time_size(size: str, bw: float, iters: int, positions: list[int]) -> dict:
    ref = load_reference()
    talker, cfg = ref.random_talker(size, "cuda", seed=0)
    t0 = time.perf_counter()
    mb = mk.MegakernelBackend(talker, torch.device("cuda"), torch.bfloat16)
    init_s = time.perf_counter() - t0
    D = cfg.talker.hidden_size
    max_pos = max(positions) + 4
    out = {"size": size, "backend_init_s": init_s, "weight_bytes": weight_bytes(talker), "modes": {}}
    wb = out["weight_bytes"]
    for sampling in (False, True):
        params = SamplingParams(do_sample=sampling, subtalker_do_sample=sampling)
        st = mb.new_state(max_positions=max_pos, params=params, seed=1,
                          trailing=torch.randn((4, D), device="cuda").to(torch.bfloat16) * 0.05,
                          pad_vec=torch.randn(D, device="cuda").to(torch.bfloat16) * 0.05)
        st.talker_cache.k.normal_(0, 0.5)
        st.talker_cache.v.normal_(0, 0.5)
        mb.prefill(st, (torch.randn((8, D), device="cuda") * 0.05).to(torch.bfloat16))
        mb.decode_frame(st)
        mb.decode_frame(st)
        tag = "sampling" if sampling else "greedy"
        for pos in positions:
            rows = {
                "frame": mb.frame_args(st, run_talker=True, pos=pos)[0],
                "talker_only": mb.frame_args(st, run_talker=True, run_predictor=False, pos=pos)[0],
            }
            for name, f in rows.items():
                time_launches(mb, st, f, 20)
                out["modes"][f"{name}_{tag}_pos{pos}"] = summary(time_launches(mb, st, f, iters))
        f = mb.frame_args(st, run_talker=False)[0]
        time_launches(mb, st, f, 20)
        out["modes"][f"predictor_only_{tag}"] = summary(time_launches(mb, st, f, iters))
        try:
            out[f"profile_{tag}_pos{positions[0]}"] = phase_profile(
                mb, st, mb.frame_args(st, run_talker=True, pos=positions[0])[0])
        except Exception as e:  # the profile is a diagnostic; keep the timings
            out[f"profile_{tag}_error"] = repr(e)
        mb.release(st)
    floors = {
        "talker_step_ms": wb["talker_step"] / bw * 1e3,
        "predictor_frame_ms": wb["predictor_frame_min"] / bw * 1e3,
        "frame_ms": (wb["talker_step"] + wb["predictor_frame_min"]) / bw * 1e3,
    }
    out["floor_at_copy_bw"] = floors
    pos0 = positions[0]
    m = out["modes"]
    out["percent_of_floor"] = {
        "talker_step": 100 * floors["talker_step_ms"] / m[f"talker_only_greedy_pos{pos0}"]["median_ms"],
        "predictor_frame_sampling": 100 * floors["predictor_frame_ms"] / m["predictor_only_sampling"]["median_ms"],
        "frame_sampling": 100 * floors["frame_ms"] / m[f"frame_sampling_pos{pos0}"]["median_ms"],
    }
    out["teacher_forced_vs_replica"] = quick_check(talker, mb, frames=20)
    # Context: the torch backend (eager) on the same weights, a few frames.
    tb = TorchBackend(talker, torch.device("cuda"), torch.bfloat16)
    st = tb.new_state(max_positions=64, params=SamplingParams(), seed=0,
                      trailing=torch.zeros((1, D), device="cuda", dtype=torch.bfloat16),
                      pad_vec=torch.zeros(D, device="cuda", dtype=torch.bfloat16))
    tb.prefill(st, (torch.randn((8, D), device="cuda") * 0.05).to(torch.bfloat16))
    for _ in range(3):
        tb.decode_frame(st)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        tb.decode_frame(st)
    torch.cuda.synchronize()
    out["torch_backend_frame_ms"] = (time.perf_counter() - t0) / 10 * 1e3
    del mb, tb, talker
    torch.cuda.empty_cache()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--sizes", nargs="+", default=["0.6b"])
    ap.add_argument("--positions", nargs="+", type=int, default=[100, 1000])
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--pytest-args", default="")
    ap.add_argument("--smoke", action="store_true", help="build, run the backend warm-up once, exit")
    args = ap.parse_args()
    if args.smoke:
        talker, _ = load_reference().random_talker("0.6b", "cuda", seed=0)
        t0 = time.perf_counter()
        mk.MegakernelBackend(talker, torch.device("cuda"), torch.bfloat16)
        print(f"smoke: build + warm-up frames ran in {time.perf_counter() - t0:.1f}s", flush=True)
        return 0
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    props = torch.cuda.get_device_properties(0)
    result = {
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": git_commit(),
        "gpu": props.name, "sms": props.multi_processor_count, "l2_bytes": getattr(props, "L2_cache_size", None),
        "torch": torch.__version__, "python": platform.python_version(),
        "script": "bench/megakernel_check.py",
    }
    t0 = time.perf_counter()
    lib_path = mk.build_library(f"sm_{props.major}{props.minor}")
    result["build_s"] = time.perf_counter() - t0
    result["library"] = str(lib_path)
    print(f"built {lib_path} in {result['build_s']:.1f}s", flush=True)

    if not args.skip_tests:
        junit = out_dir / "megakernel_pytest.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", f"--junitxml={junit}",
               "--timeout=300", "--timeout-method=thread",
               "tests/test_megakernel.py", *args.pytest_args.split()]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        result["tests"] = {"rc": proc.returncode, "seconds": time.perf_counter() - t0, "tail": proc.stdout[-3000:]}
        print(proc.stdout[-5000:], proc.stderr[-2000:], flush=True)

    bw = copy_bandwidth()
    result["copy_bandwidth_Bps"] = bw
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    result["sizes"] = {}
    for size in args.sizes:
        try:
            result["sizes"][size] = time_size(size, bw, args.iters, args.positions)
        except Exception as e:  # keep the other sizes' numbers
            import traceback

            traceback.print_exc()
            result["sizes"][size] = {"error": repr(e)}
            print(f"{size}: {e!r}", flush=True)
        (out_dir / "megakernel_results.json").write_text(json.dumps(result, indent=2))

    print(f"\n{'size':6} {'mode':34} {'median ms':>10} {'p90 ms':>8}")
    for size, r in result["sizes"].items():
        for mode, s in r.get("modes", {}).items():
            print(f"{size:6} {mode:34} {s['median_ms']:10.4f} {s['p90_ms']:8.4f}")
        if "floor_at_copy_bw" in r:
            print(size, "floors", {k: round(v, 4) for k, v in r["floor_at_copy_bw"].items()})
            print(size, "% of floor", {k: round(v, 1) for k, v in r["percent_of_floor"].items()})
            print(size, "torch backend frame ms", round(r["torch_backend_frame_ms"], 2))
            print(size, "teacher-forced vs replica", r.get("teacher_forced_vs_replica"))
        for key, prof in r.items():
            if key.startswith("profile_") and isinstance(prof, dict):
                print(size, key, "barriers", prof["barriers"], "total us", round(prof["total_us_globaltimer"], 1),
                      "SM MHz", round(prof["sm_clock_mhz"]))
                for name, e in sorted(prof["phases"].items()):
                    print(f"   {name:26} n={e['count']:4d} mean {e['mean_us']:7.2f} us  total {e['total_us']:8.1f} us")
    (out_dir / "megakernel_results.json").write_text(json.dumps(result, indent=2))
    return 0 if result.get("tests", {"rc": 0})["rc"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
