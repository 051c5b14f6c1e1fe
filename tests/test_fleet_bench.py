"""The fleet benchmark (`qwen-fast-tts bench fleet`) on CPU: its underrun arithmetic on made-up
arrivals, its capacity pick, its Poisson arrivals, the engine's round timing, and one short real
sweep on the tiny checkpoint. No speed is asserted: only that the figures are produced and right."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import statistics
import time

import pytest
import torch

from pipecat_qwen_fast.bench import fleet, fleet_callers, fleet_report, texts
from pipecat_qwen_fast.bench.fleet_callers import is_overload
from pipecat_qwen_fast.bench.fleet_workload import (
    COMPLETE,
    CUT,
    ERROR,
    REFUSED,
    Utterance,
    bucket_quantile,
    capacity,
    fleet_replies,
    histogram_lag,
    parse_metrics,
    playback_end,
    poisson_arrivals,
    summarize_level,
    verdict,
    worst_lateness,
)
from pipecat_qwen_fast.engine.request import SynthesisRequest
from pipecat_qwen_fast.engine.service import EngineService

FRAME = 1920  # samples in one 80 ms frame at 24 kHz


def utterance(submitted, arrivals, frames_per_chunk, outcome=COMPLETE, ended=None) -> Utterance:
    u = Utterance(caller=0, frames=sum(frames_per_chunk), submitted=submitted, outcome=outcome)
    u.arrivals = list(arrivals)
    u.samples = [FRAME * n for n in frames_per_chunk]
    u.ended = ended if ended is not None else (arrivals[-1] if arrivals else submitted)
    return u


def test_replies_are_short_agent_turns_of_25_to_75_frames():
    replies = fleet_replies()
    assert len(replies) >= 30
    frames = [r.frames for r in replies]
    assert min(frames) == 25 and max(frames) == 75
    assert len(set(frames)) >= 8  # varied lengths, not one size
    assert all(r.frames == texts.frames_for(r.text) for r in replies)


def test_on_time_chunks_are_not_underruns():
    # 1, 3, 6 frames arriving exactly when the audio before them runs out, and early.
    exact = utterance(0.0, [0.010, 0.010 + 0.08, 0.010 + 0.32], [1, 3, 6])
    assert worst_lateness(exact.arrivals, exact.durations) == pytest.approx(0.0, abs=1e-9)
    assert not exact.underrun
    early = utterance(0.0, [0.010, 0.05, 0.06], [1, 3, 6])
    assert early.lateness_s == 0.0 and not early.underrun
    # A big first chunk covers a slow second one.
    assert not utterance(0.0, [0.0, 0.9], [12, 1]).underrun
    # A single chunk cannot be late.
    assert not utterance(0.0, [5.0], [40]).underrun


def test_late_chunks_count_and_lateness_accumulates_on_the_playback_clock():
    # Second chunk due at 0.08 s arrives at 0.13: 50 ms late.
    u = utterance(0.0, [0.0, 0.13, 0.17], [1, 1, 1])
    assert u.underrun and u.lateness_s == pytest.approx(0.05)
    # The clock does not wait for a late chunk: the third is due at 0.16 + 0.08 = 0.24 s whenever
    # the second came, so arriving at 0.40 it is 160 ms late (a player that paused would say 110).
    u = utterance(0.0, [0.0, 0.16 + 0.05, 0.40], [2, 1, 1])
    assert u.lateness_s == pytest.approx(0.16)
    # Late by 2 ms only in the last chunk of a long stream.
    arrivals = [0.0] + [0.08 * k for k in range(1, 40)] + [0.08 * 40 + 0.002]
    assert utterance(0.0, arrivals, [1] * 41).lateness_s == pytest.approx(0.002)


def test_a_stream_cut_unfinished_counts_the_wait_since_its_audio_ran_out():
    # 2 frames (160 ms) heard from 0.1 s; cut at 1.0 s: the player has waited 740 ms.
    u = utterance(0.0, [0.1, 0.18], [1, 1], outcome=CUT, ended=1.0)
    assert u.lateness_s == pytest.approx(1.0 - 0.26)
    assert u.underrun
    # Cut while its audio is still playing: no underrun.
    u = utterance(0.0, [0.1, 0.11], [1, 30], outcome=CUT, ended=1.0)
    assert not u.underrun
    # Cut before any audio: its first audio is at least the wait until the cut, and it is silent.
    u = utterance(2.0, [], [], outcome=CUT, ended=3.5)
    assert u.first_audio_s == pytest.approx(1.5) and u.lateness_s is None and not u.underrun


def test_playback_end_waits_for_late_chunks():
    assert playback_end([1.0, 1.05], [0.08, 0.24]) == pytest.approx(1.32)  # on time: 1.0 + 0.32
    assert playback_end([1.0, 1.5], [0.08, 0.24]) == pytest.approx(1.74)  # waits for the late one


def test_level_summary_counts_each_outcome_and_frames_in_the_window():
    utts = [
        utterance(0.0, [0.02, 0.10], [1, 3]),  # on time
        utterance(0.5, [0.60, 0.75], [1, 3]),  # 70 ms late
        utterance(1.0, [], [], outcome=REFUSED, ended=1.0),
        utterance(1.5, [1.55, 1.63, 1.87, 2.3], [1, 3, 6, 10]),  # frames after the 2 s window do not count
    ]
    s = summarize_level(utts, window_s=2.0)
    assert s["utterances"] == 4 and s["completed"] == 3 and s["refused"] == 1
    assert s["underrun_utterances"] == 1 and s["underrun_rate"] == pytest.approx(1 / 3)
    assert s["worst_lateness_ms"] == pytest.approx(70.0)
    assert s["first_audio_ms"]["n"] == 3 and s["first_audio_ms"]["max"] == pytest.approx(100.0)
    assert s["first_audio_ms"]["p50"] == pytest.approx(50.0)
    assert s["frames_per_s"] == pytest.approx((4 + 4 + 10) / 2.0)
    assert verdict(s, 200.0, underruns_count=False) == ["1 refused"]
    assert len(verdict(s, 200.0, underruns_count=True)) == 2


def test_level_summary_counts_callers_heard_again_after_a_failed_stream():
    def said(caller, submitted, outcome=COMPLETE):
        u = utterance(submitted, [] if outcome == ERROR else [submitted + 0.05], [] if outcome == ERROR else [1],
                      outcome=outcome)
        u.caller = caller
        if outcome == ERROR:
            u.error = "RemoteTTSError: the server closed the stream"
        return u

    utts = [
        said(0, 0.0), said(0, 1.0, ERROR), said(0, 2.0),  # failed, then heard again
        said(1, 0.5, ERROR), said(1, 0.8, ERROR), said(1, 3.0, REFUSED),  # failed twice, never heard again
        said(2, 0.2), said(2, 1.2, ERROR),  # heard only before its failure
        said(3, 0.3),
    ]
    s = summarize_level(utts, window_s=4.0)
    assert s["errors"] == 4 and s["errored_callers"] == 3
    assert s["errored_callers_heard_again"] == 1


def test_capacity_is_the_most_callers_that_met_the_bar():
    def level(callers, p95, underruns=0, refused=0):
        lv = {"callers": callers, "utterances": 50, "first_audio_ms": {"p95": p95},
              "underrun_utterances": underruns, "refused": refused, "errors": 0, "no_audio": 0}
        lv["meets_bar"] = not verdict(lv, 100.0, underruns_count=True)
        return lv

    levels = [level(16, 20.0), level(32, 40.0), level(64, 99.0), level(128, 100.5), level(256, 30.0, underruns=1)]
    assert [lv["meets_bar"] for lv in levels] == [True, True, True, False, False]
    assert capacity(levels, "callers") == 64
    assert capacity(levels + [level(512, 50.0, refused=3)], "callers") == 64
    assert capacity([level(16, 150.0)], "callers") is None
    assert capacity([], "callers") is None
    assert not level(16, None)["meets_bar"]


def test_poisson_arrivals_come_at_the_asked_rate():
    rng = random.Random(7)
    rate, duration = 20.0, 500.0
    times = poisson_arrivals(rate, duration, rng)
    # 10,000 expected, standard deviation 100: within 4 of them.
    assert abs(len(times) - rate * duration) < 400
    assert all(0 <= t < duration for t in times) and times == sorted(times)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert statistics.fmean(gaps) == pytest.approx(1 / rate, rel=0.05)
    # Exponential gaps: standard deviation equals the mean (a fixed-interval schedule would give 0).
    assert statistics.pstdev(gaps) == pytest.approx(1 / rate, rel=0.08)
    assert poisson_arrivals(rate, duration, random.Random(7)) == times
    with pytest.raises(ValueError):
        poisson_arrivals(0.0, 1.0, rng)


def test_overload_is_recognised_by_name(monkeypatch):
    from pipecat_qwen_fast import errors

    class EngineOverloadedError(errors.QwenTTSError):
        pass

    monkeypatch.setattr(errors, "EngineOverloadedError", EngineOverloadedError, raising=False)
    assert is_overload(EngineOverloadedError("busy"))
    assert not is_overload(errors.EngineClosedError("closed"))
    monkeypatch.delattr(errors, "EngineOverloadedError")
    assert not is_overload(RuntimeError("busy"))


@pytest.fixture(scope="module")
def endless(tiny_checkpoint):
    return tiny_checkpoint("custom_voice", zero_eos=True)


@pytest.mark.timeout(180)
def test_in_process_streamed_turns_take_the_servers_engine_path(endless):
    """--in-process-turns streamed: each reply a streamed-text turn given its whole text, as a
    server's dual-track turn is; as much audio as the whole text's."""
    from pipecat_qwen_fast.engine.engine import QwenTTSEngine

    engine = QwenTTSEngine.from_pretrained(endless, device="cpu", dtype="float32", backend="torch", progress=False)
    service = EngineService.for_engine(engine)
    reply = fleet_replies()[0]

    async def hear(streamed: bool) -> list[int]:
        endpoint = fleet_callers.InProcessEndpoint(service, engine.default_voice, "dual_track", streamed)
        samples = [n async for n in endpoint.speak(fleet_callers.Reply(reply.text, 6), seed=3)]
        await endpoint.settle()
        return samples

    try:
        whole, streamed = asyncio.run(hear(False)), asyncio.run(hear(True))
        assert sum(whole) == sum(streamed) == 6 * FRAME
        with pytest.raises(SystemExit, match="dual_track"):
            fleet.parse_args(["--model", str(endless), "--out", "x", "--in-process-turns", "streamed"])
    finally:
        service.close()
        engine.close()


def test_admission_settings_for_an_ab():
    base = ["--model", "m", "--out", "x"]
    assert fleet.parse_args(base).min_slack_ms == "auto" and fleet.parse_args(base).max_round_ms == "auto"
    assert fleet.parse_args(base + ["--min-slack-ms", "off"]).min_slack_ms is None
    assert fleet.parse_args(base + ["--min-slack-ms", "12.5"]).min_slack_ms == 12.5
    assert fleet.parse_args(base + ["--max-round-ms", "40"]).max_round_ms == 40.0
    assert fleet.parse_args(base + ["--max-round-ms", "off"]).max_round_ms is None
    for bad in (["--min-slack-ms", "soon"], ["--max-round-ms", "0"], ["--max-round-ms", "inf"]):
        with pytest.raises(SystemExit):
            fleet.parse_args(base + bad)


@pytest.mark.timeout(180)
def test_in_process_callers_keep_no_finished_stream(endless):
    """A finished engine stream holds ~20 objects for the garbage collector: the in-process
    endpoint keeps a stream for settle() only while the engine has yet to close it."""
    from pipecat_qwen_fast.engine.engine import QwenTTSEngine

    engine = QwenTTSEngine.from_pretrained(endless, device="cpu", dtype="float32", backend="torch", progress=False)
    service = EngineService.for_engine(engine)
    reply = fleet_replies()[0]

    async def speak() -> None:
        endpoint = fleet_callers.InProcessEndpoint(service, engine.default_voice)
        for seed in range(3):  # heard to the end: closed before the last chunk is read
            assert sum([n async for n in endpoint.speak(fleet_callers.Reply(reply.text, 4), seed=seed)]) == 4 * FRAME
        assert endpoint._streams == []
        cut = endpoint.speak(fleet_callers.Reply(reply.text, 40), seed=9)
        await cut.__anext__()
        await cut.aclose()  # cut after its first chunk: kept until the engine closes it
        assert len(endpoint._streams) == 1
        await endpoint.settle()
        assert endpoint._streams == [] and service.admitted_streams == 0

    try:
        asyncio.run(speak())
    finally:
        service.close()
        engine.close()


@pytest.mark.timeout(180)
def test_round_timing_splits_each_round_and_leaves_the_engine_as_it_was(endless):
    from pipecat_qwen_fast.engine.engine import QwenTTSEngine

    engine = QwenTTSEngine.from_pretrained(endless, device="cpu", dtype="float32", backend="torch", progress=False)
    own = set(vars(engine))
    service = EngineService.for_engine(engine)

    async def speak(n: int, frames: int) -> None:
        async def one(i):
            async for _ in service.stream(SynthesisRequest("Hello there.", seed=i, max_frames=frames)):
                pass
        await asyncio.gather(*(one(i) for i in range(n)))

    try:
        service.wait_ready_blocking(60)
        asyncio.run(speak(2, 4))
        assert not service.round_timings  # off by default
        service.time_rounds()
        asyncio.run(speak(3, 7))
        # A round is recorded after it posts its chunks: one more stream, whose round comes after
        # the last of those, so that every round of the three is in (and only those started before it).
        barrier = time.monotonic()
        asyncio.run(speak(1, 1))
        rounds = [r for r in service.round_timings if r.started < barrier]
        assert sum(r.opened for r in rounds) == 3
        assert sum(r.stepped for r in rounds) == 3 * 7  # one frame of each stream a round
        assert all(r.decode_s > 0 for r in rounds if r.stepped)
        assert sum(r.vocoder_s for r in rounds) > 0 and sum(r.prefill_s for r in rounds) > 0
        for r in rounds:
            assert r.wall_s >= r.prefill_s + r.decode_s + r.vocoder_s
            assert r.host_s == pytest.approx(r.wall_s - r.prefill_s - r.decode_s - r.vocoder_s)
        service.time_rounds(False)
        asyncio.run(speak(1, 1))  # its rounds come after the switch and after every timed round
        service.round_timings.clear()
        asyncio.run(speak(1, 3))
        assert not service.round_timings
    finally:
        service.close()
    # The timer's wrappers are gone: nothing shadows the engine's or its parts' methods.
    assert set(vars(engine)) == own
    assert "decode_frame" not in vars(engine.backend) and "decode_stream" not in vars(engine.vocoder)


@pytest.mark.timeout(300)
def test_short_sweep_writes_json_and_markdown(endless, tmp_path):
    out = tmp_path / "fleet"
    rc = fleet.main([
        "--model", str(endless), "--device", "cpu", "--dtype", "float32", "--backend", "torch", "--out", str(out),
        "--mode", "both", "--levels", "2,3", "--rates", "2", "--duration", "2.5", "--stagger", "0.5",
        "--drain", "4", "--warmup", "0", "--bar-ms", "1e9", "--open-bar-ms", "1e9", "--keep-going",
        "--budget", "240", "--commit", "test", "--round-timing",
    ])
    assert rc == 0
    result = json.loads((out / "fleet.json").read_text())
    assert result["commit"] == "test" and result["round_timing"] is True
    assert result["engine_switches"]["min_slack_ms"] is None  # auto: no slack limit on a CPU
    assert result["device_info"]["torch"] and result["date_utc"] and result["args"]["levels"] == [2, 3]
    assert result["backend_name"] and result["load_s"] > 0
    assert result["workload"]["frames_range"] == [25, 75]
    closed = result["closed"]["levels"]
    assert [lv["callers"] for lv in closed] == [2, 3]
    for lv in closed + result["open"]["levels"]:
        assert lv["utterances"] >= 1 and lv["errors"] == 0 and lv["refused"] == 0
        assert lv["low_slack_chunks"] == 0  # counted from the service; no slack limit on a CPU
        heard = lv["completed"] + lv["cut_by_level_end"] - lv["no_audio"]
        assert heard >= 1 and lv["first_audio_ms"]["n"] >= heard
        assert lv["frames_per_s"] > 0
        assert lv["rounds"]["rounds"] > 0 and lv["rounds"]["decode_ms_mean"] > 0
        # The process's collections over the level, by generation (engine/heap.py's GcPauses).
        gcp = lv["gc_pauses"]
        assert set(gcp) == {"gen0", "gen1", "gen2"}
        assert all(g["collections"] >= 0 and 0 <= g["max_ms"] <= g["total_ms"] and g["collected"] >= 0
                   for g in gcp.values())
        # What a full collection would walk after the level (the engine is in this process).
        heap = lv["heap_after"]
        assert len(heap["unfrozen"]) == 3 and sum(heap["unfrozen"]) > 0 and heap["types"]
        assert heap["function_modules"] and all(n > 0 for _, n in heap["function_modules"])
        # The engine thread worked through the level (on the CPU, eager: most of it).
        assert 0 < lv["thread_cpu"]["engine"] <= 1.5
        assert lv["frames_compiled"] == 0  # the CPU's eager engine compiles nothing
        # A level meets this bar (any latency) exactly when nothing was cut unheard, late, refused or failed.
        assert lv["meets_bar"] == (not lv["misses"])
    # Each level of 2 s gives each caller at least one utterance.
    assert closed[0]["utterances"] >= 2 and closed[1]["utterances"] >= 3
    met = [lv["callers"] for lv in closed if lv["meets_bar"]]
    assert result["closed"]["capacity_callers"] == max(met, default=None)
    md = (out / "fleet.md").read_text()
    assert "| callers |" in md and "| requests/s |" in md and "## Open loop" in md
    assert "unfrozen objects gen0 / gen1 / gen2" in md
    assert "; functions from " in md
    assert result["plot"] == "fleet.png" or result["plot"].startswith("skipped: matplotlib")


def test_plot_is_drawn_from_the_json(tmp_path):
    pytest.importorskip("matplotlib")
    level = {"callers": 16, "utterances": 10, "first_audio_ms": {"p50": 5.0, "p95": 9.0, "p99": 9.5},
             "underrun_utterances": 0, "underrun_rate": 0.0, "worst_lateness_ms": 0.0, "frames_per_s": 100.0,
             "refused": 0, "errors": 0, "no_audio": 0, "cut_by_level_end": 0, "rounds": None,
             "meets_bar": True, "misses": []}
    result = {"commit": "x", "closed": {"bar": "p95 <= 100", "bar_ms": 100.0, "levels": [level, {**level, "callers": 32}],
                                        "capacity_callers": 32}}
    fleet_report.write(result, tmp_path)
    assert result["plot"] == "fleet.png"
    assert (tmp_path / "fleet.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.timeout(300)
def test_sweep_through_the_server_on_loopback(endless, tmp_path):
    """The same callers through `qwen-fast-tts serve`'s WebSocket over the same engine (issue 37's
    fleet comparison): every utterance heard, none refused, the engine's rounds still timed."""
    out = tmp_path / "fleet-server"
    rc = fleet.main([
        "--model", str(endless), "--device", "cpu", "--dtype", "float32", "--backend", "torch", "--out", str(out),
        "--through", "server", "--text-mode", "dual_track", "--levels", "2", "--duration", "2.5",
        "--stagger", "0.5", "--drain", "4", "--warmup", "0", "--bar-ms", "1e9", "--budget", "240",
        "--commit", "test", "--round-timing",
    ])
    assert rc == 0
    result = json.loads((out / "fleet.json").read_text())
    assert result["endpoint"].startswith("the server on loopback")
    (level,) = result["closed"]["levels"]
    assert level["utterances"] >= 2 and level["errors"] == 0 and level["refused"] == 0
    heard = level["completed"] + level["cut_by_level_end"] - level["no_audio"]
    assert heard >= 1 and level["frames_per_s"] > 0
    assert level["rounds"]["rounds"] > 0


