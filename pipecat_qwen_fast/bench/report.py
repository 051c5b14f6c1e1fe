"""Turn a benchmark run's merged JSON into the markdown tables of results.md / docs/performance.md.

Every ratio is "baseline / ours" on the same quantity from the same run, so "3.0x" means ours
takes a third of the time. A missing measurement prints as "n/a", never as a guess.

    python -m pipecat_qwen_fast.bench.report results.json > results.md
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

FRAME_MS = 80.0
BACKENDS = ("auto", "megakernel", "torch", "eager")  # ours, the default first


def _get(d: dict | None, *path, default=None):
    for key in path:
        if not isinstance(d, dict) or key not in d:
            return default
        d = d[key]
    return d


def _fmt(x, digits: int = 1, unit: str = "") -> str:
    if x is None:
        return "n/a"
    if isinstance(x, (int, float)):
        return f"{x:.{digits}f}{unit}"
    return str(x)


def _short(reason, limit: int = 160) -> str:
    text = " ".join(str(reason).split()).replace("|", "/")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _difference(x) -> str:
    """A figure measured as the difference of two timings: below zero means below their noise."""
    if isinstance(x, (int, float)) and x < 0:
        return f"below run-to-run noise ({x:.2f})"
    return _fmt(x, 2)


def _compare(baseline, ours, digits: int = 1) -> str:
    """'3.2x faster (a vs b)' where smaller is better for both numbers."""
    if baseline is None or ours is None or ours <= 0 or baseline <= 0:
        return "n/a"
    r = baseline / ours
    verdict = f"{r:.1f}x faster" if r >= 1 else f"{1 / r:.1f}x slower"
    return f"{verdict} (ours {_fmt(ours, digits)} vs {_fmt(baseline, digits)})"


# Figures of ../shared/spec/prior-art.md section 6 (same H200 model, same kind of checkpoint,
# 42-word sentence, 250 frames): each run should reproduce them within noise.
PRIOR_ART = [
    ("official: ms per frame (vocoder excluded)", 152.9, ("official", "whole", "frame_ms_median")),
    ("official: predictor ms per frame", 113.4, ("official", "whole", "predictor_ms_median")),
    ("official: RTF", 1.91, ("official", "whole", "rtf_median")),
    ("faster-qwen3-tts: whole-utterance RTF", 0.250, ("faster", "whole", "rtf_median")),
    ("faster-qwen3-tts: ms per frame", 19.3, ("faster", "breakdown", "frame_ms_instrumented")),
    ("faster-qwen3-tts: predictor graph ms per frame", 13.1, ("faster", "breakdown", "predictor_graph_ms")),
    ("faster-qwen3-tts: talker graph ms per frame", 5.4, ("faster", "breakdown", "talker_graph_ms")),
    ("faster-qwen3-tts chunk 12: TTFC on the long sentence (ms)", 327, ("faster", "streaming_chunk12", "runs")),
    ("faster-qwen3-tts chunk 12: streaming RTF", 0.277, ("faster", "streaming_chunk12", "rtf_median")),
    ("faster-qwen3-tts chunk 1: TTFC on the long sentence (ms)", 78, ("faster", "streaming_chunk1", "runs")),
    ("faster-qwen3-tts chunk 1: streaming RTF", 0.441, ("faster", "streaming_chunk1", "rtf_median")),
    ("device-to-device copy GB/s", 4285, ("ceilings", "copy_bandwidth_gbs")),
]


def prior_art_table(results: dict) -> str:
    phases = results.get("phases", {})
    lines = ["| figure | prior-art §6 | this run | this / prior |", "|---|---|---|---|"]
    for label, prior, path in PRIOR_ART:
        value = _get(phases, *path)
        if path[-1] == "runs":  # TTFC of the 250-frame runs
            value = _median([r.get("ttfc_ms") for r in value or []])
        ratio = f"{value / prior:.2f}" if isinstance(value, (int, float)) else "n/a"
        lines.append(f"| {label} | {prior} | {_fmt(value, 3 if prior < 10 else 1)} | {ratio} |")
    return "\n".join(lines)


def _row(name: str, phase: dict, *, ttfc_first, warm: dict | None, rtf, rtf_whole, mem, **extra) -> dict:
    """One measured row of the main table (`warm`: a TTFC summary with p50 / p95, or None)."""
    return {
        "name": name,
        "ttfc_first": ttfc_first,
        "ttfc_p50": _get(warm, "p50"),
        "ttfc_p95": _get(warm, "p95"),
        "rtf": rtf,
        "rtf_whole": rtf_whole,
        "mem": mem,
        "load_s": phase.get("load_s"),
        **extra,
    }


def implementation_rows(results: dict) -> list[dict]:
    """One row per implementation and mode, with the same columns for all."""
    phases = results.get("phases", {})
    rows = []
    for backend in BACKENDS:
        p = phases.get(backend)
        if p is None:
            continue
        if not p.get("available", True) or "load_s" not in p:
            rows.append({"name": f"ours ({backend})", "missing": p.get("reason") or p.get("error")
                         or p.get("phase_status")})
            continue
        sizes = _get(p, "streaming", "runs", default=[{}])[0].get("chunk_sizes")
        schedule = f"chunks of {', '.join(map(str, sizes[:5]))}, ... frames" if sizes else "chunk sizes not recorded"
        rows.append(_row(
            f"ours ({backend}), streaming, {schedule}", p,
            ttfc_first=p.get("first_request_ttfc_ms"),
            warm=p.get("ttfc_warm_ms"),
            rtf=_get(p, "streaming", "rtf_median"),
            rtf_whole=_get(p, "whole", "rtf_median"),
            mem=p.get("peak_gpu_memory_single_stream_gib"),
        ))
    f = phases.get("faster")
    if f is not None:
        if "load_s" not in f:
            rows.append({"name": "faster-qwen3-tts 0.5.4", "missing": f.get("error") or f.get("phase_status")})
        for chunk, label in ((12, "default"), (1, "smallest")):
            s = f.get(f"streaming_chunk{chunk}")
            if s is None:
                continue
            rows.append(_row(
                f"faster-qwen3-tts, streaming, chunk {chunk} ({label})", f,
                ttfc_first=_get(f, "first_request", "ttfc_ms") if chunk == 12 else None,
                warm=s.get("ttfc_warm_ms"),
                rtf=s.get("rtf_median"),
                rtf_whole=_get(f, "whole", "rtf_median"),
                mem=f.get("peak_gpu_memory_gib"),
            ))
    o = phases.get("official")
    if o is not None:
        if "whole" not in o:
            rows.append({"name": "official qwen_tts", "missing": o.get("error") or o.get("phase_status")})
        else:
            w = o["whole"]
            rows.append(_row(
                "official qwen_tts (qwen-tts-hf), non-streaming", o,
                ttfc_first=_get(o, "first_request", "ttfc_ms"),
                warm=None,
                rtf=None,
                rtf_whole=w.get("rtf_median"),
                mem=o.get("peak_gpu_memory_gib"),
                ttfc_note=f"= whole call ({_fmt(_median_wall(w), 1, ' s')} for "
                          f"{_median([r.get('frames') for r in w.get('runs', [])])} frames)",
            ))
    return rows


def _median(values: list) -> float | None:
    values = sorted(v for v in values if v is not None)
    return values[len(values) // 2] if values else None


def _median_wall(whole: dict) -> float | None:
    return _median([r.get("wall_s") for r in whole.get("runs", [])])


def main_table(results: dict) -> str:
    lines = [
        ("| implementation | TTFC, first request after load (ms) | TTFC warm p50 / p95 (ms) | RTF streaming | "
        "RTF whole utterance | ms per 80 ms frame, end to end (streaming, else whole) | peak GPU memory (GiB) | load (s) |"),
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in implementation_rows(results):
        if "missing" in r:
            lines.append(f"| {r['name']} | not measured: {_short(r['missing'])} | | | | | | |")
            continue
        ttfc = r.get("ttfc_note") or f"{_fmt(r['ttfc_p50'])} / {_fmt(r['ttfc_p95'])}"
        rtf = r["rtf"] if r["rtf"] is not None else r["rtf_whole"]
        per_frame = rtf * FRAME_MS if rtf is not None else None
        lines.append(
            f"| {r['name']} | {_fmt(r['ttfc_first'])} | {ttfc} | {_fmt(r['rtf'], 3)} | {_fmt(r['rtf_whole'], 3)} | "
            f"{_fmt(per_frame, 2)} | {_fmt(r['mem'], 2)} | {_fmt(r['load_s'])} |"
        )
    return "\n".join(lines)


def breakdown_table(results: dict) -> str:
    phases = results.get("phases", {})
    lines = ["| implementation | component | ms per frame |", "|---|---|---|"]
    for backend in BACKENDS:
        b = _get(phases, backend, "breakdown")
        if not b:
            continue
        name = f"ours ({backend})"
        # Runs before the 32-frame steady chunk recorded 16-frame chunks under another key.
        steady = b.get("steady_chunk_frames", 16)
        steady_key = "vocoder_ms_per_frame_steady" if "vocoder_ms_per_frame_steady" in b else "vocoder_ms_per_frame_chunk16"
        items = [
            ("decode_frame, back to back (device-bound)", "decode_frame_ms"),
            ("  talker (28 layers + codec head)", "talker_ms"),
            ("  predictor (15 passes + heads)", "predictor_ms"),
            ("  sampling + embedding glue", "sampling_and_glue_ms"),
            ("engine.step (adds the per-frame EOS read + bookkeeping)", "engine_step_ms"),
            ("  host overhead (engine.step - decode_frame)", "host_overhead_ms"),
            ("vocoder in engine.step, 4-frame chunks, per frame", "vocoder_ms_per_frame_chunk4"),
            (f"vocoder in engine.step, {steady}-frame chunks (the default's steady state), per frame", steady_key),
            ("vocoder in engine.step, one 1-frame chunk", "vocoder_ms_per_call_chunk1"),
        ]
        if b.get("split"):
            lines.append(f"| {name} | talker / predictor split: {_short(b['split'])} | n/a |")
        differences = {"vocoder_ms_per_frame_chunk4", "vocoder_ms_per_frame_chunk16", "vocoder_ms_per_frame_steady",
                       "vocoder_ms_per_call_chunk1",
                       "host_overhead_ms"}
        for label, key in items:
            if b.get(key) is not None:
                shown = _difference(b[key]) if key in differences else _fmt(b[key], 2)
                lines.append(f"| {name} | {label} | {shown} |")
        if b.get("talker_ms") is not None:
            lines.append(f"| {name} | (split measured with CUDA events on module forwards: "
                         f"{_fmt(b.get('decode_frame_ms_instrumented'), 2)} ms per frame with the events) | |")
    fb = _get(phases, "faster", "breakdown")
    if fb:
        for label, key in (("whole frame (instrumented run, vocoder excluded)", "frame_ms_instrumented"),
                           ("  predictor graph", "predictor_graph_ms"), ("  talker graph", "talker_graph_ms"),
                           ("  glue (sampling, embeddings, host)", "glue_ms")):
            lines.append(f"| faster-qwen3-tts | {label} | {_fmt(fb.get(key), 2)} |")
    ow = _get(phases, "official", "whole")
    if ow:
        lines.append(f"| official qwen_tts | whole frame (vocoder excluded) | {_fmt(ow.get('frame_ms_median'), 2)} |")
        lines.append(f"| official qwen_tts |   predictor (`code_predictor.generate`) | "
                     f"{_fmt(ow.get('predictor_ms_median'), 2)} |")
    return "\n".join(lines)


def floor_section(results: dict) -> str:
    phases = results.get("phases", {})
    lines = []
    for backend in BACKENDS:
        fl = _get(phases, backend, "floor")
        if not fl:
            continue
        gb = fl["total_bytes"] / 1e9
        lines.append(
            f"- ours ({backend}): a frame must read at least {gb:.2f} GB (talker {fl['talker_bytes'] / 1e9:.2f}, "
            f"predictor 15 passes {fl['predictor_bytes'] / 1e9:.2f}, predictor heads "
            f"{fl['predictor_heads_bytes'] / 1e9:.3f}, talker K/V at {fl['kv_positions']} positions "
            f"{fl['talker_kv_bytes'] / 1e9:.3f}). At the {_fmt(fl.get('bandwidth_gbs'), 0)} GB/s copy bandwidth "
            f"measured in this run that is a floor of {_fmt(fl.get('floor_ms_per_frame'), 3)} ms per frame "
            f"(RTF {_fmt(fl.get('floor_rtf'), 4)})."
        )
        pct = fl.get("pct_of_roofline") or {}
        if pct:
            lines.append(
                f"  Percent of roofline (floor / measured): decode_frame {_fmt(pct.get('decode_frame'))} %, "
                f"engine.step {_fmt(pct.get('engine_step'))} %, streaming end to end "
                f"{_fmt(pct.get('streaming_end_to_end'))} %."
            )
    return "\n".join(lines) or "n/a (no engine phase reported a floor)"


def concurrency_table(results: dict) -> str:
    phases = results.get("phases", {})
    lines = [
        ("| backend | streams | completed | per-stream RTF p50 / max | TTFC p50 / p95 (ms) | streams with no audio | "
        "starved streams | worst underrun (ms) | aggregate frames/s | peak GPU memory (GiB) |"),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for backend in BACKENDS:
        c = _get(phases, backend, "concurrency")
        if not c:
            continue
        for key, lv in c.items():
            if not isinstance(lv, dict):
                continue
            if "skipped" in lv or "error" in lv:
                lines.append(f"| {backend} | {key} | {lv.get('skipped') or lv.get('error')} | | | | | | | |")
                continue
            cut = " (cut by time budget)" if lv.get("cut_by_budget") else ""
            lines.append(
                f"| {backend} | {lv['streams']} | {lv['completed']}{cut} | "
                f"{_fmt(_get(lv, 'rtf_per_stream', 'p50'), 3)} / {_fmt(_get(lv, 'rtf_per_stream', 'max'), 3)} | "
                f"{_fmt(_get(lv, 'ttfc_ms', 'p50'))} / {_fmt(_get(lv, 'ttfc_ms', 'p95'))} | "
                f"{lv.get('streams_without_audio', 'n/a')} | {lv['starved_streams']} | {_fmt(lv.get('worst_underrun_ms'))} | "
                f"{_fmt(lv.get('aggregate_frames_per_s'))} | {_fmt(lv.get('peak_gpu_memory_gib'), 2)} |"
            )
    return "\n".join(lines)


def ratios(results: dict) -> list[str]:
    """Plain-language ratios of ours (best available backend) to each baseline."""
    phases = results.get("phases", {})
    ours_name = min((b for b in BACKENDS if _get(phases, b, "streaming", "rtf_median")),
                    key=lambda b: phases[b]["streaming"]["rtf_median"], default=None)
    if ours_name is None:
        return ["n/a: no engine phase finished its streaming runs"]
    ours = phases[ours_name]
    o_ttfc = _get(ours, "ttfc_warm_ms", "p50")
    o_rtf = _get(ours, "streaming", "rtf_median")
    o_whole = _get(ours, "whole", "rtf_median")
    ours_long_ttfc = _median([r.get("ttfc_ms") for r in _get(ours, "streaming", "runs", default=[])])
    out = []
    f = phases.get("faster", {})
    for chunk in (12, 1):
        s = f.get(f"streaming_chunk{chunk}") or {}
        out.append(
            f"vs faster-qwen3-tts streaming, chunk {chunk}: time to first audio (warm p50 over the utterances) "
            f"{_compare(_get(s, 'ttfc_warm_ms', 'p50'), o_ttfc)} ms; streaming RTF "
            f"{_compare(s.get('rtf_median'), o_rtf, 3)}"
        )
    out.append(f"vs faster-qwen3-tts whole utterance: RTF {_compare(_get(f, 'whole', 'rtf_median'), o_whole, 3)}")
    o = phases.get("official", {})
    o_first = _median_wall(o.get("whole", {}))
    out.append(
        f"vs the official qwen_tts (non-streaming): whole-utterance RTF "
        f"{_compare(_get(o, 'whole', 'rtf_median'), o_whole, 3)}; time to first audio on the long sentence "
        f"{_compare(o_first and 1e3 * o_first, ours_long_ttfc, 0)} ms"
    )
    return [f"ours ({ours_name}) " + line for line in out]


def render(results: dict) -> str:
    ceil = _get(results, "phases", "ceilings") or {}
    ck = results.get("checkpoint", {})
    tx = results.get("texts", {})
    head = [
        f"# Benchmark: {ceil.get('gpu') or ceil.get('cpu') or 'unknown device'}, {results.get('date_utc')}",
        "",
        f"Commit `{results.get('commit')}`; torch {ceil.get('torch')}, CUDA {ceil.get('cuda')}, driver "
        f"{ceil.get('driver')}. Checkpoint: random-weight {ck.get('size', '')} {ck.get('variant', '')} with its "
        "codec-head EOS row zeroed, so no run stops early: every run is cut at a fixed frame count. "
        f"RTF and per-frame figures: a {tx.get('rtf_text_words')}-word sentence, {tx.get('rtf_frames')} frames "
        f"({_fmt((tx.get('rtf_frames') or 0) / 12.5)} s of audio), median of up to 3 runs after warm-up. TTFC: "
        f"{tx.get('ttfc_utterances')} utterances of {tx.get('ttfc_words_range')} words "
        f"({tx.get('frames_per_word')} frames per word). Every implementation runs the same checkpoint, in bf16 on "
        "CUDA (fp32 on CPU)."
        + (" QUICK MODE (smoke test, numbers meaningless)." if results.get("quick") else ""),
        "",
        (f"Ceilings measured in this run: copy bandwidth {_fmt(ceil.get('copy_bandwidth_gbs'), 0)} GB/s (read + "
        f"write), bf16 matmul {_fmt(ceil.get('bf16_matmul_tflops'), 0)} TFLOP/s, {ceil.get('sm_count')} SMs, "
        f"L2 {ceil.get('l2_cache_mib')} MiB."),
        "",
        "## Single stream",
        "",
        main_table(results),
        "",
        ("RTF = wall time / audio time (lower is faster; 1.0 is real time). TTFC = from the call with text to "
        "the first 24 kHz PCM chunk in host memory. The official implementation has no streaming output: its "
        "first audio is the whole utterance."),
        "",
        "## Ours against the baselines (same run, same checkpoint)",
        "",
        *[f"- {line}" for line in ratios(results)],
        "",
        "## Baselines against the figures of prior-art §6",
        "",
        prior_art_table(results),
        "",
        "## Per-frame breakdown",
        "",
        breakdown_table(results),
        "",
        "## Bandwidth floor",
        "",
        floor_section(results),
        "",
        "## Concurrent streams (one GPU, one engine)",
        "",
        concurrency_table(results),
        "",
        ("A stream starves when a player that started at its first chunk would run out of audio before the "
        "next chunk arrives (worst underrun > 0)."),
        "",
        "## Phases",
        "",
        *[f"- {name}: {p.get('phase_status')} ({p.get('phase_wall_s')} s)" for name, p in results.get("phases", {}).items()],
    ]
    return "\n".join(head) + "\n"


def write_reports(results: dict, out_dir: Path) -> None:
    (Path(out_dir) / "results.md").write_text(render(results))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m pipecat_qwen_fast.bench.report results.json", file=sys.stderr)
        return 2
    sys.stdout.write(render(json.loads(Path(argv[0]).read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
