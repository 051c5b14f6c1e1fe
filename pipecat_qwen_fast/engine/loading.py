"""Loading an engine: each step a timed phase, so start-up can be measured, shown and explained.

Phases (top level): "reading the checkpoint" (configs, tokenizer), "loading the weights",
"building the decode backend" (megakernel build or cache load, its warm-up, the batch backend's
compile), "warming up" (graph captures, vocoder graphs, one greedy and one sampled session per
path). A failure names the phase path and the cause (ModelLoadError).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import threading
from typing import TYPE_CHECKING

import torch
from tqdm.auto import tqdm

from pipecat_qwen_fast.backends.select import (
    BACKENDS,
    resolve_device,
    resolve_dtype,
    select_backend,
)
from pipecat_qwen_fast.checkpoints import load as checkpoint
from pipecat_qwen_fast.errors import InvalidInputError
from pipecat_qwen_fast.model.talker import Qwen3TTSModel
from pipecat_qwen_fast.utils.cache import use_compile_caches
from pipecat_qwen_fast.utils.cuda_graphs import plain_first
from pipecat_qwen_fast.utils.phases import PhaseLog, phase
from pipecat_qwen_fast.vocoder.vocoder import Vocoder

if TYPE_CHECKING:
    from pipecat_qwen_fast.engine.engine import QwenTTSEngine


def load_engine(
    cls: type[QwenTTSEngine],
    model: str | os.PathLike[str],
    *,
    device: str | torch.device,
    dtype: str | torch.dtype,
    backend: str,
    warmup: bool | None,
    progress: bool,
    defer_warmup: bool = True,
    log: PhaseLog | None = None,
) -> QwenTTSEngine:
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    if backend not in BACKENDS:
        raise InvalidInputError(
            f"unknown backend {backend!r}; valid backends: {', '.join(BACKENDS)}"
        )
    use_compile_caches()
    log = log or (PhaseBars().log() if progress else PhaseLog())
    if dev.type == "cuda" and backend in ("auto", "megakernel"):
        from pipecat_qwen_fast.backends.megakernel import arch_of, start_build

        start_build(arch_of(dev))
    if dev.type == "cuda":
        # The compiler's modules (seconds of imports, first needed when the backends ask whether
        # compiling works) load on a thread while the weights, mostly C that releases the GIL,
        # are read; a later import of the same module waits for this one instead of repeating it.
        threading.Thread(target=preimport_compiler, name="qwen-preimport", daemon=True).start()
    with log.activate():
        with phase("reading the checkpoint"):
            model_dir = checkpoint.resolve_model_dir(model)
            cfg = checkpoint.load_model_config(model_dir)
            vcfg = checkpoint.load_vocoder_config(model_dir)
            gen = checkpoint.load_generation_defaults(model_dir)
            tok = checkpoint.load_text_tokenizer(model_dir)
        with phase("loading the weights"):
            # Built on the meta device, then the loaded tensors are assigned: no second copy.
            with torch.device("meta"):
                net = Qwen3TTSModel(cfg)
            with phase("reading the talker's file"):
                weights = checkpoint.load_state_dict(
                    model_dir / "model.safetensors",
                    dtype=dt,
                    device=dev,
                    prefix="talker.",
                    progress=progress,
                )
            with phase("assigning the talker's weights"):
                net.load_talker_weights(weights)
            del weights
            with phase("reading the vocoder's file"):
                voc_weights = checkpoint.load_state_dict(
                    model_dir / "speech_tokenizer" / "model.safetensors",
                    dtype=dt,
                    device=dev,
                    prefix="decoder.",
                    progress=progress,
                )
            with phase("building the vocoder"):
                voc = Vocoder.from_state_dict(
                    vcfg, voc_weights, device=dev, dtype=dt
                )  # frozen, eval
            del voc_weights
            # Inference only: parameters loaded with assign=True would otherwise require grad, and
            # a call outside no_grad (graph capture at warm-up) would keep every activation alive.
            net.requires_grad_(False).eval()
        with (
            phase("building the decode backend"),
            plain_first() if defer_warmup else contextlib.nullcontext(),
        ):
            # Deferred warm-up: the megakernel's prefill graphs are captured plain here and
            # compiled among the engine's background steps (engine/warmup.py).
            decode_backend = select_backend(backend, net, dev, dt)
        engine = cls(
            config=cfg,
            generation=gen,
            model=net,
            vocoder=voc,
            tokenizer=tok,
            device=dev,
            dtype=dt,
            backend=decode_backend,
            model_dir=model_dir,
        )
        if warmup if warmup is not None else dev.type == "cuda":
            with phase("warming up"):
                engine.warmup(defer=defer_warmup)
    engine.load_phases = log
    return engine


def preimport_compiler() -> None:
    for name in ("triton", "torch._dynamo", "torch._inductor.compile_fx"):
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the backends find out again, and say why, where it matters
            return


class PhaseBars:
    """The load as the CLI and the demo show it: a bar per top-level phase, finished with its
    seconds, the step inside it shown beside the bar while it runs (the weights' files add their
    own byte bars)."""

    def __init__(self) -> None:
        self.bar = None

    def start(self, name: str, depth: int) -> None:
        if depth == 0:
            self.bar = tqdm(
                total=1,
                desc=f"loading: {name}",
                file=sys.stderr,
                leave=True,
                bar_format="{desc} {bar:10} {elapsed}{postfix}",
            )
        elif self.bar is not None and depth == 1:
            self.bar.set_postfix_str(name, refresh=True)

    def end(self, name: str, depth: int, seconds: float) -> None:
        if depth == 0 and self.bar is not None:
            self.bar.set_postfix_str("", refresh=False)
            self.bar.update(1)
            self.bar.close()
            self.bar = None

    def log(self) -> PhaseLog:
        return PhaseLog(on_start=self.start, on_end=self.end)


def prepare(
    model: str | os.PathLike[str] | None,
    *,
    device: str = "auto",
    backend: str = "auto",
    archs: list[str] | None = None,
) -> PhaseLog:
    """Every one-time build and compile of a machine, into the cache folder (`qwen-fast-tts
    prepare`): with `archs` and no model, only the megakernel libraries (a container build with no
    GPU); otherwise a full load with warm-up, which fills the compile caches the way a start
    would read them."""
    use_compile_caches()
    log = PhaseBars().log()
    if archs:
        from pipecat_qwen_fast.backends.megakernel import build_library

        with log.activate():
            for arch in archs:
                with phase(f"megakernel library for {arch}"):
                    build_library(arch)
    if model is not None:
        from pipecat_qwen_fast.engine.engine import QwenTTSEngine

        engine = load_engine(
            QwenTTSEngine,
            model,
            device=device,
            dtype="auto",
            backend=backend,
            warmup=True,
            progress=True,
            defer_warmup=False,
            log=log,
        )
        engine.close()
    return log
