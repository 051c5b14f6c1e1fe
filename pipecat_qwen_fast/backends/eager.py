"""Decode backends: the frame-granular interface between the engine and the model.

`TorchBackend` is the plain-PyTorch reference. The megakernel backend (`megakernel.py`) implements
the same protocol, and tests compare the two. Semantics of `decode_frame` are in
docs/ARCHITECTURE.md ("Decode backends").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from pipecat_qwen_fast.backends.base import SessionSnapshot
from pipecat_qwen_fast.model.layers import KVCache
from pipecat_qwen_fast.model.sampling import (
    SamplingParams,
    counter_uniform,
    sample_code0,
    sample_residual,
    seed_as_int64,
    session_seed,
    talker_suppress_mask,
)
from pipecat_qwen_fast.model.talker import Talker


@dataclass
class TorchDecodeState:
    talker_cache: KVCache
    predictor_cache: KVCache
    params: SamplingParams
    seed: int  # the draws are counter_uniform's of (seed, frame, code group)
    trailing: Tensor  # [N, D]
    pad_vec: Tensor  # [D]
    seen: Tensor  # bool [vocab]: code-0 ids generated so far (repetition penalty)
    frame: int = 0
    hidden: Tensor | None = None  # post-norm talker hidden at the newest position
    pending: Tensor | None = None  # next talker input
    # Frame 0's codes made ahead of the frame by `preview_frame`: (returned codes, codes, code 0).
    preview: tuple[Tensor, Tensor, Tensor] | None = None
    released: bool = field(default=False)


class TorchBackend:
    name = "torch"

    def __init__(self, talker: Talker, device: torch.device, dtype: torch.dtype):
        self.talker = talker
        self.device = device
        self.dtype = dtype
        self.eos_id = talker.cfg.codec_eos_id
        self.num_groups = talker.cfg.num_code_groups
        self.suppress = talker_suppress_mask(talker.cfg.vocab_size, self.eos_id, device)
        self.groups = torch.arange(self.num_groups)  # on the host: a frame's 16 uniforms, then one copy

    def new_state(
        self, *, max_positions: int, params: SamplingParams, seed: int | None, trailing: Tensor, pad_vec: Tensor
    ) -> TorchDecodeState:
        seed = session_seed(seed)
        pred = self.talker.code_predictor.cfg
        return TorchDecodeState(
            talker_cache=KVCache(self.talker.cfg.stack, max_positions, self.device, self.dtype),
            # 2 prefill positions + 14 single steps; the 16th slot is never written.
            predictor_cache=KVCache(pred.stack, pred.num_code_groups, self.device, self.dtype),
            params=params,
            seed=seed,
            trailing=trailing.to(self.device, self.dtype),
            pad_vec=pad_vec.to(self.device, self.dtype),
            seen=torch.zeros(self.talker.cfg.vocab_size, dtype=torch.bool, device=self.device),
        )

    @torch.no_grad()
    def prefill(self, state: TorchDecodeState, embeds: Tensor) -> None:
        hidden = self.talker.model(embeds.to(self.device, self.dtype), state.talker_cache)
        state.hidden = hidden[-1]

    @torch.no_grad()
    def decode_frame(self, state: TorchDecodeState) -> Tensor:
        if state.released:
            raise RuntimeError("decode_frame on a released state")
        talker = self.talker
        if state.preview is not None:  # frame 0's codes were made ahead (preview_frame)
            out, codes, c0 = state.preview
            state.preview = None
        else:
            if state.frame > 0:
                state.hidden = talker.model(state.pending[None], state.talker_cache)[-1]
            out, codes, c0 = self._codes(state)
        state.seen[c0] = True
        # Next talker input: Σ16 embeddings + the trailing text vector of this step (or tts_pad).
        text_vec = state.trailing[state.frame] if state.frame < state.trailing.shape[0] else state.pad_vec
        state.pending = talker.embed_frames(codes[None])[0] + text_vec
        state.frame += 1
        return out

    @torch.no_grad()
    def preview_frame(self, state: TorchDecodeState) -> Tensor:
        """Frame 0's codes before the frame runs: they need only the prefill's hidden state, while
        the frame's next talker input needs trailing[0] (spec §4.5: the second text token), which
        streamed text may not have yet. The state stays at frame 0; `decode_frame` then returns
        these codes and makes the next input from the trailing row it has by then. The same
        operations in the same order as a frame run whole."""
        if state.released:
            raise RuntimeError("preview_frame on a released state")
        if state.frame != 0:
            raise RuntimeError(f"only frame 0 can be previewed (the state is at frame {state.frame})")
        if state.preview is None:
            state.preview = self._codes(state)
        return state.preview[0]

    def _codes(self, state: TorchDecodeState) -> tuple[Tensor, Tensor, Tensor]:
        """The codec head, code 0 and the 15 predictor steps on `state.hidden`: (the frame's codes
        as decode_frame returns them, the 16 codes, code 0)."""
        h = state.hidden
        logits = self.talker.codec_head(h)
        seed, frame = torch.tensor(seed_as_int64(state.seed)), torch.tensor(state.frame)
        u = counter_uniform(seed, frame, self.groups).to(self.device)
        c0 = sample_code0(logits, state.seen, self.suppress, state.frame, self.eos_id, state.params, u[0])
        codes = self.predict_residual_codes(state, h, c0, u)
        # An EOS frame carries no residual codes; mask them without a host sync.
        eos_frame = torch.zeros_like(codes)
        eos_frame[0] = self.eos_id
        return torch.where(c0 == self.eos_id, eos_frame, codes), codes, c0

    def predict_residual_codes(self, state: TorchDecodeState, h: Tensor, c0: Tensor, u: Tensor) -> Tensor:
        """15 dependent predictor steps -> LongTensor[16] = [c0, c1..c15]; code g draws at u[g]."""
        cp = self.talker.code_predictor
        cache = state.predictor_cache
        cache.reset()
        x = torch.stack([h, self.talker.embed_codec(c0.view(1))[0]])
        out = cp.model(cp.small_to_mtp_projection(x), cache)
        codes = [c0.view(())]
        code = sample_residual(cp.lm_head[0](out[-1]), state.params, u[1])
        codes.append(code)
        for g in range(2, self.num_groups):
            x = cp.model.codec_embedding[g - 2](code.view(1))
            out = cp.model(cp.small_to_mtp_projection(x), cache)
            code = sample_residual(cp.lm_head[g - 1](out[-1]), state.params, u[g])
            codes.append(code)
        return torch.stack(codes).long()

    def export_state(self, state: TorchDecodeState) -> SessionSnapshot:
        n = state.talker_cache.length
        seed = state.seed  # the adopter draws the same uniforms from the next frame
        return SessionSnapshot(
            k=state.talker_cache.k[:, :, :n], v=state.talker_cache.v[:, :, :n], frame=state.frame,
            hidden=state.hidden, pending=state.pending if state.pending is not None else torch.zeros_like(state.hidden),
            seen=state.seen, params=state.params, seed=seed, trailing=state.trailing, pad_vec=state.pad_vec,
            max_positions=state.talker_cache.max_len,
        )

    def set_trailing(self, state: TorchDecodeState, trailing: Tensor) -> None:
        """Replace the text vectors the state's frames add (streamed text grows them as it
        arrives); frame t reads row t when it runs, so only rows of frames not yet run may change."""
        state.trailing = trailing.to(self.device, self.dtype)

    def release(self, state: TorchDecodeState) -> None:
        if state.released:
            return
        state.released = True
        # Drop the big buffers now rather than when the session object is collected.
        state.talker_cache.k = state.talker_cache.v = torch.empty(0)
        state.predictor_cache.k = state.predictor_cache.v = torch.empty(0)
        state.hidden = state.pending = state.preview = None
