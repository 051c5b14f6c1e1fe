"""The LiveKit demo: an agent that speaks with our Qwen3-TTS plugin.

    python -m demo_agent livekit console          # local mic and speaker, no server
    python -m demo_agent livekit console --text   # type instead of talk
    python -m demo_agent livekit dev              # join rooms on LIVEKIT_URL

Offline (no OPENAI_API_KEY) the agent answers with the scripted echo LLM; without
DEEPGRAM_API_KEY it has no speech recognition, so turns are typed: in the console's text mode, or
through the room's chat for a LiveKit server. The model loads once in the main process before the
CLI starts, and jobs run as threads of that process, so every session shares the one engine.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from livekit.agents import Agent, AgentServer, AgentSession, JobContext, JobExecutorType, cli

from .options import TTSOptions, cloud_keys, describe_modes, missing_package_error
from .prompts import SYSTEM_PROMPT, default_greeting

logger = logging.getLogger("demo_agent.livekit")


class DemoAgent(Agent):
    """Greets on entry (when given a greeting), then leaves every turn to the session's LLM."""

    def __init__(self, *, greeting: str | None = None) -> None:
        super().__init__(instructions=SYSTEM_PROMPT)
        listening = cloud_keys()[0] is not None
        self._greeting = default_greeting(listening) if greeting is None else greeting

    async def on_enter(self) -> None:
        if self._greeting:
            self.session.say(self._greeting)


def create_tts(options: TTSOptions, service: Any):
    from livekit.plugins import qwen_fast

    return qwen_fast.TTS(
        model=options.model,
        voice=options.voice,
        language=options.language,
        device=options.device,
        dtype=options.dtype,
        backend=options.backend,
        seed=options.seed,
        max_frames=options.max_frames,
        engine_service=service,
    )


def create_session(options: TTSOptions, service: Any) -> AgentSession:
    """A session with our TTS, plus Deepgram STT and OpenAI LLM where their keys are set."""
    deepgram_key, openai_key = cloud_keys()
    kwargs: dict[str, Any] = {"tts": create_tts(options, service)}
    if deepgram_key:
        try:
            from livekit.plugins import deepgram
        except ImportError as e:
            raise missing_package_error(
                "DEEPGRAM_API_KEY", "pip install livekit-plugins-deepgram"
            ) from e
        from livekit.agents import inference

        kwargs["stt"] = deepgram.STT(api_key=deepgram_key)
        kwargs["vad"] = inference.VAD()
    if openai_key:
        try:
            from livekit.plugins import openai
        except ImportError as e:
            raise missing_package_error(
                "OPENAI_API_KEY", "pip install livekit-plugins-openai"
            ) from e
        kwargs["llm"] = openai.LLM(api_key=openai_key)
    else:
        from .livekit_llm import OfflineLLM

        kwargs["llm"] = OfflineLLM()
    return AgentSession(**kwargs)


def create_server(options: TTSOptions, service: Any) -> AgentServer:
    # Thread jobs share the engine this process loaded; process jobs would each load their own.
    server = AgentServer(job_executor_type=JobExecutorType.THREAD)

    @server.rtc_session()
    async def entrypoint(ctx: JobContext) -> None:
        session = create_session(options, service)
        await session.start(agent=DemoAgent(), room=ctx.room)

    return server


def run(options: TTSOptions, service: Any, cli_args: list[str]) -> None:
    """Hand over to LiveKit's CLI (console, dev, start, connect) with the engine already loaded."""
    # The plugin registers itself on import, which LiveKit only allows on the main thread.
    import livekit.plugins.qwen_fast  # noqa: F401

    logger.info(describe_modes("text (console --text, or room chat)"))
    sys.argv = ["python -m demo_agent livekit", *cli_args]
    cli.run_app(create_server(options, service))
