"""Unprofiled wall time of the per-chunk host pieces (perf_counter accumulators), N=64, fake decode/vocoder.
Run from the repository root: python3 bench/probes/host_profile/chunkcost.py"""
import asyncio, sys, time, collections
sys.argv = [sys.argv[0]]
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
import prof
from pipecat_qwen_fast import QwenTTSEngine
from pipecat_qwen_fast.engine import engine as E, deferred_audio as D, service as S
acc = collections.defaultdict(lambda: [0.0, 0])
def wrap(owner, name, label):
    fn = getattr(owner, name)
    def w(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            r = acc[label]; r[0] += time.perf_counter() - t; r[1] += 1
    setattr(owner, name, w)
wrap(E.QwenTTSEngine, "_flush", "_flush (host: VocoderJob, np.stack, torch.stack)")
wrap(D.VocoderSide, "resolve", "VocoderSide.resolve (host: row_chunk copies + notify)")
wrap(D, "row_chunk", "row_chunk (slice+numpy+copy)")
wrap(S.SynthesisStream, "_post", "SynthesisStream._post (incl call_soon_threadsafe)")
wrap(S.SynthesisStream, "_deferred_resolved", "_deferred_resolved (audio_arrived + call_soon_threadsafe)")
wrap(E.QwenTTSEngine, "_after_frame", "_after_frame (all, incl _flush)")
wrap(S.EngineService, "_after_step", "_after_step (all, incl _post)")
eng = QwenTTSEngine.from_pretrained(prof.CKPT, progress=False, device="cpu", dtype="float32", backend="torch")
prof.install_fake_decode(eng, "fake"); prof.install_fake_vocoder(eng, "fake")
asyncio.run(prof.run_one(eng, 4, 40, True, 0, None))
acc.clear()
from pathlib import Path
r = asyncio.run(prof.run_one(eng, 64, 200, True, 0, Path("/tmp/host_profile")))
rounds = r["rounds"]; n = 64
print(f"N=64 rounds {rounds}, host mean {r['host_ms_mean']*1e3:.0f} us/round, chunks {r['chunks']}")
for k, (t, c) in acc.items():
    print(f"{1e6*t/rounds/n:7.2f} us/stream/round  {1e6*t/max(c,1):8.2f} us/call  calls {c:6d}  {k}")
