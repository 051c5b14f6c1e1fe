"""What operators rely on: /health and /ready through loading and failure, /metrics, draining
on SIGTERM, and logs that never hold the text spoken."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time

import aiohttp
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pipecat_qwen_fast import EngineService, QwenTTSEngine
from pipecat_qwen_fast.server.api_errors import from_engine_error

from .conftest import (
    CPU,
    FRAME_SAMPLES,
    LOAD_TIMEOUT,
    VOICE,
    eventually,
    running,
    settings_for,
    settled,
)
from .test_ws import CONFIG, LONG_TEXT, read_until_done

pytestmark = pytest.mark.timeout(240)

TIMEOUT = 60
MARKER = "Zebracorn"  # a word no log line has any other reason to contain


def metric_samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


async def test_ready_only_once_the_engine_is_loaded_and_warm(endless_path):
    release = threading.Event()

    def load_when_released() -> QwenTTSEngine:
        # The real engine; the test only decides when its load begins.
        release.wait(LOAD_TIMEOUT)
        return QwenTTSEngine.from_pretrained(endless_path, **CPU, warmup=True, progress=False)

    service = EngineService(load_when_released, name="delayed")
    try:
        with running(settings_for(endless_path, retry_after_s=3), service) as srv:
            async with httpx.AsyncClient(base_url=srv.base_url, timeout=TIMEOUT) as http:
                health, ready = await http.get("/health"), await http.get("/ready")
                speech = await http.post("/v1/audio/speech", json={"input": "Early?",
                                                                   "voice": VOICE})
                assert (health.status_code, health.json()) == (200, {"status": "loading"})
                assert ready.status_code == 503 and ready.json()["ready"] is False
                assert speech.status_code == 503 and speech.headers["retry-after"] == "3"
                assert speech.json()["error"]["code"] == "not_ready"
                release.set()
                for _ in range(int(LOAD_TIMEOUT / 0.1)):
                    if (ready := await http.get("/ready")).status_code == 200:
                        break
                    await asyncio.sleep(0.1)
                assert ready.json() == {"ready": True, "status": "ready", "fully_warm": True}
                speech = await http.post("/v1/audio/speech", json={
                    "input": "Now?", "voice": VOICE, "response_format": "pcm",
                    "max_new_tokens": 6})
                assert speech.status_code == 200
                assert len(speech.content) == 6 * FRAME_SAMPLES * 2
    finally:
        release.set()
        service.close()


def test_the_engines_overload_error_is_a_503_with_its_retry_after():
    # The engine's admission control (the fleet issue) is matched by the error's name.
    class EngineOverloadedError(RuntimeError):
        retry_after_s = 4.0

    error = from_engine_error(EngineOverloadedError("48 streams running"), retry_after_s=1)
    assert (error.status, error.code, error.headers()) == (503, "overloaded", {"Retry-After": "4"})
    assert error.message == "the TTS engine is at capacity: 48 streams running"
    # The engine's own refusal says so already: not twice.
    own = from_engine_error(EngineOverloadedError("the TTS engine is at capacity: rounds of 27 ms"), 1)
    assert own.message == "the TTS engine is at capacity: rounds of 27 ms"
    assert from_engine_error(RuntimeError("boom"), retry_after_s=1).status == 500


async def test_a_server_that_loads_its_engine_freezes_the_heap(endless_path):
    # The loaded model's objects leave the collector's reach: a full collection would stall
    # every stream (docs/SERVER.md, "Performance").
    gc.unfreeze()
    try:
        with running(settings_for(endless_path)) as srv:
            await eventually(lambda: srv.ctx.ready, within=LOAD_TIMEOUT, what="the engine")
            await eventually(lambda: gc.get_freeze_count() > 10_000, what="the freeze")
    finally:
        gc.unfreeze()


@pytest.mark.parametrize("engine_process", [False, True], ids=["one-process", "engine-process"])
def test_server_exits_when_its_model_fails_to_load(tmp_path, engine_process):
    # The server loads its own engine here (in a child with engine_process); no such folder.
    settings = settings_for(tmp_path / "no-such-model", engine_process=engine_process)
    with running(settings) as srv:
        srv.thread.join(LOAD_TIMEOUT)
        assert not srv.thread.is_alive() and srv.server.load_failed


async def test_metrics_count_streams_audio_first_audio_refusals_and_errors(endless_service,
                                                                          endless_path):
    with running(settings_for(endless_path), endless_service) as srv:
        async with httpx.AsyncClient(base_url=srv.base_url, timeout=TIMEOUT) as http:
            fresh = metric_samples((await http.get("/metrics")).text)
            for endpoint in ("http", "ws"):
                e = (("endpoint", endpoint),)
                # Exported at 0 before any stream, so a scrape can tell "none" from "missing".
                assert fresh[("qwen_tts_underruns_total", e)] == 0
                assert fresh[("qwen_tts_audio_seconds_total", e)] == 0
            rounds_before = fresh[("qwen_tts_engine_rounds_total", ())]
            seconds_before = fresh[("qwen_tts_engine_round_seconds_total", ())]
            streams_before = fresh[("qwen_tts_engine_round_streams_total", ())]
            ok = await http.post("/v1/audio/speech", json={
                "input": "Count me.", "voice": VOICE, "response_format": "pcm",
                "max_new_tokens": 12})
            bad = await http.post("/v1/audio/speech", json={"input": "Count me.", "voice": 3})
            async with aiohttp.ClientSession() as session, session.ws_connect(srv.ws_url) as ws:
                await ws.send_json(CONFIG)  # 12 frames
                await ws.send_json({"type": "input.text", "text": "Count me too."})
                await ws.send_json({"type": "input.done"})
                await read_until_done(ws)
            await eventually(lambda: settled(srv) and not srv.ctx.open_sockets,
                       what="the streams and the socket to close")
            # The engine counts a round's streams just after handing out its chunks.
            await eventually(lambda: endless_service.round_streams - streams_before >= 24,
                             what="the last round to be counted")
            response = await http.get("/metrics")
        assert ok.status_code == 200 and bad.status_code == 400
        assert response.headers["content-type"].startswith("text/plain")
        m = metric_samples(response.text)
        for endpoint in ("http", "ws"):
            e = (("endpoint", endpoint),)
            assert m[("qwen_tts_first_audio_seconds_count", e)] == 1
            assert m[("qwen_tts_audio_seconds_total", e)] == pytest.approx(12 * 0.08)
            assert m[("qwen_tts_streams_total", (("endpoint", endpoint),
                                                  ("outcome", "completed")))] == 1
            # Every chunk after the first is judged against the playout clock.
            judged = m[("qwen_tts_chunk_lateness_seconds_count", e)]
            assert 1 <= judged <= 11
            # An underrun is exactly a judged chunk that came late (outside the 0 bucket).
            in_time = m[("qwen_tts_chunk_lateness_seconds_bucket", e + (("le", "0.0"),))]
            assert m[("qwen_tts_underruns_total", tuple(sorted(e)))] == judged - in_time
        assert m[("qwen_tts_errors_total", (("kind", "bad_request"),))] == 1
        assert m[("qwen_tts_streams_active", ())] == 0 and m[("qwen_tts_streams_queued", ())] == 0
        assert m[("qwen_tts_admitted_streams", ())] == 0
        assert m[("qwen_tts_max_streams", ())] == 32 and m[("qwen_tts_ready", ())] == 1
        assert m[("qwen_tts_websockets_open", ())] == 0
        # The engine's rounds: two streams of 12 frames took at least 12 rounds, and time.
        assert m[("qwen_tts_engine_rounds_total", ())] - rounds_before >= 12
        assert m[("qwen_tts_engine_round_seconds_total", ())] > seconds_before
        # Each of those rounds stepped one or both streams: 24 frames in all.
        assert m[("qwen_tts_engine_round_streams_total", ())] - streams_before == 24
        assert m[("qwen_tts_engine_round_ms", ())] > 0
        # In the server's process the engine runs on its service's thread alone.
        assert m[("qwen_tts_engine_thread_cpu_seconds_total", (("thread", "engine"),))] > 0
        assert not [k for k in m if k[0] == "qwen_tts_engine_thread_cpu_seconds_total" and k[1] != (("thread", "engine"),)]
        assert m[("qwen_tts_engine_low_slack_chunks_total", ())] == 0  # off on a CPU
        assert ("qwen_tts_engine_lowest_slack_ms", ()) in m
        # The event loop's lag, sampled every 10 ms while the server ran (seconds, here).
        lag_count = m[("qwen_tts_event_loop_lag_seconds_count", ())]
        assert lag_count > 0
        assert m[("qwen_tts_event_loop_lag_seconds_bucket", (("le", "+Inf"),))] == lag_count
        assert 0 <= m[("qwen_tts_event_loop_lag_seconds_sum", ())] < lag_count


async def test_loop_lag_sampler_runs_with_the_app_and_is_gone_after(endless_service, endless_path):
    from pipecat_qwen_fast.server.app import build_app

    app = build_app(settings_for(endless_path), endless_service)

    def samplers() -> list[asyncio.Task]:
        return [t for t in asyncio.all_tasks() if t.get_name() == "qwen-tts-loop-lag"]

    async with app.router.lifespan_context(app):
        (task,) = samplers()
        await asyncio.sleep(0.1)
        registry = app.state.qwen_tts.metrics.registry
        assert registry.get_sample_value("qwen_tts_event_loop_lag_seconds_count") >= 3
        assert not task.done()
    assert task.cancelled() and not samplers()


async def test_gc_pauses_are_metered_while_the_app_runs_and_not_after(endless_service, endless_path):
    from pipecat_qwen_fast.server.app import build_app

    app = build_app(settings_for(endless_path), endless_service)
    registry = app.state.qwen_tts.metrics.registry

    def full() -> float:
        return registry.get_sample_value("qwen_tts_gc_pause_seconds_count",
                                         {"generation": "2", "process": "server"}) or 0

    async with app.router.lifespan_context(app):
        before = full()
        gc.collect()
        assert full() == before + 1
        assert registry.get_sample_value("qwen_tts_gc_pause_seconds_sum", {"generation": "2", "process": "server"}) > 0
    after = full()
    gc.collect()
    assert full() == after  # the collector's callback went with the app


# A collection at nearly every allocation, so that one runs inside the metrics' own code, in the
# thread that is in it; its callback then observes the pause there. In a subprocess: a deadlock
# fails the test by its timeout instead of hanging the suite.
GC_INSIDE_METRICS = """
import gc
from pipecat_qwen_fast.engine.heap import watch_gc
from pipecat_qwen_fast.server.metrics import ServerMetrics

