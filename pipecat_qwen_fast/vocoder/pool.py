"""Every engine session's vocoder state as one row of buffers shared by all of them.

A batched vocoder call runs on its entry's own state (the graph's static buffers, vocoder/graphs.py).
With each session's state in a tensor of its own, the call copied every stream's 24 buffers in and
out: a `_foreach_copy_` over ~1500 tensors at 64 rows, which took 13.5 % of the engine thread at 384
callers through the server (docs/journal/NOTES.md, session 35). With the states as rows of a pool,
the call's streams are one index tensor: `gather` and `scatter` move the rows in 26 indexed copies
each, whatever the rows (captured as graphs of their own beside the entry's step), and the host's
work no longer grows with the rows.

A row is a session's packed state (`Vocoder.new_stream(packed=True)`): its floating-point buffers
are one contiguous slice of `flat`, so a new stream is zeroed by one kernel, as before. The last row
is scratch: padding rows of a batched call read and write it.

A row goes back to the pool when its stream is no longer referenced (the lease's finalizer): the
side stream's vocoder calls keep their streams until they are resolved (engine/deferred_audio.py),
so no call still queued on the GPU can write a row that a new session has been given.
"""

from __future__ import annotations

import math
import os

import torch
from torch import Tensor

from pipecat_qwen_fast.vocoder.stream import VocoderStream
from pipecat_qwen_fast.vocoder.vocoder import Vocoder

# Of the device's memory, what the pool may take at most (2.6 MB a row for the released vocoder in
# bfloat16: 1024 rows are 2.7 GB, 2 % of an H200).
MEMORY_SHARE = 0.04


def pool_slots(vocoder: Vocoder, device: torch.device, dtype: torch.dtype, sessions: int) -> int:
    """Rows for an engine that decodes up to `sessions` at once: one each, within MEMORY_SHARE of
    the device; `QWEN_FAST_VOCODER_POOL` sets the rows (0: no pool, every call copies its states,
    for an A/B on the device)."""
    env = os.environ.get("QWEN_FAST_VOCODER_POOL")
    if env is not None:
        if not env.strip().isdigit():
            raise ValueError(f"QWEN_FAST_VOCODER_POOL must be a number of rows (0: no pool), got {env!r}")
        return int(env)
    if device.type != "cuda":
        return sessions
    row = sum(math.prod(s) for s in vocoder.stream_shapes(1)) * torch.empty((), dtype=dtype).element_size()
    total = torch.cuda.get_device_properties(device).total_memory
    return max(0, min(sessions, int(MEMORY_SHARE * total) // row))


class _Lease:
    """Returns its row to the pool when the stream holding it is gone."""

    __slots__ = ("free", "slot")

    def __init__(self, free: list[int], slot: int):
        self.free, self.slot = free, slot

    def __del__(self) -> None:
        self.free.append(self.slot)  # list.append is atomic: safe from any thread's last reference


class StreamPool:
    def __init__(self, vocoder: Vocoder, slots: int, device: torch.device, dtype: torch.dtype):
        if slots < 1:
            raise ValueError(f"a stream pool needs at least one slot, got {slots}")
        self.slots = slots
        self.scratch = slots
        one = vocoder.stream_shapes(batch=1)
        sizes = [math.prod(s) for s in one]
        self.flat = torch.zeros(slots + 1, sum(sizes), device=device, dtype=dtype)
        self.position = torch.zeros(slots + 1, device=device, dtype=torch.long)
        self._one = one
        self._parts: list[tuple[int, int]] = []  # (offset, size) of each buffer in a row
        offset = 0
        for n in sizes:
            self._parts.append((offset, n))
            offset += n
        # Every row of each buffer at once, in the layout of a batched stream's buffer: histories
        # [slots + 1, C, ctx] (gathered along dim 0), keys and values [layers, slots + 1, ...]
        # (along dim 1). Views of `flat`: writing them writes the sessions' own streams.
        self.buffers: list[Tensor] = []
        self._dims: list[int] = []  # the dimension of each buffer that indexes rows
        for shape, (off, n) in zip(one, self._parts):
            rows = self.flat[:, off : off + n]
            if len(shape) == 3:  # history [1, C, ctx]
                self.buffers.append(rows.view(slots + 1, *shape[1:]))
                self._dims.append(0)
            else:  # keys / values [layers, 1, kv_heads, window - 1, head_dim]
                self.buffers.append(rows.view(slots + 1, shape[0], *shape[2:]).transpose(0, 1))
                self._dims.append(1)
        self.free = list(range(slots - 1, -1, -1))

    @property
    def row_bytes(self) -> int:
        return self.flat.shape[1] * self.flat.element_size()

    def new_stream(self) -> VocoderStream | None:
        """A zeroed stream in a free row, or None when every row is taken."""
        try:
            slot = self.free.pop()
        except IndexError:
            return None
        self.flat[slot].zero_()
        self.position[slot].zero_()
        row = self.flat[slot]
        views = [row[off : off + n].view(shape) for (off, n), shape in zip(self._parts, self._one)]
        return VocoderStream(histories=views[:-2], keys=views[-2], values=views[-1],
                             position=self.position[slot : slot + 1], slot=slot, lease=_Lease(self.free, slot))

    def holds(self, streams: list[VocoderStream]) -> bool:
        """Whether every one of these streams is a row of this pool."""
        return all(st.lease is not None and st.lease.free is self.free for st in streams)

    def gather(self, idx: Tensor, into: VocoderStream) -> None:
        """Row j of the batched stream `into` <- the pool's row idx[j]."""
        for buf, dst, dim in zip(self.buffers, [*into.histories, into.keys, into.values], self._dims):
            torch.index_select(buf, dim, idx, out=dst)
        torch.index_select(self.position, 0, idx, out=into.position)

    def scatter(self, idx: Tensor, out_of: VocoderStream) -> None:
        """The pool's row idx[j] <- row j of the batched stream `out_of` (padding rows all name the
        scratch row: which of them lands there does not matter)."""
        for buf, src, dim in zip(self.buffers, [*out_of.histories, out_of.keys, out_of.values], self._dims):
            buf.index_copy_(dim, idx, src)
        self.position.index_copy_(0, idx, out_of.position)