@pytest.mark.timeout(300)
def test_sweep_in_process_and_through_the_server_side_by_side(endless, tmp_path):
    """--through both (issue 37's 10 % comparison in one run): one engine, each level in process
    then through the server, each endpoint's report in its folder and the two side by side."""
    out = tmp_path / "fleet-both"
    rc = fleet.main([
        "--model", str(endless), "--device", "cpu", "--dtype", "float32", "--backend", "torch", "--out", str(out),
        "--through", "both", "--text-mode", "dual_track", "--levels", "2,3", "--duration", "2",
        "--stagger", "0.5", "--drain", "4", "--warmup", "1", "--bar-ms", "1e9", "--keep-going",
        "--budget", "240", "--commit", "test", "--round-timing",
    ])
    assert rc == 0
    results = {name: json.loads((out / name / "fleet.json").read_text()) for name in ("engine", "server")}
    assert results["engine"]["endpoint"].startswith("in process")
    assert results["server"]["endpoint"].startswith("the server on loopback")
    for result in results.values():
        assert result["load_s"] > 0 and result["warmup"]["utterances"] >= 1
        levels = result["closed"]["levels"]
        assert [lv["callers"] for lv in levels] == [2, 3]
        for lv in levels:
            assert lv["utterances"] >= lv["callers"] and lv["errors"] == 0 and lv["refused"] == 0
            assert lv["rounds"]["rounds"] > 0  # the one engine's rounds, timed for either endpoint
        assert result["closed"]["capacity_callers"] == max(
            (lv["callers"] for lv in levels if lv["meets_bar"]), default=None)
        assert (out / ("engine" if "in process" in result["endpoint"] else "server") / "fleet.md").exists()
    md = (out / fleet_report.COMPARISON).read_text()
    assert "in process **" in md and "through the server **" in md
    rows = [line for line in md.splitlines() if line.startswith(("| 2 |", "| 3 |"))]
    assert len(rows) == 2 and all(row.count("|") == 11 for row in rows)  # 10 columns
    caps = [results[n]["closed"]["capacity_callers"] for n in ("engine", "server")]
    if None not in caps:
        assert f"{100 * caps[1] / caps[0]:.0f} % of in-process" in md


