"""Stand-in for `livekit.local_inference` where the package is not installed (bench/device_stubs/README.md):
importable, and any use of what it holds raises."""


class _Missing:
    def __init__(self, name: str) -> None:
        self._name = name

    def _fail(self, *args, **kwargs):
        raise RuntimeError(
            f"{self._name} was used, but this is the benchmark's stand-in for a package that is "
            "not installed here (bench/device_stubs/README.md)"
        )

    __call__ = __getattr__ = __index__ = __int__ = __float__ = __iter__ = __bool__ = _fail
    __add__ = __radd__ = __sub__ = __mul__ = __rmul__ = __truediv__ = __lt__ = __gt__ = _fail


def __getattr__(name: str) -> _Missing:
    if name.startswith("__"):
        raise AttributeError(name)
    return _Missing(f"{__name__}.{name}")
