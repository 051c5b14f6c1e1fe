"""The megakernel path's prefill in fp32 (issue 34, item 5): a single call's greedy codes from text
are the eager fp32 engine's.

The kernel computes in fp32 on the bf16 weights; so do its prefill (backends/prefill_graphs.py,
`prefill_layer_fp32`) and the prompt's vectors (model/prompt.py, the talker's `prompt_dtype`), and
the kernel adds the text vectors in fp32. On CPU: the exact products, the fp32 layer step and the
prompt against the fp32 model's own. On a GPU (marker gpu): the engine with the megakernel, each
fp32 prefill mode and the auto backend, against the eager fp32 engine on a random full-size 0.6B
CustomVoice checkpoint (EOS row zeroed, so every call decodes to its frame cap): 8 texts in both
text modes, prompts of every bucket from 16 to 128 positions, every code of 100 frames equal.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from pipecat_qwen_fast import QwenTTSEngine
from pipecat_qwen_fast.backends.prefill_graphs import (
    PrefillGraphs,
    StackOwner,
    exact_linear,
    exact_products_blocker,
    prefill_from_start,
    prefill_layer_fp32,
    split_bf16,
    stack_copy,
)
from pipecat_qwen_fast.bench.texts import UTTERANCES
from pipecat_qwen_fast.model.layers import KVCache, fuse_projections
from pipecat_qwen_fast.model.prompt import (
    DUAL_TRACK,
    PREFILL,
    VoiceClonePrompt,
    build_prompt,
    text_rows,
)
from pipecat_qwen_fast.model.sampling import SamplingParams

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(),
                               reason="no CUDA GPU: the megakernel's fp32 prefill GPU tests skipped")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


# ---------------------------------------------------------------------------------------------
# CPU: the exact products, the fp32 layer step, the fp32 prompt


def test_split_bf16_terms_sum_to_x_exactly():
    """Three bf16 terms that add up to the fp32 value exactly, over 60 binades, both signs, zero."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 257, generator=g) * torch.exp2(torch.randint(-30, 30, (64, 257), generator=g).float())
    x[0, :5] = torch.tensor([0.0, -0.0, 1.0, -3.0, 1 + 2**-23])
    terms = split_bf16(x)
    assert terms.dtype == torch.bfloat16 and terms.shape == (3 * 64, 257)
    hi, mid, lo = terms.double().chunk(3)
    assert torch.equal(hi + mid + lo, x.double())


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("gcc") is None,
                    reason="no C++ compiler: inductor cannot compile on the CPU")
def test_split_bf16_stays_exact_when_compiled():
    """Compiled by inductor (its C++ backend here; the GPU's Triton one lowers casts alike), the
    terms still sum to x. A cast to bf16 and back inside a fused kernel is computed in fp32 without
    the rounding, which is why the terms are cut by a bit mask."""
    x = torch.randn(40, 300, generator=torch.Generator().manual_seed(4)) * 3
    hi, mid, lo = torch.compile(split_bf16)(x).double().chunk(3)
    assert torch.equal(hi + mid + lo, x.double())


