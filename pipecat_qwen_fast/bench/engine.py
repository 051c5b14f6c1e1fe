"""Benchmark phase: our engine with one decode backend (run by `qwen-fast-tts bench`).

Stages, most important first, each written to the JSON file as soon as it is done so a run cut
short by its time budget still reports what it measured: load and the first request, warm TTFC
over the 24 utterances, streaming and whole-utterance RTF on the 250-frame sentence, the per-frame
breakdown, the bandwidth floor, peak memory, then 1/4/16/64 concurrent streams through
EngineService.

Timing rules: TTFC runs from the call with text to the first int16 chunk in host memory; every
device figure is either bracketed by a synchronize or taken from CUDA events.

Benchmark code, not product code: its stages share one budget and one report, so they stay in
one file.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from pipecat_qwen_fast.backends.eager import TorchBackend
from pipecat_qwen_fast.bench import texts
from pipecat_qwen_fast.engine.engine import QwenTTSEngine
from pipecat_qwen_fast.engine.request import SynthesisRequest
from pipecat_qwen_fast.errors import QwenTTSError, UnsupportedFeatureError


class Budget:
    def __init__(self, seconds: float):
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()


class Report:
    """The phase's JSON result, rewritten after every stage (atomic replace)."""

    def __init__(self, path: Path, data: dict):
        self.path = path
        self.data = data
        self.save()

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=_jsonable))
        os.replace(tmp, self.path)

    def put(self, key: str, value) -> None:
        self.data[key] = value
        self.save()


def _jsonable(x):
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    return str(x)


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(values: list[float]) -> dict:
    return {
        "n": len(values),
        "p50": percentile(values, 50),
        "p95": percentile(values, 95),
        "min": min(values) if values else None,
        "max": max(values) if values else None,
    }


