"""Config strictness, checkpoint layout against the released sizes, and checkpoint loading errors."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch

from pipecat_qwen_fast.checkpoints import load as checkpoint
from pipecat_qwen_fast.checkpoints.build import safetensors_file_size
from pipecat_qwen_fast.checkpoints.layout import (
    count_params,
    main_model_layout,
    mimi_encoder_layout,
    parse_mimi_encoder_config,
    speaker_encoder_layout,
    vocoder_layout,
)
from pipecat_qwen_fast.checkpoints.tiny_configs import (
    model_config_dict,
    read_asset_config,
    speech_tokenizer_config_dict,
)
from pipecat_qwen_fast.config import parse_model_config, parse_vocoder_config
from pipecat_qwen_fast.errors import ConfigError, ModelLoadError

FULL = ("0.6b-custom_voice", "0.6b-base", "1.7b-custom_voice", "1.7b-voice_design", "1.7b-base")


def real_config(name: str) -> dict:
    return read_asset_config(f"{name}.config.json")


def test_shipped_configs_are_the_spec_copies():
    spec_dir = Path("/work/shared/spec/configs")
    if not spec_dir.is_dir():
        pytest.skip("the shared spec folder is not on this machine")
    for name in FULL + ("speech_tokenizer",):
        assert real_config(name) == json.loads((spec_dir / f"{name}.config.json").read_text())


# ----------------------------------------------------------------------------- config strictness


@pytest.mark.parametrize(
    "path",
    [
        ("talker_config", "codec_eos_token_id"),
        ("talker_config", "rope_theta"),
        ("talker_config", "code_predictor_config", "num_code_groups"),
        ("tts_pad_token_id",),
        ("tokenizer_type",),
    ],
)
def test_missing_config_key_is_named(path):
    d = copy.deepcopy(real_config("0.6b-custom_voice"))
    node = d
    for key in path[:-1]:
        node = node[key]
    del node[path[-1]]
    with pytest.raises(ConfigError, match=path[-1]):
        parse_model_config(d)


def test_base_config_needs_speaker_encoder_section():
    d = real_config("0.6b-base")
    del d["speaker_encoder_config"]["enc_dim"]
    with pytest.raises(ConfigError, match="enc_dim"):
        parse_model_config(d)


@pytest.mark.parametrize(
    "key, value",
    [("hidden_size", "1024"), ("num_hidden_layers", 28.0), ("rope_theta", "1e6"), ("num_attention_heads", True)],
)
def test_wrong_type_is_rejected(key, value):
    d = real_config("1.7b-custom_voice")
    d["talker_config"][key] = value
    with pytest.raises(ConfigError, match=key):
        parse_model_config(d)


def test_stale_class_default_eos_is_rejected():
    d = real_config("0.6b-custom_voice")
    d["talker_config"]["codec_eos_token_id"] = 4198  # the official config class's stale default
    with pytest.raises(ConfigError, match="codec_eos_id"):
        parse_model_config(d)


def test_vocoder_config_missing_key_is_named():
    d = real_config("speech_tokenizer")
    del d["decoder_config"]["sliding_window"]
    with pytest.raises(ConfigError, match="sliding_window"):
        parse_vocoder_config(d)
    d = real_config("speech_tokenizer")
    del d["encoder_config"]["num_filters"]
    with pytest.raises(ConfigError, match="num_filters"):
        parse_mimi_encoder_config(d)


# ----------------------------------------------------------------------------- layout


def test_released_file_sizes_follow_from_the_layout():
    # HF lists 1.81 GB for 0.6B-CustomVoice; the exact byte counts are the spec's (§1, §10).
    cv06 = main_model_layout(parse_model_config(real_config("0.6b-custom_voice")))
    cv17 = main_model_layout(parse_model_config(real_config("1.7b-custom_voice")))
    assert safetensors_file_size(cv06, torch.bfloat16) == 1_811_626_576
    assert safetensors_file_size(cv17, torch.bfloat16) == 3_833_402_552


@pytest.mark.parametrize(
    "name, millions",
    [("0.6b-custom_voice", 905.8), ("0.6b-base", 914.6), ("1.7b-custom_voice", 1916.7),
     ("1.7b-voice_design", 1916.7), ("1.7b-base", 1928.7)],
)
def test_parameter_counts_match_spec(name, millions):
    n = count_params(main_model_layout(parse_model_config(real_config(name))))
    assert round(n / 1e6, 1) == millions


def test_speech_tokenizer_parameter_counts():
    d = real_config("speech_tokenizer")
    dec = vocoder_layout(parse_vocoder_config(d))
    enc = mimi_encoder_layout(parse_mimi_encoder_config(d))
    assert round(count_params(dec) / 1e6, 1) == 114.3
    # Mimi keeps its codebooks in buffers (embed_sum, cluster_usage, initialized); the spec's ~39 M
    # counts parameters only.
    params = {k: v for k, v in enc.items() if ".codebook." not in k}
    assert round(count_params(params) / 1e6) == 39
    assert sum(1 for k in enc if k.endswith("codebook.embed_sum")) == 32


def test_official_names_and_shapes():
    m06 = main_model_layout(parse_model_config(real_config("0.6b-custom_voice")))
    m17 = main_model_layout(parse_model_config(real_config("1.7b-base")))
    assert m06["talker.model.text_embedding.weight"] == (151936, 2048)
    assert m06["talker.text_projection.linear_fc2.weight"] == (1024, 2048)
    assert m06["talker.model.layers.27.self_attn.q_proj.weight"] == (2048, 1024)
    assert m06["talker.model.layers.0.self_attn.k_norm.weight"] == (128,)
    assert m06["talker.code_predictor.model.codec_embedding.14.weight"] == (2048, 1024)
    assert m06["talker.code_predictor.lm_head.14.weight"] == (2048, 1024)
    assert not any("small_to_mtp_projection" in k for k in m06)
    assert not any(k.startswith("speaker_encoder.") for k in m06)
    assert m17["talker.code_predictor.small_to_mtp_projection.weight"] == (1024, 2048)
    assert m17["talker.code_predictor.small_to_mtp_projection.bias"] == (1024,)
    assert m17["talker.code_predictor.model.codec_embedding.0.weight"] == (2048, 2048)
    assert m17["speaker_encoder.fc.weight"] == (2048, 3072, 1)
    assert m17["speaker_encoder.blocks.3.res2net_block.blocks.6.conv.weight"] == (64, 64, 3)
    assert count_params(speaker_encoder_layout(1024)) == 8_854_336

    d = real_config("speech_tokenizer")
    dec = vocoder_layout(parse_vocoder_config(d))
    assert dec["decoder.quantizer.rvq_rest.vq.layers.14._codebook.embedding_sum"] == (2048, 256)
    assert dec["decoder.quantizer.rvq_first.output_proj.weight"] == (512, 256, 1)
    assert dec["decoder.upsample.1.1.dwconv.conv.weight"] == (1024, 1, 7)
    assert dec["decoder.decoder.1.block.1.conv.weight"] == (1536, 768, 16)
    assert dec["decoder.decoder.4.block.4.act2.beta"] == (96,)
    assert dec["decoder.decoder.6.conv.weight"] == (1, 96, 7)
    assert dec["decoder.pre_transformer.layers.7.mlp_layer_scale.scale"] == (512,)
    enc = mimi_encoder_layout(parse_mimi_encoder_config(d))
    assert enc["encoder.encoder.layers.0.conv.weight"] == (64, 1, 7)
    assert enc["encoder.encoder.layers.14.conv.weight"] == (512, 1024, 3)
    assert enc["encoder.downsample.conv.weight"] == (512, 512, 4)
    assert enc["encoder.quantizer.acoustic_residual_vector_quantizer.layers.30.codebook.embed_sum"] == (2048, 256)
    assert enc["encoder.quantizer.semantic_residual_vector_quantizer.input_proj.weight"] == (256, 512, 1)


def test_tiny_configs_keep_the_real_ids_and_rates():
    for variant in ("custom_voice", "voice_design", "base"):
        tiny = parse_model_config(model_config_dict("tiny", variant))
        real = parse_model_config(real_config(f"1.7b-{variant}"))
        assert tiny.talker.speaker_ids == real.talker.speaker_ids
        assert tiny.talker.language_ids == real.talker.language_ids
        assert (tiny.talker.vocab_size, tiny.talker.text_vocab_size) == (3072, 151936)
        assert tiny.talker.codec_eos_id == 2150
        assert tiny.talker.hidden_size == 64 and tiny.predictor.stack.hidden_size == 32
    v = parse_vocoder_config(speech_tokenizer_config_dict("tiny"))
    assert v.upsample_rate == 1920 and v.codebook_size == 2048 and v.sliding_window == 72
    m = parse_mimi_encoder_config(speech_tokenizer_config_dict("tiny"))
    assert m.hop_length * 2 == 1920 and m.num_quantizers == 32


# ----------------------------------------------------------------------------- loading


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_resolve_local_folder(tiny_checkpoint):
    d = tiny_checkpoint()
    assert checkpoint.resolve_model_dir(d) == d
    assert checkpoint.resolve_model_dir(str(d)) == d


def test_missing_folder_is_named(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelLoadError, match="no-such-model"):
        checkpoint.resolve_model_dir(missing)
    with pytest.raises(ModelLoadError, match="does not exist"):
        checkpoint.resolve_model_dir(str(missing))


@pytest.mark.parametrize("rel", ["config.json", "model.safetensors", "speech_tokenizer/config.json",
                                 "speech_tokenizer/model.safetensors"])
def test_missing_file_is_named(tiny_checkpoint, tmp_path, rel):
    d = copy_checkpoint(tiny_checkpoint(), tmp_path / "ckpt")
    (d / rel).unlink()
    with pytest.raises(ModelLoadError, match=rel.replace(".", r"\.")):
        checkpoint.resolve_model_dir(d)


def test_missing_text_tokenizer_is_reported(tiny_checkpoint, tmp_path):
    d = copy_checkpoint(tiny_checkpoint(), tmp_path / "ckpt")
    (d / "tokenizer.json").unlink()
    (d / "vocab.json").unlink()
    with pytest.raises(ModelLoadError, match="tokenizer"):
        checkpoint.resolve_model_dir(d)


def test_unreachable_hub_id_says_how_to_get_it(monkeypatch, tmp_path):
    # An empty cache and an id that exists nowhere: offline or online, the answer is the same error.
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path / "hub"), raising=False)
    repo = "pipecat-qwen-fast-tests/no-such-model-1b"
    with pytest.raises(ModelLoadError) as err:
        checkpoint.resolve_model_dir(repo)
    msg = str(err.value)
    assert repo in msg
    assert "hf download" in msg
    assert "qwen-fast-tts build-checkpoint" in msg


def test_hub_id_found_in_the_local_cache(tiny_checkpoint, monkeypatch, tmp_path):
    # The huggingface_hub cache layout: models--{owner}--{name}/refs/main -> snapshots/{commit}/.
    import huggingface_hub.constants as hc

    cache = tmp_path / "hub"
    repo_dir = cache / "models--pipecat-qwen-fast-tests--cached-tiny"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(tiny_checkpoint(), repo_dir / "snapshots" / commit)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(commit)
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(cache), raising=False)
    got = checkpoint.resolve_model_dir("pipecat-qwen-fast-tests/cached-tiny")
    assert got == repo_dir / "snapshots" / commit
    assert checkpoint.load_model_config(got).model_type == "custom_voice"


def test_empty_model_string_is_rejected():
    with pytest.raises(ModelLoadError, match="empty"):
        checkpoint.resolve_model_dir("")


def test_config_loaders(tiny_checkpoint):
    d = tiny_checkpoint("base")
    cfg = checkpoint.load_model_config(d)
    assert cfg.model_type == "base" and cfg.speaker_encoder_dim == 64
    assert checkpoint.load_vocoder_config(d).sample_rate == 24000
    assert checkpoint.load_mimi_encoder_config(d).num_semantic_quantizers == 1
    gen = checkpoint.load_generation_defaults(d)
    assert gen.max_new_tokens == 8192 and gen.top_k == 50 and gen.repetition_penalty == 1.05


def test_generation_defaults_fall_back_when_file_is_absent(tiny_checkpoint, tmp_path):
    d = copy_checkpoint(tiny_checkpoint(), tmp_path / "ckpt")
    (d / "generation_config.json").unlink()
    assert checkpoint.load_generation_defaults(d).max_new_tokens == 2048


def test_load_state_dict_prefix_dtype_device(tiny_checkpoint):
    d = tiny_checkpoint()
    sd = checkpoint.load_state_dict(d / "model.safetensors", dtype=torch.float32, device="cpu",
                                    prefix="talker.code_predictor.", progress=False)
    assert sd and all(k.startswith("talker.code_predictor.") for k in sd)
    assert all(v.dtype == torch.float32 for v in sd.values())
    raw = checkpoint.load_state_dict(d / "model.safetensors", progress=False)
    assert raw["talker.codec_head.weight"].dtype == torch.bfloat16
    assert torch.equal(raw["talker.code_predictor.lm_head.3.weight"].float(), sd["talker.code_predictor.lm_head.3.weight"])


def test_load_state_dict_errors(tiny_checkpoint, tmp_path):
    with pytest.raises(ModelLoadError, match="missing"):
        checkpoint.load_state_dict(tmp_path / "nothing.safetensors", progress=False)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}      ")
    with pytest.raises(ModelLoadError, match="bad.safetensors"):
        checkpoint.load_state_dict(bad, progress=False)
    with pytest.raises(ModelLoadError, match="no tensors"):
        checkpoint.load_state_dict(tiny_checkpoint() / "model.safetensors", prefix="nope.", progress=False)
