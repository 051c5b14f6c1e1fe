"""Open-ended dual-track sessions (engine/text_session.py) on tiny checkpoints, on CPU: text
streamed in pieces gives the codes of the whole text, waiting, segments, word timing, bad input."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest
import torch

from pipecat_qwen_fast import InvalidInputError, QwenTTSEngine, SynthesisRequest, VoiceClonePrompt
from pipecat_qwen_fast.backends.graph import GraphBackend
from pipecat_qwen_fast.engine.text_session import FRAME_S
from pipecat_qwen_fast.engine.text_stream import TextEndedError

TEXTS = [
    "Hello there, this is a streamed turn. It has two sentences!",
    "  Numbers 12,345 and 6.5%, a tab\there,\r\na newline; 你好，世界。 The end?  ",
    "Emoji \ud83d\ude00 split, a lone \ud800 half and a bell \x07 inside.",
]


def cpu_engine(path, **kw) -> QwenTTSEngine:
    return QwenTTSEngine.from_pretrained(path, device="cpu", dtype="float32", progress=False, **kw)


@pytest.fixture(scope="module")
def eager(tiny_checkpoint):
    return cpu_engine(tiny_checkpoint("custom_voice"), backend="eager")


@pytest.fixture(scope="module")
def graph(tiny_checkpoint):
    """GraphBackend's frame run eagerly on CPU (as tests/test_graph_backend.py does)."""
    e = cpu_engine(tiny_checkpoint("custom_voice"), backend="eager")
    e.backend = GraphBackend(
        e.model.talker, e.device, e.dtype, max_sessions=6, capacity=512, use_graphs=False
    )
    return e


@pytest.fixture
def early_eos(tiny_checkpoint, monkeypatch):
    """EOS within a few frames, small segments and caps (as tests/test_engine.py's segment tests):
    turns run through several segments, each ended by EOS or its cap."""
    import pipecat_qwen_fast.engine.engine as engine_mod

    e = cpu_engine(tiny_checkpoint("custom_voice"), backend="eager")
    eos = e.config.talker.codec_eos_id
    with torch.no_grad():
        e.model.talker.codec_head.weight[eos] *= 30
    monkeypatch.setattr(engine_mod, "MAX_SEGMENT_TOKENS", 10)
    monkeypatch.setattr(engine_mod, "FRAMES_PER_TOKEN_CAP", 1)
    monkeypatch.setattr(engine_mod, "FRAME_CAP_MARGIN", 3)
    return e


def split(rng: random.Random, text: str, n: int) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(n, len(text) - 1)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def drive(engine, s, parts: list[str], rng: random.Random, end: bool = True) -> list:
    """Feed `parts` at random moments between steps; check that a waiting session decodes
    nothing. Returns the chunks."""
    parts = list(parts)
    chunks = []
    waited = 0
    while not s.done:
        sent = engine.poll_text(s)  # what it sends while it waits is part of the audio too
        waiting = sent is not None
        chunks += sent or []
        if parts and (waiting or rng.random() < 0.35):
            engine.append_text(s, parts.pop(0))
            if not parts and end:
                engine.end_text(s)
            continue
        before = s.frames_decoded
        out = engine.step(s)
        chunks += out
        if waiting:
            waited += 1
            assert s.frames_decoded == before, "a waiting session decoded a frame"
            if not parts and not end:
                break
    return chunks


def whole_codes(engine, text: str, **kw) -> np.ndarray:
    kw = {k: v for k, v in kw.items() if k != "vocode"}
    return engine.generate_codes(text, text_mode="dual_track", **kw).numpy()


def streamed(engine, text: str, rng, pieces: int, **kw):
    s = engine.open_text_session(SynthesisRequest("", **kw))
    chunks = drive(engine, s, split(rng, text, pieces), rng)
    codes = np.stack(s.codes) if s.codes else np.zeros((0, 16), np.int64)
    return s, chunks, codes


