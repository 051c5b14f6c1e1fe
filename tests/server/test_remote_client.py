"""The remote adapters' client (pipecat_qwen_fast/remote.py) against the real server: the socket a
clean turn ends on, kept for the next utterance; the spare connected after a cancelled turn; the
number of sockets one client holds."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import weakref
from collections.abc import AsyncIterator

import pytest

from pipecat_qwen_fast import SynthesisRequest, remote
from pipecat_qwen_fast.remote import RemoteTTSClient

from .conftest import VOICE, eventually, settled

pytestmark = pytest.mark.timeout(180)

TIMEOUT = 60


def request(seed: int) -> SynthesisRequest:
    return SynthesisRequest("A short one.", voice=VOICE, seed=seed, max_frames=4)


async def read(stream) -> tuple[int, object]:
    """Samples of the stream's utterance, and the socket it was spoken on."""
    samples, socket = 0, None
    async for chunk in stream:
        socket = socket or stream._ws
        samples += len(chunk.pcm)
    await stream.wait_closed()
    return samples, socket


async def speak(client: RemoteTTSClient, seed: int) -> tuple[int, object]:
    return await read(client.open_stream(request(seed)))


@contextlib.asynccontextmanager
async def client_of(server, **kw) -> AsyncIterator[RemoteTTSClient]:
    """A client of `server`, closed at the end; after a test that passed, every socket it held
    must be gone on the server too."""
    client = RemoteTTSClient(server.base_url, **kw)
    try:
        yield client
    finally:
        await client.aclose()
    await eventually(lambda: settled(server) and server.ctx.open_sockets == 0,
                     what="the client's sockets to close on the server")


async def test_the_next_utterance_reuses_the_socket_and_aclose_closes_it(server):
    async with client_of(server) as client:
        first, used = await asyncio.wait_for(speak(client, 1), TIMEOUT)
        assert [ws for _, ws in client._spares] == [used]  # kept: no spare, no close
        second, again = await asyncio.wait_for(speak(client, 1), TIMEOUT)
        assert again is used and first == second > 0  # same turn again, sounds the same
        third, other_voice = await asyncio.wait_for(speak(client, 5), TIMEOUT)
        assert other_voice is used and third > 0  # a new session.config on the same socket
        assert server.ctx.open_sockets == 1


async def test_a_streamed_text_turn_hands_its_socket_to_the_next_one(server):
    async def turn(client: RemoteTTSClient, pieces: list[str]) -> tuple[int, object]:
        stream = client.open_text_stream(SynthesisRequest("", voice=VOICE, seed=8, max_frames=6,
                                                          text_mode="dual_track"))
        for piece in pieces:
            stream.append(piece)
        stream.end()
        return await read(stream)

    async with client_of(server) as client:
        first, used = await asyncio.wait_for(turn(client, ["Token ", "by ", "token."]), TIMEOUT)
        second, again = await asyncio.wait_for(turn(client, ["Token by ", "token."]), TIMEOUT)
        assert again is used and first == second > 0
        plain, after = await asyncio.wait_for(speak(client, 9), TIMEOUT)  # then a whole text
        assert after is used and plain > 0


async def test_a_cancelled_turns_socket_is_closed_and_a_spare_connected(server):
    async with client_of(server) as client:
        stream = client.open_stream(SynthesisRequest("A longer one to cut short.", voice=VOICE,
                                                     seed=6, max_frames=40))
        await asyncio.wait_for(stream.__anext__(), TIMEOUT)
        cut = stream._ws
        await stream.aclose()  # a barge-in
        assert cut.closed
        await eventually(lambda: len(client._spares) == 1, what="a spare socket")
        spare = client._spares[0][1]
        samples, used = await asyncio.wait_for(speak(client, 6), TIMEOUT)
        assert used is spare and samples > 0


async def test_a_stale_socket_is_closed_not_used(server, monkeypatch):
    client = RemoteTTSClient(server.base_url)
    try:
        _, kept = await asyncio.wait_for(speak(client, 2), TIMEOUT)
        monkeypatch.setattr(remote, "SPARE_MAX_AGE_S", 0.0)
        samples, used = await asyncio.wait_for(speak(client, 2), TIMEOUT)
        assert samples > 0 and used is not kept
        await eventually(lambda: kept.closed, what="the stale socket to close")
    finally:
        await client.aclose()


async def test_idle_sockets_are_closed_once_utterances_stop(server, monkeypatch):
    monkeypatch.setattr(remote, "SPARE_MAX_AGE_S", 0.3)
    client = RemoteTTSClient(server.base_url)
    try:
        _, kept = await asyncio.wait_for(speak(client, 7), TIMEOUT)
        await eventually(lambda: kept.closed and not client._spares, what="the idle socket to close")
        await eventually(lambda: server.ctx.open_sockets == 0, what="its close on the server")
    finally:
        await client.aclose()


async def test_a_closed_client_is_freed_without_the_collector(server):
    # aclose's cancelled sweeper kept its CancelledError, whose traceback's frame held the client:
    # 12 objects a client left to a collector pass, which stops every thread (the server's too
    # where the fleet bench runs its callers beside it, bench/probes/turn_cycles.py).
    client = RemoteTTSClient(server.base_url)
    await asyncio.wait_for(speak(client, 4), TIMEOUT)
    assert client._sweeper is not None  # the kept socket's
    await client.aclose()
    await eventually(lambda: server.ctx.open_sockets == 0, what="its close on the server")
    freed = weakref.ref(client)
    gc.disable()
    try:
        del client
        assert freed() is None
    finally:
        gc.enable()


async def test_no_reuse_and_no_spare_when_turned_off(server):
    client = RemoteTTSClient(server.base_url, spare_sockets=0, reuse_sockets=False)
    try:
        samples, used = await asyncio.wait_for(speak(client, 3), TIMEOUT)
        stream = client.open_stream(request(3))
        await asyncio.wait_for(stream.__anext__(), TIMEOUT)
        await stream.aclose()
        await asyncio.sleep(0.2)
        assert samples > 0 and used.closed and not client._spares and not client._chores
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
