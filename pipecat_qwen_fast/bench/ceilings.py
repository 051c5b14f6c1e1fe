"""The machine's own ceilings, measured in the benchmark run: copy bandwidth and bf16 matmul rate.

The bandwidth floor of a frame is "bytes of weights read / bandwidth"; using a copy measured on the
same GPU in the same run (bytes read + bytes written, like the prior-art figures) keeps the percent
of roofline honest instead of trusting a datasheet.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_repeats(fn, device: torch.device, repeats: int) -> float:
    """Seconds per call, median of `repeats` timed calls after warm-up."""
    for _ in range(3):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def measure_copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Device-to-device copy rate in GB/s, counting bytes read plus bytes written."""
    # Random bytes, not zeros: never time on data a compressor or a lazy page could shortcut.
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = _time_repeats(lambda: dst.copy_(src), device, repeats=20)
    return 2 * nbytes / seconds / 1e9


def measure_bf16_matmul(device: torch.device, n: int) -> float:
    """Dense bf16 n x n x n matmul rate in TFLOP/s on random data."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    seconds = _time_repeats(lambda: a @ b, device, repeats=10)
    return 2 * n**3 / seconds / 1e12


def describe_device(device: torch.device) -> dict:
    info: dict = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device_type": device.type,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            gpu=props.name,
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            sm_count=props.multi_processor_count,
            l2_cache_mib=round(getattr(props, "L2_cache_size", 0) / 2**20, 1),
            cuda=torch.version.cuda,
        )
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20, check=False,
            )
            info["driver"] = out.stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            info["driver"] = None
    else:
        info["cpu"] = platform.processor() or platform.machine()
    return info


def measure_ceilings(device: torch.device, quick: bool) -> dict:
    result = describe_device(device)
    if device.type == "cuda":
        nbytes = (256 if quick else 2048) * 2**20  # far above the 60 MiB L2
        result["copy_bandwidth_gbs"] = round(measure_copy_bandwidth(device, nbytes), 1)
        result["bf16_matmul_tflops"] = round(measure_bf16_matmul(device, 2048 if quick else 8192), 1)
    else:
        result["copy_bandwidth_gbs"] = round(measure_copy_bandwidth(device, 64 * 2**20), 1)
        result["bf16_matmul_tflops"] = None
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipecat_qwen_fast.bench.ceilings")
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", required=True, help="JSON file to write")
    args = p.parse_args(argv)
    result = measure_ceilings(torch.device(args.device), args.quick)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
