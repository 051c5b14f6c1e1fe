"""Vocoder (speech-tokenizer decoder): exact streaming, causality, names, loading, input errors.

A tiny config keeps the real rates ([8,5,4,3] x [2,2] = 1920 samples per frame) and the real
sliding window (72) but small widths; every parameter is randomised (codebooks, SnakeBeta,
LayerScale, norms, ConvNeXt gamma), so no part of the network hides behind zeros or ones.

Exactness is checked in float64: streaming and causality are properties of the algorithm, and in
fp32 the ~40 layers amplify reduction-order rounding (different op shapes) to ~1e-5, which would
blur the line between a rounding difference and a one-column history bug. One fp32 test bounds
that rounding noise.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from pipecat_qwen_fast.checkpoints.tiny_configs import speech_tokenizer_config_dict
from pipecat_qwen_fast.config import VocoderConfig, parse_vocoder_config
from pipecat_qwen_fast.errors import ConfigError, InvalidInputError, ModelLoadError
from pipecat_qwen_fast.vocoder.layers import nhwc_friendly
from pipecat_qwen_fast.vocoder.vocoder import Vocoder

OFFICIAL_NAMES = Path(__file__).parent / "data" / "official_vocoder_state_dict.json"
SPF = 1920

TINY = VocoderConfig(
    codebook_size=64, codebook_dim=16, num_quantizers=16, num_semantic_quantizers=1,
    latent_dim=24, decoder_dim=32, hidden_size=16, intermediate_size=32, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0,
    sliding_window=72, max_position_embeddings=8000, upsample_rates=(8, 5, 4, 3),
    upsampling_ratios=(2, 2), upsample_rate=1920, sample_rate=24000,
)


def randomise(voc: Vocoder, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)

    def normal(shape, std=1.0, mean=0.0):
        return torch.randn(shape, generator=g) * std + mean

    with torch.no_grad():
        for name, p in voc.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "cluster_usage":
                usage = torch.rand(p.shape, generator=g) * 20 + 0.5
                usage[::9] = 0.0  # unused entries: exercises the clamp at 1e-5
                p.copy_(usage)
            elif leaf == "embedding_sum":
                usage = voc.get_parameter(name.replace("embedding_sum", "cluster_usage"))
                p.copy_(normal(p.shape) * usage[:, None].clamp(min=1e-6))
            elif leaf in ("alpha", "beta"):
                p.copy_(normal(p.shape, 0.4))
            elif leaf == "scale":
                p.copy_(torch.rand(p.shape, generator=g) * 0.4 + 0.05)
            elif leaf == "gamma":
                p.copy_(torch.rand(p.shape, generator=g) * 0.4 + 0.1)
            elif name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(normal(p.shape, 0.1, 1.0))
            elif leaf == "bias":
                p.copy_(normal(p.shape, 0.05))
            else:  # linear / conv weights: unit-variance outputs for unit-variance inputs
                if isinstance(voc.get_submodule(name.rsplit(".", 1)[0]), torch.nn.ConvTranspose1d):
                    c_in, _, k = p.shape
                    fan_in = c_in * k // voc.get_submodule(name.rsplit(".", 1)[0]).stride[0]
                else:
                    fan_in = p[0].numel()
                p.copy_(normal(p.shape, 1.0 / math.sqrt(fan_in)))
        # Damp the residual branches and the output so the waveform stays mostly inside the clamp
        # (comparisons must not hide behind the clamp value).
        for name, m in voc.named_modules():
            if name.endswith(".conv2"):
                m.conv.weight.mul_(0.3)
        voc.decoder[-1].conv.weight.mul_(0.1)
    voc.refresh_derived()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Two threads on a shared 2-core machine make these many tiny ops ~25x slower.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def voc32() -> Vocoder:
    torch.manual_seed(0)
    v = Vocoder(TINY).eval()
    randomise(v, 1)
    return v


@pytest.fixture(scope="module")
def voc(voc32) -> Vocoder:
    return Vocoder.from_state_dict(TINY, voc32.state_dict(), dtype=torch.float64)


EXACT = 1e-9  # float64


def random_codes(frames: int, batch: int = 1, seed: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, TINY.codebook_size, (batch, TINY.num_quantizers, frames), generator=g)


@pytest.fixture(scope="module")
def long_codes() -> torch.Tensor:
    return random_codes(410)


@pytest.fixture(scope="module")
def long_wav(voc, long_codes) -> torch.Tensor:
    return voc.decode(long_codes)


def stream_decode(voc: Vocoder, codes: torch.Tensor, sizes) -> torch.Tensor:
    st = voc.new_stream(batch=codes.shape[0])
    out, t, i = [], 0, 0
    while t < codes.shape[-1]:
        n = sizes[i % len(sizes)]
        out.append(voc.decode_stream(codes[..., t:t + n], st))
        t, i = t + n, i + 1
    assert st.frames == codes.shape[-1] and st.position.tolist() == [codes.shape[-1]] * codes.shape[0]
    return torch.cat(out, dim=-1)


# -- names and loading ----------------------------------------------------------------------------


def full_config() -> VocoderConfig:
    return parse_vocoder_config(speech_tokenizer_config_dict("0.6b"))  # the released config


def test_state_dict_names_and_shapes_match_official():
    with torch.device("meta"):
        v = Vocoder(full_config())
    ours = {k: tuple(t.shape) for k, t in v.state_dict().items()}
    # Produced by instantiating the official Qwen3TTSTokenizerV2Decoder (qwen-tts 0.1.1) from the
    # released config on the meta device and listing its state_dict.
    official = {k: tuple(s) for k, s in json.loads(OFFICIAL_NAMES.read_text()).items()}
    assert ours == official


def test_state_dict_matches_layout_module():
    layout = pytest.importorskip("pipecat_qwen_fast.checkpoints.layout")
    cfg = full_config()
    with torch.device("meta"):
        v = Vocoder(cfg)
    ours = {"decoder." + k: tuple(t.shape) for k, t in v.state_dict().items()}
    assert ours == {k: tuple(s) for k, s in layout.vocoder_layout(cfg).items()}


def test_from_state_dict_round_trip(voc):
    sd = {"decoder." + k: v.clone() for k, v in voc.state_dict().items()}
    sd["encoder.some.weight"] = torch.zeros(3)  # the file's encoder half is ignored
    loaded = Vocoder.from_state_dict(TINY, sd)
    codes = random_codes(9, seed=5)
    assert torch.equal(loaded.decode(codes), voc.decode(codes))
    cb = voc.quantizer.rvq_rest.vq.layers[3]._codebook
    expected = cb.embedding_sum / cb.cluster_usage.clamp(min=1e-5)[:, None]
    assert torch.equal(loaded.codebooks[4], expected)
    assert loaded.pre_transformer.inv_freq.dtype == torch.float32


def test_from_state_dict_reports_missing_tensor(voc):
    sd = dict(voc.state_dict())
    del sd["pre_conv.conv.bias"]
    with pytest.raises(ModelLoadError, match="pre_conv.conv.bias"):
        Vocoder.from_state_dict(TINY, sd)


def test_from_pretrained_reads_speech_tokenizer_folder(voc, tmp_path):
    from safetensors.torch import save_file

    folder = tmp_path / "speech_tokenizer"
    folder.mkdir()
    raw = speech_tokenizer_config_dict("0.6b")
    dc = raw["decoder_config"]
    for key, val in dict(codebook_size=64, codebook_dim=16, latent_dim=24, decoder_dim=32,
                         hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8).items():
        dc[key] = val
    (folder / "config.json").write_text(json.dumps(raw))
    save_file({"decoder." + k: v.contiguous() for k, v in voc.state_dict().items()},
              str(folder / "model.safetensors"))
    loaded = Vocoder.from_pretrained(tmp_path)
    assert loaded.cfg == TINY
    assert loaded.codebooks.dtype == torch.float64
    codes = random_codes(5, seed=6)
    # Not bit-equal: kernels may pick another code path for the file's (mmap) tensor alignment.
    assert (loaded.decode(codes) - voc.decode(codes)).abs().max() <= EXACT


def test_loads_a_built_checkpoint(tiny_checkpoint):
    # A checkpoint folder as the builder writes it: bf16 tensors, encoder.* beside decoder.*.
    v = Vocoder.from_pretrained(tiny_checkpoint(), dtype=torch.float32)
    wav = v.decode(torch.randint(0, v.cfg.codebook_size, (1, v.cfg.num_quantizers, 6)))
    assert wav.shape == (1, 1, 6 * SPF) and torch.isfinite(wav).all() and wav.abs().max() > 0


# -- output properties ----------------------------------------------------------------------------


def test_output_shape_range_and_signal(voc32, long_codes):
    long_wav = voc32.decode(long_codes)
    assert long_wav.dtype == torch.float32
    assert long_wav.shape == (1, 1, long_codes.shape[-1] * SPF)
    assert torch.isfinite(long_wav).all()
    assert long_wav.abs().max() <= 1.0
    assert long_wav.std() > 0.05
    # Mostly unclipped, so the equality tests below compare real signal, not the clamp value.
    assert (long_wav.abs() >= 1.0).float().mean() < 0.05


def test_decode_is_causal(voc, long_codes, long_wav):
    for n in (1, 71, 150):
        prefix = voc.decode(long_codes[..., :n])
        assert (prefix - long_wav[..., : n * SPF]).abs().max() <= EXACT


def test_later_frame_changes_nothing_before_it(voc, long_codes, long_wav):
    changed = long_codes.clone()
    changed[0, :, 200] = (changed[0, :, 200] + 1) % TINY.codebook_size
    wav = voc.decode(changed)
    assert (wav[..., : 200 * SPF] - long_wav[..., : 200 * SPF]).abs().max() <= EXACT
    assert (wav[..., 200 * SPF :] - long_wav[..., 200 * SPF :]).abs().max() > 1e-3


# -- exact streaming ------------------------------------------------------------------------------


# [300] also runs a chunk longer than one attention query block (256) through the stream.
@pytest.mark.parametrize("sizes", [[1], [3], [10], [1, 5, 2, 17, 4, 80], [300]], ids=str)
def test_stream_chunks_equal_whole_decode(voc, long_codes, long_wav, sizes):
    wav = stream_decode(voc, long_codes, sizes)
    assert wav.shape == long_wav.shape
    assert (wav - long_wav).abs().max() <= EXACT


def test_stream_fp32_rounding_is_small(voc32, long_codes):
    codes = long_codes[..., :160]
    wav = stream_decode(voc32, codes, [1, 5, 2, 17])
    assert (wav - voc32.decode(codes)).abs().max() <= 1e-4


def test_channels_last_weights_keep_the_stream(voc, long_codes, long_wav):
    """The layout the engine gives cuDNN on CUDA: same values, channels innermost; the stream
    still equals the whole decode (float64)."""
    v = Vocoder.from_state_dict(TINY, voc.state_dict(), dtype=torch.float64)
    v.use_channels_last()
    convs = [m for m in v.modules() if isinstance(m, (torch.nn.Conv1d, torch.nn.ConvTranspose1d))]
    assert any(nhwc_friendly(m) for m in convs) and any(not nhwc_friendly(m) for m in convs)
    for m in convs:  # grouped and dilated convs keep NCHW weights (their inputs are made NCHW)
        assert (m.weight.transpose(1, 2) if nhwc_friendly(m) else m.weight).is_contiguous()
    codes = long_codes[..., :120]
    wav = stream_decode(v, codes, [1, 4])
    assert (wav - long_wav[..., : wav.shape[-1]]).abs().max() <= EXACT


def test_stream_batch_rows_are_independent(voc):
    codes = random_codes(90, batch=2, seed=7)
    wav = stream_decode(voc, codes, [4])
    for b in range(2):
        assert (wav[b] - voc.decode(codes[b : b + 1])[0]).abs().max() <= EXACT


def test_streams_at_different_points_decode_together(voc):
    """Sessions at different points of their utterances (one fresh, one inside the 72-frame
    window, one past it) decoded in one batched call per chunk: each equals its whole decode."""
    codes = [random_codes(140, seed=s) for s in (11, 12, 13)]
    starts = [0, 9, 100]  # frames each stream has consumed before the batched calls
    streams = [voc.new_stream() for _ in codes]
    outs: list[list[torch.Tensor]] = [[] for _ in codes]
    for i, t in enumerate(starts):
        if t:
            outs[i].append(voc.decode_stream(codes[i][..., :t], streams[i]))
    t = 0
    for n in (1, 3, 1, 6, 2, 12, 1):
        chunk = torch.cat([c[..., a + t : a + t + n] for c, a in zip(codes, starts)])
        wav = voc.decode_streams(chunk, streams)
        assert wav.shape == (3, 1, n * SPF)
        for i in range(3):
            outs[i].append(wav[i : i + 1])
        t += n
    for i, a in enumerate(starts):
        assert streams[i].frames == a + t and streams[i].position.tolist() == [a + t]
        whole = voc.decode(codes[i][..., : a + t])
        assert (torch.cat(outs[i], -1) - whole).abs().max() <= EXACT
    with pytest.raises(InvalidInputError, match="one batch-1 stream per row"):
        voc.decode_streams(codes[0][..., :2], streams)


def test_prime_stream_continues_the_reference(voc, long_codes, long_wav):
    ref_len = 97
    primed = voc.new_stream()
    voc.prime_stream(long_codes[0, :, :ref_len].T, primed)  # [T_ref, 16] voice-prompt layout
    assert primed.frames == ref_len
    # A primed stream is reused per session by copying it.
    session = voc.new_stream()
    session.copy_from(primed)
    a = voc.decode_stream(long_codes[..., ref_len : ref_len + 40], session)
    b = voc.decode_stream(long_codes[..., ref_len : ref_len + 40], primed.clone())
    expected = long_wav[..., ref_len * SPF : (ref_len + 40) * SPF]
    assert (a - expected).abs().max() <= EXACT
    assert torch.equal(a, b)


def test_stream_reset_starts_over(voc, long_codes, long_wav):
    st = voc.new_stream()
    voc.decode_stream(long_codes[..., 100:130], st)
    st.reset()
    wav = voc.decode_stream(long_codes[..., :20], st)
    assert (wav - long_wav[..., : 20 * SPF]).abs().max() <= EXACT


def test_stream_state_does_not_grow(voc, long_codes):
    st = voc.new_stream()
    voc.decode_stream(long_codes[..., :5], st)
    shapes = [tuple(h.shape) for h in st.histories] + [tuple(st.keys.shape)]
    voc.decode_stream(long_codes[..., 5:200], st)
    assert [tuple(h.shape) for h in st.histories] + [tuple(st.keys.shape)] == shapes
    assert st.keys.shape[3] == TINY.sliding_window - 1


def test_stream_bf16_tracks_whole_decode(voc32):
    v16 = Vocoder.from_state_dict(TINY, voc32.state_dict(), dtype=torch.bfloat16)
    codes = random_codes(40, seed=8)
    whole = v16.decode(codes)
    streamed = stream_decode(v16, codes, [7])
    assert whole.dtype == torch.bfloat16
    ref = voc32.decode(codes)
    # bf16 weights and activations through ~40 high-gain random layers: ~10% relative error
    # against fp32 (measured), for the streamed and the whole pass alike.
    for got in (whole, streamed):
        assert (got.float() - ref).norm() / ref.norm() < 0.2


@pytest.mark.gpu
def test_stream_equals_whole_on_cuda(voc):
    if not torch.cuda.is_available():
        pytest.skip("CUDA not available")
    vc = Vocoder.from_state_dict(TINY, voc.state_dict(), device="cuda")
    codes = random_codes(150, seed=9).cuda()
    whole = vc.decode(codes)
    assert whole.is_cuda and whole.dtype == torch.float64
    assert (stream_decode(vc, codes, [1, 4]) - whole).abs().max() <= EXACT
    # RoPE tables are fp32 by design; CPU and CUDA cos/sin differ in the last bit.
    assert (whole.cpu() - voc.decode(codes.cpu())).abs().max() <= 1e-4
    v32 = Vocoder.from_state_dict(TINY, voc.state_dict(), device="cuda", dtype=torch.float32)
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False  # TF32 convs (the default) round to ~1e-3
    try:
        assert (stream_decode(v32, codes, [1, 4]) - v32.decode(codes)).abs().max() <= 1e-4
    finally:
        torch.backends.cudnn.allow_tf32 = tf32


# -- reference chunking ---------------------------------------------------------------------------


def test_reference_chunking_semantics(voc, long_codes, long_wav):
    codes = long_codes[..., :130]
    assert torch.equal(voc.decode_reference_chunked(codes, chunk=130), voc.decode(codes))
    got = voc.decode_reference_chunked(codes, chunk=50, left_context=5)
    assert got.shape == (1, 1, 130 * SPF)
    assert torch.equal(got[..., : 50 * SPF], voc.decode(codes[..., :50]))
    # Window 2 re-decodes frames 45..99 with positions from 0 and keeps frames 50..99.
    second = voc.decode(codes[..., 45:100])[..., 5 * SPF :]
    assert torch.equal(got[..., 50 * SPF : 100 * SPF], second)
    # It is an approximation of the exact pass once the first window is over.
    assert (got[..., 50 * SPF :] - long_wav[..., 50 * SPF : 130 * SPF]).abs().max() > 1e-4


# -- bad input ------------------------------------------------------------------------------------


def test_bad_codes_are_rejected(voc):
    with pytest.raises(InvalidInputError, match=r"\[batch, 16, frames>=1\]"):
        voc.decode(torch.zeros(1, 15, 4, dtype=torch.long))
    with pytest.raises(InvalidInputError, match=r"\[0, 64\)"):
        voc.decode(torch.full((1, 16, 4), 64))
    with pytest.raises(InvalidInputError, match="integer"):
        voc.decode(torch.zeros(1, 16, 4))
    with pytest.raises(InvalidInputError, match="chunk"):
        voc.decode_reference_chunked(random_codes(3), chunk=0)
    st = voc.new_stream(batch=2)
    with pytest.raises(InvalidInputError, match="batch"):
        voc.decode_stream(random_codes(3), st)


def test_config_needs_divisible_decoder_dim():
    with pytest.raises(ConfigError, match="decoder_dim"):
        Vocoder(dataclasses.replace(TINY, decoder_dim=40))
