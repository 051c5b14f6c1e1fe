"""Text preparation: input checks and the split of long texts into segments."""

from __future__ import annotations

import re
import unicodedata

from pipecat_qwen_fast.errors import InvalidInputError
from pipecat_qwen_fast.model.prompt import TextTokenizer

# Longer texts are split at sentence boundaries into segments synthesised back to back into one
# continuous stream (one vocoder state), so a 10,000-character input neither hits the cap nor
# builds an unbounded KV cache.
MAX_SEGMENT_TOKENS = 200

_CONTROL_OK = {"\n", "\t"}


def normalize_text(text: object) -> str:
    """Reject empty input; replace control characters (except newline/tab) by spaces.

    Control characters carry no speech and can break the tokenizer's template slicing; emoji and
    other symbols are passed through to the tokenizer unchanged.
    """
    if not isinstance(text, str):
        raise InvalidInputError(f"text must be a string, got {type(text).__name__}")
    cleaned = "".join(" " if unicodedata.category(ch) == "Cc" and ch not in _CONTROL_OK else ch for ch in text)
    cleaned = cleaned.strip()
    if not cleaned:
        raise InvalidInputError("text is empty or whitespace only; there is nothing to say")
    return cleaned


_SENTENCE_END = re.compile(r"(?<=[.!?;。！？；…])\s+|(?<=[。！？；])|\n+")
_CLAUSE_END = re.compile(r"(?<=[,:，、：])\s*")


def split_text(text: str, tok: TextTokenizer, max_tokens: int) -> list[str]:
    """Split text into segments of at most `max_tokens` tokens, at sentence, then clause, then word
    boundaries. Short texts come back unchanged as one segment."""
    if len(tok.encode(text)) <= max_tokens:
        return [text]
    pieces: list[str] = []
    for sentence in filter(None, (p.strip() for p in _SENTENCE_END.split(text))):
        if len(tok.encode(sentence)) <= max_tokens:
            pieces.append(sentence)
            continue
        for clause in filter(None, (p.strip() for p in _CLAUSE_END.split(sentence))):
            if len(tok.encode(clause)) <= max_tokens:
                pieces.append(clause)
            else:
                pieces.extend(_split_words(clause, tok, max_tokens))
    segments: list[str] = []
    current = ""
    for piece in pieces:
        candidate = f"{current} {piece}".strip() if current else piece
        if current and len(tok.encode(candidate)) > max_tokens:
            segments.append(current)
            current = piece
        else:
            current = candidate
    if current:
        segments.append(current)
    return segments


def _split_words(text: str, tok: TextTokenizer, max_tokens: int) -> list[str]:
    out: list[str] = []
    current = ""
    for word in text.split() or [text]:
        candidate = f"{current} {word}".strip()
        if current and len(tok.encode(candidate)) > max_tokens:
            out.append(current)
            current = word
        else:
            current = candidate
        while len(tok.encode(current)) > max_tokens:  # one "word" longer than a segment (no spaces)
            cut = max(1, len(current) * max_tokens // (2 * len(tok.encode(current))))
            out.append(current[:cut])
            current = current[cut:]
    if current:
        out.append(current)
    return out
