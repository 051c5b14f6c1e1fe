"""Summarise an Nsight Compute profile of the frame megakernel (bench/probes/ncu_profile.sh) by source.

The profile's SASS export (sass.csv.gz: ``ncu --page source --csv --print-source sass``) counts
warp-state samples per SASS instruction but carries no source lines, and in one persistent kernel
nearly everything is inlined, so the leaf line alone does not say which phase a warp is in. This
script joins the export, by instruction offset, to ``nvdisasm -g -gi -c`` of the same cubin, whose
``//## File ... inlined at ...`` comments give each instruction's inline stack, and prints per
kernel result (frame, talker, predictor, as bench/probes/ncu_profile.py launches them):

  * total samples, the stall-reason shares and, if raw.csv.gz or details.csv.gz has the
    duration, how many warp-microseconds one sample stands for;
  * samples per phase call site (the outermost two inline frames), with all samples and without
    stall_barrier (warps idling at a CTA barrier dominate and hide where the working warps wait);
  * the top leaf source lines without stall_barrier;
  * every fence (SASS MEMBAR) with the stall_membar samples it causes.

    nvdisasm -g -gi -c qwen_mk.sm_90a.cubin > listing.sass   # or ncu_profile.sh's listing.sass.gz
    python bench/probes/ncu_summary.py OUT_DIR --sass-listing listing.sass [--top 25] [--json s.json]

OUT_DIR is where bench/probes/ncu_profile.sh wrote its exports; the listing may be gzipped. It refuses
(exit 2) when the listing's opcodes disagree with the profile's at more than 0.5% of offsets, as a
listing of another build would silently mislabel everything.
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

LABELS = ("frame", "talker", "predictor")
DEFAULT_SYMBOL = "_Z16qmk_frame_kernelILb0EEv6Params"
DEFAULT_GRID, DEFAULT_BLOCK = 132, 640
WARP = 32
BARRIER = "stall_barrier"
MEMBAR = "stall_membar"
# A fence's stall is charged to the instruction that waits for it: ERRBAR, CCTL.IVALL or the ATOMG
# it orders, within a few instructions after the MEMBAR.
FENCE_WINDOW = 3
MAX_MISMATCH = 0.005
CALL_DEPTH = 2

FILE_LINE = re.compile(r'//## File "([^"]+)", line (\d+)')
INSTRUCTION = re.compile(r"^\s+/\*([0-9a-fA-F]+)\*/\s+(.*?)\s*;")
FUNCTION_LABEL = re.compile(r"^\$(\S+):\s*$")
SECTION_END = re.compile(r"^\s*(\.section\b|//-{5,}|\.text\.\S+:\s*$)")
DURATION_US = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3,
               "s": 1e6, "second": 1e6}

Frame = tuple[str, int]  # (file name, line); line 0 names a function without line info
Stack = tuple[Frame, ...]  # leaf first, outermost last


@dataclass
class Instruction:
    offset: int
    opcode: str
    executed: int
    stalls: dict[str, int]  # reason -> samples, nonzero only


@dataclass
class Kernel:
    label: str
    name: str
    instructions: list[Instruction] = field(default_factory=list)
    duration_us: float | None = None
    grid: int = DEFAULT_GRID
    block: int = DEFAULT_BLOCK
    samples_column: int = 0  # sum of "# Samples", to cross-check the stall columns


# ---------------------------------------------------------------------------------------- input


def open_text(path: Path):
    return gzip.open(path, "rt", newline="") if path.suffix == ".gz" else open(path, newline="")


def to_int(text: str) -> int:
    text = text.replace(",", "")
    return int(text) if text and text != "-" else 0


def opcode_of(sass: str) -> str:
    words = sass.split()
    if words and words[0].startswith("@"):  # guard predicate: @P0, @!P1, @!UPT
        words = words[1:]
    return words[0] if words else ""


def read_listing(path: Path, symbol: str) -> tuple[dict[int, str], dict[int, Stack]]:
    """Opcode and inline stack per offset of one kernel's section of an nvdisasm -g -gi listing
    (empty if the listing has no such section)."""
    opcodes: dict[int, str] = {}
    stacks: dict[int, Stack] = {}
    start = f".text.{symbol}:"
    inside = False
    stack: list[Frame] = []
    in_block = False  # a "//##" line after anything else starts a new stack
    with open_text(path) as f:
        for line in f:
            if not inside:
                inside = line.strip() == start
                continue
            if SECTION_END.match(line):
                break
            m = FILE_LINE.search(line)
            if m:
                if not in_block:
                    stack = []
                stack.append((Path(m.group(1)).name, int(m.group(2))))
                in_block = True
                continue
            in_block = False
            m = INSTRUCTION.match(line)
            if m:
                # nvdisasm prints line info only when it changes: an instruction keeps the last stack.
                offset = int(m.group(1), 16)
                opcodes[offset] = opcode_of(m.group(2))
                stacks[offset] = tuple(stack)
                continue
            m = FUNCTION_LABEL.match(line)
            if m:  # a called (not inlined) function: its code has no caller in the stack
                stack = [(m.group(1).rsplit("$", 1)[-1], 0)]
    return opcodes, stacks


def read_sass_csv(path: Path) -> list[Kernel]:
    """The per-instruction rows of every kernel result in the source-page export, in order."""
    kernels: list[Kernel] = []
    columns: dict[str, int] = {}
    stall_columns: list[tuple[str, int]] = []
    base = 0
    with open_text(path) as f:
        for row in csv.reader(f):
            if not row:
                continue
            if row[0] == "Kernel Name":
                i = len(kernels)
                kernels.append(Kernel(LABELS[i] if i < len(LABELS) else f"result{i}", row[1]))
                columns = {}
                continue
            if row[0] == "Address":
                columns = {name: i for i, name in enumerate(row)}
                # The "(Not Issued)" variants are a subset of the plain ones: counting them would
                # count those samples twice.
                stall_columns = [(name, i) for name, i in columns.items()
                                 if name.startswith("stall_") and "(Not Issued)" not in name]
                continue
            if not columns or not kernels or not row[0].startswith("0x"):
                continue
            kernel = kernels[-1]
            address = int(row[0], 16)
            if not kernel.instructions:
                base = address
            stalls = {name: n for name, i in stall_columns if (n := to_int(row[i]))}
            kernel.instructions.append(Instruction(
                address - base, opcode_of(row[columns["Source"]]),
                to_int(row[columns["Instructions Executed"]]), stalls))
            kernel.samples_column += to_int(row[columns["# Samples"]])
    return kernels


def read_launch_details(path: Path, kernels: list[Kernel]) -> None:
    """Duration, grid and block size per result from details.csv.gz, where it has them."""
    if not path.exists():
        return
    with open_text(path) as f:
        for row in csv.DictReader(f):
            try:
                kernel = kernels[int(row["ID"])]
            except (KeyError, ValueError, IndexError):
                continue  # repeated header rows, or a result the SASS export lacks
            name, unit, value = row.get("Metric Name"), row.get("Metric Unit", ""), row.get(
                "Metric Value", "")
            if name == "Duration" and unit in DURATION_US:
                kernel.duration_us = float(value.replace(",", "")) * DURATION_US[unit]
            elif name == "Grid Size":
                kernel.grid = to_int(value)
            elif name == "Block Size":
                kernel.block = to_int(value)


def read_raw_duration(path: Path, kernels: list[Kernel]) -> None:
    """The duration from raw.csv.gz where present: details.csv rounds it to three digits."""
    if not path.exists():
        return
    with open_text(path) as f:
        rows = csv.reader(f)
        header = next(rows, [])
        units = next(rows, [])  # the raw page's second row holds each metric's unit
        if "ID" not in header or "gpu__time_duration.sum" not in header:
            return
        id_col, col = header.index("ID"), header.index("gpu__time_duration.sum")
        scale = DURATION_US.get(units[col] if col < len(units) else "")
        for row in rows:
            try:
                kernel = kernels[int(row[id_col])]
                value = float(row[col].replace(",", ""))
            except (ValueError, IndexError):
                continue
            if scale:
                kernel.duration_us = value * scale


# ---------------------------------------------------------------------------------- validation


def count_mismatches(kernels: list[Kernel], opcodes: dict[int, str]) -> tuple[int, int, list[str]]:
    """Instructions whose opcode differs from the listing's (or whose offset it lacks)."""
    total = bad = 0
    examples: list[str] = []
    for kernel in kernels:
        for ins in kernel.instructions:
            total += 1
            listed = opcodes.get(ins.offset)
            if listed != ins.opcode:
                bad += 1
                if len(examples) < 5:
                    examples.append(f"{kernel.label} +{ins.offset:#x}: profile {ins.opcode!r}, "
                                    f"listing {listed!r}")
    return bad, total, examples


