"""LiveKit ``llm.LLM`` standing in for a cloud model when OPENAI_API_KEY is not set."""

from __future__ import annotations

import asyncio
from typing import Any

from livekit.agents import llm, utils
from livekit.agents.types import DEFAULT_API_CONNECT_OPTIONS, APIConnectOptions

from .offline_llm import compose_reply, split_into_chunks


def last_user_message(chat_ctx: llm.ChatContext) -> str:
    for item in reversed(chat_ctx.items):
        if getattr(item, "type", None) == "message" and item.role == "user":
            return item.text_content or ""
    return ""


class OfflineLLMStream(llm.LLMStream):
    async def _run(self) -> None:
        request_id = utils.shortuuid()
        reply = compose_reply(last_user_message(self._chat_ctx))
        for piece in split_into_chunks(reply):
            self._event_ch.send_nowait(
                llm.ChatChunk(id=request_id, delta=llm.ChoiceDelta(role="assistant", content=piece))
            )
            # Yield between pieces like a network stream would, so TTS can start on sentence one.
            await asyncio.sleep(0)


class OfflineLLM(llm.LLM):
    """Answers each turn with :func:`~demo_agent.offline_llm.compose_reply`, streamed by word."""

    @property
    def model(self) -> str:
        return "offline-echo"

    @property
    def provider(self) -> str:
        return "demo_agent"

    def chat(
        self,
        *,
        chat_ctx: llm.ChatContext,
        tools: list[Any] | None = None,
        conn_options: APIConnectOptions = DEFAULT_API_CONNECT_OPTIONS,
        **_: Any,
    ) -> llm.LLMStream:
        return OfflineLLMStream(
            self, chat_ctx=chat_ctx, tools=tools or [], conn_options=conn_options
        )
