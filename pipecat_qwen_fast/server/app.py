"""The ASGI app: one engine per process, OpenAI's speech API, the stream WebSocket, probes.

``build_app`` returns a plain FastAPI app, so the same app runs under uvicorn (``qwen-fast-tts
serve``, :mod:`.run`) and as a Ray Serve ingress (:mod:`.ray_serve`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pipecat_qwen_fast.engine.heap import watch_gc

from . import openai_api, voices_api, ws
from .api_errors import ApiError
from .context import ServerContext, context_of
from .logs import install_log_redaction
from .metrics import CONTENT_TYPE, watch_loop_lag
from .settings import ServerSettings

logger = logging.getLogger("pipecat_qwen_fast.server")


def build_app(settings: ServerSettings, service: Any = None,
              on_load_failure: Callable[[BaseException], None] | None = None) -> FastAPI:
    """The server app. Without ``service`` it loads and warms its own engine at startup (and
    closes it at shutdown); a given ``EngineService`` is used as it is and left open."""
    install_log_redaction()
    ctx = ServerContext(settings, service)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if ctx.service is None:
            # The engine process's collections go into the same histogram as this one's, by process.
            ctx.service = start_engine(settings, on_gc=lambda generation, seconds: ctx.metrics.observe_gc(
                generation, seconds, "engine"))
        watcher = asyncio.create_task(report_load(ctx, on_load_failure))
        if settings.wait_ready_on_startup:
            await ctx.service.wait_ready()
        # /metrics' qwen_tts_event_loop_lag_seconds, sampled while the app serves.
        loop_lag = asyncio.create_task(watch_loop_lag(ctx.metrics.loop_lag.observe),
                                       name="qwen-tts-loop-lag")
        stop_gc_watch = watch_gc(ctx.metrics.observe_gc)  # qwen_tts_gc_pause_seconds
        try:
            yield
        finally:
            ctx.gate.begin_drain()
            watcher.cancel()
            stop_gc_watch()
            loop_lag.cancel()
            await asyncio.wait([loop_lag])  # gone before the loop closes (a cancel of ours propagates)
            if ctx.owns_service:
                await ctx.service.aclose()

    app = FastAPI(title="pipecat-qwen-fast TTS server", lifespan=lifespan, docs_url=None,
                  redoc_url=None, openapi_url=None)
    app.state.qwen_tts = ctx
    app.include_router(openai_api.router)
    app.include_router(voices_api.router)
    app.include_router(ws.router)
    app.add_exception_handler(ApiError, answer_api_error)
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/ready", ready, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    return app


def start_engine(settings: ServerSettings, on_gc: Callable[[int, float], None] | None = None) -> Any:
    """The engine the app serves from, loading on its own thread and warmed up before it is ready
    (on CPU too, where loading alone would skip warm-up): in a child process with
    ``settings.engine_process`` (server/engine_process.py), else an EngineService in this one."""
    if settings.engine_process:
        from .engine_process import EngineProcess

        return EngineProcess(settings, on_gc=on_gc)
    return load_engine_service(settings)


def load_engine_service(settings: ServerSettings) -> Any:
    """An EngineService for ``settings`` (in whichever process calls it)."""
    from pipecat_qwen_fast import EngineService, QwenTTSEngine

    def load() -> Any:
        return QwenTTSEngine.from_pretrained(settings.model, device=settings.device,
                                             dtype=settings.dtype, backend=settings.backend,
                                             warmup=True, progress=False)

    # A process of its own: the heap frozen once loaded and once fully warm, on a CPU too
    # (engine/heap.py).
    return EngineService(load, name=settings.model_name, freeze_heap=True,
                         max_round_ms=settings.max_round_ms, min_slack_ms=settings.min_slack_ms,
                         max_queued_streams=settings.max_queued_streams)


async def report_load(ctx: ServerContext,
                      on_failure: Callable[[BaseException], None] | None) -> None:
    started = time.monotonic()
    try:
        await ctx.service.wait_ready()
    except Exception as exc:  # noqa: BLE001 - reported here; /health says it too
        logger.error("engine failed to load: %s: %s", type(exc).__name__, exc)
        if on_failure is not None:
            on_failure(exc)
        return
    service = ctx.service
    logger.info("engine ready after %.1f s: %s model, %d voices; serving up to %d streams",
                time.monotonic() - started, service.model_type, len(service.voices),
                ctx.settings.max_streams)
    if ctx.owns_service:
        while service.alive and not getattr(service.engine, "fully_warm", True):
            await asyncio.sleep(1.0)
        # The service logs its heap freezes itself (engine/heap.py), the second one about now.
        logger.info("fully warm")


async def answer_api_error(request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, ApiError)
    context_of(request).count_failure(error)
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers())


def state_of(ctx: ServerContext) -> str:
    if not ctx.alive:
        return "failed"
    if ctx.gate.draining:
        return "draining"
    return "ready" if ctx.ready else "loading"


async def health(request: Request) -> JSONResponse:
    """Liveness: 200 while the process can still serve (loading and draining included); 503
    once the engine failed to load or died, which only a restart cures."""
    ctx = context_of(request)
    state = state_of(ctx)
    return JSONResponse({"status": state}, status_code=503 if state == "failed" else 200)


async def ready(request: Request) -> JSONResponse:
    """Readiness: 200 only once the engine is loaded and warm, and not while draining."""
    ctx = context_of(request)
    state = state_of(ctx)
    body = {"ready": state == "ready", "status": state}
    if state == "ready":
        # Ready serves a call at full speed; the batch path's graphs follow in the background
        # while idle (engine/warmup.py), so a load test waits for this too.
        body["fully_warm"] = bool(getattr(ctx.service.engine, "fully_warm", True))
    return JSONResponse(body, status_code=200 if state == "ready" else 503)


async def metrics(request: Request) -> Response:
    return Response(context_of(request).metrics.render(), media_type=CONTENT_TYPE)
