"""Streamed text on the GPU paths (marker gpu): the megakernel and the batch (CUDA-graph) backend
on a random full-size 0.6B CustomVoice checkpoint give a streamed turn the codes of its whole
text in dual-track mode, greedy and seeded.

The megakernel runs one session per launch, so any arrival of the text and any mix of sessions
compare. The batch rounds differently for different batch sizes in bf16 (tests/test_service.py),
as it does for whole texts: its multi-session check keeps every round's batch the same as the
whole texts' (a round runs once every live turn has its next frame's text).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from pipecat_qwen_fast import QwenTTSEngine, SynthesisRequest

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="no CUDA GPU: streamed-text GPU tests skipped"
    ),
]

TEXTS = [
    "Hello there, this turn is streamed into the megakernel token by token. Then it ends!",
    "Numbers 12,345 and 6.5%, a newline\nand 你好，世界。 The end?",
    "Short one.",
]


@pytest.fixture(scope="module")
def full_checkpoint(tmp_path_factory):
    from pipecat_qwen_fast.checkpoints.build import build_checkpoint

    path = tmp_path_factory.mktemp("ckpt-0.6b")
    # EOS row zeroed: turns run to max_frames, so both sides decode the same number of frames.
    build_checkpoint(path, "0.6b", "custom_voice", seed=0, zero_eos=True, dtype="bfloat16")
    return path


def engine_for(path, backend: str) -> QwenTTSEngine:
    engine = QwenTTSEngine.from_pretrained(path, device="cuda", backend=backend, progress=False)
    finish = getattr(engine, "finish_warmup", None)
    if finish is not None:
        finish()
    return engine


@pytest.fixture(scope="module")
def megakernel(full_checkpoint):
    engine = engine_for(full_checkpoint, "megakernel")
    assert engine.backend.name == "megakernel"
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def batch(full_checkpoint):
    engine = engine_for(full_checkpoint, "torch")
    assert getattr(engine.backend, "decode_frames", None) is not None
    yield engine
    engine.close()


def split(rng: random.Random, text: str, n: int) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(n, len(text) - 1)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def whole_codes(engine, text: str, **kw) -> np.ndarray:
    kw = {k: v for k, v in kw.items() if k != "vocode"}  # generate_codes never vocodes
    return engine.generate_codes(text, text_mode="dual_track", **kw).cpu().numpy()


def codes_of(s) -> np.ndarray:
    return np.stack(s.codes)


def drive_many(engine, sessions, parts, rng: random.Random, lockstep: bool) -> None:
    """Feed each session's parts at random moments between rounds of step_many. `lockstep`: a
    round runs only when every live session can decode (text is added to those that wait)."""
    while not all(s.done for s in sessions):
        for s, p in zip(sessions, parts, strict=True):
            if p and rng.random() < 0.4:
                engine.append_text(s, p.pop(0))
                if not p:
                    engine.end_text(s)
        if lockstep:
            for s, p in zip(sessions, parts, strict=True):
                while not s.done and engine.poll_text(s) is not None:
                    assert p, "a turn waits with no text left to give it"
                    engine.append_text(s, p.pop(0))
                    if not p:
                        engine.end_text(s)
        results = engine.step_many(sessions)
        assert not any(isinstance(r, Exception) for r in results), results


@pytest.mark.parametrize("sampling", [{"greedy": True}, {"seed": 5}], ids=["greedy", "seeded"])
def test_megakernel_streamed_turns_equal_whole_texts(megakernel, sampling):
    rng = random.Random(1)
    kws = [
        dict(voice=v, max_frames=40, vocode=False, **sampling) for v in ("ryan", "serena", "aiden")
    ]
    wholes = [whole_codes(megakernel, t, **kw) for t, kw in zip(TEXTS, kws, strict=True)]
    for pieces in (4, 30):
        # One at a time, then three together with their text arriving at different moments.
        for text, kw, whole in zip(TEXTS, kws, wholes, strict=True):
            s = megakernel.open_text_session(SynthesisRequest("", **kw))
            drive_many(megakernel, [s], [split(rng, text, pieces)], rng, lockstep=False)
            assert np.array_equal(codes_of(s), whole), (text, pieces)
        sessions = [megakernel.open_text_session(SynthesisRequest("", **kw)) for kw in kws]
        drive_many(
            megakernel, sessions, [split(rng, t, pieces) for t in TEXTS], rng, lockstep=False
        )
        for s, whole in zip(sessions, wholes, strict=True):
            assert np.array_equal(codes_of(s), whole), pieces


def test_megakernel_streamed_audio(megakernel):
    """With the vocoder (graphs, chunks sent early while waiting): the whole text's codes, and its
    audio but for the bf16 vocoder's rounding, which differs between chunk sizes (measured on the
    H200: 5 % relative L2 on this random checkpoint's audio against 25-frame chunks)."""
    rng = random.Random(2)
    kw = {"voice": "ryan", "seed": 3, "max_frames": 30}
    whole = megakernel.synthesize(TEXTS[0], text_mode="dual_track", **kw)
    s = megakernel.open_text_session(SynthesisRequest("", **kw))
    chunks = []
    parts = split(rng, TEXTS[0], 25)
    while not s.done:
        sent = megakernel.poll_text(s)
        chunks += sent or []
        if parts and (sent is not None or rng.random() < 0.3):
            megakernel.append_text(s, parts.pop(0))
            if not parts:
                megakernel.end_text(s)
            continue
        chunks += megakernel.step(s)
    assert np.array_equal(codes_of(s), whole.codes)
    pcm = np.concatenate([c.pcm for c in chunks])
    assert len(pcm) == len(whole.pcm)
    a, b = pcm.astype(np.float64), whole.pcm.astype(np.float64)
    assert np.linalg.norm(a - b) <= 0.1 * np.linalg.norm(b)