def sync(engine: QwenTTSEngine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


# ---------------------------------------------------------------------------------- single stream


def request(engine: QwenTTSEngine, text: str, frames: int, seed: int, first: int = 1,
            chunk: int = SynthesisRequest.chunk_frames,
            **kw) -> SynthesisRequest:
    return SynthesisRequest(
        text, voice=engine.default_voice, seed=seed, max_frames=frames, first_chunk_frames=first, chunk_frames=chunk,
        **kw,
    )


def measure_ttfc(engine: QwenTTSEngine, text: str, frames: int, seed: int) -> float:
    """Seconds from the call with text to the first PCM chunk on the host; the rest is cancelled."""
    t0 = time.perf_counter()
    session = engine.open_session(request(engine, text, frames, seed))
    try:
        while not session.done:
            if engine.step(session):
                return time.perf_counter() - t0
    finally:
        engine.cancel(session)
    raise RuntimeError("the session ended without producing audio")


def measure_stream(engine: QwenTTSEngine, text: str, frames: int, seed: int) -> dict:
    """One streamed utterance: TTFC, wall, audio, chunk arrivals, steady-state frames/s."""
    t0 = time.perf_counter()
    session = engine.open_session(request(engine, text, frames, seed))
    arrivals: list[float] = []
    sizes: list[int] = []
    try:
        while not session.done:
            for chunk in engine.step(session):
                arrivals.append(time.perf_counter() - t0)
                sizes.append(chunk.num_frames)
    finally:
        engine.cancel(session)
    wall = arrivals[-1]
    produced = sum(sizes)
    audio = texts.audio_seconds(produced)
    steady = (produced - sizes[0]) / (arrivals[-1] - arrivals[0]) if len(arrivals) > 1 else None
    return {
        "frames": produced,
        "stop_reason": session.stop_reason,
        "ttfc_ms": 1e3 * arrivals[0],
        "wall_s": wall,
        "audio_s": audio,
        "rtf": wall / audio,
        "frames_per_s_after_first_chunk": steady,
        "chunk_sizes": sizes,
        "max_chunk_gap_ms": 1e3 * max(np.diff(arrivals), default=0.0),
        "underrun_ms": 1e3 * max_underrun(arrivals, [n / texts.FRAME_RATE_HZ for n in sizes]),
    }


def measure_whole(engine: QwenTTSEngine, text: str, frames: int, seed: int) -> dict:
    t0 = time.perf_counter()
    result = engine.synthesize(text, voice=engine.default_voice, seed=seed, max_frames=frames)
    wall = time.perf_counter() - t0
    produced = len(result.pcm) // texts.SAMPLES_PER_FRAME
    return {
        "frames": produced,
        "stop_reason": result.stop_reason,
        "wall_s": wall,
        "audio_s": result.duration_s,
        "rtf": wall / max(result.duration_s, 1e-9),
    }


def max_underrun(arrivals: list[float], durations: list[float]) -> float:
    """Longest silence a player starting at the first chunk would hear (0 = never starved).

    Chunk k is late when it arrives after the audio of chunks 0..k-1 has finished playing.
    """
    worst = 0.0
    played = 0.0
    for k in range(1, len(arrivals)):
        played += durations[k - 1]
        worst = max(worst, (arrivals[k] - arrivals[0]) - played)
    return worst


# ---------------------------------------------------------------------------------- breakdown


class ModuleTimer:
    """CUDA events around module forwards, summed per category (forward hooks, removed after)."""

    def __init__(self, groups: dict[str, list[torch.nn.Module]]):
        self.events: dict[str, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = {g: [] for g in groups}
        self.handles = []
        for name, modules in groups.items():
            for m in modules:
                self.handles.append(m.register_forward_pre_hook(self._pre(name)))
                self.handles.append(m.register_forward_hook(self._post))
        self._open: dict[int, tuple[str, torch.cuda.Event]] = {}

    def _pre(self, name: str):
        def hook(mod, args):
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._open[id(mod)] = (name, ev)

        return hook

    def _post(self, mod, args, out) -> None:
        name, start = self._open.pop(id(mod))
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self.events[name].append((start, end))

    def totals_ms(self) -> dict[str, float]:
        torch.cuda.synchronize()
        return {g: sum(s.elapsed_time(e) for s, e in evs) for g, evs in self.events.items()}

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def decode_frames_back_to_back(engine: QwenTTSEngine, n: int) -> float:
    """Seconds per frame of `backend.decode_frame` with no host read in between (device-bound)."""
    session = engine.open_session(request(engine, texts.RTF_TEXT, n + 4, seed=7, vocode=False))
    try:
        for _ in range(3):
            engine.backend.decode_frame(session.state)
        sync(engine)
        t0 = time.perf_counter()
        for _ in range(n):
            engine.backend.decode_frame(session.state)
        sync(engine)
        return (time.perf_counter() - t0) / n
    finally:
        engine.cancel(session)


def step_wall_per_frame(engine: QwenTTSEngine, n: int, chunk: int | None) -> float:
    """Seconds per `engine.step`: decode + the per-frame EOS read + bookkeeping, plus the vocoder
    on `chunk`-frame chunks exactly as the engine runs it (chunk None: no vocoder)."""
    vocode = chunk is not None
    size = chunk or 4
    session = engine.open_session(
        request(engine, texts.RTF_TEXT, n + 2 * size, seed=8, first=size, chunk=size, vocode=vocode,
                max_chunk_frames=None)
    )
    try:
        for _ in range(size):  # one whole chunk first, so the timed steps hold whole chunks only
            engine.step(session)
        sync(engine)
        t0 = time.perf_counter()
        for _ in range(n):
            engine.step(session)
        sync(engine)
        return (time.perf_counter() - t0) / n
    finally:
        engine.cancel(session)


def instrumented_split(engine: QwenTTSEngine, n: int) -> dict | None:
    """Talker / predictor / rest of decode_frame in GPU time, from CUDA events on module forwards."""
    if engine.device.type != "cuda":
        return None
    if not isinstance(engine.backend, TorchBackend):
        # Graph replays and fused kernels never call the modules' forwards (and an event recorded
        # while a graph is being captured would break the capture): nothing to hook.
        return {"split": "not visible (the frame runs as a CUDA graph or one kernel, not module by module)"}
    talker = engine.model.talker
    cp = talker.code_predictor
    groups = {
        "talker": [talker.model, talker.codec_head],
        "predictor": [cp.model, cp.small_to_mtp_projection, *cp.lm_head],
    }
    session = engine.open_session(request(engine, texts.RTF_TEXT, n + 4, seed=9, vocode=False))
    spans = []
    timer = None
    try:
        # Frame 0 has no talker step (the prefill made its hidden state): leave it out.
        engine.backend.decode_frame(session.state)
        timer = ModuleTimer(groups)
        for _ in range(n):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            engine.backend.decode_frame(session.state)
            end.record()
            spans.append((start, end))
        totals = timer.totals_ms()
    finally:
        if timer is not None:
            timer.remove()
        engine.cancel(session)
    frame_ms = sum(s.elapsed_time(e) for s, e in spans) / n
    talker_ms = totals["talker"] / n
    predictor_ms = totals["predictor"] / n
    return {
        "decode_frame_ms_instrumented": frame_ms,
        "talker_ms": talker_ms,
        "predictor_ms": predictor_ms,
        "sampling_and_glue_ms": frame_ms - talker_ms - predictor_ms,
    }


def measure_breakdown(engine: QwenTTSEngine, n: int) -> dict:
    n -= n % 4  # whole 4-frame chunks
    device_s = decode_frames_back_to_back(engine, n)
    step_s = step_wall_per_frame(engine, n, None)
    voc4_s = step_wall_per_frame(engine, n, 4) - step_s
    steady = SynthesisRequest.max_chunk_frames  # the default schedule's chunk once it stops growing
    voc_steady_s = step_wall_per_frame(engine, max(steady, n - n % steady), steady) - step_s
    voc1_s = step_wall_per_frame(engine, n, 1) - step_s
    out = {
        "frames": n,
        "decode_frame_ms": 1e3 * device_s,
        "engine_step_ms": 1e3 * step_s,
        "host_overhead_ms": 1e3 * (step_s - device_s),
        "vocoder_ms_per_frame_chunk4": 1e3 * voc4_s,
        "steady_chunk_frames": steady,
        "vocoder_ms_per_frame_steady": 1e3 * voc_steady_s,
        "vocoder_ms_per_call_chunk1": 1e3 * voc1_s,
        # A streamed frame once the default schedule (1, 1, 2, 4, 8, 16, 32, 32, ... frames) reaches its steady chunk.
        "streaming_frame_ms_estimate": 1e3 * (step_s + voc_steady_s),
        "streaming_frame_ms_estimate_chunk4": 1e3 * (step_s + voc4_s),
    }
    try:
        split = instrumented_split(engine, n)
    except RuntimeError as e:  # the split is a nice-to-have: never lose the rest of the phase to it
        split = {"split": f"failed: {type(e).__name__}: {e}"}
    if split is not None:
        out.update(split)
    return out


# ---------------------------------------------------------------------------------- floor


def _param_bytes(*modules: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for m in modules for p in m.parameters())


def weight_bytes_per_frame(engine: QwenTTSEngine, positions: int) -> dict:
    """Bytes one frame must read at least: every weight matrix once per pass that uses it.

    Talker: its decoder stack + codec head, once. Predictor: its decoder stack (and input
    projection, 1.7B) once per each of its 15 passes (its 157 MB do not fit the 60 MB L2, so
    each pass re-reads them), one lm_head per pass. Plus the talker's K/V up to `positions`.
    Embedding rows (31 rows of 2 KB) are left out: under 0.01 %.
    """
    talker = engine.model.talker
    cp = talker.code_predictor
    passes = engine.config.talker.num_code_groups - 1
    stack = engine.config.talker.stack
    talker_b = _param_bytes(talker.model.layers, talker.model.norm, talker.codec_head)
    predictor_b = passes * _param_bytes(cp.model.layers, cp.model.norm, cp.small_to_mtp_projection)
    heads_b = _param_bytes(*cp.lm_head)
    elem = torch.finfo(engine.dtype).bits // 8
    kv_b = 2 * stack.num_layers * stack.num_kv_heads * stack.head_dim * elem * positions
    return {
        "talker_bytes": talker_b,
        "predictor_bytes": predictor_b,
        "predictor_heads_bytes": heads_b,
        "talker_kv_bytes": kv_b,
        "kv_positions": positions,
        "total_bytes": talker_b + predictor_b + heads_b + kv_b,
    }


def prompt_positions(engine: QwenTTSEngine, text: str) -> tuple[int, str]:
    """Prompt length of `text` in talker positions, read from the backend state right after the
    prefill where it is exposed, else estimated from the token count."""
    session = engine.open_session(request(engine, text, 4, seed=10, vocode=False))
    try:
        state = session.state
        for value in (getattr(state, "position", None), getattr(getattr(state, "talker_cache", None), "length", None)):
            if isinstance(value, int) and value > 0:
                return value, "measured"
    finally:
        engine.cancel(session)
    # Template and speaker/language codes add about ten positions to the text tokens.
    return len(engine.tokenizer.encode(text)) + 10, "estimated from the token count"


def measure_floor(engine: QwenTTSEngine, bandwidth_gbs: float | None, frames: int, streams: list[dict],
                  breakdown: dict | None) -> dict:
    prompt, how = prompt_positions(engine, texts.RTF_TEXT)
    floor = weight_bytes_per_frame(engine, prompt + frames // 2)
    floor["prompt_positions"] = f"{prompt} ({how})"
    if not bandwidth_gbs:
        return floor
    floor_ms = 1e3 * floor["total_bytes"] / (bandwidth_gbs * 1e9)
    stream_ms = 1e3 * float(np.median([s["wall_s"] / s["frames"] for s in streams]))
    floor.update(bandwidth_gbs=bandwidth_gbs, floor_ms_per_frame=floor_ms, floor_rtf=floor_ms / 80.0)
    pct = {"streaming_end_to_end": 100 * floor_ms / stream_ms}
    if breakdown:
        pct["decode_frame"] = 100 * floor_ms / breakdown["decode_frame_ms"]
        pct["engine_step"] = 100 * floor_ms / breakdown["engine_step_ms"]
    floor["pct_of_roofline"] = pct
    return floor


# ---------------------------------------------------------------------------------- concurrency


async def _run_level(service, engine: QwenTTSEngine, n: int, frames: int, timeout: float,
                     chunk_frames: int = SynthesisRequest.chunk_frames, stagger_s: float = 0.0) -> dict:
    """`n` streams of `frames` frames, opened at once, or one every `stagger_s` seconds (calls that
    do not arrive together); each stream's times count from its own opening."""
    arrivals: list[list[float]] = [[] for _ in range(n)]
    sizes: list[list[int]] = [[] for _ in range(n)]

    async def consume(i: int) -> None:
        async for chunk in streams[i]:
            arrivals[i].append(time.monotonic() - t0 - opened[i])
            sizes[i].append(chunk.num_frames)

    t0 = time.monotonic()
    streams, opened, tasks = [], [], []
    for i in range(n):
        if stagger_s and i:
            await asyncio.sleep(stagger_s)
        opened.append(time.monotonic() - t0)
        streams.append(service.open_stream(request(engine, texts.CONCURRENCY_TEXT, frames, seed=1000 + i,
                                                   chunk=chunk_frames)))
        tasks.append(asyncio.create_task(consume(i)))
    done, pending = await asyncio.wait(tasks, timeout=timeout)
    cut = time.monotonic() - t0
    for s in streams:
        s.cancel()
    for t in pending:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for s in streams:
        await s.wait_closed()
    errors = [repr(t.exception()) for t in done if not t.cancelled() and t.exception() is not None]
    per_stream = []
    for i in range(n):
        a, z = arrivals[i], sizes[i]
        audio = sum(z) / texts.FRAME_RATE_HZ
        complete = sum(z) >= frames
        end = a[-1] if complete else cut - opened[i]
        underrun = max_underrun(a, [k / texts.FRAME_RATE_HZ for k in z]) if a else None
        if a and not complete:
            # Cut by the time budget: the player has been waiting since its last chunk too.
            underrun = max(underrun, (cut - opened[i] - a[0]) - audio)
        per_stream.append({
            "ttfc_s": a[0] if a else None,
            "frames": sum(z),
            "complete": complete,
            "rtf": end / audio if audio else None,
            "underrun_s": underrun,
        })
    ttfcs = [s["ttfc_s"] for s in per_stream if s["ttfc_s"] is not None]
    rtfs = [s["rtf"] for s in per_stream if s["rtf"] is not None]
    frames_total = sum(s["frames"] for s in per_stream)
    return {
        "streams": n,
        "frames_per_stream": frames,
        "wall_s": cut,
        "completed": sum(s["complete"] for s in per_stream),
        "streams_without_audio": sum(1 for s in per_stream if s["ttfc_s"] is None),
        "cut_by_budget": bool(pending),
        "errors": errors[:3],
        "ttfc_ms": {k: (None if v is None else (1e3 * v if k != "n" else v)) for k, v in summarize(ttfcs).items()},
        "rtf_per_stream": summarize(rtfs),
        "starved_streams": sum(1 for s in per_stream if s["underrun_s"] is None or s["underrun_s"] > 0),
        "worst_underrun_ms": 1e3 * max((s["underrun_s"] or 0.0) for s in per_stream),
        "aggregate_frames_per_s": frames_total / cut,
    }


def measure_concurrency(engine: QwenTTSEngine, levels: list[int], frames: int, budget: Budget, report: Report) -> None:
    try:
        from pipecat_qwen_fast.engine.service import EngineService
    except ImportError as e:
        report.put("concurrency", {"error": f"EngineService unavailable: {e}"})
        return
    results: dict = {"via": "EngineService (one engine thread, round-robin, one frame per stream per round)"}
    service = EngineService.for_engine(engine)
    try:
        service.wait_ready_blocking(timeout=60)
        # One unmeasured stream first: the service thread's first CUDA work pays per-thread setup
        # (library handles) that a running server has long paid.
        warm = asyncio.run(_run_level(service, engine, 1, 4, timeout=max(5.0, budget.left() / 10)))
        results["warmup_stream_ttfc_ms"] = warm["ttfc_ms"]["p50"]
        for i, n in enumerate(levels):
            share = budget.left() / (len(levels) - i) - 2
            if share < 3:
                results[str(n)] = {"skipped": "time budget exhausted"}
                continue
            if engine.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(engine.device)
            level = asyncio.run(_run_level(service, engine, n, frames, timeout=share))
            if engine.device.type == "cuda":
                level["peak_gpu_memory_gib"] = torch.cuda.max_memory_allocated(engine.device) / 2**30
            results[str(n)] = level
            report.put("concurrency", results)
    finally:
        service.close()
    report.put("concurrency", results)


# ---------------------------------------------------------------------------------- main


def run_phase(args: argparse.Namespace, report: Report) -> None:
    budget = Budget(args.budget)
    quick = args.quick
    rtf_frames = texts.rtf_frames_for(quick)

    t0 = time.perf_counter()
    try:
        engine = QwenTTSEngine.from_pretrained(
            args.model, device=args.device, dtype=args.dtype, backend=args.backend, progress=False
        )
    except UnsupportedFeatureError as e:
        report.put("available", False)
        report.put("reason", str(e))
        return
    sync(engine)
    device = engine.device
    report.put("available", True)
    report.put("backend_name", engine.backend.name)
    report.put("load_s", time.perf_counter() - t0)
    if device.type == "cuda":
        report.put("gpu_memory_after_load_gib", torch.cuda.memory_allocated(device) / 2**30)
        torch.cuda.reset_peak_memory_stats(device)

    first_text = texts.UTTERANCES[1]
    report.put("first_request_ttfc_ms", 1e3 * measure_ttfc(engine, first_text, texts.frames_for(first_text), 1))
    # The rest is steady state: the warm-up steps a serving engine runs while idle, run now.
    t0 = time.perf_counter()
    engine.finish_warmup()
    sync(engine)
    report.put("background_warmup_s", time.perf_counter() - t0)

    ttfc = []
    for i, text in enumerate(texts.utterances_for(quick)):
        ttfc.append({"words": texts.word_count(text), "ms": 1e3 * measure_ttfc(engine, text, texts.frames_for(text), 100 + i)})
    values = [t["ms"] for t in ttfc]
    report.put("ttfc_warm_ms", {**summarize(values), "per_utterance": ttfc})

    # What is left after each stage is kept for the stages after it: the breakdown needs about
    # 4 x n frames, and concurrency is given at least a third of the phase.
    keep_for_concurrency = args.budget / 3
    streams = [measure_stream(engine, texts.RTF_TEXT, rtf_frames, 200)]
    frame_s = streams[0]["wall_s"] / streams[0]["frames"]
    n_breakdown = 12 if quick else 100

    def fits(seconds: float) -> bool:
        return budget.left() - seconds > keep_for_concurrency + 4 * n_breakdown * frame_s + 5

    def put_streaming() -> None:
        report.put("streaming", {"text_words": texts.word_count(texts.RTF_TEXT), "runs": streams,
                                 "rtf_median": float(np.median([s["rtf"] for s in streams]))})

    wholes: list[dict] = []

    def add_whole(seed: int) -> None:
        wholes.append(measure_whole(engine, texts.RTF_TEXT, rtf_frames, seed))
        report.put("whole", {"runs": wholes, "rtf_median": float(np.median([w["rtf"] for w in wholes]))})

    put_streaming()
    for r in range(1, texts.runs_for(quick)):
        if fits(streams[-1]["wall_s"]):
            streams.append(measure_stream(engine, texts.RTF_TEXT, rtf_frames, 200 + r))
            put_streaming()
        if fits(streams[-1]["wall_s"]) or not wholes:
            add_whole(300 + r)
    if not wholes:
        add_whole(300)

    n_breakdown = max(10, min(n_breakdown, int((budget.left() - keep_for_concurrency) / (5 * frame_s))))
    breakdown = None
    if budget.left() > 5 * n_breakdown * frame_s + 10:
        breakdown = measure_breakdown(engine, n_breakdown)
        report.put("breakdown", breakdown)
    report.put("floor", measure_floor(engine, args.bandwidth_gbs, rtf_frames, streams, breakdown))

    if device.type == "cuda":
        report.put("peak_gpu_memory_single_stream_gib", torch.cuda.max_memory_allocated(device) / 2**30)

    levels = [1, 4] if quick else [1, 4, 16, 64]
    frames = 12 if quick else texts.CONCURRENCY_FRAMES
    measure_concurrency(engine, levels, frames, budget, report)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipecat_qwen_fast.bench.engine")
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--backend", default="torch", choices=["torch", "auto", "megakernel", "eager"])
    p.add_argument("--budget", type=float, default=180.0, help="seconds this phase may use")
    p.add_argument("--bandwidth-gbs", type=float, default=None, help="copy bandwidth measured in this run")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", required=True, type=Path)
    args = p.parse_args(argv)
    report = Report(args.out, {"implementation": f"ours ({args.backend})", "backend": args.backend,
                               "device": args.device, "quick": args.quick})
    try:
        run_phase(args, report)
    except (QwenTTSError, RuntimeError, torch.cuda.OutOfMemoryError) as e:
        report.put("error", f"{type(e).__name__}: {e}")
        raise
    report.put("finished", True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
