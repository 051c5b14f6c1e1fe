"""Oracle harness: the official qwen-tts package run in its own venv (see harness.py)."""
