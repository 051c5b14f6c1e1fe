"""The decode-backend protocol: the frame-granular interface between the engine and the model.
Semantics of `decode_frame` are in docs/ARCHITECTURE.md ("Decode backends")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from torch import Tensor

from pipecat_qwen_fast.model.sampling import SamplingParams


class DecodeBackend(Protocol):
    name: str

    def new_state(
        self, *, max_positions: int, params: SamplingParams, seed: int | None, trailing: Tensor, pad_vec: Tensor
    ) -> object: ...

    def prefill(self, state: object, embeds: Tensor) -> None: ...

    def decode_frame(self, state: object) -> Tensor: ...

    def release(self, state: object) -> None: ...

    # Streamed text (engine/text_session.py): the state's text vectors replaced by a longer
    # tensor whose rows already read are unchanged.
    def set_trailing(self, state: object, trailing: Tensor) -> None: ...

    # Optional (streamed text's first frame): frame 0's codes made ahead of the frame, from the
    # prefill alone, the state left at frame 0; decode_frame then returns those codes and makes
    # the next input from trailing[0] as it is by then. Megakernel and eager have it.
    #   def preview_frame(self, state: object) -> Tensor: ...


@dataclass
class SessionSnapshot:
    """A decode session between frames, in a form any backend can start from (the auto backend
    moves sessions from the megakernel into the batch with it). Tensors may be views of the old
    state's buffers: adopt them before that state is released."""

    k: Tensor  # talker K of positions 0..length-1 (after norm and RoPE): [layers, kv_heads, length, head_dim]
    v: Tensor
    frame: int  # frames decoded so far
    hidden: Tensor  # post-norm talker hidden at the newest position (what frame 0 starts from)
    pending: Tensor  # next talker input (frames > 0)
    seen: Tensor  # bool [vocab]: code-0 ids generated so far
    params: SamplingParams
    seed: int  # seeds the adopting backend's draws from here on
    trailing: Tensor
    pad_vec: Tensor
    max_positions: int | None = None  # the positions its whole budget needs (None: unknown)
