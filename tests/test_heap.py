"""The collector around a loaded engine (engine/heap.py): EngineService freezes the heap once its
engine is loaded and once fully warm, gives it back when it closes, and GcPauses times collections."""

from __future__ import annotations

import asyncio
import gc

import pytest

from pipecat_qwen_fast.engine.engine import QwenTTSEngine
from pipecat_qwen_fast.engine.heap import GcPauses, freeze_heap, heap_census, release_heap
from pipecat_qwen_fast.engine.request import SynthesisRequest
from pipecat_qwen_fast.engine.service import EngineService

TIMEOUT = 120


@pytest.fixture
def thawed():
    gc.unfreeze()
    yield
    gc.unfreeze()


def loader(path):
    return lambda: QwenTTSEngine.from_pretrained(path, device="cpu", dtype="float32", backend="torch")


async def until(predicate, what: str, within: float = 30.0) -> None:
    for _ in range(int(within / 0.05)):
        if predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


async def test_a_service_freezes_the_loaded_heap_and_gives_it_back_on_close(endless_model, thawed):
    release = asyncio.Event()
    loop = asyncio.get_running_loop()

    def load():
        engine = loader(endless_model)()

        def long_lived_objects():  # as a background warm-up step's graphs and compiled code
            engine.warm_objects = [[i] for i in range(20_000)]

        # The step waits until the first freeze is seen, then adds its objects.
        engine._warmup.pending.append(("a test's step", lambda: (
            asyncio.run_coroutine_threadsafe(release.wait(), loop).result(TIMEOUT), long_lived_objects())))
        return engine

    service = EngineService(load, freeze_heap=True)
    try:
        await asyncio.wait_for(service.wait_ready(), TIMEOUT)
        loaded = gc.get_freeze_count()
        assert loaded > 10_000  # torch and the model's objects
        release.set()
        # Once out of warm-up steps it freezes again: the warm-up's objects join the frozen.
        await until(lambda: gc.get_freeze_count() >= loaded + 20_000, "the second freeze")
        chunks = [c async for c in service.stream(SynthesisRequest("Hi.", max_frames=2))]
        assert chunks, "the service still serves"
    finally:
        await asyncio.wait_for(service.aclose(), TIMEOUT)
    assert gc.get_freeze_count() == 0, "a closed service keeps nothing out of the collector's reach"


async def test_a_cpu_service_leaves_the_heap_alone_by_default(endless_model, thawed):
    service = EngineService(loader(endless_model))
    try:
        await asyncio.wait_for(service.wait_ready(), TIMEOUT)
        await asyncio.sleep(0.3)  # past its idle warm-up check
        assert service.freeze_heap is False
        assert gc.get_freeze_count() == 0
    finally:
        await asyncio.wait_for(service.aclose(), TIMEOUT)


def test_the_heap_stays_frozen_while_any_holder_needs_it(thawed):
    freeze_heap(collect=False, holder=1)
    freeze_heap(collect=False, holder=2)
    frozen = gc.get_freeze_count()
    assert frozen > 0
    # Still frozen after each release but the last; the count itself may drop by a few frozen
    # objects that other threads free meanwhile (the full suite saw 854,875 -> 854,873).
    release_heap(1)
    assert gc.get_freeze_count() > frozen // 2
    release_heap(3)  # never held: nothing changes
    assert gc.get_freeze_count() > frozen // 2
    release_heap(2)
    assert gc.get_freeze_count() == 0


def test_gc_pauses_times_each_collection_by_generation():
    with GcPauses() as pauses:
        gc.collect()
        gc.collect(0)
    after = len(pauses.pauses)
    gc.collect()  # uninstalled: not counted
    assert len(pauses.pauses) == after
    summary = pauses.summary()
    assert summary["gen2"]["collections"] >= 1 and summary["gen2"]["max_ms"] > 0
    assert summary["gen0"]["collections"] >= 1
    assert set(summary) == {"gen0", "gen1", "gen2"}


def test_gc_pauses_count_what_full_collections_free():
    class Node:
        pass

    with GcPauses() as pauses:
        for _ in range(300):  # cycles only a collection frees
            a, b = Node(), Node()
            a.other, b.other = b, a
        del a, b
        gc.collect()
    assert pauses.summary()["gen2"]["collected"] >= 600


def test_heap_census_counts_what_a_full_collection_would_walk(thawed):
    class Kept:
        pass

    name = f"{__name__}.{Kept.__qualname__}"
    kept = [Kept() for _ in range(5000)]
    census = heap_census(top=None)  # every type (a test worker's heap has larger ones)
    assert sum(census["unfrozen"]) >= 5000
    assert dict(census["types"])[name] == 5000
    here = dict(census["function_modules"])
    made = [lambda: 0 for _ in range(300)]  # 300 functions defined in this module
    assert dict(heap_census(top=None)["function_modules"])[__name__] == here.get(__name__, 0) + 300
    del made
    assert len(heap_census()["types"]) == 12
    gc.freeze()  # out of a full collection's walk, so out of the census
    frozen = heap_census(top=None)
    assert frozen["frozen"] >= census["frozen"] + 5000
    assert name not in dict(frozen["types"])
    assert len(kept) == 5000