for attempt in range(20):  # where a collection falls varies; each attempt has fresh metrics
    m = ServerMetrics(active=lambda: 0, queued=lambda: 0, in_use=lambda: 0, sockets=lambda: 0,
                      capacity=1, ready=lambda: True)
    stop = watch_gc(m.observe_gc)
    gc.set_threshold(1)
    for generation in (1, 2, 0):
        m.observe_gc(generation, 0.001)  # as the engine process's reported pauses are
    m.render()
    gc.set_threshold(700, 10, 10)
    stop()
counts = {s.labels["generation"]: s.value for f in m.registry.collect() for s in f.samples
          if s.name == "qwen_tts_gc_pause_seconds_count"}
print(sorted(counts), all(v >= 1 for v in counts.values()))
"""


def test_a_collection_inside_the_metrics_code_observes_its_pause_without_deadlock():
    """Stop 49's CI: a collection set off inside prometheus_client's labels() observed its pause
    through labels() again, whose lock that thread held: the server's loop hung for good."""
    proc = subprocess.run([sys.executable, "-c", GC_INSIDE_METRICS], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split("\n")[-2] == "['0', '1', '2'] True"


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=1)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


async def test_no_user_text_in_any_log_at_trace_level(endless_service, endless_path):
    collect = Collect()
    names = ["", "uvicorn", "uvicorn.error", "uvicorn.access", "pipecat_qwen_fast", "websockets"]
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    text = f"The {MARKER} speaks. Another {MARKER} sentence."
    with running(settings_for(endless_path, log_level="trace", max_input_chars=200),
                 endless_service) as srv:
        # After the server configured uvicorn's loggers (which replaces their handlers).
        for lg in loggers:
            lg.addHandler(collect)
            lg.setLevel(1)
        try:
            async with httpx.AsyncClient(base_url=srv.base_url, timeout=TIMEOUT) as http:
                for body in ({"input": text, "voice": VOICE, "max_new_tokens": 6},
                             {"input": text, "voice": f"{MARKER}"},
                             {"input": MARKER * 100, "voice": VOICE},
                             {"input": text, "voice": VOICE, MARKER: 1}):
                    await http.post("/v1/audio/speech", json=body)
                await http.post("/v1/audio/speech", content=f'{{"input": "{MARKER}'.encode())
            async with aiohttp.ClientSession() as session, session.ws_connect(srv.ws_url) as ws:
                await ws.send_json({**CONFIG, "max_new_tokens": 6})
                await ws.send_json({"type": "input.text", "text": text})
                await ws.send_json({"type": "input.done"})
                await read_until_done(ws)
                await ws.send_str(f"{{{MARKER}")
                await read_until_done(ws)
            await eventually(lambda: settled(srv), what="the streams to close")
        finally:
            for lg, level in zip(loggers, levels, strict=True):
                lg.removeHandler(collect)
                lg.setLevel(level)
    lines = collect.lines
    # The logs did record these requests (so the check below looks at something)...
    assert any("speech request: " in line for line in lines)
    assert any("POST /v1/audio/speech" in line for line in lines)
    assert any("WebSocket" in line for line in lines)
    # ...and never their text.
    assert not [line for line in lines if MARKER.lower() in line.lower()]


