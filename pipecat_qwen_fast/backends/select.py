"""Which device, dtype and decode backend an engine runs on."""

from __future__ import annotations

import logging

import torch

from pipecat_qwen_fast.backends.base import DecodeBackend
from pipecat_qwen_fast.backends.eager import TorchBackend
from pipecat_qwen_fast.errors import InvalidInputError, UnsupportedFeatureError
from pipecat_qwen_fast.model.talker import Qwen3TTSModel
from pipecat_qwen_fast.utils.phases import phase

logger = logging.getLogger("pipecat_qwen_fast")

BACKENDS = ("auto", "megakernel", "torch", "eager")


def resolve_device(device: str | torch.device) -> torch.device:
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise InvalidInputError(f"unknown device {device!r}; use 'auto', 'cpu', 'cuda' or 'cuda:N'") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidInputError("device 'cuda' was requested but CUDA is not available; use device='cpu'")
    return dev


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise InvalidInputError(f"unknown dtype {dtype!r}; valid: auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def _torch_backend(net: Qwen3TTSModel, device: torch.device, dtype: torch.dtype) -> DecodeBackend:
    if device.type == "cuda":
        from pipecat_qwen_fast.backends.graph import GraphBackend

        return GraphBackend.for_device(net.talker, device, dtype)
    return TorchBackend(net.talker, device, dtype)


def _hybrid_backend(net: Qwen3TTSModel, device: torch.device, dtype: torch.dtype) -> DecodeBackend:
    """`auto` on a supported GPU: the megakernel for a few calls, batched graphs for more."""
    from pipecat_qwen_fast.backends.hybrid import HybridBackend
    from pipecat_qwen_fast.backends.megakernel import MegakernelBackend

    # The graph backend first: it fuses the q/k/v and gate/up weights in place, and the megakernel
    # must take its weight addresses after that. The two share the captured prefills where both
    # prefill in bf16 (the megakernel's prefill="bf16"); by default the megakernel's are fp32.
    with phase("building the batch backend"):
        bulk = _torch_backend(net, device, dtype)
    with phase("building the megakernel backend"):
        fast = MegakernelBackend(net.talker, device, dtype, prefills=getattr(bulk, "prefills", None))
    return HybridBackend(fast, bulk)


def select_backend(name: str, net: Qwen3TTSModel, device: torch.device, dtype: torch.dtype) -> DecodeBackend:
    if name == "eager":
        return TorchBackend(net.talker, device, dtype)
    if name == "torch":
        return _torch_backend(net, device, dtype)
    reason = None
    if device.type != "cuda":
        reason = "the megakernel needs a CUDA device"
    else:
        try:
            from pipecat_qwen_fast.backends.megakernel import (
                MegakernelBackend,
                megakernel_unsupported_reason,
            )

            reason = megakernel_unsupported_reason(net, device, dtype)
            if reason is None and name == "megakernel":
                return MegakernelBackend(net.talker, device, dtype)
            if reason is None:
                return _hybrid_backend(net, device, dtype)
        except ImportError as e:  # megakernel module not built / not available
            reason = f"megakernel unavailable ({e})"
    if name == "megakernel":
        raise UnsupportedFeatureError(f"backend='megakernel' is not supported here: {reason}")
    if device.type == "cuda":
        logger.warning("falling back to the torch backend: %s", reason)
    else:
        logger.info("using the torch backend: %s", reason)
    return _torch_backend(net, device, dtype)
