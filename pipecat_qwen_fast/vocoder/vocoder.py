"""The speech-tokenizer decoder ("vocoder", spec §8.2-8.3): codes [B,16,T] -> wav [B,1,T*1920].

Two ways to run it, numerically the same:

* ``Vocoder.decode(codes)``: one exact causal pass over the whole utterance.
* ``VocoderStream`` + ``Vocoder.decode_stream(chunk, stream)``: the decoder is fully causal, so
  carrying per-conv input histories, one input column per overlapping transposed conv, and a
  ``window - 1`` frame K/V window per transformer layer reproduces the whole pass for any
  chunking. ``prime_stream`` feeds reference frames (ICL voice cloning, spec §4.6) without output.

Stream state has a fixed size and is updated in place, so a chunk of a given size always runs with
the same shapes (a prerequisite for capturing one CUDA graph per chunk size later).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipecat_qwen_fast.config import VocoderConfig, parse_vocoder_config, read_json
from pipecat_qwen_fast.errors import ConfigError, InvalidInputError, ModelLoadError
from pipecat_qwen_fast.vocoder.layers import (
    CausalConv,
    CausalTransConv,
    ConvNeXtBlock,
    DecoderBlock,
    Sequence,
    SnakeBeta,
    SplitResidualQuantizer,
    Transformer,
    nhwc_friendly,
)
from pipecat_qwen_fast.vocoder.stream import VocoderStream, copy_streams, device_lengths

CHECKPOINT_PREFIX = "decoder."


def stack_streams(streams: list[VocoderStream]) -> VocoderStream:
    """One stream whose rows are copies of ``streams``' rows, in order."""
    first = streams[0]
    return VocoderStream(
        histories=[torch.cat([st.histories[j] for st in streams]) for j in range(len(first.histories))],
        keys=torch.cat([st.keys for st in streams], dim=1),
        values=torch.cat([st.values for st in streams], dim=1),
        position=torch.cat([st.position for st in streams]),
    )


def _refresh_after_load(module: Vocoder, incompatible) -> None:
    # With missing keys some parameters may still be on "meta"; load_state_dict raises anyway.
    if not incompatible.missing_keys:
        module.refresh_derived()


