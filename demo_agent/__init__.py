"""Demo voice agent for pipecat-qwen-fast: ``python -m demo_agent pipecat|livekit``."""