# --------------------------------------------------------------------------------- aggregation


def group_samples(kernel: Kernel, key_of, exclude: tuple[str, ...] = ()) -> dict:
    """Stall-reason counters per key_of(instruction), leaving out the reasons in `exclude`."""
    groups: dict = collections.defaultdict(collections.Counter)
    for ins in kernel.instructions:
        counter = groups[key_of(ins)]
        for reason, n in ins.stalls.items():
            if reason not in exclude:
                counter[reason] += n
    return groups


def stall_totals(kernel: Kernel) -> collections.Counter:
    totals: collections.Counter = collections.Counter()
    for ins in kernel.instructions:
        totals.update(ins.stalls)
    return totals


def rank_groups(groups: dict, top: int | None) -> tuple[list[dict], int]:
    """Rows of the `top` largest groups (all if None), and the total over all groups."""
    total = sum(sum(c.values()) for c in groups.values())
    ranked = sorted(groups.items(), key=lambda kv: -sum(kv[1].values()))
    rows = []
    for key, counter in ranked[:top]:
        n = sum(counter.values())
        if n == 0:
            break
        rows.append({"key": key, "samples": n, "share": n / total if total else 0.0,
                     "stalls": dict(counter.most_common(4))})
    return rows, total


def summarise_fences(kernel: Kernel, stacks: dict[int, Stack]) -> list[dict]:
    """Per (leaf line, call site, MEMBAR opcode): MEMBARs, their executions, the membar samples."""
    fences: dict[tuple, dict] = {}
    instructions = kernel.instructions  # contiguous, in address order
    for i, membar in enumerate(instructions):
        if not membar.opcode.startswith("MEMBAR"):
            continue
        stack = stacks.get(membar.offset, ())
        leaf = stack[0] if stack else ("?", 0)
        key = (leaf, stack[-CALL_DEPTH:], membar.opcode)
        fence = fences.setdefault(key, {"leaf": leaf, "call_site": stack[-CALL_DEPTH:],
                                        "opcode": membar.opcode, "membars": 0, "executed": 0,
                                        "membar_samples": 0})
        fence["membars"] += 1
        fence["executed"] += membar.executed
        for waiter in instructions[i + 1:i + 1 + FENCE_WINDOW]:
            fence["membar_samples"] += waiter.stalls.get(MEMBAR, 0)
            # The fences come in pairs (MEMBAR.ALL.CTA; MEMBAR.ALL.GPU): a stall on the second
            # waits for the first, and what follows waits for the second.
            if waiter.opcode.startswith("MEMBAR"):
                break
    return sorted(fences.values(), key=lambda f: (-f["membar_samples"], -f["executed"]))


