"""Chunks of different sizes in one vocoder call: each row padded on the right to the call's
frames and committing its own stream after its own frames (`valid`), so a merged call gives
each stream the audio and the state of its own unpadded chunk.

Exactness is checked in float64 (the algorithm); in fp32 any change of batch shape alone moves
the numbers by ~2e-5 (unpadded batched calls as much as padded ones), which one test bounds.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import test_vocoder
import torch
from test_vocoder import TINY

from pipecat_qwen_fast import QwenTTSEngine, SynthesisRequest
from pipecat_qwen_fast.backends.graph import GraphBackend
from pipecat_qwen_fast.errors import InvalidInputError
from pipecat_qwen_fast.vocoder.graphs import GraphedVocoder, merge_sizes
from pipecat_qwen_fast.vocoder.stream import VocoderStream
from pipecat_qwen_fast.vocoder.vocoder import Vocoder

SPF = 1920
# Per call, each stream's own frames; the call runs max(lengths) frames. Stream 2 starts 70
# frames in, so its calls cross the 72-frame attention window.
RAGGED = [(4, 2, 3, 1), (1, 4, 4, 2), (3, 3, 1, 4), (2, 1, 4, 4), (1, 1, 2, 1)]
STARTS = (0, 5, 70, 1)


# test_vocoder's fixtures: one torch thread, its tiny vocoder in fp32 and in float64.
one_thread, voc32, voc = test_vocoder.one_thread, test_vocoder.voc32, test_vocoder.voc


def state_gap(a: VocoderStream, b: VocoderStream) -> float:
    """Largest difference between two streams' tensors, relative to each tensor's scale."""
    assert a.position.tolist() == b.position.tolist() and a.frames == b.frames
    pairs = [*zip(a.histories, b.histories), (a.keys, b.keys), (a.values, b.values)]
    return max(float((x - y).abs().max() / y.abs().max().clamp(min=1e-30)) for x, y in pairs)


def ragged_run(voc: Vocoder, call) -> float:
    """Streams at STARTS through the RAGGED calls made by `call(codes, streams, valid)`, against
    each stream alone through `decode_stream` of its own frames: the largest audio or state gap."""
    g = torch.Generator().manual_seed(4)
    codes = torch.randint(0, TINY.codebook_size, (len(STARTS), TINY.num_quantizers, 100), generator=g)
    alone = [voc.new_stream() for _ in STARTS]
    together = [voc.new_stream() for _ in STARTS]
    for i, t in enumerate(STARTS):
        if t:
            voc.decode_stream(codes[i : i + 1, :, :t], alone[i])
            voc.decode_stream(codes[i : i + 1, :, :t], together[i])
    at, worst = list(STARTS), 0.0
    for lengths in RAGGED:
        n = max(lengths)
        # Each row's padding is the stream's next frames: they must not reach its audio or state.
        wav = call(torch.stack([codes[i, :, t : t + n] for i, t in enumerate(at)]), together, list(lengths))
        assert wav.shape == (len(STARTS), 1, n * SPF)
        for i, v in enumerate(lengths):
            own = voc.decode_stream(codes[i : i + 1, :, at[i] : at[i] + v], alone[i])
            worst = max(worst, float((wav[i, :, : v * SPF] - own[0]).abs().max()), state_gap(together[i], alone[i]))
            at[i] += v
    assert [st.frames for st in together] == at
    return worst


def test_ragged_call_equals_each_stream_alone(voc):
    assert ragged_run(voc, lambda c, s, v: voc.decode_streams(c, s, valid=v)) <= 1e-12


def test_ragged_call_fp32_within_batching_noise(voc32):
    assert ragged_run(voc32, lambda c, s, v: voc32.decode_streams(c, s, valid=v)) <= 1e-4


def test_padded_call_commits_the_unpadded_state(voc):
    """The state after a chunk padded from 3 to 8 frames is the state after the 3 frames alone,
    not after all 8 (what a commit that ignored `valid` would keep)."""
    g = torch.Generator().manual_seed(5)
    codes = torch.randint(0, TINY.codebook_size, (1, TINY.num_quantizers, 20), generator=g)
    own, padded, ignored = voc.new_stream(), voc.new_stream(), voc.new_stream()
    for st in (own, padded, ignored):
        voc.decode_stream(codes[..., :9], st)
    voc.decode_stream(codes[..., 9:12], own)
    voc.decode_streams(codes[..., 9:17], [padded], valid=[3])
    voc.decode_streams(codes[..., 9:17], [ignored])
    assert state_gap(padded, own) <= 1e-12
    ignored.frames = own.frames
    ignored.position.copy_(own.position)
    assert state_gap(ignored, own) > 1e-3
    # And the next chunk continues from the right place.
    nxt = codes[..., 12:16]
    assert (voc.decode_stream(nxt, padded) - voc.decode_stream(nxt, own)).abs().max() <= 1e-12


def test_graphed_decode_many_with_valid(voc):
    """GraphedVocoder without graphs (the eager step): batched entries of 2 and 4 rows take the
    ragged rows with their lengths; rows left alone run batch-1 on their own frames."""
    graphs = GraphedVocoder(voc, torch.device("cpu"), torch.float64, use_graphs=False)
    graphs.capture_batched([4], max_rows=4)
    # 4 rows: one call of the 4-row entry.
    assert ragged_run(voc, graphs.decode_many) <= 1e-12
    # 3 rows: the 4-row entry, its fourth row idle; 5 rows: 4 + 1 alone (batch-1, its own frames).
    for rows in (3, 5):
        streams = [voc.new_stream() for _ in range(rows)]
        alone = [voc.new_stream() for _ in range(rows)]
        g = torch.Generator().manual_seed(rows)
        codes = torch.randint(0, TINY.codebook_size, (rows, TINY.num_quantizers, 4), generator=g)
        lengths = [1 + (i * 3) % 4 for i in range(rows)]
        wav = graphs.decode_many(codes, streams, valid=lengths)
        for i, v in enumerate(lengths):
            own = voc.decode_stream(codes[i : i + 1, :, :v], alone[i])
            assert (wav[i, :, : v * SPF] - own[0]).abs().max() <= 1e-12
            assert state_gap(streams[i], alone[i]) <= 1e-12
    assert graphs.calls(4, 5) == 2 and graphs.calls(4, 3) == 1 and graphs.calls(2, 3) == 3


def test_lengths_are_checked(voc):
    codes = torch.zeros(2, TINY.num_quantizers, 3, dtype=torch.long)
    streams = [voc.new_stream(), voc.new_stream()]
    for bad in ([0, 3], [3, 4]):
        with pytest.raises(InvalidInputError, match="valid lengths"):
            voc.decode_streams(codes, streams, valid=bad)
    with pytest.raises(InvalidInputError, match="2 streams"):
        voc.decode_streams(codes, streams, valid=[3])
    assert [st.frames for st in streams] == [0, 0]


def test_merge_sizes_policy():
    schedule = {1: 3, 2: 5, 4: 2, 8: 1, 16: 4, 32: 6}
    one_call = lambda n, k: 1  # the eager path: one call per size whatever its rows
    assert merge_sizes(schedule, one_call) == {32: 32, 16: 32, 8: 8, 4: 8, 2: 2, 1: 2}
    # Never more than 2x padding: 3 does not join 8, 5 does.
    assert merge_sizes({8: 1, 5: 1, 3: 1}, one_call) == {8: 8, 5: 8, 3: 3}
    # Batched entries of at most 64 rows x frames (2 rows of 32, 4 of 16): 16s join 32 only
    # where that makes fewer calls; a size without batched entries takes nothing.
    def calls(n: int, k: int) -> int:
        rows = max(1, 64 // n)
        return -(-k // rows)
    assert merge_sizes({32: 1, 16: 1}, calls) == {32: 32, 16: 32}  # 2 calls -> 1
    assert merge_sizes({32: 2, 16: 4}, calls) == {32: 32, 16: 16}  # 1 + 1 calls, 3 merged
    assert merge_sizes({64: 1, 32: 1}, lambda n, k: k) == {64: 64, 32: 32}


# -- the engine: a round's chunks of mixed sizes --------------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    """Sessions that run to their frame cap, stepped in batched rounds (GraphBackend's frame run
    eagerly on CPU, as tests/test_text_session.py does)."""
    e = QwenTTSEngine.from_pretrained(tiny_checkpoint("custom_voice", zero_eos=True), device="cpu",
                                      dtype="float32", progress=False, backend="eager")
    e.backend = GraphBackend(e.model.talker, e.device, e.dtype, max_sessions=4, capacity=512, use_graphs=False)
    yield e
    e.close()


def run_staggered(engine, merge: bool, calls: list) -> list[list]:
    """Four sessions joining the rounds at different times, so that rounds hold chunks of 1 and 2,
    2 and 4, 4 and 8 frames, and last chunks of other lengths; each session's AudioChunks."""
    engine.merge_vocoder_sizes = merge
    real = engine.vocoder.decode_streams

    def spy(codes, streams, check_values=True, valid=None):
        calls.append((codes.shape[-1], valid))
        return real(codes, streams, check_values=check_values, valid=valid)

    engine.vocoder.decode_streams = spy
    joins, caps = (0, 2, 4, 8), (40, 29, 22, 17)
    sessions: list = [None] * 4
    chunks: list[list] = [[] for _ in joins]
    try:
        for r in range(60):
            for j, at in enumerate(joins):
                if r == at:
                    sessions[j] = engine.open_session(
                        SynthesisRequest("Mixed sizes in one round.", voice="ryan", seed=j, max_frames=caps[j]))
            live = [s for s in sessions if s is not None]
            for j, out in enumerate(engine.step_many(live)):
                assert not isinstance(out, Exception), out
                chunks[j] += out
            if all(s is not None and s.done for s in sessions):
                break
    finally:
        del engine.vocoder.decode_streams
        engine.merge_vocoder_sizes = True
    assert [sum(c.num_frames for c in cs) for cs in chunks] == list(caps)
    return chunks


