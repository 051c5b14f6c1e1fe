"""What each compressed response format costs the server's event loop a chunk:
`python bench/probes/encoder_cost.py --out DIR`.

server/encoders.StreamEncoder runs on the event loop (PyAV), so its time is taken from every
socket and from the engine thread's GIL share. This encodes 10 s of a tone in the default chunk
schedule's later chunk size (4 frames, 7680 samples at 24 kHz) per format, several times, and
writes the median ms a chunk and a second of audio to OUT/encoder_cost.json and .md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parents[2])]  # the repository
from pipecat_qwen_fast.server.encoders import CODECS, StreamEncoder

RATE = 24000
CHUNK = 4 * 1920


def time_format(fmt: str, pcm: bytes, repeats: int) -> dict:
    per_chunk = []
    for _ in range(repeats):
        encoder = StreamEncoder(fmt, RATE)
        started = time.perf_counter()
        chunks = 0
        for i in range(0, len(pcm), CHUNK * 2):
            encoder.encode(pcm[i:i + CHUNK * 2])
            chunks += 1
        encoder.finish()
        per_chunk.append((time.perf_counter() - started) * 1e3 / chunks)
    ms = statistics.median(per_chunk)
    return {"format": fmt, "ms_per_chunk": round(ms, 3), "ms_per_audio_second": round(ms * RATE / CHUNK, 3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    t = np.arange(10 * RATE) / RATE
    pcm = (0.3 * np.sin(2 * np.pi * 220 * t) * 32767).astype("<i2").tobytes()
    rows = [time_format(fmt, pcm, args.repeats) for fmt in CODECS]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "encoder_cost.json").write_text(json.dumps(rows, indent=2))
    md = ["| format | ms a 4-frame chunk | ms a second of audio |", "|---|---|---|"]
    md += [f"| {r['format']} | {r['ms_per_chunk']} | {r['ms_per_audio_second']} |" for r in rows]
    (args.out / "encoder_cost.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
