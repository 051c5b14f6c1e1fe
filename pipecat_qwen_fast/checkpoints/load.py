"""Finding and reading a Qwen3-TTS checkpoint: folder or hub id, configs, weights, text tokenizer.

Layout (Hugging Face model repo, spec §1): config.json, generation_config.json, model.safetensors,
text-tokenizer files, speech_tokenizer/{config.json, model.safetensors, preprocessor_config.json}.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

import torch
from tqdm.auto import tqdm

from pipecat_qwen_fast.checkpoints.layout import MimiEncoderConfig, parse_mimi_encoder_config
from pipecat_qwen_fast.config import (
    GenerationDefaults,
    ModelConfig,
    VocoderConfig,
    parse_model_config,
    parse_vocoder_config,
    read_json,
)
from pipecat_qwen_fast.errors import ModelLoadError

log = logging.getLogger(__name__)

REQUIRED_FILES = (
    "config.json",
    "model.safetensors",
    "speech_tokenizer/config.json",
    "speech_tokenizer/model.safetensors",
)
TOKENIZER_FILES_HINT = "tokenizer.json, or vocab.json + merges.txt + tokenizer_config.json"

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")

BUILD_HINT = (
    "for testing without weights, build a random checkpoint: qwen-fast-tts build-checkpoint "
    "--size tiny --variant custom_voice --out DIR"
)


def download_hint(repo_id: str) -> str:
    return (
        f"On a machine with internet access run `hf download {repo_id} --local-dir DIR` "
        f"and pass that folder as the model; {BUILD_HINT}"
    )


def first_missing_file(path: Path) -> str | None:
    for rel in REQUIRED_FILES:
        if not (path / rel).is_file():
            return rel
    if not (path / "tokenizer.json").is_file() and not (path / "vocab.json").is_file():
        return f"text tokenizer ({TOKENIZER_FILES_HINT})"
    return None


def check_model_dir(path: Path) -> Path:
    """Raise ModelLoadError naming the first required file the folder lacks."""
    if not path.is_dir():
        raise ModelLoadError(f"model folder {path} does not exist (or is not a folder)")
    missing = first_missing_file(path)
    if missing is not None:
        raise ModelLoadError(
            f"model folder {path} has no {missing}; a Qwen3-TTS checkpoint needs "
            f"{', '.join(REQUIRED_FILES)} and the text-tokenizer files ({TOKENIZER_FILES_HINT})"
        )
    return path


def resolve_model_dir(model: str | os.PathLike[str]) -> Path:
    """A local checkpoint folder, or a hub id fetched (or found in the cache) with huggingface_hub."""
    text = os.fspath(model)
    if not text:
        raise ModelLoadError("model is empty; pass a local checkpoint folder or a Hugging Face hub id")
    path = Path(text).expanduser()
    if path.exists() or isinstance(model, Path) or not HUB_ID.match(text):
        return check_model_dir(path)
    return check_model_dir(download_snapshot(text))


def download_snapshot(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:
        raise ModelLoadError(f"huggingface_hub is not installed, so hub id {repo_id!r} cannot be fetched; "
                             f"pass a local folder instead ({BUILD_HINT})") from e
    try:
        # A complete cached snapshot works offline; only go to the network when it is absent.
        cached = Path(snapshot_download(repo_id, local_files_only=True))
        if first_missing_file(cached) is None:
            return cached
    except Exception:  # noqa: BLE001 - any cache miss means "try the network"
        pass
    try:
        return Path(snapshot_download(repo_id))
    except Exception as e:
        reason = type(e).__name__
        detail = str(e).strip().splitlines()
        raise ModelLoadError(
            f"could not get model {repo_id!r} from the Hugging Face hub ({reason}: "
            f"{detail[0] if detail else 'no detail'}); the hub may be unreachable or the id unknown. "
            + download_hint(repo_id)
        ) from e


def require_file(path: Path) -> Path:
    if not path.is_file():
        raise ModelLoadError(f"checkpoint file {path} is missing")
    return path


def load_model_config(model_dir: str | Path) -> ModelConfig:
    return parse_model_config(read_json(require_file(Path(model_dir) / "config.json")))


def load_vocoder_config(model_dir: str | Path) -> VocoderConfig:
    return parse_vocoder_config(read_json(require_file(Path(model_dir) / "speech_tokenizer" / "config.json")))


def load_mimi_encoder_config(model_dir: str | Path) -> MimiEncoderConfig:
    return parse_mimi_encoder_config(
        read_json(require_file(Path(model_dir) / "speech_tokenizer" / "config.json"))
    )


def load_generation_defaults(model_dir: str | Path) -> GenerationDefaults:
    """Sampling defaults from generation_config.json; the official fall-backs where it is absent."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        log.warning("%s is missing; using the official package's fall-back sampling defaults", path)
        return GenerationDefaults()
    return GenerationDefaults.parse(read_json(path))


