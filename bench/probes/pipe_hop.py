"""What the engine process's pipe costs a message: the round trip server -> engine -> server.

`server/engine_process.py` carries each stream's open and each chunk over one pipe, read on each
side by a thread that hands the message to its event loop. This times a round trip of a small
message and of a 2-frame chunk (7,680 bytes of PCM) through the same machinery: a child process
whose loop answers each message, the parent awaiting each answer on its loop. `--reader loop`
reads the pipe on the loop itself (add_reader) instead of a thread, on both sides: the hop it
would save. No GPU, no engine; seconds.

    python3 bench/probes/pipe_hop.py [--reader thread|loop] [--n 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import pickle
import statistics
import threading
import time


def attach(loop, conn, on_message, reader: str) -> None:
    """Hand every message arriving on `conn` to `on_message` on `loop`."""
    if reader == "loop":
        def readable() -> None:
            while conn.poll():
                on_message(pickle.loads(conn.recv_bytes()))
        loop.add_reader(conn.fileno(), readable)
        return

    # The engine process's own reader (server/engine_process.py).
    from pipecat_qwen_fast.server.engine_process import pump

    def on_batch(batch: list) -> None:
        for msg in batch:
            on_message(msg)
    threading.Thread(target=pump, args=(conn, loop, on_batch, lambda: None), daemon=True).start()


def child(conn, reader: str) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        done = asyncio.Event()

        def answer(msg) -> None:
            if msg is None:
                done.set()
            else:
                conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))
        attach(loop, conn, answer, reader)
        await done.wait()
    asyncio.run(main())


async def parent(conn, n: int, reader: str) -> dict:
    loop = asyncio.get_running_loop()
    waiting: list[asyncio.Future] = []
    attach(loop, conn, lambda msg: waiting.pop().set_result(msg), reader)
    out = {}
    for name, payload in (("small", ("open", 1, "x" * 64)),
                          ("chunk_2_frames", ("chunk", 1, b"\0" * 7680, 0, 2, []))):
        times = []
        for i in range(n + 50):
            future = loop.create_future()
            waiting.append(future)
            t0 = time.perf_counter()
            conn.send_bytes(pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL))
            await future
            if i >= 50:
                times.append((time.perf_counter() - t0) * 1e6)
        times.sort()
        out[name] = {"p50_us": round(statistics.median(times), 1),
                     "p95_us": round(times[int(0.95 * len(times))], 1)}
    conn.send_bytes(pickle.dumps(None))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reader", choices=["thread", "loop"], default="thread")
    p.add_argument("--n", type=int, default=2000)
    args = p.parse_args()
    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe(duplex=True)
    proc = ctx.Process(target=child, args=(there, args.reader))
    proc.start()
    result = asyncio.run(parent(here, args.n, args.reader))
    proc.join(10)
    print(json.dumps({"reader": args.reader, "round_trip": result}))


if __name__ == "__main__":
    main()
