"""The synthetic Qwen tokenizer and our text-tokenizer loader."""

from __future__ import annotations

import json
import shutil
import sys

import pytest

from pipecat_qwen_fast.checkpoints import load as checkpoint
from pipecat_qwen_fast.checkpoints.synthetic_tokenizer import (
    ADDED_TOKENS,
    BPE_VOCAB_SIZE,
    assemble_vocab,
    byte_alphabet,
    iter_training_text,
    shipped_merges,
    train_merges,
)

PARAGRAPH = (
    "The weather was beautiful this morning, so we decided to take a long walk along the river. "
    "Children were playing near the old bridge while their parents talked about the news of the day. "
    "Later, we stopped at a small cafe and ordered coffee with fresh bread. I think it was one of the "
    "nicest afternoons we have had in months, and we promised to come back next week."
)

SAMPLES = [
    PARAGRAPH,
    "McDonald's iPhone costs $1,234.56 -- isn't that a lot?",
    "你好，世界！这是一个测试。",
    "Emoji 😀 and tabs\tand  double  spaces\n\nnew lines",
    "<|im_start|>user\nspeak <tts_pad> slowly<|im_end|>\n",
]


@pytest.fixture(scope="module")
def tok(tiny_checkpoint):
    return checkpoint.load_text_tokenizer(tiny_checkpoint())


def test_template_ids(tok):
    assert tok.encode("<|im_start|>assistant\n") == [151644, 77091, 198]
    assert tok.encode("<|im_start|>user\n") == [151644, 872, 198]
    ids = tok.encode("<|im_start|>assistant\nHello there.<|im_end|>\n<|im_start|>assistant\n")
    assert ids[:3] == [151644, 77091, 198]
    assert ids[-5:] == [151645, 198, 151644, 77091, 198]
    assert tok.decode(ids[3:-5]) == "Hello there."


def test_added_tokens_have_their_real_ids(tok):
    assert len(ADDED_TOKENS) == 33
    for i, (text, _) in enumerate(ADDED_TOKENS):
        assert tok.token_to_id(text) == BPE_VOCAB_SIZE + i
        assert tok.encode(text) == [BPE_VOCAB_SIZE + i]
    expected = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645,
                "<|audio_start|>": 151669, "<|audio_end|>": 151670, "<tts_pad>": 151671,
                "<tts_text_bos>": 151672, "<tts_text_eod>": 151673, "<tts_text_bos_single>": 151674,
                "<|audio_pad|>": 151675}
    for text, tid in expected.items():
        assert tok.token_to_id(text) == tid
    assert tok.vocab_size == 151676


def test_byte_alphabet_is_the_gpt2_order(tok):
    alphabet = byte_alphabet()
    assert len(set(alphabet)) == 256
    assert alphabet[0] == "!" and alphabet[198] == "\u010a" and alphabet[220] == "\u0120"
    assert tok.encode("\n") == [198]
    assert tok.encode("!") == [0]


def test_english_costs_about_as_much_as_with_a_real_tokenizer(tok):
    words = len(PARAGRAPH.split())
    per_word = len(tok.encode(PARAGRAPH)) / words
    assert 1.1 <= per_word <= 1.6, per_word


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_qwen_pretokenizer_regex(tok):
    # The Qwen split keeps case-insensitive contractions and single digits as their own pieces.
    pieces = [tok.decode([i]) for i in tok.encode("I'M 2024")]
    assert pieces[:2] == ["I", "'M"]
    assert pieces[-4:] == ["2", "0", "2", "4"]


def test_vocab_json_and_merges_load_like_tokenizer_json(tiny_checkpoint, tmp_path, tok):
    # Released Qwen checkpoints ship vocab.json + merges.txt + tokenizer_config.json only.
    src = tiny_checkpoint()
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json"):
        shutil.copy(src / name, tmp_path / name)
    slow = checkpoint.load_text_tokenizer(tmp_path)
    for text in SAMPLES:
        assert slow.encode(text) == tok.encode(text)


def test_vocab_is_contiguous(tiny_checkpoint):
    vocab = json.loads((tiny_checkpoint() / "vocab.json").read_text("utf-8"))
    assert sorted(vocab.values()) == list(range(BPE_VOCAB_SIZE))
    assert vocab["assistant"] == 77091 and vocab["user"] == 872 and vocab["\u010a"] == 198


def test_pinned_words_do_not_change_other_words():
    vocab, merges = assemble_vocab(list(shipped_merges()))
    assert merges[: len(shipped_merges())] == list(shipped_merges())


def test_bad_tokenizer_config_is_reported(tiny_checkpoint, tmp_path):
    from pipecat_qwen_fast.errors import ModelLoadError

    src = tiny_checkpoint()
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(src / name, tmp_path / name)
    with pytest.raises(ModelLoadError, match="tokenizer_config.json"):
        checkpoint.load_text_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="added_tokens_decoder"):
        checkpoint.load_text_tokenizer(tmp_path)


def test_transformers_autotokenizer_agrees(tiny_checkpoint, tok):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tiny_checkpoint()))
    for text in SAMPLES:
        assert hf(text)["input_ids"] == tok.encode(text)


@pytest.mark.slow
def test_training_reproduces_the_shipped_merges():
    if sys.version_info[:2] != (3, 11):
        pytest.skip("the shipped merges were trained on Python 3.11's standard library")
    texts = list(iter_training_text())
    # Equal to the merges trained when they were shipped: training is reproducible across runs.
    first = train_merges(3000, texts)
    assert len(first) > 2000 and first == list(shipped_merges()[: len(first)])
