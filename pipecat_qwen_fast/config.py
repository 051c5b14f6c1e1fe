"""Strict parsing of Qwen3-TTS `config.json` files into dataclasses.

The official package's Python config classes carry stale defaults (EOS 4198, rope theta 1e4,
32 code groups, ...), and with those the model can never stop. So every key the engine uses must be
present in the file: a missing key raises ConfigError naming the key and its path, never a fallback.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipecat_qwen_fast.errors import ConfigError

# The model the CLI, the adapters and the demo load when none is named.
DEFAULT_MODEL = "Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice"

MODEL_TYPES = ("custom_voice", "voice_design", "base")
MODEL_SIZES = ("0b6", "1b7")


def _get(d: dict[str, Any], key: str, where: str, kind: type | tuple[type, ...] | None = None) -> Any:
    if not isinstance(d, dict):
        raise ConfigError(f"{where} must be a JSON object, got {type(d).__name__}")
    if key not in d:
        raise ConfigError(f"config key '{where}.{key}' is missing (no default is assumed)")
    value = d[key]
    if kind is not None:
        if kind is int and isinstance(value, bool):
            raise ConfigError(f"config key '{where}.{key}' must be an integer, got {value!r}")
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind):
            names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
            raise ConfigError(f"config key '{where}.{key}' must be {names}, got {value!r}")
    return value


@dataclass(frozen=True)
class DecoderStackConfig:
    """Shapes of one Qwen3 decoder stack (the talker or the code predictor)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int

    @classmethod
    def parse(cls, d: dict[str, Any], where: str) -> DecoderStackConfig:
        act = _get(d, "hidden_act", where, str)
        if act != "silu":
            raise ConfigError(f"'{where}.hidden_act' is {act!r}; only 'silu' is supported")
        if _get(d, "attention_bias", where, bool):
            raise ConfigError(f"'{where}.attention_bias' is true; Qwen3-TTS has no attention bias")
        cfg = cls(
            hidden_size=_get(d, "hidden_size", where, int),
            intermediate_size=_get(d, "intermediate_size", where, int),
            num_layers=_get(d, "num_hidden_layers", where, int),
            num_heads=_get(d, "num_attention_heads", where, int),
            num_kv_heads=_get(d, "num_key_value_heads", where, int),
            head_dim=_get(d, "head_dim", where, int),
            rms_norm_eps=_get(d, "rms_norm_eps", where, float),
            rope_theta=_get(d, "rope_theta", where, float),
            max_position_embeddings=_get(d, "max_position_embeddings", where, int),
        )
        if cfg.num_heads % cfg.num_kv_heads:
            raise ConfigError(f"'{where}': num_attention_heads must be a multiple of num_key_value_heads")
        if cfg.head_dim % 2:
            raise ConfigError(f"'{where}.head_dim' must be even for rotary embeddings")
        return cfg


@dataclass(frozen=True)
class TalkerConfig:
    stack: DecoderStackConfig
    text_hidden_size: int
    vocab_size: int
    text_vocab_size: int
    num_code_groups: int
    codec_bos_id: int
    codec_eos_id: int
    codec_pad_id: int
    codec_think_id: int
    codec_nothink_id: int
    codec_think_bos_id: int
    codec_think_eos_id: int
    language_ids: dict[str, int]
    speaker_ids: dict[str, int]
    speaker_dialect: dict[str, str | None]

    @property
    def hidden_size(self) -> int:
        return self.stack.hidden_size


@dataclass(frozen=True)
class PredictorConfig:
    stack: DecoderStackConfig
    vocab_size: int
    num_code_groups: int


@dataclass(frozen=True)
class ModelConfig:
    """Everything the engine needs from a model's config.json."""

    model_type: str  # custom_voice | voice_design | base
    model_size: str  # 0b6 | 1b7
    talker: TalkerConfig
    predictor: PredictorConfig
    im_start_id: int
    im_end_id: int
    assistant_id: int
    tts_pad_id: int
    tts_bos_id: int
    tts_eos_id: int
    speaker_encoder_dim: int | None  # Base only
    speaker_encoder_sample_rate: int | None
    raw: dict[str, Any] = field(repr=False, compare=False, default_factory=dict)

    @property
    def accepts_instruct(self) -> bool:
        # The official wrapper silently drops instruct for the 0.6B CustomVoice model and Base
        # models have no instruct argument at all; we raise instead of silently ignoring.
        if self.model_type == "voice_design":
            return True
        return self.model_type == "custom_voice" and self.model_size == "1b7"


