"""The engine on tiny random checkpoints (CPU): streaming, seeding, caps, bad input, CLI."""

from __future__ import annotations

import itertools
import json
import shutil
import subprocess
import sys
import wave

import numpy as np
import pytest
import torch

from pipecat_qwen_fast import (
    ConfigError,
    InvalidInputError,
    ModelLoadError,
    QwenTTSEngine,
    SynthesisRequest,
    UnsupportedFeatureError,
    VoiceClonePrompt,
)
from pipecat_qwen_fast.engine.request import chunk_target, round_budget_ms, schedule_sizes
from pipecat_qwen_fast.engine.text import MAX_SEGMENT_TOKENS, split_text
from pipecat_qwen_fast.vocoder.graphs import GraphedVocoder


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return QwenTTSEngine.from_pretrained(tiny_checkpoint("custom_voice"), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def endless(tiny_checkpoint):
    """EOS row zeroed: utterances run until a cap, so frame counts are predictable."""
    return QwenTTSEngine.from_pretrained(tiny_checkpoint("custom_voice", zero_eos=True), device="cpu",
                                         dtype="float32")


def _assert_still_works(engine):
    chunks = list(engine.stream("Still working.", voice="ryan", seed=1, max_frames=3))
    assert sum(c.num_frames for c in chunks) >= 1


def test_listings(engine):
    assert engine.sample_rate == 24000
    assert engine.model_type == "custom_voice"
    assert engine.voices == sorted(["serena", "vivian", "uncle_fu", "ryan", "aiden", "ono_anna", "sohee", "eric", "dylan"])
    assert engine.languages[0] == "auto"
    assert "english" in engine.languages and "chinese" in engine.languages
    assert not any("dialect" in lang for lang in engine.languages)


def test_stream_chunks_and_equals_whole(endless):
    kw = dict(voice="ryan", language="english", seed=7, max_frames=30)
    chunks = list(endless.stream("Hello there, how are you?", **kw))
    # Default schedule: 1 frame, then 1, then doubling within the frames already sent (2, 4, 8,
    # 16, then 32: the cap, ...); the last chunk holds what is left.
    assert [c.num_frames for c in chunks] == [1, 1, 2, 4, 8, 14]
    assert [c.frame_index for c in chunks] == [0, 1, 2, 4, 8, 16]
    for c in chunks:
        assert c.pcm.dtype == np.int16 and len(c.pcm) == 1920 * c.num_frames
    streamed = np.concatenate([c.pcm for c in chunks])
    whole = endless.synthesize("Hello there, how are you?", **kw)
    assert whole.stop_reason == "frame_cap"
    np.testing.assert_array_equal(np.concatenate([c.codes for c in chunks]), whole.codes)
    # Exact streaming vocoder: chunking does not change the audio beyond int16 rounding.
    assert np.abs(streamed.astype(np.int32) - whole.pcm.astype(np.int32)).max() <= 1
    assert np.abs(streamed).max() > 0


def test_the_doubling_schedule_carries_the_same_audio(endless):
    # chunk_frames=2 with chunk_growth=2 (1, 2, 4, ...: the default before session 35): one chunk
    # fewer, the same codes and audio as the default schedule's.
    kw = {"voice": "ryan", "language": "english", "seed": 7, "max_frames": 30}
    chunks = list(endless.stream("Hello there, how are you?", chunk_frames=2, chunk_growth=2, **kw))
    assert [c.num_frames for c in chunks] == [1, 2, 4, 8, 15]
    assert [c.frame_index for c in chunks] == [0, 1, 3, 7, 15]
    default = list(endless.stream("Hello there, how are you?", **kw))
    np.testing.assert_array_equal(np.concatenate([c.codes for c in chunks]),
                                  np.concatenate([c.codes for c in default]))
    pcm = [np.concatenate([c.pcm for c in cs]).astype(np.int32) for cs in (chunks, default)]
    assert np.abs(pcm[0] - pcm[1]).max() <= 1


def test_fixed_chunks_without_growth(endless):
    kw = dict(voice="ryan", seed=7, max_frames=11, first_chunk_frames=1, chunk_frames=4, max_chunk_frames=None)
    assert [c.num_frames for c in endless.stream("Hello there.", **kw)] == [1, 4, 4, 2]


@pytest.mark.parametrize(
    "first, chunk, most, growth, sizes",
    [
        (1, 2, 32, 2, [1, 2, 4, 8, 16, 32, 32]),  # the default before session 35
        (1, 3, 32, 2, [1, 3, 6, 12, 32, 32]),  # 32 once it is within twice the 22 sent
        (1, 4, 32, 2, [1, 4, 8, 16, 32, 32]),
        (1, 4, 16, 2, [1, 4, 8, 16, 16]),
        (1, 2, 16, 2, [1, 2, 4, 8, 16]),  # 4: the most of the ladder 2, 4, 8, ... within twice the 3 sent
        (2, 4, 32, 2, [2, 4, 8, 16, 32]),
        (1, 4, 20, 2, [1, 4, 8, 20, 20]),  # 20, off the ladder, once growth allows it (13 sent)
        (1, 4, None, 2, [1, 4, 4, 4, 4]),
        (1, 8, 4, 2, [1, 8, 8, 8, 8]),  # a cap below chunk_frames never shrinks a chunk
        (1, 1, 32, 2, [1, 1, 4, 8, 16, 32]),  # growth 2 from one sent: the third chunk jumps to 4
        (1, 1, 32, 1, [1, 1, 2, 4, 8, 16, 32, 32]),  # the default: each chunk at most the frames sent
        (1, 2, 32, 1, [1, 2, 2, 4, 8, 16, 32, 32]),
        (1, 1, 32, 3, [1, 1, 4, 16, 32, 32]),  # the ladder's most within 3x sent: 4 of 6, 16 of 18
    ],
)
def test_chunk_schedule(first, chunk, most, growth, sizes):
    req = SynthesisRequest("x", first_chunk_frames=first, chunk_frames=chunk, max_chunk_frames=most,
                           chunk_growth=growth)
    sent, got = 0, []
    for _ in sizes:
        got.append(chunk_target(req, sent))
        sent += got[-1]
    assert got == sizes
    assert schedule_sizes(req) == tuple(sorted(set(sizes)))


def test_default_schedule_sizes():
    # The engine compiles these vocoder graphs at warm-up (the sizes before a default stream's tail).
    assert schedule_sizes(SynthesisRequest("x")) == (1, 2, 4, 8, 16, 32)


def test_round_budget():
    # The longest round in which every chunk still follows the audio before it: the second chunk's
    # n rounds within the first chunk's 80 ms.
    assert round_budget_ms(SynthesisRequest("x", chunk_frames=2, chunk_growth=2)) == pytest.approx(40.0)
    assert round_budget_ms(SynthesisRequest("x", chunk_frames=3, chunk_growth=2)) == pytest.approx(80 / 3)
    assert round_budget_ms(SynthesisRequest("x", chunk_frames=1, max_chunk_frames=None)) == pytest.approx(80.0)
    # A later chunk can be the tightest: 1, 1, then 4 frames after 2 sent, made 5 rounds after the
    # first chunk while its 160 ms play (the second chunk's round counts too).
    assert round_budget_ms(SynthesisRequest("x", chunk_frames=1, chunk_growth=2)) == pytest.approx(32.0)
    # The default 1, 1, 2, 4, ...: 80 ms for the second chunk, 53.3 for the third; 32 frames after
    # 32 sent, the tightest, made 63 rounds after the first chunk while 2.56 s play.
    assert round_budget_ms(SynthesisRequest("x")) == pytest.approx(80 * 32 / 63)
    # The first chunk's frames come before the player starts: 2, then 4 in 4 rounds within 160 ms.
    assert round_budget_ms(SynthesisRequest("x", first_chunk_frames=2, chunk_frames=4, chunk_growth=2)) == pytest.approx(40.0)


def test_bad_max_chunk_frames(engine):
    with pytest.raises(InvalidInputError, match="max_chunk_frames must be >= 1, or None"):
        engine.open_session(SynthesisRequest("Hello.", voice="ryan", max_chunk_frames=0))


def test_seeded_sampling_repeats(endless):
    a = endless.generate_codes("Seeded run.", voice="aiden", seed=123, max_frames=8)
    b = endless.generate_codes("Seeded run.", voice="aiden", seed=123, max_frames=8)
    c = endless.generate_codes("Seeded run.", voice="aiden", seed=124, max_frames=8)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert int(a[:, 0].max()) < 2048 and int(a[:, 1:].max()) < 2048


def test_greedy_is_deterministic_without_seed(endless):
    a = endless.generate_codes("Greedy.", voice="ryan", greedy=True, max_frames=6)
    b = endless.generate_codes("Greedy.", voice="ryan", greedy=True, max_frames=6)
    assert torch.equal(a, b)


def test_text_length_frame_cap_stops_runaway(endless):
    s = endless.open_session(SynthesisRequest("Hi.", voice="ryan", seed=0, vocode=False))
    while not s.done:
        endless.step(s)
    assert s.stop_reason == "frame_cap"
    assert s.frames_decoded == s.frame_cap
    assert s.frame_cap < 200, "a 2-token text must not run for minutes"


def test_eos_stops_generation(tiny_checkpoint):
    """An utterance ends when code 0 is EOS. The tiny model's random weights emit EOS at random
    (and how often depends on torch's random init, which differs between versions), so this
    engine's codec head has its EOS row scaled up: its logit dwarfs the others whenever it is
    positive, and every seeded utterance ends by EOS within a few frames of `min_new_tokens`."""
    eng = QwenTTSEngine.from_pretrained(tiny_checkpoint("custom_voice"), device="cpu", dtype="float32")
    eos = eng.config.talker.codec_eos_id
    with torch.no_grad():
        eng.model.talker.codec_head.weight[eos] *= 1e3
    for seed in range(4):
        s = eng.open_session(SynthesisRequest("A short one.", voice="ryan", seed=seed, vocode=False))
        steps = 0
        while not s.done:
            eng.step(s)
            steps += 1
        assert s.stop_reason == "eos", (seed, s.stop_reason, steps)
    eng.close()


def _run(eng, request, run_ahead, use_step_many=False, at_chunks=True):
    """Chunks, stop reason and frame count of one request, how many steps found a frame
    launched ahead, and how many of those frames start a chunk (launched at the chunk boundary,
    behind the vocoder's work)."""
    eng.run_ahead = run_ahead
    eng.ahead_at_chunks = at_chunks
    s = eng.open_session(request)
    chunks, aheads, at_boundary = [], 0, 0
    try:
        while not s.done:
            aheads += s.ahead is not None
            at_boundary += s.ahead is not None and not s.pending
            if use_step_many:
                [out] = eng.step_many([s])
                if isinstance(out, Exception):
                    raise out
                chunks += out
            else:
                chunks += eng.step(s)
    finally:
        eng.run_ahead = False
        eng.ahead_at_chunks = True
    key = [(c.frame_index, c.num_frames, c.pcm.tobytes(), c.codes.tobytes()) for c in chunks]
    return key, s.stop_reason, s.frames_decoded, aheads, at_boundary


def test_run_ahead_changes_nothing(tiny_checkpoint, monkeypatch):
    """A frame launched before the previous one is read (run_ahead, the default on a GPU) gives
    the same chunks, codes and stop, whether the utterance ends by EOS, by a cap or by max_frames,
    across segments, through step and step_many, with the frame that starts a chunk launched at
    the boundary (behind the vocoder's work) or only once the chunk is out."""
    import pipecat_qwen_fast.engine.engine as engine_mod

    eng = QwenTTSEngine.from_pretrained(tiny_checkpoint("custom_voice"), device="cpu", dtype="float32")
    eos = eng.config.talker.codec_eos_id
    with torch.no_grad():
        eng.model.talker.codec_head.weight[eos] *= 1e3  # EOS within a few frames (test_eos_stops_generation)
    monkeypatch.setattr(engine_mod, "MAX_SEGMENT_TOKENS", 8)
    text = "One two three. Four five six seven. Eight nine ten."
    # The GPU's vocoder wrapper without graphs: the vocoder call queued ahead of its chunk's last
    # frame runs on the wrapper's copy of the state, kept or dropped by that frame.
    graphs = GraphedVocoder(eng.vocoder, eng.device, eng.dtype, use_graphs=False)
    calls = {"launch": 0, "commit": 0}

    def counted(name):
        real = getattr(graphs, name)

        def call(*a, **k):
            calls[name] += 1
            return real(*a, **k)
        return call

    for name in calls:
        setattr(graphs, name, counted(name))
    reasons, used, at_boundary = set(), 0, [0, 0]
    # Every way of running ahead meets every kind of request; the three seeds (three stops) take
    # the ways in turn rather than each seed all eight (the suite's time on 2 cores).
    ways = list(itertools.product((False, True), (False, True), (None, graphs)))
    for kw in ({}, {"max_frames": 7}, {"chunk_frames": 2, "max_chunk_frames": 3}):
        for seed in range(3):
            req = SynthesisRequest(text, voice="ryan", seed=seed, **kw)
            off = _run(eng, req, False)
            for many, at_chunks, wrapper in ways[seed::3]:
                eng.vocoder_graphs = wrapper
                on = _run(eng, req, True, use_step_many=many, at_chunks=at_chunks)
                eng.vocoder_graphs = None
                assert on[:3] == off[:3], (seed, kw, many, at_chunks, wrapper)
                used += on[3]
                at_boundary[at_chunks] += on[4]
            reasons.add(off[1])
    assert used > 0, "no step ever found a frame launched ahead"
    assert at_boundary[0] == 0 and at_boundary[1] > 0, at_boundary
    # Early calls kept, and early calls dropped (their frame was EOS, or the chunk was cut).
    assert 0 < calls["commit"] < calls["launch"], calls
    assert "eos" in reasons
    eng.close()


def test_run_ahead_frame_caps(endless):
    for kw in ({}, {"max_frames": 9}):
        req = SynthesisRequest("Hi there.", voice="ryan", seed=3, **kw)
        off, on = _run(endless, req, False), _run(endless, req, True)
        assert on[:3] == off[:3] and on[3] > 0, kw
        assert off[1] == "frame_cap"


def test_run_ahead_only_for_a_session_alone(endless):
    """Sessions sharing step_many's rounds never run ahead (they would leave the batch for good);
    one with a frame ahead when others join finishes it and runs ahead no more."""
    endless.run_ahead = True
    try:
        a = endless.open_session(SynthesisRequest("First caller here.", voice="ryan", seed=1, max_frames=12))
        for _ in range(2):
            endless.step_many([a])
        assert a.ahead is not None  # alone: frame 1 started a 4-frame chunk, frame 2 runs ahead
        b = endless.open_session(SynthesisRequest("Second caller.", voice="ryan", seed=2, max_frames=12))
        shared = 0
        while not (a.done and b.done):
            results = endless.step_many([a, b])
            assert not any(isinstance(r, Exception) for r in results), results
            if not (a.done or b.done):  # once one is done the other is alone and may run ahead
                assert a.ahead is None and b.ahead is None
                shared += 1
        assert shared >= 5
    finally:
        endless.run_ahead = False


def test_cancel_with_a_frame_ahead(endless):
    endless.run_ahead = True
    try:
        s = endless.open_session(SynthesisRequest("Cancel me soon.", voice="ryan", seed=0, chunk_frames=3))
        endless.step(s)  # frame 0 completes the first chunk: nothing launched behind it
        assert s.ahead is None and not s.pending
        endless.step(s)  # frame 1 starts a 3-frame chunk: frame 2 is launched ahead
        assert s.ahead is not None
        endless.step(s)
        endless.step(s)  # frame 3 completes that chunk: frame 4 launched behind its vocoder call
        assert s.ahead is not None and not s.pending
        endless.cancel(s)
        assert s.done and s.ahead is None and s.state is None
    finally:
        endless.run_ahead = False
    _assert_still_works(endless)


def test_cancel_frees_state(endless):
    s = endless.open_session(SynthesisRequest("Cancel me soon.", voice="ryan", seed=0))
    endless.step(s)
    assert s.state is not None and s.vocoder_state is not None
    endless.cancel(s)
    assert s.done and s.stop_reason == "cancelled"
    assert s.state is None and s.vocoder_state is None
    assert endless.step(s) == []
    _assert_still_works(endless)


@pytest.mark.parametrize("text", ["", "   \n\t  "])
def test_empty_text(engine, text):
    with pytest.raises(InvalidInputError, match="empty"):
        engine.open_session(SynthesisRequest(text, voice="ryan"))
    _assert_still_works(engine)


def test_unknown_voice_lists_valid(engine):
    with pytest.raises(InvalidInputError) as e:
        engine.open_session(SynthesisRequest("Hi.", voice="darth"))
    assert "darth" in str(e.value) and "ryan" in str(e.value) and "serena" in str(e.value)
    _assert_still_works(engine)


def test_unknown_language_lists_valid(engine):
    with pytest.raises(InvalidInputError) as e:
        engine.open_session(SynthesisRequest("Hi.", voice="ryan", language="klingon"))
    assert "klingon" in str(e.value) and "english" in str(e.value) and "auto" in str(e.value)
    _assert_still_works(engine)


def test_instruct_on_model_that_ignores_it(tiny_checkpoint):
    small = QwenTTSEngine.from_pretrained(tiny_checkpoint("custom_voice", size_tag="0b6"), device="cpu")
    assert small.config.model_size == "0b6"
    with pytest.raises(UnsupportedFeatureError, match="instruct"):
        small.open_session(SynthesisRequest("Hi.", voice="ryan", instruct="whisper softly"))
    _assert_still_works(small)


def test_instruct_accepted_by_1b7_custom_voice(engine):
    assert engine.config.model_size == "1b7"
    codes = engine.generate_codes("Hi.", voice="ryan", instruct="whisper softly", seed=0, max_frames=2)
    assert codes.shape[0] >= 1


def test_voice_clone_on_custom_voice_rejected(engine):
    vc = VoiceClonePrompt(x_vector=torch.zeros(engine.config.talker.hidden_size))
    with pytest.raises(UnsupportedFeatureError):
        engine.open_session(SynthesisRequest("Hi.", voice_clone=vc))


def test_control_characters_and_emoji(engine):
    chunks = list(engine.stream("Hello\x00 there\x07! 😀🎉 ok", voice="ryan", seed=3, max_frames=3))
    assert chunks and all(c.pcm.dtype == np.int16 for c in chunks)


def test_ten_thousand_characters_split_by_sentence(endless):
    sentence = "This is a fairly ordinary sentence about the weather and the sea. "
    text = (sentence * (10_000 // len(sentence) + 1))[:10_000]
    segments = split_text(text, endless.tokenizer, MAX_SEGMENT_TOKENS)
    assert len(segments) > 1
    assert all(len(endless.tokenizer.encode(s)) <= MAX_SEGMENT_TOKENS for s in segments)
    assert " ".join(segments).split() == text.split()
    s = endless.open_session(SynthesisRequest(text, voice="ryan", seed=0, max_frames=4))
    assert len(s.segments) == len(segments)
    while not s.done:
        endless.step(s)
    assert s.frames_decoded == 4
    _assert_still_works(endless)


def test_long_text_continues_across_segments(endless, monkeypatch):
    import pipecat_qwen_fast.engine.engine as eng

    # Small segments and a small per-segment cap: the session must run through all segments.
    monkeypatch.setattr(eng, "MAX_SEGMENT_TOKENS", 8)
    monkeypatch.setattr(eng, "FRAMES_PER_TOKEN_CAP", 1)
    monkeypatch.setattr(eng, "FRAME_CAP_MARGIN", 2)
    s = endless.open_session(SynthesisRequest("One two three. Four five six seven. Eight nine ten.", voice="ryan", seed=0))
    assert len(s.segments) >= 2
    chunks = []
    while not s.done:
        chunks += endless.step(s)
    assert s.segment_index == len(s.segments) - 1
    assert sum(c.num_frames for c in chunks) == s.frames_decoded
    assert [c.frame_index for c in chunks] == sorted(c.frame_index for c in chunks)


def test_missing_model_folder(tmp_path):
    with pytest.raises(ModelLoadError, match="does-not-exist"):
        QwenTTSEngine.from_pretrained(tmp_path / "does-not-exist", device="cpu")


def test_config_missing_key(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("custom_voice")
    dst = tmp_path / "broken"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    del cfg["talker_config"]["codec_eos_token_id"]
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="codec_eos_token_id"):
        QwenTTSEngine.from_pretrained(dst, device="cpu")


def test_bad_device_and_backend(tiny_checkpoint):
    with pytest.raises(InvalidInputError, match="backend"):
        QwenTTSEngine.from_pretrained(tiny_checkpoint("custom_voice"), device="cpu", backend="warp")
    if not torch.cuda.is_available():
        with pytest.raises(UnsupportedFeatureError, match="CUDA"):
            QwenTTSEngine.from_pretrained(tiny_checkpoint("custom_voice"), device="cpu", backend="megakernel")


def test_voice_design_and_base_variants(tiny_checkpoint):
    vd = QwenTTSEngine.from_pretrained(tiny_checkpoint("voice_design"), device="cpu")
    assert vd.voices == []
    codes = vd.generate_codes("Hello.", instruct="A calm deep voice.", seed=0, max_frames=3)
    assert codes.shape[1] == 16
    with pytest.raises(UnsupportedFeatureError):
        vd.open_session(SynthesisRequest("Hello.", voice="ryan"))

    base = QwenTTSEngine.from_pretrained(tiny_checkpoint("base"), device="cpu")
    d = base.config.talker.hidden_size
    with pytest.raises(InvalidInputError, match="voice_clone"):
        base.open_session(SynthesisRequest("Hello."))
    vc = VoiceClonePrompt(x_vector=torch.randn(d), ref_codes=torch.randint(0, 2048, (5, 16)), ref_text="Reference words.")
    chunks = list(base.stream("Hello.", voice_clone=vc, seed=0, max_frames=3))
    assert sum(c.num_frames for c in chunks) >= 1
    with pytest.raises(InvalidInputError, match="x_vector"):
        base.open_session(SynthesisRequest("Hello.", voice_clone=VoiceClonePrompt(x_vector=torch.randn(d + 1))))


def test_cli_writes_playable_wav(tiny_checkpoint, tmp_path):
    out = tmp_path / "hello.wav"
    ckpt = tiny_checkpoint("custom_voice", zero_eos=True)
    proc = subprocess.run(
        [sys.executable, "-m", "pipecat_qwen_fast.cli", "say", "Hello there.", "--model", str(ckpt),
         "--voice", "ryan", "--max-frames", "5", "--seed", "0", "-o", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    with wave.open(str(out)) as w:
        assert w.getframerate() == 24000 and w.getnchannels() == 1 and w.getsampwidth() == 2
        frames = w.readframes(w.getnframes())
    pcm = np.frombuffer(frames, dtype="<i2")
    assert len(pcm) == 5 * 1920 and np.abs(pcm).max() > 0


def test_cli_reports_bad_voice(tiny_checkpoint, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "pipecat_qwen_fast.cli", "say", "Hi.", "--model", str(tiny_checkpoint("custom_voice")),
         "--voice", "nobody", "-o", str(tmp_path / "x.wav")],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2 and "nobody" in proc.stderr and "ryan" in proc.stderr


def test_inference_only_parameters(engine):
    # Parameters must not require grad: graph capture at warm-up runs outside the callers' no_grad.
    assert not any(p.requires_grad for p in engine.model.parameters())
    assert not any(p.requires_grad for p in engine.vocoder.parameters())


def test_prompt_constants_computed_once_per_weights(tiny_checkpoint):
    """The vectors every prompt shares are computed once and reused, bit for bit what a fresh
    build gives, and recomputed after a weight is edited in place."""
    from pipecat_qwen_fast.model.prompt import DUAL_TRACK, PREFILL, build_prompt

    eng = QwenTTSEngine.from_pretrained(tiny_checkpoint("custom_voice"), device="cpu", dtype="float32")
    talker = eng.model.talker

    def build(text_mode=DUAL_TRACK, speaker="ryan"):
        with torch.no_grad():
            return build_prompt(talker, eng.tokenizer, eng.config, text="Hello there.", speaker=speaker,
                                language="english", instruct=None, text_mode=text_mode, voice_clone=None)

    for kw in ({}, {"text_mode": PREFILL}, {"speaker": "vivian"}):
        talker.__dict__.pop("_prompt_memo", None)
        fresh = build(**kw)
        again = build(**kw)  # from the memo
        assert again.pad_vec.data_ptr() == fresh.pad_vec.data_ptr()  # the same storage, not a recomputation
        assert torch.equal(again.embeds, fresh.embeds) and torch.equal(again.trailing, fresh.trailing)

    pad = eng.config.tts_pad_id
    before = build()
    with torch.no_grad():
        talker.model.text_embedding.weight[pad] += 1.0
    edited = build()
    talker.__dict__.pop("_prompt_memo", None)
    assert not torch.equal(edited.pad_vec, before.pad_vec)
    assert torch.equal(edited.pad_vec, build().pad_vec)
    eng.close()
