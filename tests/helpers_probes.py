"""Shared by the probes' CPU tests: a probe loaded from bench/probes by its file, and an engine
whose batch path is a GraphBackend run eagerly (the probes' `run` needs a batch path; the CPU's
default backend has none)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

PROBES = Path(__file__).resolve().parents[1] / "bench" / "probes"


def load_probe(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_probe", PROBES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cpu_batch_engine(path, max_sessions: int):
    from pipecat_qwen_fast import QwenTTSEngine
    from pipecat_qwen_fast.backends.graph import GraphBackend

    engine = QwenTTSEngine.from_pretrained(path, device="cpu", dtype="float32", backend="eager", progress=False)
    engine.backend = GraphBackend(engine.model.talker, engine.device, engine.dtype, max_sessions=max_sessions,
                                  capacity=512, use_graphs=False)
    return engine
