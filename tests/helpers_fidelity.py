"""Teacher-forced fidelity of the batched decode path against fp32 (issue 34, item 5).

An fp32 TorchBackend decodes each text freely and greedily; GraphBackend rows, several to a text,
are fed the reference's 16 codes at every frame instead of their own, so every frame starts from
the reference's history and its differences are that frame's own. Each row's argmaxes (code 0,
codes 1-15) and hidden states (the talker's, and the predictor's at passes 1-15) are compared with
the reference's at that frame, by tests/test_megakernel.py's measure: |a - b| / |b| over a row's
vector. The texts are random prompts and text rows of different lengths (the checkpoints are
random too); their values are bf16-representable, so both paths read the same inputs."""

from __future__ import annotations

import importlib.util
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from pipecat_qwen_fast.backends.eager import TorchBackend
from pipecat_qwen_fast.backends.graph import GraphBackend
from pipecat_qwen_fast.model.sampling import SamplingParams

GREEDY = SamplingParams(do_sample=False, subtalker_do_sample=False)


def reference_module():
    """cuda/reference.py (random full-size talkers, the torch modules' predictor hidden states),
    imported by path: cuda/ is not a package."""
    path = Path(__file__).resolve().parent.parent / "cuda" / "reference.py"
    spec = importlib.util.spec_from_file_location("qmk_reference", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass
class Prompt:
    embeds: Tensor  # [L, D] the prefill's input
    trailing: Tensor  # [N, D] text vectors added to frames 0..N-1's next inputs
    pad: Tensor  # [D] added from frame N on


@dataclass
class Reference:
    codes: Tensor  # [frames, 16] what the fp32 path decoded
    hidden: Tensor  # [frames, D] the talker hidden each frame started from (frame 0: the prefill's)
    pred_hidden: Tensor  # [frames, 15, Dp] the predictor's post-norm hidden at passes 1-15


def make_prompts(hidden_size: int, count: int, device: torch.device, seed: int = 1, shortest: int = 10) -> list[Prompt]:
    """`count` distinct texts, prompts of `shortest` to `shortest` + 42 positions and 3-59 text
    rows: the batch then holds rows at different positions and offsets into their pages."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def draw(*shape: int) -> Tensor:
        return (torch.randn(shape, device=device, generator=gen) * 0.05).to(torch.bfloat16)

    return [Prompt(draw(shortest + 6 * (i % 8), hidden_size), draw(3 + 8 * (i % 8), hidden_size), draw(hidden_size))
            for i in range(count)]


def bucket_edge_prompts(hidden_size: int, device: torch.device) -> list[Prompt]:
    """3 texts of 114, 120 and 126 positions: a batch's first frames attend over the 128-position
    bucket with its longest rows on that bucket's last page, and its fourth frame crosses into the
    256 bucket (where a frame that read another frame's positions would index a page past its
    bucket)."""
    return make_prompts(hidden_size, 3, device, shortest=114)


# ---------------------------------------------------------------------------------------------
# The fp32 reference

_recorded = threading.local()


@contextmanager
def predictor_outputs_recorded(talker):
    """While open, each thread's calls of the predictor stack append their post-norm outputs to
    that thread's `_recorded.outs` (when it has one): TorchBackend's own predictor hidden states,
    with no second predictor pass to recompute them."""
    def keep(module, args, out):
        outs = getattr(_recorded, "outs", None)
        if outs is not None:
            outs.append(out)

    handle = talker.code_predictor.model.register_forward_hook(keep)
    try:
        yield
    finally:
        handle.remove()


@torch.no_grad()
def run_reference(tb: TorchBackend, prompt: Prompt, frames: int) -> Reference:
    """The fp32 path decodes `frames` greedy frames of the text freely (call inside
    `predictor_outputs_recorded`)."""
    st = tb.new_state(max_positions=prompt.embeds.shape[0] + frames + 2, params=GREEDY, seed=0,
                      trailing=prompt.trailing, pad_vec=prompt.pad)
    tb.prefill(st, prompt.embeds.float())
    _recorded.outs = []
    codes, hidden = [], []
    try:
        for _ in range(frames):
            codes.append(tb.decode_frame(st))
            hidden.append(st.hidden)
        outs = torch.cat(_recorded.outs)  # per frame: passes 0-1 in one call, then 2-15
    finally:
        _recorded.outs = None
        tb.release(st)
    pred = outs.view(frames, tb.num_groups, -1)[:, 1:]
    return Reference(torch.stack(codes), torch.stack(hidden).float(), pred.float())


def run_references(tb: TorchBackend, prompts: list[Prompt], frames: int) -> list[Reference]:
    """Every text's reference, each in a thread of its own: an eager frame is thousands of small
    launches whose dispatch runs outside the GIL, so the texts' launches overlap."""
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # TF32 matmuls would round the reference to ~1e-3
    try:
        with predictor_outputs_recorded(tb.talker), ThreadPoolExecutor(len(prompts)) as pool:
            return list(pool.map(lambda p: run_reference(tb, p, frames), prompts))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


@torch.no_grad()
def eager_prefill_err(tb: TorchBackend, prompt: Prompt, ref: Reference) -> float:
    """The eager path's prefill hidden in `tb`'s dtype against the reference's: the floor that
    arithmetic in that dtype sets, whatever the path (bf16 rounds each activation by up to 2^-8)."""
    st = tb.new_state(max_positions=prompt.embeds.shape[0], params=GREEDY, seed=0, trailing=prompt.trailing,
                      pad_vec=prompt.pad)
    try:
        tb.prefill(st, prompt.embeds)
        return float(row_rel_err(st.hidden[None], ref.hidden[:1]))
    finally:
        tb.release(st)


# ---------------------------------------------------------------------------------------------
# The batched path, teacher-forced


def row_rel_err(a: Tensor, b: Tensor) -> Tensor:
    """|a - b| / |b| per row of [n, ...] tensors, in fp32."""
    a, b = a.float().flatten(1), b.float().flatten(1)
    return (a - b).norm(dim=1) / b.norm(dim=1)


def pages_for(gb: GraphBackend, prompts: list[Prompt], texts: list[int], frames: int) -> int:
    return sum(gb.pages_needed(session_positions(prompts[i], frames)) for i in texts)


def session_positions(prompt: Prompt, frames: int) -> int:
    return prompt.embeds.shape[0] + frames + 1


def open_states(gb: GraphBackend, prompts: list[Prompt], texts: list[int], frames: int) -> list:
    """len(texts) sessions, row r reading text texts[r], prefilled by the backend itself (as
    deployed: one by one under `batched_prefill_min` rows, else in one pass)."""
    states = []
    try:
        for i in texts:
            states.append(gb.new_state(max_positions=session_positions(prompts[i], frames), params=GREEDY, seed=0,
                                       trailing=prompts[i].trailing, pad_vec=prompts[i].pad))
        gb.prefill_many(states, [prompts[i].embeds for i in texts])
    except BaseException:
        for s in states:
            gb.release(s)
        raise
    return states


@torch.no_grad()
def decode_rows(gb: GraphBackend, prompts: list[Prompt], texts: list[int], frames: int, force: Tensor | None = None,
                run_ahead: bool = False) -> Tensor:
    """`frames` frames of len(texts) rows (`force` [frames, rows, 16]: each frame's forced codes)
    -> their codes [frames, rows, 16]. By default the host waits for each frame, as the engine
    does (it reads each round's codes back). `run_ahead` (CUDA): the host reads nothing back, as
    the fidelity runs do, and the stream is held busy before each frame, so the host is always a
    frame ahead of the GPU, whatever the batch's size; run the same frames without it first, so
    that no frame captures a graph (a capture waits for the GPU)."""
    states = open_states(gb, prompts, texts, frames)
    try:
        out = []
        for t in range(frames):
            if run_ahead:
                torch.cuda._sleep(100_000_000)  # ~50 ms: far longer than the host takes to queue a frame
            out.append(gb.decode_frames(states, force=None if force is None else force[t]))
            if not run_ahead and gb.device.type == "cuda":
                torch.cuda.synchronize(gb.device)
        return torch.stack(out).cpu()
    finally:
        for s in states:
            gb.release(s)


@torch.no_grad()
def teacher_forced_rows(gb: GraphBackend, prompts: list[Prompt], refs: list[Reference], texts: list[int],
                        frames: int) -> dict:
    """One batch of len(texts) rows (`open_states`), then `frames` frames, each fed its text's
    reference codes. Sums and extremes over rows and frames (host syncs only at the end)."""
    states = open_states(gb, prompts, texts, frames)
    try:
        idx = torch.tensor(texts, device=gb.device)
        ref_codes = torch.stack([r.codes for r in refs])  # [texts, frames, 16]
        ref_hidden = torch.stack([r.hidden for r in refs])
        ref_pred = torch.stack([r.pred_hidden for r in refs])
        n = len(states)
        talker_err = torch.zeros(frames, n, device=gb.device)
        pred_err = torch.zeros(frames, n, device=gb.device)
        agree = torch.zeros(gb.num_groups, device=gb.device, dtype=torch.long)
        for t in range(frames):
            force = ref_codes[idx, t]
            codes = gb.decode_frames(states, force=force)
            agree += (codes == force).sum(0)
            talker_err[t] = row_rel_err(gb.forced_hidden[:n], ref_hidden[idx, t])
            pred_err[t] = row_rel_err(gb.forced_pred_hidden[:n], ref_pred[idx, t])
    finally:
        for s in states:
            gb.release(s)
    return {"rows": n, "frames": frames, "agree": agree.cpu(), "talker_err": talker_err.cpu(),
            "pred_err": pred_err.cpu()}


def summarize(runs: list[dict]) -> dict:
    """Figures of one batch size over its runs (batch 1 runs one text at a time)."""
    agree = sum(r["agree"] for r in runs)
    codes = sum(r["rows"] * r["frames"] for r in runs)
    talker = torch.cat([r["talker_err"].flatten() for r in runs])
    prefill = torch.cat([r["talker_err"][0] for r in runs])
    pred = torch.cat([r["pred_err"].flatten() for r in runs])
    return {
        "rows": runs[0]["rows"], "runs": len(runs), "frames": runs[0]["frames"],
        "code0_agreement": float(agree[0]) / codes,
        "codes_1_15_agreement": float(agree[1:].sum()) / (codes * (len(agree) - 1)),
        "argmax_agreement": float(agree.sum()) / (codes * len(agree)),
        "talker_hidden_rel_err_max": float(talker.max()), "talker_hidden_rel_err_mean": float(talker.mean()),
        "prefill_hidden_rel_err_max": float(prefill.max()),
        "predictor_hidden_rel_err_max": float(pred.max()), "predictor_hidden_rel_err_mean": float(pred.mean()),
    }


def measure_batch(gb: GraphBackend, prompts: list[Prompt], refs: list[Reference], rows: int, frames: int) -> dict:
    """Batch `rows`, its rows the texts in turn; batch 1 once per text (each a batch of one)."""
    start = time.perf_counter()
    if rows == 1:
        runs = [teacher_forced_rows(gb, prompts, refs, [i], frames) for i in range(len(prompts))]
    else:
        runs = [teacher_forced_rows(gb, prompts, refs, [r % len(prompts) for r in range(rows)], frames)]
    return summarize(runs) | {"texts": len(prompts), "layer_step": gb.layer_step,
                              "seconds": round(time.perf_counter() - start, 2)}


def summary_line(batch: int, f: dict) -> str:
    return (f"batch {batch} ({f['texts']} texts, {f['frames']} teacher-forced frames, {f['layer_step']} step) vs "
            f"fp32 TorchBackend: argmax agreement code 0 {f['code0_agreement']:.4f}, codes 1-15 "
            f"{f['codes_1_15_agreement']:.4f}, all {f['argmax_agreement']:.4f}; talker hidden rel err max "
            f"{f['talker_hidden_rel_err_max']:.2e} mean {f['talker_hidden_rel_err_mean']:.2e} (prefill "
            f"{f['prefill_hidden_rel_err_max']:.2e}); predictor max {f['predictor_hidden_rel_err_max']:.2e} "
            f"mean {f['predictor_hidden_rel_err_mean']:.2e}; {f['seconds']:.1f} s")