async def test_drain_finishes_streams_in_flight_and_refuses_new_ones(endless_service,
                                                                    endless_path):
    with running(settings_for(endless_path), endless_service) as srv:
        async with httpx.AsyncClient(base_url=srv.base_url, timeout=TIMEOUT) as http, \
                aiohttp.ClientSession() as session:
            async with http.stream("POST", "/v1/audio/speech", json={
                    "input": LONG_TEXT, "voice": VOICE, "response_format": "pcm",
                    "max_new_tokens": 30}) as holding:
                pieces = holding.aiter_raw()
                received = len(await anext(pieces))
                idle = await session.ws_connect(srv.ws_url)
                await idle.send_json(CONFIG)
                busy = await session.ws_connect(srv.ws_url)
                await busy.send_json({**CONFIG, "max_new_tokens": 30})
                await busy.send_json({"type": "input.text", "text": LONG_TEXT})
                await busy.send_json({"type": "input.done"})
                first = await busy.receive(timeout=TIMEOUT)
                assert json.loads(first.data)["type"] == "audio.start"

                srv.server.request_drain()  # what SIGTERM does
                await eventually(lambda: srv.ctx.gate.draining, what="the drain")
                ready = await http.get("/ready")
                refused = await http.post("/v1/audio/speech", json={"input": "Hi.",
                                                                    "voice": VOICE})
                assert (ready.status_code, ready.json()["status"]) == (503, "draining")
                assert refused.status_code == 503 and "retry-after" in refused.headers
                assert refused.json()["error"]["code"] == "draining"

                idle_items = await read_until_done(idle)
                assert idle_items[0]["code"] == "draining" and idle_items[-1] == ("closed", 1001)
                # The whole turn: its six sentences, 30 frames each.
                busy_items = await read_until_done(busy)
                assert busy_items[-1] == {"type": "session.done", "total_sentences": 6}
                assert sum(len(i) for i in busy_items if isinstance(i, bytes)) == \
                    6 * 30 * FRAME_SAMPLES * 2
                async for piece in pieces:
                    received += len(piece)
            assert received == 30 * FRAME_SAMPLES * 2
        # Drained: the server shuts itself down.
        srv.thread.join(TIMEOUT)
        assert not srv.thread.is_alive()


