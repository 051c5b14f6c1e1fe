"""Shared fixtures: tiny random checkpoints, built once and cached across test runs.

`tiny_checkpoint(variant="custom_voice", zero_eos=False, *, size_tag=None, seed=0,
dtype="bfloat16") -> Path` returns a folder in the real Hugging Face layout (spec §10 tiny shapes).
Builds land in `<repo>/.cache/ckpt/` (override with QWEN_FAST_CKPT_CACHE), keyed by a hash of
the builder's source files and the arguments, so a change to the builder rebuilds and an unchanged
one never does. Parallel pytest processes are safe: one builds under a file lock into a temporary
folder that is renamed into place; the rest wait for it and reuse the result.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

# Tiny models on 2 shared cores: intra-op thread pools only contend there (measured 15x slower per
# frame with the default pool while other processes ran). Subprocesses inherit the variable.
os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

REPO_ROOT = Path(__file__).resolve().parents[1]
PACKAGE = REPO_ROOT / "pipecat_qwen_fast"
BUILDER_SOURCES = (
    "build_checkpoint.py",
    "layout.py",
    "tiny_configs.py",
    "synthetic_tokenizer.py",
    "config.py",
)


def checkpoint_cache_dir() -> Path:
    return Path(os.environ.get("QWEN_FAST_CKPT_CACHE", REPO_ROOT / ".cache" / "ckpt"))


def builder_source_hash() -> str:
    h = hashlib.sha256()
    files = [PACKAGE / name for name in BUILDER_SOURCES]
    files += sorted((PACKAGE / "assets").rglob("*"))
    for path in files:
        if path.is_file():
            h.update(path.relative_to(PACKAGE).as_posix().encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


def build_cached_checkpoint(variant: str, zero_eos: bool, size_tag: str | None, seed: int, dtype: str) -> Path:
    from pipecat_qwen_fast.checkpoints.build import build_checkpoint

    cache = checkpoint_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    key = f"tiny-{variant}-{size_tag or 'default'}-eos{'0' if zero_eos else '1'}-s{seed}-{dtype}-{builder_source_hash()}"
    final = cache / key
    if final.is_dir():
        return final
    with open(cache / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if final.is_dir():  # another process built it while we waited
                return final
            tmp = Path(tempfile.mkdtemp(prefix=f"{key}.tmp-", dir=cache))
            try:
                build_checkpoint(tmp, "tiny", variant, seed=seed, zero_eos=zero_eos, dtype=dtype,
                                 size_tag=size_tag)
                os.rename(tmp, final)  # atomic: readers see a complete folder or none
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return final


@pytest.fixture(scope="session")
def tiny_checkpoint() -> Callable[..., Path]:
    """Factory: tiny_checkpoint(variant="custom_voice", zero_eos=False, *, size_tag=None, seed=0,
    dtype="bfloat16") -> Path of a cached tiny random checkpoint. Treat the folder as read-only."""
    built: dict[tuple, Path] = {}

    def make(variant: str = "custom_voice", zero_eos: bool = False, *, size_tag: str | None = None,
             seed: int = 0, dtype: str = "bfloat16") -> Path:
        args = (variant, zero_eos, size_tag, seed, dtype)
        if args not in built:
            built[args] = build_cached_checkpoint(*args)
        return built[args]

    return make


@pytest.fixture(scope="session")
def megakernel_library() -> Callable[..., Path]:
    """Factory: megakernel_library(arch, defines=None) -> Path of libqwen_mk.so for `arch` ("sm_80",
    "sm_90"), built once per session through the backend's own cache (keyed by the kernel's
    sources and flags), so an unchanged kernel is not rebuilt on the next run either, and a GPU
    run's first use finds the same file. `defines` sets QWEN_FAST_MK_DEFINES for that build (a
    variant, with its own cache entry)."""
    from pipecat_qwen_fast.backends import megakernel as mk

    built: dict[tuple, Path] = {}

    def make(arch: str, defines: str | None = None) -> Path:
        if (arch, defines) not in built:
            with pytest.MonkeyPatch.context() as mp:
                if defines is not None:
                    mp.setenv("QWEN_FAST_MK_DEFINES", defines)
                built[arch, defines] = mk.build_library(arch)
        return built[arch, defines]

    return make


@pytest.fixture
def finite_model(tiny_checkpoint) -> Path:
    """Tiny CustomVoice checkpoint; random weights end utterances at random (EOS)."""
    return tiny_checkpoint("custom_voice")


@pytest.fixture
def endless_model(tiny_checkpoint) -> Path:
    """Tiny CustomVoice checkpoint with the EOS row zeroed: utterances run to their frame cap."""
    return tiny_checkpoint("custom_voice", zero_eos=True)