@pytest.mark.timeout(300)
def test_whole_and_streamed_turns_side_by_side_place_their_low_slack_chunks(endless, tmp_path):
    """--in-process-turns both: one engine, each level with whole texts then streamed turns, each
    in its folder; with a margin no chunk after the first can meet (a first chunk is 80 ms of
    audio), every later chunk is low, and each level says which chunks they were."""
    out = tmp_path / "fleet-turns"
    rc = fleet.main([
        "--model", str(endless), "--device", "cpu", "--dtype", "float32", "--backend", "torch", "--out", str(out),
        "--text-mode", "dual_track", "--in-process-turns", "both", "--min-slack-ms", "500", "--levels", "2",
        "--chunk-frames", "2", "--chunk-growth", "2",
        "--duration", "2", "--stagger", "0.2", "--drain", "6", "--warmup", "0", "--bar-ms", "1e9",
        "--budget", "240", "--commit", "test", "--round-timing",
    ])
    assert rc == 0
    results = {name: json.loads((out / name / "fleet.json").read_text()) for name in ("engine", "engine-streamed")}
    assert "streamed-text" not in results["engine"]["endpoint"]
    assert "streamed-text turns (the server's engine path)" in results["engine-streamed"]["endpoint"]
    assert not (out / fleet_report.COMPARISON).exists()  # a comparison is of in process and the server
    for name, result in results.items():
        assert result["engine_switches"]["min_slack_ms"] == 500
        assert result["request_schedule"] == {"chunk_frames": 2, "chunk_growth": 2}
        lv = result["closed"]["levels"][0]
        low = lv["low_slack"]
        assert low["chunks"] == lv["low_slack_chunks"] >= 1
        # Every refusal of the level is the engine's, by the setting that made it.
        assert sum(lv["refused_by"].values()) == lv["refused"]
        assert set(lv["refused_by"]) <= {"min_slack_ms"}  # no other limit is on on a CPU
        assert low["streamed"] == (low["chunks"] if name == "engine-streamed" else 0)
        assert "chunk 1" not in low["by_chunk"] and sum(low["by_chunk"].values()) == low["chunks"]
        assert low["slack_ms_min"] < 500 and len(low["lowest"]) == min(5, low["chunks"])
        assert "Low-slack chunks:" in (out / name / "fleet.md").read_text()
    with pytest.raises(SystemExit, match="--through engine"):
        fleet.parse_args(["--model", "m", "--out", "x", "--text-mode", "dual_track", "--in-process-turns", "both",
                          "--through", "both"])


