"""What each stand-in module in bench/device_stubs holds (README.md there): importable names
whose every use raises, so that a run which needed the real package fails loudly."""


class Missing:
    def __init__(self, name: str) -> None:
        self._name = name

    def _fail(self, *args, **kwargs):
        raise RuntimeError(
            f"{self._name} was used, but this is the benchmark's stand-in for a package that is "
            "not installed here (bench/device_stubs/README.md)"
        )

    __call__ = __getattr__ = __index__ = __int__ = __float__ = __iter__ = __bool__ = _fail
    __add__ = __radd__ = __sub__ = __mul__ = __rmul__ = __truediv__ = __lt__ = __gt__ = _fail


def missing_names(module: str):
    """A module's `__getattr__`: any name but dunders is a `Missing`."""

    def getattr_(name: str) -> Missing:
        if name.startswith("__"):
            raise AttributeError(name)
        return Missing(f"{module}.{name}")

    return getattr_