class Vocoder(nn.Module):
    """State-dict keys are the checkpoint's ``decoder.*`` names without the prefix."""

    def __init__(self, cfg: VocoderConfig):
        super().__init__()
        self._check_config(cfg)
        self.cfg = cfg
        latent, ddim = cfg.latent_dim, cfg.decoder_dim
        self.quantizer = SplitResidualQuantizer(
            cfg.num_semantic_quantizers, cfg.num_quantizers, cfg.codebook_size,
            cfg.codebook_vector_dim, cfg.codebook_dim,
        )
        self.pre_conv = CausalConv(cfg.codebook_dim, latent, 3)
        self.pre_transformer = Transformer(
            latent, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads,
            cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps, cfg.rope_theta, cfg.sliding_window,
        )
        self.upsample = nn.ModuleList(
            Sequence([CausalTransConv(latent, latent, f, f), ConvNeXtBlock(latent)])
            for f in cfg.upsampling_ratios
        )
        rates = cfg.upsample_rates
        self.decoder = Sequence(
            [CausalConv(latent, ddim, 7)]
            + [DecoderBlock(ddim >> i, ddim >> (i + 1), r) for i, r in enumerate(rates)]
            + [SnakeBeta(ddim >> len(rates)), CausalConv(ddim >> len(rates), 1, 7)]
        )
        # Derived at load time (never saved): the stacked codebook table [Q, size, dim].
        self.register_buffer("codebooks", self._derive_codebooks(), persistent=False)
        self._history_specs = self._assign_history_slots()
        self.register_load_state_dict_post_hook(_refresh_after_load)

    # -- construction / loading ---------------------------------------------------------------

    @staticmethod
    def _check_config(cfg: VocoderConfig) -> None:
        if cfg.decoder_dim % (2 ** len(cfg.upsample_rates)):
            raise ConfigError(
                f"decoder_dim {cfg.decoder_dim} must be divisible by 2**{len(cfg.upsample_rates)}"
            )
        if not 0 < cfg.num_semantic_quantizers < cfg.num_quantizers:
            raise ConfigError(
                f"num_semantic_quantizers {cfg.num_semantic_quantizers} must be in "
                f"[1, num_quantizers={cfg.num_quantizers})"
            )
        if cfg.sliding_window < 1:
            raise ConfigError(f"sliding_window {cfg.sliding_window} must be >= 1")

    def _assign_history_slots(self) -> list[tuple[int, int]]:
        # modules() lists the convolutions in the order the data flows through them, so a conv's
        # input columns per code frame are the product of the transposed convs' strides before it
        # (a row's chunk of v frames ends at column v * frame_cols: stream_step with `valid`).
        specs, cols = [], 1
        for m in self.modules():
            if isinstance(m, (CausalConv, CausalTransConv)):
                m.frame_cols = cols
                if m.context > 0:
                    m.slot = len(specs)
                    specs.append((m.conv.in_channels, m.context))
            if isinstance(m, CausalTransConv):
                cols *= m.stride
        return specs

    def _codebook_modules(self) -> list[nn.Module]:
        q = self.quantizer
        return [vq._codebook for r in (q.rvq_first, q.rvq_rest) for vq in r.vq.layers]

    def _derive_codebooks(self) -> Tensor:
        with torch.no_grad():
            return torch.stack([cb.vectors() for cb in self._codebook_modules()])

    def refresh_derived(self) -> None:
        """Recompute the non-saved tensors from the parameters.

        Loading and moving do this by themselves; call it after editing parameters in place.
        """
        self.codebooks = self._derive_codebooks()
        for m in self.modules():
            if isinstance(m, SnakeBeta):
                m.refresh()
        pt = self.pre_transformer
        pt.inv_freq = pt.compute_inv_freq(pt.norm.weight.device)

    @torch.no_grad()
    def use_channels_last(self) -> None:
        """Store the convolution weights channels-innermost (same values; the engine does this on
        CUDA). cuDNN runs bf16 convolutions in NHWC and converted NCHW weights on every call: a
        captured compiled 1-frame step went from 1.64 to 1.40 ms on the H200 (docs/journal/NOTES.md,
        "Vocoder channels-last"). Grouped and dilated convolutions keep NCHW weights and inputs
        (`nhwc_friendly`): given NHWC, cuDNN ran the dilated ones 34x slower.
        """
        for m in self.modules():
            if isinstance(m, (nn.Conv1d, nn.ConvTranspose1d)) and nhwc_friendly(m):
                m.weight.data = m.weight.data.transpose(1, 2).contiguous().transpose(1, 2)

    def _apply(self, fn, recurse=True):
        # Keep inv_freq in fp32 whatever dtype the module is moved to (RoPE angles in bf16 would
        # be off by whole radians at a few hundred frames), and the codebook table and SnakeBeta
        # factors in step with the parameters (computed in their dtype, as the reference does).
        super()._apply(fn, recurse)
        if self.pre_transformer.norm.weight.device.type != "meta":
            self.refresh_derived()
        return self

    @classmethod
    def from_state_dict(cls, cfg: VocoderConfig, state_dict: Mapping[str, Tensor],
                        device: torch.device | str | None = None,
                        dtype: torch.dtype | None = None) -> Vocoder:
        """Build from ``decoder.*`` tensors (prefixed, as in the checkpoint, or already stripped).

        Other keys (``encoder.*``) are ignored; missing or unexpected decoder keys raise.
        """
        # The module itself has "decoder.*" keys (the conv stack), so look for a top-level name.
        if any(k.startswith(CHECKPOINT_PREFIX + "quantizer.") for k in state_dict):
            sd = {k[len(CHECKPOINT_PREFIX):]: v for k, v in state_dict.items()
                  if k.startswith(CHECKPOINT_PREFIX)}
        else:
            sd = dict(state_dict)
        with torch.device("meta"):
            model = cls(cfg)
        try:
            model.load_state_dict(sd, strict=True, assign=True)
        except RuntimeError as e:
            raise ModelLoadError(f"speech-tokenizer decoder weights do not match the config: {e}") from e
        if device is not None or dtype is not None:
            model.to(device=device, dtype=dtype)
        return model.eval().requires_grad_(False)

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device | str | None = None,
                        dtype: torch.dtype | None = None) -> Vocoder:
        """Load from a model folder (with ``speech_tokenizer/``) or a speech-tokenizer folder."""
        from safetensors import safe_open

        root = Path(path)
        folder = root / "speech_tokenizer" if (root / "speech_tokenizer").is_dir() else root
        cfg_path, weights = folder / "config.json", folder / "model.safetensors"
        for p in (cfg_path, weights):
            if not p.is_file():
                raise ModelLoadError(f"speech tokenizer file not found: {p}")
        cfg = parse_vocoder_config(read_json(cfg_path))
        sd = {}
        with safe_open(str(weights), framework="pt") as f:
            for k in f.keys():
                if k.startswith(CHECKPOINT_PREFIX):
                    sd[k] = f.get_tensor(k)
        return cls.from_state_dict(cfg, sd, device=device, dtype=dtype)

    # -- helpers ------------------------------------------------------------------------------

    @property
    def samples_per_frame(self) -> int:
        return self.cfg.upsample_rate

    def _check_codes(self, codes: Tensor, check_values: bool) -> Tensor:
        q = self.cfg.num_quantizers
        if codes.dim() != 3 or codes.shape[1] != q or codes.shape[2] < 1:
            raise InvalidInputError(
                f"codes must have shape [batch, {q}, frames>=1]; got {list(codes.shape)}"
            )
        if codes.dtype.is_floating_point or codes.dtype == torch.bool:
            raise InvalidInputError(f"codes must be an integer tensor; got {codes.dtype}")
        if check_values:
            lo, hi = int(codes.min()), int(codes.max())
            if lo < 0 or hi >= self.cfg.codebook_size:
                raise InvalidInputError(
                    f"codes must be in [0, {self.cfg.codebook_size}); got values in [{lo}, {hi}]"
                )
        return codes.to(device=self.codebooks.device, dtype=torch.long)

    def embed_codes(self, codes: Tensor) -> Tensor:
        """RVQ decode: ``[B, Q, T]`` ids -> ``[B, codebook_dim, T]``."""
        q, size, dim = self.codebooks.shape
        offsets = torch.arange(q, device=codes.device)[None, :, None] * size
        vecs = F.embedding(codes + offsets, self.codebooks.view(q * size, dim))  # [B,Q,T,dim]
        s = self.cfg.num_semantic_quantizers
        first = vecs[:, :s].sum(1).transpose(1, 2)
        rest = vecs[:, s:].sum(1).transpose(1, 2)
        return (F.conv1d(first, self.quantizer.rvq_first.output_proj.weight)
                + F.conv1d(rest, self.quantizer.rvq_rest.output_proj.weight))

    # -- whole-utterance decoding -------------------------------------------------------------

    @torch.no_grad()
    def decode(self, codes: Tensor, check_values: bool = True) -> Tensor:
        """Exact causal pass over the whole sequence: ``[B, Q, T]`` -> ``[B, 1, T * 1920]``."""
        codes = self._check_codes(codes, check_values)
        h = self.pre_conv(self.embed_codes(codes))
        h = self.pre_transformer(h.transpose(1, 2)).transpose(1, 2)
        for stage in self.upsample:
            h = stage(h)
        return self.decoder(h).clamp(-1.0, 1.0)

    @torch.no_grad()
    def decode_reference_chunked(self, codes: Tensor, chunk: int = 300, left_context: int = 25) -> Tensor:
        """The reference package's decoding of long inputs (spec §8.3), for bit-level comparison.

        Windows of ``chunk`` frames are decoded independently (positions restart at 0), each but
        the first with ``left_context`` earlier frames whose audio is dropped. Equal to ``decode``
        for T <= chunk; an approximation of it beyond.
        """
        if chunk < 1 or left_context < 0:
            raise InvalidInputError(
                f"chunk must be >= 1 and left_context >= 0; got chunk={chunk}, left_context={left_context}"
            )
        codes = self._check_codes(codes, True)
        total = codes.shape[-1]
        pieces, start = [], 0
        while start < total:
            end = min(start + chunk, total)
            ctx = left_context if start - left_context > 0 else start
            wav = self.decode(codes[..., start - ctx:end], check_values=False)
            pieces.append(wav[..., ctx * self.samples_per_frame:])
            start = end
        return torch.cat(pieces, dim=-1)

    # -- streaming ----------------------------------------------------------------------------

    def new_stream(self, batch: int = 1, device: torch.device | str | None = None,
                   dtype: torch.dtype | None = None, packed: bool = False) -> VocoderStream:
        """A fresh stream (all-zero history = the causal zero padding of ``decode``).

        ``device``/``dtype`` default to the model's; they must match it when decoding. ``packed``:
        every floating-point buffer a view of one allocation, zeroed by one kernel instead of 23
        (an engine session's stream, opened in a busy round: 0.27 ms of host time on the H200
        unpacked). Not for the streams a compiled step takes as inputs, whose buffers should not
        alias one another.
        """
        if batch < 1:
            raise InvalidInputError(f"batch must be >= 1; got {batch}")
        device = torch.device(device) if device is not None else self.codebooks.device
        dtype = dtype or self.codebooks.dtype
        shapes = self.stream_shapes(batch)
        if packed:
            flat = torch.zeros(sum(math.prod(s) for s in shapes), device=device, dtype=dtype)
            buffers = [part.view(s) for part, s in zip(flat.split([math.prod(s) for s in shapes]), shapes)]
        else:
            buffers = [torch.zeros(s, device=device, dtype=dtype) for s in shapes]
        return VocoderStream(
            histories=buffers[:-2],
            keys=buffers[-2],
            values=buffers[-1],
            position=torch.zeros(batch, device=device, dtype=torch.long),
        )

    def stream_shapes(self, batch: int = 1) -> list[tuple[int, ...]]:
        """The floating-point buffers of a stream of `batch` rows, in `VocoderStream` order: each
        stateful convolution's history [batch, C_in, context], then keys and values [layers,
        batch, kv_heads, window - 1, head_dim]."""
        pt, cfg = self.pre_transformer, self.cfg
        kv_shape = (cfg.num_layers, batch, cfg.num_kv_heads, pt.window - 1, cfg.head_dim)
        return [(batch, c, n) for c, n in self._history_specs] + [kv_shape, kv_shape]

    def _check_stream(self, codes: Tensor, stream: VocoderStream) -> None:
        if stream.batch != codes.shape[0]:
            raise InvalidInputError(
                f"codes batch {codes.shape[0]} does not match the stream's batch {stream.batch}"
            )
        if stream.device != self.codebooks.device or stream.dtype != self.codebooks.dtype:
            raise InvalidInputError(
                f"stream is on {stream.device}/{stream.dtype} but the vocoder is on "
                f"{self.codebooks.device}/{self.codebooks.dtype}"
            )

    @torch.no_grad()
    def decode_stream(self, codes: Tensor, stream: VocoderStream, check_values: bool = True) -> Tensor:
        """Decode the next ``n`` frames ``[B, Q, n]`` -> ``[B, 1, n * 1920]``, advancing ``stream``.

        Concatenating the outputs of any chunking equals ``decode`` of the whole sequence.
        """
        codes = self._check_codes(codes, check_values)
        self._check_stream(codes, stream)
        wav = self.stream_step(codes, stream)
        stream.frames += codes.shape[-1]
        return wav

    @torch.no_grad()
    def decode_streams(self, codes: Tensor, streams: list[VocoderStream], check_values: bool = True,
                       valid: list[int] | None = None) -> Tensor:
        """Row i of ``codes [k, Q, n]`` through the batch-1 stream ``streams[i]``, all k in one
        batched call whatever point each stream is at: ``[k, 1, n * 1920]``, equal to k
        ``decode_stream`` calls. The reference for the graphed batched calls (vocoder_graphs.py).

        ``valid``: the frames of each row's own chunk (the rest is right padding): its audio is
        the first ``valid[i] * 1920`` samples of its row, and its stream advances by ``valid[i]``
        frames, as ``decode_stream`` of the unpadded chunk would."""
        codes = self._check_codes(codes, check_values)
        n = codes.shape[-1]
        if len(streams) != codes.shape[0] or any(st.batch != 1 for st in streams):
            raise InvalidInputError(
                f"decode_streams takes one batch-1 stream per row of codes; got {codes.shape[0]} rows and "
                f"streams of batches {[st.batch for st in streams]}"
            )
        if valid is not None and len(valid) != len(streams):
            raise InvalidInputError(f"decode_streams: {len(valid)} valid lengths for {len(streams)} streams")
        batch = stack_streams(streams)
        self._check_stream(codes, batch)
        if valid is not None:
            batch.valid = device_lengths(valid, n, batch.device)
        wav = self.stream_step(codes, batch)
        copy_streams(streams, [batch.row(i) for i in range(len(streams))])
        for i, st in enumerate(streams):
            st.frames += n if valid is None else valid[i]
        return wav

    def stream_step(self, codes: Tensor, stream: VocoderStream) -> Tensor:
        """The device work of ``decode_stream`` on checked inputs: reads and advances only the
        stream's tensors, never its host-side ``frames``, so a CUDA graph or ``torch.compile`` can
        take it as it is (vocoder_graphs.py)."""
        h = self.pre_conv.step(self.embed_codes(codes), stream)
        h = self.pre_transformer.step(h.transpose(1, 2), stream).transpose(1, 2)
        for stage in self.upsample:
            h = stage.step(h, stream)
        wav = self.decoder.step(h, stream).clamp(-1.0, 1.0)
        stream.position.add_(codes.shape[-1] if stream.valid is None else stream.valid)
        return wav

    def prime_stream(self, ref_codes: Tensor, stream: VocoderStream) -> None:
        """Run reference frames through ``stream`` and drop their audio (ICL, spec §4.6).

        Accepts ``[B, Q, T_ref]`` or the ``[T_ref, Q]`` layout voice prompts are stored in.
        """
        if ref_codes.dim() == 2:
            ref_codes = ref_codes.t().unsqueeze(0).expand(stream.batch, -1, -1)
        self.decode_stream(ref_codes, stream)

