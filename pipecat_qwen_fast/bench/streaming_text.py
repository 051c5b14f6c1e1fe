"""`qwen-fast-tts bench streaming-text`: first audio after an LLM's first token (issue 35).

A scripted LLM writes one reply token by token at a fixed rate (40 and 100 tokens a second by
default) into each framework's real pipeline with our TTS, in sentence mode (each sentence its own
request, the text mode the model defaults to) and in token mode (one dual-track session per turn,
fed as the tokens arrive):

* Pipecat: [scripted LLM processor, QwenFastTTSService, timing sink] in a PipelineWorker, with
  ``text_aggregation_mode`` SENTENCE or TOKEN; audio is timed as it leaves the TTS processor.
* LiveKit: an ``AgentSession`` with a scripted ``llm.LLM`` and an audio output that timestamps
  each frame it receives; ``qwen_fast.TTS(streaming_text=False)`` (sentences) or the default.
* engine: the EngineService alone (``--frameworks engine``, for a machine without the
  frameworks): a text stream per turn, or a request per sentence.

Per run: the time from the LLM's first token to the first audio sample at the framework's output,
and the playback gap: audio played from its first sample in real time, how long the player would
wait for audio not yet there. The reply's tokens are the model's own tokenizer's (a Qwen-family
LLM writes those pieces). A model reads 12.5 tokens a second (one a frame): an LLM slower than
that leaves gaps (try ``--rates 8``), never other speech (tests/test_text_session.py).

    qwen-fast-tts bench streaming-text --build-size 0.6b --out results/streaming_text
    qwen-fast-tts bench streaming-text --model DIR --out DIR --rates 40,100,8 --runs 20
    qwen-fast-tts bench streaming-text --build-size tiny --device cpu --quick --out /tmp/st
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPLY = (
    "Sure, I can help with that. Your order shipped yesterday and should arrive on Friday, "
    "before noon. Is there anything else I can do for you today?"
)
MODES = ("sentence", "token")
FRAMEWORKS = ("pipecat", "livekit", "engine")
LIVEKIT_TEXT_TRANSFORMS = "default"  # --livekit-text-transforms
# Where a sentence ends for the engine-only measure's sentence mode (as a sentence aggregator
# would see it: the punctuation, then the next token's whitespace).
SENTENCE_END = (".", "!", "?")


@dataclass
class Run:
    """One turn's timeline (time.perf_counter seconds)."""

    first_token: float | None = None
    audio: list[tuple[float, float]] = field(default_factory=list)  # (arrival, seconds of audio)
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def result(self) -> dict:
        if self.first_token is None or not self.audio:
            return {"error": "no token or no audio"}
        first = self.audio[0][0]
        clock, gap = first, 0.0
        for arrival, seconds in self.audio:
            start = max(clock, arrival)
            gap += start - clock
            clock = start + seconds
        return {
            "first_audio_ms": 1e3 * (first - self.first_token),
            "gap_s": gap,
            "audio_s": sum(s for _, s in self.audio),
        }


LLM_WORD = re.compile(r" ?\w+| ?[^\w\s]+|\s+")


def llm_words(text: str) -> list[str]:
    """`text` as an LLM's tokenizer sends common English: a word with its leading space, a run of
    punctuation, whitespace. The checkpoints measured here are random, with a synthetic tokenizer
    whose small vocabulary splits words (it sent "Sure" as "S" + "ure", so the first word was
    complete only at the third token); an LLM sends "Sure" whole."""
    pieces = LLM_WORD.findall(text)
    assert "".join(pieces) == text
    return pieces


def llm_tokens(tokenizer, text: str) -> list[str]:
    """`text` in the pieces its tokens decode to (a piece holding part of a character waits for
    the rest of it)."""
    ids = tokenizer.encode(text)
    pieces, done = [], ""
    for i in range(1, len(ids) + 1):
        decoded = tokenizer.decode(ids[:i])
        if decoded.endswith("\ufffd") and i < len(ids):
            continue
        pieces.append(decoded[len(done) :])
        done = decoded
    return [p for p in pieces if p]


async def _paced(tokens: list[str], rate: float, run: Run, push) -> None:
    """`push(token)` for each token at `rate` tokens a second from now; marks the first."""
    t0 = time.perf_counter()
    for i, token in enumerate(tokens):
        delay = t0 + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if i == 0:
            run.first_token = time.perf_counter()
        await push(token)


def summary(values: list[float]) -> dict:
    ordered = sorted(values)
    if not ordered:
        return {"n": 0}
    return {
        "p50": statistics.median(ordered),
        "p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
        "min": ordered[0],
        "max": ordered[-1],
        "n": len(ordered),
    }


