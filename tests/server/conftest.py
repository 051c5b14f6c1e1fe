"""The real server on loopback, over the real engine on tiny random checkpoints (CPU).

`running(settings, service)` starts uvicorn with the server app in a thread, on 127.0.0.1 and a
port the OS picks, and stops it on exit. The engine services are loaded once per session and
shared by the servers of many tests (a server given a service leaves it open); tests that need
the server's own loading path build one without a service.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pipecat_qwen_fast import EngineService, QwenTTSEngine
from pipecat_qwen_fast.server import DrainingServer, ServerSettings, make_server

CPU = {"device": "cpu", "dtype": "float32", "backend": "torch"}
LOAD_TIMEOUT = 120
FRAME_SAMPLES = 1920  # 80 ms at 24 kHz
VOICE = "ryan"
# The shared server's cap on a stream: 24 frames (~2 s of audio) keep a request about a second
# long on 2 CPU cores.
SERVER_MAX_FRAMES = 24


@dataclass
class RunningServer:
    server: DrainingServer
    port: int
    thread: threading.Thread

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/audio/speech/stream"

    @property
    def ctx(self) -> Any:
        return self.server.ctx


def settings_for(model: Path | str, **kw: Any) -> ServerSettings:
    kw.setdefault("log_level", "warning")
    return ServerSettings(model=str(model), host="127.0.0.1", port=0, **CPU, **kw)


@contextlib.contextmanager
def running(settings: ServerSettings, service: Any = None) -> Iterator[RunningServer]:
    server = make_server(settings, service)
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + LOAD_TIMEOUT
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the server stopped during startup")
        if time.monotonic() > deadline:
            raise TimeoutError("the server did not start")
        time.sleep(0.02)
    sockets = server.servers[0].sockets if server.servers else []
    port = sockets[0].getsockname()[1] if sockets else 0  # 0: it has stopped already
    try:
        yield RunningServer(server, port, thread)
    except Exception:
        dump_stacks(server)
        raise
    finally:
        server.should_exit = True
        thread.join(30)
        if thread.is_alive():
            dump_stacks(server)
        assert not thread.is_alive(), "the server did not stop"


def dump_stacks(server: DrainingServer) -> None:
    """Every thread's stack, this process's and its engine process's, into the failed test's
    captured stderr: where a request that timed out was stuck."""
    faulthandler.dump_traceback(all_threads=True)
    pid = getattr(getattr(server.ctx, "service", None), "pid", None)
    if pid is not None:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGUSR1)  # the engine process prints its own (engine_process.py)
            time.sleep(1.0)


def load_service(path: Path) -> EngineService:
    def load() -> QwenTTSEngine:
        return QwenTTSEngine.from_pretrained(path, **CPU, warmup=True, progress=False)

    service = EngineService(load, name="server-tests")
    return service.wait_ready_blocking(LOAD_TIMEOUT)


@pytest.fixture(scope="session")
def endless_service(tiny_checkpoint) -> Iterator[EngineService]:
    """EOS never comes: every utterance runs to the engine's frame cap for its text, so a stream
    lasts as long as its text says and can be cut off mid-way."""
    service = load_service(tiny_checkpoint("custom_voice", zero_eos=True))
    yield service
    service.close()


@pytest.fixture(scope="session")
def finite_service(tiny_checkpoint) -> Iterator[EngineService]:
    """Random weights: utterances end at a random EOS."""
    service = load_service(tiny_checkpoint("custom_voice"))
    yield service
    service.close()


@pytest.fixture(scope="session")
def endless_path(tiny_checkpoint) -> Path:
    return tiny_checkpoint("custom_voice", zero_eos=True)


@pytest.fixture(scope="module")
def server(endless_service, endless_path) -> Iterator[RunningServer]:
    """One server for a module's tests that need no special settings."""
    with running(settings_for(endless_path, voice_aliases={"alloy": VOICE},
                              max_frames=SERVER_MAX_FRAMES),
                 endless_service) as srv:
        yield srv


async def eventually(predicate, within: float = 30.0, what: str = "condition") -> None:
    """Wait (without blocking the test's event loop) until ``predicate()`` holds."""
    deadline = time.monotonic() + within
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def settled(srv: RunningServer) -> bool:
    """No stream admitted, none open in the engine service."""
    return srv.ctx.gate.in_use == 0 and not srv.ctx.live


@pytest.fixture(scope="module")
def base_path(tiny_checkpoint) -> Path:
    return tiny_checkpoint("base", zero_eos=True)


@pytest.fixture(scope="module")
def base_server(base_path) -> Iterator[RunningServer]:
    """A server on a tiny Base model (voices uploaded or cloned inline), one a test module."""
    service = load_service(base_path)
    try:
        with running(settings_for(base_path), service) as srv:
            yield srv
    finally:
        service.close()
