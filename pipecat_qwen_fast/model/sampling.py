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


def draw(logits: Tensor, u: Tensor) -> Tensor:
    """Sample from softmax(logits) with no host sync: the inverse-CDF draw of `draw_inverse_cdf`
    at uniforms `u` in [0, 1) (the logits' shape less the last dim; `counter_uniform` makes them).
    The megakernel's draw: a batched graph reads one uniform a row, no vocabulary of noise drawn
    by each session's own generator."""
    return draw_inverse_cdf(logits.softmax(dim=-1), u)


def draw_inverse_cdf(probs: Tensor, u: Tensor) -> Tensor:
    """The first id, in id order, whose running mass exceeds u times the total (the kernel's and
    cuda/reference.py's `inverse_cdf_draw`). A u so close to 1 that the product rounds up to the
    total would pass every id: it takes the last id of nonzero mass."""
    cum = probs.cumsum(dim=-1)
    r = u.to(cum.dtype).unsqueeze(-1) * cum[..., -1:]
    idx = torch.searchsorted(cum, r, right=True).squeeze(-1)
    ids = torch.arange(probs.shape[-1], device=probs.device)
    last = torch.where(probs > 0, ids, 0).amax(dim=-1)
    return torch.minimum(idx, last)


_M64 = (1 << 64) - 1


def _i64(c: int) -> int:
    """A 64-bit constant as the signed value torch's int64 holds."""
    return c - (1 << 64) if c >= 1 << 63 else c


def _shr(z: Tensor, n: int) -> Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic)."""
    return (z >> n) & ((1 << (64 - n)) - 1)


def _splitmix64(z: Tensor) -> Tensor:
    # int64 arithmetic wraps like the kernel's uint64 (two's complement), so the bits agree.
    z = z + _i64(0x9E3779B97F4A7C15)
    z = (z ^ _shr(z, 30)) * _i64(0xBF58476D1CE4E5B9)
    z = (z ^ _shr(z, 27)) * _i64(0x94D049BB133111EB)
    return z ^ _shr(z, 31)


def counter_uniform(seed: Tensor, frame: Tensor, group: Tensor) -> Tensor:
    """The megakernel's counter-based uniform (mk_util.cuh `uniform01`) for each (seed, frame,
    group), broadcast: int64 tensors (a seed's 64 bits as torch's signed int64) -> float32 in
    [0, 1), a multiple of 2**-24. A session's draws are a function of its seed and frame alone,
    whatever it is batched with."""
    z = _splitmix64(seed ^ _splitmix64(((frame & 0xFFFFFFFF) << 8) | group))
    return _shr(z, 40).float() * (1.0 / 16777216.0)


def session_seed(seed: int | None) -> int:
    """The seed a backend's session draws from: the request's, or a random one (62 bits) for a
    call that gave none."""
    return int(torch.randint(0, 2**62, (1,)).item()) if seed is None else seed


def seed_as_int64(seed: int) -> int:
    """A seed's low 64 bits as the signed int64 a device tensor holds (counter_uniform's input)."""
    return _i64(seed & _M64)


def sample_code0(
    logits: Tensor, seen: Tensor, suppress: Tensor, frame: int | Tensor, eos_id: int, params: SamplingParams,
    u: Tensor | None,
) -> Tensor:
    """Code 0 from the talker's logits; `u` the draw's uniforms (unused when greedy)."""
    logits = process_talker_logits(logits.float(), seen, suppress, frame, eos_id, params)
    if not params.do_sample:
        return torch.argmax(logits, dim=-1)
    return draw(warp_logits(logits, params.temperature, params.top_k, params.top_p), u)


def sample_residual(logits: Tensor, params: SamplingParams, u: Tensor | None) -> Tensor:
    """A predictor code from its head's logits; `u` the draw's uniforms (unused when greedy)."""
    logits = logits.float()
    if not params.subtalker_do_sample:
        return torch.argmax(logits, dim=-1)
    warped = warp_logits(logits, params.subtalker_temperature, params.subtalker_top_k, params.subtalker_top_p)
    return draw(warped, u)