# ------------------------------------------------------------------------------------ Pipecat


async def pipecat_runs(
    model: str,
    placement: dict,
    mode: str,
    rate: float,
    tokens: list[str],
    runs: int,
    max_frames: int | None,
) -> list[dict]:
    from dataclasses import dataclass as frame_dataclass

    from pipecat.frames.frames import (
        DataFrame,
        EndFrame,
        LLMFullResponseEndFrame,
        LLMFullResponseStartFrame,
        LLMTextFrame,
        TTSAudioRawFrame,
        TTSStoppedFrame,
    )
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.pipeline.worker import PipelineParams, PipelineWorker
    from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
    from pipecat.services.tts_service import TextAggregationMode
    from pipecat.workers.runner import WorkerRunner

    from pipecat_qwen_fast import QwenFastTTSService

    @frame_dataclass
    class Go(DataFrame):
        run: Any = None

    class ScriptedLLM(FrameProcessor):
        async def process_frame(self, frame, direction):
            await super().process_frame(frame, direction)
            if isinstance(frame, Go):
                self.create_task(self._reply(frame.run))
            else:
                await self.push_frame(frame, direction)

        async def _reply(self, run: Run) -> None:
            await self.push_frame(LLMFullResponseStartFrame())
            await _paced(tokens, rate, run, lambda t: self.push_frame(LLMTextFrame(t)))
            await self.push_frame(LLMFullResponseEndFrame())

    class Sink(FrameProcessor):
        run: Run | None = None

        async def process_frame(self, frame, direction):
            await super().process_frame(frame, direction)
            if self.run is not None and direction == FrameDirection.DOWNSTREAM:
                if isinstance(frame, TTSAudioRawFrame) and frame.audio:
                    self.run.audio.append(
                        (time.perf_counter(), len(frame.audio) / 2 / frame.sample_rate)
                    )
                elif isinstance(frame, TTSStoppedFrame):
                    self.run.done.set()
            await self.push_frame(frame, direction)

    aggregation = TextAggregationMode.TOKEN if mode == "token" else TextAggregationMode.SENTENCE
    tts = QwenFastTTSService(
        model=model,
        **placement,
        seed=1,
        max_frames=max_frames,
        text_aggregation_mode=aggregation,
        stop_frame_timeout_s=60.0,
    )
    sink = Sink()
    worker = PipelineWorker(
        Pipeline([ScriptedLLM(), tts, sink]), params=PipelineParams(), cancel_on_idle_timeout=False
    )
    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(worker)
    running = asyncio.create_task(runner.run())
    out = []
    try:
        for i in range(runs + 1):  # the first warms this pipeline up and is not counted
            run = sink.run = Run()
            await worker.queue_frame(Go(run=run))
            await asyncio.wait_for(run.done.wait(), 300)
            await asyncio.sleep(0.05)  # the turn's last frames drain
            if i:
                out.append(run.result())
    finally:
        await worker.queue_frame(EndFrame())
        await asyncio.wait_for(running, 60)
    return out


# ------------------------------------------------------------------------------------ LiveKit