@pytest.mark.timeout(300)
def test_schedule_ab_runs_the_default_and_the_given_schedule_on_one_engine(endless, tmp_path):
    out = tmp_path / "fleet-schedule"
    rc = fleet.main([
        "--model", str(endless), "--device", "cpu", "--dtype", "float32", "--backend", "torch", "--out", str(out),
        "--chunk-frames", "2", "--chunk-growth", "2", "--schedule-ab", "--levels", "2", "--duration", "1.5",
        "--stagger", "0.2", "--drain", "6", "--warmup", "0", "--bar-ms", "1e9", "--budget", "240",
        "--commit", "test",
    ])
    assert rc == 0
    results = {name: json.loads((out / name / "fleet.json").read_text()) for name in ("engine", "engine-schedule")}
    assert results["engine"]["request_schedule"] == "defaults"
    assert results["engine-schedule"]["request_schedule"] == {"chunk_frames": 2, "chunk_growth": 2}
    assert results["engine-schedule"]["endpoint"].endswith("requests with {'chunk_frames': 2, 'chunk_growth': 2}")
    for result in results.values():
        lv = result["closed"]["levels"][0]
        assert lv["utterances"] >= 2 and lv["errors"] == 0 and lv["frames_per_s"] > 0
        # Round timing off (the default): the level's rounds from the service's own counters.
        assert result["round_timing"] is False
        rounds = lv["rounds"]
        assert rounds["source"] == "engine counters" and rounds["rounds"] > 0 and "decode_ms_mean" not in rounds
        assert rounds["streams_per_round_mean"] >= 1 and 0 < rounds["busy_fraction"] <= 1
    assert "engine counters: " in (out / "engine" / "fleet.md").read_text()


