"""`qwen-fast-tts bench streaming-text` (pipecat_qwen_fast/bench/streaming_text.py): its measures,
and a CPU smoke run through both frameworks."""

from __future__ import annotations

import asyncio
import json

import pytest

from pipecat_qwen_fast.bench.streaming_text import REPLY, Run, llm_tokens, llm_words, main
from pipecat_qwen_fast.checkpoints.load import load_text_tokenizer


def test_run_result_first_audio_and_gap():
    async def make() -> Run:
        run = Run(first_token=10.0)
        # 80 ms at 10.05, then 80 ms arriving at 10.20: the player waits 70 ms for it.
        run.audio = [(10.05, 0.08), (10.20, 0.08), (10.21, 0.08)]
        return run

    run = asyncio.run(make())
    result = run.result()
    assert result["first_audio_ms"] == pytest.approx(50.0)
    assert result["gap_s"] == pytest.approx(0.07)
    assert result["audio_s"] == pytest.approx(0.24)
    assert asyncio.run(_empty()).result() == {"error": "no token or no audio"}


async def _empty() -> Run:
    return Run()


def test_llm_tokens_are_the_reply_in_tokenizer_pieces(tiny_checkpoint):
    tok = load_text_tokenizer(tiny_checkpoint("custom_voice"))
    pieces = llm_tokens(tok, REPLY)
    assert "".join(pieces) == REPLY and len(pieces) > len(REPLY.split())
    emoji = llm_tokens(tok, "a 😀 b")
    assert "".join(emoji) == "a 😀 b" and not any("\ufffd" in p for p in emoji)


def test_llm_words_are_whole_words_with_their_space():
    pieces = llm_words(REPLY)
    assert "".join(pieces) == REPLY and pieces[:4] == ["Sure", ",", " I", " can"]


def test_cpu_smoke_run_writes_json(endless_model, tmp_path):
    out = tmp_path / "st"
    args = [
        "--model",
        str(endless_model),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--backend",
        "torch",
        "--quick",
        "--rates",
        "400",
        "--max-frames",
        "12",
        "--out",
        str(out),
    ]
    assert main(args) == 0
    result = json.loads((out / "streaming_text.json").read_text())
    assert result["llm_tokens"] > 20 and result["runs"] == 2
    for framework in ("pipecat", "livekit", "engine"):
        for mode in ("sentence", "token"):
            row = result["frameworks"][framework][mode]["400"]
            assert row["errors"] == 0 and row["first_audio_ms"]["n"] == 2
            assert 0 < row["first_audio_ms"]["p50"] < 30_000
            assert row["audio_s"]["min"] > 0
