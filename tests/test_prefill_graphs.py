"""The captured prefill's body (right-padded bucket) against the eager prefill, on CPU."""

from __future__ import annotations

import pytest
import torch

from pipecat_qwen_fast import QwenTTSEngine
from pipecat_qwen_fast.backends.prefill_graphs import PrefillGraphs
from pipecat_qwen_fast.model.layers import KVCache


def test_bucketed_prefill_equals_eager(tiny_checkpoint):
    engine = QwenTTSEngine.from_pretrained(tiny_checkpoint("custom_voice"), device="cpu", dtype="float32")
    talker = engine.model.talker
    graphs = PrefillGraphs(talker, engine.device, engine.dtype, buckets=(16, 32))
    for b in graphs.buckets:
        graphs.prepare(b)
    g = torch.Generator().manual_seed(0)
    for n in (3, 16, 17, 30):
        embeds = torch.randn(n, talker.cfg.hidden_size, generator=g) * 0.5
        cache = KVCache(talker.cfg.stack, 40, engine.device, engine.dtype)
        with torch.no_grad():
            hidden = talker.model(embeds, cache)[-1]
        k, v, h = graphs.run(embeds)
        assert k.shape[2] == graphs.bucket_for(n)
        torch.testing.assert_close(h, hidden, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(k[:, :, :n], cache.k[:, :, :n], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v[:, :, :n], cache.v[:, :, :n], rtol=1e-5, atol=1e-5)
    assert graphs.run(torch.zeros(33, talker.cfg.hidden_size)) is None  # no bucket: caller goes eager


def test_one_compiled_layer_step_serves_every_layer_and_bucket(tiny_checkpoint):
    """The GPU compiles `prefill_layer` once: every layer and bucket length reuses that code
    (a compile per layer or bucket would add minutes to a cold load). Traced here by dynamo with
    its eager backend; the result equals the plain body's."""
    from torch._dynamo.testing import CompileCounter

    from pipecat_qwen_fast.backends.prefill_graphs import mark_length_dynamic, prefill_layer

    engine = QwenTTSEngine.from_pretrained(tiny_checkpoint("custom_voice"), device="cpu", dtype="float32")
    talker = engine.model.talker
    assert len(talker.model.layers) >= 2
    graphs = PrefillGraphs(talker, engine.device, engine.dtype, buckets=(16, 32, 64))
    counter = CompileCounter()
    step = torch.compile(prefill_layer, backend=counter, dynamic=None)
    g = torch.Generator().manual_seed(1)
    for b in graphs.buckets:
        n = b - 3
        embeds = torch.randn(n, talker.cfg.hidden_size, generator=g) * 0.5
        e = graphs.prepare(b)
        plain = [t.clone() for t in graphs.run(embeds)]  # the plain body; leaves the prompt in e
        mark_length_dynamic(e)
        with torch.no_grad():
            graphs._body(e, step)
        for got, want in zip((e["k"], e["v"], e["hidden"]), plain):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert counter.frame_count == 1, counter.frame_count
    engine.close()


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _gpu_talker(tiny_checkpoint):
    """The tiny checkpoint's talker alone in bf16 on the GPU (no vocoder graphs to capture), its
    projections fused as the GPU backends run it; and its engine, to close."""
    from pipecat_qwen_fast.model.layers import fuse_projections

    engine = QwenTTSEngine.from_pretrained(tiny_checkpoint("custom_voice"), device="cpu", dtype="float32")
    talker = engine.model.talker.to(torch.device("cuda"), torch.bfloat16)
    fuse_projections(talker)
    return engine, talker


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU: the compiled, captured prefill is GPU-only")
@pytest.mark.gpu
def test_compiled_captured_prefill_matches_eager_on_gpu(tiny_checkpoint):
    """The prefill graphs captured from the compiled layer step against the eager stack and
    against graphs of the plain step, in bf16 (the compiled step fuses and rounds differently)."""
    engine, talker = _gpu_talker(tiny_checkpoint)
    device, dtype = torch.device("cuda"), torch.bfloat16
    compiled = PrefillGraphs(talker, device, dtype, buckets=(16, 32))
    plain = PrefillGraphs(talker, device, dtype, buckets=(16, 32), compile=False)
    compiled.capture_all()
    plain.capture_all()
    assert compiled.compile, "the layer step did not compile (see the warning logged)"
    assert all(e["graph"] is not None for e in compiled.entries.values())

    g = torch.Generator(device="cuda").manual_seed(0)
    for n in (5, 16, 29):
        embeds = (torch.randn(n, talker.cfg.hidden_size, generator=g, device="cuda") * 0.5).to(torch.bfloat16)
        cache = KVCache(talker.cfg.stack, 40, device, dtype)
        with torch.no_grad():
            hidden = talker.model(embeds, cache)[-1]
        ours = [t.clone() for t in compiled.run(embeds)]
        base = [t.clone() for t in plain.run(embeds)]
        for got, ref in ((ours, base), (ours, [cache.k, cache.v, hidden])):
            assert rel(got[2], ref[2]) < 2e-2
            assert rel(got[0][:, :, :n], ref[0][:, :, :n]) < 2e-2
            assert rel(got[1][:, :, :n], ref[1][:, :, :n]) < 2e-2
    engine.close()


def _row_graphs(talker, device, dtype, buckets=(16, 32), **kw):
    from pipecat_qwen_fast.backends.prefill_graphs import prefill_layer_rows

    return PrefillGraphs(talker, device, dtype, buckets=buckets, step=prefill_layer_rows, rows=4, **kw)


def test_row_prefill_equals_each_prompt_alone(tiny_checkpoint):
    # Up to 4 prompts of different lengths in one right-padded pass of several rows: each row's
    # K/V and last hidden state equal the eager prefill of its prompt alone.
    engine = QwenTTSEngine.from_pretrained(tiny_checkpoint("custom_voice"), device="cpu", dtype="float32")
    talker = engine.model.talker
    graphs = _row_graphs(talker, engine.device, engine.dtype)
    for b in graphs.buckets:
        graphs.prepare(b)
    g = torch.Generator().manual_seed(3)
    for lengths in ((3, 17, 30), (16,), (5, 9, 2, 12), (32, 1)):
        prompts = [torch.randn(n, talker.cfg.hidden_size, generator=g) * 0.5 for n in lengths]
        k, v, h = [t.clone() for t in graphs.run_rows(prompts)]
        assert k.shape[1] == 4 and k.shape[3] == graphs.bucket_for(max(lengths))
        for i, (n, embeds) in enumerate(zip(lengths, prompts)):
            cache = KVCache(talker.cfg.stack, 40, engine.device, engine.dtype)
            with torch.no_grad():
                hidden = talker.model(embeds, cache)[-1]
            torch.testing.assert_close(h[i], hidden, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(k[:, i, :, :n], cache.k[:, :, :n], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(v[:, i, :, :n], cache.v[:, :, :n], rtol=1e-5, atol=1e-5)
    assert graphs.run_rows([torch.zeros(33, talker.cfg.hidden_size)]) is None  # no bucket fits
    with pytest.raises(ValueError, match="1 to 4 prompts"):
        graphs.run_rows([torch.zeros(3, talker.cfg.hidden_size)] * 5)
    with pytest.raises(RuntimeError, match="run_rows"):
        graphs.run(torch.zeros(3, talker.cfg.hidden_size))
    engine.close()


def test_one_compiled_row_step_serves_every_layer_and_bucket(tiny_checkpoint):
    """As for one prompt: the step of several rows compiles once for every layer and bucket."""
    from torch._dynamo.testing import CompileCounter

    from pipecat_qwen_fast.backends.prefill_graphs import mark_length_dynamic, prefill_layer_rows

    engine = QwenTTSEngine.from_pretrained(tiny_checkpoint("custom_voice"), device="cpu", dtype="float32")
    talker = engine.model.talker
    graphs = _row_graphs(talker, engine.device, engine.dtype, buckets=(16, 32, 64))
    counter = CompileCounter()
    step = torch.compile(prefill_layer_rows, backend=counter, dynamic=None)
    g = torch.Generator().manual_seed(4)
    for b in graphs.buckets:
        prompts = [torch.randn(b - 3 - i, talker.cfg.hidden_size, generator=g) * 0.5 for i in range(3)]
        e = graphs.prepare(b)
        plain = [t.clone() for t in graphs.run_rows(prompts)]
        mark_length_dynamic(e)
        with torch.no_grad():
            graphs._body(e, step)
        for got, want in zip((e["k"], e["v"], e["hidden"]), plain):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert counter.frame_count == 1, counter.frame_count
    engine.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU: the compiled, captured prefill is GPU-only")
@pytest.mark.gpu
def test_captured_row_prefill_matches_one_prompt_graphs_on_gpu(tiny_checkpoint):
    """The captured prefill of several rows against the captured prefill of one prompt, in bf16:
    the same step's math with a batch dimension (its kernels may round differently)."""
    engine, talker = _gpu_talker(tiny_checkpoint)
    device, dtype = torch.device("cuda"), torch.bfloat16
    one = PrefillGraphs(talker, device, dtype, buckets=(16, 32))
    rows = _row_graphs(talker, device, dtype)
    one.capture_all()
    rows.capture_all()
    assert rows.compile, "the row step did not compile (see the warning logged)"
    assert all(e["graph"] is not None for e in rows.entries.values())

    g = torch.Generator(device="cuda").manual_seed(5)
    for lengths in ((5, 16, 29), (30, 3, 12, 7), (11,)):
        prompts = [(torch.randn(n, talker.cfg.hidden_size, generator=g, device="cuda") * 0.5).to(dtype)
                   for n in lengths]
        k, v, h = [t.clone() for t in rows.run_rows(prompts)]
        for i, (n, embeds) in enumerate(zip(lengths, prompts)):
            k1, v1, h1 = one.run(embeds)
            assert rel(h[i], h1) < 2e-2
            assert rel(k[:, i, :, :n], k1[:, :, :n]) < 2e-2
            assert rel(v[:, i, :, :n], v1[:, :, :n]) < 2e-2
    engine.close()
