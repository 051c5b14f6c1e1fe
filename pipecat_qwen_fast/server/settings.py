"""What one server process is configured with: the model it loads and the limits it enforces."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

# The variable the API key is read from when no --api-key is given: a key on the command line is
# visible to every user of the machine through the process list.
API_KEY_ENV = "QWEN_FAST_API_KEY"


@dataclass
class ServerSettings:
    """Settings of one server process (one engine).

    Args:
        model: local checkpoint folder or Hugging Face hub id.
        device, dtype, backend: passed to ``QwenTTSEngine.from_pretrained``.
        host, port: where the standalone server listens (port 0: any free port, logged).
        api_key: when set, every ``/v1`` request must carry it (``Authorization: Bearer <key>``
            or ``Api-Key <key>``); ``/health``, ``/ready`` and ``/metrics`` stay open.
        max_streams: synthesis streams served at once (HTTP requests plus WebSocket turns);
            one more is refused with 503 / an error event rather than queued behind them.
        max_input_chars: longest text one request (or one WebSocket turn's unspoken buffer) may
            hold.
        max_frames: longest audio one stream may make, in 80 ms frames, below the engine's own
            cap from the text's length (a guard against runaway generation); None: the engine's.
        retry_after_s: the Retry-After a refusal suggests.
        drain_timeout_s: on SIGTERM, how long in-flight streams may take to finish before exit.
        ws_config_timeout_s: a new WebSocket must send session.config within this time.
        ws_idle_timeout_s: an idle WebSocket (no turn in progress) is closed after this long
            without a message (LiveKit's Qwen3TTS client pings every 15 s).
        voice_aliases: extra names for voices (``{"alloy": "ryan"}``), for clients that only
            send OpenAI's voice names (Pipecat's OpenAITTSService).
        served_model_name: the id ``/v1/models`` reports; the folder or hub name by default.
        wait_ready_on_startup: finish ASGI startup only once the engine is warm (Ray Serve then
            routes nothing to a replica that is still loading); standalone servers answer
            ``/health`` while they load.
        log_level: uvicorn's log level for the standalone server.
        engine_process: run the engine in a child process of its own, this one keeping the
            sockets (server/engine_process.py): the engine thread then has a GIL to itself.
        max_round_ms, min_slack_ms, max_queued_streams: the engine's admission control, as
            `EngineService` takes them ("auto": its defaults on a GPU, none elsewhere; None:
            off): new streams are refused while the smoothed round is over `max_round_ms`, for
            0.5 s after a chunk came within `min_slack_ms` of its playback, or while
            `max_queued_streams` calls already wait to open. Lower limits refuse sooner and
            keep more margin; higher ones admit more calls and risk late audio.
    """

    model: str
    device: str = "auto"
    dtype: str = "auto"
    backend: str = "auto"
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_streams: int = 32
    max_input_chars: int = 4096
    max_frames: int | None = None
    retry_after_s: int = 1
    drain_timeout_s: float = 30.0
    ws_config_timeout_s: float = 10.0
    ws_idle_timeout_s: float = 30.0
    voice_aliases: dict[str, str] = field(default_factory=dict)
    served_model_name: str | None = None
    wait_ready_on_startup: bool = False
    log_level: str = "info"
    engine_process: bool = False
    max_round_ms: float | str | None = "auto"
    min_slack_ms: float | str | None = "auto"
    max_queued_streams: int | str | None = "auto"

    def __post_init__(self) -> None:
        from pipecat_qwen_fast.engine.service import check_admission

        # Here, not when the engine (maybe in a child process) is made from these settings.
        check_admission(max_round_ms=self.max_round_ms, min_slack_ms=self.min_slack_ms,
                        max_queued_streams=self.max_queued_streams)
        if self.api_key is None:
            self.api_key = os.environ.get(API_KEY_ENV) or None
        if self.max_streams < 1:
            raise ValueError(f"max_streams must be >= 1, got {self.max_streams}")
        if self.max_frames is not None and self.max_frames < 1:
            raise ValueError(f"max_frames must be >= 1, got {self.max_frames}")
        if self.max_input_chars < 1:
            raise ValueError(f"max_input_chars must be >= 1, got {self.max_input_chars}")
        self.voice_aliases = {k.strip().lower(): v.strip() for k, v in self.voice_aliases.items()}

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        return os.path.basename(os.fspath(self.model).rstrip("/")) or os.fspath(self.model)


def parse_voice_aliases(items: list[str] | None) -> dict[str, str]:
    """``["alloy=ryan", "nova=vivian"]`` -> ``{"alloy": "ryan", "nova": "vivian"}``."""
    aliases: dict[str, str] = {}
    for item in items or []:
        name, sep, voice = item.partition("=")
        if not sep or not name.strip() or not voice.strip():
            raise ValueError(f"a voice alias is NAME=VOICE (e.g. alloy=ryan), got {item!r}")
        aliases[name.strip().lower()] = voice.strip()
    return aliases