@pytest.mark.parametrize("sampling", [{"greedy": True}, {"seed": 7}], ids=["greedy", "seeded"])
def test_batch_streamed_turn_equals_whole_text(batch, sampling):
    """One turn alone (batches of one whatever it waits for), any arrival of its text."""
    rng = random.Random(3)
    for text in TEXTS:
        kw = dict(voice="ryan", max_frames=36, vocode=False, **sampling)
        whole = whole_codes(batch, text, **kw)
        s = batch.open_text_session(SynthesisRequest("", **kw))
        drive_many(batch, [s], [split(rng, text, 12)], rng, lockstep=False)
        assert np.array_equal(codes_of(s), whole), text


def test_batch_rounds_of_streamed_turns_equal_whole_texts(batch):
    """Three turns in batched rounds, each round the batch the whole texts ran in."""
    rng = random.Random(4)
    kws = [
        {"voice": v, "seed": 10 + i, "max_frames": 32, "vocode": False}
        for i, v in enumerate(("ryan", "vivian", "eric"))
    ]
    whole_sessions = [
        batch.open_session(SynthesisRequest(t, text_mode="dual_track", **kw))
        for t, kw in zip(TEXTS, kws, strict=True)
    ]
    while not all(s.done for s in whole_sessions):
        batch.step_many(whole_sessions)
    sessions = [batch.open_text_session(SynthesisRequest("", **kw)) for kw in kws]
    # The prefills: one each, as the whole texts' were (opened one by one).
    parts = [split(rng, t, 10) for t in TEXTS]
    for s, p in zip(sessions, parts, strict=True):
        while not s.feed.begun:
            batch.append_text(s, p.pop(0))
            batch.poll_text(s)
    drive_many(batch, sessions, parts, rng, lockstep=True)
    for s, w in zip(sessions, whole_sessions, strict=True):
        assert np.array_equal(codes_of(s), codes_of(w))


def prompted_state(engine, text: str, params, seed: int, frames: int):
    from pipecat_qwen_fast.model.prompt import DUAL_TRACK, build_prompt

    prompt = build_prompt(
        engine.model.talker, engine.tokenizer, engine.config, text=text, speaker="ryan",
        language="english", instruct=None, text_mode=DUAL_TRACK, voice_clone=None,
    )
    st = engine.backend.new_state(
        max_positions=prompt.embeds.shape[0] + frames + 2, params=params, seed=seed,
        trailing=prompt.trailing, pad_vec=prompt.pad_vec,
    )
    engine.backend.prefill(st, prompt.embeds)
    return st


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_megakernel_preview_is_frame_0(megakernel, sampled):
    """preview_frame (frame 0 without the talker step and without the next input, then the next
    input made by torch) gives a state bit for bit the same as frame 0 run whole: the same codes,
    the same next input and code-0 set, and the same frames after it."""
    from pipecat_qwen_fast.model.sampling import SamplingParams

    params = SamplingParams(do_sample=sampled, subtalker_do_sample=sampled)
    mb = megakernel.backend
    text = "Hello there, the first frame comes from the prefill."
    a = prompted_state(megakernel, text, params, seed=9, frames=12)
    b = prompted_state(megakernel, text, params, seed=9, frames=12)
    preview = mb.preview_frame(a).clone()
    assert a.frame == 0 and not a.buffers["seen"].any()
    assert torch.equal(mb.preview_frame(a), preview)  # made once
    assert torch.equal(mb.decode_frame(a), preview)
    assert torch.equal(mb.decode_frame(b), preview)
    assert torch.equal(a.buffers["pending"], b.buffers["pending"])
    assert torch.equal(a.buffers["seen"], b.buffers["seen"])
    for _ in range(10):
        assert torch.equal(mb.decode_frame(a), mb.decode_frame(b))
    mb.release(a)
    mb.release(b)


