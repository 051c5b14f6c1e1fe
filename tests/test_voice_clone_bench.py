"""`qwen-fast-tts bench voice-clone` on CPU with tiny checkpoints: every figure is produced and
consistent (voice creation, cloned first audio, and the frame time of an ICL voice, an x-vector
voice and CustomVoice in one run). No speed is asserted."""

from __future__ import annotations

import json

import pytest

from pipecat_qwen_fast.bench import main as bench
from pipecat_qwen_fast.bench import voice_clone

pytestmark = pytest.mark.timeout(300)

FRAMES = 10


def test_one_run_reports_creation_first_audio_and_frame_times(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "voice_clone.json"
    rc = bench.main([
        "voice-clone", "--model", str(tiny_checkpoint("base", zero_eos=True)),
        "--custom-voice-model", str(tiny_checkpoint("custom_voice", zero_eos=True)),
        "--device", "cpu", "--dtype", "float32", "--backend", "torch", "--seconds", "2",
        "--repeats", "2", "--frames", str(FRAMES), "--frame-repeats", "2", "--out", str(out),
    ])
    assert rc == 0
    result = json.loads(capsys.readouterr().out)
    assert json.loads(out.read_text()) == result
    assert result["create_icl"]["create_voice"]["n"] == 2 and "prime" in result["create_icl"]
    assert "prime" not in result["create_x_vector"]
    assert result["first_audio_icl"]["p50_ms"] > 0 and result["first_audio_x_vector"]["n"] == 2
    ft = result["frame_time"]
    assert ft["frames"] == FRAMES
    for mode in ("icl", "x_vector", "custom_voice"):
        run = ft[mode]
        # The EOS row is zeroed: every run reaches the frame cap.
        assert run["runs"] == 2 and run["frames"] == [FRAMES, FRAMES]
        assert run["ms_per_frame"] > 0 and run["step_ms_p50"] > 0
        assert min(run["ms_per_frame_runs"]) <= run["ms_per_frame"] <= max(run["ms_per_frame_runs"])
    assert ft["icl"]["text_mode"] == ft["x_vector"]["text_mode"] == "dual_track"
    assert ft["custom_voice"]["text_mode"] == "prefill"
    for mode in ("icl", "x_vector"):
        ratio = ft[f"{mode}_over_custom_voice"]
        assert ratio == pytest.approx(ft[mode]["ms_per_frame"] / ft["custom_voice"]["ms_per_frame"])


def test_frame_time_needs_more_than_one_chunk(tiny_checkpoint):
    from pipecat_qwen_fast import QwenTTSEngine

    engine = QwenTTSEngine.from_pretrained(tiny_checkpoint("custom_voice", zero_eos=True),
                                           device="cpu", dtype="float32", backend="torch",
                                           progress=False)
    with pytest.raises(RuntimeError, match="raise --frames"):
        voice_clone.time_frames(engine, engine.default_voice, frames=1, repeats=1, warmup=0)
    engine.close()
