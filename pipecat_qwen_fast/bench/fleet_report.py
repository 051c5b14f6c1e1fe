"""The fleet benchmark's markdown and plot, from its JSON (written by `qwen-fast-tts bench fleet`).

Re-render them elsewhere, e.g. where matplotlib is installed and the GPU machine had none:

    python -m pipecat_qwen_fast.bench.fleet_report fleet.json --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pipecat_qwen_fast.bench.fleet_workload import ROUNDS_BEFORE_LOW
from pipecat_qwen_fast.bench.report import _fmt, _get

MARKDOWN = "fleet.md"
PLOT = "fleet.png"
COMPARISON = "comparison.md"  # `--through both`: the two endpoints' levels side by side
TITLES = {"engine": "in process", "server": "through the server"}

MODES = (
    # mode, level key, column title, unit of the capacity, JSON key of the capacity
    ("closed", "callers", "callers", "callers", "capacity_callers"),
    ("open", "rate_rps", "requests/s", "requests/s", "capacity_rps"),
)


def _rounds_cell(lv: dict) -> str:
    r = lv.get("rounds")
    if not r:
        return "n/a"
    if "decode_ms_mean" not in r:  # counted, not timed: the wall time only
        streams = r.get("streams_per_round_mean")
        source = r.get("source", "server /metrics")
        where = "server's /metrics" if source == "server /metrics" else source
        return (f"{_fmt(r['wall_ms_mean'], 2)} ({where}: {r['rounds']} rounds"
                + (f", {_fmt(streams, 0)} streams" if streams is not None else "")
                + f", busy {_fmt(100 * (r['busy_fraction'] or 0), 0)} %)")
    return (f"{_fmt(r['wall_ms_mean'], 2)}: {_fmt(r['decode_ms_mean'], 2)} / {_fmt(r['vocoder_ms_mean'], 2)} / "
            f"{_fmt(r['prefill_ms_mean'], 2)} / {_fmt(r['host_ms_mean'], 2)} ({_fmt(r['streams_per_round_mean'], 0)} "
            f"streams, busy {_fmt(100 * (r['busy_fraction'] or 0), 0)} %)")


def _lag(figures: dict | None) -> str:
    return f"{_fmt(figures['p50_ms'], 2)} / {_fmt(figures['p99_ms'], 2)}" if figures and figures.get("n") else "n/a"


def gc_text(pauses: dict | None) -> str:
    """The level's full collections in the benchmark's process: count and longest."""
    if not pauses:
        return "gc n/a"
    full = pauses["gen2"]
    bound = "<= " if full.get("max_is_bound") else ""
    return f"full gc {full['collections']}x, longest {bound}{full['max_ms']:.0f} ms"


def served_gc_text(pauses: dict) -> str:
    """A server's collections over a level: the full ones, then gen0 / gen1 / gen2 counts and
    their ms by process (which process stops what: the engine's its rounds, the server's delivery)."""
    text = gc_text(pauses)
    for process, gens in (pauses.get("by_process") or {}).items():
        counts = " / ".join(str(gens[f"gen{g}"]["collections"]) for g in range(3))
        ms = sum(gens[f"gen{g}"]["total_ms"] for g in range(3))
        text += f"; {process} {counts} ({ms:.0f} ms)"
    return text


def thread_cpu_text(shares: dict | None) -> str:
    """", engine threads' CPU engine 0.62, relay 0.21, pipe 0.04" (each a share of the level's
    wall time: 1.0 is a core's whole time), or nothing where it was not read."""
    return ", engine threads' CPU " + _cpu_list(shares) if shares else ""


def _cpu_list(shares: dict) -> str:
    return ", ".join(f"{name} {share:.2f}" for name, share in shares.items())


def lag_text(loop_lag: dict | None) -> str:
    """A level's event-loop lag, p50 / p99 in ms: the server's (from its /metrics), then each
    caller process's."""
    if not loop_lag:
        return "n/a"
    callers = loop_lag.get("callers") or []
    return (f"server {_lag(loop_lag.get('server'))}; "
            + ("callers " if len(callers) == 1 else f"{len(callers)} caller processes ")
            + ", ".join(_lag(c.get("loop_lag")) for c in callers))


def _checkpoint(ck: dict) -> str:
    if ck.get("size"):
        return f"random-weight {ck['size']} {ck.get('variant', '')}, EOS row zeroed"
    return f"{ck.get('path')}"


# The engine's admission settings (EngineOverloadedError.reason) as the refused column names them.
REFUSAL_WORDS = {"max_round_ms": "round", "max_queued_streams": "queue", "min_slack_ms": "slack",
                 "max_streams": "max streams"}


def refused_why(lv: dict) -> str:
    """What refused the level's calls: by setting, then the chunks under the slack margin."""
    by = ", ".join(f"{REFUSAL_WORDS.get(k, k)} {v}" for k, v in (lv.get("refused_by") or {}).items())
    low = lv.get("low_slack_chunks")
    parts = [p for p in (f"by {by}" if by else "", f"{low} low-slack chunks" if low else "") if p]
    return f" ({'; '.join(parts)})" if parts else ""


def level_table(levels: list[dict], key: str, title: str) -> str:
    lines = [
        (f"| {title} | utterances | first audio p50 / p95 / p99 (ms) | utterances with an underrun | worst lateness "
         "(ms) | frames/s | refused | errors / no audio / cut | round, mean ms: wall: decode / vocoder / prefill / host "
         "| event-loop lag p50 / p99 (ms) | full gc: count, longest | bar |"),
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for lv in levels:
        if "skipped" in lv:
            lines.append(f"| {lv[key]:g} | skipped: {lv['skipped']} | | | | | | | | | | |")
            continue
        fa = lv["first_audio_ms"]
        bar = "met" if lv["meets_bar"] else "missed: " + "; ".join(lv["misses"])
        lines.append(
            f"| {lv[key]:g} | {lv['utterances']} | {_fmt(fa['p50'])} / {_fmt(fa['p95'])} / {_fmt(fa['p99'])} | "
            f"{lv['underrun_utterances']} | {_fmt(lv['worst_lateness_ms'])} | {_fmt(lv['frames_per_s'])} | "
            f"{lv['refused']}{refused_why(lv)} | {lv['errors']} / {lv['no_audio']} / {lv['cut_by_level_end']} | {_rounds_cell(lv)} | "
            f"{lag_text(lv.get('loop_lag'))} | {gc_text(lv.get('gc_pauses'))} | {bar} |"
        )
    return "\n".join(lines)


def low_slack_table(levels: list[dict], key: str, title: str) -> str:
    """Where the low-slack chunks came (bench/fleet_workload.place_low_slack), level by level."""
    lines = [
        ("Low-slack chunks: which chunk of its stream each was, and the three rounds up to its arrival "
         "(ms: wall: decode / vocoder / prefill / host, calls opened), beside any three rounds of the level."),
        "",
        (f"| {title} | chunks | of streamed turns | by chunk | slack p50 / min (ms) | their 3 rounds | "
         "any 3 rounds |"),
        "|---|---|---|---|---|---|---|",
    ]

    def rounds(r: dict) -> str:
        return (f"{_fmt(r['wall_ms'])}: {_fmt(r['decode_ms'])} / {_fmt(r['vocoder_ms'])} / {_fmt(r['prefill_ms'])} / "
                f"{_fmt(r['host_ms'])}, {_fmt(r['opened'])} opened")

    for lv in levels:
        low = lv["low_slack"]
        by_chunk = ", ".join(f"{k}: {v}" for k, v in low["by_chunk"].items())
        mine, anyr = (low[f"{p}_{ROUNDS_BEFORE_LOW}_rounds_mean"] for p in ("last", "any"))
        lines.append(f"| {lv[key]:g} | {low['chunks']} | {low['streamed']} | {by_chunk} | "
                     f"{_fmt(low['slack_ms_p50'])} / {_fmt(low['slack_ms_min'])} | {rounds(mine)} | {rounds(anyr)} |")
    return "\n".join(lines)


def early_chunks_table(levels: list[dict], key: str, title: str) -> str:
    """Every second and third chunk, whole texts beside streamed turns
    (bench/fleet_workload.compare_early_chunks), level by level."""
    lines = [
        ("Second and third chunks, all of them: their slack (ms before playback), and after how many "
         "of the engine's rounds since their stream's first chunk they arrived."),
        "",
        f"| {title} | turns | chunk | chunks | slack p5 / p50 (ms) | rounds since the first chunk: chunks |",
        "|---|---|---|---|---|---|",
    ]
    for lv in levels:
        for kind, chunks in lv["early_chunks"].items():
            for name, c in chunks.items():
                rounds = ", ".join(f"{k}: {v}" for k, v in c["rounds_since_first"].items())
                lines.append(f"| {lv[key]:g} | {kind} | {name} | {c['n']} | "
                             f"{_fmt(c['slack_ms_p5'])} / {_fmt(c['slack_ms_p50'])} | {rounds} |")
    return "\n".join(lines)


def thread_cpu_table(levels: list[dict], key: str, title: str) -> str:
    """The engine's threads' CPU time over each level (`thread_cpu`), level by level."""
    lines = [
        ("The engine's threads' CPU time over each level, as a share of its wall time (1.00: a "
         "core's whole time): the engine thread's rounds, and where the engine runs in a process of "
         "its own, that process's relay (streams and chunks, streamed text cut into tokens) and pipe "
         "reader, which share its GIL."),
        "",
        f"| {title} | CPU by thread |",
        "|---|---|",
    ]
    lines += [f"| {lv[key]:g} | {_cpu_list(lv['thread_cpu'])} |" for lv in levels]
    return "\n".join(lines)


def heap_table(levels: list[dict], key: str, title: str) -> str:
    """The engine's process after each level: its full collections during the level, what they
    freed, and the tracked objects outside the frozen heap then (engine/heap.heap_census)."""
    lines = [
        ("The engine's process: full collections during the level (longest, unreachable objects "
         "they freed), and after it the tracked objects outside the frozen heap, which a full "
         "collection walks, with the most common types."),
        "",
        f"| {title} | full gc: count, longest ms, freed | unfrozen objects gen0 / gen1 / gen2 | most common |",
        "|---|---|---|---|",
    ]
    for lv in levels:
        full = (lv.get("gc_pauses") or {}).get("gen2") or {}
        heap = lv["heap_after"]
        common = ", ".join(f"{name} {n}" for name, n in heap["types"][:6])
        if heap.get("function_modules"):
            common += "; functions from " + ", ".join(f"{m} {n}" for m, n in heap["function_modules"][:3])
        lines.append(f"| {lv[key]:g} | {full.get('collections', 0)}, {_fmt(full.get('max_ms'))}, "
                     f"{full.get('collected', 'n/a')} | {' / '.join(str(n) for n in heap['unfrozen'])} | {common} |")
    return "\n".join(lines)


def render(result: dict) -> str:
    args = result.get("args", {})
    dev = result.get("device_info", {})
    wl = result.get("workload", {})
    out = [
        f"# Fleet benchmark: {dev.get('gpu') or dev.get('cpu') or 'unknown device'}, {result.get('date_utc')}",
        "",
        (f"Commit `{result.get('commit')}`; torch {dev.get('torch')}, CUDA {dev.get('cuda')}. Checkpoint: "
         f"{_checkpoint(result.get('checkpoint') or {})}, backend {result.get('backend_name')}, "
         f"{args.get('dtype')} on {args.get('device')}; loaded in {_fmt(result.get('load_s'))} s. Endpoint: "
         f"{result.get('endpoint')}."),
        "",
        (f"Workload: {wl.get('replies')} agent replies of {wl.get('frames_range')} frames (cut there: the EOS row is "
         f"zeroed); closed loop: each caller speaks, plays the audio at real time, listens "
         f"{wl.get('listen_s')} s, speaks again; first utterances spread over {wl.get('stagger_s')} s; open loop: "
         f"Poisson arrivals. {wl.get('duration_s')} s a level, utterances still running "
         f"{wl.get('drain_s')} s after it are cut. First audio runs from when the request was due. An "
         "underrun is a chunk that reaches its caller after its playback time (the player starts at the "
         "first chunk; playback time = first chunk's arrival + audio received before it)."),
        "",
        (f"Round timing {'on' if result.get('round_timing') else 'off'}"
         + (": each round's wall time split into decode, vocoder, prefill (opening sessions) and the host "
            "rest, with a device synchronization around each timed call." if result.get("round_timing") else ".")),
        "",
        ("Event-loop lag: how late a task sleeping 10 ms woke, p50 / p99 over the level: the server's from "
         "its /metrics histogram (`qwen_tts_event_loop_lag_seconds`, interpolated within its buckets; n/a "
         "where there is no server or it does not publish it), each caller process's from its own samples"
         + (f" (the callers split over {wl['caller_processes']} processes)."
            if (wl.get("caller_processes") or 1) > 1 else " (all the callers in one process).")),
    ]
    for mode, key, title, unit, cap_key in MODES:
        section = result.get(mode)
        if not section:
            continue
        bar = section.get("bar")
        cap = section.get(cap_key)
        out += [
            "",
            f"## {'Closed' if mode == 'closed' else 'Open'} loop",
            "",
            f"Capacity ({bar}): " + (f"**{cap:g} {unit}**." if cap is not None else "**none**: no level met it."),
            "",
            level_table(section.get("levels", []), key, title),
        ]
        # The optional tables, each over the levels that recorded its figure.
        for field, table in (("low_slack", low_slack_table), ("early_chunks", early_chunks_table),
                             ("thread_cpu", thread_cpu_table), ("heap_after", heap_table)):
            levels = [lv for lv in section.get("levels", []) if lv.get(field)]
            if levels:
                out += ["", table(levels, key, title)]
        if section.get("stopped"):
            out += ["", f"Sweep stopped: {section['stopped']}."]
    out += ["", f"Plot: {result.get('plot')}.", ""]
    return "\n".join(out)


def _cells(lv: dict | None) -> list[str]:
    """first audio p50 / p95, utterances with an underrun, frames/s, bar of one level."""
    if lv is None:
        return ["not run", "", "", ""]
    if "skipped" in lv:
        return [f"skipped: {lv['skipped']}", "", "", ""]
    fa = lv["first_audio_ms"]
    bar = "met" if lv["meets_bar"] else "missed: " + "; ".join(lv["misses"])
    return [f"{_fmt(fa['p50'])} / {_fmt(fa['p95'])}", f"{lv['underrun_utterances']} of {lv['utterances']}",
            _fmt(lv["frames_per_s"]), bar]


def render_comparison(results: dict[str, dict]) -> str:
    """The sweeps of one engine in process and through the server (`--through both`), level by
    level, and the server's capacity as a share of the in-process one (issue 37's bar: within 10 %)."""
    base, other = results["engine"], results["server"]
    args, dev, wl = base.get("args", {}), base.get("device_info", {}), base.get("workload", {})
    device = dev.get("gpu") or dev.get("cpu") or "unknown device"
    out = [
        f"# Fleet in process and through the server: {device}, {base.get('date_utc')}",
        "",
        (f"Commit `{base.get('commit')}`. Checkpoint: {_checkpoint(base.get('checkpoint') or {})}, backend "
         f"{base.get('backend_name')}, {args.get('dtype')} on {args.get('device')}, text mode "
         f"{args.get('text_mode') or 'the variant default'}. One engine, loaded once; each level runs in "
         "process (callers on its EngineService), then through the server over the same engine "
         "(`qwen-fast-tts serve`'s WebSocket on loopback, a socket an utterance, the callers in the "
         f"server's process). {wl.get('duration_s')} s a level; the workload, the bar and each "
         "endpoint's full table: `engine/fleet.md`, `server/fleet.md`."),
    ]
    for mode, key, title, unit, cap_key in MODES:
        a, b = base.get(mode), other.get(mode)
        if not a or not b:
            continue
        cap_a, cap_b = a.get(cap_key), b.get(cap_key)
        share = (f"{100 * cap_b / cap_a:.0f} % of in-process" if cap_a and cap_b is not None
                 else "no ratio (a capacity is missing)")
        out += [
            "",
            f"## {'Closed' if mode == 'closed' else 'Open'} loop",
            "",
            (f"Capacity ({a.get('bar')}): in process **{_cap(cap_a, unit)}**, through the server "
             f"**{_cap(cap_b, unit)}**: {share}."),
            "",
            (f"| {title} | in process: first audio p50 / p95 (ms) | underran | frames/s | bar | through the server: "
             "first audio p50 / p95 (ms) | underran | frames/s | bar | p95 through the server - in process (ms) |"),
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        rows_a = {lv[key]: lv for lv in a.get("levels", [])}
        rows_b = {lv[key]: lv for lv in b.get("levels", [])}
        for value in sorted(set(rows_a) | set(rows_b)):
            la, lb = rows_a.get(value), rows_b.get(value)
            measured = [lv for lv in (la, lb) if lv is not None and "skipped" not in lv]
            diff = (_fmt(lb["first_audio_ms"]["p95"] - la["first_audio_ms"]["p95"])
                    if len(measured) == 2 and None not in (la["first_audio_ms"]["p95"], lb["first_audio_ms"]["p95"])
                    else "")
            out.append(f"| {value:g} | " + " | ".join(_cells(la) + _cells(lb)) + f" | {diff} |")
    out.append("")
    return "\n".join(out)


def _cap(value, unit: str) -> str:
    return f"{value:g} {unit}" if value is not None else "none"


def write_comparison(results: dict[str, dict], out_dir: Path) -> None:
    (out_dir / COMPARISON).write_text(render_comparison(results))


def plot(result: dict, path: Path) -> str:
    """Write the plot; returns what the JSON records about it (its file, or why there is none)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return "skipped: matplotlib is not installed (pip install 'pipecat-qwen-fast[bench]')"
    panels = [(m, key, title, result[m]) for m, key, title, _, _ in MODES if result.get(m)]
    panels = [(m, key, title, [lv for lv in s.get("levels", []) if "skipped" not in lv]) for m, key, title, s in panels]
    panels = [p for p in panels if p[3]]
    if not panels:
        return "skipped: no level was measured"
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
    for ax, (mode, key, title, levels) in zip(axes[0], panels):
        x = [lv[key] for lv in levels]
        ax.plot(x, [lv["first_audio_ms"]["p95"] for lv in levels], "o-", color="tab:blue", label="p95 first audio")
        ax.axhline(result[mode]["bar_ms"], color="tab:blue", linestyle=":", label=f"bar {result[mode]['bar_ms']:g} ms")
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, [f"{v:g}" for v in x])
        ax.minorticks_off()
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set_xlabel(title)
        ax.set_ylabel("p95 first audio (ms)", color="tab:blue")
        ax.set_title(f"{mode} loop")
        twin = ax.twinx()
        twin.plot(x, [100 * (lv["underrun_rate"] or 0.0) for lv in levels], "s--", color="tab:red",
                  label="utterances with an underrun")
        twin.set_ylabel("utterances with an underrun (%)", color="tab:red")
        twin.set_ylim(0, 105)
        handles = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
        ax.legend(handles, [h.get_label() for h in handles], loc="upper left", fontsize=8)
    fig.suptitle(f"Fleet: {_get(result, 'device_info', 'gpu') or 'CPU'}, commit {result.get('commit')}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path.name


def write(result: dict, out_dir: Path) -> None:
    """The plot first (the markdown names it), then the markdown."""
    result["plot"] = plot(result, out_dir / PLOT)
    (out_dir / MARKDOWN).write_text(render(result))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipecat_qwen_fast.bench.fleet_report")
    p.add_argument("json", type=Path)
    p.add_argument("--out", type=Path, default=None, help="folder for fleet.md and fleet.png (default: the JSON's)")
    args = p.parse_args(argv)
    result = json.loads(args.json.read_text())
    out = args.out or args.json.parent
    out.mkdir(parents=True, exist_ok=True)
    write(result, out)
    print(f"{out / MARKDOWN}; plot: {result['plot']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
