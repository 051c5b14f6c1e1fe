"""`qwen-fast-tts serve` whose GIL switch interval can be changed while it runs, for an A/B of
the interval on one warm server (a restart costs minutes of load and compile on the GPU machine).

    python3 bench/probes/switch_serve.py --model DIR --port 8177   # serve's arguments
    echo 0.0005 > $SWITCH_FILE                                      # seconds; read every 0.5 s

Why: through the server the engine's rounds stretch (docs/SERVER.md, "Performance"). If the
engine thread waits for the GIL behind the event loop, each wait can last up to the switch
interval (5 ms by default) after every GPU wait the engine thread makes; a shorter interval bounds
it. The file's value is applied as sys.setswitchinterval and echoed to stderr.
"""

import os
import sys
import threading
import time

SWITCH_FILE = os.environ.get("SWITCH_FILE", "/tmp/qwen-fast-switch")


def watch(path: str) -> None:
    applied = None
    while True:
        try:
            with open(path) as f:
                value = float(f.read().strip())
        except (OSError, ValueError):
            value = None
        if value is not None and value != applied:
            sys.setswitchinterval(value)
            applied = value
            print(f"switch_serve: GIL switch interval now {sys.getswitchinterval() * 1e3:.3f} ms",
                  file=sys.stderr, flush=True)
        time.sleep(0.5)


if __name__ == "__main__":
    threading.Thread(target=watch, args=(SWITCH_FILE,), daemon=True, name="switch-watch").start()
    from pipecat_qwen_fast.cli import main

    sys.exit(main(["serve", *sys.argv[1:]]))