def test_serve_cli_drains_on_sigterm_and_logs_no_text(endless_path):
    env = {**os.environ, "QWEN_FAST_API_KEY": "cli-key", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "pipecat_qwen_fast.cli", "serve", "--model",
               str(endless_path), "--device", "cpu", "--dtype", "float32", "--backend", "torch",
               "--host", "127.0.0.1", "--port", "0", "--log-level", "debug"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")),
                              daemon=True)
    reader.start()
    try:
        port = None
        deadline = time.monotonic() + LOAD_TIMEOUT
        while port is None and time.monotonic() < deadline and proc.poll() is None:
            found = [re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", line)
                     for line in list(lines)]
            port = next((int(m.group(1)) for m in found if m), None)
            time.sleep(0.05)
        assert port, "".join(lines)
        key = {"Authorization": "Bearer cli-key"}
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=TIMEOUT) as http:
            while http.get("/ready").status_code != 200:
                assert time.monotonic() < deadline, "".join(lines)
                time.sleep(0.1)
            assert http.post("/v1/audio/speech", json={"input": "Hi.", "voice": VOICE}
                             ).status_code == 401
            body = {"input": f"A {MARKER} in flight. " * 4, "voice": VOICE,
                    "response_format": "pcm", "max_new_tokens": 30}
            with http.stream("POST", "/v1/audio/speech", json=body, headers=key) as holding:
                pieces = holding.iter_raw()
                received = len(next(pieces))
                proc.send_signal(signal.SIGTERM)
                for _ in range(200):
                    if http.get("/ready").status_code == 503:
                        break
                    time.sleep(0.05)
                assert http.get("/ready").json()["status"] == "draining"
                refused = http.post("/v1/audio/speech", json=body, headers=key)
                assert refused.status_code == 503
                received += sum(len(piece) for piece in pieces)
            assert received == 30 * FRAME_SAMPLES * 2
        assert proc.wait(TIMEOUT) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        reader.join(10)
    log = "".join(lines)
    assert "draining" in log and "speech request: " in log
    assert MARKER not in log


