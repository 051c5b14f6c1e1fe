"""Logits processing and sampling in the official order (spec §6), without host syncs.

Talker code 0: repetition penalty over past code-0 ids -> EOS masked for the first `min_new_tokens`
frames -> ids [vocab-1024, vocab) suppressed except EOS -> (sampling only) temperature -> top-k ->
top-p -> draw. Greedy is the argmax after the first three steps. Predictor codes 1..15: temperature,
top-k, top-p only.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch
from torch import Tensor

from pipecat_qwen_fast.config import GenerationDefaults
from pipecat_qwen_fast.errors import InvalidInputError


@dataclass(frozen=True)
class SamplingParams:
    do_sample: bool = True
    temperature: float = 0.9
    top_k: int = 50
    top_p: float = 1.0
    repetition_penalty: float = 1.05
    subtalker_do_sample: bool = True
    subtalker_temperature: float = 0.9
    subtalker_top_k: int = 50
    subtalker_top_p: float = 1.0
    min_new_tokens: int = 2

    @classmethod
    def from_defaults(cls, d: GenerationDefaults) -> SamplingParams:
        # The sampling fields of generation_config.json carry the same names here.
        return cls(**{f.name: getattr(d, f.name) for f in fields(cls) if hasattr(d, f.name)}).validated()

    def greedy(self) -> SamplingParams:
        """Argmax for code 0 and for the predictor's codes; the logits processing stays."""
        return replace(self, do_sample=False, subtalker_do_sample=False)

    def validated(self) -> SamplingParams:
        for name in ("temperature", "subtalker_temperature"):
            if not getattr(self, name) > 0:
                raise InvalidInputError(f"{name} must be > 0 (use greedy=True for argmax decoding)")
        for name in ("top_p", "subtalker_top_p"):
            if not 0 < getattr(self, name) <= 1:
                raise InvalidInputError(f"{name} must be in (0, 1]")
        for name in ("top_k", "subtalker_top_k"):
            if getattr(self, name) < 0:
                raise InvalidInputError(f"{name} must be >= 0 (0 disables top-k)")
        if not self.repetition_penalty > 0:
            raise InvalidInputError("repetition_penalty must be > 0")
        return self


def talker_suppress_mask(vocab_size: int, eos_id: int, device: torch.device) -> Tensor:
    """Boolean [vocab]: True where the id may never be sampled as code 0."""
    mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
    mask[vocab_size - 1024 :] = True
    mask[eos_id] = False
    return mask


def apply_repetition_penalty(logits: Tensor, seen: Tensor, penalty: float) -> Tensor:
    """Divide positive / multiply negative logits of already generated ids (HF semantics)."""
    if penalty == 1.0:
        return logits
    penalised = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalised, logits)


def process_talker_logits(
    logits: Tensor, seen: Tensor, suppress: Tensor, frame: int | Tensor, eos_id: int, params: SamplingParams
) -> Tensor:
    """Steps 2-4 of spec §6 on fp32 logits [..., vocab].

    `frame` = number of codes sampled before: a host int, or a LongTensor [...] on the device (a
    captured graph cannot branch on a host value, so the EOS rule becomes a mask).
    """
    logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    if isinstance(frame, Tensor):
        is_eos = torch.arange(logits.shape[-1], device=logits.device) == eos_id
        logits = logits.masked_fill((frame < params.min_new_tokens).unsqueeze(-1) & is_eos, float("-inf"))
    elif frame < params.min_new_tokens:
        logits = logits.clone()
        logits[..., eos_id] = float("-inf")
    return logits.masked_fill(suppress, float("-inf"))


def warp_logits(logits: Tensor, temperature: float, top_k: int, top_p: float) -> Tensor:
    """Temperature -> top-k -> top-p on [..., vocab] fp32 logits (HF warper semantics)."""
    logits = logits / temperature
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(logits, dim=-1, descending=False)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cum <= (1 - top_p)
        remove_sorted[..., -1:] = False  # always keep the most likely id
        remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits


def draw(logits: Tensor, generator: torch.Generator | None, noise: Tensor | None = None) -> Tensor:
    """Sample from softmax(logits) with no host sync: argmax(p / Exp(1)) is a categorical draw.

    `noise` (Exp(1) samples shaped like the logits) is drawn from `generator` unless given: a
    captured graph reads noise its caller drew from each session's own generator.
    """
    probs = logits.softmax(dim=-1)
    if noise is None:
        noise = torch.empty_like(probs).exponential_(1, generator=generator)
    return torch.argmax(probs / noise, dim=-1)


def sample_code0(
    logits: Tensor,
    seen: Tensor,
    suppress: Tensor,
    frame: int | Tensor,
    eos_id: int,
    params: SamplingParams,
    generator: torch.Generator | None,
    noise: Tensor | None = None,
) -> Tensor:
    logits = process_talker_logits(logits.float(), seen, suppress, frame, eos_id, params)
    if not params.do_sample:
        return torch.argmax(logits, dim=-1)
    return draw(warp_logits(logits, params.temperature, params.top_k, params.top_p), generator, noise)


def sample_residual(
    logits: Tensor, params: SamplingParams, generator: torch.Generator | None, noise: Tensor | None = None
) -> Tensor:
    logits = logits.float()
    if not params.subtalker_do_sample:
        return torch.argmax(logits, dim=-1)
    warped = warp_logits(logits, params.subtalker_temperature, params.subtalker_top_k, params.subtalker_top_p)
    return draw(warped, generator, noise)
