"""One folder for everything a machine builds once: the megakernel library and torch's compile
caches (inductor's compiled graphs, Triton's kernels). `qwen-fast-tts prepare` fills it; a
container image or a bare GPU machine that gets a copy starts warm.

`QWEN_FAST_CACHE` names the folder (default ~/.cache/pipecat_qwen_fast). torch's own variables,
where the user set them, win over it.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("QWEN_FAST_CACHE", Path.home() / ".cache" / "pipecat_qwen_fast"))


def use_compile_caches() -> Path:
    """Point torch's persistent compile caches into the cache folder (before anything compiles;
    both are read when a compile starts, not at import)."""
    root = cache_dir()
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(root / "inductor"))
    os.environ.setdefault("TRITON_CACHE_DIR", str(root / "triton"))
    return root


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_digest(path: Path) -> None:
    """Record `path`'s digest beside it: an entry is trusted only while the two agree."""
    tmp = path.with_name(path.name + ".sha256.tmp")
    tmp.write_text(file_digest(path))
    os.replace(tmp, path.with_name(path.name + ".sha256"))


def digest_matches(path: Path) -> bool:
    sidecar = path.with_name(path.name + ".sha256")
    try:
        return path.is_file() and sidecar.read_text().strip() == file_digest(path)
    except OSError:
        return False