async def livekit_runs(
    model: str,
    placement: dict,
    mode: str,
    rate: float,
    tokens: list[str],
    runs: int,
    max_frames: int | None,
) -> list[dict]:
    from livekit import rtc
    from livekit.agents import llm, utils
    from livekit.agents.types import DEFAULT_API_CONNECT_OPTIONS
    from livekit.agents.voice import Agent, AgentSession, io
    from livekit.plugins import qwen_fast

    current: dict[str, Run] = {}

    class PacedStream(llm.LLMStream):
        async def _run(self) -> None:
            request_id = utils.shortuuid()

            async def send(token: str) -> None:
                self._event_ch.send_nowait(
                    llm.ChatChunk(
                        id=request_id, delta=llm.ChoiceDelta(role="assistant", content=token)
                    )
                )

            await _paced(tokens, rate, current["run"], send)

    class PacedLLM(llm.LLM):
        def chat(self, *, chat_ctx, tools=None, conn_options=DEFAULT_API_CONNECT_OPTIONS, **_):
            return PacedStream(
                self, chat_ctx=chat_ctx, tools=tools or [], conn_options=conn_options
            )

    class TimedOutput(io.AudioOutput):
        """Receives frames as fast as they come (no real-time playout) and timestamps them."""

        def __init__(self) -> None:
            super().__init__(label="timed", capabilities=io.AudioOutputCapabilities(pause=False))
            self._pushed = 0.0
            self._playing = False

        async def capture_frame(self, frame: rtc.AudioFrame) -> None:
            await super().capture_frame(frame)
            if not self._playing:
                self._playing = True
                self.on_playback_started(created_at=asyncio.get_running_loop().time())
            current["run"].audio.append((time.perf_counter(), frame.duration))
            self._pushed += frame.duration

        def flush(self) -> None:
            super().flush()
            self._finish(False)

        def clear_buffer(self) -> None:
            self._finish(True)

        def _finish(self, interrupted: bool) -> None:
            if self._playing:
                self._playing = False
                position, self._pushed = self._pushed, 0.0
                self.on_playback_finished(playback_position=position, interrupted=interrupted)

    tts = qwen_fast.TTS(
        model=model, **placement, seed=1, max_frames=max_frames, streaming_text=mode == "token"
    )
    # Typed turns: no user audio, so no VAD and no end-of-turn model (AgentSession's defaults load
    # both, livekit-local-inference's, which would only sit beside the measure).
    session = AgentSession(
        llm=PacedLLM(),
        tts=tts,
        vad=None,
        turn_handling={"turn_detection": "manual"},
        use_tts_aligned_transcript=mode == "token",
        # LiveKit's default transforms (markdown, emoji) hold each piece until the next split
        # token arrives: one LLM interval before the TTS sees the end of a word.
        **({} if LIVEKIT_TEXT_TRANSFORMS == "default" else {"tts_text_transforms": None}),
    )
    session.output.audio = TimedOutput()
    await session.start(agent=Agent(instructions="Answer."))
    out = []
    try:
        for i in range(runs + 1):
            run = current["run"] = Run()
            await asyncio.wait_for(session.run(user_input="Where is my order?"), 300)
            if i:
                out.append(run.result())
    finally:
        await session.aclose()
        await tts.aclose()
    return out


# ------------------------------------------------------------------------------------ engine only


async def engine_runs(
    model: str,
    placement: dict,
    mode: str,
    rate: float,
    tokens: list[str],
    runs: int,
    max_frames: int | None,
) -> list[dict]:
    """The EngineService alone, no framework (for machines without Pipecat or LiveKit): token mode
    appends each token to one text stream; sentence mode sends each sentence as its own request
    once the token after its end arrives, one after another, as the frameworks do."""
    from pipecat_qwen_fast.engine.request import SynthesisRequest
    from pipecat_qwen_fast.engine.service import get_shared_service

    service = await get_shared_service(model, **placement)
    out = []
    for i in range(runs + 1):
        run = Run()
        if mode == "token":
            stream = service.open_text_stream(SynthesisRequest("", seed=1, max_frames=max_frames))

            async def push(token: str, stream=stream) -> None:
                stream.append(token)

            async def feed(stream=stream, run=run) -> None:
                await _paced(tokens, rate, run, push)
                stream.end()

            feeding = asyncio.create_task(feed())
            async for chunk in stream:
                run.audio.append((time.perf_counter(), chunk.duration_s))
            await feeding
        else:
            sentences: asyncio.Queue[str | None] = asyncio.Queue()
            pending = [""]

            async def push(token: str, sentences=sentences, pending=pending) -> None:
                if pending[0].rstrip().endswith(SENTENCE_END) and token[:1].isspace():
                    sentences.put_nowait(pending[0].strip())
                    pending[0] = ""
                pending[0] += token

            async def feed(run=run, sentences=sentences, pending=pending) -> None:
                await _paced(tokens, rate, run, push)
                if pending[0].strip():
                    sentences.put_nowait(pending[0].strip())
                sentences.put_nowait(None)

            feeding = asyncio.create_task(feed())
            while (sentence := await sentences.get()) is not None:
                async for chunk in service.open_stream(
                    SynthesisRequest(sentence, seed=1, max_frames=max_frames)
                ):
                    run.audio.append((time.perf_counter(), chunk.duration_s))
            await feeding
        if i:
            out.append(run.result())
    return out


