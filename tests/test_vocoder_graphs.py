"""The shared-graph vocoder wrapper: static-state copies in and out give the plain stream's output."""

from __future__ import annotations

import contextlib

import pytest
import torch

from pipecat_qwen_fast import QwenTTSEngine
from pipecat_qwen_fast.engine.request import SynthesisRequest, schedule_sizes
from pipecat_qwen_fast.vocoder.graphs import (
    BATCH_BUCKETS,
    MAX_BATCH_FRAMES,
    GraphedVocoder,
    _cudnn_benchmark,
    compile_unavailable_reason,
)


@contextlib.contextmanager
def _fp32_cuda_engine(tiny_checkpoint):
    """A tiny float32 engine on CUDA (no warm-up) with TF32 convolutions off, so graphs compared
    with each other differ only by their fusions and batch shapes; closed and restored after."""
    engine = QwenTTSEngine.from_pretrained(tiny_checkpoint("custom_voice"), device="cuda", dtype="float32",
                                           warmup=False)
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield engine
    finally:
        torch.backends.cudnn.allow_tf32 = tf32
        engine.close()


def test_graphed_wrapper_equals_plain_stream(tiny_checkpoint):
    engine = QwenTTSEngine.from_pretrained(tiny_checkpoint("custom_voice"), device="cpu", dtype="float32")
    voc = engine.vocoder
    wrapped = GraphedVocoder(voc, engine.device, engine.dtype, use_graphs=False)
    g = torch.Generator().manual_seed(0)
    codes = [torch.randint(0, 2048, (1, 16, 30), generator=g) for _ in range(2)]
    # Two interleaved streams through the shared wrapper vs each stream alone.
    plain = [voc.new_stream(), voc.new_stream()]
    shared = [voc.new_stream(), voc.new_stream()]
    outs_plain: list[list[torch.Tensor]] = [[], []]
    outs_shared: list[list[torch.Tensor]] = [[], []]
    start = 0
    for n in (1, 4, 4, 3, 10, 8):
        for i in range(2):
            chunk = codes[i][..., start : start + n]
            outs_plain[i].append(voc.decode_stream(chunk, plain[i]))
            outs_shared[i].append(wrapped.decode_stream(chunk, shared[i]))
        start += n
    for i in range(2):
        assert torch.equal(torch.cat(outs_plain[i], -1), torch.cat(outs_shared[i], -1))
        assert shared[i].frames == plain[i].frames == 30
        assert int(shared[i].position) == 30
    assert sorted(wrapped.entries) == [1, 3, 4, 8, 10]


@pytest.mark.gpu
def test_compiled_graphs_match_plain_graphs_on_cuda(tiny_checkpoint):
    """Captured from torch.compile'd code (1 and 4 compiled for their shape, 2, 3 and 5 from the
    shape-generic step, 6 first seen after warm-up) vs captured from the plain step: the same audio
    up to fp32 rounding (TF32 convolutions off, so only the fusions differ)."""
    if not torch.cuda.is_available():
        pytest.skip("CUDA not available: compiled vocoder graphs run on CUDA only")
    reason = compile_unavailable_reason(torch.device("cuda"))
    if reason is not None:
        pytest.skip(f"vocoder step not compiled here: {reason}")
    with _fp32_cuda_engine(tiny_checkpoint) as engine:
        voc = engine.vocoder
        compiled = GraphedVocoder(voc, engine.device, engine.dtype, compile_sizes=(1, 4), compile_dynamic=True)
        plain = GraphedVocoder(voc, engine.device, engine.dtype, compile_sizes=())
        compiled.capture([2, 3, 1, 4, 5])  # the per-shape sizes are compiled first whatever the order
        plain.capture([1, 4])
        assert compiled.compiled_sizes == {1, 2, 3, 4, 5} and plain.compiled_sizes == set()
        assert compiled._generic is not None
        g = torch.Generator().manual_seed(1)
        codes = torch.randint(0, 2048, (1, 16, 40), generator=g).cuda()
        streams = [voc.new_stream(), voc.new_stream()]
        outs: list[list[torch.Tensor]] = [[], []]
        start = 0
        for n in (1, 4, 4, 1, 2, 3, 4, 5, 1, 6, 1, 1, 6, 1):
            chunk = codes[..., start : start + n]
            for i, wrapper in enumerate((compiled, plain)):
                outs[i].append(wrapper.decode_stream(chunk, streams[i]))
            start += n
        a, b = torch.cat(outs[0], -1), torch.cat(outs[1], -1)
        peak = float(b.abs().max())
        assert peak > 0
        assert float((a - b).abs().max()) <= 1e-4 * max(1.0, peak)
        assert streams[0].frames == streams[1].frames == 40
        assert 6 in compiled.entries  # first seen after warm-up: from the generic step or plain, never a compile