def load_state_dict(
    path: str | Path,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    prefix: str | tuple[str, ...] | None = None,
    progress: bool = True,
) -> dict[str, torch.Tensor]:
    """Tensors of a .safetensors file whose names start with prefix (names are kept whole).

    Floating tensors are cast to dtype when given; a tqdm bar counts bytes while they load.
    """
    from safetensors import safe_open

    path = require_file(Path(path))
    if torch.device(device).type == "cuda":
        return load_state_dict_staged(path, dtype, device, prefix)
    out: dict[str, torch.Tensor] = {}
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            names = [k for k in f.keys() if prefix is None or k.startswith(prefix)]
            sizes = {}
            for k in names:
                sl = f.get_slice(k)
                n = 1
                for s in sl.get_shape():
                    n *= s
                sizes[k] = n * _itemsize(sl.get_dtype())
            bar = tqdm(total=sum(sizes.values()), unit="B", unit_scale=True, unit_divisor=1024,
                       desc=f"loading {path.parent.name}/{path.name}", disable=not progress, leave=False)
            with bar:
                for k in names:
                    t = f.get_tensor(k)
                    if dtype is not None and t.is_floating_point():
                        t = t.to(dtype)
                    out[k] = t.to(device)
                    bar.update(sizes[k])
    except Exception as e:  # safetensors' SafetensorError derives from Exception only
        raise ModelLoadError(f"cannot load weights from {path}: {type(e).__name__}: {e}") from e
    if not out:
        raise ModelLoadError(f"{path} holds no tensors starting with {prefix!r}")
    return out


_TORCH_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                 "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                 "BOOL": torch.bool}


def load_state_dict_staged(
    path: str | Path,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cuda",
    prefix: str | tuple[str, ...] | None = None,
) -> dict[str, torch.Tensor]:
    """`load_state_dict`'s result, moved in one copy: the file's bytes go to the device whole, and
    each tensor is cut from them there into an allocation of its own (aligned as any, which the
    megakernel's bulk copies need). One tensor at a time from the host took 4.7 s for the 0.6B's
    2.5 GB on the H200 (bench startup, warm); the file in one copy is bounded by the page cache
    and one host-to-device transfer. Peak device memory: the file once more, briefly."""
    path = require_file(Path(path))
    try:
        with open(path, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(header_len))
        header.pop("__metadata__", None)
        names = [k for k in header if prefix is None or k.startswith(prefix)]
        if not names:
            raise ModelLoadError(f"{path} holds no tensors starting with {prefix!r}")
        base = 8 + header_len
        lo = min(header[k]["data_offsets"][0] for k in names)
        hi = max(header[k]["data_offsets"][1] for k in names)
        blob = torch.from_file(str(path), shared=False, size=base + hi, dtype=torch.uint8)[base + lo : base + hi]
        staged = blob.to(device)
        del blob
        out: dict[str, torch.Tensor] = {}
        for k in names:
            info = header[k]
            start, end = info["data_offsets"]
            raw = staged[start - lo : end - lo]
            try:
                t = raw.view(_TORCH_DTYPES[info["dtype"]]).reshape(info["shape"])
            except RuntimeError:  # an offset not aligned to its element size: copy the bytes first
                raw = raw.clone()
                t = raw.view(_TORCH_DTYPES[info["dtype"]]).reshape(info["shape"])
            if dtype is not None and t.is_floating_point():
                t = t.to(dtype)
            out[k] = t.clone() if t.data_ptr() == raw.data_ptr() else t
        return out
    except ModelLoadError:
        raise
    except Exception as e:
        raise ModelLoadError(f"cannot load weights from {path}: {type(e).__name__}: {e}") from e


