"""Streamed text's tokens and segments (engine/text_stream.py) against the whole text's, on the
Qwen tokenizer's steps (added tokens, NFC, the pre-tokenizer regex, byte-level BPE)."""

from __future__ import annotations

import random

import pytest

from pipecat_qwen_fast.checkpoints.load import load_text_tokenizer
from pipecat_qwen_fast.engine.text_stream import TextEndedError, TurnText, turn_segments
from pipecat_qwen_fast.model.prompt import _target_body

# Characters that change tokens across a boundary: spaces of every kind, newlines after
# punctuation, contractions, digits, combining marks (NFC), Hangul jamo (compose), CJK with its
# punctuation, emoji with joiners, control characters, and the pieces of added tokens.
ALPHABET = (
    list("abcdeXYZ") * 6
    + list("     ") * 4
    + ["\n", "\n\n", "\r\n", "\t", "\x0b", "\x1c", "\x85", "\xa0", "\u3000"]
    + list(".,!?;:'\"-()…") * 2
    + list("0123456789")
    + ["'s", "'ll", "n't", "'RE"]
    + ["e\u0301", "\u0301", "\u0327", "A\u030a", "\u1100", "\u1161", "\u11a8", "\uac00"]
    + list("你好世界。！，")
    + ["😀", "👍🏽", "\u200d", "👨\u200d👩"]
    + ["\u00b2", "\u2163", "\u212b"]
    + ["<", "|", ">", "<|im_end|>", "<|im_", "end|>", "<tts_pad>", "<tts", "_pad>", "</think>"]
    + ["\ud83d\ude00", "\ud83d", "\ude00"]
)


@pytest.fixture(scope="module")
def tok(tiny_checkpoint):
    return load_text_tokenizer(tiny_checkpoint("custom_voice"))


def random_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(n))


def random_split(rng: random.Random, text: str) -> list[str]:
    cuts = sorted(
        rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, len(text) // 2 + 1)))
    )
    parts, prev = [], 0
    for c in [*cuts, len(text)]:
        parts.append(text[prev:c])
        prev = c
    return parts


def streamed(tok, parts: list[str], **kw) -> TurnText:
    turn = TurnText(tok, **kw)
    for p in parts:
        turn.append(p)
    turn.end()
    return turn


def whole_body(tok, cfg_text: str) -> list[int]:
    from pipecat_qwen_fast.engine.text import mend_surrogates

    class Cfg:
        im_start_id, assistant_id = 151644, 77091

    return _target_body(tok, Cfg, mend_surrogates(cfg_text))


def test_random_splits_give_the_whole_texts_tokens(tok):
    rng = random.Random(0)
    checked = 0
    for trial in range(600):
        text = random_text(rng, rng.randint(1, 60))
        whole = streamed(tok, [text])
        if whole.empty:
            assert not text.strip() or not mend_text(text).strip()
            continue
        assert len(whole.segments) == 1, text  # short texts: one segment, unchanged
        seg = whole.segments[0]
        assert seg.text == mend_text(text)
        assert seg.tokens == whole_body(tok, text), repr(text)
        for _ in range(4):
            parts = random_split(rng, text)
            turn = streamed(tok, parts)
            assert [s.text for s in turn.segments] == [seg.text], (parts,)
            assert turn.segments[0].tokens == seg.tokens, (parts,)
            checked += 1
    assert checked > 1500


def mend_text(text: str) -> str:
    from pipecat_qwen_fast.engine.text import mend_surrogates

    return mend_surrogates(text)


def test_tokens_are_final_when_released(tok):
    """Every prefix of a stream releases only tokens that the whole text also has, in order."""
    rng = random.Random(1)
    for _ in range(200):
        text = random_text(rng, rng.randint(5, 50))
        final = streamed(tok, [text])
        if final.empty:
            continue
        turn = TurnText(tok)
        for part in random_split(rng, text):
            turn.append(part)
            with turn.lock:
                got = turn.segments[0].tokens if turn.segments else []
            assert got == final.segments[0].tokens[: len(got)], (text, part)


def test_words_released_with_their_first_token(tok):
    turn = TurnText(tok)
    turn.append("Hello there, how are")
    seg = turn.segments[0]
    # "are" may still grow ("area"); the space before it waits with it.
    assert [seg.word_text(i) for i in range(len(seg.words))] == ["Hello", "there,", "how"]
    turn.append(" you? 你好，世界")
    turn.end()
    words = [seg.word_text(i) for i in range(len(seg.words))]
    assert words == ["Hello", "there,", "how", "are", "you?", "你", "好，", "世", "界"]
    # Each word's token holds its first character.
    for w in seg.words:
        s, e = seg.offsets[w.token]
        assert s <= w.start < e
    assert all(a.token < b.token for a, b in zip(seg.words, seg.words[1:]))


def test_long_turns_segment_alike_streamed_and_whole(tok):
    rng = random.Random(2)
    sentences = [f"This is sentence number {i}, with a few words in it." for i in range(60)]
    for trial in range(6):
        text = " ".join(rng.sample(sentences, 40)) + rng.choice(
            ["", "\n\nAnd a last line", " 你好世界" * 90]
        )
        segments = turn_segments(text, tok)
        assert len(segments) >= 3
        whole = streamed(tok, [text])
        for s in whole.segments:
            n = len(s.tokens)
            assert 0 < n <= 200
            assert s.tokens == whole_body(tok, s.text)
        # Cuts at sentence ends once a segment holds 120 tokens, when one fits.
        assert all(s.text.rstrip().endswith((".", "界")) for s in whole.segments[:-1]), [
            s.text[-20:] for s in whole.segments
        ]
        for _ in range(3):
            turn = streamed(tok, random_split(rng, text))
            assert [s.text for s in turn.segments] == segments
            assert [s.tokens for s in turn.segments] == [s.tokens for s in whole.segments]