def test_exact_linear_is_the_fp32_product():
    """bf16 weights, fp32 activations: the fp32 product of the upcast weights to fp32 rounding,
    where a bf16 product is off by bf16's."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(19, 256, generator=g)
    w = (torch.randn(96, 256, generator=g) * 0.05).to(torch.bfloat16)
    want = x.double() @ w.double().T
    got = exact_linear(x, w)
    assert got.dtype == torch.float32
    assert rel_err(got, want) < 1e-6
    assert rel_err((x.to(torch.bfloat16) @ w.T).float(), want) > 1e-3
    assert torch.equal(exact_linear(x, w.float()), torch.nn.functional.linear(x, w.float()))


def load_tiny(path, dtype: str) -> QwenTTSEngine:
    return QwenTTSEngine.from_pretrained(path, device="cpu", dtype=dtype, backend="eager", progress=False)


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    """The tiny CustomVoice checkpoint (bf16 values) loaded at bf16 and at fp32."""
    path = tiny_checkpoint("custom_voice")
    engines = load_tiny(path, "bfloat16"), load_tiny(path, "float32")
    yield engines
    for e in engines:
        e.close()


@torch.no_grad()
def test_fp32_layer_step_is_the_fp32_models_prefill(tiny):
    """The fp32 prefill on the bf16 weights (graphs' body and eager), and on an fp32 copy of
    them, against the fp32 model's prefill: K/V rows and last hidden state within fp32 rounding."""
    bf, f32 = (e.model.talker for e in tiny)
    fuse_projections(bf.model)
    owners = {"bf16 weights": StackOwner(bf.cfg, bf.model),
              "fp32 copy": StackOwner(bf.cfg, stack_copy(bf.model, torch.float32))}
    assert owners["fp32 copy"].model.layers[0].self_attn.qkv_weight.dtype == torch.float32
    g = torch.Generator().manual_seed(2)
    for name, owner in owners.items():
        graphs = PrefillGraphs(owner, torch.device("cpu"), torch.float32, buckets=(16, 32),
                               step=prefill_layer_fp32, kind="fp32")
        for b in graphs.buckets:
            graphs.prepare(b)
        for n in (3, 16, 17, 30):
            embeds = (torch.randn(n, bf.cfg.hidden_size, generator=g) * 0.5).to(torch.bfloat16).float()
            want = KVCache(f32.cfg.stack, 40, torch.device("cpu"), torch.float32)
            hidden = f32.model(embeds, want)[-1]
            k, v, h = graphs.run(embeds)
            eager = KVCache(bf.cfg.stack, 40, torch.device("cpu"), torch.float32)
            h_eager = prefill_from_start(owner.model, embeds, eager)
            assert eager.length == n
            for got_k, got_v, got_h in ((k, v, h), (eager.k, eager.v, h_eager)):
                assert got_h.dtype == torch.float32
                assert rel_err(got_h, hidden) < 1e-5, name
                assert rel_err(got_k[:, :, :n], want.k[:, :, :n]) < 1e-5, name
                assert rel_err(got_v[:, :, :n], want.v[:, :, :n]) < 1e-5, name


@torch.no_grad()
def test_one_compiled_fp32_step_serves_every_layer_and_bucket(tiny):
    """The fp32 step traces whole (no graph break) and once for every layer and bucket, as the
    bf16 one does (tests/test_prefill_graphs.py): traced here by dynamo with its eager backend."""
    from torch._dynamo.testing import CompileCounter

    from pipecat_qwen_fast.backends.prefill_graphs import mark_length_dynamic

    talker = tiny[0].model.talker
    fuse_projections(talker.model)
    assert len(talker.model.layers) >= 2
    graphs = PrefillGraphs(StackOwner(talker.cfg, talker.model), torch.device("cpu"), torch.float32,
                           buckets=(16, 32, 64), step=prefill_layer_fp32, kind="fp32")
    counter = CompileCounter()
    step = torch.compile(prefill_layer_fp32, backend=counter, dynamic=None)
    g = torch.Generator().manual_seed(5)
    for b in graphs.buckets:
        embeds = torch.randn(b - 3, talker.cfg.hidden_size, generator=g) * 0.5
        e = graphs.prepare(b)
        plain = [t.clone() for t in graphs.run(embeds)]
        mark_length_dynamic(e)
        graphs._body(e, step)
        for got, want in zip((e["k"], e["v"], e["hidden"]), plain):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert counter.frame_count == 1, counter.frame_count


@torch.no_grad()
def test_fp32_prompt_is_the_fp32_models(tiny, tiny_checkpoint):
    """A bf16 model asked for fp32 prompts (what the megakernel's fp32 prefill asks) builds the
    fp32 model's prompt bit for bit: both text modes, streamed text rows, a cloned voice with
    reference frames. The vectors every prompt shares are made again for the new dtype."""
    bf_engine, f32_engine = tiny
    base = tiny_checkpoint("base")
    bases = load_tiny(base, "bfloat16"), load_tiny(base, "float32")
    g = torch.Generator().manual_seed(3)
    D = bf_engine.config.talker.hidden_size
    voice = VoiceClonePrompt(x_vector=(torch.randn(D, generator=g) * 0.1).to(torch.bfloat16).float(),
                             ref_codes=torch.randint(0, 2048, (5, 16), generator=g),
                             ref_text="This is how the voice sounds.")

    def prompt(engine, mode, vc=None):
        speaker = None if vc is not None else "ryan"
        return build_prompt(engine.model.talker, engine.tokenizer, engine.config, text="Hello there, one two.",
                            speaker=speaker, language="english", instruct=None, text_mode=mode, voice_clone=vc)

    cases = [(bf_engine, f32_engine, mode, None) for mode in (PREFILL, DUAL_TRACK)]
    cases += [(bases[0], bases[1], mode, voice) for mode in (PREFILL, DUAL_TRACK)]
    for low, ref, mode, vc in cases:
        low.model.talker.prompt_dtype = None
        assert prompt(low, mode, vc).embeds.dtype == torch.bfloat16  # memoised at bf16 first
        low.model.talker.prompt_dtype = torch.float32
        got, want = prompt(low, mode, vc), prompt(ref, mode, vc)
        for field in ("embeds", "trailing", "pad_vec", "eos_vec"):
            a, b = getattr(got, field), getattr(want, field)
            assert a.dtype == torch.float32 and torch.equal(a, b), (mode, vc is not None, field)
        ids = low.tokenizer.encode("Streamed text, row by row, in blocks.")
        assert torch.equal(text_rows(low.model.talker, ids, 0, start=3), text_rows(ref.model.talker, ids, 0, start=3))
    for e in bases:
        e.close()


def test_prefill_mode_is_checked(monkeypatch):
    """A wrong prefill mode names the valid ones, before anything is built (no GPU needed)."""
    from pipecat_qwen_fast.backends import megakernel as mk

    with pytest.raises(ValueError, match=r"\['fp32', 'fp32-copy', 'bf16'\], got 'fp16'"):
        mk.MegakernelBackend(None, torch.device("cpu"), torch.bfloat16, prefill="fp16")
    assert mk.prefill_mode(None) == "fp32"
    monkeypatch.setenv("QWEN_FAST_MK_PREFILL", "bf16")
    assert mk.prefill_mode(None) == "bf16" and mk.prefill_mode("fp32-copy") == "fp32-copy"


# ---------------------------------------------------------------------------------------------
# GPU: the engine's codes against the eager fp32 engine's

FRAMES = 100
GREEDY = SamplingParams(do_sample=False, subtalker_do_sample=False)
# (text, text mode): prefill-mode prompts of 15-102 positions (buckets 16, 32, 64, 128 with the
# synthetic tokenizer), dual-track prompts whose text comes one token a frame.
CALLS = [
    (UTTERANCES[0], PREFILL),
    (UTTERANCES[4], PREFILL),
    (UTTERANCES[7], PREFILL),
    (UTTERANCES[13], PREFILL),
    (UTTERANCES[16], PREFILL),
    (UTTERANCES[9], DUAL_TRACK),
    ("Numbers 12,345 and 6.5%, a newline\nand 你好，世界。 The end?", DUAL_TRACK),
    (UTTERANCES[21], DUAL_TRACK),
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU: the megakernel's fp32 prefill GPU tests skipped")
    from pipecat_qwen_fast.checkpoints.build import build_checkpoint

    path = tmp_path_factory.mktemp("ckpt-0.6b")
    build_checkpoint(path, "0.6b", "custom_voice", seed=0, zero_eos=True, dtype="bfloat16")
    return path


def load(path, backend: str, dtype: str = "auto") -> QwenTTSEngine:
    # No engine warm-up (vocoder graphs, batch graphs): the megakernel's own warm-up still captures
    # its prefill graphs, plain (deferred warm-up); `compiled_prefills` compiles them.
    return QwenTTSEngine.from_pretrained(path, device="cuda", dtype=dtype, backend=backend, warmup=False,
                                         progress=False)


def greedy_codes(engine: QwenTTSEngine, text: str, mode: str) -> np.ndarray:
    return engine.generate_codes(text, greedy=True, max_frames=FRAMES, text_mode=mode).numpy()


@pytest.fixture(scope="module")
def reference(checkpoint):
    """The eager fp32 engine, its matrix products at fp32 (TF32 off, the default), and its codes."""
    assert torch.get_float32_matmul_precision() == "highest" and not torch.backends.cuda.matmul.allow_tf32
    engine = load(checkpoint, "eager", "float32")
    codes = [greedy_codes(engine, text, mode) for text, mode in CALLS]
    assert all(c.shape == (FRAMES, 16) for c in codes)
    yield engine, codes
    engine.close()


def megakernel_of(engine: QwenTTSEngine):
    return getattr(engine.backend, "fast", engine.backend)


def compiled_prefills(engine: QwenTTSEngine) -> None:
    """The megakernel's prefill graphs as the engine serves them once warm: compiled, captured."""
    graphs = megakernel_of(engine).prefills
    graphs.compile_plain()
    assert graphs.compile, "the prefill's layer step did not compile (see the warning logged)"
    assert not graphs.plain_buckets and all(e["graph"] is not None for e in graphs.entries.values())


@pytest.fixture(scope="module", params=[("megakernel", "fp32"), ("megakernel", "fp32-copy"), ("auto", "fp32")],
                ids=["megakernel-fp32", "megakernel-fp32-copy", "auto"])
def engine(request, checkpoint):
    backend, mode = request.param
    reason = exact_products_blocker(torch.device("cuda"))
    assert reason is None, f"bf16 products with an fp32 result do not run here ({reason}): fp32 falls back to fp32-copy"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QWEN_FAST_MK_PREFILL", mode)
        engine = load(checkpoint, backend)
    mb = megakernel_of(engine)
    assert mb.name == "megakernel" and mb.prefill_mode == mode and mb.prefills.kind == mode
    compiled_prefills(engine)
    yield engine
    engine.close()


def prompt_of(engine: QwenTTSEngine, text: str, mode: str):
    with torch.no_grad():
        return build_prompt(engine.model.talker, engine.tokenizer, engine.config, text=text,
                            speaker=engine.default_voice, language="auto", instruct=None, text_mode=mode,
                            voice_clone=None)


def first_difference(got: np.ndarray, want: np.ndarray) -> str:
    same = (got == want).all(axis=1)
    if same.all():
        return "none"
    t = int(np.flatnonzero(~same)[0])
    return f"frame {t} ({int(same.sum())} of {len(same)} identical): {got[t].tolist()} vs {want[t].tolist()}"


@needs_gpu
@pytest.mark.gpu
def test_greedy_codes_from_text_are_the_fp32_engines(reference, engine, request):
    """8 texts, one call each: every code of 100 greedy frames equals the eager fp32 engine's."""
    _, want = reference
    started = dict(getattr(engine.backend, "started", {}))
    diffs = []
    for (text, mode), w in zip(CALLS, want, strict=True):
        n = megakernel_of(engine).prefills.bucket_for(prompt_of(engine, text, mode).embeds.shape[0])
        diffs.append((f"{mode} {text[:28]!r} (bucket {n})", first_difference(greedy_codes(engine, text, mode), w)))
    for name, diff in diffs:
        print(f"{request.node.callspec.id}: {name}: first difference {diff}")
    if started:  # the auto backend: every call alone, so on its megakernel
        assert engine.backend.started["fast"] - started["fast"] == len(CALLS)
    assert all(diff == "none" for _, diff in diffs)


@needs_gpu
@pytest.mark.gpu
@torch.no_grad()
def test_prefill_is_the_fp32_models(reference, engine, request):
    """The prompt is the fp32 engine's bit for bit; the prefill's K/V rows and last hidden state,
    captured (compiled, and plain as before the warm-up compiles them) and eager, are the fp32
    engine's to fp32 rounding (the bf16 prefill was ~1 % off: docs/journal/NOTES.md, "The prefill
    compiled")."""
    ref_engine, _ = reference
    tb, mb = ref_engine.backend, megakernel_of(engine)
    plain = PrefillGraphs(mb.prefills.talker, mb.device, torch.float32, buckets=(16, 32, 64, 128),
                          step=prefill_layer_fp32, kind=mb.prefill_mode, compile=False)
    plain.capture_all()
    worst = 0.0
    for text, mode in CALLS[:5]:
        got, want = prompt_of(engine, text, mode), prompt_of(ref_engine, text, mode)
        for field in ("embeds", "trailing", "pad_vec"):
            assert torch.equal(getattr(got, field), getattr(want, field)), (text[:20], field)
        n = want.embeds.shape[0]
        ts = tb.new_state(max_positions=n + 2, params=GREEDY, seed=0, trailing=want.trailing,
                          pad_vec=want.pad_vec)
        tb.prefill(ts, want.embeds)
        ms = mb.new_state(max_positions=n + 2, params=GREEDY, seed=0, trailing=got.trailing,
                          pad_vec=got.pad_vec)
        mb.prefill(ms, got.embeds)
        eager = KVCache(mb.talker.cfg.stack, n, mb.device, torch.float32)
        h_eager = mb._eager_prefill(got.embeds, eager)
        k, v, h = (t.clone() for t in plain.run(got.embeds))
        runs = {"captured": (ms.talker_cache.k, ms.talker_cache.v, ms.buffers["hidden"]),
                "plain graph": (k, v, h), "eager": (eager.k, eager.v, h_eager)}
        for name, (rk, rv, rh) in runs.items():
            errs = (rel_err(rk[:, :, :n], ts.talker_cache.k[:, :, :n]), rel_err(rv[:, :, :n], ts.talker_cache.v[:, :, :n]),
                    rel_err(rh, ts.hidden))
            print(f"{request.node.callspec.id}: {n} positions, {name}: K {errs[0]:.1e}, V {errs[1]:.1e}, "
                  f"hidden {errs[2]:.1e}")
            worst = max(worst, *errs)
        mb.release(ms)
        tb.release(ts)
    assert worst < 1e-4


@needs_gpu
@pytest.mark.gpu
def test_bf16_prefill_parts_from_the_fp32_engine(reference, checkpoint):
    """The switch back (QWEN_FAST_MK_PREFILL=bf16) keeps the bf16 prefill and prompt, and with them
    the codes that part from the fp32 engine's within the first frames (the issue's measurement:
    frames 0-29): the test above can tell the two apart."""
    _, want = reference
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QWEN_FAST_MK_PREFILL", "bf16")
        engine = load(checkpoint, "megakernel")
    try:
        assert engine.backend.prefill_mode == "bf16" and engine.model.talker.prompt_dtype is None
        compiled_prefills(engine)
        diffs = [first_difference(greedy_codes(engine, text, mode), w) for (text, mode), w in zip(CALLS, want)]
        print("bf16 prefill:", "; ".join(diffs))
        assert sum(d != "none" for d in diffs) >= len(CALLS) // 2
    finally:
        engine.close()
