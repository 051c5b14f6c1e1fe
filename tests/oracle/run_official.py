"""Run the official qwen-tts 0.1.1 on one checkpoint for a list of cases (the oracle side).

Runs INSIDE the oracle venv (tests/oracle/setup_env.sh), never in the main environment: it needs
transformers 4.57.3. The main-env harness (tests/oracle/harness.py) writes a request JSON, starts
this script once per checkpoint and reads back one ``<case id>.npz`` per case plus ``done.json``.

Request: ``{"cases": [case, ...]}``; every case has ``id`` and ``op``:

* ``generate``: ``text``, ``language``, ``speaker`` (CustomVoice), ``instruct`` (VoiceDesign and
  1.7B CustomVoice), ``non_streaming_mode``, ``max_new_tokens``, ``voice_clone`` (Base:
  ``{"x_vector": [D floats], "ref_codes": [[16 ints], ...] | null, "ref_text": str | null}``;
  ICL mode when ref_codes and ref_text are given, x-vector-only otherwise). Always fp32 greedy
  (``do_sample=False, subtalker_dosample=False``). Writes ``codes`` [T,16] int64, ``wav`` float32,
  ``sample_rate``, ``eos`` (whether the talker sampled EOS), ``text_ids`` / ``instruct_ids`` /
  ``ref_ids`` (the token ids the wrapper fed, where used).
* ``decode``: ``codes`` [[16 ints], ...] -> the official speech-tokenizer ``decode``; writes ``wav``.
* ``clone`` (Base): ``audio`` (a file path), ``ref_text`` (null: x-vector-only mode) ->
  ``create_voice_clone_prompt``; writes ``x_vector`` and, in ICL mode, ``ref_codes`` [T_ref,16]. With
  ``text``, ``language``, ``non_streaming_mode`` and ``max_new_tokens`` also ``generate_voice_clone``
  from the same file (fp32 greedy), writing ``codes`` and ``wav``. Other keys (a content hash of
  the file, say) only enter the cache key.
* ``inspect``: writes ``state_dict`` (name -> shape of the official model) and ``loading``
  (missing / unexpected / mismatched keys that ``from_pretrained`` reported, per loaded class) as
  JSON inside the npz (key ``json``).

Usage: python run_official.py --ckpt DIR --request request.json --out OUTDIR
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

GENERATE_KEYS = {
    "id", "op", "text", "language", "speaker", "instruct", "non_streaming_mode", "max_new_tokens",
    "voice_clone",
}


def install_loading_recorder() -> list[dict]:
    """Record the key report of every ``from_pretrained`` (main model and speech tokenizer).

    The official wrapper swallows ``output_loading_info``, so we observe the transformers loader
    itself; the recorder only reads the result.
    """
    from transformers.modeling_utils import PreTrainedModel

    reports: list[dict] = []
    original = PreTrainedModel._load_pretrained_model.__func__

    def recording(cls, model, *args, **kwargs):
        result = original(cls, model, *args, **kwargs)
        _, missing, unexpected, mismatched = result[:4]
        reports.append({
            "class": type(model).__name__,
            "missing": sorted(missing),
            "unexpected": sorted(unexpected),
            "mismatched": sorted(str(k) for k in mismatched),
        })
        return result

    PreTrainedModel._load_pretrained_model = classmethod(recording)
    return reports


def load_official(ckpt: Path):
    from qwen_tts import Qwen3TTSModel

    tts = Qwen3TTSModel.from_pretrained(str(ckpt), dtype=torch.float32, device_map="cpu")
    tts.model.eval()
    return tts


def record_calls(obj, name: str, log: list):
    """Wrap ``obj.name`` so that every call's arguments and result are appended to ``log``."""
    original = getattr(obj, name)

    def wrapper(*args, **kwargs):
        result = original(*args, **kwargs)
        log.append((args, kwargs, result))
        return result

    setattr(obj, name, wrapper)


def classify_prompt_text(text: str) -> str:
    if text.startswith("<|im_start|>user\n"):
        return "instruct_ids"
    if text.endswith("<|im_start|>assistant\n"):
        return "text_ids"
    return "ref_ids"


def build_clone_prompt(tts, spec: dict):
    from qwen_tts import VoiceClonePromptItem

    x_vector = torch.tensor(spec["x_vector"], dtype=torch.float32)
    ref_codes = spec.get("ref_codes")
    ref_text = spec.get("ref_text")
    icl = ref_codes is not None and bool(ref_text)
    return [VoiceClonePromptItem(
        ref_code=torch.tensor(ref_codes, dtype=torch.long) if icl else None,
        ref_spk_embedding=x_vector,
        x_vector_only_mode=not icl,
        icl_mode=icl,
        ref_text=ref_text if icl else None,
    )]