def test_chunk_schedule_for_an_ab_sets_the_in_process_requests():
    base = ["--model", "m", "--out", "x"]
    assert fleet.request_schedule(fleet.parse_args(base)) == {}
    args = fleet.parse_args(base + ["--chunk-frames", "2", "--chunk-growth", "2"])
    assert fleet.request_schedule(args) == {"chunk_frames": 2, "chunk_growth": 2}
    endpoint = fleet_callers.InProcessEndpoint(None, "ryan", schedule=fleet.request_schedule(args))
    opened = []

    def open_(request):
        opened.append(request)
        raise LookupError("recorded")

    endpoint.open = open_
    with pytest.raises(LookupError):
        asyncio.run(anext(endpoint.speak(fleet_callers.Reply("Hi.", 4), seed=1)))
    assert (opened[0].chunk_frames, opened[0].chunk_growth, opened[0].max_frames) == (2, 2, 4)
    with pytest.raises(SystemExit, match="expected an integer >= 1"):
        fleet.parse_args(base + ["--chunk-growth", "0"])
    with pytest.raises(SystemExit, match="--schedule-ab needs"):
        fleet.parse_args(base + ["--schedule-ab"])
    with pytest.raises(SystemExit, match="need --through engine"):
        fleet.parse_args(["--server-url", "http://127.0.0.1:1", "--out", "x", "--chunk-frames", "1"])


