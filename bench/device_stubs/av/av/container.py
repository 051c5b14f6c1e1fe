"""Stand-in for `av.container` where PyAV is not installed (bench/device_stubs/README.md)."""

from av import _Missing


def __getattr__(name: str) -> _Missing:
    if name.startswith("__"):
        raise AttributeError(name)
    return _Missing(f"{__name__}.{name}")