def alone(engine, chunks) -> np.ndarray:
    """A stream's chunks vocoded by themselves, one `decode_stream` call each."""
    st = engine.vocoder.new_stream()
    out = [engine.vocoder.decode_stream(torch.from_numpy(c.codes.T[None].copy()), st)[0, 0] for c in chunks]
    return (torch.cat(out).clamp(-1, 1) * 32767).round().to(torch.int16).numpy()


def test_round_with_mixed_sizes_gives_each_stream_its_own_audio(engine):
    calls: list = []
    merged = run_staggered(engine, True, calls)
    padded = [(n, v) for n, v in calls if v is not None and min(v) < n]
    assert {n for n, _ in padded} == {2, 4, 8}, calls  # 2 took 1s, 4 took 2s, 8 took 4s
    per_size: list = []
    separate = run_staggered(engine, False, per_size)
    assert all(v is None for _, v in per_size)
    assert len(calls) < len(per_size)
    for mine, theirs in zip(merged, separate):
        assert [(c.frame_index, c.num_frames) for c in mine] == [(c.frame_index, c.num_frames) for c in theirs]
        pcm = np.concatenate([c.pcm for c in mine])
        assert np.array_equal(np.concatenate([c.codes for c in mine]), np.concatenate([c.codes for c in theirs]))
        # fp32 batching noise (~2e-5) may move a sample by one step of int16.
        assert np.abs(pcm.astype(np.int32) - alone(engine, mine)).max() <= 1
        assert np.abs(pcm.astype(np.int32) - np.concatenate([c.pcm for c in theirs])).max() <= 1
        assert np.abs(pcm).max() > 1000  # real audio, not silence that would hide a wrong state


def test_a_packed_stream_decodes_as_an_unpacked_one(voc32):
    # An engine session's stream is packed (one allocation); its buffers are views that must not
    # overlap: chunked decoding through it equals decoding through separate buffers.
    codes = torch.randint(0, TINY.codebook_size, (1, TINY.num_quantizers, 9), generator=torch.Generator().manual_seed(3))
    packed, plain = voc32.new_stream(packed=True), voc32.new_stream()
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
                   for t in (*packed.histories, packed.keys, packed.values))
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans))
    assert len({t.untyped_storage().data_ptr() for t in (*packed.histories, packed.keys)}) == 1
    outs = []
    for st in (packed, plain):
        outs.append(torch.cat([voc32.decode_stream(codes[..., a:b], st) for a, b in ((0, 1), (1, 3), (3, 9))], -1))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