def test_comparison_lists_levels_one_side_skipped():
    level = {"callers": 16, "utterances": 10, "first_audio_ms": {"p50": 5.0, "p95": 9.0, "p99": 9.5},
             "underrun_utterances": 0, "frames_per_s": 100.0, "meets_bar": True, "misses": []}
    engine = {"closed": {"bar": "p95 <= 100", "capacity_callers": 32,
                         "levels": [level, {**level, "callers": 32}]}}
    server = {"closed": {"bar": "p95 <= 100", "capacity_callers": 16,
                         "levels": [{**level, "first_audio_ms": {"p50": 6.0, "p95": 11.0, "p99": 12.0}},
                                    {"callers": 32, "skipped": "time budget (3 s left)"}]}}
    md = fleet_report.render_comparison({"engine": engine, "server": server})
    assert "in process **32 callers**, through the server **16 callers**: 50 % of in-process" in md
    assert "| 16 | 5.0 / 9.0 | 0 of 10 |" in md and md.rstrip().splitlines()[-2].endswith("| 2.0 |")
    assert "| 32 |" in md and "skipped: time budget" in md


@pytest.fixture(scope="module")
def served(endless):
    """`qwen-fast-tts serve` in a process of its own on the endless checkpoint: its base URL."""
    import subprocess
    import sys
    import urllib.request

    from pipecat_qwen_fast.bench.server_latency import free_port

    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "pipecat_qwen_fast.cli", "serve", "--model", str(endless),
                               "--device", "cpu", "--dtype", "float32", "--backend", "torch", "--port", str(port),
                               "--log-level", "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(240):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(30)


@pytest.mark.timeout(300)
def test_sweep_against_a_server_of_another_process(served, tmp_path):
    """--server-url: callers on a running server's WebSocket, with no engine in the benchmark's own
    process (the run issue 38 makes through Ray Serve's proxy); its rounds' count, mean wall time
    and streams a round from the server's /metrics, the split into decode and vocoder not being
    published."""
    out = tmp_path / "fleet-url"
    rc = fleet.main([
        "--server-url", served, "--voice", "ryan", "--text-mode", "dual_track",
        "--out", str(out), "--levels", "2", "--duration", "2.5", "--stagger", "0.5", "--drain", "4",
        "--warmup", "0", "--bar-ms", "1e9", "--budget", "120", "--commit", "test",
    ])
    assert rc == 0
    result = json.loads((out / "fleet.json").read_text())
    assert result["endpoint"].startswith("a server at")
    (level,) = result["closed"]["levels"]
    assert level["utterances"] >= 2 and level["errors"] == 0 and level["refused"] == 0
    assert level["frames_per_s"] > 0
    rounds = level["rounds"]
    assert rounds["source"] == "server /metrics" and rounds["rounds"] >= 10
    assert level["low_slack_chunks"] == 0  # from the server's /metrics; no slack limit on a CPU
    assert 0 < rounds["wall_ms_mean"] < 2500 and 0 < rounds["busy_fraction"] <= 1.0
    # Two callers: a round steps one or both of them.
    assert 1.0 <= rounds["streams_per_round_mean"] <= 2.0
    assert " (server's /metrics: " in (out / "fleet.md").read_text()
    # The event loops' lag: the server's from its /metrics, the callers' (all in this process) here.
    lag = level["loop_lag"]
    assert lag["server"]["n"] > 0 and lag["server"]["source"].startswith("server /metrics")
    (callers,) = lag["callers"]
    assert callers["utterances"] == level["utterances"] and callers["loop_lag"]["n"] > 0


@pytest.mark.timeout(300)
def test_callers_split_over_two_processes_against_a_server(served, tmp_path):
    """--caller-processes 2: each level's callers in two spawned processes, each with its own loop
    and client, their utterances merged into one level; the server's loop lag and each caller
    process's own in the report."""
    out = tmp_path / "fleet-procs"
    rc = fleet.main([
        "--server-url", served, "--voice", "ryan", "--text-mode", "dual_track", "--caller-processes", "2",
        "--out", str(out), "--levels", "4", "--duration", "2.5", "--stagger", "0.5", "--drain", "4",
        "--warmup", "0", "--bar-ms", "1e9", "--budget", "150", "--commit", "test",
    ])
    assert rc == 0
    result = json.loads((out / "fleet.json").read_text())
    assert result["endpoint"].endswith("the callers split over 2 processes")
    assert result["workload"]["caller_processes"] == 2 and result["caller_processes_start_s"] > 0
    (level,) = result["closed"]["levels"]
    assert level["errors"] == 0 and level["refused"] == 0 and level["frames_per_s"] > 0
    processes = level["loop_lag"]["callers"]
    assert [p["process"] for p in processes] == [0, 1]
    # Every utterance of the level is one of a process's records; each process ran 2 of the 4 callers.
    assert level["utterances"] == sum(p["utterances"] for p in processes)
    assert all(p["utterances"] >= 2 for p in processes)
    for p in processes:
        lag = p["loop_lag"]
        assert lag["n"] > 0 and 0 <= lag["p50_ms"] <= lag["p99_ms"] <= lag["max_ms"]
        assert p["started_late_ms"] < 500  # each had the plan before the level's start
    server = level["loop_lag"]["server"]
    assert server["n"] > 0 and 0 <= server["p50_ms"] <= server["p99_ms"]
    # The server's collections over the level, from its /metrics, summed and by process (this
    # server runs its engine in its own process: both report).
    served = level["server_gc_pauses"]
    assert set(served) == {"gen0", "gen1", "gen2", "by_process"}
    assert set(served["by_process"]) <= {"server", "engine"} and "server" in served["by_process"]
    # Its engine process's threads, from /metrics: the engine's worked most of the level.
    assert set(level["thread_cpu"]) == {"engine", "relay", "pipe"} and level["thread_cpu"]["engine"] > 0
    md = (out / "fleet.md").read_text()
    assert "split over 2 processes" in md
    row = next(line for line in md.splitlines() if line.startswith("| 4 |"))  # the level table's
    assert row.count("|") == 13 and "; 2 caller processes " in row  # 12 columns, the lag among them


