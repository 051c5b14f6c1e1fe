"""Issue 4's speed targets judged on one `bench/megakernel_check.py` result: each bar, what the run
measured, met or missed and by how much, the percent of the bandwidth floor, and for a missed kernel
target where its time goes (block 0's per-phase profile of the same run).

    python bench/targets.py bench/results/megakernel_h200_2026-11-24_v25c.json   # prints the Markdown

Plain dicts in and out (no torch, no GPU), so the check script and the CPU tests share it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipecat_qwen_fast.bench.texts import FRAME_RATE_HZ

FRAME_MS = 1e3 / FRAME_RATE_HZ


def _kernel_row(name, bar_ms, measured_ms, floor_ms, source, stack, profile):
    row = {"target": name, "bar": bar_ms, "unit": "ms", "measured": measured_ms, "source": source,
           "percent_of_floor": None if floor_ms is None or not measured_ms else 100 * floor_ms / measured_ms}
    if profile:
        row["where_the_time_goes"] = phase_split(profile, stack)
    return row


def phase_split(profile: dict, stack: str) -> dict:
    """Block 0's phases of one stack ("talker." or "predictor."), largest total first, with the part
    of each spent waiting for the other blocks at its barrier."""
    phases = [(name, e) for name, e in profile["phases"].items() if name.startswith(stack)]
    phases.sort(key=lambda p: -p[1]["total_us"])
    total = sum(e["total_us"] for _, e in phases)
    waiting = sum(e["waiting_us"] for _, e in phases)
    return {
        "total_us": total,
        "waiting_for_other_blocks_us": waiting,
        "phases": [{"phase": name, "count": e["count"], "mean_us": e["mean_us"], "total_us": e["total_us"],
                    "mean_waiting_us": e["mean_waiting_us"]} for name, e in phases],
    }


def judge(row: dict) -> dict:
    """Adds status ("met", "missed", "not measured") and, when missed, the excess over the bar."""
    if row["measured"] is None:
        row["status"] = "not measured"
        return row
    row["ratio"] = row["measured"] / row["bar"]
    row["status"] = "met" if row["measured"] <= row["bar"] else "missed"
    if row["status"] == "missed":
        row["missed_by"] = row["measured"] - row["bar"]
    return row


def summarize_targets(result: dict, size: str = "0.6b", position: int = 100) -> list[dict]:
    """The five targets of issue 4 on `result` (megakernel_check's JSON). Kernel targets use the
    sampling medians at talker position `position` (the checkpoint's default decoding); the
    engine targets use the engine stage (a random 0.6B CustomVoice checkpoint)."""
    r = result.get("sizes", {}).get(size, {})
    modes, floors = r.get("modes", {}), r.get("floor_at_copy_bw", {})
    profile = r.get(f"profile_sampling_pos{position}")

    def median(mode):
        return modes[mode]["median_ms"] if mode in modes else None

    rows = [
        _kernel_row("talker step (28 layers, codec head, code-0 draw)", 0.3,
                    median(f"talker_only_sampling_pos{position}"), floors.get("talker_step_ms"),
                    f"{size} talker_only_sampling_pos{position}", "talker.", profile),
        _kernel_row("15 code-predictor steps with sampling", 1.2, median("predictor_only_sampling"),
                    floors.get("predictor_frame_ms"), f"{size} predictor_only_sampling", "predictor.", profile),
    ]
    engine = result.get("engine") or {}
    stream = engine.get("streaming")
    per_frame = None if not stream else stream["rtf"] * FRAME_MS
    row = {"target": "a streamed frame with its share of the vocoder, end to end", "bar": 2.0, "unit": "ms",
           "measured": per_frame, "source": "engine streaming: RTF x 80 ms",
           "percent_of_floor": None if per_frame is None or "frame_ms" not in floors
           else 100 * floors["frame_ms"] / per_frame}
    kernel_frame = median(f"frame_sampling_pos{position}")
    if per_frame is not None and kernel_frame is not None:
        row["where_the_time_goes"] = {
            "kernel_frame_ms": kernel_frame,
            "rest_ms": per_frame - kernel_frame,
            "rest_is": "vocoder calls, host work, the first chunk's latency, and talker positions past "
                       f"{position} in the {stream['frames']}-frame sentence",
        }
    rows.append(row)
    ttfc = engine.get("ttfc_warm_ms")
    rows.append({"target": "time to first chunk, warm p50", "bar": 10.0, "unit": "ms",
                 "measured": None if not ttfc else ttfc["p50"], "source": "engine: 24 utterances",
                 "percent_of_floor": None if not ttfc or "frame_ms" not in floors or "talker_step_ms" not in floors
                 else 100 * (floors["talker_step_ms"] + floors["frame_ms"]) / ttfc["p50"]})
    first = engine.get("first_request_ttfc_ms")
    rows.append({"target": "first request after load, over the warm p50", "bar": 1.5, "unit": "x",
                 "measured": None if first is None or not ttfc else first / ttfc["p50"],
                 "source": "engine: first request's TTFC / warm p50", "percent_of_floor": None})
    return [judge(row) for row in rows]


def _num(x, unit):
    return "n/a" if x is None else (f"{x:.3f} {unit}" if unit == "ms" else f"{x:.2f}{unit}")


def render_markdown(result: dict, rows: list[dict]) -> str:
    bw = result.get("copy_bandwidth_Bps")
    lines = [
        f"# Megakernel targets: {result.get('gpu', '?')}, {result.get('date_utc', '?')}, commit {result.get('commit', '?')}",
        "",
        (f"Script: `{result.get('script', 'bench/megakernel_check.py')}`. Floors: the weight bytes each part must stream over "
        f"the copy bandwidth measured in the same run ({'n/a' if bw is None else f'{bw / 1e9:.0f} GB/s'}). "
        "The time-to-first-chunk floor is one talker pass for the prefill plus one frame."),
        "",
        "| target | bar | measured | status | % of floor | measured from |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        status = row["status"]
        if status == "missed":
            status = f"missed by {_num(row['missed_by'], row['unit'])} ({row['ratio']:.2f}x the bar)"
        pct = "n/a" if row["percent_of_floor"] is None else f"{row['percent_of_floor']:.1f} %"
        lines.append(f"| {row['target']} | <= {_num(row['bar'], row['unit'])} | {_num(row['measured'], row['unit'])} | "
                     f"{status} | {pct} | {row['source']} |")
    for row in rows:
        where = row.get("where_the_time_goes")
        if row["status"] != "missed" or not where:
            continue
        lines += ["", f"## Where the time goes: {row['target']}", ""]
        if "phases" in where:
            lines.append(f"Block 0's phases, barrier exit to barrier exit: {where['total_us']:.1f} us in all, "
                         f"{where['waiting_for_other_blocks_us']:.1f} us of it waiting for the other blocks.")
            lines += ["", "| phase | count | mean us | total us | mean us waiting |", "|---|---|---|---|---|"]
            for p in where["phases"]:
                lines.append(f"| {p['phase']} | {p['count']} | {p['mean_us']:.2f} | {p['total_us']:.1f} | "
                             f"{p['mean_waiting_us']:.2f} |")
        else:
            lines.append(f"The kernel's frame: {where['kernel_frame_ms']:.3f} ms; the rest, {where['rest_ms']:.3f} ms, "
                         f"is {where['rest_is']}.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    data = json.loads(Path(sys.argv[1]).read_text())
    print(render_markdown(data, summarize_targets(data)), end="")
