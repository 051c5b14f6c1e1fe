"""Stand-in for `livekit.local_inference` where the package is not installed (bench/device_stubs/README.md):
importable, and any use of what it holds raises."""

from device_stub import missing_names

__getattr__ = missing_names(__name__)