def test_caller_processes_need_a_server_url(endless):
    for source in (["--model", str(endless)], ["--build-size", "tiny"]):
        with pytest.raises(SystemExit, match="--caller-processes needs --server-url"):
            fleet.parse_args([*source, "--out", "x", "--caller-processes", "2"])
    with pytest.raises(SystemExit, match="1 or more"):
        fleet.parse_args(["--server-url", "http://127.0.0.1:1", "--out", "x", "--caller-processes", "0"])
    assert fleet.parse_args(["--server-url", "http://127.0.0.1:1", "--out", "x"]).caller_processes == 1


class Instant:
    """An endpoint with no engine: one frame of audio for each reply, at once."""

    async def speak(self, reply, seed):
        yield FRAME

    async def settle(self) -> None:
        pass

    def take_rounds(self) -> None:
        return None


def test_a_share_of_the_callers_keeps_their_schedule():
    """Split over processes, caller i (arrival k) of a level is due when it is among all of them."""
    replies = fleet_replies()

    async def level(closed: bool, share: tuple[int, int]) -> list[Utterance]:
        kw = {"duration": 0.4, "drain": 0.3, "seed": 5, "share": share, "start": time.monotonic()}
        if closed:
            utts, _ = await fleet_callers.closed_loop(Instant(), replies, callers=7, stagger=0.3,
                                                      listen=(0.05, 0.1), **kw)
        else:
            utts, _ = await fleet_callers.open_loop(Instant(), replies, rate=40.0, **kw)
        return utts

    def firsts(utts: list[Utterance]) -> dict[int, tuple[float, int]]:
        out = {}
        for u in sorted(utts, key=lambda u: u.submitted):
            out.setdefault(u.caller, (u.submitted, u.frames))
        return out

    for closed in (True, False):
        whole = asyncio.run(level(closed, (0, 1)))
        parts = [asyncio.run(level(closed, (p, 3))) for p in range(3)]
        for p, utts in enumerate(parts):
            assert utts and all(u.caller % 3 == p for u in utts)
        merged = [u for utts in parts for u in utts]
        assert firsts(merged) == firsts(whole) and len(firsts(whole)) == (7 if closed else len(whole))
        if not closed:  # every arrival of the plan, once
            assert len(whole) > 6
            assert sorted((u.caller, u.submitted, u.frames) for u in merged) == sorted(
                (u.caller, u.submitted, u.frames) for u in whole)


def test_loop_lag_sees_a_blocked_loop():
    async def blocked() -> list[float]:
        lag = fleet_callers.LoopLag()
        await asyncio.sleep(0.05)
        time.sleep(0.06)  # noqa: ASYNC251 - the loop held: the sampler's wake-up comes late
        await asyncio.sleep(0.03)
        return await lag.stop()

    samples = asyncio.run(blocked())
    assert len(samples) >= 3 and max(samples) >= 0.04 and min(samples) >= 0.0


def test_loop_lag_quantiles_from_a_servers_histogram_deltas():
    def scrape(counts: dict[str, float], total: float) -> dict[str, float]:
        text = "\n".join([
            "# HELP qwen_tts_event_loop_lag_seconds How late.",
            "# TYPE qwen_tts_event_loop_lag_seconds histogram",
            *(f'qwen_tts_event_loop_lag_seconds_bucket{{le="{le}"}} {n}' for le, n in counts.items()),
            f"qwen_tts_event_loop_lag_seconds_count {counts['+Inf']}",
            f"qwen_tts_event_loop_lag_seconds_sum {total}",
            "qwen_tts_engine_rounds_total 12.0",
        ])
        return parse_metrics(text)

    before = scrape({"0.001": 50.0, "0.01": 60.0, "0.1": 60.0, "+Inf": 60.0}, 0.05)
    # Over the level: 100 samples, 90 under 1 ms, 8 in (1, 10] ms, 2 in (10, 100] ms.
    after = scrape({"0.001": 140.0, "0.01": 158.0, "0.1": 160.0, "+Inf": 160.0}, 0.35)
    assert after["qwen_tts_engine_rounds_total"] == 12.0
    lag = histogram_lag(before, after)
    assert lag["n"] == 100 and lag["mean_ms"] == pytest.approx(3.0)
    assert lag["p50_ms"] == pytest.approx(1e3 * 0.001 * 50 / 90)  # within the first bucket
    assert lag["p99_ms"] == pytest.approx(10 + 90 * (99 - 98) / 2)  # halfway into (10, 100] ms
    assert histogram_lag(None, after) is None and histogram_lag(before, {"x": 1.0}) is None
    # Beyond the last finite bound: that bound; nothing observed: none.
    assert bucket_quantile([(0.5, 0.0), (1.0, 1.0), (float("inf"), 5.0)], 0.99) == 1.0
    assert bucket_quantile([(1.0, 0.0), (float("inf"), 0.0)], 0.5) is None
    quiet = histogram_lag(after, after)
    assert quiet["n"] == 0 and quiet["p50_ms"] is None and quiet["mean_ms"] is None