def parse_model_config(d: dict[str, Any]) -> ModelConfig:
    tokenizer_type = _get(d, "tokenizer_type", "config", str)
    if tokenizer_type != "qwen3_tts_tokenizer_12hz":
        raise ConfigError(
            f"'config.tokenizer_type' is {tokenizer_type!r}; only the 12 Hz family "
            "('qwen3_tts_tokenizer_12hz') is supported"
        )
    model_type = _get(d, "tts_model_type", "config", str)
    if model_type not in MODEL_TYPES:
        raise ConfigError(f"'config.tts_model_type' is {model_type!r}; valid: {', '.join(MODEL_TYPES)}")
    model_size = _get(d, "tts_model_size", "config", str)
    if model_size not in MODEL_SIZES:
        raise ConfigError(f"'config.tts_model_size' is {model_size!r}; valid: {', '.join(MODEL_SIZES)}")

    t = _get(d, "talker_config", "config", dict)
    w = "config.talker_config"
    p = _get(t, "code_predictor_config", w, dict)
    wp = w + ".code_predictor_config"

    lang = _get(t, "codec_language_id", w, dict)
    spk = _get(t, "spk_id", w, dict)
    dialect_raw = _get(t, "spk_is_dialect", w, dict)
    for name, value in list(lang.items()) + list(spk.items()):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"'{w}': id of {name!r} must be an integer, got {value!r}")
    dialect: dict[str, str | None] = {}
    for name, value in dialect_raw.items():
        if value is False or value is None:
            dialect[name] = None
        elif isinstance(value, str) and value in lang:
            dialect[name] = value
        else:
            raise ConfigError(f"'{w}.spk_is_dialect.{name}' must be false or a language name, got {value!r}")

    talker = TalkerConfig(
        stack=DecoderStackConfig.parse(t, w),
        text_hidden_size=_get(t, "text_hidden_size", w, int),
        vocab_size=_get(t, "vocab_size", w, int),
        text_vocab_size=_get(t, "text_vocab_size", w, int),
        num_code_groups=_get(t, "num_code_groups", w, int),
        codec_bos_id=_get(t, "codec_bos_id", w, int),
        codec_eos_id=_get(t, "codec_eos_token_id", w, int),
        codec_pad_id=_get(t, "codec_pad_id", w, int),
        codec_think_id=_get(t, "codec_think_id", w, int),
        codec_nothink_id=_get(t, "codec_nothink_id", w, int),
        codec_think_bos_id=_get(t, "codec_think_bos_id", w, int),
        codec_think_eos_id=_get(t, "codec_think_eos_id", w, int),
        language_ids={k.lower(): v for k, v in lang.items()},
        speaker_ids={k.lower(): v for k, v in spk.items()},
        speaker_dialect={k.lower(): v for k, v in dialect.items()},
    )
    predictor = PredictorConfig(
        stack=DecoderStackConfig.parse(p, wp),
        vocab_size=_get(p, "vocab_size", wp, int),
        num_code_groups=_get(p, "num_code_groups", wp, int),
    )
    if predictor.num_code_groups != talker.num_code_groups:
        raise ConfigError("talker and code predictor disagree on num_code_groups")
    for name in ("codec_bos_id", "codec_eos_id", "codec_pad_id"):
        if not 0 <= getattr(talker, name) < talker.vocab_size:
            raise ConfigError(f"'{w}.{name}' = {getattr(talker, name)} lies outside the codec vocab")

    enc_dim = enc_sr = None
    if model_type == "base":
        s = _get(d, "speaker_encoder_config", "config", dict)
        enc_dim = _get(s, "enc_dim", "config.speaker_encoder_config", int)
        enc_sr = _get(s, "sample_rate", "config.speaker_encoder_config", int)
        if enc_dim != talker.hidden_size:
            raise ConfigError("speaker_encoder_config.enc_dim must equal the talker hidden_size")

    return ModelConfig(
        model_type=model_type,
        model_size=model_size,
        talker=talker,
        predictor=predictor,
        im_start_id=_get(d, "im_start_token_id", "config", int),
        im_end_id=_get(d, "im_end_token_id", "config", int),
        assistant_id=_get(d, "assistant_token_id", "config", int),
        tts_pad_id=_get(d, "tts_pad_token_id", "config", int),
        tts_bos_id=_get(d, "tts_bos_token_id", "config", int),
        tts_eos_id=_get(d, "tts_eos_token_id", "config", int),
        speaker_encoder_dim=enc_dim,
        speaker_encoder_sample_rate=enc_sr,
        raw=d,
    )


