"""The talker (28-layer Qwen3 over text + codec embeddings) and the 5-layer code predictor.

Plain PyTorch: this is the reference path the megakernel is checked against. Parameter names match
the checkpoint's `talker.*` tensors (spec appendix).
"""

from __future__ import annotations

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

    def embed_text(self, ids: Tensor) -> Tensor:
        """T(ids): text embedding + projection, [n] -> [n, D]."""
        return self.text_projection(self.model.text_embedding(ids))

    def embed_codec(self, ids: Tensor) -> Tensor:
        """C(ids): rows of the talker's codec table, [n] -> [n, D]."""
        return self.model.codec_embedding(ids)

    def embed_frames(self, codes: Tensor) -> Tensor:
        """Σ of the 16 code embeddings per frame, codes [T, 16] -> [T, D] (talker input / ICL frames)."""
        total = self.model.codec_embedding(codes[:, 0])
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
