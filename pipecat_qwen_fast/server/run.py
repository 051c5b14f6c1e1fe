"""The standalone server: uvicorn, with a drain on SIGTERM before uvicorn's own shutdown.

Uvicorn, told to exit, stops listening and closes every open WebSocket at once (code 1012), which
would cut off turns mid-sentence. Here the first SIGTERM or SIGINT starts a drain instead: the
server keeps listening but refuses new streams (503 with Retry-After, ``/ready`` false, idle
sockets closed with 1001), waits until the streams in flight have finished or
``drain_timeout_s`` has passed, and only then lets uvicorn shut down. A second signal exits at once.
"""

from __future__ import annotations

import logging
import time
from types import FrameType

import uvicorn

from .app import build_app
from .context import ServerContext
from .inline_voices import MAX_INLINE_BYTES
from .settings import ServerSettings

logger = logging.getLogger("pipecat_qwen_fast.server")

# The uvicorn's own limit on a WebSocket message. A session.config with inline reference audio
# is the largest message the protocol has; this server refuses those anyway.


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose exit signals drain first (see the module docstring)."""

    def __init__(self, config: uvicorn.Config, ctx: ServerContext) -> None:
        super().__init__(config)
        self.ctx = ctx
        self._drain_requested = False
        self._drain_deadline: float | None = None
        self.load_failed = False

    def request_drain(self) -> None:
        """Start draining at the next tick (safe from a signal handler or another thread)."""
        self._drain_requested = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_requested:
            self.should_exit = True
            self.force_exit = True
        else:
            self.request_drain()

    def fail_load(self, error: BaseException) -> None:
        self.load_failed = True
        self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        if await super().on_tick(counter):
            return True
        if not self._drain_requested:
            return False
        gate = self.ctx.gate
        now = time.monotonic()
        if self._drain_deadline is None:
            self._drain_deadline = now + self.ctx.settings.drain_timeout_s
            gate.begin_drain()
            logger.info("draining: %d streams in flight, new ones refused", gate.in_use)
        if gate.in_use == 0:
            logger.info("drained; shutting down")
            return True
        if now >= self._drain_deadline:
            logger.warning("drain timed out with %d streams in flight; shutting down", gate.in_use)
            return True
        return False


def make_server(settings: ServerSettings, service=None) -> DrainingServer:
    """A server for ``settings``; ``run()`` it (in the main thread for signal handling)."""
    holder: list[DrainingServer] = []
    app = build_app(settings, service, on_load_failure=lambda exc: holder[0].fail_load(exc))
    config = uvicorn.Config(
        app, host=settings.host, port=settings.port, log_level=settings.log_level,
        ws_max_size=MAX_INLINE_BYTES, lifespan="on",
        # Our drain has already waited for the streams; what is left is closing sockets.
        timeout_graceful_shutdown=5,
    )
    server = DrainingServer(config, app.state.qwen_tts)
    holder.append(server)
    return server


def serve(settings: ServerSettings) -> int:
    """Run until drained after SIGTERM/SIGINT; the exit status (1 if the model failed to load)."""
    server = make_server(settings)
    server.run()
    return 1 if server.load_failed else 0
