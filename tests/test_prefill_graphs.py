"""The captured prefill's body (right-padded bucket) against the eager prefill, on CPU."""

from __future__ import annotations

import torch

from pipecat_qwen_fast import QwenTTSEngine
from pipecat_qwen_fast.layers import KVCache
from pipecat_qwen_fast.prefill_graphs import PrefillGraphs


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
