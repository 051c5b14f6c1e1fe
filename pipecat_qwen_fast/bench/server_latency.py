"""`qwen-fast-tts bench server-latency`: first audio through the server against in-process.

One engine, loaded once and fully warmed, serves both sides: in-process requests go through its
`EngineService`; server requests go through the app built on that same service, over a WebSocket
on loopback (one socket kept open across turns, as LiveKit's Qwen3TTS client keeps it) and over
HTTP (`POST /v1/audio/speech`, a connection per request, as the OpenAI SDK makes them). The two
alternate request by request, so drift in the GPU's state affects both alike. First audio runs
from the moment the client sends the text to the first PCM byte it holds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

from pipecat_qwen_fast.bench.engine import percentile

TEXT = "Sure, your table for four is booked for seven tonight."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_in_thread(service, model, device: str, backend: str, max_streams: int = 32,
                    engine_process: bool = False):
    """The server app over `service`, on a free loopback port in a thread: (server, thread, port).
    With `engine_process` (and service None) the server loads its own engine in a child process,
    as `serve` does, and this returns once that engine is fully warm. Stop it with
    `server.should_exit = True` and a join of the thread."""
    import uvicorn

    from pipecat_qwen_fast.server.app import build_app
    from pipecat_qwen_fast.server.settings import ServerSettings

    port = free_port()
    settings = ServerSettings(model=str(model), device=device, backend=backend, host="127.0.0.1",
                              port=port, log_level="warning", max_streams=max_streams,
                              engine_process=engine_process)
    config = uvicorn.Config(build_app(settings, service), host="127.0.0.1", port=port,
                            log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(400):
        if server.started:
            break
        time.sleep(0.05)
    if not server.started:
        raise RuntimeError("the server did not start within 20 s")
    if engine_process:
        wait_fully_warm(port)
    return server, thread, port


def wait_fully_warm(port: int, timeout_s: float = 900.0) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as r:
                if json.load(r).get("fully_warm"):
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server's engine process was not fully warm within {timeout_s:.0f} s")


async def in_process(service, voice: str | None, frames: int) -> float:
    from pipecat_qwen_fast import SynthesisRequest

    t0 = time.perf_counter()
    stream = service.open_stream(SynthesisRequest(TEXT, voice=voice, seed=0, max_frames=frames))
    try:
        async for _ in stream:
            return time.perf_counter() - t0
    finally:
        stream.cancel()
        await stream.wait_closed()
    raise RuntimeError("no audio")


async def over_ws(ws, frames: int) -> float:
    t0 = time.perf_counter()
    await ws.send(json.dumps({"type": "input.text", "text": TEXT}))
    await ws.send(json.dumps({"type": "input.done"}))
    first = None
    while True:
        msg = await ws.recv()
        if isinstance(msg, bytes):
            if first is None:
                first = time.perf_counter() - t0
            continue
        event = json.loads(msg)
        if event["type"] == "error":
            raise RuntimeError(f"server error: {event.get('message')}")
        if event["type"] == "session.done":
            if first is None:
                raise RuntimeError("no audio")
            return first


async def over_http(client, base: str, voice: str | None, frames: int) -> float:
    body = {
        "model": "qwen",
        "input": TEXT,
        "voice": voice,
        "response_format": "pcm",
        "max_new_tokens": frames,
        "seed": 0,
    }
    t0 = time.perf_counter()
    first = None
    async with client.stream("POST", f"{base}/v1/audio/speech", json=body) as r:
        r.raise_for_status()
        async for chunk in r.aiter_bytes():
            if chunk and first is None:
                first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError("no audio")
    return first


async def measure(service, port: int, voice: str | None, requests: int, frames: int) -> dict:
    import httpx
    import websockets

    base = f"http://127.0.0.1:{port}"
    times: dict[str, list[float]] = {"in_process": [], "ws": [], "http": []}
    async with (
        websockets.connect(f"ws://127.0.0.1:{port}/v1/audio/speech/stream", max_size=None) as ws,
        httpx.AsyncClient(timeout=30) as client,
    ):
        await ws.send(
            json.dumps(
                {"type": "session.config", "voice": voice, "max_new_tokens": frames, "seed": 0}
            )
        )
        for i in range(requests + 3):  # the first three of each are warm-up, not kept
            got = {
                "in_process": await in_process(service, voice, frames),
                "ws": await over_ws(ws, frames),
                "http": await over_http(client, base, voice, frames),
            }
            if i >= 3:
                for k, v in got.items():
                    times[k].append(v * 1e3)
        await ws.send(json.dumps({"type": "session.close"}))
    out = {
        k: {
            "p50_ms": statistics.median(v),
            "p95_ms": percentile(v, 95),
            "n": len(v),
        }
        for k, v in times.items()
    }
    out["ws_minus_in_process_p50_ms"] = out["ws"]["p50_ms"] - out["in_process"]["p50_ms"]
    out["http_minus_in_process_p50_ms"] = out["http"]["p50_ms"] - out["in_process"]["p50_ms"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="qwen-fast-tts bench server-latency",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True, help="checkpoint folder")
    p.add_argument("--out", type=Path, required=True, help="folder for server_latency.json")
    p.add_argument("--device", default="cuda")
    p.add_argument("--backend", default="auto")
    p.add_argument("--requests", type=int, default=30)
    p.add_argument(
        "--frames", type=int, default=8, help="frames each request makes (the first chunk is one)"
    )
    p.add_argument(
        "--engine-process", action="store_true",
        help="the server loads its own engine in a child process, as `serve` does (a second "
        "engine on the device); in-process requests keep this process's engine",
    )
    args = p.parse_args(argv)

    import torch

    from pipecat_qwen_fast import EngineService, QwenTTSEngine

    def load():
        engine = QwenTTSEngine.from_pretrained(
            args.model, device=args.device, backend=args.backend, progress=False
        )
        engine.finish_warmup()
        return engine

    service = EngineService(load, name="server-latency")
    service.wait_ready_blocking()
    voice = service.engine.voices[0] if service.engine.voices else None
    server, thread, port = serve_in_thread(None if args.engine_process else service, args.model,
                                           args.device, args.backend,
                                           engine_process=args.engine_process)

    async def run() -> dict:
        # The service's async API binds to the loop it is used from: this one.
        return await measure(service, port, voice, args.requests, args.frames)

    try:
        result = asyncio.run(run())
    finally:
        server.should_exit = True
        thread.join(10)
        service.close()
    result.update(
        {
            "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
            "backend": args.backend,
            "frames": args.frames,
            "server_engine": "child process" if args.engine_process else "the same EngineService",
            "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        }
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "server_latency.json").write_text(json.dumps(result, indent=2))
    print(
        json.dumps(
            {
                k: v
                for k, v in result.items()
                if k.endswith("_ms") or k in ("in_process", "ws", "http")
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
