"""Start-up (issue 33): the cache that makes a warm start, and load phases that name a failure."""

from __future__ import annotations

import shutil

import pytest
import torch

from pipecat_qwen_fast import ModelLoadError, QwenTTSEngine
from pipecat_qwen_fast.backends import megakernel as mk
from pipecat_qwen_fast.errors import UnsupportedFeatureError
from pipecat_qwen_fast.utils.cache import digest_matches, use_compile_caches, write_digest
from pipecat_qwen_fast.utils.phases import PhaseLog, phase


def test_cache_key_follows_source_arch_and_torch():
    base = mk.cache_key("sm_90", src_hash="aaaa", torch_version="2.11.0+cu130")
    assert mk.cache_key("sm_90", src_hash="aaab", torch_version="2.11.0+cu130") != base
    assert mk.cache_key("sm_80", src_hash="aaaa", torch_version="2.11.0+cu130") != base
    assert mk.cache_key("sm_90", src_hash="aaaa", torch_version="2.12.0+cu130") != base
    assert mk.cache_key("sm_90", src_hash="aaaa", torch_version="2.11.0+cu130") == base


def test_source_hash_follows_every_kernel_source(tmp_path):
    src = tmp_path / "cuda"
    shutil.copytree(mk.source_dir(), src)
    before = mk.source_hash(src)
    first = next(name for name in mk.SOURCE_FILES if name.endswith(".cuh"))
    with open(src / first, "a") as f:
        f.write("\n// a change\n")
    assert mk.source_hash(src) != before


def _no_nvcc(monkeypatch, tmp_path):
    monkeypatch.delenv("NVCC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "no-cuda"))
    assert mk.find_nvcc() is None


def _planted_entry(monkeypatch, tmp_path, payload: bytes):
    monkeypatch.setenv("QWEN_FAST_CACHE", str(tmp_path / "cache"))
    target = mk.cache_root() / mk.cache_key("sm_90") / "libqwen_mk.so"
    target.parent.mkdir(parents=True)
    target.write_bytes(payload)
    return target


def test_intact_cache_entry_is_used_without_building(monkeypatch, tmp_path):
    target = _planted_entry(monkeypatch, tmp_path, b"\x7fELF a library")
    write_digest(target)
    _no_nvcc(monkeypatch, tmp_path)
    assert mk.build_library("sm_90") == target


@pytest.mark.parametrize("damage", ["truncated", "no digest"])
def test_corrupt_cache_entry_is_rebuilt_not_trusted(monkeypatch, tmp_path, damage):
    target = _planted_entry(monkeypatch, tmp_path, b"\x7fELF a library")
    write_digest(target)
    if damage == "truncated":
        target.write_bytes(b"\x7fEL")
    else:
        target.with_name(target.name + ".sha256").unlink()
    assert not digest_matches(target)
    _no_nvcc(monkeypatch, tmp_path)
    # It goes to build (and, with no nvcc here, says so) instead of loading the damaged file.
    with pytest.raises(UnsupportedFeatureError, match="nvcc"):
        mk.build_library("sm_90")


def test_compile_caches_live_in_the_cache_folder_unless_set(monkeypatch, tmp_path):
    monkeypatch.setenv("QWEN_FAST_CACHE", str(tmp_path / "c"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    use_compile_caches()
    import os

    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "c" / "inductor")
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "mine")


def test_phases_nest_and_a_failure_names_the_path():
    log = PhaseLog()
    with log.activate():
        with phase("outer"):
            with phase("inner"):
                pass
        with pytest.raises(
            ModelLoadError, match=r"while warming up / capturing: RuntimeError: out of graphs"
        ):
            with phase("warming up"):
                with phase("capturing"):
                    raise RuntimeError("out of graphs")
    names = [(p.name, p.depth) for p in log.phases]
    assert names == [("inner", 1), ("outer", 0), ("capturing", 1), ("warming up", 0)]
    assert set(log.top_level()) == {"outer", "warming up"}


def test_phase_outside_a_load_only_runs_its_body():
    with pytest.raises(RuntimeError, match="plain"):
        with phase("anything"):
            raise RuntimeError("plain")


def test_load_records_phases_and_is_ready(tiny_checkpoint):
    engine = QwenTTSEngine.from_pretrained(tiny_checkpoint(), device="cpu", progress=False)
    assert engine.ready
    top = engine.load_phases.top_level()
    assert list(top)[:3] == [
        "reading the checkpoint",
        "loading the weights",
        "building the decode backend",
    ]
    assert all(s >= 0 for s in top.values())


def test_failed_load_names_its_phase(tiny_checkpoint, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_checkpoint(), broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match="loading failed while loading the weights"):
        QwenTTSEngine.from_pretrained(broken, device="cpu", progress=False)


@pytest.mark.parametrize("dtype", [None, torch.float32])
@pytest.mark.parametrize(
    "file,prefix",
    [("model.safetensors", "talker."), ("speech_tokenizer/model.safetensors", "decoder.")],
)
def test_staged_weight_load_equals_the_per_tensor_load(tiny_checkpoint, file, prefix, dtype):
    from pipecat_qwen_fast.checkpoints.load import load_state_dict, load_state_dict_staged

    path = tiny_checkpoint() / file
    ref = load_state_dict(path, dtype=dtype, device="cpu", prefix=prefix, progress=False)
    fast = load_state_dict_staged(path, dtype=dtype, device="cpu", prefix=prefix)
    assert list(fast) == list(ref)
    for name, t in ref.items():
        assert fast[name].dtype == t.dtype and fast[name].shape == t.shape, name
        assert torch.equal(fast[name], t), name
        assert fast[name].is_contiguous()


def test_staged_load_of_a_truncated_file_is_a_load_error(tiny_checkpoint, tmp_path):
    from pipecat_qwen_fast.checkpoints.load import load_state_dict_staged

    broken = tmp_path / "model.safetensors"
    data = (tiny_checkpoint() / "model.safetensors").read_bytes()
    broken.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="cannot load weights"):
        load_state_dict_staged(broken, device="cpu", prefix="talker.")


def test_service_runs_deferred_warmup_while_idle_and_serves_meanwhile(tiny_checkpoint):
    import threading

    from pipecat_qwen_fast import EngineService, SynthesisRequest

    engine = QwenTTSEngine.from_pretrained(tiny_checkpoint(), device="cpu", progress=False)
    ran: list[str] = []
    gate = threading.Event()
    # Two queued steps: the first waits until a request was served, so the test sees the engine
    # thread serve a call between two background steps, and finish them once idle again.
    engine._warmup.pending.extend(
        [
            ("first", lambda: (gate.wait(30), ran.append("first"))),
            ("second", lambda: ran.append("second")),
        ]
    )
    assert not engine.fully_warm
    gate.set()

    async def main():
        async with EngineService.for_engine(engine) as service:
            pcm = await service.synthesize(SynthesisRequest("Hello.", greedy=True, max_frames=3))
            for _ in range(300):
                if engine.fully_warm:
                    break
                await asyncio.sleep(0.05)
            return pcm

    import asyncio

    pcm = asyncio.run(main())
    assert len(pcm) == 3 * 1920
    assert ran == ["first", "second"] and engine.fully_warm