def generate_case(tts, case: dict) -> dict:
    unknown = set(case) - GENERATE_KEYS
    if unknown:
        raise ValueError(
            f"case {case['id']}: unknown keys {sorted(unknown)}; valid: {sorted(GENERATE_KEYS)}"
        )

    tokenized: list = []
    generated: list = []
    talker_runs: list = []
    record_calls(tts, "_tokenize_texts", tokenized)
    record_calls(tts.model, "generate", generated)
    record_calls(tts.model.talker, "generate", talker_runs)
    try:
        greedy = {
            "do_sample": False,
            "subtalker_dosample": False,
            "max_new_tokens": int(case["max_new_tokens"]),
            "non_streaming_mode": bool(case["non_streaming_mode"]),
        }
        model_type = tts.model.tts_model_type
        if model_type == "custom_voice":
            wavs, sr = tts.generate_custom_voice(
                case["text"], speaker=case["speaker"], language=case["language"],
                instruct=case.get("instruct"), **greedy,
            )
        elif model_type == "voice_design":
            wavs, sr = tts.generate_voice_design(
                case["text"], instruct=case.get("instruct") or "", language=case["language"], **greedy,
            )
        elif model_type == "base":
            wavs, sr = tts.generate_voice_clone(
                case["text"], language=case["language"],
                voice_clone_prompt=build_clone_prompt(tts, case["voice_clone"]), **greedy,
            )
        else:
            raise ValueError(f"unknown tts_model_type {model_type!r}")
    finally:
        for obj in (tts, tts.model, tts.model.talker):  # drop the recorders, back to the class methods
            for name in ("_tokenize_texts", "generate"):
                obj.__dict__.pop(name, None)

    (codes_list, _), = [g[2] for g in generated]
    sequences = talker_runs[0][2].sequences
    eos_id = tts.model.config.talker_config.codec_eos_token_id
    out = {
        "codes": codes_list[0].cpu().numpy().astype(np.int64),
        "wav": np.asarray(wavs[0], dtype=np.float32),
        "sample_rate": np.int64(sr),
        "eos": np.bool_(bool((sequences[0] == eos_id).any())),
    }
    for args, _, ids_list in tokenized:
        out[classify_prompt_text(args[0][0])] = ids_list[0][0].cpu().numpy().astype(np.int64)
    return out


def clone_case(tts, case: dict) -> dict:
    ref_text = case.get("ref_text")
    x_vector_only = ref_text is None
    (item,) = tts.create_voice_clone_prompt(case["audio"], ref_text=ref_text, x_vector_only_mode=x_vector_only)
    out = {"x_vector": item.ref_spk_embedding.float().cpu().numpy()}
    if item.ref_code is not None:
        out["ref_codes"] = item.ref_code.cpu().numpy().astype(np.int64)
    if not case.get("text"):
        return out
    generated: list = []
    record_calls(tts.model, "generate", generated)
    try:
        wavs, sr = tts.generate_voice_clone(
            case["text"], language=case["language"], ref_audio=case["audio"], ref_text=ref_text,
            x_vector_only_mode=x_vector_only, non_streaming_mode=bool(case["non_streaming_mode"]),
            do_sample=False, subtalker_dosample=False, max_new_tokens=int(case["max_new_tokens"]),
        )
    finally:
        tts.model.__dict__.pop("generate", None)
    (codes_list, _), = [g[2] for g in generated]
    out.update(codes=codes_list[0].cpu().numpy().astype(np.int64), wav=np.asarray(wavs[0], dtype=np.float32),
               sample_rate=np.int64(sr))
    return out


def decode_case(tts, case: dict) -> dict:
    codes = torch.tensor(case["codes"], dtype=torch.long)
    wavs, sr = tts.model.speech_tokenizer.decode([{"audio_codes": codes}])
    return {"wav": np.asarray(wavs[0], dtype=np.float32), "sample_rate": np.int64(sr)}


def inspect_case(tts, reports: list[dict]) -> dict:
    state = {
        "model": {k: list(v.shape) for k, v in tts.model.state_dict().items()
                  if not k.startswith("speech_tokenizer.")},
        "speech_tokenizer": {k: list(v.shape)
                             for k, v in tts.model.speech_tokenizer.model.state_dict().items()},
    }
    info = {
        "state_dict": state,
        "loading": reports,
        "tts_model_type": tts.model.tts_model_type,
        "tts_model_size": tts.model.tts_model_size,
        "speakers": sorted(tts.model.get_supported_speakers()),
        "languages": sorted(tts.model.get_supported_languages()),
    }
    return {"json": np.array(json.dumps(info))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", required=True, type=Path)
    parser.add_argument("--request", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch default)")
    args = parser.parse_args()

    warnings.simplefilter("ignore")
    if args.threads:
        torch.set_num_threads(args.threads)
    cases = json.loads(args.request.read_text())["cases"]
    ids = [c["id"] for c in cases]
    if len(set(ids)) != len(ids):
        raise ValueError(f"duplicate case ids in {args.request}")

    reports = install_loading_recorder()
    start = time.perf_counter()
    tts = load_official(args.ckpt)
    print(f"[oracle] loaded {args.ckpt} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    args.out.mkdir(parents=True, exist_ok=True)
    ops = {
        "generate": lambda c: generate_case(tts, c),
        "decode": lambda c: decode_case(tts, c),
        "clone": lambda c: clone_case(tts, c),
        "inspect": lambda c: inspect_case(tts, reports),
    }
    for case in cases:
        if case["op"] not in ops:
            raise ValueError(f"case {case['id']}: op {case['op']!r}; valid: {sorted(ops)}")
        start = time.perf_counter()
        with torch.no_grad():
            result = ops[case["op"]](case)
        print(f"[oracle] {case['id']}: {time.perf_counter() - start:.1f} s", file=sys.stderr)
        np.savez(args.out / f"{case['id']}.npz", **result)
    (args.out / "done.json").write_text(json.dumps({"cases": ids}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