def summarise_kernel(kernel: Kernel, stacks: dict[int, Stack], top: int) -> dict:
    def call_site(ins: Instruction) -> Stack:
        return stacks.get(ins.offset, ())[-CALL_DEPTH:]

    def leaf(ins: Instruction) -> Stack:
        return stacks.get(ins.offset, ())[:1]

    totals = stall_totals(kernel)
    samples = sum(totals.values())
    warps = kernel.grid * kernel.block // WARP
    phases, _ = rank_groups(group_samples(kernel, call_site), None)
    phases_nb, working = rank_groups(group_samples(kernel, call_site, (BARRIER,)), None)
    lines, _ = rank_groups(group_samples(kernel, leaf, (BARRIER,)), top)
    return {
        "label": kernel.label, "name": kernel.name, "instructions": len(kernel.instructions),
        "samples": samples, "samples_column": kernel.samples_column,
        "samples_excluding_barrier": working,
        "stall_shares": {r: n / samples for r, n in totals.most_common()} if samples else {},
        "stall_samples": dict(totals.most_common()),
        "duration_us": kernel.duration_us, "grid": kernel.grid, "block": kernel.block,
        "warp_us_per_sample": (kernel.duration_us * warps / samples
                               if kernel.duration_us and samples else None),
        "call_sites": phases, "call_sites_excluding_barrier": phases_nb,
        "top_lines_excluding_barrier": lines,
        "fences": summarise_fences(kernel, stacks),
        "membar_samples": totals.get(MEMBAR, 0),
    }


