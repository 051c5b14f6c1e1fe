"""A stream's vocoder state between chunks: what makes chunked decoding exact."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from pipecat_qwen_fast.errors import InvalidInputError
from pipecat_qwen_fast.utils.host_copy import to_device_ints


@dataclass
class VocoderStream:
    """Per-utterance streaming state of a Vocoder. Create it with ``Vocoder.new_stream``."""

    histories: list[Tensor]  # per stateful conv: [B, C_in, context] last input columns
    keys: Tensor  # [layers, B, kv_heads, window - 1, head_dim], rotated at absolute positions
    values: Tensor  # [layers, B, kv_heads, window - 1, head_dim]
    # [B] int64 on the device: frames each row has consumed, so rows of one batch may be at
    # different points of their utterances (several sessions decoded in one call).
    position: Tensor
    frames: int = 0  # host copy of ``position`` (of every row: the streams the engine advances are batch 1)
    # An input of the next call, not state: [B] int64 on the device, the frames of each row's
    # chunk when rows of one call hold chunks of different sizes, each padded on the right to
    # the call's frames. Each row commits its state after its own frames (Vocoder.stream_step).
    # None: every row takes all the call's frames (the batch-1 latency path, no gathers).
    valid: Tensor | None = None
    # A stream held in a StreamPool (vocoder/pool.py): its row there, and the lease that gives the
    # row back once nothing refers to this stream (the side stream's pending calls included).
    slot: int | None = None
    lease: object | None = field(default=None, repr=False, compare=False)

    @property
    def batch(self) -> int:
        return self.keys.shape[1]

    @property
    def device(self) -> torch.device:
        return self.keys.device

    @property
    def dtype(self) -> torch.dtype:
        return self.keys.dtype

    def reset(self) -> None:
        """Back to the start of an utterance, reusing the buffers."""
        for h in self.histories:
            h.zero_()
        self.keys.zero_()
        self.values.zero_()
        self.position.zero_()
        self.frames = 0

    def row(self, i: int) -> VocoderStream:
        """Row ``i`` as a batch-1 stream of views: copying into it writes this stream's row."""
        if not 0 <= i < self.batch:
            raise InvalidInputError(f"row {i} is out of range for a stream of batch {self.batch}")
        return VocoderStream(
            histories=[h[i : i + 1] for h in self.histories],
            keys=self.keys[:, i : i + 1],
            values=self.values[:, i : i + 1],
            position=self.position[i : i + 1],
            frames=self.frames,
        )

    def copy_from(self, other: VocoderStream) -> None:
        """In-place copy of another stream of the same shape (e.g. a primed voice prefix, or a
        session's state in and out of a vocoder graph's)."""
        copy_streams([self], [other])
        self.frames = other.frames

    def clone(self) -> VocoderStream:
        return VocoderStream(
            histories=[h.clone() for h in self.histories],
            keys=self.keys.clone(),
            values=self.values.clone(),
            position=self.position.clone(),
            frames=self.frames,
        )


def copy_streams(dsts: list[VocoderStream], srcs: list[VocoderStream]) -> None:
    """``dsts[i] <- srcs[i]`` for every i (device tensors only; ``frames`` is the caller's): the
    floating-point state of all of them in one fused launch where torch offers it, the int64
    positions in another (a list of mixed dtypes takes torch's per-tensor path: ~26 copies a
    stream, each a host round of its own)."""
    floats_d, floats_s, pos_d, pos_s = [], [], [], []
    for d, s in zip(dsts, srcs, strict=True):
        if len(d.histories) != len(s.histories) or d.keys.shape != s.keys.shape:
            raise InvalidInputError("copy_streams: the two vocoder streams have different shapes")
        floats_d += [*d.histories, d.keys, d.values]
        floats_s += [*s.histories, s.keys, s.values]
        pos_d.append(d.position)
        pos_s.append(s.position)
    for dl, sl in ((floats_d, floats_s), (pos_d, pos_s)):
        if hasattr(torch, "_foreach_copy_"):
            torch._foreach_copy_(dl, sl)
        else:  # older torch
            for d, s in zip(dl, sl):
                d.copy_(s)


def device_lengths(valid: Sequence[int], frames: int, device: torch.device) -> Tensor:
    """Host lengths (1 .. ``frames`` each) as an int64 tensor on ``device``, copied without
    waiting for the device (utils/host_copy.py: a pageable copy would stall the host between the
    round's queued vocoder calls)."""
    if any(not 1 <= v <= frames for v in valid):
        raise InvalidInputError(f"valid lengths must be in [1, {frames}]; got {list(valid)}")
    return to_device_ints(valid, device)
