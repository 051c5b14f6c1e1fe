"""The server on Ray Serve (CPU): two replicas of the tiny checkpoint behind Ray's loopback proxy.

Requests spread over both replicas; one replica is killed while streams are in flight on both.
Streams on the dead replica end with an error the client sees (a cut transfer, never a short
response that looks complete), the other replica's streams finish and it keeps serving, and Ray
brings a new replica up in the dead one's place.
"""

from __future__ import annotations

import asyncio
import socket
import time

import httpx
import pytest

from .conftest import FRAME_SAMPLES, VOICE, settings_for

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

APP = "qwen-tts"
FRAMES = 60  # long enough that a stream is still in flight when its replica dies
TIMEOUT = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_app(endless_path):
    from pipecat_qwen_fast.server.ray_serve import tts_app

    port = free_port()
    # Two CPUs for the whole cluster; replicas ask for a quarter each so both fit beside Ray's own
    # actors, and start torch with one thread as the rest of the test suite does.
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = tts_app(settings_for(endless_path, max_frames=FRAMES), num_replicas=2, num_gpus=0,
                      num_cpus=0.25, health_check_period_s=1)
        serve.run(app, name=APP, route_prefix="/", blocking=False)
        base = f"http://127.0.0.1:{port}"
        wait_for_replicas(2)
        yield base
    finally:
        serve.shutdown()
        ray.shutdown()


def running_replicas() -> int:
    status = serve.status().applications.get(APP)
    if status is None:
        return 0
    (deployment,) = status.deployments.values()
    return deployment.replica_states.get("RUNNING", 0)


def wait_for_replicas(count: int, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while running_replicas() != count:
        assert time.monotonic() < deadline, f"replicas: {serve.status().applications.get(APP)}"
        time.sleep(0.2)


BODY = {"input": "Replicas share the work. " * 4, "voice": VOICE, "response_format": "pcm"}


async def speak(http: httpx.AsyncClient) -> tuple[str, int]:
    response = await http.post("/v1/audio/speech", json={**BODY, "max_new_tokens": 4})
    assert response.status_code == 200, response.text
    return response.headers["x-qwen-fast-replica"], len(response.content)


async def test_two_replicas_share_requests_and_survive_one_being_killed(ray_app):
    async with httpx.AsyncClient(base_url=ray_app, timeout=TIMEOUT) as http:
        ready = await http.get("/ready")
        assert ready.status_code == 200
        # Requests spread: concurrent ones go to both replicas.
        seen: set[str] = set()
        for _ in range(10):
            results = await asyncio.gather(*(speak(http) for _ in range(4)))
            assert {size for _, size in results} == {4 * FRAME_SAMPLES * 2}
            seen |= {replica for replica, _ in results}
            if len(seen) == 2:
                break
        assert len(seen) == 2, seen

        # Streams in flight on both replicas: one reads a first chunk and then waits.
        streams, first = [], {}
        for _ in range(12):
            request = http.build_request("POST", "/v1/audio/speech", json=BODY)
            response = await http.send(request, stream=True)
            assert response.status_code == 200
            replica = response.headers["x-qwen-fast-replica"]
            pieces = response.aiter_raw()
            received = len(await anext(pieces))
            streams.append((replica, response, pieces, received))
            first.setdefault(replica, len(streams) - 1)
            if len(first) == 2:
                break
        assert len(first) == 2, "no stream landed on the second replica"
        victim, survivor = sorted(first)
        ray.kill(ray.get_actor(victim, namespace="serve"))

        outcomes: dict[str, list[str]] = {victim: [], survivor: []}
        for replica, response, pieces, received in streams:
            try:
                async for piece in pieces:
                    received += len(piece)
                outcome = "complete" if received == FRAMES * FRAME_SAMPLES * 2 else "short"
            except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
                outcome = type(exc).__name__
            finally:
                await response.aclose()
            outcomes[replica].append(outcome)
        assert set(outcomes[survivor]) == {"complete"}, outcomes
        # Cut off, and the client knows it: no stream on the dead replica looks complete.
        assert outcomes[victim] and "complete" not in outcomes[victim], outcomes
        assert "short" not in outcomes[victim], outcomes

        # The other replica keeps serving meanwhile...
        replica, _ = await speak(http)
        assert replica != victim
        # ...and Ray replaces the dead one.
        wait_for_replicas(2)
        # The proxy's router learns of the new replica some time after the controller calls it
        # running (a long poll; once more than 10 rounds of requests on a loaded machine).
        seen, deadline = set(), time.monotonic() + TIMEOUT / 2
        while not seen - {survivor} and time.monotonic() < deadline:
            seen |= {r for r, _ in await asyncio.gather(*(speak(http) for _ in range(4)))}
        assert victim not in seen and len(seen - {survivor}) == 1, seen


def test_app_builder_reads_serve_run_arguments():
    from pipecat_qwen_fast.server.ray_serve import app_builder

    app = app_builder({"model": "/models/tts", "max_streams": "8", "max_frames": "600",
                       "voice_aliases": "alloy=ryan,nova=vivian", "max_replicas": "4",
                       "num_gpus": "1"})
    deployment = app._bound_deployment
    (settings,) = deployment.init_args
    assert (settings.model, settings.max_streams, settings.max_frames) == ("/models/tts", 8, 600)
    assert settings.voice_aliases == {"alloy": "ryan", "nova": "vivian"}
    assert settings.engine_process  # as `qwen-fast-tts serve` runs it
    (settings,) = app_builder({"model": "/m", "engine_process": "false"})._bound_deployment.init_args
    assert not settings.engine_process
    with pytest.raises(ValueError, match="expected true or false, got 'maybe'"):
        app_builder({"model": "/m", "engine_process": "maybe"})
    config = deployment._deployment_config
    assert config.autoscaling_config.max_replicas == 4
    assert config.autoscaling_config.target_ongoing_requests == 8
    assert config.max_ongoing_requests == 16 and config.max_queued_requests == 8
    assert deployment.ray_actor_options["num_gpus"] == 1
    with pytest.raises(ValueError, match="unknown arguments: modle"):
        app_builder({"modle": "/models/tts"})
