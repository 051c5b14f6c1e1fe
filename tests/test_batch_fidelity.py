"""The batched path's teacher-forced fidelity harness on CPU (tests/helpers_fidelity.py; the GPU
bars are tests/test_batch_fidelity_gpu.py's): GraphBackend in fp32 on the tiny checkpoint, fed the
fp32 TorchBackend's codes, gives the reference's argmaxes and hidden states at every frame, with
either predictor pass (the plain layers' multi-position pass, the kernel step's one position at a
time), and at 512 rows (the largest batch bucket) across an attention bucket's edge, the shape whose
GPU run hit a device assert (the host overwriting a queued frame's rows: a race the CPU cannot show,
tests/test_batch_fidelity_gpu.py has it). Teacher forcing itself: a forced frame returns the row's
own codes, feeds back the forced ones, and leaves the unforced frames' graphs alone."""

from __future__ import annotations

import pytest
import torch
from helpers_fidelity import (
    GREEDY,
    bucket_edge_prompts,
    make_prompts,
    measure_batch,
    reference_module,
    run_references,
    summary_line,
)

from pipecat_qwen_fast import QwenTTSEngine
from pipecat_qwen_fast.backends.eager import TorchBackend
from pipecat_qwen_fast.backends.graph import GraphBackend

FRAMES = 40
TEXTS = 3
BAR = 1e-5
EDGE_FRAMES = 4  # bucket_edge_prompts' batch crosses from the 128 into the 256 bucket at its fourth frame


@pytest.fixture(scope="module")
def talker(tiny_checkpoint):
    engine = QwenTTSEngine.from_pretrained(tiny_checkpoint("custom_voice", zero_eos=True), device="cpu",
                                           dtype="float32", backend="eager")
    return engine.model.talker


@pytest.fixture(scope="module")
def references(talker):
    prompts = make_prompts(talker.cfg.hidden_size, TEXTS, torch.device("cpu"))
    return prompts, run_references(TorchBackend(talker, torch.device("cpu"), torch.float32), prompts, FRAMES)


def graph_backend(talker, layer_step: str) -> GraphBackend:
    return GraphBackend(talker, torch.device("cpu"), torch.float32, max_sessions=4, capacity=512, use_graphs=False,
                        layer_step=layer_step)


@pytest.mark.parametrize("layer_step", ["plain", "kernel"])
@pytest.mark.parametrize("batch", [1, 4])
def test_teacher_forced_fp32_matches_the_reference(talker, references, layer_step, batch):
    prompts, refs = references
    f = measure_batch(graph_backend(talker, layer_step), prompts, refs, batch, FRAMES)
    print("\n" + summary_line(batch, f))
    assert f["code0_agreement"] == f["argmax_agreement"] == 1.0
    assert f["talker_hidden_rel_err_max"] < BAR
    assert f["predictor_hidden_rel_err_max"] < BAR


@pytest.fixture(scope="module")
def edge_references(talker):
    prompts = bucket_edge_prompts(talker.cfg.hidden_size, torch.device("cpu"))
    return prompts, run_references(TorchBackend(talker, torch.device("cpu"), torch.float32), prompts, EDGE_FRAMES)


def test_teacher_forced_largest_batch_across_a_bucket_edge(talker, edge_references):
    # 512 rows fill the row buffers (no padding rows) and prefill in one batched pass.
    prompts, refs = edge_references
    gb = GraphBackend(talker, torch.device("cpu"), torch.float32, max_sessions=512, capacity=512, use_graphs=False,
                      layer_step="kernel", pages=3 * 512)
    assert gb.max_batch == 512
    f = measure_batch(gb, prompts, refs, 512, EDGE_FRAMES)
    assert f["code0_agreement"] == f["argmax_agreement"] == 1.0
    assert f["talker_hidden_rel_err_max"] < BAR
    assert f["predictor_hidden_rel_err_max"] < BAR
    assert len(gb.free_pages) == gb.num_pages


def test_references_decode_freely(references):
    # Distinct texts give distinct runs, none stopped (EOS zeroed) or stuck on one code.
    _, refs = references
    firsts = [tuple(r.codes[:, 0].tolist()) for r in refs]
    assert len(set(firsts)) == len(refs)
    assert all(len(set(f)) > FRAMES // 4 for f in firsts)


def open_rows(gb: GraphBackend, prompt, n: int) -> list:
    states = [gb.new_state(max_positions=64, params=GREEDY, seed=0, trailing=prompt.trailing, pad_vec=prompt.pad)
              for _ in range(n)]
    for s in states:
        gb.prefill(s, prompt.embeds)
    return states


@pytest.mark.parametrize("layer_step", ["plain", "kernel"])
@torch.no_grad()
def test_forced_frame_feeds_the_teacher_and_returns_its_own(talker, references, layer_step):
    """Two rows of one text: at frame 1 one is fed its own codes (nothing changes), the other
    other codes. The latter still returns its own code 0; its predictor passes run on the codes it
    was fed (its hidden states the torch modules' on them) and return their own argmaxes; its
    code-0 history and next input are the fed codes'; its next frame differs."""
    prompts, _ = references
    p = prompts[0]
    gb = graph_backend(talker, layer_step)
    states = open_rows(gb, p, 2)
    free = [gb.decode_frames(states) for _ in range(3)]
    for s in states:
        gb.release(s)
    states = open_rows(gb, p, 2)
    fed = (free[1][1] + 7) % 2048
    runs = [gb.decode_frames(states), gb.decode_frames(states, force=torch.stack([free[1][0], fed]))]
    hidden, pred = gb.forced_hidden[1].clone(), gb.forced_pred_hidden[1].clone()
    slot = states[1].slot
    pending, seen = gb.pool_pending[slot].clone(), gb.pool_seen[slot].clone()
    runs.append(gb.decode_frames(states))
    for frame, run in enumerate(runs):
        assert torch.equal(run[0], free[frame][0])
    assert runs[1][1, 0] == free[1][1, 0]
    expected = reference_module().torch_predictor_hidden(talker, hidden, fed)[1:]
    torch.testing.assert_close(pred, expected)
    heads = talker.code_predictor.lm_head
    assert runs[1][1, 1:].tolist() == [int(heads[g](expected[g]).argmax()) for g in range(15)]
    torch.testing.assert_close(pending, talker.embed_frames(fed[None])[0] + p.trailing[1].float())
    assert seen[fed[0]]
    assert not torch.equal(runs[2][1], free[2][1])