# ------------------------------------------------------------------------------------ main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="qwen-fast-tts bench streaming-text",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", type=Path, help="a checkpoint folder")
    src.add_argument(
        "--build-size",
        choices=["tiny", "0.6b", "1.7b"],
        help="build a random CustomVoice checkpoint (EOS row zeroed) first",
    )
    p.add_argument("--checkpoint-dir", type=Path, default=Path("/tmp/qwen-fast-bench-ckpt"))
    p.add_argument("--out", type=Path, required=True, help="folder for streaming_text.json")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--backend", default="auto")
    p.add_argument("--rates", default="40,100", help="LLM tokens a second, comma list")
    p.add_argument("--livekit-text-transforms", choices=["default", "none"], default="default",
                   help="AgentSession's tts_text_transforms: LiveKit's default (markdown and emoji "
                        "filters) or none")
    p.add_argument("--llm-tokens", choices=["words", "tokenizer"], default="words",
                   help="the scripted LLM's pieces: words as an LLM sends them, or the TTS tokenizer's")
    p.add_argument("--runs", type=int, default=10, help="runs per framework, mode and rate")
    p.add_argument(
        "--frameworks",
        default="pipecat,livekit,engine",
        help="comma list of: pipecat, livekit, engine (no framework)",
    )
    p.add_argument(
        "--max-frames",
        type=int,
        default=300,
        help="frame cap per request (random weights never end by themselves)",
    )
    p.add_argument("--quick", action="store_true", help="2 runs each (CPU smoke test)")
    args = p.parse_args(argv)
    args.rates = [float(r) for r in args.rates.split(",") if r.strip()]
    args.frameworks = [f.strip() for f in args.frameworks.split(",") if f.strip()]
    bad = [f for f in args.frameworks if f not in FRAMEWORKS]
    if bad or not args.rates or any(r <= 0 for r in args.rates):
        p.error(f"--frameworks takes {', '.join(FRAMEWORKS)}; --rates positive numbers")
    if args.quick:
        args.runs = 2
    return args


async def measure(args: argparse.Namespace, model: str) -> dict:
    from pipecat_qwen_fast.engine.service import get_shared_service

    placement = {"device": args.device, "dtype": args.dtype, "backend": args.backend}
    service = await get_shared_service(model, **placement)
    engine = service.engine
    deadline = time.monotonic() + 600
    while not getattr(engine, "fully_warm", True) and time.monotonic() < deadline:
        await asyncio.sleep(0.5)  # the deferred warm-up runs while the engine thread is idle
    # --llm-tokens: word pieces as an LLM sends them (default), or the TTS tokenizer's pieces.
    global LIVEKIT_TEXT_TRANSFORMS
    LIVEKIT_TEXT_TRANSFORMS = args.livekit_text_transforms
    tokens = llm_words(REPLY) if args.llm_tokens == "words" else llm_tokens(engine.tokenizer, REPLY)
    results: dict = {
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "model": model,
        "placement": placement,
        "backend_name": getattr(engine.backend, "name", None),
        "reply": REPLY,
        "llm_tokens": len(tokens),
        "llm_token_pieces": args.llm_tokens,
        "livekit_text_transforms": args.livekit_text_transforms,
        "first_llm_tokens": tokens[:4],
        "runs": args.runs,
        "max_frames": args.max_frames,
        "frameworks": {},
    }
    measure_one = {"pipecat": pipecat_runs, "livekit": livekit_runs, "engine": engine_runs}
    for framework in args.frameworks:
        for mode in MODES:
            for rate in args.rates:
                runs = await measure_one[framework](
                    model, placement, mode, rate, tokens, args.runs, args.max_frames
                )
                ok = [r for r in runs if "error" not in r]
                row = {
                    "first_audio_ms": summary([r["first_audio_ms"] for r in ok]),
                    "gap_s": summary([r["gap_s"] for r in ok]),
                    "audio_s": summary([r["audio_s"] for r in ok]),
                    "errors": len(runs) - len(ok),
                    "runs": runs,
                }
                results["frameworks"].setdefault(framework, {}).setdefault(mode, {})[
                    f"{rate:g}"
                ] = row
                p50 = row["first_audio_ms"].get("p50")
                print(
                    f"[streaming-text] {framework:8s} {mode:8s} {rate:5g} tok/s: first audio p50 "
                    f"{p50 if p50 is None else round(p50, 1)} ms, gap p50 "
                    f"{row['gap_s'].get('p50')} s",
                    file=sys.stderr,
                    flush=True,
                )
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.build_size:
        from pipecat_qwen_fast.bench.main import build_checkpoint

        build_checkpoint(args.build_size, "custom_voice", args.checkpoint_dir)
        model = str(args.checkpoint_dir)
    else:
        model = str(args.model)

    async def run() -> dict:
        from pipecat_qwen_fast.engine.service import close_shared_services

        try:
            return await measure(args, model)
        finally:
            await close_shared_services()

    results = asyncio.run(run())
    path = args.out / "streaming_text.json"
    path.write_text(json.dumps(results, indent=2))
    print(f"wrote {path}", file=sys.stderr)
    for framework, modes in results["frameworks"].items():
        for mode, rates in modes.items():
            for rate, row in rates.items():
                fa = row["first_audio_ms"]
                print(
                    f"{framework:8s} {mode:8s} {rate:>5s} tok/s  first audio p50 {fa.get('p50', float('nan')):8.1f} ms"
                    f"  p90 {fa.get('p90', float('nan')):8.1f} ms  gap p50 {row['gap_s'].get('p50', float('nan')):.3f} s"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