@pytest.mark.parametrize("compiled,pooled", [(False, False), (True, False), (True, True)])
def test_batched_graphs_match_batch1_graphs_on_cuda(tiny_checkpoint, compiled, pooled):
    """Batched entries (plain graphs, or captured from the compiled step with symbolic rows and
    frames) over streams at different positions, groups split across buckets and padded: the
    audio and states of batch-1 plain graphs, up to fp32 rounding (TF32 off). `pooled`: the
    streams are rows of the entries' pool, moved by the captured gather and scatter graphs."""
    if not torch.cuda.is_available():
        pytest.skip("CUDA not available: batched vocoder graphs run on CUDA only")
    if compiled and (reason := compile_unavailable_reason(torch.device("cuda"))) is not None:
        pytest.skip(f"vocoder step not compiled here: {reason}")
    with _fp32_cuda_engine(tiny_checkpoint) as engine:
        voc = engine.vocoder
        batched = GraphedVocoder(voc, engine.device, engine.dtype, compile_batched=compiled,
                                 pool_slots=8 if pooled else 0)
        one = GraphedVocoder(voc, engine.device, engine.dtype)
        batched.capture_batched([1, 3], max_rows=4)
        assert sorted(batched.batched) == [(1, 2), (1, 4), (3, 2), (3, 4)]
        assert all(e.graph is not None for e in batched.batched.values())
        assert all((e.gather is not None and e.scatter is not None) == pooled for e in batched.batched.values())
        assert batched.compile_batched is compiled
        g = torch.Generator().manual_seed(3)
        codes = torch.randint(0, 2048, (5, 16, 60), generator=g).cuda()
        a = [batched.new_stream() if pooled else voc.new_stream() for _ in range(5)]
        assert all((st.slot is not None) == pooled for st in a)
        b = [voc.new_stream() for _ in range(5)]
        for i in range(5):  # different positions: 0, 7, 14, 21, 28 frames in
            for streams in (a, b):
                if i:
                    one.decode_stream(codes[i : i + 1, :, : 7 * i], streams[i])
        starts = [7 * i for i in range(5)]
        peak = worst = 0.0
        for rows, n in (([0, 1, 2, 3, 4], 1), ([1, 3], 3), ([0, 2, 4], 3), ([4], 1), ([0, 1, 2], 1)):
            c = torch.cat([codes[i : i + 1, :, starts[i] : starts[i] + n] for i in rows])
            got = batched.decode_many(c, [a[i] for i in rows])
            want = torch.cat([one.decode_stream(c[j : j + 1], b[i]) for j, i in enumerate(rows)])
            worst = max(worst, float((got - want).abs().max()))
            peak = max(peak, float(want.abs().max()))
            for i in rows:
                starts[i] += n
        assert peak > 0 and worst <= 1e-4 * max(1.0, peak)
        # Batched calls: 4 + 1 alone, 2, 3 padded to 4, 1 alone (batch-1), 3 padded to 4.
        assert (batched.calls_pooled, batched.calls_copied) == ((4, 0) if pooled else (0, 4))
        for x, y in zip(a, b):
            assert x.frames == y.frames and torch.equal(x.position, y.position)
            assert float((x.keys - y.keys).abs().max()) <= 1e-4 * max(1.0, float(y.keys.abs().max()))


def test_cudnn_benchmark_scope_restores_the_setting():
    before = torch.backends.cudnn.benchmark
    try:
        for outside in (False, True):
            torch.backends.cudnn.benchmark = outside
            with pytest.raises(RuntimeError), _cudnn_benchmark(True):
                assert torch.backends.cudnn.benchmark
                raise RuntimeError("a failed capture")
            assert torch.backends.cudnn.benchmark is outside
            with _cudnn_benchmark(False):  # off: the process's own setting stands
                assert torch.backends.cudnn.benchmark is outside
    finally:
        torch.backends.cudnn.benchmark = before


def test_engine_warmup_compiles_the_default_schedule_on_cuda(tiny_checkpoint):
    """Warm-up compiles every size a default stream sends (1, 2, 4, 8, 16, 32) and every tail, so no
    stream meets a compile or a capture once it is done (the part after `ready` runs in the
    background under EngineService; finish_warmup() runs it here)."""
    if not torch.cuda.is_available():
        pytest.skip("CUDA not available: the engine captures vocoder graphs on CUDA only")
    reason = compile_unavailable_reason(torch.device("cuda"))
    if reason is not None:
        pytest.skip(f"vocoder step not compiled here: {reason}")
    engine = QwenTTSEngine.from_pretrained(tiny_checkpoint("custom_voice", zero_eos=True), device="cuda",
                                           backend="torch")  # EOS row zeroed: the stream runs to max_frames
    engine.finish_warmup()
    graphs = engine.vocoder_graphs
    assert schedule_sizes(SynthesisRequest("x")) == (1, 2, 4, 8, 16, 32)
    assert graphs.compiled_sizes == set(graphs.entries) and set(range(1, 33)) <= graphs.compiled_sizes
    captured = set(graphs.entries)
    # The batched backend's warm-up also captured the batched calls of the default schedule.
    rows = engine.backend.max_batch
    assert set(graphs.batched) == {(n, b) for n in (1, 3, 6, 12, 32) for b in BATCH_BUCKETS
                                   if b <= rows and b * n <= MAX_BATCH_FRAMES}
    sizes = [c.num_frames for c in engine.stream("Hello there, a longer sentence.", voice="ryan", seed=0, max_frames=70)]
    assert sizes == [1, 3, 6, 12, 32, 16]
    assert set(graphs.entries) == captured
