"""The talker (28-layer Qwen3 over text + codec embeddings) and the 5-layer code predictor.

Plain PyTorch: this is the reference path the megakernel is checked against. Parameter names match
the checkpoint's `talker.*` tensors (spec appendix).
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from pipecat_qwen_fast.config import ModelConfig, PredictorConfig, TalkerConfig
from pipecat_qwen_fast.model.layers import DecoderStack


class TalkerModel(DecoderStack):
    def __init__(self, cfg: TalkerConfig):
        super().__init__(cfg.stack)
        self.text_embedding = nn.Embedding(cfg.text_vocab_size, cfg.text_hidden_size)
        self.codec_embedding = nn.Embedding(cfg.vocab_size, cfg.hidden_size)


class TextProjection(nn.Module):
    """`fc2(silu(fc1(e)))` with biases: maps 2048-wide text embeddings to the talker width."""

    def __init__(self, text_hidden: int, out: int):
        super().__init__()
        self.linear_fc1 = nn.Linear(text_hidden, text_hidden, bias=True)
        self.linear_fc2 = nn.Linear(text_hidden, out, bias=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_fc2(nn.functional.silu(self.linear_fc1(x)))


class CodePredictorModel(DecoderStack):
    def __init__(self, cfg: PredictorConfig, talker_hidden: int):
        super().__init__(cfg.stack)
        # Table g-1 embeds residual group g (g = 1..15), in the talker's width.
        self.codec_embedding = nn.ModuleList(
            nn.Embedding(cfg.vocab_size, talker_hidden) for _ in range(cfg.num_code_groups - 1)
        )


class CodePredictor(nn.Module):
    def __init__(self, cfg: PredictorConfig, talker_hidden: int):
        super().__init__()
        self.cfg = cfg
        self.model = CodePredictorModel(cfg, talker_hidden)
        self.lm_head = nn.ModuleList(
            nn.Linear(cfg.stack.hidden_size, cfg.vocab_size, bias=False) for _ in range(cfg.num_code_groups - 1)
        )
        # 1.7B: every predictor input (talker hidden and code embeddings) is projected 2048 -> 1024.
        self.small_to_mtp_projection: nn.Module = (
            nn.Linear(talker_hidden, cfg.stack.hidden_size, bias=True)
            if talker_hidden != cfg.stack.hidden_size
            else nn.Identity()
        )


class Talker(nn.Module):
    def __init__(self, cfg: TalkerConfig, predictor_cfg: PredictorConfig):
        super().__init__()
        self.cfg = cfg
        self.model = TalkerModel(cfg)
        self.text_projection = TextProjection(cfg.text_hidden_size, cfg.hidden_size)
        self.codec_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.code_predictor = CodePredictor(predictor_cfg, cfg.hidden_size)
        # The dtype prompts are built at (model/prompt.py); None: the weights'. The megakernel's
        # fp32 prefill sets float32: a bf16 checkpoint's prompt is then the fp32 model's.
        self.prompt_dtype: torch.dtype | None = None

    def embed_text(self, ids: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        """T(ids): text embedding + projection, [n] -> [n, D]. With a `dtype` other than the
        weights', the projection runs at it on a copy of its weights (an upcast is exact), as the
        same checkpoint loaded at that dtype computes it."""
        e = self.model.text_embedding(ids)
        if dtype is None or dtype == e.dtype:
            return self.text_projection(e)
        return self._projection_at(dtype)(e.to(dtype))

    def _projection_at(self, dtype: torch.dtype) -> nn.Module:
        """`text_projection` at `dtype`, copied again once its weights change (new storage or an
        in-place edit)."""
        key = (dtype, tuple((p.data_ptr(), p._version, p.device) for p in self.text_projection.parameters()))
        held = self.__dict__.get("_projection_copy")
        if held is None or held[0] != key:
            held = (key, copy.deepcopy(self.text_projection).to(dtype))
            # Kept out of the module tree, so that state_dict() and .to() see the checkpoint only.
            self.__dict__["_projection_copy"] = held
        return held[1]

    def embed_codec(self, ids: Tensor) -> Tensor:
        """C(ids): rows of the talker's codec table, [n] -> [n, D]."""
        return self.model.codec_embedding(ids)

    def embed_frames(self, codes: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        """Σ of the 16 code embeddings per frame, codes [T, 16] -> [T, D] (talker input / ICL frames),
        summed at `dtype` (None: the weights')."""
        total = self.model.codec_embedding(codes[:, 0])
        if dtype is not None:
            total = total.to(dtype)
        for g in range(1, codes.shape[1]):
            total = total + self.code_predictor.model.codec_embedding[g - 1](codes[:, g])
        return total


class Qwen3TTSModel(nn.Module):
    """The parts of `model.safetensors` the decoder needs (`talker.*`)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.talker = Talker(cfg.talker, cfg.predictor)

    @torch.no_grad()
    def load_talker_weights(self, state: dict[str, Tensor]) -> None:
        """Load `talker.*` tensors strictly: a missing or unexpected key is an error."""
        own = {k: v for k, v in state.items() if k.startswith("talker.")}
        missing, unexpected = self.load_state_dict(own, strict=False, assign=True)
        if missing or unexpected:
            parts = []
            if missing:
                parts.append(f"missing {len(missing)} tensors (e.g. {', '.join(missing[:3])})")
            if unexpected:
                parts.append(f"unexpected {len(unexpected)} tensors (e.g. {', '.join(unexpected[:3])})")
            raise ValueError("checkpoint does not match the config: " + "; ".join(parts))
