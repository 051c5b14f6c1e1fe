"""The remote adapters' client (pipecat_qwen_fast/remote.py) against the real server: the spare
socket it connects once a turn is sent, which the next utterance takes instead of a handshake."""

from __future__ import annotations

import asyncio

import pytest

from pipecat_qwen_fast import SynthesisRequest, remote
from pipecat_qwen_fast.remote import RemoteTTSClient

from .conftest import VOICE, eventually, settled

pytestmark = pytest.mark.timeout(180)

TIMEOUT = 60


def request(seed: int) -> SynthesisRequest:
    return SynthesisRequest("A short one.", voice=VOICE, seed=seed, max_frames=4)


async def speak(client: RemoteTTSClient, seed: int) -> tuple[int, object]:
    """Samples of the utterance, and the socket it was spoken on."""
    stream = client.open_stream(request(seed))
    samples, socket = 0, None
    async for chunk in stream:
        socket = socket or stream._ws
        samples += len(chunk.pcm)
    await stream.wait_closed()
    return samples, socket


async def test_the_next_utterance_takes_the_spare_and_aclose_closes_it(server):
    client = RemoteTTSClient(server.base_url)
    try:
        first, _ = await asyncio.wait_for(speak(client, 1), TIMEOUT)
        await eventually(lambda: len(client._spares) == 1, what="a spare socket")
        spare = client._spares[0][1]
        second, used = await asyncio.wait_for(speak(client, 1), TIMEOUT)
        assert used is spare and first == second > 0
        await eventually(lambda: len(client._spares) == 1, what="the next spare")
        assert client._spares[0][1] is not spare
    finally:
        await client.aclose()
    await eventually(lambda: settled(server) and server.ctx.open_sockets == 0,
                     what="the spare to close on the server")


async def test_a_stale_spare_is_closed_not_used(server, monkeypatch):
    client = RemoteTTSClient(server.base_url)
    try:
        await asyncio.wait_for(speak(client, 2), TIMEOUT)
        await eventually(lambda: len(client._spares) == 1, what="a spare socket")
        stale = client._spares[0][1]
        monkeypatch.setattr(remote, "SPARE_MAX_AGE_S", 0.0)
        samples, used = await asyncio.wait_for(speak(client, 2), TIMEOUT)
        assert samples > 0 and used is not stale
        await eventually(lambda: stale.closed, what="the stale spare to close")
    finally:
        await client.aclose()


async def test_no_spare_when_turned_off(server):
    client = RemoteTTSClient(server.base_url, spare_sockets=0)
    try:
        samples, _ = await asyncio.wait_for(speak(client, 3), TIMEOUT)
        await asyncio.sleep(0.2)
        assert samples > 0 and not client._spares and not client._chores
    finally:
        await client.aclose()
    with pytest.raises(ValueError, match="spare_sockets"):
        RemoteTTSClient(server.base_url, spare_sockets=-1)


async def test_one_client_holds_more_sockets_than_aiohttps_default_pool(server):
    # A fleet's callers (bench fleet --server-url, an agent process serving many calls) share one
    # client; aiohttp's default pool of 100 connections held the 101st stream until the connect
    # timeout.
    client = RemoteTTSClient(server.base_url, connect_timeout_s=5.0, spare_sockets=0)
    sockets = []
    try:
        sockets = await asyncio.wait_for(asyncio.gather(*(client.connect() for _ in range(120))),
                                         TIMEOUT)
        await eventually(lambda: server.ctx.open_sockets >= 120, what="120 sockets on the server")
    finally:
        await asyncio.gather(*(remote._close(ws) for ws in sockets))
        await client.aclose()
    await eventually(lambda: server.ctx.open_sockets == 0, what="the sockets to close on the server")
