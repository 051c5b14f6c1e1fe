"""Import-only stand-in for ``torchaudio.compliance.kaldi`` (see ``torchaudio/__init__.py``)."""


def __getattr__(name):
    raise AttributeError(
        f"torchaudio.compliance.kaldi.{name} is unavailable in the oracle venv stand-in; "
        "only the 25 Hz speech tokenizer (not compared here) calls it"
    )
