"""Unprofiled per-op costs (timeit) of the per-stream pieces of one round."""
import timeit, numpy as np, torch
from pipecat_qwen_fast.model.sampling import SamplingParams
from pipecat_qwen_fast.engine.request import SynthesisRequest, chunk_target
N = 64
codes = torch.randint(0, 1000, (N, 16)); host = codes.numpy()
ps = [SamplingParams() for _ in range(N)]
canon = ps[0]
req = SynthesisRequest("x"); pcm = torch.zeros(N, 32 * 1920, dtype=torch.int16)
def t(stmt, g, number=2000):
    return min(timeit.repeat(stmt, globals=g, number=number, repeat=5)) / number * 1e6
g = dict(globals())
res = {
 "codes[j] (torch row view), per row": t("for j in range(N): codes[j]", g) / N,
 "codes.unbind(0) then list index, per row": t("u = codes.unbind(0)\nfor j in range(N): u[j]", g) / N,
 "host[j] (numpy row view), per row": t("for j in range(N): host[j]", g) / N,
 "int(host[j][0]), per row": t("for j in range(N): int(host[j][0])", g) / N,
 "host[:,0].tolist() once, per row": t("host[:,0].tolist()", g) / N,
 "groups.setdefault(distinct equal params), per row": t("d={}\nfor p in ps: d.setdefault(p, []).append(1)", g) / N,
 "groups.setdefault(same canonical params), per row": t("d={}\nfor p in ps: d.setdefault(canon, []).append(1)", g) / N,
 "chunk_target(req, 40), per call": t("chunk_target(req, 40)", g, 20000),
 "torch.stack(8 rows).T, per chunk": t("torch.stack([codes[j] for j in range(8)]).T", g, 2000),
 "np.stack(8 host rows), per chunk": t("np.stack([host[j] for j in range(8)])", g, 2000),
 "pcm[row,:k].numpy().copy() 32 frames, per chunk": t("pcm[3, :32*1920].numpy().copy()", g, 2000),
 "pcm.numpy() once + row view (no copy), per chunk": t("a=pcm.numpy()\nfor j in range(N): a[j,:32*1920]", g, 500) / N,
}
for k, v in res.items():
    print(f"{v:8.3f} us  {k}")
