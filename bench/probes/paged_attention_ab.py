"""The paged decode-attention kernel's two forms against each other and the reference:
`python bench/probes/paged_attention_ab.py --out DIR [--rows 64,128,256,512]`.

Why: the batched round's attention was 15.4 of 24.4 ms at 512 rows on the H200
(batch_round_profile), ~14x what reading the rows' K/V costs. The `loop` kernel forms each page's
products as [rep, 64, 128] fp32 broadcasts; `dot` puts both products on the tensor cores
(backends/paged_attention.py). Prediction: `dot` 2-4x faster at 64-512 rows, errors against the
fp32 reference as small as `loop`'s (bf16 output rounding).

Per rows R: random bf16 pools in the talker's layout (8 kv heads, 16 query heads, head_dim 128,
pages of 64), each row at a position drawn from `--positions` (default 100-200, the fleet's)
on pages scattered over the pool; each kernel's median time over do_bench's repeats (CUDA
events), its maximum error against `paged_attention_reference` and the ratio loop / dot. No engine
is loaded: a few seconds of device time.

`--check-only` runs small shapes of both kernels against the reference without timing: on a CPU
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
    KERNELS,
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


def max_error(kind: str, args: tuple) -> float:
    want = paged_attention_reference(*args).float()
    got = paged_attention_triton(*args, kind=kind).float()
    return (got - want).abs().max().item()


def check(device: str, dtypes: list[torch.dtype]) -> list[dict]:
    """Small shapes, both kernels, each dtype: the talker's page (64) and the predictor's (16)."""
    out = []
    for dtype in dtypes:
        for page, positions in ((64, (0, 150)), (16, (0, 40))):
            args = inputs(4, page, positions, dtype, device, seed=page)
            for kind in KERNELS:
                out.append({"dtype": str(dtype).removeprefix("torch."), "page": page, "kernel": kind,
                            "max_error": max_error(kind, args)})
    return out


def time_rows(rows: int, positions: tuple[int, int]) -> dict:
    import triton.testing

    args = inputs(rows, 64, positions, torch.bfloat16, "cuda", seed=rows)
    cell = {"rows": rows}
    for kind in KERNELS:
        cell[f"{kind}_ms"] = triton.testing.do_bench(lambda kind=kind: paged_attention_triton(*args, kind=kind),
                                                     warmup=25, rep=200, return_mode="median")
        cell[f"{kind}_max_error"] = max_error(kind, args)
    cell["loop_over_dot"] = cell["loop_ms"] / cell["dot_ms"]
    return cell


def markdown(result: dict) -> str:
    lines = [f"# Paged decode attention: loop against dot ({result['device']}, commit {result['commit']})", ""]
    if result.get("cells"):
        lines += [f"bf16, pages of 64, positions {result['positions']}; medians (do_bench).", "",
                  "| rows | loop ms | dot ms | loop / dot | max error loop / dot |", "|---|---|---|---|---|"]
        for c in result["cells"]:
            lines.append(f"| {c['rows']} | {c['loop_ms']:.4f} | {c['dot_ms']:.4f} | {c['loop_over_dot']:.2f} | "
                         f"{c['loop_max_error']:.1e} / {c['dot_max_error']:.1e} |")
        lines.append("")
    lines += ["Checks against the reference (small shapes):", "", "| dtype | page | kernel | max error |",
              "|---|---|---|---|"]
    lines += [f"| {c['dtype']} | {c['page']} | {c['kernel']} | {c['max_error']:.1e} |" for c in result["checks"]]
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