_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
             "BOOL": 1}


def _itemsize(dtype: str) -> int:
    return _ITEMSIZE.get(dtype.upper(), 4)


class QwenTextTokenizer:
    """The Qwen2/Qwen3 byte-level BPE, on the `tokenizers` library.

    Text is encoded as the official wrapper does: plain strings, added tokens (`<|im_start|>`,
    `<tts_pad>`, ...) recognised in the text, no extra special tokens around it.
    """

    def __init__(self, tokenizer) -> None:
        self._tok = tokenizer

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """`encode(text)` and each token's span of characters in `text` (a token holding part of
        a character's bytes spans that whole character)."""
        enc = self._tok.encode(text, add_special_tokens=False)
        return enc.ids, enc.offsets

    @property
    def added_tokens(self) -> list[str]:
        """The added tokens' texts (`<|im_start|>`, `<tts_pad>`, ...): the tokenizer finds them
        in the text before anything else."""
        return [t.content for t in self._tok.get_added_tokens_decoder().values()]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)


def qwen_pre_tokenizer():
    from tokenizers import Regex, pre_tokenizers

    from pipecat_qwen_fast.checkpoints.synthetic_tokenizer import QWEN_PRETOKENIZE_REGEX

    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])


def read_added_tokens(model_dir: Path) -> list[tuple[int, str, bool]]:
    cfg_path = model_dir / "tokenizer_config.json"
    if not cfg_path.is_file():
        raise ModelLoadError(f"{cfg_path} is missing; it lists the added tokens (<|im_start|>, <tts_pad>, ...)")
    try:
        cfg = json.loads(cfg_path.read_text("utf-8"))
        decoder = cfg["added_tokens_decoder"]
        return sorted((int(i), d["content"], bool(d.get("special", True))) for i, d in decoder.items())
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{cfg_path} has no valid added_tokens_decoder: {e}") from e


def load_text_tokenizer(model_dir: str | Path) -> QwenTextTokenizer:
    """tokenizer.json when present, else vocab.json + merges.txt + tokenizer_config.json.

    The pre-tokenizer is always the Qwen split regex: transformers 4.57.3 can swap in the Mistral
    one when loading a local folder (spec §10), and a tokenizer.json saved that way would carry it.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    d = Path(model_dir)
    tok_json = d / "tokenizer.json"
    try:
        if tok_json.is_file():
            tok = Tokenizer.from_file(str(tok_json))
        else:
            vocab, merges = require_file(d / "vocab.json"), require_file(d / "merges.txt")
            tok = Tokenizer(models.BPE.from_file(str(vocab), str(merges), unk_token=None, fuse_unk=False,
                                                 byte_fallback=False))
            for tid, content, special in read_added_tokens(d):
                token = AddedToken(content, single_word=False, lstrip=False, rstrip=False,
                                   normalized=False, special=special)
                if special:
                    tok.add_special_tokens([token])
                else:
                    tok.add_tokens([token])
                if tok.token_to_id(content) != tid:
                    raise ModelLoadError(
                        f"added token {content!r} is id {tid} in tokenizer_config.json but lands on "
                        f"{tok.token_to_id(content)}: vocab.json must hold exactly the ids below the added tokens"
                    )
    except ModelLoadError:
        raise
    except Exception as e:  # tokenizers raises plain Exception subclasses on malformed files
        raise ModelLoadError(f"cannot read the text tokenizer in {d}: {e}") from e
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = qwen_pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    return QwenTextTokenizer(tok)