@pytest.mark.parametrize("sampling", [{"greedy": True}, {"seed": 11}], ids=["greedy", "seeded"])
def test_any_split_gives_the_whole_texts_codes(eager, sampling, monkeypatch):
    """Any split, including the pieces that make frame 0 run from a preview (the first token
    final, the second not yet) and from a guess at the first token (none final yet)."""
    previews = []
    real = eager.backend.preview_frame
    monkeypatch.setattr(eager.backend, "preview_frame", lambda st: previews.append(st) or real(st))
    rng = random.Random(3)
    kw = dict(voice="ryan", max_frames=28, vocode=False, **sampling)
    for text in TEXTS:
        whole = whole_codes(eager, text, **kw)
        for pieces in (1, 5, len(text) // 2, len(text) - 1):
            s, _, codes = streamed(eager, text, rng, pieces, **kw)
            assert np.array_equal(codes, whole), (text, pieces)
            assert s.stop_reason == "frame_cap" and s.state is None
    assert previews


def test_audio_equals_the_whole_texts(eager):
    """With the vocoder: the same codes, and audio equal to the whole text's (chunks sent early
    while waiting for text round at most an LSB apart)."""
    rng = random.Random(4)
    kw = {"voice": "serena", "seed": 2, "max_frames": 24}
    text = TEXTS[0]
    whole = eager.synthesize(text, text_mode="dual_track", **kw)
    _s, chunks, codes = streamed(eager, text, rng, 12, **kw)
    assert np.array_equal(codes, whole.codes)
    pcm = np.concatenate([c.pcm for c in chunks])
    assert len(pcm) == len(whole.pcm)
    assert np.abs(pcm.astype(np.int32) - whole.pcm.astype(np.int32)).max() <= 1
    assert [c.frame_index for c in chunks] == sorted(c.frame_index for c in chunks)


def test_segments_match_the_whole_text(early_eos):
    """A turn over several segments (EOS and caps end them, some before all their text was
    read) gives the whole text's codes; the session runs through every segment."""
    rng = random.Random(5)
    text = (
        "One two three four. Five six seven, eight nine ten eleven. Twelve thirteen fourteen! "
        "Fifteen sixteen seventeen eighteen nineteen twenty twenty-one twenty-two. The end."
    )
    reasons = set()
    for seed in range(4):
        kw = {"voice": "ryan", "seed": seed, "vocode": False}
        whole_session = early_eos.open_session(SynthesisRequest(text, text_mode="dual_track", **kw))
        while not whole_session.done:
            early_eos.step(whole_session)
        whole = np.stack(whole_session.codes)
        s, _, codes = streamed(early_eos, text, rng, 20, **kw)
        assert np.array_equal(codes, whole), seed
        assert s.segment_index == whole_session.segment_index >= 3
        assert s.stop_reason == whole_session.stop_reason
        reasons.add(s.stop_reason)
    assert reasons <= {"eos", "frame_cap"}


def test_waiting_feeds_nothing_and_resumes(eager):
    kw = {"voice": "ryan", "greedy": True, "max_frames": 12, "vocode": False}
    s = eager.open_text_session(SynthesisRequest("", **kw))
    for _ in range(3):
        assert eager.step(s) == [] and s.frames_decoded == 0  # no text at all yet
    eager.append_text(s, "Hello")
    assert eager.step(s) == [] and s.state is not None and s.frames_decoded == 0  # "Hello" may grow
    eager.append_text(s, " there, how")
    # "Hello" and " there" are final ("how" may still grow): frame 0 reads "Hello" in the prompt
    # and adds " there"; frame 1 adds ","; frame 2 would need " how".
    while eager.poll_text(s) is None:
        eager.step(s)
    assert s.frames_decoded == 2
    for _ in range(3):
        eager.step(s)
    assert s.frames_decoded == 2
    eager.append_text(s, " are you?")
    eager.end_text(s)
    while not s.done:
        eager.step(s)
    assert np.array_equal(np.stack(s.codes), whole_codes(eager, "Hello there, how are you?", **kw))


def test_batched_rounds_on_the_graph_backend(graph):
    """Several streamed turns stepped together (step_many, GraphBackend's batched frame run
    eagerly on CPU), their text arriving at different moments, against each whole text alone."""
    rng = random.Random(6)
    texts = [TEXTS[0], TEXTS[1], "Short one.", "A fourth turn, with its own words."]
    kws = [
        {"voice": v, "seed": 20 + i, "max_frames": 18, "vocode": False}
        for i, v in enumerate(["ryan", "serena", "aiden", "ryan"])
    ]
    wholes = [whole_codes(graph, t, **kw) for t, kw in zip(texts, kws)]
    sessions = [graph.open_text_session(SynthesisRequest("", **kw)) for kw in kws]
    parts = [split(rng, t, 8) for t in texts]
    while not all(s.done for s in sessions):
        for s, p in zip(sessions, parts):
            if p and rng.random() < 0.5:
                graph.append_text(s, p.pop(0))
                if not p:
                    graph.end_text(s)
        results = graph.step_many(sessions)
        assert not any(isinstance(r, Exception) for r in results), results
    for s, whole in zip(sessions, wholes):
        assert np.array_equal(np.stack(s.codes), whole)
    # And one turn alone on the graph backend equals the eager reference.
    kw = {"voice": "ryan", "greedy": True, "max_frames": 16, "vocode": False}
    s, _, codes = streamed(graph, TEXTS[0], rng, 9, **kw)
    assert np.array_equal(codes, whole_codes(graph, TEXTS[0], **kw))


@pytest.mark.parametrize("shared_fails", [False, True], ids=["batched", "shared-prefill-fails"])
def test_turns_begin_together_in_one_prefill(graph, shared_fails, monkeypatch):
    """begin_text_sessions: the turns whose first words are final begin with one prefill of them
    all (GraphBackend's batched pass, eagerly on CPU), a turn with no text yet is left waiting,
    and the codes are each whole text's. If the shared prefill fails, each turn is prefilled
    alone from a fresh state, with the same codes."""
    monkeypatch.setattr(graph.backend, "batched_prefill_min", 2)
    calls = count_prefills(graph, monkeypatch)
    if shared_fails:
        alone = graph._prefill

        def failing(sessions, embeds):
            if len(sessions) > 1:
                raise RuntimeError("shared prefill failed")
            return alone(sessions, embeds)

        monkeypatch.setattr(graph, "_prefill", failing)
    texts = [TEXTS[0], "Short one.", "A third turn, with its own words.", TEXTS[1]]
    kws = [{"voice": v, "seed": 40 + i, "max_frames": 12, "vocode": False}
           for i, v in enumerate(["ryan", "serena", "aiden", "ryan"])]
    wholes = [whole_codes(graph, t, **kw) for t, kw in zip(texts, kws)]
    calls.clear()
    sessions = [graph.open_text_session(SynthesisRequest("", **kw)) for kw in kws]
    for s, t in zip(sessions[:3], texts):
        graph.append_text(s, t)
        graph.end_text(s)
    assert graph.begin_text_sessions(sessions) == [None] * 4
    assert [s.feed.begun for s in sessions] == [True, True, True, False]
    assert calls == ([3] if not shared_fails else [1, 1, 1])
    graph.append_text(sessions[3], texts[3])
    graph.end_text(sessions[3])
    while not all(s.done for s in sessions):
        results = graph.step_many(sessions)
        assert not any(isinstance(r, Exception) for r in results), results
    for s, whole in zip(sessions, wholes):
        assert np.array_equal(np.stack(s.codes), whole)


def test_begin_seeds_the_text_rows_the_first_poll_would_compute(eager, monkeypatch):
    """`_seed_rows` (the fast path) against `_push` computing every row at the turn's first poll
    (SEED_ROWS off, the reference): the same text vectors handed to the backend, bit for bit, and
    the same codes, for a turn whose whole text came before its begin (a server's turn: then the
    first poll computes no row at all) and for one whose text arrives in pieces."""
    from pipecat_qwen_fast.engine import text_session as ts

    handed: list[torch.Tensor] = []
    real_set = eager.backend.set_trailing
    monkeypatch.setattr(eager.backend, "set_trailing", lambda st, t: handed.append(t.clone()) or real_set(st, t))
    computed: list[int] = []
    real_rows = ts.text_rows
    monkeypatch.setattr(ts, "text_rows", lambda *a, **k: computed.append(1) or real_rows(*a, **k))
    kw = {"voice": "serena", "seed": 5, "max_frames": 20, "vocode": False}

    def run(seed: bool, pieces: int | None) -> tuple[np.ndarray, torch.Tensor, int]:
        monkeypatch.setattr(ts, "SEED_ROWS", seed)
        handed.clear()
        computed.clear()
        s = eager.open_text_session(SynthesisRequest("", **kw))
        if pieces is None:  # all of it before the begin
            eager.append_text(s, TEXTS[0])
            eager.end_text(s)
            chunks = drive(eager, s, [], random.Random(0))
        else:
            chunks = drive(eager, s, split(random.Random(8), TEXTS[0], pieces), random.Random(9))
        assert chunks and s.stop_reason == "frame_cap"
        return np.stack(s.codes), handed[-1], len(computed)

    for pieces in (None, 6):
        ref_codes, ref_rows, ref_computed = run(False, pieces)
        codes, rows, seeded_computed = run(True, pieces)
        assert np.array_equal(codes, ref_codes), pieces
        assert rows.shape == ref_rows.shape and torch.equal(rows, ref_rows), pieces
        assert np.array_equal(codes, whole_codes(eager, TEXTS[0], **kw))
        assert ref_computed >= 1
        if pieces is None:
            assert seeded_computed == 0  # its prompt held every row


def test_a_closed_turn_is_freed_without_the_collector(eager):
    """A turn's session and its text feed refer to each other until the session closes: then the
    feed lets go, so the turn is freed by reference counting (no cycle left for the collector's
    passes, which stop every thread), and its words stay as they were, a cancelled segment's
    included."""
    import gc
    import weakref

    for cancel in (False, True):
        s = eager.open_text_session(SynthesisRequest("", voice="ryan", greedy=True, max_frames=12, vocode=False))
        eager.append_text(s, TEXTS[0])
        eager.end_text(s)
        for _ in range(4 if cancel else 10_000):
            if s.done:
                break
            eager.step(s)
        words = s.feed.words()
        assert words
        eager.close_session(s)
        assert s.feed.words() == words
        feed, session = weakref.ref(s.feed), weakref.ref(s)
        gc.disable()
        try:
            del s
            assert feed() is None and session() is None
        finally:
            gc.enable()


def test_voice_clone_turns(tiny_checkpoint):
    """Base model: in-context cloning needs the reference's length of text before its prefill
    (spec §4.6), x-vector-only cloning one token; both equal their whole texts."""
    e = cpu_engine(tiny_checkpoint("base"), backend="eager")
    d = e.config.talker.hidden_size
    g = torch.Generator().manual_seed(0)
    icl = VoiceClonePrompt(
        torch.randn(d, generator=g), torch.randint(0, 2048, (9, 16), generator=g), "Some words."
    )
    xvec = VoiceClonePrompt(torch.randn(d, generator=g))
    rng = random.Random(7)
    for vc in (icl, xvec):
        for text in ("Cloned voice, streamed in pieces of text.", "Hi."):
            kw = {"voice_clone": vc, "greedy": True, "max_frames": 14, "vocode": False}
            _s, _, codes = streamed(e, text, rng, 6, **kw)
            assert np.array_equal(codes, whole_codes(e, text, **kw)), (vc.icl, text)


def test_a_voices_probe_is_made_once_and_again_for_new_weights(eager):
    """open_text_session sizes a turn from a probe prompt, kept per voice: a second turn of the
    voice reuses it, another instruct gets its own, and an in-place weight edit remakes it."""
    from pipecat_qwen_fast.engine import text_session

    def opened(**kw):
        s = eager.open_text_session(SynthesisRequest("", voice="serena", **kw))
        facts = text_session.probe_facts(eager, s)
        with torch.no_grad():
            fresh = text_session._prompt(eager, s, "a")
        assert facts[0] == fresh.embeds.shape[0] == s.feed.prompt_len
        assert torch.equal(facts[1], fresh.eos_vec) and torch.equal(facts[2], fresh.pad_vec)
        eager.close_session(s)
        return facts

    first = opened()
    assert opened() is first  # kept
    other = opened(instruct="Speak slowly and calmly.")
    assert other is not first and other[0] > first[0]  # the instruct's rows
    with torch.no_grad():
        eager.model.talker.text_projection.parameters().__next__().add_(0)  # a new version, same values
    remade = opened()
    assert remade is not first and remade[0] == first[0]


def test_word_timing_and_spoken_text(eager):
    kw = {"voice": "ryan", "greedy": True, "max_frames": 30, "vocode": False}
    s = eager.open_text_session(SynthesisRequest("", **kw))
    drive(eager, s, ["Good morn", "ing, dear friend", "s. How are ", "you?"], random.Random(8))
    words = s.feed.words()
    assert [w.text for w in words] == ["Good", "morning,", "dear", "friends.", "How", "are", "you?"]
    tokens = s.feed.turn.segments[0].tokens
    starts = [w.token for w in s.feed.turn.segments[0].words]
    # The word's first token is read at the frame of that token's index.
    assert [w.frame for w in words] == starts
    assert all(w.start_s == pytest.approx(w.frame * FRAME_S) for w in words)
    assert words[0].frame == 0 and len(tokens) > len(words)
    cut = words[3].start_s + 1e-6  # barged in just after "friends." started
    assert s.feed.spoken_text(cut) == "Good morning, dear friends."
    assert s.feed.spoken_text(0.0) == ""


def test_bad_input_and_edge_turns(eager):
    kw = {"voice": "ryan", "greedy": True, "max_frames": 6, "vocode": False}
    with pytest.raises(InvalidInputError, match="dual_track"):
        eager.open_text_session(SynthesisRequest("", text_mode="prefill", **kw))
    with pytest.raises(InvalidInputError, match="voice"):
        eager.open_text_session(SynthesisRequest("", voice="nobody"))
    with pytest.raises(InvalidInputError, match="idle_timeout_s"):
        eager.open_text_session(SynthesisRequest("", **kw), idle_timeout_s=-1)
    with pytest.raises(InvalidInputError, match="open_text_session"):
        eager.append_text(eager.open_session(SynthesisRequest("Whole.", **kw)), "more")

    # Empty turns: nothing, whitespace, a lone surrogate: no audio, no error, the state freed.
    for text in ("", " \n\t ", "\ud800"):
        s = eager.open_text_session(SynthesisRequest("", **kw))
        eager.append_text(s, text)
        eager.end_text(s)
        assert eager.step(s) == []
        assert s.done and s.stop_reason == "empty" and s.codes == [] and s.state is None

    # Text after end(): a clear error; the turn goes on with what it had.
    s = eager.open_text_session(SynthesisRequest("", **kw))
    eager.append_text(s, "Finished.")
    eager.end_text(s)
    with pytest.raises(TextEndedError, match="after end"):
        eager.append_text(s, " More.")
    while not s.done:
        eager.step(s)
    assert np.array_equal(np.stack(s.codes), whole_codes(eager, "Finished.", **kw))

    # Cancel mid-turn, as for any session; later text is dropped.
    s = eager.open_text_session(SynthesisRequest("", **kw))
    eager.append_text(s, "Cancel me soon, ")
    eager.step(s)
    eager.cancel(s)
    eager.append_text(s, "dropped")
    assert s.done and s.stop_reason == "cancelled" and s.state is None


def test_idle_timeout_ends_and_frees_the_turn(eager):
    kw = {"voice": "ryan", "greedy": True, "max_frames": 40, "vocode": False}
    s = eager.open_text_session(SynthesisRequest("", **kw), idle_timeout_s=0.3)
    eager.append_text(s, "Nobody ends this turn")
    while eager.poll_text(s) is None:
        eager.step(s)
    frames = s.frames_decoded
    time.sleep(0.35)
    while not s.done:
        eager.step(s)
    assert s.feed.ended_by == "idle_timeout" and s.state is None
    assert s.frames_decoded > frames
    assert np.array_equal(np.stack(s.codes), whole_codes(eager, "Nobody ends this turn", **kw))
    with pytest.raises(TextEndedError):
        eager.append_text(s, " late")


class HandClock:
    """A stand-in for the text session's `time`: it moves only when the test moves it, so a slow
    machine's decoding takes no time on it (the deadlines are checked, not the machine's speed)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def test_waiting_sends_decoded_audio(eager, monkeypatch):
    """Frames decoded while the text is slow go out as audio once what was sent is about to run
    out (LOW_WATER_S), instead of waiting for their chunk to fill."""
    from pipecat_qwen_fast.engine import text_first_frame, text_session

    # On the wall clock a loaded 2-core machine took longer to decode the frames after the first
    # chunk than the chunk left above the low water, and sent them early; on this clock the
    # decoding takes no time, and the test moves it to the deadline.
    clock = HandClock()
    monkeypatch.setattr(text_session, "time", clock)
    monkeypatch.setattr(text_first_frame, "time", clock)
    kw = {"voice": "ryan", "seed": 1, "max_frames": 40, "first_chunk_frames": 8, "chunk_frames": 8}
    s = eager.open_text_session(SynthesisRequest("", **kw))
    eager.append_text(s, "One two three four five six seven eight nine ten eleven ")
    chunks = []
    while (sent := eager.poll_text(s)) is None:
        chunks += eager.step(s)
    assert sent == [] and [c.num_frames for c in chunks] == [8]  # 640 ms sent: enough for now
    pending = s.frames_decoded - 8
    assert 0 < pending < 8
    wake = s.feed.deadline(s)
    assert wake is not None and wake - clock.monotonic() < 0.64 - 0.2 + 0.01
    clock.now = max(clock.now, wake) + 0.01
    sent = eager.poll_text(s)
    assert [c.num_frames for c in sent] == [pending]  # the chunk of 8 was not full
    assert (
        eager.poll_text(s) == [] and s.feed.deadline(s) > clock.monotonic() + 1
    )  # only the idle timeout left
    eager.cancel(s)


def count_prefills(engine, monkeypatch) -> list:
    calls = []
    real = engine._prefill

    def counted(sessions, embeds):
        calls.append(len(sessions))
        return real(sessions, embeds)

    monkeypatch.setattr(engine, "_prefill", counted)
    return calls


@pytest.mark.parametrize("sampling", [{"greedy": True}, {"seed": 13}], ids=["greedy", "seeded"])
def test_first_frame_once_the_first_token_is_final(eager, sampling, monkeypatch):
    """Frame 0's codes need only the first token (in the prefill): its audio goes out once that
    token is final, before the second one is (a preview of frame 0; the frame's next talker input
    waits for the second token). Before any token is final the session prefills with a guess at
    the first one and previews frame 0, so a right guess leaves no GPU work for first audio."""
    prefills = count_prefills(eager, monkeypatch)
    kw = dict(voice="ryan", max_frames=20, **sampling)
    text = "Hello, there friends."
    whole = eager.synthesize(text, text_mode="dual_track", **kw)
    s = eager.open_text_session(SynthesisRequest("", **kw))
    before = len(prefills)
    eager.append_text(s, "Hello")
    assert eager.poll_text(s) == [] and s.frames_decoded == 0  # "Hello" may still grow
    assert len(prefills) == before + 1 and s.feed.guess is not None  # prefilled with the guess
    assert s.state.preview is not None
    eager.append_text(s, ",")  # "Hello" is final; "," may still take a newline
    sent = eager.poll_text(s)
    assert len(prefills) == before + 1  # the guess was right: no prefill again
    assert [c.num_frames for c in sent] == [1] and s.frames_decoded == 1
    assert s.feed.previewed and s.state.frame == 0  # the state waits for the second token
    assert eager.poll_text(s) == [] and s.frames_decoded == 1
    eager.append_text(s, " there friends")
    chunks = list(sent)
    while not s.done:
        out = eager.poll_text(s)
        if out is not None:
            chunks += out
            if s.feed.ended_by is None:  # it waits for "friends" to be final: the rest comes
                eager.append_text(s, ".")
                eager.end_text(s)
            continue
        chunks += eager.step(s)
    assert s.feed.ended_by == "end"  # by the text's end, not by the idle timeout
    assert np.array_equal(np.stack(s.codes), whole.codes)
    pcm = np.concatenate([c.pcm for c in chunks])
    assert len(pcm) == len(whole.pcm)
    assert np.abs(pcm.astype(np.int32) - whole.pcm.astype(np.int32)).max() <= 1


@pytest.mark.parametrize(
    "parts",
    [
        ["Hel", "lo, there friends."],  # the guess "Hel" was wrong: prefilled again
        ["S", "u", "re", ", I can", " help."],  # the guess changes before the token is final
        ["Sure", ", I can help.", ""],  # right, and the second token is final at once
        ["  ", "Sure", ","],  # leading spaces; the turn ends with the second token
    ],
)
def test_guesses_right_and_wrong_keep_the_codes(eager, parts, monkeypatch):
    prefills = count_prefills(eager, monkeypatch)
    kw = {"voice": "serena", "seed": 4, "max_frames": 16, "vocode": False}
    whole = whole_codes(eager, "".join(parts), **kw)
    before = len(prefills)
    s = eager.open_text_session(SynthesisRequest("", **kw))
    for p in parts:
        eager.append_text(s, p)
        eager.poll_text(s)
    eager.end_text(s)
    while not s.done:
        eager.step(s)
    assert np.array_equal(np.stack(s.codes), whole)
    guessed_right = "Sure" in parts[:2]
    assert (len(prefills) - before == 1) == guessed_right


def test_no_preview_on_the_graph_backend(graph):
    """A backend without preview_frame waits for the second token, as before (the batch)."""
    kw = {"voice": "ryan", "greedy": True, "max_frames": 10, "vocode": False}
    s = graph.open_text_session(SynthesisRequest("", **kw))
    graph.append_text(s, "Hello")
    graph.append_text(s, ",")
    assert graph.poll_text(s) == [] and s.frames_decoded == 0 and s.feed.begun
    graph.append_text(s, " there.")
    graph.end_text(s)
    while not s.done:
        graph.step(s)
    assert np.array_equal(np.stack(s.codes), whole_codes(graph, "Hello, there.", **kw))
