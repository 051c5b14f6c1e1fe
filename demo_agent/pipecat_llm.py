"""Pipecat processor standing in for an LLM service when OPENAI_API_KEY is not set."""

from __future__ import annotations

from pipecat.frames.frames import (
    Frame,
    LLMContextFrame,
    LLMFullResponseEndFrame,
    LLMFullResponseStartFrame,
    LLMTextFrame,
)
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor

from .offline_llm import compose_reply, last_user_text, split_into_chunks


class OfflineLLM(FrameProcessor):
    """Answers each context frame with :func:`compose_reply`, framed like a streaming LLM.

    Sits where an LLM service would (between the user and assistant aggregators) and emits the
    same frame sequence, so the TTS sentence aggregation and the context commit behave exactly as
    with a real model.
    """

    def __init__(self, **kwargs):
        super().__init__(name="OfflineLLM", **kwargs)

    async def process_frame(self, frame: Frame, direction: FrameDirection):
        await super().process_frame(frame, direction)
        if not isinstance(frame, LLMContextFrame):
            await self.push_frame(frame, direction)
            return
        # A speculative context is a guess at an unfinished turn; its answer must never be heard.
        if frame.speculation:
            return
        reply = compose_reply(last_user_text(list(frame.context.get_messages())))
        await self.push_frame(LLMFullResponseStartFrame())
        for piece in split_into_chunks(reply):
            await self.push_frame(LLMTextFrame(piece))
        await self.push_frame(LLMFullResponseEndFrame())
