"""The scripted "LLM" the demo uses when no cloud LLM key is set.

It lets the demo run on a machine with no network at all: typed text goes in, a short reply comes
out, and the reply is what our TTS speaks. It answers a few fixed prompts (a greeting, "help",
"who are you") and otherwise reads the user's words back, so whatever a person types is heard in
the agent's voice. Framework-neutral: the Pipecat and LiveKit wrappers both call
:func:`compose_reply`.
"""

from __future__ import annotations

import re

from .prompts import GREETING

# Long typed text would keep a CPU run busy for minutes; the echo is cut at a word boundary.
MAX_ECHO_CHARS = 240

_HELP = (
    "I run offline: I speak whatever you type, using Qwen3-TTS on this machine. "
    "Set OPENAI_API_KEY for a real language model and DEEPGRAM_API_KEY to talk instead of type."
)
_WHO = "I am a demo agent for pipecat-qwen-fast, a self-hosted Qwen3-TTS engine."
_EMPTY = "I did not catch any words. Type a message and I will say it back."

_GREETING_WORDS = {"hello", "hi", "hey", "hallo", "hola", "bonjour", "howdy"}


def compose_reply(user_text: str) -> str:
    """Reply to one user turn: a fixed answer for a few prompts, otherwise an echo."""
    text = " ".join(user_text.split())
    words = re.findall(r"[\w']+", text.lower())
    if not words:
        return _EMPTY
    if words[0] in _GREETING_WORDS and len(words) <= 3:
        return GREETING
    if words in (["help"], ["what", "can", "you", "do"]):
        return _HELP
    if "who are you" in " ".join(words) or "what are you" in " ".join(words):
        return _WHO
    return f"You said: {_truncate(text)}"


def last_user_text(messages: list[dict]) -> str:
    """Text of the newest user message in an OpenAI-style message list ("" when there is none).

    ``content`` is either a string or a list of parts; only the text parts count.
    """
    for message in reversed(messages):
        if message.get("role") != "user":
            continue
        content = message.get("content")
        if isinstance(content, str):
            return content
        if isinstance(content, list):
            return " ".join(
                part.get("text", "")
                for part in content
                if isinstance(part, dict) and part.get("type") == "text"
            )
        return ""
    return ""


def split_into_chunks(reply: str) -> list[str]:
    """Break a reply into word-sized pieces, the way a streaming LLM delivers tokens."""
    return re.findall(r"\S+\s*", reply)


def _truncate(text: str) -> str:
    if len(text) <= MAX_ECHO_CHARS:
        return text
    cut = text[:MAX_ECHO_CHARS].rsplit(" ", 1)[0]
    return cut + "..."
