"""The CUDA-graph backend's frame (run eagerly on CPU) against the eager reference backend."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
import torch

from pipecat_qwen_fast import QwenTTSEngine, SynthesisRequest, VoiceClonePrompt
from pipecat_qwen_fast.backends.eager import TorchBackend
from pipecat_qwen_fast.backends.graph import GraphBackend, NoFreeSlotError
from pipecat_qwen_fast.engine.request import schedule_sizes
from pipecat_qwen_fast.model.sampling import SamplingParams
from pipecat_qwen_fast.vocoder.graphs import GraphedVocoder


def _engines(path, **graph_kw):
    ref = QwenTTSEngine.from_pretrained(path, device="cpu", dtype="float32", backend="eager")
    assert isinstance(ref.backend, TorchBackend)
    fast = QwenTTSEngine.from_pretrained(path, device="cpu", dtype="float32", backend="eager")
    kw = dict(max_sessions=4, capacity=512, use_graphs=False) | graph_kw
    fast.backend = GraphBackend(fast.model.talker, fast.device, fast.dtype, **kw)
    return ref, fast


@pytest.fixture(scope="module")
def pair(tiny_checkpoint):
    return _engines(tiny_checkpoint("custom_voice", zero_eos=True))


@pytest.fixture(scope="module")
def fused_pair(tiny_checkpoint):
    # The fused layer step (decode_layer: attention indexed in place) run eagerly: the math the
    # GPU compiles, against the eager reference.
    return _engines(tiny_checkpoint("custom_voice", zero_eos=True), layer_step="fused")


@pytest.mark.parametrize("text_mode", ["prefill", "dual_track"])
def test_greedy_codes_identical(pair, text_mode):
    ref, fast = pair
    kw = dict(voice="ryan", language="english", greedy=True, text_mode=text_mode, max_frames=20)
    a = ref.generate_codes("Hello there, this is a test.", **kw)
    b = fast.generate_codes("Hello there, this is a test.", **kw)
    assert a.shape == (20, 16)
    assert torch.equal(a, b)


def test_greedy_identical_on_other_variants(tiny_checkpoint):
    ref, fast = _engines(tiny_checkpoint("voice_design"))
    kw = dict(instruct="A bright young voice.", greedy=True, max_frames=12)
    assert torch.equal(ref.generate_codes("Good morning.", **kw), fast.generate_codes("Good morning.", **kw))
    ref, fast = _engines(tiny_checkpoint("base"))
    d = ref.config.talker.hidden_size
    g = torch.Generator().manual_seed(0)
    vc = VoiceClonePrompt(torch.randn(d, generator=g), torch.randint(0, 2048, (6, 16), generator=g), "Some words.")
    kw = dict(voice_clone=vc, greedy=True, max_frames=12)
    assert torch.equal(ref.generate_codes("Cloned voice.", **kw), fast.generate_codes("Cloned voice.", **kw))


def test_attention_bucket_crossing(pair):
    # A prompt near 128 positions: the decode crosses from the 128 into the 256 bucket.
    ref, fast = pair
    text = "word " * 110
    kw = dict(voice="ryan", greedy=True, max_frames=30)
    a = ref.generate_codes(text, **kw)
    b = fast.generate_codes(text, **kw)
    assert torch.equal(a, b)


def test_sampling_seeded_and_valid(pair):
    _, fast = pair
    a = fast.generate_codes("Sampling run.", voice="serena", seed=5, max_frames=15)
    b = fast.generate_codes("Sampling run.", voice="serena", seed=5, max_frames=15)
    c = fast.generate_codes("Sampling run.", voice="serena", seed=6, max_frames=15)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert int(a[:, 0].max()) < 2048 and int(a.max()) < 2048


def test_interleaved_sessions_equal_solo(pair):
    _, fast = pair
    reqs = [SynthesisRequest(f"Session number {i}.", voice="aiden", seed=i, max_frames=10, vocode=False) for i in range(3)]
    solo = [fast.generate_codes(r.text, voice="aiden", seed=r.seed, max_frames=10) for r in reqs]
    sessions = [fast.open_session(r) for r in reqs]
    assert len({s.state.slot for s in sessions}) == 3
    while not all(s.done for s in sessions):
        for s in sessions:
            fast.step(s)
    for s, expected in zip(sessions, solo):
        assert torch.equal(torch.from_numpy(np.stack(s.codes)), expected)
    assert len(fast.backend.free_slots) == 4, "closed sessions return their slots"


def test_slots_exhausted_then_freed(pair):
    _, fast = pair
    sessions = [fast.open_session(SynthesisRequest("Hi.", voice="ryan", max_frames=2)) for _ in range(4)]
    with pytest.raises(NoFreeSlotError):
        fast.open_session(SynthesisRequest("One too many.", voice="ryan", max_frames=2))
    fast.cancel(sessions[0])
    s = fast.open_session(SynthesisRequest("Now it fits.", voice="ryan", max_frames=2))
    for x in sessions[1:] + [s]:
        fast.cancel(x)
    assert len(fast.backend.free_slots) == 4


def test_pages_follow_what_sessions_reserve(tiny_checkpoint):
    # A pool of 12 pages of 64 positions: sessions reserve the pages of their budget (prompt +
    # max_frames), fill scattered pages, and give them back; a session the free pages cannot hold
    # waits (NoFreeSlotError) though slots are free. Codes equal each request run alone.
    ref, fast = _engines(tiny_checkpoint("custom_voice", zero_eos=True), max_sessions=8, pages=12)
    gb = fast.backend
    reqs = [SynthesisRequest(f"Paged session {i} speaks.", voice="ryan", greedy=True, max_frames=n, vocode=False)
            for i, n in enumerate((90, 10, 150, 40))]
    sessions = [fast.open_session(r) for r in reqs]
    need = [gb.pages_needed(s.state.position + r.max_frames + 1) for s, r in zip(sessions, reqs)]
    assert [len(gb.slot_pages[s.state.slot]) for s in sessions] == need
    assert len(gb.free_pages) == 12 - sum(need)
    with pytest.raises(NoFreeSlotError, match="pages free"):
        fast.open_session(SynthesisRequest("No room is left for a session whose words go on for a good while, "
                                           "so its budget needs more pages than the pool has.", voice="ryan",
                                           max_frames=400, vocode=False))
    while not all(s.done for s in sessions):
        fast.step_many([s for s in sessions if not s.done])
    for s, r in zip(sessions, reqs):
        assert np.array_equal(np.stack(s.codes), ref.generate_codes(r.text, voice="ryan", greedy=True,
                                                                    max_frames=r.max_frames).numpy())
    assert sorted(gb.free_pages) == list(range(12)) and not gb.slot_pages


def test_codes_do_not_depend_on_slot_or_pages(tiny_checkpoint):
    # The same greedy request in different slots and pages, batched with different neighbours.
    _, fast = _engines(tiny_checkpoint("custom_voice", zero_eos=True), max_sessions=8)
    req = SynthesisRequest("Which slot am I in?", voice="ryan", greedy=True, max_frames=30, vocode=False)
    other = SynthesisRequest("A neighbour with other words.", voice="aiden", greedy=True, max_frames=45, vocode=False)
    runs = []
    for layout in (["req"], ["other", "other", "req"], ["other", "req", "other", "other", "other"]):
        sessions = [fast.open_session(req if name == "req" else other) for name in layout]
        mine = sessions[layout.index("req")]
        while not all(s.done for s in sessions):
            fast.step_many([s for s in sessions if not s.done])
        runs.append(np.stack(mine.codes))
    assert all(np.array_equal(runs[0], codes) for codes in runs[1:])


def test_last_chunks_join_a_rounds_vocoder_call_and_keep_their_audio(pair):
    # Streams of 13, 17 and 30 frames in one batch: they end with tails (13 = 1+2+4+6,
    # 17 = 1+2+4+8+2, 30 = 1+2+4+8+15) flushed in rounds where the third sends other chunks: each tail is vocoded padded to a size of that round (or of the schedule) and must keep exactly its own
    # audio: every stream's audio equals the same request decoded alone.
    _, fast = pair
    reqs = [SynthesisRequest(f"Stream {i} with a tail of its own.", voice="ryan", greedy=True, max_frames=n)
            for i, n in enumerate((13, 17, 30))]
    alone = []
    for r in reqs:  # each alone, the same chunks, each vocoded by itself
        s = fast.open_session(r)
        chunks = []
        while not s.done:
            chunks += fast.step(s)
        alone.append(np.concatenate([c.pcm for c in chunks]))
    sizes = []
    real = fast._vocode_round

    def spy(sessions, results, jobs):
        sizes.append(sorted((job.codes.shape[1], job.final) for _, job in jobs))
        return real(sessions, results, jobs)

    fast._vocode_round = spy
    try:
        sessions = [fast.open_session(r) for r in reqs]
        audio = [[] for _ in reqs]
        while not all(s.done for s in sessions):
            live = [i for i, s in enumerate(sessions) if not s.done]
            for i, chunks in zip(live, fast.step_many([sessions[i] for i in live])):
                audio[i] += [c.pcm for c in chunks]
    finally:
        del fast._vocode_round
    assert any(final and n not in schedule_sizes(SynthesisRequest('')) for row in sizes for n, final in row), sizes
    for got, want in zip(audio, alone):
        got = np.concatenate(got)
        assert got.shape == want.shape
        assert np.abs(got.astype(np.int32) - want.astype(np.int32)).max() <= 1


def test_adopts_a_snapshot_of_another_dtype(tiny_checkpoint):
    # The megakernel's snapshots hold fp32 K/V; the batch pool is bf16 on a GPU. An H200 fleet run
    # failed 4 calls moved into the batch ("index_copy_(): ... BFloat16 and ... Float").

    engine = QwenTTSEngine.from_pretrained(tiny_checkpoint("custom_voice", zero_eos=True), device="cpu",
                                           dtype="bfloat16", backend="eager")
    gb = GraphBackend(engine.model.talker, engine.device, torch.bfloat16, max_sessions=2, capacity=512,
                      use_graphs=False)
    text = " ".join(f"word{i}" for i in range(60))  # a prompt of whole pages and a partial one
    s = engine.open_session(SynthesisRequest(text, voice="ryan", greedy=True, max_frames=4, vocode=False,
                                             text_mode="prefill"))
    engine.step(s)
    snap = engine.backend.export_state(s.state.inner if hasattr(s.state, "inner") else s.state)
    n = snap.k.shape[2]
    assert n > 64  # whole pages and a partial one
    snap = dataclasses.replace(snap, k=snap.k.float(), v=snap.v.float())
    state = gb.adopt_state(snap)
    k, v = gb.read_positions(state.slot, n)
    assert torch.equal(k, snap.k.to(torch.bfloat16)) and torch.equal(v, snap.v.to(torch.bfloat16))
    engine.cancel(s)
    engine.close()


def test_capacity_bounds_the_frame_cap(tiny_checkpoint):
    _, fast = _engines(tiny_checkpoint("custom_voice", zero_eos=True), capacity=64)
    s = fast.open_session(SynthesisRequest("Hello there.", voice="ryan", seed=0, vocode=False))
    assert s.frame_cap < 64
    while not s.done:
        fast.step(s)
    assert s.stop_reason == "frame_cap" and s.frames_decoded == s.frame_cap


def test_fused_projections_same_codes(tiny_checkpoint):
    from pipecat_qwen_fast.model.layers import fuse_projections

    ref, fast = _engines(tiny_checkpoint("custom_voice", zero_eos=True))
    fuse_projections(fast.model)
    assert fast.model.talker.model.layers[0].self_attn.qkv_weight is not None
    kw = dict(voice="ryan", greedy=True, max_frames=12)
    a = ref.generate_codes("Fused weights.", **kw)
    b = fast.generate_codes("Fused weights.", **kw)
    # fp32 matmuls over concatenated weights may round differently; the argmaxes stay put here.
    assert (a == b).float().mean() > 0.95


def test_bucketed_prefill_body_matches_eager(tiny_checkpoint):
    # The captured prefill's body (static, right-padded buffers, copy into the slot) run eagerly.
    ref, fast = _engines(tiny_checkpoint("custom_voice", zero_eos=True))
    for bucket in (16, 32, 64):
        fast.backend.prefills.prepare(bucket)
    kw = dict(voice="ryan", greedy=True, max_frames=10)
    for text in ("Hi.", "A somewhat longer sentence to land in a bigger bucket of the prefill."):
        assert torch.equal(ref.generate_codes(text, **kw), fast.generate_codes(text, **kw))


@pytest.mark.parametrize("layer_step", ["plain", "fused"])
def test_batched_frames_equal_solo(tiny_checkpoint, layer_step):
    # step_many batches sessions (same sampling settings) into one frame; each still equals its
    # solo run, including sessions that join mid-way (frame-0 rows mixed with talker-step rows).
    _, fast = _engines(tiny_checkpoint("custom_voice", zero_eos=True), max_sessions=8, layer_step=layer_step)
    assert fast.backend.layer_step == layer_step
    texts = [f"Batched session {i} says hello." for i in range(4)]
    solo_greedy = [fast.generate_codes(t, voice="ryan", greedy=True, max_frames=9) for t in texts]
    solo_sampled = [fast.generate_codes(t, voice="vivian", seed=i, max_frames=9) for i, t in enumerate(texts)]
    reqs = [SynthesisRequest(t, voice="ryan", greedy=True, max_frames=9, vocode=False) for t in texts[:2]]
    reqs += [SynthesisRequest(t, voice="vivian", seed=i, max_frames=9, vocode=False) for i, t in enumerate(texts[:2])]
    sessions = [fast.open_session(r) for r in reqs]
    late = None
    rounds = 0
    while not all(s.done for s in sessions):
        results = fast.step_many(sessions)
        assert not any(isinstance(r, Exception) for r in results)
        rounds += 1
        if rounds == 3 and late is None:
            late = fast.open_session(SynthesisRequest(texts[2], voice="ryan", greedy=True, max_frames=9, vocode=False))
            sessions.append(late)
    expected = solo_greedy[:2] + solo_sampled[:2] + [solo_greedy[2]]
    for s, e in zip(sessions, expected):
        assert torch.equal(torch.from_numpy(np.stack(s.codes)), e)


@pytest.mark.parametrize("wrapper", [None, "copy", "pool"])
def test_batched_rounds_vocode_chunks_together(tiny_checkpoint, wrapper, monkeypatch):
    """Chunks completed in the same round are vocoded in one call per chunk size; each session's
    chunks (sizes, codes, audio) are still those of its solo run. Sessions join at different
    rounds, so some rounds hold chunks of several sizes and sessions at different positions.
    `wrapper`: the GPU's graph wrapper with batched entries (run eagerly here) instead of the CPU's
    batched reference call; one bucket (2) is too small for the rows, one size (8) has none.
    "pool": its sessions' states are rows of a pool of 3 (vocoder/pool.py), so of the 5 sessions
    some hold rows that others gave back, some run out of rows and have states of their own, and
    some calls mix the two."""
    _, fast = _engines(tiny_checkpoint("custom_voice", zero_eos=True), max_sessions=8)
    calls: list[tuple[int, int]] = []
    if wrapper:
        graphs = GraphedVocoder(fast.vocoder, fast.device, fast.dtype, use_graphs=False,
                                pool_slots=3 if wrapper == "pool" else 0)
        graphs.capture_batched([1, 2, 4], max_rows=2)
        assert (graphs.pool is not None) == (wrapper == "pool")
        assert sorted(graphs.batched) == [(1, 2), (2, 2), (4, 2)]
        real = graphs.decode_many
        monkeypatch.setattr(graphs, "decode_many", lambda c, st, **kw: calls.append(tuple(c.shape[::2])) or real(c, st, **kw))
        monkeypatch.setattr(fast, "vocoder_graphs", graphs)
    else:
        real = fast.vocoder.decode_streams
        monkeypatch.setattr(fast.vocoder, "decode_streams",
                            lambda c, st, **kw: calls.append(tuple(c.shape[::2])) or real(c, st, **kw))
    texts = [f"Session {i} speaks a few words." for i in range(5)]
    # Sampled with a seed each: the tiny model's greedy codes hardly depend on the text, and
    # sessions with equal codes would hide a mix-up of their vocoder states.
    frames = [24, 24, 24, 14, 15]
    reqs = [SynthesisRequest(t, voice="ryan", seed=i, max_frames=f) for i, (t, f) in enumerate(zip(texts, frames))]
    solo = [list(fast.stream(r.text, voice="ryan", seed=r.seed, max_frames=r.max_frames)) for r in reqs]
    assert len({c[1].codes.tobytes() for c in solo}) == 5
    calls.clear()
    sessions, chunks = [], {}
    for rnd in range(40):
        if rnd in (0, 2, 3):  # three at once, one two rounds later, one a round after that
            for r in reqs[: 3] if rnd == 0 else [reqs[rnd + 1]]:
                sessions.append(fast.open_session(r))
        live = [s for s in sessions if not s.done]
        if not live:
            break
        for s, out in zip(live, fast.step_many(live)):
            assert not isinstance(out, Exception), out
            chunks.setdefault(id(s), []).extend(out)
    assert len(sessions) == 5 and all(s.done for s in sessions)
    for s, expected in zip(sessions, solo):
        got = chunks[id(s)]
        assert [(c.frame_index, c.num_frames) for c in got] == [(c.frame_index, c.num_frames) for c in expected]
        for a, b in zip(got, expected):
            assert np.array_equal(a.codes, b.codes)
            # fp32 convolutions over a batch round differently from batch 1: at most an LSB of PCM
            assert np.abs(a.pcm.astype(np.int32) - b.pcm.astype(np.int32)).max() <= 1
    assert any(k > 2 for k, _ in calls), calls  # some calls took more sessions' chunks than a bucket holds
    assert any(n == 8 for _, n in calls), calls  # and some a size without batched entries
    if wrapper:
        assert graphs.calls_pooled + graphs.calls_copied > 0
        assert (graphs.calls_pooled > 0) == (wrapper == "pool"), (graphs.calls_pooled, graphs.calls_copied)
    if wrapper == "pool":
        assert graphs.calls_copied > 0  # the calls that held a session without a row
        del sessions, s
        assert len(graphs.pool.free) == 3  # every row given back


async def test_service_batches_and_queues_when_slots_run_out(tiny_checkpoint):
    # Six streams through a backend with 2 session slots: the service batches what fits and queues
    # the rest until slots free up; every stream equals its solo run.
    from pipecat_qwen_fast.engine.service import EngineService

    _, fast = _engines(tiny_checkpoint("custom_voice", zero_eos=True), max_sessions=2)
    texts = [f"Queued stream {i}." for i in range(6)]
    solo = [fast.generate_codes(t, voice="ryan", seed=i, max_frames=6) for i, t in enumerate(texts)]
    service = EngineService.for_engine(fast)
    try:
        import asyncio

        async def run(i):
            codes = []
            async for chunk in service.stream(SynthesisRequest(texts[i], voice="ryan", seed=i, max_frames=6)):
                codes.append(chunk.codes)
            return np.concatenate(codes)

        outs = await asyncio.wait_for(asyncio.gather(*(run(i) for i in range(6))), timeout=120)
    finally:
        await service.aclose()
    for out, expected in zip(outs, solo):
        assert torch.equal(torch.from_numpy(out), expected)
    assert len(fast.backend.free_slots) == 2


# Three prompts of different lengths, opened together.
THREE_PROMPTS = [SynthesisRequest(text, voice=v, greedy=True, max_frames=6, vocode=False)
                 for text, v in (("Short one.", "ryan"), ("A rather longer sentence to prefill here.", "aiden"),
                                 ("Medium length words.", "serena"))]


def _prefilled_alone(fast, reqs) -> list[tuple]:
    """Each request opened on its own: (positions, K, V, hidden) of its prefill."""
    gb = fast.backend
    alone = []
    for r in reqs:
        s = fast.open_session(r)
        n = s.state.position
        alone.append((n, *gb.read_positions(s.state.slot, n), gb.pool_hidden[s.state.slot].clone()))
        fast.cancel(s)
    return alone


def _check_as_alone(fast, sessions, alone) -> None:
    """Sessions opened together hold what each held opened alone, and decode the same codes."""
    gb = fast.backend
    assert len({s.state.position for s in sessions}) == len(sessions), "prompts of different lengths"
    for s, (n, k, v, h) in zip(sessions, alone):
        assert s.state.position == n
        got_k, got_v = gb.read_positions(s.state.slot, n)
        torch.testing.assert_close(got_k, k, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_v, v, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(gb.pool_hidden[s.state.slot], h, rtol=1e-5, atol=1e-5)
    while not all(s.done for s in sessions):
        fast.step_many(sessions)
    for s in sessions:
        r = s.request
        assert np.array_equal(np.stack(s.codes), fast.generate_codes(r.text, voice=r.voice, greedy=True, max_frames=6).numpy())


def test_prefill_many_equals_one_by_one(pair):
    # Prompts of different lengths, right-padded into one batched pass: K/V rows, hidden state and
    # the codes that follow match each prompt prefilled alone.
    _, fast = pair
    gb = fast.backend
    alone = _prefilled_alone(fast, THREE_PROMPTS)
    before = gb.batched_prefills
    gb.batched_prefill_min = 2  # the GPU default (8) is about launch counts; here any burst batches
    try:
        sessions = fast.open_sessions(THREE_PROMPTS)
    finally:
        gb.batched_prefill_min = 8
    assert gb.batched_prefills == before + 1
    _check_as_alone(fast, sessions, alone)


def test_a_few_calls_opened_together_share_one_row_prefill(pair):
    # Fewer calls than the eager batched pass pays for (3 < 8), their prompts within the row
    # prefill's buckets: one prefill of several rows, each row's K/V, hidden state and codes
    # those of its prompt prefilled alone. (On the GPU the row graphs are captured in the
    # background warm-up; here they run their eager body.)
    _, fast = pair
    gb = fast.backend
    alone = _prefilled_alone(fast, THREE_PROMPTS)
    assert not gb.row_prefills.entries, "nothing prepared: one prefill a call"
    for b in gb.row_prefills.buckets:
        gb.row_prefills.prepare(b)
    passes, batched = gb.row_prefill_passes, gb.batched_prefills
    try:
        sessions = fast.open_sessions(THREE_PROMPTS)
    finally:
        gb.row_prefills.entries.clear()
    assert gb.row_prefill_passes == passes + 1 and gb.batched_prefills == batched
    _check_as_alone(fast, sessions, alone)


def test_open_sessions_reports_each_refusal(pair):
    _, fast = pair
    gb = fast.backend
    reqs = [SynthesisRequest("Fine.", voice="ryan", max_frames=2), SynthesisRequest("Bad voice.", voice="nobody"),
            SynthesisRequest("Also fine.", voice="ryan", max_frames=2)]
    out = fast.open_sessions(reqs)
    assert isinstance(out[1], Exception) and "nobody" in str(out[1])
    assert not isinstance(out[0], Exception) and not isinstance(out[2], Exception)
    # More calls than slots: the ones past the pool get NoFreeSlotError, in their own places.
    more = fast.open_sessions([SynthesisRequest(f"Extra {i}.", voice="ryan", max_frames=2) for i in range(3)])
    assert [isinstance(x, NoFreeSlotError) for x in more] == [False, False, True]
    for s in [out[0], out[2], *more[:2]]:
        fast.cancel(s)
    assert len(gb.free_slots) == 4


async def test_service_opens_a_burst_with_one_prefill(pair):
    from pipecat_qwen_fast.engine.service import EngineService

    _, fast = pair
    before = fast.backend.batched_prefills
    fast.backend.batched_prefill_min = 2
    service = EngineService.for_engine(fast)
    try:
        await service.wait_ready()
        reqs = [SynthesisRequest(f"Burst call {i}.", voice="ryan", seed=i, max_frames=3) for i in range(4)]
        streams = [service.open_stream(r) for r in reqs]

        async def collect(stream):
            return np.concatenate([c.pcm async for c in stream])

        pcm = await asyncio.wait_for(asyncio.gather(*(collect(s) for s in streams)), 120)
        assert all(len(p) == 3 * 1920 for p in pcm)
        assert all(s.record.stop_reason == "frame_cap" for s in streams)
        assert fast.backend.batched_prefills >= before + 1
    finally:
        fast.backend.batched_prefill_min = 8
        await service.aclose()


def test_fused_step_codes_equal_reference(fused_pair):
    ref, fast = fused_pair
    assert fast.backend.layer_step == "fused" and not fast.backend.compiled
    greedy = {"voice": "ryan", "greedy": True, "max_frames": 20}
    text = "word " * 110  # crosses from the 128 into the 256 bucket
    for t in ("Hello there, this is a test.", text):
        assert torch.equal(ref.generate_codes(t, **greedy), fast.generate_codes(t, **greedy))
    sampled = {"voice": "serena", "seed": 5, "max_frames": 15}
    assert torch.equal(ref.generate_codes("Sampling run.", **sampled), fast.generate_codes("Sampling run.", **sampled))


def test_fused_layer_equals_plain_layer(tiny_checkpoint):
    """decode_layer against plain_decode_layer on one layer of the talker and one of the
    predictor: rows in scattered pool slots at different positions, the pool's other rows and
    positions untouched."""
    from pipecat_qwen_fast.backends.graph import KernelLayerStep, decode_layer, plain_decode_layer
    from pipecat_qwen_fast.model.layers import rotary_cos_sin

    engine = QwenTTSEngine.from_pretrained(tiny_checkpoint("custom_voice"), device="cpu", dtype="float32")
    talker = engine.model.talker
    g = torch.Generator().manual_seed(0)
    for layer, stack in ((talker.model.layers[1], talker.cfg.stack),
                         (talker.code_predictor.model.layers[0], talker.code_predictor.cfg.stack)):
        kvh, hd = stack.num_kv_heads, stack.head_dim
        # 9 pages of 8 positions; each row owns 4 scattered pages (32 positions), page 8 is scratch.
        k_pool = torch.randn(9, kvh, 8, hd, generator=g)
        v_pool = torch.randn(9, kvh, 8, hd, generator=g)
        pages = torch.tensor([[5, 1, 7, 3], [0, 8, 8, 8], [2, 6, 4, 8]])
        pos = torch.tensor([27, 3, 19])
        wpage, woff = pages.gather(1, (pos // 8)[:, None])[:, 0], pos % 8
        x = torch.randn(3, stack.hidden_size, generator=g)
        cos, sin = (t[:, None] for t in rotary_cos_sin(pos, hd, stack.rope_theta, torch.float32))
        valid = (torch.arange(32).view(4, 8)[None] <= pos[:, None, None])[:, None, None]
        heads = torch.arange(kvh)
        outs = []
        for step in (plain_decode_layer, decode_layer, KernelLayerStep(False, torch.device("cpu"))):
            k, v = k_pool.clone(), v_pool.clone()
            with torch.no_grad():
                outs.append((step(layer, x, cos, sin, k, v, pages, wpage, woff, pos, valid, heads), k, v))
        (want, k_want, v_want), *others = outs
        for got, k_got, v_got in others:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(k_got, k_want, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(v_got, v_want, rtol=1e-6, atol=1e-6)
        untouched = torch.ones(9, 8, dtype=torch.bool)
        untouched[wpage, woff] = False
        assert torch.equal(k_got.transpose(1, 2)[untouched], k_pool.transpose(1, 2)[untouched])
        # The reference itself: each row's attention over its positions in page order, by hand.
        for r in range(3):
            keys = k_want[pages[r]].transpose(0, 1).flatten(1, 2)[:, : pos[r] + 1]  # [KVH, n, hd]
            assert torch.equal(keys[:, -1], k_want[wpage[r], :, woff[r]])
    engine.close()


def test_fused_step_compiles_a_few_times_for_every_batch_bucket_and_layer(tiny_checkpoint):
    """The GPU compiles `decode_layer` once per width and batch kind (one row, several), not per
    layer, predictor pass, batch bucket or attention bucket: traced here by dynamo with its eager
    backend over rounds of 1-6 sessions crossing from the 128 into the 256 bucket. The tiny
    talker and predictor differ in width (two families), the 0.6B's do not."""
    from torch._dynamo.testing import CompileCounter

    from pipecat_qwen_fast.backends.graph import decode_layer
    from pipecat_qwen_fast.utils.cuda_graphs import recompile_limit

    ref, fast = _engines(tiny_checkpoint("custom_voice", zero_eos=True), max_sessions=8, layer_step="fused")
    gb = fast.backend
    counter = CompileCounter()
    gb._step, gb.compiled = torch.compile(decode_layer, backend=counter, dynamic=None), True
    texts = [f"Session number {i} talks for a while here." for i in range(6)]
    reqs = [SynthesisRequest(t, voice="ryan", greedy=True, max_frames=150, vocode=False) for t in texts]
    torch._dynamo.reset()
    sessions = []
    try:
        with recompile_limit(64):
            sessions += [fast.open_session(r) for r in reqs]
            for r in range(140):
                fast.step_many([s for s in sessions if not s.done][: 1 + r % 6])
        assert max(s.state.position for s in sessions if s.state is not None) > 128
        assert counter.frame_count <= 4, counter.frame_count
        # The dynamo-traced step computes what the eager one does.
        done = fast.generate_codes(texts[0], voice="ryan", greedy=True, max_frames=12)
        assert torch.equal(done, ref.generate_codes(texts[0], voice="ryan", greedy=True, max_frames=12))
    finally:
        for s in sessions:
            fast.cancel(s)
        torch._dynamo.reset()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU: the compiled, captured batched frame is GPU-only")
