"""End-to-end check of the Pipecat demo, run inside a private network namespace.

``tests/test_demo_agent.py`` runs this script under ``unshare -n``: the namespace starts with only
a down loopback, and WebRTC's ICE (aioice, Chromium) ignores loopback addresses, so the script
first makes a veth pair with two addresses that exist only inside this namespace. Then it:

1. starts ``python -m demo_agent pipecat`` on the namespace's loopback with a tiny checkpoint;
2. connects a real WebRTC client (aiortc) the way the prebuilt UI does (``/start``, then
   ``/sessions/{id}/api/offer``), sends a typed turn as an RTVI ``send-text`` message over the
   data channel, and records the bot's audio track and data-channel messages;
3. optionally drives headless Chromium through the DevTools protocol: checks that the prebuilt UI
   renders, then on the offline text page (``/text/``) clicks Connect, types a message, waits for
   the spoken reply's text and for audio on the browser's WebRTC track, and saves a screenshot;
4. stops the bot with SIGINT and records how it exited.

Everything observed is written as JSON to ``--out``; the pytest side makes the assertions.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Int16 peak above which a decoded WebRTC audio frame counts as sound, not silence or codec noise.
SOUND_PEAK = 300
# Two addresses private to the namespace this script runs in; nothing outside it can see them.
VETH = (("demo-a", "10.213.0.1/24"), ("demo-b", "10.213.0.2/24"))
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--use-fake-ui-for-media-stream",
    "--use-fake-device-for-media-stream",
    "--autoplay-policy=no-user-gesture-required",
    # Chromium hides host candidates behind mDNS names by default; aiortc would have to resolve
    # them over multicast, which this namespace has no route for.
    "--disable-features=WebRtcHideLocalIpsWithMdns",
    "--window-size=1280,800",
    "--remote-debugging-port=0",
    "--remote-allow-origins=*",
]


def setup_network() -> None:
    (a, a_addr), (b, b_addr) = VETH
    commands = [
        ["ip", "link", "set", "lo", "up"],
        ["ip", "link", "add", a, "type", "veth", "peer", "name", b],
        ["ip", "addr", "add", a_addr, "dev", a],
        ["ip", "addr", "add", b_addr, "dev", b],
        ["ip", "link", "set", a, "up"],
        ["ip", "link", "set", b, "up"],
        # Chromium gathers no host candidates without a default route.
        ["ip", "route", "add", "default", "dev", a],
    ]
    for cmd in commands:
        subprocess.run(cmd, check=True, capture_output=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_bot(checkpoint: str, port: int, log_path: Path, max_frames: int) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "demo_agent", "pipecat",
        "--host", "127.0.0.1", "--port", str(port),
        "--model", checkpoint, "--device", "cpu", "--dtype", "float32", "--backend", "torch",
        "--seed", "1", "--max-frames", str(max_frames), "--greeting", "",
    ]  # fmt: skip
    env = {**os.environ, "DEEPGRAM_API_KEY": "", "OPENAI_API_KEY": "", "PYTHONUNBUFFERED": "1"}
    log = open(log_path, "wb")  # noqa: SIM115 - the child writes to it until it exits
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


def wait_http(url: str, proc: subprocess.Popen, timeout: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"bot exited with {proc.returncode} before serving")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return time.monotonic() - start
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"bot did not serve {url} within {timeout} s")


def stop_bot(proc: subprocess.Popen, timeout: float) -> dict:
    start = time.monotonic()
    proc.send_signal(signal.SIGINT)
    try:
        rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return {"returncode": None, "stop_seconds": None}
    return {"returncode": rc, "stop_seconds": round(time.monotonic() - start, 2)}


def _get_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


def _post_json(url: str, body: dict) -> dict:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def _squash(text: str) -> str:
    return "".join(text.split()).lower()


def rtvi(kind: str, msg_id: str, data: dict) -> str:
    return json.dumps({"label": "rtvi-ai", "type": kind, "id": msg_id, "data": data})


async def webrtc_turn(base: str, text: str, expect: str, timeout: float) -> dict:
    """One typed turn over a real WebRTC connection; returns what was heard and seen."""
    from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription

    # No STUN server: aiortc would otherwise try Google's, which this namespace cannot reach.
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    pc.addTransceiver("audio", direction="sendrecv")
    pc.addTransceiver("video", direction="sendrecv")
    channel = pc.createDataChannel("rtvi", ordered=True)
    opened = asyncio.Event()
    bot_ready = asyncio.Event()
    reply_seen = asyncio.Event()
    messages: list[dict] = []
    bot_text: list[str] = []
    frames: list[tuple[float, int, int, int]] = []  # (time, peak, samples, rate)
    loop = asyncio.get_running_loop()
    sent_at: list[float] = []

    channel.on("open", opened.set)

    @channel.on("message")
    def on_message(raw):
        try:
            message = json.loads(raw)
        except (TypeError, ValueError):
            return
        messages.append(message)
        if message.get("type") == "bot-ready":
            bot_ready.set()
        data = message.get("data")
        # The TTS service reports each sentence's text once its audio has been produced.
        if message.get("type") == "bot-tts-text" and isinstance(data, dict):
            bot_text.append(str(data.get("text", "")))
            if _squash(expect) in _squash(" ".join(bot_text)):
                reply_seen.set()

    readers: list[asyncio.Task] = []

    @pc.on("track")
    def on_track(track):
        if track.kind != "audio":
            return

        async def read() -> None:
            import numpy as np

            while True:
                try:
                    frame = await track.recv()
                except Exception:  # noqa: BLE001 - the track ends when the peer hangs up
                    return
                pcm = frame.to_ndarray()
                peak = int(np.abs(pcm.astype(np.int32)).max()) if pcm.size else 0
                frames.append((loop.time(), peak, frame.samples, frame.sample_rate))

        readers.append(asyncio.create_task(read()))

    result: dict = {}
    try:
        started = loop.time()
        session = await asyncio.to_thread(_post_json, f"{base}/start", {"transport": "webrtc"})
        await pc.setLocalDescription(await pc.createOffer())
        answer = await asyncio.to_thread(
            _post_json,
            f"{base}/sessions/{session['sessionId']}/api/offer",
            {"sdp": pc.localDescription.sdp, "type": pc.localDescription.type},
        )
        await pc.setRemoteDescription(RTCSessionDescription(sdp=answer["sdp"], type=answer["type"]))
        await asyncio.wait_for(opened.wait(), timeout)
        result["connect_seconds"] = round(loop.time() - started, 3)
        channel.send(
            rtvi("client-ready", "ready-1", {"version": "1.0.0", "about": {"library": "aiortc"}})
        )
        await asyncio.wait_for(bot_ready.wait(), timeout)
        # Anything heard before the typed turn would not be our reply (the greeting is off).
        await asyncio.sleep(1.0)
        result["peak_before_send"] = max((p for _, p, _, _ in frames), default=0)
        sent_at.append(loop.time())
        channel.send(
            rtvi(
                "send-text",
                "text-1",
                {"content": text, "options": {"run_immediately": True, "audio_response": True}},
            )
        )
        deadline = sent_at[0] + timeout
        while loop.time() < deadline:
            sound = [f for f in frames if f[0] > sent_at[0] and f[1] > SOUND_PEAK]
            if reply_seen.is_set() and sum(s / r for _, _, s, r in sound) >= 0.3:
                break
            await asyncio.sleep(0.1)
        # Let the rest of the utterance arrive before summing it up.
        await asyncio.sleep(1.0)
        after = [f for f in frames if f[0] > sent_at[0]]
        sound = [f for f in after if f[1] > SOUND_PEAK]
        result.update(
            frames_after_send=len(after),
            sound_seconds=round(sum(s / r for _, _, s, r in sound), 3),
            first_sound_after_send=round(sound[0][0] - sent_at[0], 3) if sound else None,
            peak_after_send=max((p for _, p, _, _ in after), default=0),
            sample_rates=sorted({r for *_, r in frames}),
            reply_seen=reply_seen.is_set(),
            message_types=sorted({m.get("type", "") for m in messages}),
            bot_text=" ".join(bot_text),
        )
    finally:
        await pc.close()
        for task in readers:
            task.cancel()
    return result


class DevTools:
    """The few DevTools-protocol calls this check needs, over one page's websocket."""

    def __init__(self, ws) -> None:
        self._ws = ws
        self._next = 0

    async def call(self, method: str, **params):
        self._next += 1
        await self._ws.send_json({"id": self._next, "method": method, "params": params})
        while True:
            message = await self._ws.receive_json()
            if message.get("id") == self._next:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})

    async def evaluate(self, expression: str):
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result.get("result", {}).get("value")

    async def wait_for(self, expression: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if await self.evaluate(expression):
                return True
            await asyncio.sleep(0.25)
        return False


async def browser_turn(base: str, text: str, expect: str, screenshot: Path, timeout: float) -> dict:
    """Load the demo page in headless Chromium, connect, type a turn, and take a screenshot."""
    import aiohttp

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        return {"skipped": "chromium is not installed (apt-get install chromium)"}
    profile = Path(tempfile.mkdtemp(prefix="demo-chromium-"))
    proc = subprocess.Popen(
        [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "about:blank"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    result: dict = {}
    try:
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not port_file.exists() or not port_file.read_text().strip():
            if time.monotonic() > deadline or proc.poll() is not None:
                # Chromium is installed but did not come up: a failure, not a reason to skip.
                return {"error": f"chromium did not start its DevTools endpoint (exit code {proc.poll()})"}
            await asyncio.sleep(0.2)
        port = int(port_file.read_text().split()[0])
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{port}/json/list") as response:
                pages = [t for t in await response.json() if t.get("type") == "page"]
            async with http.ws_connect(pages[0]["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                tools = DevTools(ws)
                await tools.call("Page.enable")
                # The prebuilt UI renders offline, though connecting needs Daily's CDN.
                await tools.call("Page.navigate", url=f"{base}/")
                result["prebuilt_rendered"] = await tools.wait_for(
                    "!!Array.from(document.querySelectorAll('button'))"
                    ".find(b => b.innerText.trim() === 'Connect')",
                    timeout,
                )
                await tools.call("Page.navigate", url=f"{base}/text/")
                result["page_loaded"] = await tools.wait_for("!!window.demoState", timeout)
                await tools.evaluate("document.getElementById('connect').click()")
                result["connected"] = await tools.wait_for(
                    "document.getElementById('status').textContent === 'CONNECTED'", timeout
                )
                result["status"] = await tools.evaluate(
                    "document.getElementById('status').textContent"
                )
                if result["connected"]:
                    result["peak_before_send"] = await tools.evaluate("window.demoState.peak")
                    # Typed the way a person types: focus, text, Enter.
                    await tools.evaluate("document.getElementById('text').focus()")
                    await tools.call("Input.insertText", text=text)
                    for kind in ("keyDown", "keyUp"):
                        await tools.call(
                            "Input.dispatchKeyEvent",
                            type=kind,
                            key="Enter",
                            code="Enter",
                            windowsVirtualKeyCode=13,
                            **({"text": "\r"} if kind == "keyDown" else {}),
                        )
                    shown = "Array.from(document.querySelectorAll('.msg.bot'))"
                    shown += f".some(m => m.textContent.includes({json.dumps(expect)}))"
                    result["reply_shown"] = await tools.wait_for(shown, timeout)
                    result["audio_heard"] = await tools.wait_for(
                        "window.demoState.peak > 0.01 && window.demoState.received > 0.3", timeout
                    )
                    # Let the meter settle on the reply's audio before the picture.
                    await asyncio.sleep(1.0)
                    result["audio"] = await tools.evaluate(
                        "({peak: window.demoState.peak, received: window.demoState.received})"
                    )
                result["page_text"] = await tools.evaluate("document.body.innerText")
                shot = await tools.call("Page.captureScreenshot", format="png")
                screenshot.write_bytes(base64.b64decode(shot["data"]))
                result["screenshot"] = str(screenshot)
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
        if proc.poll() is None:
            proc.kill()
        shutil.rmtree(profile, ignore_errors=True)
    return result


async def run_checks(args: argparse.Namespace) -> dict:
    from demo_agent.offline_llm import compose_reply

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = Path(args.out).with_suffix(".bot.log")
    report: dict = {"bot_log": str(log_path)}
    proc = start_bot(args.checkpoint, port, log_path, args.max_frames)
    try:
        waited = await asyncio.to_thread(wait_http, f"{base}/status", proc, args.timeout)
        report["startup_seconds"] = round(waited, 2)
        index = await asyncio.to_thread(_get_text, f"{base}/")
        report["ui_served"] = '<div id="root">' in index
        text = "The quick brown fox."
        report["webrtc"] = await webrtc_turn(base, text, compose_reply(text), args.timeout)
        if args.screenshot:
            text = "Hi from the browser"
            report["browser"] = await browser_turn(
                base, text, compose_reply(text), Path(args.screenshot), args.timeout
            )
    finally:
        report["shutdown"] = stop_bot(proc, 30)
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--out", required=True, help="JSON report path")
    parser.add_argument("--screenshot", default=None, help="PNG path; omit to skip the browser")
    parser.add_argument("--max-frames", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args()
    setup_network()
    sys.path.insert(0, str(REPO))
    report = asyncio.run(run_checks(args))
    Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
