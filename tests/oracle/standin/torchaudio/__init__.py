"""Import-only stand-in for torchaudio inside the oracle virtual environment.

qwen-tts 0.1.1 imports ``torchaudio.compliance.kaldi`` at package import time, but only its 25 Hz
speech tokenizer calls it; the 12 Hz models we compare against never do. PyPI has no torchaudio
build that matches the system torch 2.13 CPU wheel, and installing one would replace torch. Any
attribute use fails loudly so a stray call can never go unnoticed.
"""

__version__ = "0.0.0+oracle-standin"


def __getattr__(name):
    raise AttributeError(
        f"torchaudio.{name} is unavailable: the oracle venv ships an import-only torchaudio "
        "stand-in (tests/oracle/standin); only the 25 Hz tokenizer path would need it"
    )