# ------------------------------------------------------------------------------------- output


def short_reason(reason: str) -> str:
    return reason.removeprefix("stall_")


def format_frame(frame: Frame) -> str:
    return f"{frame[0]}:{frame[1]}" if frame[1] else frame[0]


def format_chain(stack: Stack) -> str:
    return " < ".join(format_frame(f) for f in stack) if stack else "(no line info)"


def format_stalls(stalls: dict[str, int], n: int = 4) -> str:
    total = sum(stalls.values()) or 1
    return "  ".join(f"{short_reason(r)} {100 * v / total:.0f}%" for r, v in list(stalls.items())[:n])


def print_table(title: str, rows: list[dict], limit: int, total: int) -> None:
    print(f"  {title}")
    width = max([len(format_chain(r["key"])) for r in rows[:limit]] + [10])
    for r in rows[:limit]:
        print(f"    {r['samples']:7d} {100 * r['share']:5.1f}%  {format_chain(r['key']):{width}}  "
              f"{format_stalls(r['stalls'])}")
    rest = rows[limit:]
    if rest:
        n = sum(r["samples"] for r in rest)
        print(f"    {n:7d} {100 * n / total if total else 0:5.1f}%  ({len(rest)} more)")


def print_overview(summaries: list[dict], check: dict) -> None:
    print(f"listing check: {check['mismatches']} of {check['instructions']} opcodes differ")
    labels = [s["label"] for s in summaries]
    print(f"{'':24}" + "".join(f"{lab:>12}" for lab in labels))
    rows = [("samples", [f"{s['samples']:d}" for s in summaries]),
            ("duration us", [f"{s['duration_us']:.1f}" if s["duration_us"] else "-"
                             for s in summaries]),
            ("grid x block", [f"{s['grid']}x{s['block']}" for s in summaries]),
            ("warp-us / sample", [f"{s['warp_us_per_sample']:.2f}" if s["warp_us_per_sample"]
                                  else "-" for s in summaries])]
    reasons = sorted({r for s in summaries for r in s["stall_shares"]},
                     key=lambda r: -sum(s["stall_shares"].get(r, 0) for s in summaries))
    for r in reasons:
        if all(s["stall_shares"].get(r, 0) < 0.0005 for s in summaries):
            continue
        rows.append((f"  {short_reason(r)}", [f"{100 * s['stall_shares'].get(r, 0):.1f}%"
                                               for s in summaries]))
    for name, values in rows:
        print(f"{name:24}" + "".join(f"{v:>12}" for v in values))
    for s in summaries:
        if s["samples_column"] != s["samples"]:
            print(f"note: {s['label']}: '# Samples' sums to {s['samples_column']}, "
                  f"the stall columns to {s['samples']}")


def print_fences(summary: dict) -> None:
    executed = [f for f in summary["fences"] if f["executed"] or f["membar_samples"]]
    stalled = [f for f in executed if f["membar_samples"]]
    counted = sum(f["membar_samples"] for f in stalled)
    print(f"  fences: stall_membar samples in the {FENCE_WINDOW} instructions after a MEMBAR "
          f"({counted} of {summary['membar_samples']})")
    width = max([len(format_frame(f["leaf"])) for f in stalled] + [10])
    for f in stalled:
        print(f"    {f['membar_samples']:7d}  {f['opcode']:15} {format_frame(f['leaf']):{width}}"
              f"  x{f['membars']:<2d} exec {f['executed']:8d}  at {format_chain(f['call_site'])}")
    # Only counted: listed they would double the table, being mostly the MEMBAR.ALL.CTA half of
    # each CTA+GPU pair, which is cheap (the GPU MEMBAR right after it shows no membar stall).
    idle = collections.Counter(f["opcode"] for f in executed if not f["membar_samples"])
    if idle:
        print("    executed without membar samples: "
              + ", ".join(f"{op} x{n}" for op, n in sorted(idle.items())))


