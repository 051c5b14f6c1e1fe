"""The benchmark harness on CPU with a tiny checkpoint: its measurements, its floor arithmetic, its
report. Speeds are never asserted here (a speed target is not a unit test); only that every figure
is produced, is consistent, and that starvation and byte counts are computed right."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest

from pipecat_qwen_fast.bench import engine as bench_engine
from pipecat_qwen_fast.bench import main as bench
from pipecat_qwen_fast.bench import report as bench_report
from pipecat_qwen_fast.bench import texts
from pipecat_qwen_fast.checkpoints.layout import talker_layout
from pipecat_qwen_fast.engine.engine import QwenTTSEngine

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench" / "baselines"))
import driver_common


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return QwenTTSEngine.from_pretrained(tiny_checkpoint("custom_voice", zero_eos=True), device="cpu",
                                         dtype="float32", backend="torch", progress=False)


def test_texts_cover_the_required_range():
    words = [texts.word_count(u) for u in texts.UTTERANCES]
    assert len(words) >= 20
    assert min(words) == 3 and max(words) == 60
    assert texts.word_count(texts.RTF_TEXT) == 42
    assert texts.frames_for("Hi.") == texts.MIN_FRAMES
    assert texts.frames_for("word " * 1000) == texts.MAX_FRAMES
    assert texts.frames_for("one two three four five") == 25


@pytest.mark.parametrize("underrun", [bench_engine.max_underrun, driver_common.max_underrun])
def test_underrun(underrun):
    # 80 ms chunks arriving every 80 ms: never dry.
    assert underrun([0.0, 0.08, 0.16], [0.08, 0.08, 0.08]) == pytest.approx(0.0)
    # Second chunk 50 ms late, third back on schedule relative to audio played: worst gap is 50 ms.
    assert underrun([0.0, 0.13, 0.17], [0.08, 0.08, 0.08]) == pytest.approx(0.05)
    # A big first chunk buys time for a slow second one.
    assert underrun([0.0, 0.9], [1.0, 0.08]) == 0.0
    assert underrun([0.5], [0.08]) == 0.0


@pytest.mark.parametrize("summarize", [bench_engine.summarize, driver_common.summarize])
def test_summarize_percentiles(summarize):
    s = summarize([float(x) for x in range(1, 101)])
    assert s["n"] == 100 and s["min"] == 1 and s["max"] == 100
    assert s["p50"] == pytest.approx(50.5) and s["p95"] == pytest.approx(95.05)
    assert summarize([]) == {"n": 0, "p50": None, "p95": None, "min": None, "max": None}


def _layout_bytes_per_frame(cfg, elem: int) -> tuple[int, int, int]:
    """Independent count from the checkpoint layout (tensor names -> shapes)."""
    lay = talker_layout(cfg)
    size = lambda keys: sum(math.prod(lay[k]) for k in keys) * elem
    cp = "talker.code_predictor."
    talker = size(k for k in lay if k.startswith("talker.model.layers.")
                  or k in ("talker.model.norm.weight", "talker.codec_head.weight"))
    per_pass = size(k for k in lay if k.startswith((cp + "model.layers.", cp + "small_to_mtp_projection."))
                    or k == cp + "model.norm.weight")
    heads = size(k for k in lay if k.startswith(cp + "lm_head."))
    return talker, (cfg.predictor.num_code_groups - 1) * per_pass, heads


def test_floor_bytes_match_the_checkpoint_layout(engine):
    floor = bench_engine.weight_bytes_per_frame(engine, positions=100)
    talker, predictor, heads = _layout_bytes_per_frame(engine.config, elem=4)
    assert (floor["talker_bytes"], floor["predictor_bytes"], floor["predictor_heads_bytes"]) == (talker, predictor, heads)
    stack = engine.config.talker.stack
    assert floor["talker_kv_bytes"] == 2 * stack.num_layers * stack.num_kv_heads * stack.head_dim * 4 * 100
    assert floor["total_bytes"] == talker + predictor + heads + floor["talker_kv_bytes"]


def test_released_06b_floor_is_about_3_3_gb():
    from pipecat_qwen_fast.checkpoints.tiny_configs import read_asset_config
    from pipecat_qwen_fast.config import parse_model_config

    cfg = parse_model_config(read_asset_config("0.6b-custom_voice.config.json"))
    total = sum(_layout_bytes_per_frame(cfg, elem=2))
    assert 3.2e9 < total < 3.4e9  # prior-art §6: ~3.3 GB per frame in bf16


def test_single_stream_measurements(engine):
    ttfc = bench_engine.measure_ttfc(engine, "Hello there.", 12, seed=1)
    assert ttfc > 0
    run = bench_engine.measure_stream(engine, texts.RTF_TEXT, 9, seed=2)
    assert run["frames"] == 9 and run["stop_reason"] == "frame_cap"
    assert run["chunk_sizes"] == [1, 1, 2, 4, 1]  # the default schedule (1, 1, 2, 4, 8, ...) cut at 9 frames
    assert run["audio_s"] == pytest.approx(9 / 12.5)
    assert 0 < run["ttfc_ms"] <= 1e3 * run["wall_s"]
    assert run["underrun_ms"] >= 0
    whole = bench_engine.measure_whole(engine, texts.RTF_TEXT, 9, seed=3)
    assert whole["frames"] == 9 and whole["rtf"] > 0


def test_breakdown_and_floor(engine):
    b = bench_engine.measure_breakdown(engine, 4)
    assert b["frames"] == 4 and b["decode_frame_ms"] > 0 and b["engine_step_ms"] > 0
    # Vocoder figures are differences of two timings: finite, but on a busy CPU not always > 0.
    assert math.isfinite(b["vocoder_ms_per_frame_chunk4"]) and math.isfinite(b["vocoder_ms_per_call_chunk1"])
    assert b["steady_chunk_frames"] == 32 and math.isfinite(b["vocoder_ms_per_frame_steady"])
    assert b["streaming_frame_ms_estimate"] == pytest.approx(b["engine_step_ms"] + b["vocoder_ms_per_frame_steady"])
    assert "split" not in b  # CPU: no CUDA events, no split reported
    assert b["host_overhead_ms"] == pytest.approx(b["engine_step_ms"] - b["decode_frame_ms"])
    positions, how = bench_engine.prompt_positions(engine, texts.RTF_TEXT)
    assert how == "measured" and positions > len(engine.tokenizer.encode(texts.RTF_TEXT))
    runs = [{"wall_s": 1.0, "frames": 10}]
    floor = bench_engine.measure_floor(engine, 100.0, 10, runs, b)
    assert floor["floor_ms_per_frame"] == pytest.approx(1e3 * floor["total_bytes"] / 100e9)
    assert floor["pct_of_roofline"]["streaming_end_to_end"] == pytest.approx(100 * floor["floor_ms_per_frame"] / 100.0)


def test_concurrency_through_engine_service(engine, tmp_path):
    report = bench_engine.Report(tmp_path / "phase.json", {})
    bench_engine.measure_concurrency(engine, [1, 3], 5, bench_engine.Budget(120), report)
    levels = report.data["concurrency"]
    for n in (1, 3):
        lv = levels[str(n)]
        assert lv["streams"] == n and lv["completed"] == n and not lv["errors"]
        assert lv["streams_without_audio"] == 0
        assert lv["ttfc_ms"]["n"] == n and lv["aggregate_frames_per_s"] > 0


def _fake_results() -> dict:
    stream = {"ttfc_ms": 60.0, "wall_s": 2.0, "frames": 250, "rtf": 0.1}
    return {
        "date_utc": "2026-11-22 14:00 UTC", "commit": "abc", "checkpoint": {"size": "0.6b", "variant": "custom_voice"},
        "texts": {"rtf_text_words": 42, "rtf_frames": 250, "ttfc_utterances": 24, "ttfc_words_range": [3, 60]},
        "phases": {
            "ceilings": {"gpu": "NVIDIA H200", "copy_bandwidth_gbs": 4000.0, "phase_status": "ok"},
            "torch": {"available": True, "load_s": 5.0, "first_request_ttfc_ms": 90.0,
                      "ttfc_warm_ms": {"p50": 50.0, "p95": 70.0}, "streaming": {"runs": [stream], "rtf_median": 0.1},
                      "whole": {"runs": [stream], "rtf_median": 0.08}, "phase_status": "ok"},
            "megakernel": {"available": False, "reason": "not built", "phase_status": "ok"},
            "faster": {"load_s": 2.0, "whole": {"rtf_median": 0.25},
                       "streaming_chunk12": {"ttfc_warm_ms": {"p50": 300.0, "p95": 330.0}, "rtf_median": 0.3,
                                             "runs": [{"ttfc_ms": 320.0}]},
                       "phase_status": "ok"},
            "official": {"phase_status": "stopped at its 100 s budget"},
        },
    }


def test_report_states_ratios_and_missing_rows():
    md = bench_report.render(_fake_results())
    assert "6.0x faster (ours 50.0 vs 300.0) ms" in md  # TTFC vs faster chunk 12
    assert "3.0x faster (ours 0.100 vs 0.300)" in md  # streaming RTF
    assert "3.1x faster (ours 0.080 vs 0.250)" in md  # whole-utterance RTF
    assert "not measured: not built" in md
    assert "official qwen_tts | not measured: stopped at its 100 s budget" in md
    assert "| faster-qwen3-tts chunk 12: TTFC on the long sentence (ms) | 327 | 320.0 | 0.98 |" in md
    assert bench_report._compare(2.0, 4.0) == "2.0x slower (ours 4.0 vs 2.0)"
    # An empty run renders too, and says what it lacks instead of guessing.
    empty = bench_report.render({"phases": {}})
    assert "n/a: no engine phase finished its streaming runs" in empty
    assert "n/a (no engine phase reported a floor)" in empty


def test_cli_rejects_unknown_backend():
    with pytest.raises(SystemExit, match="unknown warp; valid: torch, auto, megakernel, eager"):
        bench.parse_args(["--model", "x", "--out", "y", "--backends", "torch,warp"])


def test_rope_fix_reads_rope_parameters():
    from transformers import MimiConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = MimiConfig()
    assert getattr(config, "rope_theta", None) is None  # what breaks qwen-tts-hf on transformers 5
    theta = config.rope_parameters["rope_theta"]

    # qwen-tts-hf registers an initializer of this shape (it reads config.rope_theta).
    def registered(cfg, device=None, seq_len=None, layer_type=None):
        dim = cfg.head_dim
        return 1.0 / (cfg.rope_theta ** (np.arange(0, dim, 2) / dim)), 1.0

    saved = ROPE_INIT_FUNCTIONS.get("default")
    ROPE_INIT_FUNCTIONS["default"] = registered
    try:
        assert driver_common.fix_rope_init_for_transformers5() == "installed"
        assert driver_common.fix_rope_init_for_transformers5() == "already installed"
        inv_freq, scale = ROPE_INIT_FUNCTIONS["default"](config, None)
        assert scale == 1.0 and inv_freq[1] == pytest.approx(theta ** (-2 / config.head_dim))
    finally:
        if saved is None:
            ROPE_INIT_FUNCTIONS.pop("default", None)
        else:
            ROPE_INIT_FUNCTIONS["default"] = saved
