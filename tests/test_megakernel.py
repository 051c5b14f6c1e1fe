"""The CUDA megakernel: it compiles for sm_80 and sm_90 (no GPU needed), its C ABI matches the
ctypes mirror, and on a GPU it agrees with the torch backend on a random full-size 0.6B talker."""

from __future__ import annotations

import ctypes
import importlib.util
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

from pipecat_qwen_fast import megakernel as mk
from pipecat_qwen_fast.backend import TorchBackend
from pipecat_qwen_fast.sampling import SamplingParams, talker_suppress_mask

CUDA_DIR = Path(__file__).resolve().parent.parent / "cuda"
NVCC = mk.find_nvcc()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found (set NVCC or CUDA_HOME)")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU: megakernel GPU tests skipped")

PROMPT_LEN = 12
TF_FRAMES = 500
GREEDY_FRAMES = 50


def load_reference():
    spec = importlib.util.spec_from_file_location("qmk_reference", CUDA_DIR / "reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@needs_nvcc
def test_compiles():
    """CI has nvcc but no GPU: a kernel that does not build for sm_80 and sm_90 cannot land."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "qwen_mk.o"
        cmd = mk.nvcc_command(NVCC, ["sm_80", "sm_90"], out, shared=False)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert out.stat().st_size > 0


@needs_nvcc
def test_ctypes_layout_matches_header(tmp_path, monkeypatch):
    """Host-only entry points of the built library: ABI version and struct sizes (no GPU needed)."""
    monkeypatch.setenv("QWEN_FAST_CACHE", str(tmp_path))
    lib = mk.load_library(mk.build_library("sm_80"))
    sizes = (ctypes.c_int32 * 4)()
    lib.qmk_struct_sizes(sizes)
    assert list(sizes) == [ctypes.sizeof(s) for s in mk.STRUCTS]
    # room for the split attention's partials: 16 position chunks per kv head at 1000 positions
    assert lib.qmk_attn_part_floats(1000, 8) >= 16 * 8 * 2 * 130


def test_unsupported_reason_names_the_device():
    reason = mk.megakernel_unsupported_reason(None, torch.device("cpu"), torch.bfloat16)
    assert reason is not None and "CUDA" in reason


def test_nvcc_command_rejects_bad_arch():
    with pytest.raises(ValueError, match="sm_90"):
        mk.gencode_flags(["hopper"])


# ---------------------------------------------------------------------------------------------
# GPU


@pytest.fixture(scope="module")
def backends():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU: megakernel GPU tests skipped")
    ref = load_reference()
    dev = torch.device("cuda")
    talker, cfg = ref.random_talker("0.6b", dev, seed=0)
    return talker, cfg, TorchBackend(talker, dev, torch.bfloat16), mk.MegakernelBackend(talker, dev, torch.bfloat16)


@needs_gpu
@pytest.mark.gpu
def test_supported_on_this_gpu(backends):
    """The selection-time probe (library + cooperative grid fit) accepts this GPU and model."""
    talker, cfg, tb, mb = backends
    assert mk.megakernel_unsupported_reason(talker, torch.device("cuda"), torch.bfloat16) is None


def start(backend, talker, params, frames, seed=0, prompt_seed=1, prompt_len=PROMPT_LEN):
    D = talker.cfg.hidden_size
    gen = torch.Generator(device="cuda").manual_seed(prompt_seed)
    embeds = (torch.randn((prompt_len, D), device="cuda", generator=gen) * 0.05).to(torch.bfloat16)
    trailing = (torch.randn((4, D), device="cuda", generator=gen) * 0.05).to(torch.bfloat16)
    pad = (torch.randn(D, device="cuda", generator=gen) * 0.05).to(torch.bfloat16)
    st = backend.new_state(max_positions=prompt_len + frames + 2, params=params, seed=seed, trailing=trailing, pad_vec=pad)
    backend.prefill(st, embeds)
    return st


GREEDY = SamplingParams(do_sample=False, subtalker_do_sample=False)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm())


@torch.no_grad()
def torch_predictor_hidden(talker, h, codes):
    """Post-norm predictor hidden states at positions 0..15 for a frame with the given codes."""
    from pipecat_qwen_fast.layers import KVCache

    cp = talker.code_predictor
    cache = KVCache(cp.cfg.stack, cp.cfg.num_code_groups, h.device, h.dtype)
    x = torch.stack([h, talker.embed_codec(codes[0].view(1))[0]])
    outs = [cp.model(cp.small_to_mtp_projection(x), cache)]
    for g in range(2, talker.cfg.num_code_groups):
        e = cp.model.codec_embedding[g - 2](codes[g - 1].view(1))
        outs.append(cp.model(cp.small_to_mtp_projection(e), cache))
    return torch.cat(outs)


def replica_for(ref, talker, ms):
    """A replica decoder starting from the same torch prefill as megakernel state `ms`."""
    return ref.ReplicaDecoder(talker, ms.talker_cache.k, ms.talker_cache.v, ms.talker_cache.length,
                              ms.buffers["hidden"], ms.trailing, ms.pad_vec)


# Measured noise floor (H200, random 0.6B, see bench/NOTES.md "Megakernel"): the torch modules
# themselves sit 1.3e-2 from the exact-sum replica after one 28-layer step (SDPA rounds attention
# probabilities to bf16), and any two bf16 implementations that only sum in another order drift
# apart by ~1.5e-2 over 500 teacher-forced frames of this random model, which flips ~3-4 % of
# argmaxes at near-ties. The bars (1e-2, 99 %) are reported by the bench next to these.
TF_HIDDEN_BAR = 2.5e-2
TF_AGREEMENT_BAR = 0.95


@needs_gpu
@pytest.mark.gpu
@pytest.mark.slow
def test_teacher_forced_against_replica(backends):
    """500 teacher-forced frames against the torch replica of the kernel's math (cuda/reference.py:
    fp32 sums, bf16 at the torch modules' rounding points)."""
    ref = load_reference()
    talker, cfg, tb, mb = backends
    ms = start(mb, talker, GREEDY, TF_FRAMES)
    rep = replica_for(ref, talker, ms)
    agree = total = 0
    worst_talker = worst_pred = 0.0
    for t in range(TF_FRAMES):
        ref_codes = rep.decode_frame()
        codes = mb.decode_frame(ms, force=ref_codes)
        worst_talker = max(worst_talker, rel_err(ms.buffers["hidden"], rep.hidden))
        if t % 25 == 0:
            worst_pred = max(worst_pred, rel_err(ms.buffers["pred_hidden"][1:], rep.pred_hidden[1:]))
        agree += int((codes == ref_codes).sum())
        total += codes.numel()
    print(f"vs replica: talker hidden rel err max {worst_talker:.2e}; predictor {worst_pred:.2e}; "
          f"argmax agreement {agree / total:.4f}")
    assert worst_talker < TF_HIDDEN_BAR
    assert worst_pred < TF_HIDDEN_BAR
    assert agree / total >= TF_AGREEMENT_BAR


@needs_gpu
@pytest.mark.gpu
@pytest.mark.slow
def test_teacher_forced_against_torch_backend(backends):
    """Against TorchBackend itself. Its SDPA rounds attention probabilities to bf16 and its GEMMs
    sum in another order, so it sits ~1.3e-2 (28 layers, random weights) from the exact-sum
    replica on its own (see test_kernel_stream_matches_phase_reference); the bars here allow for
    that noise."""
    talker, cfg, tb, mb = backends
    ts = start(tb, talker, GREEDY, TF_FRAMES)
    ms = start(mb, talker, GREEDY, TF_FRAMES)
    agree = total = 0
    worst_talker = worst_pred = 0.0
    for t in range(TF_FRAMES):
        ref_codes = tb.decode_frame(ts)
        ref_hidden = ts.hidden.clone()
        codes = mb.decode_frame(ms, force=ref_codes)
        worst_talker = max(worst_talker, rel_err(ms.buffers["hidden"], ref_hidden))
        if t % 25 == 0:
            ref_pred = torch_predictor_hidden(talker, ref_hidden, ref_codes)
            worst_pred = max(worst_pred, rel_err(ms.buffers["pred_hidden"][1:], ref_pred[1:]))
        agree += int((codes == ref_codes).sum())
        total += codes.numel()
    print(f"vs TorchBackend: talker hidden rel err max {worst_talker:.2e}; predictor {worst_pred:.2e}; "
          f"argmax agreement {agree / total:.4f}")
    assert worst_talker < TF_HIDDEN_BAR
    assert worst_pred < TF_HIDDEN_BAR
    assert agree / total >= TF_AGREEMENT_BAR


@torch.no_grad()
def torch_module_step(talker, x, kc, vc, pos, layers):
    """The torch modules' own path (cuBLAS, SDPA) for one position through the first `layers`."""
    from pipecat_qwen_fast.layers import KVCache, rotary_cos_sin

    stack = talker.model
    cache = KVCache(stack.cfg, kc.shape[2], x.device, torch.bfloat16)
    cache.k.copy_(kc)
    cache.v.copy_(vc)
    cos, sin = rotary_cos_sin(torch.tensor([pos], device=x.device), 128, stack.cfg.rope_theta, torch.bfloat16)
    y = x[None]
    for i in range(layers):
        y = stack.layers[i](y, cos, sin, cache, i, pos)
    return stack.norm(y)[0]


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("prompt_len", [PROMPT_LEN, 100], ids=["local-attention", "split-attention"])
def test_kernel_stream_matches_phase_reference(backends, prompt_len):
    """Talker steps of 1..28 layers against cuda/reference.py's phase-by-phase replica (same
    roundings, fp32 sums), at a position below 16 (attention inside every block) and at 100
    (attention split over position chunks and merged). The torch modules' own error against the
    same replica is the noise floor: the kernel must stay within it."""
    ref = load_reference()
    talker, cfg, tb, mb = backends
    freq = ref.inv_freq(cfg.talker.stack.rope_theta, "cuda")
    rows = []
    for layers in (1, 2, 4, 8, 16, 28):
        ms = start(mb, talker, GREEDY, 4, prompt_len=prompt_len)
        ms.model.talker.num_layers = layers
        mb.decode_frame(ms)  # frame 0: head only
        kc, vc = ms.talker_cache.k.clone(), ms.talker_cache.v.clone()
        pos = ms.talker_cache.length
        x = ms.buffers["pending"].clone()
        mb.decode_frame(ms)
        _, hidden = ref.stack_step(talker.model, x, kc.clone(), vc.clone(), pos, freq, layers=layers)
        torch_hidden = torch_module_step(talker, x, kc, vc, pos, layers)
        rows.append((layers, rel_err(ms.buffers["hidden"], hidden), rel_err(torch_hidden, hidden)))
        mb.release(ms)
    for layers, k_err, t_err in rows:
        print(f"pos {prompt_len} layers {layers:2d}: kernel vs replica {k_err:.2e}, torch modules vs replica {t_err:.2e}")
    assert rows[0][1] < 3e-3
    for layers, k_err, t_err in rows:
        assert k_err <= 2 * t_err + 2e-3, f"{layers} layers: kernel error {k_err:.2e} vs torch {t_err:.2e}"


@needs_gpu
@pytest.mark.gpu
def test_greedy_frames(backends):
    """Greedy decoding is deterministic (two runs, 50 frames, identical codes), and the first
    frame's code 0 (same hidden state, head and rules in both) equals the replica's."""
    ref = load_reference()
    talker, cfg, tb, mb = backends
    runs = []
    for _ in range(2):
        ms = start(mb, talker, GREEDY, GREEDY_FRAMES)
        if not runs:
            rep = replica_for(ref, talker, ms)
        runs.append(torch.stack([mb.decode_frame(ms).clone() for _ in range(GREEDY_FRAMES)]))
    assert torch.equal(runs[0], runs[1])
    replica = torch.stack([rep.decode_frame() for _ in range(GREEDY_FRAMES)])
    same = (replica == runs[0]).all(dim=1)
    first_diff = int((~same).nonzero()[0]) if not bool(same.all()) else None
    print(f"greedy vs replica: first differing frame {first_diff}; identical frames {int(same.sum())}/{GREEDY_FRAMES}")
    assert int(replica[0, 0]) == int(runs[0][0, 0])


def sampled_frames(mb, talker, params, frames, seed):
    st = start(mb, talker, params, frames, seed=seed)
    out = []
    for _ in range(frames):
        seen = st.buffers["seen"].clone().bool()
        codes = mb.decode_frame(st)
        out.append((codes.clone(), st.buffers["logits"].clone(), st.buffers["pred_logits"].clone(), seen, st.frame - 1))
    return out


@needs_gpu
@pytest.mark.gpu
def test_sampling_respects_suppression_and_top_k(backends):
    from pipecat_qwen_fast.sampling import process_talker_logits

    talker, cfg, tb, mb = backends
    k = 5
    params = SamplingParams(do_sample=True, top_k=k, subtalker_do_sample=True, subtalker_top_k=k)
    eos, vocab = cfg.talker.codec_eos_id, cfg.talker.vocab_size
    suppress = talker_suppress_mask(vocab, eos, torch.device("cuda"))
    distinct = set()
    for codes, logits, pred_logits, seen, frame in sampled_frames(mb, talker, params, 60, seed=3):
        c0 = int(codes[0])
        assert c0 < 2048 or c0 == eos, f"suppressed id {c0} sampled"
        processed = process_talker_logits(logits, seen, suppress, frame, eos, params) / params.temperature
        assert int((processed > processed[c0]).sum()) < k, "code 0 outside the top-k"
        if c0 == eos:
            break
        for g in range(1, 16):
            c = int(codes[g])
            assert 0 <= c < 2048
            assert int((pred_logits[g - 1] > pred_logits[g - 1][c]).sum()) < k, f"group {g} outside the top-k"
            distinct.add(c)
    assert len(distinct) > 16, "sampling looks degenerate"


@needs_gpu
@pytest.mark.gpu
def test_top_p_keeps_the_nucleus(backends):
    talker, cfg, tb, mb = backends
    top_p = 0.3
    params = SamplingParams(do_sample=True, top_k=0, top_p=top_p, subtalker_do_sample=True, subtalker_top_k=0,
                            subtalker_top_p=top_p)
    for codes, logits, pred_logits, seen, frame in sampled_frames(mb, talker, params, 20, seed=5):
        for g in range(1, 16):
            probs = (pred_logits[g - 1] / params.subtalker_temperature).softmax(-1)
            c = int(codes[g])
            # mass strictly above the sampled id must be below top_p (it belongs to the nucleus)
            assert float(probs[probs > probs[c]].sum()) < top_p + 1e-4


@needs_gpu
@pytest.mark.gpu
def test_same_seed_same_codes(backends):
    talker, cfg, tb, mb = backends
    params = SamplingParams()
    a = [c for c, *_ in sampled_frames(mb, talker, params, 10, seed=11)]
    b = [c for c, *_ in sampled_frames(mb, talker, params, 10, seed=11)]
    c = [c for c, *_ in sampled_frames(mb, talker, params, 10, seed=12)]
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for x, y in zip(a, c))