def test_a_run_with_no_boundary_is_cut_into_segments(tok):
    text = "x" * 3000 + " end."
    turn = streamed(tok, [text[i : i + 7] for i in range(0, len(text), 7)])
    assert "".join(s.text for s in turn.segments) == text
    assert all(len(s.tokens) <= 200 for s in turn.segments)
    assert [s.text for s in turn.segments] == turn_segments(text, tok)


def test_text_is_held_until_its_end_is_known(tok):
    turn = TurnText(tok)
    turn.append("Hello")
    assert not turn.segments  # "Hello" may still become "Hellos"
    turn.append(" ")
    assert turn.segments[0].tokens == tok.encode("Hello")
    turn.append("<|im_")
    turn.append("end|> x")
    turn.end()
    assert 151645 in turn.segments[0].tokens  # the added token, whole, as in the whole text


def test_bad_input(tok):
    turn = TurnText(tok)
    with pytest.raises(Exception, match="string"):
        turn.append(5)  # type: ignore[arg-type]
    turn.append("Hi there")
    turn.end()
    turn.end()
    with pytest.raises(TextEndedError, match="after end"):
        turn.append("more")
    empty = TurnText(tok)
    empty.append("  \n\t ")
    empty.end()
    assert empty.empty
    # A surrogate pair split across two appends joins as in the whole text; a lone half goes.
    pair = streamed(tok, ["a \ud83d", "\ude00 b \ud800"])
    assert pair.segments[0].text == "a \U0001f600 b "


def test_segment_rule_is_the_same_for_any_split(tok):
    """Small segments (20 tokens, so runs over 160 characters are cut before their end) over
    texts mixing sentences, held pieces, newlines and long runs with no boundary in them: any
    split, and the whole text, cut the same segments with the same tokens."""
    rng = random.Random(9)
    parts = [
        "One two three four five.",
        " Six seven, eight nine ten eleven!",
        "\n\nTwelve thirteen",
        " fourteen fifteen sixteen seventeen.",
        " 你好世界。今天很好。",
        " x" * 30,
        " " + "ab" * rng.randint(80, 200),
        "   " + "q" * rng.randint(150, 400) + ".",
        " " * 170 + "spaced",
        " <|im_" + "z" * 170,
        " 12,345 and 6.5%.",
        "\t" * 200,
        "!" * 300 + "\n",
        "\n" * 400,
    ]
    for _ in range(40):
        text = "".join(rng.choice(parts) for _ in range(rng.randint(1, 9)))
        whole = streamed(tok, [text], max_tokens=20)
        assert [s.text for s in whole.segments] == turn_segments(text, tok, 20)
        for s in whole.segments:
            assert s.tokens and len(s.tokens) <= 20 and s.tokens == whole_body(tok, s.text), s.text
        for _ in range(3):
            turn = streamed(tok, random_split(rng, text), max_tokens=20)
            assert [s.text for s in turn.segments] == [s.text for s in whole.segments], text
            assert [s.tokens for s in turn.segments] == [s.tokens for s in whole.segments]


def test_first_token_guess(tok):
    """Before the turn's first token is final, the first token of the text so far (a guess the
    session prefills with, engine/text_session.py); None once a token is final, before a word, or
    after the end. A guess matches the final token whenever the text after it cannot join it."""
    turn = TurnText(tok)
    assert turn.first_token_guess() is None
    turn.append("  ")
    assert turn.first_token_guess() is None  # no word yet
    turn.append("Hel")
    hel = turn.first_token_guess()
    assert hel is not None and not turn.segments
    assert hel == whole_body(tok, "  Hel")[0]
    turn.append("lo")
    assert turn.first_token_guess() == whole_body(tok, "  Hello")[0]
    appends = turn.appends
    turn.append(", there")
    assert turn.appends == appends + 1
    assert turn.segments and turn.first_token_guess() is None  # final now
    assert turn.segments[0].tokens[0] == whole_body(tok, "  Hello")[0]
    ended = TurnText(tok)
    ended.append("Hi")
    ended.end()
    assert ended.first_token_guess() is None

    rng = random.Random(9)
    right = 0
    for _ in range(300):
        text = random_text(rng, rng.randint(1, 30))
        turn = TurnText(tok)
        guess = None
        for part in random_split(rng, text):
            if not turn.segments:
                guess = turn.first_token_guess() if turn.appends else None
            turn.append(part)
        turn.end()
        if guess is not None and turn.segments:
            right += guess == turn.segments[0].tokens[0]
    assert right > 20


def test_added_token_prefixes_are_built_once_per_tokenizer(tok, monkeypatch):
    # The server makes a TurnText a turn; the table of added-token prefixes is the tokenizer's.
    from pipecat_qwen_fast.engine import text_stream

    added = list(tok.added_tokens)
    text_stream._ADDED_PREFIXES.pop(tok, None)
    reads = []

    def counted(self):
        reads.append(1)
        return added

    monkeypatch.setattr(type(tok), "added_tokens", property(counted))
    first, second = TurnText(tok), TurnText(tok)
    assert len(reads) == 1
    assert first._prefixes is second._prefixes and "<|im_" in first._prefixes
    assert first._longest_prefix == max(len(t) for t in added) - 1
