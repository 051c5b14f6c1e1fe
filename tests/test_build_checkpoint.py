"""The random-checkpoint builder: files, names, values, determinism, CLI."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipecat_qwen_fast.checkpoints import load as checkpoint
from pipecat_qwen_fast.checkpoints.build import (
    build_checkpoint,
    main,
    main_model_init,
    make_tensor,
    safetensors_file_size,
    tensor_seed,
    write_random_safetensors,
)
from pipecat_qwen_fast.checkpoints.layout import main_model_layout, speech_tokenizer_layout

FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "vocab.json",
    "merges.txt",
    "tokenizer_config.json",
    "speech_tokenizer/config.json",
    "speech_tokenizer/model.safetensors",
    "speech_tokenizer/preprocessor_config.json",
)


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("variant", ["custom_voice", "voice_design", "base"])
def test_every_file_is_written_and_loads(tiny_checkpoint, variant):
    d = tiny_checkpoint(variant)
    for rel in FILES:
        assert (d / rel).is_file(), rel
    cfg = checkpoint.load_model_config(d)
    assert cfg.model_type == variant
    layout = main_model_layout(cfg)
    sd = checkpoint.load_state_dict(d / "model.safetensors", progress=False)
    assert {k: tuple(v.shape) for k, v in sd.items()} == layout
    assert all(v.dtype == torch.bfloat16 and torch.isfinite(v.float()).all() for v in sd.values())
    assert (d / "model.safetensors").stat().st_size == safetensors_file_size(layout, torch.bfloat16)

    st_layout = speech_tokenizer_layout(checkpoint.load_vocoder_config(d), checkpoint.load_mimi_encoder_config(d))
    st = checkpoint.load_state_dict(d / "speech_tokenizer" / "model.safetensors", progress=False)
    assert {k: tuple(v.shape) for k, v in st.items()} == st_layout
    assert all(v.dtype == torch.float32 and torch.isfinite(v).all() for v in st.values())

    if variant == "base":
        assert json.loads((d / "config.json").read_text())["speaker_encoder_config"] == {
            "enc_dim": 64, "sample_rate": 24000}
        assert any(k.startswith("speaker_encoder.") for k in sd)
    else:
        assert "speaker_encoder_config" not in json.loads((d / "config.json").read_text())


def test_values_are_random_and_realistic(tiny_checkpoint):
    d = tiny_checkpoint()
    sd = {k: v.float() for k, v in load_file(d / "model.safetensors").items()}
    norm = sd["talker.model.layers.0.input_layernorm.weight"]
    assert 0.9 < norm.mean() < 1.1 and norm.std() > 0.01
    head = sd["talker.codec_head.weight"]
    assert 0.015 < head.std() < 0.025 and abs(head.mean()) < 0.002
    assert head[2150].abs().sum() > 0  # EOS row intact unless zero_eos
    assert sd["talker.text_projection.linear_fc1.bias"].abs().sum() > 0

    st = load_file(d / "speech_tokenizer" / "model.safetensors")
    usage = [v for k, v in st.items() if k.endswith("cluster_usage")]
    assert len(usage) == 16 + 32 and all((u > 0).all() for u in usage)
    emb = st["decoder.quantizer.rvq_first.vq.layers.0._codebook.embedding_sum"]
    assert 0.8 < emb.std() < 1.2
    for name in ("decoder.decoder.1.block.0.alpha", "decoder.decoder.5.beta"):
        assert st[name].std() > 0.1  # SnakeBeta not left at the official zero init
    scale = st["decoder.pre_transformer.layers.0.self_attn_layer_scale.scale"]
    assert scale.min() > 0 and scale.std() > 0.01  # LayerScale not the constant 0.01
    assert st["decoder.upsample.0.1.gamma"].min() > 1e-3  # ConvNeXt gamma not 1e-6
    assert (st["encoder.quantizer.semantic_residual_vector_quantizer.layers.0.codebook.initialized"] == 1).all()


def test_zero_eos_zeroes_only_the_eos_row(tiny_checkpoint):
    plain = load_file(tiny_checkpoint() / "model.safetensors")
    zeroed = load_file(tiny_checkpoint(zero_eos=True) / "model.safetensors")
    head, zhead = plain["talker.codec_head.weight"], zeroed["talker.codec_head.weight"]
    assert (zhead[2150] == 0).all()
    others = torch.ones(head.shape[0], dtype=torch.bool)
    others[2150] = False
    assert torch.equal(head[others], zhead[others])
    for k in plain:
        if k != "talker.codec_head.weight":
            assert torch.equal(plain[k], zeroed[k]), k


def test_build_is_deterministic_per_seed(tiny_checkpoint, tmp_path):
    ref = tiny_checkpoint("voice_design")
    again = build_checkpoint(tmp_path / "a", "tiny", "voice_design", seed=0)
    for rel in FILES:
        assert sha256(again / rel) == sha256(ref / rel), rel
    other = build_checkpoint(tmp_path / "b", "tiny", "voice_design", seed=1)
    assert sha256(other / "model.safetensors") != sha256(ref / "model.safetensors")


def test_streamed_file_equals_safetensors_own_writer(tmp_path):
    layout = {"b.weight": (3, 5), "a.norm.weight": (7,), "c.bias": (2,), "d.weight": (4, 2, 3)}
    ours = tmp_path / "ours.safetensors"
    write_random_safetensors(ours, layout, torch.bfloat16, seed=3, init_of=main_model_init)
    tensors = load_file(ours)
    gen = torch.Generator()
    for name, shape in layout.items():
        gen.manual_seed(tensor_seed(3, name))
        assert torch.equal(tensors[name], make_tensor(shape, main_model_init(name, shape), torch.bfloat16, gen))
    theirs = tmp_path / "theirs.safetensors"
    save_file(tensors, theirs, metadata={"format": "pt"})
    assert ours.read_bytes() == theirs.read_bytes()


def test_generation_and_preprocessor_configs(tiny_checkpoint):
    d = tiny_checkpoint()
    gen = d / "generation_config.json"
    assert gen.stat().st_size == 245  # the released file's size
    assert json.loads(gen.read_text())["max_new_tokens"] == 8192
    pre = json.loads((d / "speech_tokenizer" / "preprocessor_config.json").read_text())
    assert pre["feature_extractor_type"] == "EncodecFeatureExtractor" and pre["sampling_rate"] == 24000


def test_size_tag_and_float32(tmp_path):
    d = build_checkpoint(tmp_path / "t", "tiny", "custom_voice", dtype="float32", size_tag="0b6")
    cfg = checkpoint.load_model_config(d)
    assert cfg.model_size == "0b6" and not cfg.accepts_instruct
    sd = load_file(d / "model.safetensors")
    assert all(v.dtype == torch.float32 for v in sd.values())


def test_cli_writes_a_checkpoint(tmp_path, capsys):
    out = tmp_path / "cli"
    assert main(["--size", "tiny", "--variant", "base", "--out", str(out), "--seed", "5", "--zero-eos"]) == 0
    assert checkpoint.resolve_model_dir(out) == out
    assert (load_file(out / "model.safetensors")["talker.codec_head.weight"][2150] == 0).all()
    assert "wrote tiny base checkpoint" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--size", "0.6b", "--variant", "voice_design"], "no 0.6B VoiceDesign"),
        (["--size", "2b", "--variant", "base"], "invalid choice"),
        (["--size", "tiny", "--variant", "clone"], "invalid choice"),
        (["--size", "tiny", "--variant", "base", "--dtype", "int8"], "invalid choice"),
    ],
)
def test_cli_rejects_bad_arguments(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        main(argv + ["--out", str(tmp_path / "x")])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_function_rejects_bad_arguments(tmp_path):
    from pipecat_qwen_fast.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match="valid: tiny, 0.6b, 1.7b"):
        build_checkpoint(tmp_path, "3b", "base")
    with pytest.raises(InvalidInputError, match="dtype"):
        build_checkpoint(tmp_path, "tiny", "base", dtype="float16")
