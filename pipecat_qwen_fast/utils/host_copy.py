"""Small host lists onto the device without waiting for it.

`torch.tensor(ids, device="cuda")` copies from pageable memory, and CUDA synchronizes the stream
before such a copy: the engine thread then waits for every frame and vocoder call already queued
(and, after `VocoderSide.order_main`, for the side stream's too) before it can go on building a
prompt. From pinned memory the copy is queued like a kernel and the host goes on.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def to_device_ints(values: Sequence[int], device: torch.device | str) -> Tensor:
    """`values` as an int64 tensor on `device`, queued on its current stream (CUDA: through
    pinned memory, which torch's host allocator keeps until the copy has run)."""
    host = torch.tensor(list(values), dtype=torch.long)
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def copy_ints_into(dst: Tensor, values: Sequence[int]) -> None:
    """`dst[:] = values` queued on the current stream like `to_device_ints` (no wait for the device),
    into a tensor the device already holds (a CUDA graph's static input)."""
    host = torch.tensor(list(values), dtype=dst.dtype)
    if dst.device.type == "cuda":
        host = host.pin_memory()
    dst.copy_(host, non_blocking=True)
