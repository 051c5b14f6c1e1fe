"""Prompt construction for every model variant and both text modes (spec §4).

The prefill is a sequence of vectors, each the sum of a text-track vector T(id) and a codec-track
vector C(id) (or the speaker vector). `build_prompt` returns it together with the "trailing" text
vectors that the decode loop adds one per frame.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from pipecat_qwen_fast.config import ModelConfig
from pipecat_qwen_fast.errors import InvalidInputError, UnsupportedFeatureError
from pipecat_qwen_fast.model.talker import Talker
from pipecat_qwen_fast.utils.host_copy import to_device_ints

PREFILL = "prefill"  # all text in the prefill (official non_streaming_mode=True)
DUAL_TRACK = "dual_track"  # one text token per frame (official non_streaming_mode=False)
TEXT_MODES = (PREFILL, DUAL_TRACK)


class TextTokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...


@dataclass(frozen=True)
class VoiceClonePrompt:
    """A Base-model voice: the speaker x-vector and, for in-context cloning, reference codes + text.

    ICL mode when both `ref_codes` and `ref_text` are given; x-vector-only mode otherwise.
    """

    x_vector: Tensor  # [D]
    ref_codes: Tensor | None = None  # [T_ref, 16] int64
    ref_text: str | None = None

    @property
    def icl(self) -> bool:
        return self.ref_codes is not None and self.ref_text is not None


@dataclass
class Prompt:
    embeds: Tensor  # [L, D] prefill
    trailing: Tensor  # [N, D] text vectors added at decode steps 0..N-1
    pad_vec: Tensor  # [D] tts_pad vector added after the trailing text is exhausted
    num_text_tokens: int  # target text body length (drives the frame cap)
    eos_vec: Tensor | None = None  # [D] tts_eos, which ends the trailing text (streamed text appends it)
    body: list[int] | None = None  # the target text's body tokens (spec §4.2), where build_prompt made it


def supported_languages(cfg: ModelConfig) -> list[str]:
    """`auto` plus the config's languages; dialects are chosen through the speaker, not by name."""
    return ["auto"] + sorted(k for k in cfg.talker.language_ids if "dialect" not in k)


def resolve_language(cfg: ModelConfig, language: str | None) -> str:
    lang = (language or "auto").strip().lower()
    valid = supported_languages(cfg)
    if lang not in valid:
        raise InvalidInputError(f"unknown language {language!r}; valid languages: {', '.join(valid)}")
    return lang


def resolve_voice(cfg: ModelConfig, voice: str | None, voice_clone: VoiceClonePrompt | None) -> str | None:
    """Check the voice arguments against the model variant; returns the speaker name or None."""
    speakers = sorted(cfg.talker.speaker_ids)
    if cfg.model_type == "custom_voice":
        if voice_clone is not None:
            raise UnsupportedFeatureError("voice_clone needs a Base model; this CustomVoice model has speakers: " + ", ".join(speakers))
        if voice is None:
            raise InvalidInputError(f"a voice is required; valid voices: {', '.join(speakers)}")
        name = voice.strip().lower()
        if name not in cfg.talker.speaker_ids:
            raise InvalidInputError(f"unknown voice {voice!r}; valid voices: {', '.join(speakers)}")
        return name
    if cfg.model_type == "voice_design":
        if voice is not None or voice_clone is not None:
            raise UnsupportedFeatureError(
                "VoiceDesign models have no preset voices; describe the voice with instruct= instead"
            )
        return None
    # base
    if voice is not None:
        raise UnsupportedFeatureError(
            "Base models have no preset voices; pass voice_clone=VoiceClonePrompt(x_vector, ref_codes, ref_text)"
        )
    if voice_clone is None:
        raise InvalidInputError(
            "Base models need a cloned voice: voice='name' or voice='file.voice' (made with "
            "engine.create_voice(audio, ref_text) or `qwen-fast-tts voice create`), or voice_clone=VoiceClonePrompt(...)"
        )
    return None


def check_voice_clone(cfg: ModelConfig, vc: VoiceClonePrompt) -> None:
    d = cfg.talker.hidden_size
    if vc.x_vector.shape != (d,):
        raise InvalidInputError(f"voice_clone.x_vector must have shape ({d},), got {tuple(vc.x_vector.shape)}")
    if (vc.ref_codes is None) != (vc.ref_text is None):
        raise InvalidInputError("in-context cloning needs both voice_clone.ref_codes and voice_clone.ref_text")
    if vc.ref_codes is not None:
        g = cfg.talker.num_code_groups
        rc = vc.ref_codes
        if rc.dim() != 2 or rc.shape[1] != g or rc.shape[0] == 0:
            raise InvalidInputError(f"voice_clone.ref_codes must have shape [frames, {g}], got {tuple(rc.shape)}")
        if rc.dtype.is_floating_point or int(rc.min()) < 0 or int(rc.max()) >= cfg.predictor.vocab_size:
            raise InvalidInputError(f"voice_clone.ref_codes must be integers in [0, {cfg.predictor.vocab_size})")
        if not vc.ref_text or not vc.ref_text.strip():
            raise InvalidInputError("voice_clone.ref_text is empty")


