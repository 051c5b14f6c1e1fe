"""A process that exits while the engine thread is decoding exits cleanly (issue 32, item 6).

The abort was "terminate called without an active exception" (exit 134): at interpreter shutdown
a daemon thread that wants the GIL back is ended with pthread_exit, whose forced unwind runs
through torch's noexcept gil_scoped_release destructor (the engine thread is inside an op such as
linear, with the GIL released), and std::terminate follows. Each case exits in the middle of a
frame, with nothing closed by the caller; before the fix every run aborted.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.slow

RUNS = 3

SERVICE = """
    import asyncio, sys
    from pipecat_qwen_fast.engine.request import SynthesisRequest
    from pipecat_qwen_fast.engine.service import get_shared_service

    async def main():
        service = await get_shared_service(sys.argv[1], device="cpu", dtype="float32", backend="torch")
        stream = service.open_stream(SynthesisRequest(
            "Talk until the process exits.", voice="ryan", seed=1, max_frames=2000,
            first_chunk_frames=1, chunk_frames=32, max_chunk_frames=None))
        async for _ in stream:
            break  # the engine goes on with the next 32-frame chunk while the process exits

    asyncio.run(main())
    print("exiting")
"""

LIVEKIT = """
    import asyncio, sys
    from livekit.agents import APIConnectOptions
    from livekit.plugins import qwen_fast

    async def main():
        tts = qwen_fast.TTS(model=sys.argv[1], device="cpu", dtype="float32", backend="torch",
                            voice="ryan", seed=1, max_frames=2000, chunk_frames=32, max_chunk_frames=None)
        stream = tts.synthesize("Talk until the process exits.",
                                conn_options=APIConnectOptions(max_retry=0, timeout=120))
        async for _ in stream:
            break
        await tts.aclose()

    asyncio.run(main())
    print("exiting")
"""

PIPECAT = """
    import asyncio, sys
    from pipecat.frames.frames import TTSAudioRawFrame, TTSSpeakFrame
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.pipeline.worker import PipelineWorker
    from pipecat.processors.frame_processor import FrameProcessor
    from pipecat.workers.runner import WorkerRunner
    from pipecat_qwen_fast import QwenFastTTSService

    class FirstAudio(FrameProcessor):
        def __init__(self, seen):
            super().__init__()
            self.seen = seen

        async def process_frame(self, frame, direction):
            await super().process_frame(frame, direction)
            if isinstance(frame, TTSAudioRawFrame):
                self.seen.set()
            await self.push_frame(frame, direction)

    async def main():
        seen = asyncio.Event()
        tts = QwenFastTTSService(model=sys.argv[1], device="cpu", dtype="float32", backend="torch",
                                 seed=1, max_frames=2000, chunk_frames=32, max_chunk_frames=None)
        worker = PipelineWorker(Pipeline([tts, FirstAudio(seen)]))
        await worker.queue_frame(TTSSpeakFrame("Talk until the process exits."))
        run = asyncio.create_task(WorkerRunner(handle_sigint=False).run(worker))
        await asyncio.wait_for(seen.wait(), 120)
        await worker.cancel()
        await run

    asyncio.run(main())
    print("exiting")
"""


@pytest.mark.parametrize(
    ("script", "runs"),
    [(SERVICE, RUNS), (LIVEKIT, 1), (PIPECAT, 1)],
    ids=["service", "livekit-aclose", "pipecat-cancel"],
)
def test_exit_mid_frame_is_clean(endless_model, script, runs):
    for _ in range(runs):
        proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script), str(endless_model)],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
        assert "terminate called" not in proc.stderr
        assert proc.stdout.strip().endswith("exiting")


LOADING = """
    import time
    from pipecat_qwen_fast.engine.service import EngineService

    EngineService(lambda: time.sleep(600))  # a load that would hold the exit for ten minutes
    print("exiting")
"""


def test_exit_during_a_long_load_waits_a_bounded_time():
    from pipecat_qwen_fast.engine.service import LOAD_EXIT_WAIT_S

    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(LOADING)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "still loads" in proc.stderr
    assert LOAD_EXIT_WAIT_S <= time.monotonic() - started < LOAD_EXIT_WAIT_S + 60
