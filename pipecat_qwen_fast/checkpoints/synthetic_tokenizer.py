"""A stand-in for the Qwen2/Qwen3 text tokenizer, for random-weight checkpoints.

The real tokenizer files cannot be downloaded here. What the engine relies on is reproduced
exactly: the GPT-2/Qwen byte alphabet as ids 0..255 (so `\\n` = 198), `user` = 872 and
`assistant` = 77091 as single tokens, a BPE vocab contiguous over 0..151642 and the 33 real added
tokens at 151643..151675, the Qwen pre-tokenizer regex and NFC normalisation. The merges are a
byte-level BPE trained on English found offline (Python standard-library docstrings, comments and
pydoc topics, plus /usr/share/common-licenses), so ordinary English costs ~1.4 tokens per word as
with a real tokenizer instead of one token per byte. Training results depend on the machine's files,
so the trained merges ship in `assets/synthetic_bpe_merges.txt`; `train_merges()` regenerates them.
"""

from __future__ import annotations

import ast
import io
import json
import sysconfig
import tokenize
from collections.abc import Iterator
from functools import lru_cache
from importlib import resources
from pathlib import Path

QWEN_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

BPE_VOCAB_SIZE = 151643  # ids 0..151642; added tokens start right after

# The real Qwen3 added tokens in id order from 151643, with their `special` flags.
ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
    ("<|audio_start|>", True),
    ("<|audio_end|>", True),
    ("<tts_pad>", True),
    ("<tts_text_bos>", True),
    ("<tts_text_eod>", True),
    ("<tts_text_bos_single>", True),
    ("<|audio_pad|>", True),
)

# Words whose ids the prompt template hard-codes (config.json: assistant_token_id).
PINNED_WORDS = {"user": 872, "assistant": 77091}

MERGES_ASSET = "synthetic_bpe_merges.txt"
TRAIN_VOCAB_SIZE = 40000


def byte_to_char() -> dict[int, str]:
    """The printable stand-ins for bytes, in GPT-2/Qwen id order (dict order = id order).

    Printable Latin-1 bytes stand for themselves and come first; the other 68 bytes map, in byte
    order, to code points from 256 up, so `\\n` (byte 10) gets id 188 + 10 = 198 and space 220.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    others = [b for b in range(256) if b not in set(printable)]
    table = {b: chr(b) for b in printable}
    table.update({b: chr(256 + i) for i, b in enumerate(others)})
    return table


def byte_alphabet() -> list[str]:
    return list(byte_to_char().values())


def iter_training_text() -> Iterator[str]:
    """English prose found on any Debian machine with Python 3.11, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3"}
    files = sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))
    for path in files:
        try:
            source = path.read_text("utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    yield doc
        try:
            toks = tokenize.generate_tokens(io.StringIO(source).readline)
            yield "\n".join(t.string.lstrip("#").strip() for t in toks if t.type == tokenize.COMMENT)
        except (tokenize.TokenError, SyntaxError):
            pass
    from pydoc_data import topics

    for key in sorted(topics.topics):
        yield topics.topics[key]
    licenses = Path("/usr/share/common-licenses")
    if licenses.is_dir():
        for path in sorted(licenses.iterdir()):
            if path.is_file():
                yield path.read_text("utf-8", errors="ignore")


def build_pre_tokenizer():
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )


def train_merges(vocab_size: int = TRAIN_VOCAB_SIZE, texts: list[str] | None = None) -> list[tuple[str, str]]:
    """Train the byte-level BPE merges (deterministic for a given set of files; ~30 s).

    BPE picks merges greedily, so a smaller vocab_size yields a prefix of the same merge list.
    """
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = build_pre_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts if texts is not None else list(iter_training_text()), trainer)
    merges = json.loads(tok.to_str())["model"]["merges"]
    return [tuple(m.split(" ", 1)) if isinstance(m, str) else (m[0], m[1]) for m in merges]