@pytest.mark.parametrize(
    "first",
    [["Hello", ","], ["Hel", "lo", ","], ["Hello, ", "there"]],
    ids=["guessed", "guessed-wrong", "both-final"],
)
@pytest.mark.parametrize("sampling", [{"greedy": True}, {"seed": 6}], ids=["greedy", "seeded"])
def test_megakernel_first_token_alone(megakernel, first, sampling):
    """The first token final before the second: frame 0's audio goes out from its preview (and,
    guessed right, from the prefill made with the guess), the turn's codes and audio are the
    whole text's."""
    text = "Hello, there: the first frame is spoken before the second token is final."
    kw = dict(voice="ryan", max_frames=24, **sampling)
    whole = megakernel.synthesize(text, text_mode="dual_track", **kw)
    s = megakernel.open_text_session(SynthesisRequest("", **kw))
    chunks = []
    for part in first:
        megakernel.append_text(s, part)
        chunks += megakernel.poll_text(s) or []
    if first[-1] == ",":  # "Hello" final, "," not yet: frame 0 was sent
        assert s.frames_decoded == 1 and [c.num_frames for c in chunks] == [1]
        assert s.feed.previewed
    megakernel.append_text(s, text[len("".join(first)) :])
    megakernel.end_text(s)
    while not s.done:
        sent = megakernel.poll_text(s)
        chunks += sent if sent is not None else megakernel.step(s)
    assert np.array_equal(codes_of(s), whole.codes)
    pcm = np.concatenate([c.pcm for c in chunks])
    assert len(pcm) == len(whole.pcm)
    a, b = pcm.astype(np.float64), whole.pcm.astype(np.float64)
    assert np.linalg.norm(a - b) <= 0.1 * np.linalg.norm(b)


@pytest.mark.parametrize("stale", [False, True], ids=["kept", "another-call-between"])
def test_megakernel_guessed_frame_0_audio(megakernel, stale):
    """A right guess at the first token: frame 0's audio, made during the LLM's interval
    (text_first_frame.speculate), goes out with no vocoder call once the token is final, and is
    bit for bit the audio frame 0 gets without a guess. If another call of the same vocoder graph
    ran in between (another turn's one-frame chunk), that early audio is dropped and made anew."""
    text = "Hello, the first audio is made before the first token is final."
    kw = dict(voice="ryan", max_frames=6, greedy=True)
    whole = megakernel.synthesize(text, text_mode="dual_track", first_chunk_frames=1, **kw)
    graphs = megakernel.vocoder_graphs
    s = megakernel.open_text_session(SynthesisRequest("", **kw))
    megakernel.append_text(s, "Hello")
    assert megakernel.poll_text(s) == []  # not final: nothing sent, the guess prefilled
    assert s.early is not None and s.feed.guess is not None
    runs = graphs.entries[1].runs
    if stale:
        other = megakernel.open_text_session(SynthesisRequest("", voice="serena", max_frames=4, greedy=True))
        megakernel.append_text(other, "Another turn speaks first.")
        megakernel.end_text(other)
        while other.frames_decoded < 1:
            sent = megakernel.poll_text(other)
            if sent is None:
                megakernel.step(other)
        megakernel.cancel(other)
        assert graphs.entries[1].runs > runs
        runs = graphs.entries[1].runs
    megakernel.append_text(s, ",")
    chunks = megakernel.poll_text(s)
    assert [c.num_frames for c in chunks] == [1]
    assert graphs.entries[1].runs == runs + (1 if stale else 0)
    assert np.array_equal(chunks[0].pcm, whole.pcm[: len(chunks[0].pcm)])
    megakernel.append_text(s, text[len("Hello,") :])
    megakernel.end_text(s)
    while not s.done:
        sent = megakernel.poll_text(s)
        chunks += sent if sent is not None else megakernel.step(s)
    assert np.array_equal(codes_of(s), whole.codes)


def test_auto_backend_previews_on_its_megakernel(full_checkpoint):
    """The default backend: a lone streamed turn runs on its megakernel side, which previews frame
    0; codes equal the whole text's on the same backend."""
    engine = engine_for(full_checkpoint, "auto")
    try:
        if not hasattr(engine.backend, "fast"):
            pytest.skip(f"auto picked {engine.backend.name} here")
        rng = random.Random(8)
        for text in TEXTS[:2]:
            kw = {"voice": "serena", "max_frames": 30, "vocode": False, "seed": 2}
            whole = whole_codes(engine, text, **kw)
            s = engine.open_text_session(SynthesisRequest("", **kw))
            engine.append_text(s, text[:5])
            engine.poll_text(s)
            assert s.state.on_fast and s.feed.guess is not None
            parts = split(rng, text[5:], 10)
            drive_many(engine, [s], [parts], rng, lockstep=False)
            assert np.array_equal(codes_of(s), whole), text
    finally:
        engine.close()
