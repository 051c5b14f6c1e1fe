"""Cloned voices on the GPU paths (marker gpu): an in-context (ICL: reference codes and text) and
an x-vector-only voice, made by the engine's encoders from a recording, through the megakernel and
through the batched CUDA-graph backend, against the fp32 PyTorch reference on a random full-size
0.6B Base checkpoint.

"Equal" is as in the existing GPU tests. The megakernel computes in fp32 on the bf16 weights, so
its reference is the eager backend in fp32 on the same weight values, started from the same
prefill (tests/test_megakernel.py, test_greedy_frames): greedy codes identical in every frame. The
batch backend is the served path's code (captured graphs of the compiled layer step); in bf16 it
rounds differently for different batch sizes (tests/test_service.py), so here it runs in fp32,
where it must give the fp32 reference's greedy codes too. On random weights the argmax margins are
tiny: a test that fails prints the first differing frame, so a single late flip (fp32 rounding)
can be told from a voice that does not reach the decoder (codes apart from the first frames on).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipecat_qwen_fast import QwenTTSEngine, SynthesisRequest
from pipecat_qwen_fast.bench.voice_clone import synthetic_speech
from pipecat_qwen_fast.model.prompt import build_prompt, resolve_language, resolve_voice
from pipecat_qwen_fast.model.sampling import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="no CUDA GPU: cloned-voice GPU tests skipped"
    ),
]

REF_TEXT = "This is the reference recording that the voice is cloned from."
TEXTS = [
    "Hello there, this is a cloned voice speaking through the fast path.",
    "A second caller, with other words to say.",
    "Short one.",
]
GREEDY_FRAMES = 50  # as tests/test_megakernel.py
ENGINE_FRAMES = 40


@pytest.fixture(scope="module")
def base_checkpoint(tmp_path_factory):
    from pipecat_qwen_fast.checkpoints.build import build_checkpoint

    path = tmp_path_factory.mktemp("ckpt-0.6b-base")
    # EOS row zeroed: every run decodes to its frame cap, so both sides decode the same frames.
    build_checkpoint(path, "0.6b", "base", seed=0, zero_eos=True, dtype="bfloat16")
    return path


def load(path, backend: str, dtype: str = "auto") -> QwenTTSEngine:
    # No warm-up: graphs are captured at first use, the compiled ones as the warm-up would.
    return QwenTTSEngine.from_pretrained(path, device="cuda", dtype=dtype, backend=backend,
                                         warmup=False, progress=False)


@pytest.fixture(scope="module")
def reference(base_checkpoint):
    engine = load(base_checkpoint, "eager", "float32")
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def voices(reference):
    """An ICL and an x-vector voice from 4 s of speech-like audio, by the engine's encoders."""
    icl = reference.create_voice(synthetic_speech(4.0, seed=1), ref_text=REF_TEXT,
                                 sample_rate=24000, register=False)
    xvec = reference.create_voice(synthetic_speech(4.0, seed=2), sample_rate=24000, register=False)
    assert icl.mode == "icl" and xvec.mode == "x_vector"
    assert icl.prompt.ref_codes.shape == (50, 16)  # 4 s of reference frames in the prompt
    return {"icl": icl, "x_vector": xvec}


@pytest.fixture(scope="module")
def megakernel(base_checkpoint):
    engine = load(base_checkpoint, "megakernel")
    assert engine.backend.name == "megakernel"
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def batch32(base_checkpoint):
    engine = load(base_checkpoint, "torch", "float32")
    assert getattr(engine.backend, "decode_frames", None) is not None, engine.backend.name
    yield engine
    engine.close()


def first_difference(got: np.ndarray, want: np.ndarray) -> str:
    same = (got == want).all(axis=1)
    if same.all():
        return "none"
    t = int(np.flatnonzero(~same)[0])
    return (f"frame {t} of {len(same)} ({int(same.sum())} frames identical): "
            f"{got[t].tolist()} vs reference {want[t].tolist()}")


def prompt_inputs(engine: QwenTTSEngine, voice, text: str):
    """The cloned voice's prompt as the engine builds it (dual-track, the Base default), its values
    rounded to bf16: the megakernel reads the text vectors in bf16, so both sides get these."""
    cfg = engine.config
    vc = voice.prompt
    with torch.no_grad():
        prompt = build_prompt(engine.model.talker, engine.tokenizer, cfg, text=text,
                              speaker=resolve_voice(cfg, None, vc),
                              language=resolve_language(cfg, "english"), instruct=None,
                              text_mode="dual_track", voice_clone=vc)
    inputs = (prompt.embeds, prompt.trailing, prompt.pad_vec)
    return tuple(x.to(torch.bfloat16).float() for x in inputs)


