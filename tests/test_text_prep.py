"""Text preparation costs about one segment's tokenizing per segment, whatever the text's length
(issue 32, item 8): a 100,000-character text with no spaces must not stall the other streams."""

from __future__ import annotations

import asyncio
import statistics
import time

import pytest

from pipecat_qwen_fast import QwenTTSEngine, SynthesisRequest
from pipecat_qwen_fast.engine.service import EngineService
from pipecat_qwen_fast.engine.text import MAX_SEGMENT_TOKENS, Segments, split_text

CPU = {"device": "cpu", "dtype": "float32", "backend": "torch"}
TIMEOUT = 120
LONG = 100_000


class CountingTokenizer:
    """The engine's own tokenizer, counting the characters it is asked to tokenize."""

    def __init__(self, tok) -> None:
        self._tok = tok
        self.chars = 0

    def encode(self, text: str) -> list[int]:
        self.chars += len(text)
        return self._tok.encode(text)


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return QwenTTSEngine.from_pretrained(tiny_checkpoint("custom_voice", zero_eos=True), progress=False, **CPU)


@pytest.mark.parametrize("text", [
    "x" * LONG,  # no spaces at all
    ("word " * (LONG // 5)),  # no punctuation
    ("a, " * (LONG // 3)),  # clauses only
    ("Short sentence here. " * (LONG // 21)),
], ids=["no-spaces", "words", "clauses", "sentences"])
def test_each_segment_costs_about_one_segment_of_tokenizing(engine, text):
    tok = CountingTokenizer(engine.tokenizer)
    segments = Segments(text, tok, MAX_SEGMENT_TOKENS)
    first = segments[0]
    # The first segment is what the engine thread makes at open: a few segments' worth of
    # characters at most (the old splitter tokenized the whole text several times first).
    assert tok.chars <= 40_000, tok.chars
    assert len(engine.tokenizer.encode(first)) <= MAX_SEGMENT_TOKENS
    made = list(segments)
    # All of them: linear in the text.
    assert tok.chars <= 12 * len(text), tok.chars
    assert all(len(engine.tokenizer.encode(s)) <= MAX_SEGMENT_TOKENS for s in made)
    assert "".join("".join(made).split()) == "".join(text.split())


def test_split_text_keeps_short_texts_and_splits_at_sentences(engine):
    tok = engine.tokenizer
    assert split_text("  Hello there.\n", tok, MAX_SEGMENT_TOKENS) == ["  Hello there.\n"]
    parts = split_text("One two three. Four five six seven. Eight nine ten.", tok, 8)
    assert parts[0] == "One two three." and all(len(tok.encode(p)) <= 8 for p in parts)


async def test_a_huge_text_does_not_stall_another_stream(engine):
    service = EngineService.for_engine(engine)
    try:
        await service.wait_ready()
        running = service.open_stream(SynthesisRequest("Keep talking.", voice="ryan", seed=1, max_frames=400,
                                                       first_chunk_frames=1, chunk_frames=1,
                                                       max_chunk_frames=None))
        arrivals: list[float] = []

        async def consume() -> None:
            async for _ in running:
                arrivals.append(time.monotonic())

        task = asyncio.create_task(consume())
        deadline = time.monotonic() + TIMEOUT
        while len(arrivals) < 20 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        opened_at = time.monotonic()
        huge = service.open_stream(SynthesisRequest("x" * LONG, voice="ryan", seed=2, max_frames=2))
        chunks = await asyncio.wait_for(_collect(huge), TIMEOUT)
        done_at = time.monotonic()
        while len([t for t in arrivals if t > done_at]) < 5 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        running.cancel()
        await asyncio.wait_for(task, TIMEOUT)

        assert sum(c.num_frames for c in chunks) == 2
        before = [b - a for a, b in zip(arrivals, arrivals[1:]) if b < opened_at]
        during = [b - a for a, b in zip(arrivals, arrivals[1:]) if b > opened_at and a < done_at + 0.5]
        assert before and during
        # The huge request's prefill is a frame's work like any other; its text preparation adds
        # next to nothing. (The old splitter held the engine thread for 17-24 s.)
        assert max(during) < 3 * statistics.median(before) + 0.3, (max(during), statistics.median(before))
    finally:
        service.close()


async def _collect(stream):
    return [c async for c in stream]
