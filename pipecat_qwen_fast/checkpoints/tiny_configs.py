"""Config dicts for every checkpoint size the builder can write.

Full sizes are the released configs, shipped verbatim under `assets/configs/`. The tiny size (spec
§10) keeps everything that selects a code path real: the 151936-row text vocab, the 3072-row
codec vocab with the real special, language and speaker ids, 16 code groups, 2048-entry codebooks,
M-RoPE sections, the vocoder's sliding window and the 1920-samples-per-frame rates. Only widths and
depths shrink; the predictor is narrower than the talker so `small_to_mtp_projection` exists.
"""

from __future__ import annotations

import copy
import json
from importlib import resources
from typing import Any

from pipecat_qwen_fast.errors import InvalidInputError

SIZES = ("tiny", "0.6b", "1.7b")
VARIANTS = ("custom_voice", "voice_design", "base")


def read_asset_config(name: str) -> dict[str, Any]:
    text = resources.files("pipecat_qwen_fast").joinpath("assets", "configs", name).read_text("utf-8")
    return json.loads(text)


def check_size_variant(size: str, variant: str) -> None:
    if size not in SIZES:
        raise InvalidInputError(f"unknown size {size!r}; valid: {', '.join(SIZES)}")
    if variant not in VARIANTS:
        raise InvalidInputError(f"unknown variant {variant!r}; valid: {', '.join(VARIANTS)}")
    if size == "0.6b" and variant == "voice_design":
        raise InvalidInputError(
            "there is no 0.6B VoiceDesign model; voice_design exists only as 1.7b (or tiny)"
        )


def tiny_talker_dict(base: dict[str, Any]) -> dict[str, Any]:
    t = copy.deepcopy(base)
    t.update(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        text_hidden_size=32,
    )
    t["rope_scaling"]["mrope_section"] = [4, 2, 2]
    p = t["code_predictor_config"]
    p.update(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        layer_types=["full_attention"] * 2,
    )
    return t


def model_config_dict(size: str, variant: str, size_tag: str | None = None) -> dict[str, Any]:
    """config.json of a checkpoint.

    size_tag overrides `tts_model_size` for tiny builds ("0b6" or "1b7"; default "1b7", since the
    tiny shapes follow the 1.7B structure). The official wrapper keys behaviour on it, e.g. it drops
    `instruct` for "0b6" CustomVoice models.
    """
    check_size_variant(size, variant)
    if size != "tiny":
        if size_tag is not None:
            raise InvalidInputError("size_tag applies to tiny builds only")
        return read_asset_config(f"{size}-{variant}.config.json")
    # Only 1.7B exists for every variant; its speaker/language tables equal the 0.6B ones.
    d = read_asset_config(f"1.7b-{variant}.config.json")
    tag = size_tag or "1b7"
    if tag not in ("0b6", "1b7"):
        raise InvalidInputError(f"unknown size_tag {tag!r}; valid: 0b6, 1b7")
    d["tts_model_size"] = tag
    d["talker_config"] = tiny_talker_dict(d["talker_config"])
    if variant == "base":
        d["speaker_encoder_config"] = {"enc_dim": d["talker_config"]["hidden_size"], "sample_rate": 24000}
    return d


def speech_tokenizer_config_dict(size: str) -> dict[str, Any]:
    d = read_asset_config("speech_tokenizer.config.json")
    if size not in SIZES:
        raise InvalidInputError(f"unknown size {size!r}; valid: {', '.join(SIZES)}")
    if size != "tiny":
        return d
    d["decoder_config"].update(
        latent_dim=32,
        codebook_dim=32,
        decoder_dim=64,
        hidden_size=32,
        intermediate_size=64,
        head_dim=16,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_hidden_layers=2,
        vector_quantization_hidden_dimension=32,
    )
    d["encoder_config"].update(
        hidden_size=32,
        num_filters=4,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=64,
        codebook_dim=16,
        vector_quantization_hidden_dimension=16,
        # MimiModel builds (then drops) a grouped transposed conv with this many groups; the
        # default 512 does not divide the tiny width.
        upsample_groups=32,
    )
    return d
