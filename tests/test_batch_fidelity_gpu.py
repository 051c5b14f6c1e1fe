"""The batched decode path against fp32 (issue 34, item 5, marker gpu): 500 teacher-forced frames
at batch 1, 64 and 512 on a random full-size 0.6B talker (the EOS row zeroed, so greedy runs never
stop): argmax agreement >= 99 % (code 0, and all 16 codes) and the talker's and predictor's hidden
states within 1e-2, by tests/test_megakernel.py's measure.

The batched path is GraphBackend as deployed (`for_device`: bf16, K/V pages in 40 % of the free
memory, the default layer step, CUDA graphs), prefilling its rows itself; the reference is the
eager TorchBackend on an fp32 copy of the same weights, one free greedy run per text, shared by the
three batch sizes (tests/helpers_fidelity.py). The references cost the most (an eager frame is
~80 ms), so there are few texts, each repeated across the rows: QWEN_FAST_FIDELITY_TEXTS (default
3) and QWEN_FAST_FIDELITY_FRAMES (default 500) change that. Each batch size prints a one-line
summary (run pytest with -s to see it), and with QWEN_FAST_FIDELITY_OUT set (a path) the figures
are written there as JSON after each.

First, quickly, on the tiny checkpoint: 512 rows (the largest batch bucket, whose rows reach the
GPU by a truly asynchronous copy out of one pinned buffer) with the host a frame ahead of the GPU,
as in the fidelity runs, across an attention bucket's edge: the codes of a run that waits for each
frame, forced and not (before the fix, batch 512's device assert)."""

from __future__ import annotations

import copy
import json
import os
import time
from pathlib import Path

import pytest
import torch
from helpers_fidelity import (
    bucket_edge_prompts,
    decode_rows,
    eager_prefill_err,
    make_prompts,
    measure_batch,
    pages_for,
    reference_module,
    run_references,
    summary_line,
)

from pipecat_qwen_fast import QwenTTSEngine
from pipecat_qwen_fast.backends.eager import TorchBackend
from pipecat_qwen_fast.backends.graph import GraphBackend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU: the batch path's fidelity tests skipped"),
]

FRAMES = int(os.environ.get("QWEN_FAST_FIDELITY_FRAMES", "500"))
TEXTS = int(os.environ.get("QWEN_FAST_FIDELITY_TEXTS", "3"))
BATCHES = (1, 64, 512)
HIDDEN_BAR = 1e-2
AGREEMENT_BAR = 0.99
FIGURES: dict = {}


def test_host_ahead_of_the_gpu_at_the_largest_batch(tiny_checkpoint):
    engine = QwenTTSEngine.from_pretrained(tiny_checkpoint("custom_voice", zero_eos=True), device="cpu",
                                           dtype="float32", backend="eager")
    dev = torch.device("cuda")
    talker = engine.model.talker.to(dev)
    gb = GraphBackend(talker, dev, torch.float32, max_sessions=512, capacity=512, layer_step="plain", pages=3 * 512)
    assert gb.use_graphs and gb.max_batch == 512
    prompts = bucket_edge_prompts(talker.cfg.hidden_size, dev)
    rows = [r % len(prompts) for r in range(512)]
    frames = 4  # the fourth crosses from the 128 into the 256 bucket
    waited = decode_rows(gb, prompts, rows, frames)
    assert torch.equal(decode_rows(gb, prompts, rows, frames, run_ahead=True), waited)
    force = waited.to(dev)
    forced = decode_rows(gb, prompts, rows, frames, force=force)
    assert torch.equal(decode_rows(gb, prompts, rows, frames, force=force, run_ahead=True), forced)
    assert {k[:2] for k in gb.graphs} == {(512, 0), (512, 128), (512, 256)}
    engine.close()


@pytest.fixture(scope="module")
def fidelity():
    talker, cfg = reference_module().random_talker("0.6b", torch.device("cuda"), seed=0)
    talker32 = copy.deepcopy(talker).float()
    dev = torch.device("cuda")
    prompts = make_prompts(cfg.talker.hidden_size, TEXTS, dev)
    start = time.perf_counter()
    refs = run_references(TorchBackend(talker32, dev, torch.float32), prompts, FRAMES)
    seconds = round(time.perf_counter() - start, 2)
    # Context for the prefill's figure: the eager torch modules' own bf16 prefill against fp32.
    floor = max(eager_prefill_err(TorchBackend(talker, dev, torch.bfloat16), p, r) for p, r in zip(prompts, refs))
    FIGURES["reference"] = {"backend": "TorchBackend, fp32 copy of the weights, greedy, decoding freely",
                            "texts": TEXTS, "frames": FRAMES, "seconds": seconds,
                            "bf16_eager_prefill_hidden_rel_err_max": floor}
    print(f"\nfp32 references: {TEXTS} texts x {FRAMES} frames in {seconds:.1f} s; the eager bf16 prefill's "
          f"hidden rel err against them {floor:.2e}", flush=True)
    del talker32
    torch.cuda.empty_cache()  # the pool's 40 % is of what is free now
    gb = GraphBackend.for_device(talker, dev, torch.bfloat16)
    FIGURES["device"] = {"name": torch.cuda.get_device_name(dev), "torch": torch.__version__,
                         "pages": gb.num_pages, "page_size": gb.page_size}
    return gb, prompts, refs


@pytest.mark.parametrize("batch", BATCHES)
def test_teacher_forced_batch_against_fp32(fidelity, batch):
    gb, prompts, refs = fidelity
    rows = [r % len(prompts) for r in range(batch)]
    need = pages_for(gb, prompts, rows, FRAMES)
    assert need <= len(gb.free_pages), (f"{batch} sessions of up to {FRAMES} frames need {need} K/V pages; "
                                        f"the deployed pool has {len(gb.free_pages)} free")
    f = measure_batch(gb, prompts, refs, batch, FRAMES)
    FIGURES[f"batch_{batch}"] = f
    print("\n" + summary_line(batch, f), flush=True)
    out = os.environ.get("QWEN_FAST_FIDELITY_OUT")
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(FIGURES, indent=2) + "\n")
    assert f["talker_hidden_rel_err_max"] < HIDDEN_BAR
    assert f["predictor_hidden_rel_err_max"] < HIDDEN_BAR
    assert f["code0_agreement"] >= AGREEMENT_BAR
    assert f["argmax_agreement"] >= AGREEMENT_BAR