def _target_body(tok: TextTokenizer, cfg: ModelConfig, text: str) -> list[int]:
    ids = tok.encode(f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n")
    role = [cfg.im_start_id, cfg.assistant_id, ids[2] if len(ids) > 2 else -1]
    if ids[:2] != role[:2] or len(ids) < 9:
        raise InvalidInputError("text could not be tokenized into the TTS template")
    body = ids[3:-5]
    if not body:
        raise InvalidInputError("text is empty after tokenization")
    return body


# Dual-track text vectors are computed in blocks of this many rows, aligned on the text's first
# token, each block padded to full size: a row then comes out bit for bit the same whether its
# block was computed whole or while later tokens were still unknown (streamed text,
# engine/text_session.py). A matmul's rows depend on the batch size (CPU float32 measured; GPU
# kernels likewise), not on the other rows' values.
TEXT_ROW_BLOCK = 32


def prompt_dtype(talker: Talker) -> torch.dtype:
    """The dtype of a prompt's vectors: the talker's `prompt_dtype` where set (float32 for the
    megakernel's fp32 prefill, whose calls then read the fp32 model's prompt), else its weights'."""
    return getattr(talker, "prompt_dtype", None) or talker.codec_head.weight.dtype


def text_rows(talker: Talker, ids: list[int], fill_id: int, start: int = 0) -> Tensor:
    """T(ids[start:]) for dual-track text: [len(ids) - start, D], each row computed in its
    TEXT_ROW_BLOCK-aligned block, rows past the end of `ids` filled with `fill_id`."""
    device = talker.codec_head.weight.device
    dtype = prompt_dtype(talker)
    out = []
    first = start - start % TEXT_ROW_BLOCK
    for b in range(first, len(ids), TEXT_ROW_BLOCK):
        block = ids[b : b + TEXT_ROW_BLOCK]
        padded = block + [fill_id] * (TEXT_ROW_BLOCK - len(block))
        rows = talker.embed_text(to_device_ints(padded, device), dtype)
        out.append(rows[max(start - b, 0) : len(block)])
    if not out:
        return talker.embed_text(torch.zeros(0, dtype=torch.long, device=device), dtype)
    return torch.cat(out)


def _weights_key(modules: tuple[torch.nn.Module, ...]) -> tuple:
    """What `_memo` checks its entries against: taken once per prompt, not once per entry (each
    walk of the modules' parameters is ~40 us of host time before the prefill, six per prompt)."""
    return tuple((p.data_ptr(), p._version, p.device, p.dtype) for m in modules for p in m.parameters())


def _memo(talker: Talker, key: tuple, weights: tuple, make) -> Tensor:
    """`make()` for ids that are the same in every prompt (control codes, speakers, the role
    prefix, tts bos/eos/pad), computed once for the weights as they are (`weights`:
    `_weights_key` of the modules `make` reads): a request's prompt is built while the GPU waits
    for its prefill, and each of these is several small launches. An in-place edit of a weight
    bumps its version, a move gives it new storage: either misses."""
    memo = talker.__dict__.setdefault("_prompt_memo", {})
    hit = memo.get(key)
    if hit is not None and hit[0] == weights:
        return hit[1]
    value = make()
    memo[key] = (weights, value)
    return value


def build_prompt(
    talker: Talker,
    tok: TextTokenizer,
    cfg: ModelConfig,
    *,
    text: str,
    speaker: str | None,
    language: str,
    instruct: str | None,
    text_mode: str,
    voice_clone: VoiceClonePrompt | None,
    body: list[int] | None = None,
) -> Prompt:
    """`body`: the text's body tokens (spec §4.2) when the caller has them, else `text` is
    tokenized (streamed text: tokens already final, or a guess at them)."""
    tc = cfg.talker
    device = talker.codec_head.weight.device
    dtype = prompt_dtype(talker)

    def ids(x: list[int]) -> Tensor:
        return to_device_ints(x, device)

    def T(x: list[int]) -> Tensor:
        return talker.embed_text(ids(x), dtype)

    def C(x: list[int]) -> Tensor:
        return talker.embed_codec(ids(x)).to(dtype)

    # The dtype is part of the key: a prompt made after the talker's prompt_dtype changed
    # recomputes the shared vectors at the new one.
    text_weights = (dtype, _weights_key((talker.model.text_embedding, talker.text_projection)))
    codec_weights = (dtype, _weights_key((talker.model.codec_embedding,)))

    def T_const(x: list[int]) -> Tensor:
        return _memo(talker, ("T", *x), text_weights, lambda: T(x))

    def C_const(x: list[int]) -> Tensor:
        return _memo(talker, ("C", *x), codec_weights, lambda: C(x))

    bos_vec, eos_vec, pad_vec = T_const([cfg.tts_bos_id, cfg.tts_eos_id, cfg.tts_pad_id])
    if body is None:
        body = _target_body(tok, cfg, text)

    # Codec control prefix: think/lang or nothink, then the speaker slot, then pad, bos.
    lang_id = None if language == "auto" else tc.language_ids[language]
    if speaker is not None and language in ("chinese", "auto") and tc.speaker_dialect.get(speaker):
        lang_id = tc.language_ids[tc.speaker_dialect[speaker]]
    if lang_id is None:
        control = [tc.codec_nothink_id, tc.codec_think_bos_id, tc.codec_think_eos_id]
    else:
        control = [tc.codec_think_id, tc.codec_think_bos_id, lang_id, tc.codec_think_eos_id]
    codec = [C_const(control)]
    if speaker is not None:
        codec.append(C_const([tc.speaker_ids[speaker]]))
    elif voice_clone is not None:
        codec.append(voice_clone.x_vector.to(device, pad_vec.dtype)[None])
    codec.append(C_const([tc.codec_pad_id, tc.codec_bos_id]))
    codec_track = torch.cat(codec)  # [m + 2, D]; its last row (codec bos) pairs with the first text input

    parts: list[Tensor] = []
    if instruct:
        parts.append(T(tok.encode(f"<|im_start|>user\n{instruct}<|im_end|>\n")))
    parts.append(T_const([cfg.im_start_id, cfg.assistant_id, tok.encode("\n")[0]]))
    n_ctl = codec_track.shape[0] - 1
    text_track = torch.cat([pad_vec.expand(n_ctl - 1, -1), bos_vec[None]])
    parts.append(text_track + codec_track[:-1])
    codec_bos = codec_track[-1]
    codec_pad = C_const([tc.codec_pad_id])[0]

    if voice_clone is not None and voice_clone.icl:
        ref_codes = voice_clone.ref_codes.to(device)
        ref_body = _ref_body(tok, cfg, voice_clone.ref_text)
        seq_vecs = T(ref_body + body) if text_mode == PREFILL else text_rows(talker, ref_body + body, cfg.tts_pad_id)
        text_vecs = torch.cat([seq_vecs, eos_vec[None]])  # [R+N+1, D]
        codec_vecs = torch.cat([codec_bos[None], talker.embed_frames(ref_codes, dtype)])  # [T_ref+1, D]
        if text_mode == PREFILL:
            parts.append(text_vecs + codec_pad)
            parts.append(codec_vecs + pad_vec)
            trailing = pad_vec[None]
        elif text_vecs.shape[0] > codec_vecs.shape[0]:
            k = codec_vecs.shape[0]
            parts.append(text_vecs[:k] + codec_vecs)
            trailing = text_vecs[k:]
        else:
            padded = torch.cat([text_vecs, pad_vec.expand(codec_vecs.shape[0] - text_vecs.shape[0], -1)])
            parts.append(padded + codec_vecs)
            trailing = pad_vec[None]
    elif text_mode == PREFILL:
        parts.append(torch.cat([T(body), eos_vec[None]]) + codec_pad)
        parts.append((pad_vec + codec_bos)[None])
        trailing = pad_vec[None]
    else:
        rows = text_rows(talker, body, cfg.tts_pad_id)
        parts.append((rows[0] + codec_bos)[None])
        trailing = torch.cat([rows[1:], eos_vec[None]])

    return Prompt(
        embeds=torch.cat(parts),
        trailing=trailing,
        pad_vec=pad_vec,
        num_text_tokens=len(body),
        eos_vec=eos_vec,
        body=list(body),
    )


def _ref_body(tok: TextTokenizer, cfg: ModelConfig, ref_text: str) -> list[int]:
    ids = tok.encode(f"<|im_start|>assistant\n{ref_text}<|im_end|>\n")
    body = ids[3:-2]
    if not body:
        raise InvalidInputError("voice_clone.ref_text is empty after tokenization")
    return body