@pytest.mark.gpu
@pytest.mark.parametrize("layer_step", ["kernel", "fused"])
def test_compiled_batched_frame_matches_plain_on_gpu(tiny_checkpoint, layer_step):
    """Graphs captured from the compiled fused step against graphs of the plain step, in bf16 on
    the same weights, each round from the same pool contents: the talker step's new K/V rows, and
    the codes of 40 batched greedy rounds (bf16 roundings differ, so most, not all)."""
    engine = QwenTTSEngine.from_pretrained(tiny_checkpoint("custom_voice", zero_eos=True), device="cpu", dtype="float32")
    device, dtype = torch.device("cuda"), torch.bfloat16
    talker = engine.model.talker.to(device, dtype)
    fused = GraphBackend(talker, device, dtype, max_sessions=8, capacity=512, layer_step=layer_step)
    plain = GraphBackend(talker, device, dtype, max_sessions=8, capacity=512, layer_step="plain")
    assert fused.compiled and not plain.compiled

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    g = torch.Generator(device="cuda").manual_seed(0)
    d = talker.cfg.hidden_size
    states = {}
    for be in (fused, plain):
        states[be] = [be.new_state(max_positions=400, params=SamplingParams().greedy(), seed=i,
                                   trailing=torch.zeros(1, d, device=device), pad_vec=torch.zeros(d, device=device))
                      for i in range(5)]
    for i in range(5):
        embeds = (torch.randn(20 + 7 * i, d, generator=g, device="cuda") * 0.5).to(dtype)
        for be in (fused, plain):
            be.prefill(states[be][i], embeds)
    agree = []
    for r in range(40):
        n = 5 if r % 3 else 3  # batch buckets 8 and 4
        out = [be.decode_frames(states[be][:n]) for be in (fused, plain)]
        agree.append((out[0] == out[1]).float().mean().item())
        for s_f, s_p in zip(states[fused][:n], states[plain][:n]):
            assert s_f.position == s_p.position
            if r > 0:  # the talker step's newest K/V row (frame 0 has no talker step)
                last = s_f.position - 1
                for kv_f, kv_p in zip(fused.read_positions(s_f.slot, last + 1), plain.read_positions(s_p.slot, last + 1)):
                    assert rel(kv_f[:, :, last], kv_p[:, :, last]) < 3e-2
        # Both go on from the plain backend's state: each round compares one step, not two
        # trajectories that drift apart after one differing code.
        for name in ("pool_k", "pool_v", "pool_pending", "pool_seen"):  # same slots and pages on both
            getattr(fused, name).copy_(getattr(plain, name))
    assert len(fused.graphs) >= 2 and all(k[0] in (4, 8) for k in fused.graphs)
    assert sum(agree) / len(agree) > 0.9, agree
    engine.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU: the paged-attention kernel is Triton on CUDA")
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_kernel_matches_reference(dtype):
    """The Triton kernel against the torch reference: rows at positions inside, at the
    start and at the end of pages, scattered pages, the talker's page (64) and the predictor's (16),
    GQA 2."""
    from pipecat_qwen_fast.backends.paged_attention import (
        paged_attention_reference,
        paged_attention_triton,
    )

    g = torch.Generator(device="cuda").manual_seed(0)
    for P, npages, positions in ((64, 40, [0, 63, 64, 150, 511, 2047 % 512]), (16, 8, [0, 5, 15])):
        kvh, hd, H = 8, 128, 16
        k_pool = torch.randn(npages + 1, kvh, P, hd, generator=g, device="cuda").to(dtype)
        v_pool = torch.randn(npages + 1, kvh, P, hd, generator=g, device="cuda").to(dtype)
        pos = torch.tensor(positions, device="cuda")
        np_ = max(positions) // P + 1
        pages = torch.stack([torch.randperm(npages, generator=g, device="cuda")[:np_] for _ in positions])
        q = torch.randn(len(positions), H, hd, generator=g, device="cuda").to(dtype)
        want = paged_attention_reference(q, k_pool, v_pool, pages, pos)
        got = paged_attention_triton(q, k_pool, v_pool, pages, pos)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
