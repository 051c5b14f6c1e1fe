"""utils/host_copy.py: small host lists onto the device, the same values, and on a GPU without the
host waiting for the work already queued (a pageable copy would wait for all of it)."""

from __future__ import annotations

import pytest
import torch

from pipecat_qwen_fast.utils.host_copy import to_device_ints


def test_the_values_as_int64_on_the_device():
    got = to_device_ints((3, 1, 4), "cpu")
    assert got.dtype == torch.long and got.tolist() == [3, 1, 4]
    assert to_device_ints([], torch.device("cpu")).shape == (0,)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU: the copy's ordering is GPU-only")
def test_on_a_gpu_the_copy_is_queued_behind_the_work_and_the_host_goes_on():
    stream = torch.cuda.current_stream()
    to_device_ints(list(range(64)), "cuda")  # a pinned block in torch's cache (a first allocation may sync)
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of the GPU's cycles, queued
    queued = torch.cuda.Event()
    queued.record(stream)
    got = to_device_ints(list(range(64)), "cuda")
    assert not queued.query(), "the host waited for the queued work"
    # Ordered behind it on the stream: the values are right once it has run.
    assert got.tolist() == list(range(64))
    # The pageable copy it replaces waits: the reference for what the test would catch.
    torch.cuda._sleep(2_000_000_000)
    queued.record(stream)
    torch.tensor(list(range(64)), device="cuda")
    assert queued.query()
