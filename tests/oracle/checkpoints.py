"""Derived tiny checkpoints that make the oracle comparison discriminating.

The builder's random init gives near-uniform attention (QK-norm weights ~1 on tiny widths), so
the talker barely looks at its prompt: changing a word, an instruction or a language often leaves
the greedy codes unchanged, and a prompt bug could go unnoticed. Scaling every ``q_norm``/``k_norm``
weight sharpens attention until such changes show up in the codes. Random weights also almost never
pick EOS (one id among 2049), so the stop logic would never be compared; giving the EOS row of
``codec_head`` the (slightly amplified) row of a code the model does emit makes EOS win wherever that
code would, mid-utterance. Both sides load the same derived files, so exactness is still judged
against the official package; only the weights are less bland.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

EOS_ROW = "talker.codec_head.weight"


def read_tensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, (f.metadata() or {})  # noqa: SIM118


def sharpen(tensors: dict[str, torch.Tensor], qk_gain: float) -> None:
    for name, t in tensors.items():
        if name.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")):
            tensors[name] = (t.float() * qk_gain).to(t.dtype)


def shadow_eos(tensors: dict[str, torch.Tensor], eos_id: int, code: int, gain: float) -> None:
    head = tensors[EOS_ROW].clone()
    head[eos_id] = (head[code].float() * gain).to(head.dtype)
    tensors[EOS_ROW] = head


def derive_checkpoint(src: Path, cache_root: Path, *, qk_gain: float, eos_code: int | None = None,
                      eos_gain: float = 1.05) -> Path:
    """Copy ``src`` with sharpened attention (and EOS shadowing ``eos_code``); cached, atomic."""
    src = Path(src)
    h = hashlib.sha256(json.dumps([src.name, qk_gain, eos_code, eos_gain]).encode())
    h.update((src / "model.safetensors").read_bytes())
    final = Path(cache_root) / f"{src.name[:40]}-derived-{h.hexdigest()[:16]}"
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{final.name}.tmp-", dir=final.parent))
    try:
        shutil.copytree(src, tmp, dirs_exist_ok=True)
        tensors, metadata = read_tensors(src / "model.safetensors")
        sharpen(tensors, qk_gain)
        if eos_code is not None:
            eos_id = json.loads((src / "config.json").read_text())["talker_config"]["codec_eos_token_id"]
            shadow_eos(tensors, eos_id, eos_code, eos_gain)
        save_file(tensors, str(tmp / "model.safetensors"), metadata=metadata)
        try:
            os.rename(tmp, final)
        except OSError:  # a concurrent run renamed its identical copy first
            if not final.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
