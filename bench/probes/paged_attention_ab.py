"""The paged decode-attention kernel against its torch reference, checked and timed:
`python bench/probes/paged_attention_ab.py --out DIR [--rows 64,128,256,512]`.

Why: the batched round's attention was 15.4 of 24.4 ms at 512 rows on the H200
(batch_round_profile), ~14x what reading the rows' K/V costs. This probe chose the kernel's
tensor-core form over one of broadcast products, 2.95-4.17x faster
(bench/results/2026-11-28-h200-session30/probes/, the last run with both); it now times the kernel
against the reference (gather, mask, softmax in torch) to show what it saves.

Per rows R: random bf16 pools in the talker's layout (8 kv heads, 16 query heads, head_dim 128,
pages of 64), each row at a position drawn from `--positions` (default 100-200, the fleet's)
on pages scattered over the pool; the kernel's and the reference's median times over do_bench's
repeats (CUDA events), the kernel's maximum error against the reference and the ratio. No engine
is loaded: a few seconds of device time.

`--check-only` runs small shapes of the kernel against the reference without timing: on a CPU
under Triton's interpreter (TRITON_INTERPRET=1, fp32 and fp16: the interpreter's bf16 products
are wrong, its own limit, so bf16 is checked on the GPU only) - tests/test_paged_attention_probe.py.

Writes OUT/paged_attention_ab.json and .md (the table, also printed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[2])]  # the repository
from pipecat_qwen_fast.backends.paged_attention import (
    paged_attention_reference,
    paged_attention_triton,
)

NAME = "paged_attention_ab"
KVH, H, HD = 8, 16, 128


def inputs(rows: int, page: int, positions: tuple[int, int], dtype: torch.dtype, device: str, seed: int):
    """Pools with one page more than the rows need in all, each row's pages a random draw."""
    g = torch.Generator(device=device).manual_seed(seed)
    lo, hi = positions
    pos = torch.randint(lo, hi + 1, (rows,), generator=g, device=device)
    per_row = hi // page + 1
    pool_pages = rows * per_row + 1
    k_pool = torch.randn(pool_pages, KVH, page, HD, generator=g, device=device).to(dtype)
    v_pool = torch.randn(pool_pages, KVH, page, HD, generator=g, device=device).to(dtype)
    pages = torch.randperm(pool_pages - 1, generator=g, device=device)[: rows * per_row].view(rows, per_row)
    q = torch.randn(rows, H, HD, generator=g, device=device).to(dtype)
    return q, k_pool, v_pool, pages, pos


def max_error(args: tuple) -> float:
    want = paged_attention_reference(*args).float()
    got = paged_attention_triton(*args).float()
    return (got - want).abs().max().item()


def check(device: str, dtypes: list[torch.dtype]) -> list[dict]:
    """Small shapes, each dtype: the talker's page (64) and the predictor's (16)."""
    out = []
    for dtype in dtypes:
        for page, positions in ((64, (0, 150)), (16, (0, 40))):
            args = inputs(4, page, positions, dtype, device, seed=page)
            out.append({"dtype": str(dtype).removeprefix("torch."), "page": page, "max_error": max_error(args)})
    return out


def time_rows(rows: int, positions: tuple[int, int]) -> dict:
    import triton.testing

    args = inputs(rows, 64, positions, torch.bfloat16, "cuda", seed=rows)
    cell = {"rows": rows}
    for name, fn in (("kernel", paged_attention_triton), ("reference", paged_attention_reference)):
        cell[f"{name}_ms"] = triton.testing.do_bench(lambda fn=fn: fn(*args), warmup=25, rep=200,
                                                     return_mode="median")
    cell["max_error"] = max_error(args)
    cell["reference_over_kernel"] = cell["reference_ms"] / cell["kernel_ms"]
    return cell


def markdown(result: dict) -> str:
    title = f"# Paged decode attention: the kernel against its reference ({result['device']}, commit {result['commit']})"
    lines = [title, ""]
    if result.get("cells"):
        lines += [f"bf16, pages of 64, positions {result['positions']}; medians (do_bench).", "",
                  "| rows | kernel ms | reference ms | reference / kernel | max error |", "|---|---|---|---|---|"]
        for c in result["cells"]:
            lines.append(f"| {c['rows']} | {c['kernel_ms']:.4f} | {c['reference_ms']:.4f} | "
                         f"{c['reference_over_kernel']:.2f} | {c['max_error']:.1e} |")
        lines.append("")
    lines += ["Checks against the reference (small shapes):", "", "| dtype | page | max error |", "|---|---|---|"]
    lines += [f"| {c['dtype']} | {c['page']} | {c['max_error']:.1e} |" for c in result["checks"]]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rows", default="64,128,256,512")
    p.add_argument("--positions", default="100,200", help="LOW,HIGH: each row's position drawn between")
    p.add_argument("--check-only", action="store_true", help="no timing: the checks alone (CPU interpreter)")
    p.add_argument("--commit", default=os.environ.get("BENCH_COMMIT"))
    args = p.parse_args(argv)
    try:
        args.row_counts = [int(r) for r in args.rows.split(",")]
        lo, hi = (int(x) for x in args.positions.split(","))
    except ValueError:
        p.error(f"--rows takes integers, --positions LOW,HIGH; got {args.rows!r}, {args.positions!r}")
    if not 0 <= lo <= hi or any(r < 1 for r in args.row_counts):
        p.error("--positions needs 0 <= LOW <= HIGH and --rows values >= 1")
    args.position_range = (lo, hi)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
    if not cuda and not args.check_only:
        raise SystemExit("timing needs a CUDA GPU; on a CPU run --check-only under TRITON_INTERPRET=1")
    from pipecat_qwen_fast.bench.main import git_commit

    device = "cuda" if cuda else "cpu"
    result = {
        "probe": NAME, "commit": args.commit or git_commit(),
        "device": torch.cuda.get_device_name() if cuda else "cpu (Triton's interpreter)",
        "positions": list(args.position_range),
        "checks": check(device, [torch.float32, torch.bfloat16] if cuda else [torch.float32, torch.float16]),
    }
    if not args.check_only:
        result["cells"] = [time_rows(r, args.position_range) for r in args.row_counts]
    (args.out / f"{NAME}.json").write_text(json.dumps(result, indent=2))
    md = markdown(result)
    (args.out / f"{NAME}.md").write_text(md)
    print(md, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