def write_merges_asset(path: Path, merges: list[tuple[str, str]]) -> None:
    path.write_text("".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")


@lru_cache(maxsize=1)
def shipped_merges() -> tuple[tuple[str, str], ...]:
    text = resources.files("pipecat_qwen_fast").joinpath("assets", MERGES_ASSET).read_text("utf-8")
    return tuple(tuple(line.split(" ", 1)) for line in text.splitlines() if line)  # type: ignore[misc]


def segment(word: str, merges: list[tuple[str, str]]) -> list[str]:
    """Plain BPE of one pre-token (lowest-rank pair first), as the tokenizers library does."""
    ranks = {m: i for i, m in enumerate(merges)}
    parts = list(word)
    while len(parts) > 1:
        best = min(range(len(parts) - 1), key=lambda i: ranks.get((parts[i], parts[i + 1]), 1 << 60))
        pair = (parts[best], parts[best + 1])
        if pair not in ranks:
            break
        parts[best : best + 2] = [pair[0] + pair[1]]
    return parts


def assemble_vocab(merges: list[tuple[str, str]]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Vocab over ids 0..151642 and the merge list, with the pinned words at their real ids."""
    merges = list(merges)
    for word in PINNED_WORDS:
        # Join whatever pieces the trained merges leave, left to right, at the lowest priority so
        # that no other word's segmentation changes.
        parts = segment(word, merges)
        while len(parts) > 1:
            merges.append((parts[0], parts[1]))
            parts[0:2] = [parts[0] + parts[1]]
    tokens = byte_alphabet()
    seen = set(tokens)
    for a, b in merges:
        if a + b not in seen:
            seen.add(a + b)
            tokens.append(a + b)
    if len(tokens) > BPE_VOCAB_SIZE:
        raise ValueError(f"{len(tokens)} BPE tokens do not fit below the added-token ids")
    # Unreachable filler (no merge produces it) keeps the vocab contiguous: the fast tokenizer
    # numbers added tokens from len(vocab), so the gap must be filled for 151643.. to be exact.
    tokens += [f"<|synthetic_filler_{i}|>" for i in range(BPE_VOCAB_SIZE - len(tokens))]
    for word, want in PINNED_WORDS.items():
        have = tokens.index(word)
        tokens[have], tokens[want] = tokens[want], tokens[have]
    return {t: i for i, t in enumerate(tokens)}, merges


def tokenizer_config() -> dict:
    decoder = {
        str(BPE_VOCAB_SIZE + i): {
            "content": text,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for i, (text, special) in enumerate(ADDED_TOKENS)
    }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "additional_special_tokens": [t for t, special in ADDED_TOKENS if special and t != "<|endoftext|>"],
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def build_fast_tokenizer(vocab: dict[str, int], merges: list[tuple[str, str]]):
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, unk_token=None,
                               fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = build_pre_tokenizer()
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    for text, special in ADDED_TOKENS:
        token = AddedToken(text, single_word=False, lstrip=False, rstrip=False, normalized=False,
                           special=special)
        if special:
            tok.add_special_tokens([token])
        else:
            tok.add_tokens([token])
    return tok


def write_tokenizer_files(out_dir: Path, merges: list[tuple[str, str]] | None = None) -> None:
    """Write tokenizer.json, vocab.json, merges.txt and tokenizer_config.json into out_dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab, full_merges = assemble_vocab(list(merges if merges is not None else shipped_merges()))
    tok = build_fast_tokenizer(vocab, full_merges)
    for i, (text, _) in enumerate(ADDED_TOKENS):
        if tok.token_to_id(text) != BPE_VOCAB_SIZE + i:
            raise AssertionError(f"added token {text} did not land on id {BPE_VOCAB_SIZE + i}")
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (out_dir / "merges.txt").write_text(
        "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in full_merges), encoding="utf-8"
    )
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(), indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description="Retrain the synthetic BPE merges shipped with the package.")
    ap.add_argument("--out", type=Path, required=True, help="where to write the merges file")
    ap.add_argument("--vocab-size", type=int, default=TRAIN_VOCAB_SIZE)
    args = ap.parse_args()
    write_merges_asset(args.out, train_merges(args.vocab_size))


if __name__ == "__main__":
    main()
