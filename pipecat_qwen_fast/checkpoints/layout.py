"""Tensor names and shapes of a Qwen3-TTS checkpoint, derived from its parsed configs.

Names are exactly those of the released checkpoints (spec appendix), i.e. the state-dict keys of the
official modules: `Qwen3TTSForConditionalGeneration` for `model.safetensors` and
`Qwen3TTSTokenizerV2Model` for `speech_tokenizer/model.safetensors`, whose encoder is a
transformers 4.57 `MimiModel` with the decoder half removed. Later transformers releases renamed
Mimi's submodules; the checkpoint keeps the 4.57 names, so they are written out here by hand.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipecat_qwen_fast.config import ModelConfig, VocoderConfig, _get
from pipecat_qwen_fast.errors import ConfigError

Shape = tuple[int, ...]
Layout = dict[str, Shape]

# The speaker encoder's widths are not in config.json (only enc_dim and sample_rate are); the
# official module takes them from its config-class defaults, so they are fixed facts.
ECAPA_MEL_DIM = 128
ECAPA_CHANNELS = (512, 512, 512, 512, 1536)
ECAPA_KERNEL_SIZES = (5, 3, 3, 3, 1)
ECAPA_DILATIONS = (1, 2, 3, 4, 1)
ECAPA_ATTENTION_CHANNELS = 128
ECAPA_RES2NET_SCALE = 8
ECAPA_SE_CHANNELS = 128


def add_decoder_layer(out: Layout, prefix: str, hidden: int, inter: int, heads: int, kv_heads: int,
                      head_dim: int) -> None:
    """One Qwen3 decoder layer with QK-norm and no biases (talker and code predictor)."""
    out[f"{prefix}.input_layernorm.weight"] = (hidden,)
    out[f"{prefix}.self_attn.q_proj.weight"] = (heads * head_dim, hidden)
    out[f"{prefix}.self_attn.k_proj.weight"] = (kv_heads * head_dim, hidden)
    out[f"{prefix}.self_attn.v_proj.weight"] = (kv_heads * head_dim, hidden)
    out[f"{prefix}.self_attn.o_proj.weight"] = (hidden, heads * head_dim)
    out[f"{prefix}.self_attn.q_norm.weight"] = (head_dim,)
    out[f"{prefix}.self_attn.k_norm.weight"] = (head_dim,)
    out[f"{prefix}.post_attention_layernorm.weight"] = (hidden,)
    out[f"{prefix}.mlp.gate_proj.weight"] = (inter, hidden)
    out[f"{prefix}.mlp.up_proj.weight"] = (inter, hidden)
    out[f"{prefix}.mlp.down_proj.weight"] = (hidden, inter)


def talker_layout(cfg: ModelConfig) -> Layout:
    t, p = cfg.talker, cfg.predictor
    d, ts, ps = t.hidden_size, t.stack, p.stack
    out: Layout = {}
    out["talker.model.text_embedding.weight"] = (t.text_vocab_size, t.text_hidden_size)
    out["talker.model.codec_embedding.weight"] = (t.vocab_size, d)
    for i in range(ts.num_layers):
        add_decoder_layer(out, f"talker.model.layers.{i}", d, ts.intermediate_size, ts.num_heads,
                          ts.num_kv_heads, ts.head_dim)
    out["talker.model.norm.weight"] = (d,)
    out["talker.text_projection.linear_fc1.weight"] = (t.text_hidden_size, t.text_hidden_size)
    out["talker.text_projection.linear_fc1.bias"] = (t.text_hidden_size,)
    out["talker.text_projection.linear_fc2.weight"] = (d, t.text_hidden_size)
    out["talker.text_projection.linear_fc2.bias"] = (d,)
    out["talker.codec_head.weight"] = (t.vocab_size, d)

    cp = "talker.code_predictor"
    for g in range(p.num_code_groups - 1):
        # Predictor input tables are talker-wide: the projection happens after the lookup.
        out[f"{cp}.model.codec_embedding.{g}.weight"] = (p.vocab_size, d)
    for i in range(ps.num_layers):
        add_decoder_layer(out, f"{cp}.model.layers.{i}", ps.hidden_size, ps.intermediate_size,
                          ps.num_heads, ps.num_kv_heads, ps.head_dim)
    out[f"{cp}.model.norm.weight"] = (ps.hidden_size,)
    for g in range(p.num_code_groups - 1):
        out[f"{cp}.lm_head.{g}.weight"] = (p.vocab_size, ps.hidden_size)
    if ps.hidden_size != d:
        out[f"{cp}.small_to_mtp_projection.weight"] = (ps.hidden_size, d)
        out[f"{cp}.small_to_mtp_projection.bias"] = (ps.hidden_size,)
    return out


def add_conv(out: Layout, name: str, c_out: int, c_in: int, k: int, bias: bool = True) -> None:
    out[f"{name}.weight"] = (c_out, c_in, k)
    if bias:
        out[f"{name}.bias"] = (c_out,)


def speaker_encoder_layout(enc_dim: int) -> Layout:
    """ECAPA-TDNN (spec §8.4); every conv has a bias, there is no BatchNorm."""
    ch, ks = ECAPA_CHANNELS, ECAPA_KERNEL_SIZES
    out: Layout = {}
    add_conv(out, "speaker_encoder.blocks.0.conv", ch[0], ECAPA_MEL_DIM, ks[0])
    for i in range(1, len(ch) - 1):
        b = f"speaker_encoder.blocks.{i}"
        add_conv(out, f"{b}.tdnn1.conv", ch[i], ch[i - 1], 1)
        part = ch[i] // ECAPA_RES2NET_SCALE
        for j in range(ECAPA_RES2NET_SCALE - 1):
            add_conv(out, f"{b}.res2net_block.blocks.{j}.conv", part, part, ks[i])
        add_conv(out, f"{b}.tdnn2.conv", ch[i], ch[i], 1)
        add_conv(out, f"{b}.se_block.conv1", ECAPA_SE_CHANNELS, ch[i], 1)
        add_conv(out, f"{b}.se_block.conv2", ch[i], ECAPA_SE_CHANNELS, 1)
    add_conv(out, "speaker_encoder.mfa.conv", ch[-1], ch[-1], ks[-1])
    add_conv(out, "speaker_encoder.asp.tdnn.conv", ECAPA_ATTENTION_CHANNELS, ch[-1] * 3, 1)
    add_conv(out, "speaker_encoder.asp.conv", ch[-1], ECAPA_ATTENTION_CHANNELS, 1)
    add_conv(out, "speaker_encoder.fc", enc_dim, ch[-1] * 2, 1)
    return out


def main_model_layout(cfg: ModelConfig) -> Layout:
    """Every tensor of `model.safetensors`."""
    out = talker_layout(cfg)
    if cfg.model_type == "base":
        assert cfg.speaker_encoder_dim is not None
        out.update(speaker_encoder_layout(cfg.speaker_encoder_dim))
    return out


def vocoder_layout(v: VocoderConfig, prefix: str = "decoder") -> Layout:
    """The speech-tokenizer decoder (spec §8.2)."""
    out: Layout = {}
    q, dim = f"{prefix}.quantizer", v.codebook_vector_dim
    for part, n in (("rvq_first", v.num_semantic_quantizers),
                    ("rvq_rest", v.num_quantizers - v.num_semantic_quantizers)):
        # input_proj is the encoder-side projection; it is stored although decoding never uses it.
        out[f"{q}.{part}.input_proj.weight"] = (dim, v.codebook_dim, 1)
        out[f"{q}.{part}.output_proj.weight"] = (v.codebook_dim, dim, 1)
        for i in range(n):
            out[f"{q}.{part}.vq.layers.{i}._codebook.cluster_usage"] = (v.codebook_size,)
            out[f"{q}.{part}.vq.layers.{i}._codebook.embedding_sum"] = (v.codebook_size, dim)
    add_conv(out, f"{prefix}.pre_conv.conv", v.latent_dim, v.codebook_dim, 3)

    pt, h = f"{prefix}.pre_transformer", v.hidden_size
    out[f"{pt}.input_proj.weight"] = (h, v.latent_dim)
    out[f"{pt}.input_proj.bias"] = (h,)
    for i in range(v.num_layers):
        lp = f"{pt}.layers.{i}"
        out[f"{lp}.self_attn.q_proj.weight"] = (v.num_heads * v.head_dim, h)
        out[f"{lp}.self_attn.k_proj.weight"] = (v.num_kv_heads * v.head_dim, h)
        out[f"{lp}.self_attn.v_proj.weight"] = (v.num_kv_heads * v.head_dim, h)
        out[f"{lp}.self_attn.o_proj.weight"] = (h, v.num_heads * v.head_dim)
        out[f"{lp}.mlp.gate_proj.weight"] = (v.intermediate_size, h)
        out[f"{lp}.mlp.up_proj.weight"] = (v.intermediate_size, h)
        out[f"{lp}.mlp.down_proj.weight"] = (h, v.intermediate_size)
        out[f"{lp}.input_layernorm.weight"] = (h,)
        out[f"{lp}.post_attention_layernorm.weight"] = (h,)
        out[f"{lp}.self_attn_layer_scale.scale"] = (h,)
        out[f"{lp}.mlp_layer_scale.scale"] = (h,)
    out[f"{pt}.norm.weight"] = (h,)
    out[f"{pt}.output_proj.weight"] = (v.latent_dim, h)
    out[f"{pt}.output_proj.bias"] = (v.latent_dim,)

    lat = v.latent_dim
    for i, r in enumerate(v.upsampling_ratios):
        up = f"{prefix}.upsample.{i}"
        out[f"{up}.0.conv.weight"] = (lat, lat, r)  # ConvTranspose1d: [in, out, k]
        out[f"{up}.0.conv.bias"] = (lat,)
        add_conv(out, f"{up}.1.dwconv.conv", lat, 1, 7)  # depthwise
        out[f"{up}.1.norm.weight"] = (lat,)
        out[f"{up}.1.norm.bias"] = (lat,)
        out[f"{up}.1.pwconv1.weight"] = (4 * lat, lat)
        out[f"{up}.1.pwconv1.bias"] = (4 * lat,)
        out[f"{up}.1.pwconv2.weight"] = (lat, 4 * lat)
        out[f"{up}.1.pwconv2.bias"] = (lat,)
        out[f"{up}.1.gamma"] = (lat,)

    dec = f"{prefix}.decoder"
    add_conv(out, f"{dec}.0.conv", v.decoder_dim, lat, 7)
    for i, r in enumerate(v.upsample_rates):
        c_in, c_out = v.decoder_dim // 2**i, v.decoder_dim // 2 ** (i + 1)
        b = f"{dec}.{i + 1}.block"
        out[f"{b}.0.alpha"] = (c_in,)
        out[f"{b}.0.beta"] = (c_in,)
        out[f"{b}.1.conv.weight"] = (c_in, c_out, 2 * r)  # ConvTranspose1d
        out[f"{b}.1.conv.bias"] = (c_out,)
        for j in range(3):  # residual units, dilations 1, 3, 9
            u = f"{b}.{j + 2}"
            out[f"{u}.act1.alpha"] = (c_out,)
            out[f"{u}.act1.beta"] = (c_out,)
            add_conv(out, f"{u}.conv1.conv", c_out, c_out, 7)
            out[f"{u}.act2.alpha"] = (c_out,)
            out[f"{u}.act2.beta"] = (c_out,)
            add_conv(out, f"{u}.conv2.conv", c_out, c_out, 1)
    n = len(v.upsample_rates)
    c_last = v.decoder_dim // 2**n
    out[f"{dec}.{n + 1}.alpha"] = (c_last,)
    out[f"{dec}.{n + 1}.beta"] = (c_last,)
    add_conv(out, f"{dec}.{n + 2}.conv", 1, c_last, 7)
    return out


@dataclass(frozen=True)
class MimiEncoderConfig:
    """The keys of `speech_tokenizer/config.json: encoder_config` that shape the Mimi encoder."""

    audio_channels: int
    num_filters: int
    hidden_size: int
    upsampling_ratios: tuple[int, ...]
    kernel_size: int
    last_kernel_size: int
    residual_kernel_size: int
    num_residual_layers: int
    compress: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    codebook_size: int
    codebook_dim: int
    vector_quantization_hidden_dimension: int
    num_quantizers: int
    num_semantic_quantizers: int
    sampling_rate: int
    frame_rate: float
    use_conv_shortcut: bool = False
    dilation_growth_rate: int = 2

    @property
    def hop_length(self) -> int:
        total = 1
        for r in self.upsampling_ratios:
            total *= r
        return total

    @property
    def has_downsample(self) -> bool:
        # MimiModel adds a stride-2 conv only when the SEANet frame rate differs from frame_rate.
        return -(-self.sampling_rate // self.hop_length) != self.frame_rate

    @property
    def downsample_kernel(self) -> int:
        return 2 * int(-(-self.sampling_rate // self.hop_length) / self.frame_rate)


def parse_mimi_encoder_config(d: dict[str, Any]) -> MimiEncoderConfig:
    w = "speech_tokenizer.encoder_config"
    c = _get(d, "encoder_config", "speech_tokenizer", dict)
    cfg = MimiEncoderConfig(
        audio_channels=_get(c, "audio_channels", w, int),
        num_filters=_get(c, "num_filters", w, int),
        hidden_size=_get(c, "hidden_size", w, int),
        upsampling_ratios=tuple(_get(c, "upsampling_ratios", w, list)),
        kernel_size=_get(c, "kernel_size", w, int),
        last_kernel_size=_get(c, "last_kernel_size", w, int),
        residual_kernel_size=_get(c, "residual_kernel_size", w, int),
        num_residual_layers=_get(c, "num_residual_layers", w, int),
        compress=_get(c, "compress", w, int),
        num_hidden_layers=_get(c, "num_hidden_layers", w, int),
        num_attention_heads=_get(c, "num_attention_heads", w, int),
        num_key_value_heads=_get(c, "num_key_value_heads", w, int),
        head_dim=_get(c, "head_dim", w, int),
        intermediate_size=_get(c, "intermediate_size", w, int),
        codebook_size=_get(c, "codebook_size", w, int),
        codebook_dim=_get(c, "codebook_dim", w, int),
        vector_quantization_hidden_dimension=_get(c, "vector_quantization_hidden_dimension", w, int),
        num_quantizers=_get(c, "num_quantizers", w, int),
        num_semantic_quantizers=_get(c, "num_semantic_quantizers", w, int),
        sampling_rate=_get(c, "sampling_rate", w, int),
        frame_rate=_get(c, "frame_rate", w, float),
        use_conv_shortcut=bool(c.get("use_conv_shortcut", False)),
        dilation_growth_rate=int(c.get("dilation_growth_rate", 2)),
    )
    if cfg.codebook_dim != cfg.vector_quantization_hidden_dimension:
        # MimiModel sizes codebooks by codebook_dim but the RVQ projections by the hidden dimension;
        # they must agree for the quantizer to run.
        raise ConfigError(f"'{w}': codebook_dim must equal vector_quantization_hidden_dimension")
    return cfg


def mimi_encoder_layout(m: MimiEncoderConfig, prefix: str = "encoder") -> Layout:
    """The encoder half of a transformers-4.57 MimiModel (SEANet, transformer, downsample, RVQ)."""
    out: Layout = {}
    seanet = f"{prefix}.encoder.layers"
    add_conv(out, f"{seanet}.0.conv", m.num_filters, m.audio_channels, m.kernel_size)
    idx, scale = 1, 1
    for ratio in reversed(m.upsampling_ratios):
        width = scale * m.num_filters
        for _ in range(m.num_residual_layers):
            hidden = width // m.compress
            add_conv(out, f"{seanet}.{idx}.block.1.conv", hidden, width, m.residual_kernel_size)
            add_conv(out, f"{seanet}.{idx}.block.3.conv", width, hidden, 1)
            if m.use_conv_shortcut:
                add_conv(out, f"{seanet}.{idx}.shortcut.conv", width, width, 1)
            idx += 1
        idx += 1  # ELU
        add_conv(out, f"{seanet}.{idx}.conv", width * 2, width, ratio * 2)
        idx += 1
        scale *= 2
    idx += 1  # ELU
    add_conv(out, f"{seanet}.{idx}.conv", m.hidden_size, scale * m.num_filters, m.last_kernel_size)

    h = m.hidden_size
    for i in range(m.num_hidden_layers):
        lp = f"{prefix}.encoder_transformer.layers.{i}"
        out[f"{lp}.self_attn.q_proj.weight"] = (m.num_attention_heads * m.head_dim, h)
        out[f"{lp}.self_attn.k_proj.weight"] = (m.num_key_value_heads * m.head_dim, h)
        out[f"{lp}.self_attn.v_proj.weight"] = (m.num_key_value_heads * m.head_dim, h)
        out[f"{lp}.self_attn.o_proj.weight"] = (h, m.num_attention_heads * m.head_dim)
        out[f"{lp}.mlp.fc1.weight"] = (m.intermediate_size, h)
        out[f"{lp}.mlp.fc2.weight"] = (h, m.intermediate_size)
        out[f"{lp}.input_layernorm.weight"] = (h,)
        out[f"{lp}.input_layernorm.bias"] = (h,)
        out[f"{lp}.post_attention_layernorm.weight"] = (h,)
        out[f"{lp}.post_attention_layernorm.bias"] = (h,)
        out[f"{lp}.self_attn_layer_scale.scale"] = (h,)
        out[f"{lp}.mlp_layer_scale.scale"] = (h,)
    if m.has_downsample:
        out[f"{prefix}.downsample.conv.weight"] = (h, h, m.downsample_kernel)

    vq = m.vector_quantization_hidden_dimension
    for part, n in (("semantic_residual_vector_quantizer", m.num_semantic_quantizers),
                    ("acoustic_residual_vector_quantizer", m.num_quantizers - m.num_semantic_quantizers)):
        rq = f"{prefix}.quantizer.{part}"
        for i in range(n):
            out[f"{rq}.layers.{i}.codebook.initialized"] = (1,)
            out[f"{rq}.layers.{i}.codebook.cluster_usage"] = (m.codebook_size,)
            out[f"{rq}.layers.{i}.codebook.embed_sum"] = (m.codebook_size, m.codebook_dim)
        if vq != h:
            out[f"{rq}.input_proj.weight"] = (vq, h, 1)
            out[f"{rq}.output_proj.weight"] = (h, vq, 1)
    return out


def speech_tokenizer_layout(v: VocoderConfig, m: MimiEncoderConfig) -> Layout:
    """Every tensor of `speech_tokenizer/model.safetensors`."""
    out = mimi_encoder_layout(m)
    out.update(vocoder_layout(v))
    return out


def count_params(layout: Layout) -> int:
    total = 0
    for shape in layout.values():
        n = 1
        for s in shape:
            n *= s
        total += n
    return total
