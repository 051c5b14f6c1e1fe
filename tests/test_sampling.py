"""Sampling rules (spec §6): order, suppression, EOS rule, top-k / top-p, seeding."""

from __future__ import annotations

import pytest
import torch

from pipecat_qwen_fast.errors import InvalidInputError
from pipecat_qwen_fast.model.sampling import (
    SamplingParams,
    apply_repetition_penalty,
    draw,
    process_talker_logits,
    sample_code0,
    sample_residual,
    talker_suppress_mask,
    warp_logits,
)

VOCAB, EOS = 3072, 2150


def _logits(seed: int, n: int = VOCAB) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * 3


def test_suppression_allows_only_codes_and_eos():
    mask = talker_suppress_mask(VOCAB, EOS, torch.device("cpu"))
    assert not mask[:2048].any()
    assert not mask[EOS]
    assert mask[2048:EOS].all() and mask[EOS + 1 :].all()


def test_suppressed_ids_and_early_eos_never_drawn():
    params = SamplingParams()
    suppress = talker_suppress_mask(VOCAB, EOS, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    seen = torch.zeros(VOCAB, dtype=torch.bool)
    for i in range(400):
        logits = _logits(i)
        logits[2048:] += 20  # make the forbidden range overwhelmingly likely
        frame = i % 4
        code = int(sample_code0(logits, seen, suppress, frame, EOS, params, gen))
        assert code < 2048 or code == EOS
        if frame < params.min_new_tokens:
            assert code != EOS, "EOS must be masked for the first min_new_tokens frames"


def test_eos_allowed_after_min_new_tokens():
    params = SamplingParams(do_sample=False)
    suppress = talker_suppress_mask(VOCAB, EOS, torch.device("cpu"))
    logits = torch.zeros(VOCAB)
    logits[EOS] = 10
    seen = torch.zeros(VOCAB, dtype=torch.bool)
    assert int(sample_code0(logits, seen, suppress, 1, EOS, params, None)) != EOS
    assert int(sample_code0(logits, seen, suppress, 2, EOS, params, None)) == EOS


def test_top_k_holds_over_many_draws():
    logits = _logits(1, 2048)
    allowed = set(torch.topk(logits / 0.9, 50).indices.tolist())
    gen = torch.Generator().manual_seed(1)
    params = SamplingParams()
    drawn = {int(sample_residual(logits, params, gen)) for _ in range(3000)}
    assert drawn <= allowed
    assert len(drawn) > 25, "sampling should spread over the top-k set"


def test_top_p_keeps_smallest_nucleus():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    probs = logits.softmax(-1)
    warped = warp_logits(logits, 1.0, 0, 0.8)
    kept = torch.isfinite(warped).nonzero().flatten().tolist()
    # smallest prefix of the sorted distribution whose mass exceeds 0.8
    assert probs[:1].sum() < 0.8 < probs[:2].sum()
    assert kept == [0, 1]


def test_repetition_penalty_official_semantics():
    logits = torch.tensor([2.0, -2.0, 1.0, -1.0])
    seen = torch.tensor([True, True, False, False])
    out = apply_repetition_penalty(logits, seen, 1.05)
    assert torch.allclose(out, torch.tensor([2.0 / 1.05, -2.0 * 1.05, 1.0, -1.0]))


def test_processing_order_penalty_before_suppression():
    params = SamplingParams(do_sample=False)
    suppress = talker_suppress_mask(VOCAB, EOS, torch.device("cpu"))
    logits = torch.zeros(VOCAB)
    logits[5] = 1.0
    logits[6] = 1.04
    seen = torch.zeros(VOCAB, dtype=torch.bool)
    seen[6] = True  # 1.04 / 1.05 < 1.0: the penalty flips the argmax
    processed = process_talker_logits(logits, seen, suppress, 5, EOS, params)
    assert int(processed.argmax()) == 5
    assert torch.isinf(processed[2048]) and processed[2048] < 0


def test_seeded_draws_repeat_exactly():
    logits = torch.stack([_logits(i, 2048) for i in range(8)])
    a = [draw(warp_logits(logits, 0.9, 50, 1.0), torch.Generator().manual_seed(42)) for _ in range(2)]
    assert torch.equal(a[0], a[1])
    b = draw(warp_logits(logits, 0.9, 50, 1.0), torch.Generator().manual_seed(43))
    assert not torch.equal(a[0], b)


def test_draw_matches_distribution():
    logits = torch.tensor([0.0, 1.0, 2.0])
    gen = torch.Generator().manual_seed(3)
    counts = torch.bincount(torch.stack([draw(logits, gen) for _ in range(6000)]), minlength=3).float()
    expected = logits.softmax(-1) * 6000
    assert torch.all((counts - expected).abs() < 5 * expected.sqrt() + 5)


@pytest.mark.parametrize(
    "kw", [{"temperature": 0.0}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -1}, {"repetition_penalty": 0.0}]
)
def test_invalid_params_rejected(kw):
    with pytest.raises(InvalidInputError):
        SamplingParams(**kw).validated()
