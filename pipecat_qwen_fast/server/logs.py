"""Keeps spoken text out of the logs.

Our own log lines carry counts and names only. The one place text could leak is a library's frame
dump: uvicorn hands its WebSocket connections the ``uvicorn.error`` logger, and the websockets
library logs every frame there at DEBUG, payload preview included (``--log-level debug``).
"""

from __future__ import annotations

import logging
import os

_WEBSOCKETS_DIR = os.sep + "websockets" + os.sep


class DropFrameDumps(logging.Filter):
    """Drops the websockets library's DEBUG records (frame dumps); keeps everything else."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno <= logging.DEBUG and _WEBSOCKETS_DIR in record.pathname)


def install_log_redaction() -> None:
    """Install the filter on the loggers the websockets library writes to (idempotent)."""
    for name in ("uvicorn.error", "websockets.server", "websockets.client", "websockets"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, DropFrameDumps) for f in logger.filters):
            logger.addFilter(DropFrameDumps())
