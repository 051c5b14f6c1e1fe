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


def _host_ints(values: Sequence[int], device: torch.device, dtype: torch.dtype = torch.long) -> Tensor:
    """`values` in host memory a copy to `device` need not wait for: pinned for CUDA (torch's host
    allocator keeps it until the copy has run)."""
    host = torch.tensor(list(values), dtype=dtype)
    return host.pin_memory() if device.type == "cuda" else host


def to_device_ints(values: Sequence[int], device: torch.device | str) -> Tensor:
    """`values` as an int64 tensor on `device`, queued on its current stream."""
    device = torch.device(device)
    return _host_ints(values, device).to(device, non_blocking=True)


def copy_ints_into(dst: Tensor, values: Sequence[int]) -> None:
    """`dst[:] = values` queued on the current stream like `to_device_ints` (no wait for the device),
    into a tensor the device already holds (a CUDA graph's static input)."""
    dst.copy_(_host_ints(values, dst.device, dst.dtype), non_blocking=True)
