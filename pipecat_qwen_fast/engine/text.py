"""Text preparation: input checks and the split of long texts into segments.

The text reaches the tokenizer as the caller gave it: leading and trailing whitespace and control
characters included, as the official package does (both change the codes from frame 0, so any
cleaning would break identity with it). Two exceptions: a text that is empty or whitespace only is
refused (there is nothing to say), and lone UTF-16 surrogates are removed (see `mend_surrogates`:
the tokenizer cannot encode them at all). A text over MAX_SEGMENT_TOKENS is split into segments,
each stripped of the whitespace around it.

Splitting runs on the engine thread, one segment at a time as the session reaches it, and costs
about as much as tokenizing that segment, whatever the length of the whole text: a 100,000-character
text with no spaces must not hold up the other sessions for more than a frame.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from pipecat_qwen_fast.errors import InvalidInputError
from pipecat_qwen_fast.model.prompt import TextTokenizer

# Longer texts are split at sentence boundaries into segments synthesised back to back into one
# continuous stream (one vocoder state), so a 10,000-character input neither hits the cap nor
# builds an unbounded KV cache.
MAX_SEGMENT_TOKENS = 200

# A byte-level BPE token holds at least one UTF-8 byte, so a text of at most max_tokens bytes needs
# no tokenizing to know it fits. Up to this many characters per allowed token, a text is tokenized
# whole to see whether it fits; beyond it, it is split without trying (a real token averages 3-5
# characters, and only pathological repeats reach 16).
_WHOLE_TEXT_CHARS_PER_TOKEN = 16
# The window a run of text with no spaces is cut from, in characters per allowed token: wide enough
# that a cut takes nearly a full segment's worth of tokens, narrow enough that tokenizing it stays
# cheap.
_CUT_WINDOW_CHARS_PER_TOKEN = 8

_SURROGATES = re.compile("[\ud800-\udfff]")
_SURROGATE_PAIR_OR_HALF = re.compile("([\ud800-\udbff][\udc00-\udfff])|[\ud800-\udfff]")


def mend_surrogates(text: str) -> str:
    """`text` with each UTF-16 surrogate pair written as two code points joined into the character
    it encodes, and every lone surrogate removed; the same object when there are none.

    Lone surrogates come from text cut or decoded wrongly upstream (half an emoji, say); they carry
    no speech and no tokenizer can encode them (the official package raises a TypeError).
    """
    if _SURROGATES.search(text) is None:
        return text

    def mend(m: re.Match[str]) -> str:
        pair = m.group(1)
        if pair is None:
            return ""
        return chr(0x10000 + ((ord(pair[0]) - 0xD800) << 10) + (ord(pair[1]) - 0xDC00))

    return _SURROGATE_PAIR_OR_HALF.sub(mend, text)


def normalize_text(text: object) -> str:
    """The text to synthesize: as given, but lone surrogates removed (`mend_surrogates`); raises
    InvalidInputError for a non-string, or a text that is empty or whitespace only."""
    if not isinstance(text, str):
        raise InvalidInputError(f"text must be a string, got {type(text).__name__}")
    text = mend_surrogates(text)
    if not text.strip():
        raise InvalidInputError("text is empty or whitespace only; there is nothing to say")
    return text


_SENTENCE_END = re.compile(r"(?<=[.!?;。！？；…])\s+|(?<=[。！？；])|\n+")
_CLAUSE_END = re.compile(r"(?<=[,:，、：])\s*")
_WORD = re.compile(r"\S+")


class Segments:
    """A text's segments of at most `max_tokens` tokens each, made as they are first asked for.

    Indexing (`segments[i]`), `has(i)`, iteration and `len()` all work; only `len()` makes every
    segment. A text that fits is one segment, itself, unchanged.
    """

    def __init__(self, text: str, tok: TextTokenizer, max_tokens: int) -> None:
        self._made: list[str] = []
        self._rest: Iterator[str] | None = _segments(text, tok, max_tokens)

    def has(self, i: int) -> bool:
        """Whether segment `i` exists (making the segments up to it)."""
        while len(self._made) <= i and self._rest is not None:
            nxt = next(self._rest, None)
            if nxt is None:
                self._rest = None
            else:
                self._made.append(nxt)
        return i < len(self._made)

    def __getitem__(self, i: int) -> str:
        if i < 0 or not self.has(i):
            raise IndexError(i)
        return self._made[i]

    def __iter__(self) -> Iterator[str]:
        i = 0
        while self.has(i):
            yield self._made[i]
            i += 1

    def __len__(self) -> int:
        return sum(1 for _ in self)


def split_text(text: str, tok: TextTokenizer, max_tokens: int) -> list[str]:
    """Split text into segments of at most `max_tokens` tokens, at sentence, then clause, then word
    boundaries (a run with no spaces is cut where its tokens allow). Short texts come back
    unchanged as one segment."""
    return list(Segments(text, tok, max_tokens))


def _segments(text: str, tok: TextTokenizer, max_tokens: int) -> Iterator[str]:
    if len(text.encode("utf-8", "surrogatepass")) <= max_tokens or (
        len(text) <= _WHOLE_TEXT_CHARS_PER_TOKEN * max_tokens and len(tok.encode(text)) <= max_tokens
    ):
        yield text
        return
    # Pieces joined by a space: the Qwen pre-tokenizer never merges across a space followed by a
    # word, so the joined tokens are those of the segment so far plus those of " " + piece. Each
    # piece is tokenized once or twice and never the growing segment: linear in the text.
    current, count = "", 0
    for piece, alone in _pieces(text, tok, max_tokens):
        if not current:
            current, count = piece, alone
            continue
        joined = len(tok.encode(" " + piece))
        if count + joined > max_tokens:
            yield current
            current, count = piece, alone
        else:
            current, count = f"{current} {piece}", count + joined
    if current:
        yield current


def _pieces(text: str, tok: TextTokenizer, max_tokens: int) -> Iterator[tuple[str, int]]:
    """(piece, its token count): sentences, or the clauses, words or cuts of the sentences too long
    to be one segment, in order, each stripped and at most `max_tokens` tokens."""
    for sentence in _parts(_SENTENCE_END, text):
        fits = _fits(sentence, tok, max_tokens)
        if fits is not None:
            yield sentence, fits
            continue
        for clause in _parts(_CLAUSE_END, sentence):
            fits = _fits(clause, tok, max_tokens)
            if fits is not None:
                yield clause, fits
                continue
            for m in _WORD.finditer(clause):
                yield from _cut(m.group(), tok, max_tokens)


def _parts(pattern: re.Pattern[str], text: str) -> Iterator[str]:
    """`pattern.split(text)` without its empty pieces, stripped, made lazily."""
    start = 0
    for m in pattern.finditer(text):
        part = text[start : m.start()].strip()
        if part:
            yield part
        start = m.end()
    part = text[start:].strip()
    if part:
        yield part


def _fits(text: str, tok: TextTokenizer, max_tokens: int) -> int | None:
    """The token count of `text` if it is at most `max_tokens`, else None (a text too long to
    possibly fit is not tokenized)."""
    if len(text) > _WHOLE_TEXT_CHARS_PER_TOKEN * max_tokens:
        return None
    n = len(tok.encode(text))
    return n if n <= max_tokens else None


def _cut(word: str, tok: TextTokenizer, max_tokens: int) -> Iterator[tuple[str, int]]:
    """A run with no spaces, in pieces of at most `max_tokens` tokens, cut from a bounded window
    where its tokens say (assumed evenly spread over the window, then shrunk until it fits): two or
    three tokenizer calls per piece."""
    window = _CUT_WINDOW_CHARS_PER_TOKEN * max_tokens
    while word:
        fits = _fits(word, tok, max_tokens) if len(word) <= window else None
        if fits is not None:
            yield word, fits
            return
        head = word[:window]
        cut, count = len(head), len(tok.encode(head))
        while count > max_tokens and cut > 1:
            cut = max(1, cut * max_tokens // (count + 1))
            count = len(tok.encode(head[:cut]))
        yield word[:cut], count
        word = word[cut:]
