"""bench/probes/ncu_summary.py on a tiny profile in the real formats (ncu's source-page CSV, nvdisasm's
-g -gi listing): samples land on the inline stack of their instruction, a fence's membar samples
on the MEMBAR that caused them, and a listing of another build is refused."""

from __future__ import annotations

import csv
import gzip
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SYMBOL = "_Z16qmk_frame_kernelILb0EEv6Params"

# (offset, SASS, inline stack leaf first, executed, {stall: samples})
CODE = [
    (0x00, "LDC R1, c[0x0][0x28]", [("qwen_mk.cu", 1273)], 132, {"stall_no_inst": 3}),
    (0x10, "BAR.SYNC.DEFER_BLOCKING R0, 0x200", [("mk_util.cuh", 30), ("qwen_mk.cu", 1208), ("qwen_mk.cu", 1326)],
     900, {"stall_barrier": 50}),
    (0x20, "MEMBAR.SC.GPU", [("mk_attention.cuh", 208), ("qwen_mk.cu", 755), ("qwen_mk.cu", 1213), ("qwen_mk.cu", 1326)],
     64, {}),
    (0x30, "ERRBAR", [("mk_attention.cuh", 208), ("qwen_mk.cu", 755), ("qwen_mk.cu", 1213), ("qwen_mk.cu", 1326)],
     64, {"stall_membar": 7}),
    (0x40, "CCTL.IVALL", [("mk_attention.cuh", 208), ("qwen_mk.cu", 755), ("qwen_mk.cu", 1213), ("qwen_mk.cu", 1326)],
     64, {"stall_membar": 5, "stall_wait": 1}),
    (0x50, "@P0 LDG.E.128 R4, desc[UR4][R2.64]", [("mk_attention.cuh", 85), ("qwen_mk.cu", 1213), ("qwen_mk.cu", 1326)],
     64, {"stall_long_sb": 11}),
]
STALLS = ["stall_barrier", "stall_long_sb", "stall_membar", "stall_no_inst", "stall_wait"]


def write_listing(path: Path, code) -> None:
    lines = ["//--------------------- .text._Z16qmk_frame_kernelILb1EEv6Params ----",
             ".text._Z16qmk_frame_kernelILb1EEv6Params:",
             "        /*0000*/                   NOP ;",
             f"//--------------------- .text.{SYMBOL} ----",
             f".text.{SYMBOL}:"]
    for offset, sass, stack, _, _ in code:
        for i, (f, ln) in enumerate(stack):
            at = f' inlined at "/src/{stack[i + 1][0]}", line {stack[i + 1][1]}' if i + 1 < len(stack) else ""
            lines.append(f'\t//## File "/src/{f}", line {ln}{at}')
        lines.append(f"        /*{offset:04x}*/                   {sass} ;")
    lines.append("//--------------------- .nv.shared ----")
    path.write_text("\n".join(lines) + "\n")


def write_profile(folder: Path, code) -> None:
    with gzip.open(folder / "sass.csv.gz", "wt", newline="") as f:
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        for name in ("void qmk_frame_kernel<(bool)0>(Params)",) * 2:
            w.writerow(["Kernel Name", name])
            w.writerow(["Address", "Source", "# Samples", "Instructions Executed", *STALLS,
                        *(s + " (Not Issued)" for s in STALLS)])
            for offset, sass, _, executed, stalls in code:
                counts = [stalls.get(s, 0) for s in STALLS]
                w.writerow([hex(0x7F0000000000 + offset), f"      {sass}", sum(counts), executed, *counts, *counts])


def summarise(folder: Path, listing: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "bench" / "probes" / "ncu_summary.py"), str(folder),
                           "--sass-listing", str(listing), "--json", str(folder / "s.json")],
                          check=False, capture_output=True, text=True, timeout=60)


def test_samples_map_to_inline_stacks_and_fences(tmp_path):
    write_profile(tmp_path, CODE)
    write_listing(tmp_path / "listing.sass", CODE)
    proc = summarise(tmp_path, tmp_path / "listing.sass")
    assert proc.returncode == 0, proc.stderr
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["listing_check"]["mismatches"] == 0
    talker = s["kernels"][1]
    assert talker["label"] == "talker"
    assert talker["samples"] == 77  # the "(Not Issued)" columns are not counted again
    assert talker["samples_excluding_barrier"] == 27
    sites = {r["key"]: r["samples"] for r in talker["call_sites_excluding_barrier"]}
    assert sites["qwen_mk.cu:1213 < qwen_mk.cu:1326"] == 24  # the fence's 13 and the load's 11
    lines = {r["key"]: r["samples"] for r in talker["top_lines_excluding_barrier"]}
    assert lines["mk_attention.cuh:85"] == 11
    (fence,) = [f for f in talker["fences"] if f["opcode"] == "MEMBAR.SC.GPU"]
    assert fence["membar_samples"] == 12 and fence["leaf"] == "mk_attention.cuh:208"
    assert fence["executed"] == 64


def test_listing_of_another_build_is_refused(tmp_path):
    write_profile(tmp_path, CODE)
    other = [(o, "NOP", st, e, s) for o, _, st, e, s in CODE]
    write_listing(tmp_path / "listing.sass", other)
    proc = summarise(tmp_path, tmp_path / "listing.sass")
    assert proc.returncode == 2
    assert "differ in opcode" in proc.stderr
