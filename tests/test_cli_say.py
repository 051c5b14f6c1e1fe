"""`qwen-fast-tts say` and the CLI's help (issue 32, items 13-15): the output path is checked before
the model loads, progress is shown, the WAV grows as the audio streams and an interrupted run keeps
what was made; the help names every backend and shows the defaults. Real engine, tiny checkpoint."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import wave

import numpy as np
import pytest

from pipecat_qwen_fast.cli import main

SAY = [sys.executable, "-m", "pipecat_qwen_fast.cli", "say"]
CPU_ARGS = ["--device", "cpu", "--dtype", "float32", "--backend", "torch"]


def read_wav(path) -> np.ndarray:
    with wave.open(str(path)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (24000, 1, 2)
        return np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")


# -- item 13 ------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["missing-folder", "a-folder"])
def test_a_bad_output_path_is_refused_before_the_model_loads(tmp_path, capsys, where):
    out = tmp_path / "no" / "such" / "folder" / "x.wav" if where == "missing-folder" else tmp_path
    # A model that does not exist: had it been loaded first, the error would be about the model.
    missing_model = tmp_path / "no-model-here"
    started = time.monotonic()
    assert main(["say", "Hello.", "--model", str(missing_model), *CPU_ARGS, "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert str(out) in err and "no-model-here" not in err, err
    assert "Traceback" not in err
    assert time.monotonic() - started < 5


# -- item 14 ------------------------------------------------------------------------------------


def test_say_shows_progress_and_writes_the_same_audio(endless_model, tmp_path):
    out = tmp_path / "hello.wav"
    proc = subprocess.run(
        [*SAY, "Hello there.", "--model", str(endless_model), *CPU_ARGS, "--voice", "ryan", "--seed", "0",
         "--max-frames", "40", "-o", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "s of audio" in proc.stderr.split("wrote")[0], proc.stderr  # progress before the summary
    pcm = read_wav(out)
    assert len(pcm) == 40 * 1920 and np.abs(pcm).max() > 0


def test_an_interrupted_say_keeps_a_valid_wav_of_what_was_made(endless_model, tmp_path):
    out = tmp_path / "long.wav"
    proc = subprocess.Popen(
        [*SAY, "Keep talking for a long time.", "--model", str(endless_model), *CPU_ARGS, "--voice", "ryan",
         "--seed", "0", "--max-frames", "100000", "-o", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        # The file grows while the run goes on: audio is written as it streams.
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and (not out.exists() or os.path.getsize(out) < 44 + 20 * 3840):
            assert proc.poll() is None, proc.communicate()[1]
            time.sleep(0.2)
        assert out.exists() and os.path.getsize(out) >= 44 + 20 * 3840, "no audio written while running"
        mid = read_wav(out)  # readable mid-run: the header follows the data
        assert len(mid) >= 20 * 1920
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err, err
    kept = read_wav(out)
    assert len(kept) >= len(mid) and len(kept) % 1920 == 0
    assert np.array_equal(kept[: len(mid)], mid)


# -- item 15 ------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["say", "voices"])
def test_help_lists_every_backend_and_the_defaults(command, capsys):
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for backend in ("auto", "torch", "megakernel", "eager"):
        assert backend in text
    assert "(default: auto)" in text
    assert "(default: Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice)" in text
    if command == "say":
        assert "(default: out.wav)" in text
