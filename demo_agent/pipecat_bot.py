"""The Pipecat demo: a voice bot on the SmallWebRTC transport with Pipecat's prebuilt browser UI.

    python -m demo_agent pipecat            # then open http://localhost:7860/

One HTTP server serves the prebuilt UI (``/client/``, where ``/`` leads), a small text-only page
that needs no internet (``/text/``, see :mod:`demo_agent.text_page`) and the WebRTC signalling both
speak (``/start``, then ``/sessions/{id}/api/offer``; plain ``/api/offer`` for other clients).
Each browser connection gets its own pipeline:

    transport in -> [Deepgram STT] -> user context -> LLM -> Qwen3-TTS -> transport out

With DEEPGRAM_API_KEY set, speech is transcribed (Silero VAD finds the turns); with
OPENAI_API_KEY set, an OpenAI model answers. Without keys it runs offline: the UI's text box
sends the typed text, :class:`~demo_agent.pipecat_llm.OfflineLLM` answers, and our TTS speaks.
The model is loaded once, before the server accepts its first connection; every session shares
it through the engine service.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import HTMLResponse, RedirectResponse
from loguru import logger as pipecat_logger
from pipecat.frames.frames import TTSSpeakFrame
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.processors.aggregators.llm_response_universal import (
    LLMContextAggregatorPair,
    LLMUserAggregatorParams,
)
from pipecat.transports.base_transport import TransportParams
from pipecat.transports.smallwebrtc.connection import SmallWebRTCConnection
from pipecat.transports.smallwebrtc.request_handler import (
    IceCandidate,
    SmallWebRTCPatchRequest,
    SmallWebRTCRequest,
    SmallWebRTCRequestHandler,
)
from pipecat.transports.smallwebrtc.transport import SmallWebRTCTransport
from pipecat.workers.runner import WorkerRunner

from pipecat_qwen_fast.engine.service import EngineService
from pipecat_qwen_fast.tts import QwenFastTTSService

from .options import TTSOptions, cloud_keys, describe_modes, missing_package_error
from .pipecat_llm import OfflineLLM
from .prompts import SYSTEM_PROMPT, default_greeting
from .text_page import PAGE

logger = logging.getLogger("demo_agent.pipecat")

TRANSPORTS = ("webrtc",)


@dataclass(frozen=True)
class BotConfig:
    """Everything a session needs; built once per process."""

    tts: TTSOptions
    service: EngineService
    greeting: str | None = None  # None: the greeting for the input mode; "" for none
    idle_timeout_s: float = 300.0


def create_tts(config: BotConfig) -> QwenFastTTSService:
    opts = config.tts
    return QwenFastTTSService(
        engine_service=config.service,
        seed=opts.seed,
        max_frames=opts.max_frames,
        settings=QwenFastTTSService.Settings(
            model=opts.model, voice=opts.voice, language=opts.language
        ),
    )


def create_stt_and_llm(deepgram_key: str | None, openai_key: str | None) -> tuple[Any, Any]:
    """Cloud services where a key is set, the offline stand-in LLM where not (no offline STT)."""
    stt = None
    if deepgram_key:
        try:
            from pipecat.services.deepgram.stt import DeepgramSTTService
        except ImportError as e:
            raise missing_package_error(
                "DEEPGRAM_API_KEY", 'pip install "pipecat-ai[deepgram]"'
            ) from e
        stt = DeepgramSTTService(api_key=deepgram_key)
    if openai_key:
        try:
            from pipecat.services.openai.llm import OpenAILLMService
        except ImportError as e:
            raise missing_package_error("OPENAI_API_KEY", 'pip install "pipecat-ai[openai]"') from e
        llm = OpenAILLMService(api_key=openai_key)
    else:
        llm = OfflineLLM()
    return stt, llm


def create_webrtc_transport(connection: SmallWebRTCConnection, listening: bool):
    return SmallWebRTCTransport(
        webrtc_connection=connection,
        params=TransportParams(audio_in_enabled=listening, audio_out_enabled=True),
    )


async def run_bot(make_transport: Callable[[bool], Any], config: BotConfig) -> None:
    """Run one client's pipeline until the client leaves or the server stops.

    ``make_transport(listening)`` builds the session's transport; ``listening`` says whether
    audio input is wanted (only when there is speech recognition).
    """
    deepgram_key, openai_key = cloud_keys()
    stt, llm = create_stt_and_llm(deepgram_key, openai_key)
    listening = stt is not None
    transport = make_transport(listening)
    context = LLMContext(messages=[{"role": "system", "content": SYSTEM_PROMPT}])
    vad = None
    if listening:
        from pipecat.audio.vad.silero import SileroVADAnalyzer

        vad = SileroVADAnalyzer()
    aggregators = LLMContextAggregatorPair(
        context, user_params=LLMUserAggregatorParams(vad_analyzer=vad)
    )
    processors = [
        transport.input(),
        *([stt] if stt is not None else []),
        aggregators.user(),
        llm,
        create_tts(config),
        transport.output(),
        aggregators.assistant(),
    ]
    worker = PipelineWorker(
        Pipeline(processors),
        params=PipelineParams(enable_metrics=True, enable_usage_metrics=True),
        idle_timeout_secs=config.idle_timeout_s,
    )

    greeting = default_greeting(listening) if config.greeting is None else config.greeting

    @transport.event_handler("on_client_connected")
    async def on_client_connected(_transport, _client):
        logger.info("client connected (%s mode)", "voice" if listening else "text")
        if greeting:
            await worker.queue_frames([TTSSpeakFrame(greeting)])

    @transport.event_handler("on_client_disconnected")
    async def on_client_disconnected(_transport, _client):
        logger.info("client disconnected")
        await worker.cancel()

    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(worker)
    await runner.run()


def create_app(config: BotConfig, *, ready_message: str | None = None) -> FastAPI:
    """The HTTP app: prebuilt UI, the signalling routes it uses, and clean shutdown."""
    handler = SmallWebRTCRequestHandler()
    sessions: set[str] = set()
    bots: set[asyncio.Task] = set()

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        if ready_message:
            print(ready_message, flush=True)
        yield
        # Hang up first so every pipeline sees its client leave, then stop what is left.
        await handler.close()
        for task in list(bots):
            task.cancel()
        if bots:
            await asyncio.wait(bots, timeout=10)
        await config.service.aclose()

    app = FastAPI(lifespan=lifespan)

    try:
        from pipecat_ai_prebuilt.frontend import PipecatPrebuiltUI
    except ImportError:
        logger.warning(
            'prebuilt UI missing: pip install "pipecat-ai[runner]"; serving the API only'
        )
    else:
        app.mount("/client", PipecatPrebuiltUI)

        @app.get("/", include_in_schema=False)
        async def root():
            return RedirectResponse(url="/client/")

    @app.get("/text/", include_in_schema=False)
    async def text_page():
        return HTMLResponse(PAGE)

    @app.get("/text", include_in_schema=False)
    async def text_page_redirect():
        return RedirectResponse(url="/text/")

    @app.get("/status")
    async def status():
        return {"status": "ready", "transports": list(TRANSPORTS)}

    @app.post("/start")
    async def start(request: Request):
        try:
            body = await request.json()
        except ValueError:
            body = {}
        transport = (body or {}).get("transport", "webrtc")
        if transport not in TRANSPORTS:
            raise HTTPException(
                status_code=400,
                detail=f"transport {transport!r} is not served here; "
                f"valid transports: {', '.join(TRANSPORTS)}",
            )
        session_id = str(uuid.uuid4())
        sessions.add(session_id)
        return {"sessionId": session_id}

    def start_bot(make_transport: Callable[[bool], Any]) -> asyncio.Task:
        task = asyncio.create_task(_run_logged(make_transport, config))
        bots.add(task)
        task.add_done_callback(bots.discard)
        return task

    async def answer_offer(offer: SmallWebRTCRequest) -> dict:
        async def on_connection(connection: SmallWebRTCConnection) -> None:
            start_bot(partial(create_webrtc_transport, connection))

        return await handler.handle_web_request(offer, on_connection)

    @app.post("/api/offer")
    async def offer(offer: SmallWebRTCRequest):
        return await answer_offer(offer)

    @app.patch("/api/offer")
    async def ice_candidates(patch: SmallWebRTCPatchRequest):
        await handler.handle_patch_request(patch)
        return {"status": "success"}

    @app.api_route("/sessions/{session_id}/api/offer", methods=["POST", "PATCH"])
    async def session_offer(session_id: str, request: Request):
        if session_id not in sessions:
            raise HTTPException(status_code=404, detail="unknown session; POST /start first")
        data = await request.json()
        if request.method == "POST":
            return await answer_offer(
                SmallWebRTCRequest(
                    sdp=data["sdp"],
                    type=data["type"],
                    pc_id=data.get("pc_id"),
                    restart_pc=data.get("restart_pc"),
                )
            )
        candidates = [IceCandidate(**c) for c in data.get("candidates", [])]
        return await ice_candidates(
            SmallWebRTCPatchRequest(pc_id=data["pc_id"], candidates=candidates)
        )

    return app


async def _run_logged(make_transport: Callable[[bool], Any], config: BotConfig) -> None:
    try:
        await run_bot(make_transport, config)
    except asyncio.CancelledError:
        raise
    except Exception:  # noqa: BLE001 - one failed session must not stop the server
        pipecat_logger.exception("bot session failed")


def serve(config: BotConfig, *, host: str, port: int) -> None:
    """Serve until SIGINT/SIGTERM, then hang up every session and stop the engine."""
    import uvicorn

    logger.info(describe_modes("text (type in the page)"))
    url = f"http://{_url_host(host)}:{port}"
    ready = f"Demo ready: open {url}/ in a browser ({url}/text/ works with no internet at all)"
    uvicorn.run(
        create_app(config, ready_message=ready),
        host=host,
        port=port,
        log_level="warning",
        # An open browser tab would otherwise hold shutdown until it hangs up.
        timeout_graceful_shutdown=5,
    )


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", "::"):
        return "localhost"
    return f"[{host}]" if ":" in host else host
