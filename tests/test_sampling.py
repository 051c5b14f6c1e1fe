"""Sampling rules (spec §6): order, suppression, EOS rule, top-k / top-p, seeding."""

from __future__ import annotations

import pytest
import torch

from pipecat_qwen_fast.errors import InvalidInputError
from pipecat_qwen_fast.model.sampling import (
    SamplingParams,
    apply_repetition_penalty,
    counter_uniform,
    draw,
    draw_inverse_cdf,
    process_talker_logits,
    sample_code0,
    sample_residual,
    seed_as_int64,
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
    u = counter_uniform(torch.tensor(0), torch.arange(400), torch.tensor(0))
    seen = torch.zeros(VOCAB, dtype=torch.bool)
    for i in range(400):
        logits = _logits(i)
        logits[2048:] += 20  # make the forbidden range overwhelmingly likely
        frame = i % 4
        code = int(sample_code0(logits, seen, suppress, frame, EOS, params, u[i]))
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
    u = counter_uniform(torch.tensor(1), torch.arange(3000), torch.tensor(1))
    params = SamplingParams()
    drawn = set(sample_residual(logits.expand(3000, -1), params, u).tolist())
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

    def drawn(seed: int) -> torch.Tensor:
        u = counter_uniform(torch.tensor(seed_as_int64(seed)), torch.arange(8), torch.tensor(0))
        return draw(warp_logits(logits, 0.9, 50, 1.0), u)

    assert torch.equal(drawn(42), drawn(42))
    assert not torch.equal(drawn(42), drawn(43))


@pytest.mark.parametrize(
    "kw", [{"temperature": 0.0}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -1}, {"repetition_penalty": 0.0}]
)
def test_invalid_params_rejected(kw):
    with pytest.raises(InvalidInputError):
        SamplingParams(**kw).validated()


# The batched graph's draw: the megakernel's counter-based uniform and inverse CDF, checked against
# the float64 reference of cuda/reference.py (the same one tests/test_megakernel.py checks the
# kernel against).

def _kernel_reference():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "cuda" / "reference.py"
    spec = importlib.util.spec_from_file_location("qmk_reference_sampling", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


REF = _kernel_reference()


def test_counter_uniform_is_the_kernels_hash_bit_for_bit():
    # Seeds with the top bit set cross torch's signed int64; frames past 2**31 its sign too.
    seeds = [0, 1, 21, 2**62 - 1, 2**63, 2**64 - 1, 0xDEADBEEFCAFEF00D]
    frames = [0, 1, 7, 1000, 2**31 + 5, 2**32 - 1]
    seed_t = torch.tensor([seed_as_int64(s) for s in seeds])[:, None, None]
    frame_t = torch.tensor(frames)[None, :, None]
    got = counter_uniform(seed_t, frame_t, torch.arange(16))
    assert got.shape == (len(seeds), len(frames), 16) and got.dtype == torch.float32
    want = torch.tensor([[[REF.kernel_uniform(s, f, g) for g in range(16)] for f in frames] for s in seeds],
                        dtype=torch.float64)
    assert torch.equal(got.double(), want)
    assert len(set(got.flatten().tolist())) > 0.99 * got.numel(), "distinct counters, distinct uniforms"


@pytest.mark.parametrize("top_k,top_p", [(50, 1.0), (0, 0.8), (0, 1.0), (3, 1.0)])
def test_inverse_cdf_draw_is_the_reference_draw(top_k, top_p):
    logits = torch.stack([_logits(i, 2048) for i in range(64)])
    warped = warp_logits(logits, 0.9, top_k, top_p)
    u = counter_uniform(torch.tensor(seed_as_int64(77)), torch.arange(64), torch.tensor(3))
    got = draw(warped, u)
    exact = 0
    for row, (x, uu) in enumerate(zip(warped, u.tolist())):
        want, margin = REF.inverse_cdf_draw(x, uu)
        assert int(got[row]) == want or margin < 1e-5, f"row {row}: drew {int(got[row])}, reference {want}"
        assert torch.isfinite(x[got[row]]), "never an id outside top-k / top-p"
        exact += int(got[row]) == want
    assert exact >= 60


def test_inverse_cdf_draw_at_the_ends_of_the_unit_interval():
    # Mass on ids 3 and 7 only: u = 0 takes the first, u just below 1 the last of nonzero mass,
    # even where u times the total rounds up to the total.
    probs = torch.zeros(2, 10)
    probs[:, 3], probs[:, 7] = 0.25, 0.75
    u = torch.tensor([0.0, 1.0 - 2.0**-24])
    assert draw_inverse_cdf(probs, u).tolist() == [3, 7]
    assert draw_inverse_cdf(probs, torch.tensor([0.2499, 0.2501])).tolist() == [3, 7]


def test_draw_matches_distribution():
    logits = torch.tensor([0.0, 1.0, 2.0]).expand(6000, 3)
    u = counter_uniform(torch.tensor(seed_as_int64(3)), torch.arange(6000), torch.tensor(0))
    counts = torch.bincount(draw(logits, u), minlength=3).float()
    expected = logits[0].softmax(-1) * 6000
    assert torch.all((counts - expected).abs() < 5 * expected.sqrt() + 5)


def test_sampled_codes_with_uniforms_follow_the_rules():
    # Batched, frames as a tensor (the EOS rule as a mask, as in the graph): suppressed ids and
    # early EOS are never drawn.
    params = SamplingParams()
    suppress = talker_suppress_mask(VOCAB, EOS, torch.device("cpu"))
    logits = torch.stack([_logits(i) for i in range(256)])
    logits[:, 2048:] += 10  # suppressed ids and EOS would win without the rules
    seen = torch.zeros(256, VOCAB, dtype=torch.bool)
    u = counter_uniform(torch.tensor(seed_as_int64(9)), torch.arange(256), torch.tensor(0))
    early = sample_code0(logits, seen, suppress, torch.zeros(256, dtype=torch.long), EOS, params, u)
    assert int(early.max()) < 2048
    late = sample_code0(logits, seen, suppress, torch.full((256,), 5), EOS, params, u)
    assert set(late.tolist()) <= set(range(2048)) | {EOS} and EOS in late.tolist()
