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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU: the compiled, captured prefill is GPU-only")
@pytest.mark.gpu
def test_compiled_captured_prefill_matches_eager_on_gpu(tiny_checkpoint):
    """The prefill graphs captured from the compiled layer step against the eager stack and
    against graphs of the plain step, in bf16 (the compiled step fuses and rounds differently)."""
    from pipecat_qwen_fast.model.layers import fuse_projections

    engine = QwenTTSEngine.from_pretrained(tiny_checkpoint("custom_voice"), device="cpu", dtype="float32")
    device, dtype = torch.device("cuda"), torch.bfloat16
    talker = engine.model.talker.to(device, dtype)  # the talker alone: no vocoder graphs to capture
    fuse_projections(talker)  # as the GPU backends run it
    compiled = PrefillGraphs(talker, device, dtype, buckets=(16, 32))
    plain = PrefillGraphs(talker, device, dtype, buckets=(16, 32), compile=False)
    compiled.capture_all()
    plain.capture_all()
    assert compiled.compile, "the layer step did not compile (see the warning logged)"
    assert all(e["graph"] is not None for e in compiled.entries.values())

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

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