@pytest.mark.parametrize("mode", ["icl", "x_vector"])
def test_megakernel_decodes_a_cloned_voice_as_the_fp32_reference(reference, megakernel, voices,
                                                                  mode):
    """The cloned voice's own prompt (the reference's fp32 prefill of it, loaded into the kernel):
    50 free-running greedy frames, the kernel's codes equal the fp32 reference's in every frame."""
    tb, mb = reference.backend, megakernel.backend
    embeds, trailing, pad = prompt_inputs(reference, voices[mode], TEXTS[0])
    if mode == "icl":
        assert embeds.shape[0] > voices["icl"].prompt.ref_codes.shape[0]  # the reference frames
    params = SamplingParams.from_defaults(reference.generation).validated().greedy()
    n = embeds.shape[0] + GREEDY_FRAMES + 2
    ts = tb.new_state(max_positions=n, params=params, seed=0, trailing=trailing, pad_vec=pad)
    tb.prefill(ts, embeds)
    ms = mb.new_state(max_positions=n, params=params, seed=0, trailing=trailing, pad_vec=pad)
    mb.load_prefill(ms, ts.talker_cache.k, ts.talker_cache.v, ts.talker_cache.length, ts.hidden)
    want = torch.stack([tb.decode_frame(ts).clone() for _ in range(GREEDY_FRAMES)]).cpu().numpy()
    got = torch.stack([mb.decode_frame(ms).clone() for _ in range(GREEDY_FRAMES)]).cpu().numpy()
    tb.release(ts)
    mb.release(ms)
    diff = first_difference(got, want)
    print(f"{mode}: megakernel vs fp32 reference, first difference: {diff}")
    assert diff == "none"


@pytest.mark.parametrize("mode", ["icl", "x_vector"])
def test_megakernel_engine_speaks_a_cloned_voice(megakernel, voices, mode):
    """The engine's own path on the megakernel (its bf16 prefill, the vocoder primed with an ICL
    voice's reference frames): every frame to the cap, the same codes run after run, and audio
    of the codes' length whose chunks make the whole utterance's audio."""
    voice = voices[mode]
    kw = {"voice": voice, "greedy": True, "max_frames": ENGINE_FRAMES}
    a = megakernel.generate_codes(TEXTS[0], **kw).numpy()
    b = megakernel.generate_codes(TEXTS[0], **kw).numpy()
    assert a.shape == (ENGINE_FRAMES, 16) and np.array_equal(a, b)
    other = voices["x_vector" if mode == "icl" else "icl"]
    b = megakernel.generate_codes(TEXTS[0], **{**kw, "voice": other}).numpy()
    assert not np.array_equal(a, b)  # the voice reaches the decoder
    result = megakernel.synthesize(TEXTS[0], **kw)
    assert np.array_equal(result.codes, a)
    assert len(result.pcm) == ENGINE_FRAMES * 1920 and np.abs(result.pcm).max() > 0
    chunks = list(megakernel.stream(TEXTS[0], **kw))
    pcm = np.concatenate([c.pcm for c in chunks]).astype(np.float64)
    # Chunked and whole differ only by the bf16 vocoder's rounding for other chunk sizes
    # (tests/test_text_gpu.py: test_megakernel_streamed_audio).
    whole = result.pcm.astype(np.float64)
    assert len(pcm) == len(whole) and np.linalg.norm(pcm - whole) <= 0.1 * np.linalg.norm(whole)


@pytest.mark.parametrize("mode", ["icl", "x_vector"])
def test_batch_backend_speaks_a_cloned_voice_as_the_fp32_reference(reference, batch32, voices,
                                                                   mode):
    """One call on the batch backend's captured graphs (fp32), the engine's whole path from the
    request: its greedy codes equal the fp32 reference engine's."""
    kw = {"voice": voices[mode], "greedy": True, "max_frames": ENGINE_FRAMES}
    want = reference.generate_codes(TEXTS[0], **kw).numpy()
    got = batch32.generate_codes(TEXTS[0], **kw).numpy()
    assert want.shape == (ENGINE_FRAMES, 16)
    diff = first_difference(got, want)
    print(f"{mode}: batch (fp32) vs fp32 reference, first difference: {diff}")
    assert diff == "none"


def test_batched_round_of_cloned_voices_equals_each_alone(reference, batch32, voices):
    """An ICL voice, an x-vector voice and the ICL voice again with other words, decoded together
    in one batched frame a round (step_many): each call's greedy codes are the fp32 reference's
    for that call alone."""
    calls = [(TEXTS[0], voices["icl"]), (TEXTS[1], voices["x_vector"]), (TEXTS[2], voices["icl"])]
    frames = 24
    sessions = [batch32.open_session(SynthesisRequest(text, voice=voice, greedy=True,
                                                      max_frames=frames, vocode=False))
                for text, voice in calls]
    rounds = 0
    while not all(s.done for s in sessions):
        results = batch32.step_many(sessions)
        assert not any(isinstance(r, Exception) for r in results), results
        rounds += 1
    assert rounds == frames  # every round decoded all three: one batched frame each
    for (text, voice), s in zip(calls, sessions, strict=True):
        want = reference.generate_codes(text, voice=voice, greedy=True, max_frames=frames).numpy()
        diff = first_difference(np.stack(s.codes), want)
        print(f"{voice.mode} {text[:20]!r}: batched round vs fp32 reference alone, first "
              f"difference: {diff}")
        assert diff == "none"
