"""What the demo agent says on its own: the system prompt for a real LLM, and its greeting."""

SYSTEM_PROMPT = (
    "You are a friendly voice assistant in a demo of a self-hosted text-to-speech engine. "
    "Your answers are spoken aloud: keep them to one or two short sentences, with no lists, "
    "markdown or emoji."
)

GREETING = "Hello! I am a demo voice agent. Type a message and I will say it back."
# With speech recognition (DEEPGRAM_API_KEY) the user talks rather than types.
VOICE_GREETING = "Hello! I am a demo voice agent. Say something and I will answer."


def default_greeting(listening: bool) -> str:
    return VOICE_GREETING if listening else GREETING
