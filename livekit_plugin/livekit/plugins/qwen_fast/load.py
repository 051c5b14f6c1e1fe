# Copyright 2026 pipecat-qwen-fast authors
# SPDX-License-Identifier: Apache-2.0

"""``load_fnc`` for LiveKit's dispatcher: this worker's TTS stream load in [0, 1].

LiveKit calls ``WorkerOptions.load_fnc`` every few seconds, in a thread, with no argument or with
the worker; past ``load_threshold`` (0.7 in production) the worker is marked full and gets no new
jobs. Its default measures CPU, which says nothing about a GPU full of TTS streams.

- Remote mode: the server's own figures, read from its ``/metrics`` (streams admitted over its
  bound on them; 1.0 while it loads or drains, or cannot be read).
- In-process: the engine's streams (decoding or waiting for a slot) over its slots. Only a worker
  whose jobs share its process (``job_executor_type=JobExecutorType.THREAD``) sees them; with
  LiveKit's default process per job, run the server and use remote mode.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pipecat_qwen_fast.remote import RemoteUnavailableError, server_load

from .log import logger

if TYPE_CHECKING:
    from .tts import TTS

# Streams an engine without a fixed slot count (the CPU backends) is taken to serve at once:
# the server's own default bound (ServerSettings.max_streams).
DEFAULT_CAPACITY = 32


def load_fnc(
    tts: TTS | None = None,
    *,
    base_url: str | None = None,
    api_key: str | None = None,
    capacity: int | None = None,
    timeout_s: float = 2.0,
) -> Callable[[], float]:
    """A ``load_fnc`` for ``WorkerOptions``: the load of `tts` (remote or in-process), or of the
    server at `base_url`.

    Args:
        tts: The TTS the worker's jobs use; its mode decides where the load is read.
        base_url: A server to read instead (``qwen-fast-tts serve``, "ws://host:port").
        api_key: The server's API key (with ``base_url``; a remote `tts` brings its own).
        capacity: In-process: the streams that make the worker full; None uses the engine's
            session slots, or DEFAULT_CAPACITY on a backend with no fixed number.
        timeout_s: How long a read of the server's metrics may take.

    Usage::

        WorkerOptions(entrypoint_fnc=entrypoint, load_fnc=qwen_fast.load_fnc(base_url=URL))
    """
    if (tts is None) == (base_url is None):
        raise ValueError("load_fnc takes a TTS or a base_url (one of them)")
    if capacity is not None and capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    if tts is not None and tts.remote is not None:
        base_url, api_key = tts.remote.base_url, tts.remote.api_key
    if base_url is not None:
        url = base_url

        def remote_load() -> float:
            try:
                return server_load(url, api_key, timeout_s)
            except RemoteUnavailableError as e:
                # A worker whose TTS cannot be reached is full: its calls would have no voice.
                logger.warning("TTS load unknown, reporting full: %s", e)
                return 1.0

        return remote_load

    assert tts is not None
    in_process = tts

    def engine_load() -> float:
        return _engine_load(in_process.engine_service, capacity)

    return engine_load


def _engine_load(service: Any, capacity: int | None) -> float:
    if service is None or not service.ready:
        return 0.0  # nothing loaded yet: the first job's TTS loads it
    # EngineService keeps no public count of its streams: these lists are the streams opened and
    # not yet closed (new, decoding, waiting for a slot); len() of a list is safe across threads.
    streams = len(service._inbox) + len(service._active) + len(service._waiting)
    if capacity is None:
        backend = getattr(service.engine, "backend", None)
        capacity = getattr(backend, "max_sessions", None) or DEFAULT_CAPACITY
    return min(1.0, streams / capacity)
