"""The shared-graph vocoder wrapper: static-state copies in and out give the plain stream's output."""

from __future__ import annotations

import torch

from pipecat_qwen_fast import QwenTTSEngine
from pipecat_qwen_fast.vocoder_graphs import GraphedVocoder


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
