"""The server as a Ray Serve deployment: one replica per GPU, the same API behind Ray's proxy.

Each replica is one process with one engine and the app of :func:`.app.build_app`, so everything
the standalone server does (OpenAI endpoint, WebSocket, metrics, admission) holds per replica.
Ray Serve routes requests to replicas, adds replicas as ongoing requests grow, and replaces a
replica that dies or fails its health check. Run it from Python::

    from ray import serve
    from pipecat_qwen_fast.server import ServerSettings
    from pipecat_qwen_fast.server.ray_serve import tts_app

    serve.run(tts_app(ServerSettings(model="Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice",
                                     engine_process=True)))

or from the shell: ``serve run pipecat_qwen_fast.server.ray_serve:app_builder model=<model>``.
``engine_process=True`` runs each replica's engine in a child process, as ``qwen-fast-tts serve``
does (app_builder's default), so the replica's socket work never holds up the engine's thread.
For many streams per replica, start Ray with ``RAY_SERVE_ENABLE_HA_PROXY=1``: Serve's HAProxy
ingress hands each socket to the replica's own server, where its Python proxy relays every
WebSocket message through an actor call (docs/SERVER.md, scale-out).
Needs ``ray[serve]`` (the ``server`` extra brings it).
"""

from __future__ import annotations

from typing import Any

from ray import serve
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .app import build_app
from .settings import ServerSettings, parse_voice_aliases

REPLICA_HEADER = "x-qwen-fast-replica"


@serve.deployment
@serve.ingress()
class QwenTTSDeployment:
    """One replica: loads its engine at startup and is routed to only once it is warm."""

    def __init__(self, settings: ServerSettings) -> None:
        # Ray starts routing when startup returns, so startup waits for the warm engine.
        settings.wait_ready_on_startup = True
        self._app = build_app(settings)
        replica = serve.get_replica_context().replica_id.to_full_id_str()
        self._asgi = ReplicaHeader(self._app, replica)

    def __serve_build_asgi_app__(self) -> ASGIApp:
        return self._asgi

    async def check_health(self) -> None:
        """Ray replaces a replica whose health check raises: here, one whose engine died."""
        ctx = self._app.state.qwen_tts
        if not ctx.alive:
            raise RuntimeError("the TTS engine of this replica failed to load or stopped")


class ReplicaHeader:
    """Names the replica that answered an HTTP request (``x-qwen-fast-replica``), so clients and
    tests can tell replicas apart behind the proxy."""

    def __init__(self, app: ASGIApp, replica: str) -> None:
        self.app = app
        self.header = (REPLICA_HEADER.encode(), replica.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_named(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, send_named)

    def __getattr__(self, name: str) -> Any:
        # Ray's ingress wrapper looks up FastAPI attributes (docs_url, exception handlers).
        return getattr(self.app, name)


def tts_app(settings: ServerSettings, *, num_replicas: int | str = "auto", min_replicas: int = 1,
            max_replicas: int = 1, num_gpus: float = 1, num_cpus: float = 1,
            target_ongoing_requests: float | None = None, max_ongoing_requests: int | None = None,
            max_queued_requests: int | None = None,
            health_check_period_s: float = 10.0) -> Any:
    """A Ray Serve application of the server.

    Args:
        num_replicas: a fixed count, or "auto" to scale between ``min_replicas`` and
            ``max_replicas`` (set it to the GPUs available) on ongoing requests.
        num_gpus, num_cpus: per replica; one GPU each keeps one engine per GPU.
        target_ongoing_requests: what autoscaling keeps per replica; default ``max_streams``.
            A WebSocket counts as ongoing for its whole life, idle or not.
        max_ongoing_requests: what Ray sends one replica at most; default twice ``max_streams``,
            room for idle warm sockets beside the streams the server itself bounds.
        max_queued_requests: requests Ray holds for a busy deployment before answering 503
            itself; default ``max_streams`` (a short wait, not an unbounded queue).
        health_check_period_s: how often Ray asks each replica whether its engine is alive.
    """
    streams = settings.max_streams
    options: dict[str, Any] = {
        "ray_actor_options": {"num_gpus": num_gpus, "num_cpus": num_cpus},
        "max_ongoing_requests": max_ongoing_requests or 2 * streams,
        "max_queued_requests": max_queued_requests if max_queued_requests is not None else streams,
        "health_check_period_s": health_check_period_s,
    }
    if num_replicas == "auto":
        options["autoscaling_config"] = {
            "min_replicas": min_replicas,
            "max_replicas": max_replicas,
            "target_ongoing_requests": target_ongoing_requests or streams,
        }
    else:
        options["num_replicas"] = int(num_replicas)
    return QwenTTSDeployment.options(**options).bind(settings)


DEPLOYMENT_ARGS = {"num_replicas": int, "min_replicas": int, "max_replicas": int,
                   "num_gpus": float, "num_cpus": float, "target_ongoing_requests": float,
                   "max_ongoing_requests": int, "max_queued_requests": int,
                   "health_check_period_s": float}


def _flag(value: str) -> bool:
    if value.lower() not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
        raise ValueError(f"expected true or false, got {value!r}")
    return value.lower() in ("true", "1", "yes", "on")


SETTINGS_ARGS = {"model": str, "device": str, "dtype": str, "backend": str, "api_key": str,
                 "max_streams": int, "max_input_chars": int, "max_frames": int,
                 "retry_after_s": int,
                 "drain_timeout_s": float, "ws_config_timeout_s": float,
                 "ws_idle_timeout_s": float, "served_model_name": str,
                 "engine_process": _flag,
                 "voice_aliases": lambda v: parse_voice_aliases(v.split(","))}


def app_builder(args: dict[str, str]) -> Any:
    """For ``serve run pipecat_qwen_fast.server.ray_serve:app_builder model=... max_replicas=4``:
    ServerSettings fields and :func:`tts_app`'s keyword arguments as strings
    (``voice_aliases=alloy=ryan,nova=vivian``; ``num_replicas=auto``). The engine runs in a child
    process of each replica, as under ``qwen-fast-tts serve`` (``engine_process=false``: in the
    replica's own)."""
    unknown = sorted(set(args) - set(DEPLOYMENT_ARGS) - set(SETTINGS_ARGS))
    if unknown:
        raise ValueError(f"unknown arguments: {', '.join(unknown)}; valid: "
                         f"{', '.join(sorted({*DEPLOYMENT_ARGS, *SETTINGS_ARGS}))}")
    settings = {"engine_process": True,
                **{k: SETTINGS_ARGS[k](v) for k, v in args.items() if k in SETTINGS_ARGS}}
    deployment = {k: v if v == "auto" else DEPLOYMENT_ARGS[k](v)
                  for k, v in args.items() if k in DEPLOYMENT_ARGS}
    return tts_app(ServerSettings(**settings), **deployment)
