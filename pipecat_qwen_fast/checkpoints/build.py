"""Write a random-weight Qwen3-TTS checkpoint in the real Hugging Face layout.

    python -m pipecat_qwen_fast.checkpoints.build --size tiny|0.6b|1.7b \\
        --variant custom_voice|voice_design|base --out DIR [--seed N] [--zero-eos] \\
        [--dtype bfloat16|float32] [--size-tag 0b6|1b7]

Real weights cannot be downloaded here; tests, the official-package oracle and GPU benchmarks run on
these instead. Every file of a released model repo is written (spec §1, §10): config.json,
generation_config.json, model.safetensors, text-tokenizer files and speech_tokenizer/{config.json,
model.safetensors, preprocessor_config.json}. Values are random but shaped like trained ones: the
official init leaves codebooks, SnakeBeta and LayerScale at constants, which hides bugs.

Tensors are generated one at a time, directly in the target dtype, and streamed into the file, so
a full-size build needs memory for the largest tensor only.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import torch

from pipecat_qwen_fast.checkpoints.layout import (
    Layout,
    Shape,
    main_model_layout,
    parse_mimi_encoder_config,
    speech_tokenizer_layout,
)
from pipecat_qwen_fast.checkpoints.synthetic_tokenizer import write_tokenizer_files
from pipecat_qwen_fast.checkpoints.tiny_configs import (
    SIZES,
    VARIANTS,
    check_size_variant,
    model_config_dict,
    speech_tokenizer_config_dict,
)
from pipecat_qwen_fast.config import parse_model_config, parse_vocoder_config
from pipecat_qwen_fast.errors import InvalidInputError

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
SAFETENSORS_DTYPE = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float16: "F16"}

# generation_config.json of the released models (spec §6), in the released key order.
GENERATION_CONFIG = {
    "do_sample": True,
    "repetition_penalty": 1.05,
    "temperature": 0.9,
    "top_p": 1.0,
    "top_k": 50,
    "subtalker_dosample": True,
    "subtalker_temperature": 0.9,
    "subtalker_top_p": 1.0,
    "subtalker_top_k": 50,
    "max_new_tokens": 8192,
}

# What transformers' EncodecFeatureExtractor reads for the speech tokenizer's encode path.
PREPROCESSOR_CONFIG = {
    "chunk_length_s": None,
    "feature_extractor_type": "EncodecFeatureExtractor",
    "feature_size": 1,
    "overlap": None,
    "padding_side": "right",
    "padding_value": 0.0,
    "return_attention_mask": True,
    "sampling_rate": 24000,
}

# The speech tokenizer is written in float32 whatever the main model's dtype.
SPEECH_TOKENIZER_DTYPE = torch.float32

MAIN_LINEAR_STD = 0.02  # the talker/predictor's HF init scale
NORM_NOISE_STD = 0.05
BIAS_STD = 0.02
# The vocoder ends in clamp(-1, 1); a smaller last conv keeps random audio mostly unclipped.
VOCODER_OUTPUT_GAIN = 0.1
# Residual branches (vocoder residual units, SEANet blocks) add to their input; at full gain the
# activations grow ~3x per upsampling block and the random waveform is a clipped square wave.
RESIDUAL_BRANCH_GAIN = 0.3

Init = tuple[str, float, float]  # (kind, a, b): normal(mean=a, std=b) | uniform(a, b) | const(a)


def tensor_seed(seed: int, name: str) -> int:
    # Per-name streams: a tensor's values depend only on (seed, name), not on build order.
    return (seed * 0x9E3779B1 + zlib.crc32(name.encode())) % (2**63)


def is_transposed_conv(name: str) -> bool:
    return bool(re.search(r"\.upsample\.\d+\.0\.conv\.weight$|\.decoder\.\d+\.block\.1\.conv\.weight$", name))


def fan_in(name: str, shape: Shape) -> int:
    if len(shape) == 2:
        return shape[1]
    if is_transposed_conv(name):
        # [in, out, k] with stride k (upsample) or k/2 (decoder blocks): ~in * k / stride taps.
        return shape[0] * (1 if ".upsample." in name else 2)
    return shape[1] * shape[2]


def is_norm_weight(name: str) -> bool:
    return bool(re.search(r"(norm|layernorm)\.weight$", name))


def main_model_init(name: str, shape: Shape) -> Init:
    if name.startswith("speaker_encoder."):
        if name.endswith(".bias"):
            return ("normal", 0.0, BIAS_STD)
        # Every TDNN conv is followed by ReLU: He scale keeps activations from shrinking.
        return ("normal", 0.0, math.sqrt(2.0 / fan_in(name, shape)))
    if is_norm_weight(name):
        return ("normal", 1.0, NORM_NOISE_STD)
    if name.endswith(".bias"):
        return ("normal", 0.0, BIAS_STD)
    return ("normal", 0.0, MAIN_LINEAR_STD)


def speech_tokenizer_init(name: str, shape: Shape, last_conv: str) -> Init:
    if name.endswith("codebook.initialized"):
        return ("const", 1.0, 0.0)
    if name.endswith("cluster_usage"):
        return ("uniform", 0.5, 2.0)
    if name.endswith(("embedding_sum", "embed_sum")):
        return ("normal", 0.0, 1.0)
    if name.endswith((".alpha", ".beta")):  # SnakeBeta, log scale
        return ("normal", 0.0, 0.3)
    if name.endswith("layer_scale.scale"):
        return ("uniform", 0.02, 0.2)
    if name.endswith(".gamma"):  # ConvNeXt
        return ("uniform", 0.05, 0.3)
    if is_norm_weight(name):
        return ("normal", 1.0, NORM_NOISE_STD)
    if name.endswith(".bias"):
        return ("normal", 0.0, BIAS_STD)
    gain = 1.0
    if name == last_conv:
        gain = VOCODER_OUTPUT_GAIN
    elif re.search(r"\.conv2\.conv\.weight$|\.block\.3\.conv\.weight$", name):
        gain = RESIDUAL_BRANCH_GAIN
    return ("normal", 0.0, gain / math.sqrt(fan_in(name, shape)))


def make_tensor(shape: Shape, init: Init, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    kind, a, b = init
    t = torch.empty(shape, dtype=dtype)
    if kind == "normal":
        t.normal_(a, b, generator=gen)
    elif kind == "uniform":
        t.uniform_(a, b, generator=gen)
    else:
        t.fill_(a)
    return t


def safetensors_header(layout: Layout, dtype: torch.dtype) -> bytes:
    """The header safetensors itself writes: tensors in name order, padded to 8 bytes."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    entries: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in sorted(layout):
        n = math.prod(layout[name]) * itemsize
        entries[name] = {"dtype": SAFETENSORS_DTYPE[dtype], "shape": list(layout[name]),
                         "data_offsets": [offset, offset + n]}
        offset += n
    header = json.dumps(entries, separators=(",", ":")).encode()
    return header + b" " * (-len(header) % 8)


