"""Batched vocoder calls inside a real engine: `python bench/probes/batched_vocoder_check.py [cuda|cpu]`.

The tiny CustomVoice checkpoint (EOS row zeroed), backend "torch", warmed up as the service loads
it. Prints (GPU only) the largest difference of `decode_many` through the engine's batched graphs,
through plain batched graphs and through the eager batched reference from the engine's batch-1
graphs, for 8 and 3 one-frame chunks and 5 three-frame ones; then, for 8 sessions of 3 frames
(chunks 1 and 2) stepped together against each alone: per chunk, whether the codes are equal,
the largest PCM difference and the PCM peak.
"""

import sys

import numpy as np
import torch

sys.path.insert(0, '.')
from pipecat_qwen_fast import QwenTTSEngine, SynthesisRequest
from pipecat_qwen_fast.vocoder.graphs import GraphedVocoder

sys.path.insert(0, 'tests')
from conftest import build_cached_checkpoint

path = build_cached_checkpoint("custom_voice", True, None, 0, "bfloat16")
dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"
eng = QwenTTSEngine.from_pretrained(path, device=dev, backend="torch")
gv = eng.vocoder_graphs
voc = eng.vocoder
print("batched entries", gv and sorted(gv.batched), gv and gv.compile_batched, flush=True)
g = torch.Generator(device=dev).manual_seed(0)
for n, k in (((1, 8), (1, 3), (3, 5)) if gv is not None else ()):
    codes = torch.randint(0, 2048, (k, 16, n), device=dev, generator=g)
    a = [voc.new_stream() for _ in range(k)]
    b = [voc.new_stream() for _ in range(k)]
    got = gv.decode_many(codes, a)
    want = torch.cat([gv.decode_stream(codes[i:i+1], b[i]) for i in range(k)])
    eager = voc.decode_streams(codes, [voc.new_stream() for _ in range(k)], check_values=False)
    print(n, k, "graphs batched vs batch1", float((got - want).abs().max()), "eager batched vs batch1", float((eager - want).abs().max()), "peak", float(want.abs().max()), flush=True)
    plain = GraphedVocoder(voc, eng.device, eng.dtype, compile_batched=False)
    plain.capture_batched([n], k)
    c = [voc.new_stream() for _ in range(k)]
    got2 = plain.decode_many(codes, c)
    print("   plain batched graphs vs batch1", float((got2 - want).abs().max()), flush=True)
# engine-level
reqs = [SynthesisRequest(f"Sentence number {i} is here.", seed=100 + i, max_frames=3, first_chunk_frames=1, chunk_frames=2) for i in range(8)]
alone = [list(eng.stream(r.text, seed=r.seed, max_frames=3, first_chunk_frames=1, chunk_frames=2)) for r in reqs]
sessions = eng.open_sessions(reqs)
chunks = {i: [] for i in range(8)}
while not all(s.done for s in sessions):
    for i, out in enumerate(eng.step_many(sessions)):
        assert not isinstance(out, Exception), out
        chunks[i].extend(out)
for i in range(8):
    for x, y in zip(chunks[i], alone[i]):
        print(i, x.frame_index, x.num_frames, np.array_equal(x.codes, y.codes), int(np.abs(x.pcm.astype(int) - y.pcm.astype(int)).max()), int(np.abs(y.pcm).max()))
