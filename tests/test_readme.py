"""README.md's snippets run as written, in order, in one empty folder, on the tiny checkpoint that
the README itself builds first.

Every fenced block is `bash` or `python`. A block preceded by `<!-- readme-test: skip (why) -->` is
not run (it installs, downloads, or starts a server), but it must still parse (`bash -n`,
`compile`), so a typo in it fails too. The rest run one after another, each with a time limit,
offline (HF_HUB_OFFLINE=1) and with this interpreter's `python3` and `qwen-fast-tts` first on
PATH. Running them takes a few minutes on 2 CPU cores: torch and the frameworks are imported
afresh by each block, and the tiny model's noise may run to its frame cap.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MAX_LINES = 250
BLOCK_TIMEOUT_S = 600

FENCE = re.compile(r"^```(\S*)\s*$")
SKIP = re.compile(r"^<!-- readme-test: skip \((.+)\) -->$")


@dataclass
class Block:
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    skip: str | None  # why it is not run

    @property
    def name(self) -> str:
        return f"line{self.line}-{self.lang}"


def parse(text: str) -> list[Block]:
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, body = i, []
        i += 1
        while i < len(lines) and not FENCE.match(lines[i]):
            body.append(lines[i])
            i += 1
        if i == len(lines):
            raise AssertionError(f"README.md:{start + 1}: a fence that never closes")
        prev = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        skip = SKIP.match(prev.strip())
        blocks.append(Block(start + 1, m.group(1), "\n".join(body) + "\n", skip.group(1) if skip else None))
        i += 1
    return blocks


BLOCKS = parse(README.read_text(encoding="utf-8"))
RUN = [b for b in BLOCKS if b.skip is None]


def test_readme_is_short_and_every_block_is_runnable_or_says_why_not():
    n = len(README.read_text(encoding="utf-8").splitlines())
    assert n <= MAX_LINES, f"README.md has {n} lines, the front door holds {MAX_LINES}"
    for b in BLOCKS:
        assert b.lang in ("bash", "python"), f"README.md:{b.line}: a ```{b.lang} block (bash or python only)"
    # The snippets that must keep working: the tiny checkpoint, the CLI, Python, both adapters.
    ran = "".join(b.code for b in RUN)
    for needle in ("build-checkpoint --size tiny", "qwen-fast-tts say", "QwenTTSEngine",
                   "QwenFastTTSService", "qwen_fast.TTS"):
        assert needle in ran, f"no snippet that runs uses {needle!r}"


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.skip], ids=lambda b: b.name)
def test_skipped_snippets_parse(block: Block):
    if block.lang == "python":
        compile(block.code, f"README.md:{block.line}", "exec")
    else:
        proc = subprocess.run(["bash", "-n"], input=block.code, capture_output=True, text=True, check=False)
        assert proc.returncode == 0, f"README.md:{block.line}: {proc.stderr}"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("readme")


@pytest.mark.slow
@pytest.mark.timeout(BLOCK_TIMEOUT_S + 60)
@pytest.mark.parametrize("block", RUN, ids=lambda b: b.name)
def test_snippet_runs(block: Block, workdir: Path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    if block.lang == "python":
        script = workdir / f"{block.name}.py"
        script.write_text(block.code, encoding="utf-8")
        cmd = [sys.executable, str(script)]
    else:
        cmd = ["bash", "-euo", "pipefail", "-c", block.code]
    try:
        proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True,
                              timeout=BLOCK_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"README.md:{block.line} ran past {BLOCK_TIMEOUT_S} s:\n{e.stdout}\n{e.stderr}")
    assert proc.returncode == 0, (
        f"README.md:{block.line} failed ({proc.returncode}):\n{block.code}\n--- stdout\n{proc.stdout[-3000:]}"
        f"\n--- stderr\n{proc.stderr[-3000:]}"
    )
