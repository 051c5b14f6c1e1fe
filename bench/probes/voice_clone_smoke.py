"""Voice cloning on a GPU (issue 36): do the encoders give the CPU's voice, and how long does making one take?

    python bench/probes/voice_clone_smoke.py eager      # on the GPU machine; writes $OUT/vc_gpu.json

Builds a tiny and a 0.6B random Base checkpoint, encodes 10 s of synthetic speech (44.1 kHz in) on
the CPU and on the GPU and compares reference codes and x-vectors, then times
`bench.voice_clone.time_create_voice` on the 0.6B engine (backend from argv, no warm-up: only the
encoders and the eager vocoder run). Needs soundfile and soxr carried as wheels (bench/README's
device notes). The `tf32=` rows toggle cuDNN's TF32 switch around calls that, since 45e88af,
switch it off themselves: both rows of each pair measure true float32 (kept as run).
"""
import json
import os
import sys
import time

import torch
import transformers

from pipecat_qwen_fast.bench.voice_clone import (
    synthetic_speech,
    time_create_voice,
)
from pipecat_qwen_fast.checkpoints.build import build_checkpoint
from pipecat_qwen_fast.checkpoints.load import load_model_config
from pipecat_qwen_fast.voices.audio import load_reference
from pipecat_qwen_fast.voices.encoders import VoiceEncoders

out = {"torch": torch.__version__, "transformers": transformers.__version__, "gpu": torch.cuda.get_device_name()}
ckpts = {}
for size in ("tiny", "0.6b"):
    p = f"/tmp/ck-{size}"; t = time.time()
    build_checkpoint(p, size, "base", seed=0, dtype="bfloat16"); ckpts[size] = p
    out[f"build_{size}_s"] = time.time() - t
wav = load_reference(synthetic_speech(10.0, 44100), 44100).wav
for size, p in ckpts.items():
    cfg = load_model_config(p)
    cpu = VoiceEncoders.load(p, cfg, torch.device("cpu")).encode(wav, True)
    gpu_enc = VoiceEncoders.load(p, cfg, torch.device("cuda"))
    for tf32 in (True, False):
        with torch.backends.cudnn.flags(enabled=True, allow_tf32=tf32):
            x, c = gpu_enc.encode(wav, True)
        out[f"{size}_tf32={tf32}"] = {"code_mismatch_frames": int((c != cpu[1]).any(1).sum()), "frames": int(c.shape[0]),
            "xvec_maxdiff": float((x - cpu[0]).abs().max()), "xvec_peak": float(cpu[0].abs().max())}
    print(json.dumps(out), flush=True)
from pipecat_qwen_fast.engine.engine import QwenTTSEngine

eng = QwenTTSEngine.from_pretrained(ckpts["0.6b"], device="cuda", backend=sys.argv[1], warmup=sys.argv[1] != "eager", progress=False)
for tf32 in (True, False):
    torch.backends.cudnn.allow_tf32 = tf32
    out[f"create_icl_tf32={tf32}"] = time_create_voice(eng, 10.0, icl=True, rate=44100, repeats=10)
    out[f"create_xvec_tf32={tf32}"] = time_create_voice(eng, 10.0, icl=False, rate=24000, repeats=10)
with open(os.environ["OUT"] + "/vc_gpu.json", "w") as f:
    json.dump(out, f, indent=1)
print(json.dumps(out, indent=1))