def test_engine_threads_cpu_from_a_servers_metrics():
    """Through a server whose engine runs in a process of its own, its threads' CPU time comes
    from /metrics (server/metrics.py), each level's as a share of its wall time."""
    from pipecat_qwen_fast.bench.fleet import cpu_shares, engine_thread_cpu

    class Remote:
        service = None  # the engine is not in this process

    def scrape(engine: float, relay: float, pipe: float) -> dict[str, float]:
        return parse_metrics("\n".join([
            "# TYPE qwen_tts_engine_thread_cpu_seconds counter",
            f'qwen_tts_engine_thread_cpu_seconds_total{{thread="engine"}} {engine}',
            f'qwen_tts_engine_thread_cpu_seconds_total{{thread="pipe"}} {pipe}',
            f'qwen_tts_engine_thread_cpu_seconds_total{{thread="relay"}} {relay}',
        ]))

    before = engine_thread_cpu(Remote(), scrape(10.0, 2.0, 0.5))
    after = engine_thread_cpu(Remote(), scrape(25.0, 6.0, 1.0))
    assert before == {"engine": 10.0, "relay": 2.0, "pipe": 0.5}
    shares = cpu_shares(before, after, 20.0)
    assert shares == {"engine": 0.75, "pipe": 0.025, "relay": 0.2}
    assert fleet_report.thread_cpu_text(shares) == ", engine threads' CPU engine 0.75, pipe 0.03, relay 0.20"
    assert cpu_shares(None, after, 20.0) is None and cpu_shares(before, {}, 20.0) is None
    assert engine_thread_cpu(Remote(), None) is None and fleet_report.thread_cpu_text(None) == ""


def test_lag_column_reads_each_caller_process():
    lag = {"server": {"n": 10, "p50_ms": 0.25, "p99_ms": 3.5},
           "callers": [{"loop_lag": {"n": 5, "p50_ms": 0.1, "p99_ms": 1.0}},
                       {"loop_lag": {"n": 5, "p50_ms": 0.2, "p99_ms": 2.0}}]}
    assert fleet_report.lag_text(lag) == "server 0.25 / 3.50; 2 caller processes 0.10 / 1.00, 0.20 / 2.00"
    assert fleet_report.lag_text({"server": None, "callers": lag["callers"][:1]}) == "server n/a; callers 0.10 / 1.00"
    assert fleet_report.lag_text(None) == "n/a"


def test_frames_compiled_counts_a_compile_in_this_process():
    # What a level's `frames_compiled` reads: a recompile mid-level holds the GIL for seconds.
    before = fleet.frames_compiled()
    torch.compile(lambda x: x * 3 + 1, backend="eager")(torch.ones(2))
    assert fleet.frames_compiled() == before + 1


def test_low_slack_chunks_are_placed_against_the_long_collections_before_them():
    from pipecat_qwen_fast.bench.fleet_workload import gc_near_low_slack

    # Collections (generation, ms) ending at 10.0, 10.5 (short: not counted), 12.0 and 12.05 s.
    pauses, ended = [(2, 40.0), (0, 0.4), (1, 8.0), (0, 6.0)], [10.0, 10.5, 12.0, 12.05]
    events = [(10.05, 0.012, 1, False),   # 50 ms after the full collection
              (10.52, 0.015, 1, False),   # after a short one only
              (12.08, 0.002, 2, True),    # after two long ones: the longer (gen1) is its
              (15.0, 0.018, 1, False)]    # after none
    got = gc_near_low_slack(events, pauses, ended, level_wall_s=20.0)
    assert got["chunks"] == 4 and got["after_a_long_collection"] == 2
    assert got["longest_generation"] == {"gen1": 1, "gen2": 1} and got["longest_ms"] == 40.0
    # Windows [10.0, 10.1] and [12.0, 12.15] cover 0.25 s of 20.
    assert got["chance"] == pytest.approx(0.25 / 20)
    assert gc_near_low_slack([], pauses, ended, 20.0) is None


def test_served_gc_reads_a_levels_collections_from_the_servers_metrics():
    from pipecat_qwen_fast.bench.fleet_workload import parse_metrics, served_gc
    from pipecat_qwen_fast.server.metrics import ServerMetrics

    metrics = ServerMetrics(active=lambda: 0, queued=lambda: 0, in_use=lambda: 0, sockets=lambda: 0,
                            capacity=1, ready=lambda: True)
    metrics.observe_gc(2, 0.004)  # before the level: not counted
    before = parse_metrics(metrics.render().decode())
    for generation, seconds in ((0, 0.0003), (0, 0.0004), (2, 0.03), (2, 0.008)):
        metrics.observe_gc(generation, seconds)
    level = served_gc(before, parse_metrics(metrics.render().decode()))
    assert level["gen0"]["collections"] == 2 and level["gen0"]["max_ms"] == 0.5
    assert level["gen1"] == {"collections": 0, "total_ms": 0.0, "max_ms": 0.0, "max_is_bound": True}
    full = level["gen2"]
    assert full["collections"] == 2 and full["total_ms"] == 38.0 and full["max_ms"] == 50.0
    assert list(level["by_process"]) == ["server"]  # no engine process has reported one
    assert served_gc(before, {"qwen_tts_engine_rounds_total": 1.0}) is None  # not published
    # An engine process's collections: their own series, summed into the totals.
    for generation, seconds in ((1, 0.012), (2, 0.07)):
        metrics.observe_gc(generation, seconds, "engine")
    level = served_gc(before, parse_metrics(metrics.render().decode()))
    engine, server = level["by_process"]["engine"], level["by_process"]["server"]
    assert engine["gen1"]["collections"] == 1 and engine["gen1"]["max_ms"] == 20.0
    assert engine["gen2"] == {"collections": 1, "total_ms": 70.0, "max_ms": 100.0, "max_is_bound": True}
    assert server["gen2"]["collections"] == 2 and engine["gen0"]["collections"] == 0
    assert level["gen2"]["collections"] == 3 and level["gen2"]["total_ms"] == 108.0
    assert level["gen2"]["max_ms"] == 100.0 and level["gen1"]["collections"] == 1
