"""`qwen-fast-tts serve` over the stand-in engine (sim_engine.py), its timelines traced
(timeline.py). Arguments are serve's. Environment, for A/Bs of what the server does under load:
NO_FREEZE=1 leaves the heap unfrozen (the service's freeze_heap, engine/heap.py), LOOP=asyncio|uvloop picks
uvicorn's event loop (the GPU machine's image has no uvloop), SWITCH=seconds sets
sys.setswitchinterval, WS=websockets|websockets-sansio|wsproto picks uvicorn's WebSocket
implementation (its "auto" takes websockets-sansio here). PROFILE=path writes a cProfile of the event loop's thread (CPU time of
that thread only) to path at exit.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import sim_engine
import timeline

sim_engine.install()
timeline.install_server()
if os.environ.get("NO_FREEZE"):
    from pipecat_qwen_fast.engine import service

    service.freeze_heap = lambda **kw: 0
if os.environ.get("SWITCH"):
    sys.setswitchinterval(float(os.environ["SWITCH"]))
if os.environ.get("WS"):
    import uvicorn.config

    uvicorn.config.WS_PROTOCOLS["auto"] = uvicorn.config.WS_PROTOCOLS[os.environ["WS"]]
if os.environ.get("LOOP"):
    import uvicorn.config

    uvicorn.config.LOOP_FACTORIES["auto"] = uvicorn.config.LOOP_FACTORIES[os.environ["LOOP"]]

from pipecat_qwen_fast.cli import main

if os.environ.get("PROFILE"):
    import cProfile
    import time

    profile = cProfile.Profile(time.thread_time)  # uvicorn runs its loop on this thread
    try:
        code = profile.runcall(main, ["serve", *sys.argv[1:]])
    finally:
        profile.dump_stats(os.environ["PROFILE"])
    sys.exit(code)
sys.exit(main(["serve", *sys.argv[1:]]))