def print_kernel(summary: dict, top: int, sites: int) -> None:
    print()
    print(f"== {summary['label']}: {summary['name']}, {summary['instructions']} instructions, "
          f"{summary['samples']} samples ({summary['samples_excluding_barrier']} not at a barrier)")
    print_table("by call site (outermost two inline frames), all samples",
                summary["call_sites"], sites, summary["samples"])
    print_table("by call site, excluding stall_barrier",
                summary["call_sites_excluding_barrier"], sites,
                summary["samples_excluding_barrier"])
    print_table(f"top {top} leaf lines, excluding stall_barrier",
                summary["top_lines_excluding_barrier"], top,
                summary["samples_excluding_barrier"])
    print_fences(summary)


def to_json(summaries: list[dict], check: dict, args: argparse.Namespace) -> dict:
    def rows(items: list[dict]) -> list[dict]:
        return [{**r, "key": format_chain(r["key"])} for r in items]

    kernels = []
    for s in summaries:
        kernels.append({
            **s,
            "call_sites": rows(s["call_sites"]),
            "call_sites_excluding_barrier": rows(s["call_sites_excluding_barrier"]),
            "top_lines_excluding_barrier": rows(s["top_lines_excluding_barrier"]),
            "fences": [{**f, "leaf": format_frame(f["leaf"]),
                        "call_site": format_chain(f["call_site"])} for f in s["fences"]],
        })
    return {"profile_dir": str(args.dir), "sass_listing": str(args.sass_listing),
            "kernel_symbol": args.kernel_symbol, "listing_check": check, "kernels": kernels}


# --------------------------------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", type=Path, help="folder with sass.csv.gz (and details.csv.gz)")
    ap.add_argument("--sass-listing", type=Path, required=True,
                    help="nvdisasm -g -gi -c of the profiled cubin (may be .gz)")
    ap.add_argument("--kernel-symbol", default=DEFAULT_SYMBOL)
    ap.add_argument("--top", type=int, default=25, help="leaf lines per kernel")
    ap.add_argument("--sites", type=int, default=8, help="call sites printed per table")
    ap.add_argument("--json", type=Path, help="write the whole summary here")
    args = ap.parse_args()

    sass_csv = args.dir / "sass.csv.gz"
    if not sass_csv.exists():
        print(f"error: {sass_csv} not found", file=sys.stderr)
        return 2
    kernels = read_sass_csv(sass_csv)
    if not kernels:
        print(f"error: no kernel results in {sass_csv}", file=sys.stderr)
        return 2
    read_launch_details(args.dir / "details.csv.gz", kernels)
    read_raw_duration(args.dir / "raw.csv.gz", kernels)
    opcodes, stacks = read_listing(args.sass_listing, args.kernel_symbol)
    if not opcodes:
        print(f"error: no instructions of section .text.{args.kernel_symbol} in {args.sass_listing}",
              file=sys.stderr)
        return 2

    bad, total, examples = count_mismatches(kernels, opcodes)
    check = {"mismatches": bad, "instructions": total, "listing_instructions": len(opcodes)}
    if bad > MAX_MISMATCH * total:
        print(f"error: {bad} of {total} instructions differ in opcode from {args.sass_listing} "
              f"(more than {100 * MAX_MISMATCH:.1f}%): is it the listing of the profiled build "
              f"and of {args.kernel_symbol}?", file=sys.stderr)
        for e in examples:
            print(f"  {e}", file=sys.stderr)
        return 2

    summaries = [summarise_kernel(k, stacks, args.top) for k in kernels]
    print_overview(summaries, check)
    for s in summaries:
        print_kernel(s, args.top, args.sites)
    if args.json:
        args.json.write_text(json.dumps(to_json(summaries, check, args), indent=1) + "\n")
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