async def test_the_engines_admission_settings_reach_it_in_its_own_process(endless_path):
    # A round limit every CPU round exceeds, given to the server: with one stream live in the
    # engine process, the next request is refused as overloaded, and /metrics names the setting.
    settings = settings_for(endless_path, engine_process=True, max_round_ms=1e-3, min_slack_ms=None,
                            max_queued_streams=4)
    with running(settings) as srv:
        await eventually(lambda: srv.ctx.ready, within=LOAD_TIMEOUT, what="the engine")
        url = srv.base_url + "/v1/audio/speech"
        body = {"input": LONG_TEXT, "voice": VOICE, "response_format": "pcm", "max_new_tokens": 400}
        async with httpx.AsyncClient(timeout=TIMEOUT) as http:
            async with http.stream("POST", url, json=body) as holding:
                assert holding.status_code == 200
                pieces = holding.aiter_raw()
                await anext(pieces)
                await anext(pieces)  # rounds have run, and been timed, while it is live
                refused = await http.post(url, json={**body, "max_new_tokens": 12})
            await asyncio.sleep(0.5)  # the engine process reports every 0.2 s
            metrics = (await http.get(srv.base_url + "/metrics")).text
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "overloaded"
    assert "max_round_ms" in refused.json()["error"]["message"]
    assert 'qwen_tts_engine_refusals_total{reason="max_round_ms"} 1.0' in metrics


def test_serve_cli_refuses_a_bad_admission_setting_and_names_the_choices(endless_path):
    for flag, value in (("--max-round-ms", "fast"), ("--min-slack-ms", "nan"), ("--max-queued-streams", "0")):
        done = subprocess.run([sys.executable, "-m", "pipecat_qwen_fast.cli", "serve", "--model", str(endless_path),
                               flag, value], capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 2
        assert flag[2:].replace("-", "_") in done.stderr and "auto, off or a number" in done.stderr