def safetensors_file_size(layout: Layout, dtype: torch.dtype) -> int:
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 8 + len(safetensors_header(layout, dtype)) + itemsize * sum(math.prod(s) for s in layout.values())


def write_random_safetensors(path: Path, layout: Layout, dtype: torch.dtype, seed: int,
                             init_of: Callable[[str, Shape], Init],
                             edit: Callable[[str, torch.Tensor], None] | None = None) -> None:
    header = safetensors_header(layout, dtype)
    gen = torch.Generator()
    with open(path, "wb") as f:
        f.write(len(header).to_bytes(8, "little"))
        f.write(header)
        for name in sorted(layout):
            gen.manual_seed(tensor_seed(seed, name))
            t = make_tensor(layout[name], init_of(name, layout[name]), dtype, gen)
            if edit is not None:
                edit(name, t)
            # Raw little-endian bytes, as safetensors stores them (bf16 has no numpy dtype).
            f.write(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")


def write_json(path: Path, data: dict, indent: int = 2) -> None:
    path.write_text(json.dumps(data, indent=indent, ensure_ascii=False) + "\n", encoding="utf-8")


def build_checkpoint(out_dir: str | Path, size: str = "tiny", variant: str = "custom_voice", seed: int = 0,
                     zero_eos: bool = False, dtype: str | torch.dtype = "bfloat16",
                     size_tag: str | None = None) -> Path:
    """Write a complete random checkpoint into out_dir (created; existing files are overwritten)."""
    check_size_variant(size, variant)
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise InvalidInputError(f"unknown dtype {dtype!r}; valid: {', '.join(DTYPES)}")
        dtype = DTYPES[dtype]
    if dtype not in DTYPES.values():
        raise InvalidInputError(f"unsupported dtype {dtype}; valid: {', '.join(DTYPES)}")
    out = Path(out_dir)
    (out / "speech_tokenizer").mkdir(parents=True, exist_ok=True)

    model_dict = model_config_dict(size, variant, size_tag)
    cfg = parse_model_config(model_dict)  # the builder must write what our loader accepts
    st_dict = speech_tokenizer_config_dict(size)
    vcfg = parse_vocoder_config(st_dict)
    mcfg = parse_mimi_encoder_config(st_dict)

    eos_row = cfg.talker.codec_eos_id

    def zero_eos_row(name: str, t: torch.Tensor) -> None:
        if zero_eos and name == "talker.codec_head.weight":
            t[eos_row].zero_()

    write_json(out / "config.json", model_dict)
    # Released file: indent 2, no trailing newline (245 bytes).
    (out / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2), encoding="utf-8")
    write_random_safetensors(out / "model.safetensors", main_model_layout(cfg), dtype, seed,
                             main_model_init, zero_eos_row)
    write_tokenizer_files(out)

    st_layout = speech_tokenizer_layout(vcfg, mcfg)
    last_conv = f"decoder.decoder.{len(vcfg.upsample_rates) + 2}.conv.weight"
    write_json(out / "speech_tokenizer" / "config.json", st_dict)
    write_json(out / "speech_tokenizer" / "preprocessor_config.json", PREPROCESSOR_CONFIG)
    write_random_safetensors(out / "speech_tokenizer" / "model.safetensors", st_layout,
                             SPEECH_TOKENIZER_DTYPE, seed + 1,
                             lambda n, s: speech_tokenizer_init(n, s, last_conv))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m pipecat_qwen_fast.checkpoints.build",
        description="Write a random-weight Qwen3-TTS checkpoint in the Hugging Face layout.",
    )
    ap.add_argument("--size", required=True, choices=SIZES)
    ap.add_argument("--variant", required=True, choices=VARIANTS)
    ap.add_argument("--out", required=True, type=Path, help="output folder (created; files overwritten)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--zero-eos", action="store_true",
                    help="zero the codec-head EOS row so generation runs to its frame cap (benchmarks)")
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16",
                    help="dtype of model.safetensors (the speech tokenizer is always float32)")
    ap.add_argument("--size-tag", choices=("0b6", "1b7"), default=None,
                    help="tts_model_size written into a tiny config (default 1b7)")
    args = ap.parse_args(argv)
    t0 = time.time()
    try:
        build_checkpoint(args.out, args.size, args.variant, seed=args.seed, zero_eos=args.zero_eos,
                         dtype=args.dtype, size_tag=args.size_tag)
    except InvalidInputError as e:
        ap.error(str(e))
    total = sum(p.stat().st_size for p in args.out.rglob("*") if p.is_file())
    print(f"wrote {args.size} {args.variant} checkpoint to {args.out} "
          f"({total / 1e6:.1f} MB, {time.time() - t0:.1f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
