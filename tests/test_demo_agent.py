"""The demo agent as a person would use it, on CPU with a tiny random-weight checkpoint.

* Pipecat: ``python -m demo_agent pipecat`` runs for real; an aiortc WebRTC client connects the way
  the prebuilt UI does, types a turn over the data channel and must hear our TTS; then headless
  Chromium checks that the prebuilt UI renders and, on the offline page ``/text/`` (the prebuilt
  UI cannot connect without Daily's CDN), clicks Connect, types, must see the reply and receive
  its audio, and a screenshot is taken. WebRTC will not use loopback addresses, so this part runs
  in a private network namespace (``unshare -n``) with a veth pair that exists only there (see
  ``tests/demo_agent_e2e.py``).
* LiveKit: the demo's own AgentSession (offline LLM + our plugin) answers a typed turn with audio,
  captured without a room; and ``python -m demo_agent livekit console --text`` answers in a pty.

Set DEMO_AGENT_SCREENSHOT=docs/img/demo.png to refresh the README screenshot.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from demo_agent.__main__ import main as demo_main
from demo_agent.offline_llm import GREETING, MAX_ECHO_CHARS, compose_reply, last_user_text
from demo_agent.options import TTSOptions

REPO = Path(__file__).resolve().parent.parent
E2E_SCRIPT = Path(__file__).with_name("demo_agent_e2e.py")
E2E_TIMEOUT = 240
TURN_TIMEOUT = 120
# Int16 peak that separates our TTS's output from silence (random weights are loud, not quiet).
SOUND_PEAK = 300
CPU = {"device": "cpu", "dtype": "float32", "backend": "torch"}


# -- offline LLM script --------------------------------------------------------------------------


def test_offline_reply_greets_helps_and_echoes():
    assert compose_reply("Hi there!") == GREETING
    assert "OPENAI_API_KEY" in compose_reply("help")
    assert compose_reply("  The quick\n brown fox.  ") == "You said: The quick brown fox."
    assert "did not catch" in compose_reply("?!")
    long = compose_reply("word " * 200)
    assert long.endswith("...") and len(long) <= len("You said: ") + MAX_ECHO_CHARS + 3


def test_last_user_text_reads_string_and_part_lists():
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "You said: first"},
        {"role": "user", "content": [{"type": "text", "text": "second"}, {"type": "image_url"}]},
    ]
    assert last_user_text(messages) == "second"
    assert last_user_text(messages[:1]) == ""


# -- CLI -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cpu_service(tiny_checkpoint):
    """The process-wide engine for the tiny checkpoint, loaded once for this module's tests.

    The demo looks engines up in the same registry, so its own load finds this one ready.
    """
    from pipecat_qwen_fast.engine.service import shared_service

    model = str(tiny_checkpoint("custom_voice"))
    service = shared_service(model, **CPU).wait_ready_blocking(TURN_TIMEOUT)
    yield model, service
    service.close()  # the registry forgets it; a later user of this model loads afresh


def test_cli_rejects_bad_voice_and_language_with_the_valid_choices(cpu_service, capsys):
    model, _ = cpu_service
    cpu = ["--device", "cpu", "--dtype", "float32", "--backend", "torch"]
    assert demo_main(["pipecat", "--model", model, *cpu, "--voice", "nobody"]) == 2
    err = capsys.readouterr().err
    assert "unknown voice 'nobody'" in err and "valid voices:" in err and "ryan" in err
    assert demo_main(["pipecat", "--model", model, *cpu, "--language", "klingon"]) == 2
    err = capsys.readouterr().err
    assert "unknown language 'klingon'" in err and "english" in err
    with pytest.raises(SystemExit):
        demo_main(["pipecat", "--model", model, "console"])


def test_keys_choose_cloud_services_and_no_keys_the_offline_llm():
    pytest.importorskip("pipecat")
    from demo_agent.pipecat_bot import create_stt_and_llm
    from demo_agent.pipecat_llm import OfflineLLM

    stt, llm = create_stt_and_llm(None, None)
    assert stt is None and isinstance(llm, OfflineLLM)
    try:
        stt, llm = create_stt_and_llm("test-deepgram-key", "test-openai-key")
    except RuntimeError as e:  # the cloud extras are optional: the error must say what to install
        assert "pip install" in str(e)
    else:
        assert type(stt).__name__ == "DeepgramSTTService"
        assert type(llm).__name__ == "OpenAILLMService"


# -- LiveKit ------------------------------------------------------------------------------------


async def test_livekit_agent_answers_a_typed_turn_with_our_audio(cpu_service, monkeypatch):
    pytest.importorskip("livekit.agents")
    from helpers_frameworks import livekit_helpers

    from demo_agent.livekit_agent import DemoAgent, create_session

    _, CaptureAudioOutput = livekit_helpers()  # the room's speaker, played out instantly

    model, service = cpu_service
    options = TTSOptions(model=model, seed=1, max_frames=10, **CPU)
    monkeypatch.delenv("DEEPGRAM_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    session = create_session(options, service)
    output = CaptureAudioOutput()
    session.output.audio = output
    try:
        await session.start(agent=DemoAgent(greeting=""))
        assert output.frames == []  # no greeting: every frame below answers the typed turn
        result = session.run(user_input="The quick brown fox.")
        await asyncio.wait_for(result, TURN_TIMEOUT)
        said = [
            item.text_content
            for item in session.history.items
            if getattr(item, "type", None) == "message" and item.role == "assistant"
        ]
        assert said == ["You said: The quick brown fox."]
        assert output.frames, "the agent produced no audio"
        assert {f.sample_rate for f in output.frames} == {service.sample_rate}
        pcm = np.concatenate([np.frombuffer(f.data, dtype=np.int16) for f in output.frames])
        assert np.abs(pcm.astype(np.int32)).max() > SOUND_PEAK
        assert service.history and service.history[-1].stop_reason in ("eos", "frame_cap")
    finally:
        await session.aclose()


def _read_pty_until(fd: int, buffer: bytearray, text: str, timeout: float) -> bool:
    """Wait for ``text`` on a terminal, ignoring colours, cursor moves and line wrapping."""
    import re
    import select
    import time

    wanted = "".join(text.split()).encode()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.5)
        if ready:
            try:
                buffer += os.read(fd, 65536)
            except OSError:  # the child closed the terminal
                return False
        plain = re.sub(rb"\x1b\[[0-9;?]*[A-Za-z]", b"", bytes(buffer))
        if wanted in b"".join(plain.split()):
            return True
    return False


def test_livekit_console_text_mode_answers_a_typed_turn(cpu_service):
    """``python -m demo_agent livekit console --text`` in a terminal: greeting, typed turn, reply.

    LiveKit's text console shows text only (its audio output is off), so this checks the entry
    point and the CLI wiring; the audio path is the AgentSession test above.
    """
    import pty
    import signal

    try:
        import sounddevice  # noqa: F401 - LiveKit's console imports it even in text mode
    except OSError as e:
        pytest.skip(f"needs PortAudio ({e}); .ci/install_system_deps.sh installs libportaudio2")
    model, _ = cpu_service
    master, slave = pty.openpty()
    path = os.pathsep.join(
        filter(None, [str(REPO / "livekit_plugin"), os.environ.get("PYTHONPATH")])
    )
    env = {**os.environ, "PYTHONPATH": path, "DEEPGRAM_API_KEY": "", "OPENAI_API_KEY": ""}
    env.update(COLUMNS="120", LINES="40", TERM="xterm")
    cmd = [
        sys.executable, "-m", "demo_agent", "livekit", "--model", model,
        "--device", "cpu", "--dtype", "float32", "--backend", "torch", "--max-frames", "8",
        "console", "--text",
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdin=slave, stdout=slave, stderr=slave, env=env, cwd=REPO, start_new_session=True
    )
    os.close(slave)
    screen = bytearray()
    try:
        assert _read_pty_until(master, screen, GREETING, TURN_TIMEOUT), screen[-2000:]
        # The greeting can show before the console's input widget takes keystrokes (seen in a
        # fresh checkout: the line was echoed but never submitted), so type again, as a person
        # would, until the turn is answered.
        answered = False
        for _ in range(4):
            os.write(master, b"The quick brown fox\r")
            if _read_pty_until(master, screen, "You said: The quick brown fox", 15):
                answered = True
                break
        assert answered, screen[-2000:]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)


# -- Pipecat over WebRTC, and the browser page ----------------------------------------------------


def _namespace_problem() -> str | None:
    if sys.platform != "linux":
        return "needs Linux network namespaces"
    for tool in ("unshare", "ip"):
        if shutil.which(tool) is None:
            return f"needs `{tool}` (util-linux / iproute2)"
    cmd = [
        "unshare", "-n", "ip", "link", "add", "probe-a", "type", "veth", "peer", "name", "probe-b",
    ]  # fmt: skip
    probe = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        check=False,
    )
    if probe.returncode != 0:
        return f"cannot create a private network namespace with veth: {probe.stderr.strip()}"
    return None


@pytest.fixture(scope="module")
def e2e_report(tiny_checkpoint, tmp_path_factory):
    pytest.importorskip("aiortc", reason='needs aiortc: pip install "pipecat-ai[webrtc]"')
    pytest.importorskip("pipecat_ai_prebuilt", reason='needs pip install "pipecat-ai[runner]"')
    if problem := _namespace_problem():
        pytest.skip(problem)
    out_dir = tmp_path_factory.mktemp("demo_e2e")
    out = out_dir / "report.json"
    screenshot = Path(os.environ.get("DEMO_AGENT_SCREENSHOT") or out_dir / "demo.png")
    screenshot = screenshot if screenshot.is_absolute() else REPO / screenshot
    screenshot.parent.mkdir(parents=True, exist_ok=True)
    cmd = [
        "unshare", "-n", sys.executable, str(E2E_SCRIPT),
        "--checkpoint", str(tiny_checkpoint("custom_voice")), "--out", str(out),
        "--screenshot", str(screenshot), "--timeout", "60",
    ]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=REPO, capture_output=True, text=True, timeout=E2E_TIMEOUT, check=False
    )
    assert proc.returncode == 0, f"e2e driver failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    report = json.loads(out.read_text())
    report["bot_log_text"] = Path(report["bot_log"]).read_text(errors="replace")
    return report


def test_pipecat_bot_speaks_a_typed_turn_over_webrtc(e2e_report):
    log = e2e_report["bot_log_text"]
    assert e2e_report["ui_served"], "the prebuilt UI was not served at /"
    webrtc = e2e_report["webrtc"]
    assert "bot-ready" in webrtc["message_types"], webrtc
    # Greeting off and nothing typed yet: the line must be quiet before our turn.
    assert webrtc["peak_before_send"] <= SOUND_PEAK, webrtc
    assert webrtc["reply_seen"], f"the bot's reply text never arrived: {webrtc}"
    assert webrtc["first_sound_after_send"] is not None, f"no audio after the typed turn: {webrtc}"
    assert webrtc["first_sound_after_send"] < 60, webrtc
    assert webrtc["sound_seconds"] >= 0.3, webrtc
    assert "bot session failed" not in log, log[-3000:]


def test_pipecat_bot_shuts_down_cleanly_on_sigint(e2e_report):
    shutdown = e2e_report["shutdown"]
    assert shutdown["returncode"] == 0, (shutdown, e2e_report["bot_log_text"][-3000:])
    assert shutdown["stop_seconds"] < 20, shutdown
    assert "Traceback" not in e2e_report["bot_log_text"], e2e_report["bot_log_text"][-3000:]


def test_browser_loads_the_demo_page_and_connects(e2e_report):
    browser = e2e_report.get("browser", {})
    if "skipped" in browser:
        pytest.skip(browser["skipped"] + "; .ci/install_system_deps.sh installs it")
    assert "error" not in browser, browser["error"]
    assert browser["prebuilt_rendered"], "Pipecat's prebuilt UI did not render at /"
    assert browser["page_loaded"], browser.get("page_text")
    assert browser["connected"], browser.get("status")
    # WebRTC audio level (0..1) on the browser's received track: quiet before, sound after.
    assert browser["peak_before_send"] < 0.01, browser
    assert browser["reply_shown"], browser.get("page_text")
    assert browser["audio_heard"], browser
    shot = Path(browser["screenshot"])
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
