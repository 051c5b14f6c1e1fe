"""`qwen-fast-tts bench fleet` with its utterances' timelines traced (timeline.py); with --model,
in process over the stand-in engine (sim_engine.py). Arguments are bench fleet's. SPARES=n sets
the remote client's spare sockets and REUSE=0|1 whether it keeps a clean turn's socket
(pipecat_qwen_fast/remote.py; SPARES=0 REUSE=0: a handshake an utterance).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import timeline

in_process = "--model" in sys.argv
if in_process:
    import sim_engine

    sim_engine.install()
timeline.install_callers(in_process)
if os.environ.get("SPARES") or os.environ.get("REUSE"):
    from pipecat_qwen_fast import remote

    client_init = remote.RemoteTTSClient.__init__

    def __init__(self, *args, **kw):
        if os.environ.get("SPARES"):
            kw.setdefault("spare_sockets", int(os.environ["SPARES"]))
        if os.environ.get("REUSE"):
            kw.setdefault("reuse_sockets", os.environ["REUSE"] == "1")
        client_init(self, *args, **kw)

    remote.RemoteTTSClient.__init__ = __init__

from pipecat_qwen_fast.cli import main

sys.exit(main(["bench", "fleet", *sys.argv[1:]]))