@dataclass(frozen=True)
class VocoderConfig:
    """The speech-tokenizer decoder (spec §8.1)."""

    codebook_size: int
    codebook_dim: int  # 512; vectors inside the codebooks are codebook_dim // 2 wide
    num_quantizers: int
    num_semantic_quantizers: int
    latent_dim: int
    decoder_dim: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    sliding_window: int
    max_position_embeddings: int
    upsample_rates: tuple[int, ...]
    upsampling_ratios: tuple[int, ...]
    upsample_rate: int  # samples per frame (1920)
    sample_rate: int

    @property
    def codebook_vector_dim(self) -> int:
        return self.codebook_dim // 2


def parse_vocoder_config(d: dict[str, Any]) -> VocoderConfig:
    mt = _get(d, "model_type", "speech_tokenizer", str)
    if mt != "qwen3_tts_tokenizer_12hz":
        raise ConfigError(f"speech_tokenizer model_type is {mt!r}; expected 'qwen3_tts_tokenizer_12hz'")
    w = "speech_tokenizer.decoder_config"
    c = _get(d, "decoder_config", "speech_tokenizer", dict)
    act = _get(c, "hidden_act", w, str)
    if act != "silu":
        raise ConfigError(f"'{w}.hidden_act' is {act!r}; only 'silu' is supported")
    cfg = VocoderConfig(
        codebook_size=_get(c, "codebook_size", w, int),
        codebook_dim=_get(c, "codebook_dim", w, int),
        num_quantizers=_get(c, "num_quantizers", w, int),
        num_semantic_quantizers=_get(c, "num_semantic_quantizers", w, int),
        latent_dim=_get(c, "latent_dim", w, int),
        decoder_dim=_get(c, "decoder_dim", w, int),
        hidden_size=_get(c, "hidden_size", w, int),
        intermediate_size=_get(c, "intermediate_size", w, int),
        num_layers=_get(c, "num_hidden_layers", w, int),
        num_heads=_get(c, "num_attention_heads", w, int),
        num_kv_heads=_get(c, "num_key_value_heads", w, int),
        head_dim=_get(c, "head_dim", w, int),
        rms_norm_eps=_get(c, "rms_norm_eps", w, float),
        rope_theta=_get(c, "rope_theta", w, float),
        sliding_window=_get(c, "sliding_window", w, int),
        max_position_embeddings=_get(c, "max_position_embeddings", w, int),
        upsample_rates=tuple(_get(c, "upsample_rates", w, list)),
        upsampling_ratios=tuple(_get(c, "upsampling_ratios", w, list)),
        upsample_rate=_get(d, "decode_upsample_rate", "speech_tokenizer", int),
        sample_rate=_get(d, "output_sample_rate", "speech_tokenizer", int),
    )
    total = 1
    for r in cfg.upsample_rates + cfg.upsampling_ratios:
        total *= r
    if total != cfg.upsample_rate:
        raise ConfigError(
            f"speech_tokenizer: upsample_rates x upsampling_ratios = {total}, "
            f"but decode_upsample_rate = {cfg.upsample_rate}"
        )
    return cfg


@dataclass(frozen=True)
class GenerationDefaults:
    """Sampling defaults from generation_config.json (spec §6).

    The official wrapper's fall-backs for keys the file lacks are these same values except
    max_new_tokens, where it uses 2048; we mirror that documented behaviour.
    """

    do_sample: bool = True
    repetition_penalty: float = 1.05
    temperature: float = 0.9
    top_k: int = 50
    top_p: float = 1.0
    subtalker_do_sample: bool = True
    subtalker_temperature: float = 0.9
    subtalker_top_k: int = 50
    subtalker_top_p: float = 1.0
    max_new_tokens: int = 2048

    @classmethod
    def parse(cls, d: dict[str, Any]) -> GenerationDefaults:
        base = cls()
        kw: dict[str, Any] = {}
        keys = {
            "do_sample": "do_sample",
            "repetition_penalty": "repetition_penalty",
            "temperature": "temperature",
            "top_k": "top_k",
            "top_p": "top_p",
            "subtalker_dosample": "subtalker_do_sample",
            "subtalker_temperature": "subtalker_temperature",
            "subtalker_top_k": "subtalker_top_k",
            "subtalker_top_p": "subtalker_top_p",
            "max_new_tokens": "max_new_tokens",
        }
        for src, dst in keys.items():
            kw[dst] = type(getattr(base, dst))(d[src]) if src in d else getattr(base, dst)
        return cls(**kw)


def read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError as e:
        raise ConfigError(f"{path} does not exist") from e
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    return data
