"""ctypes binding to the CUDA frame megakernel (`cuda/`) and the `megakernel` decode backend.

The shared library is compiled with nvcc on first use and cached under
`$QWEN_FAST_CACHE/megakernel` (default `~/.cache/pipecat_qwen_fast`) by source hash, GPU architecture
and torch version, so a change to any kernel source, a different GPU or a torch upgrade gets its own
build; an entry is trusted only while its recorded digest matches. One `decode_frame` is one
cooperative launch (talker step, codec head, sampling, 15 predictor steps, next input); the only
host read per frame is the engine's look at code 0.

The kernel reads the checkpoint's bf16 weights and computes everything else in fp32: activations,
both stacks' K/V caches, RoPE tables and logits. That is the official model's fp32 arithmetic at
bf16 weight bandwidth, so its reference is `TorchBackend` on an fp32 copy of the same weights. The
talker's prefill and the prompt's vectors are fp32 too (`prefill`, QWEN_FAST_MK_PREFILL), and so
are the text vectors the kernel adds: a call's greedy codes from text are the fp32 model's.

One file over 500 lines: the ctypes mirror of cuda/qwen_mk.h, the cached build and the backend
that fills the structs change together whenever the kernel's ABI does.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import hashlib
import logging
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from pipecat_qwen_fast.backends.base import SessionSnapshot
from pipecat_qwen_fast.backends.prefill_graphs import (
    PrefillGraphs,
    StackOwner,
    exact_products_blocker,
    fp32_matmuls,
    prefill_from_start,
    prefill_layer_fp32,
    stack_copy,
)
from pipecat_qwen_fast.errors import UnsupportedFeatureError
from pipecat_qwen_fast.model.layers import KVCache, fuse_projections, rotary_cos_sin
from pipecat_qwen_fast.model.sampling import SamplingParams, session_seed
from pipecat_qwen_fast.utils.cache import cache_dir, digest_matches, write_digest
from pipecat_qwen_fast.utils.phases import phase

logger = logging.getLogger(__name__)

# Every file of the kernel's one translation unit (cuda/qwen_mk.cu includes the others, the phases
# in this order): all of them key the build cache, and pyproject.toml's data-files ship them.
PHASE_FILES = ("schedule", "producer", "consumer", "matvec", "mlp", "attention", "pred_fused", "talker_fused",
               "pred_first", "stack", "frame", "host")
SOURCE_FILES = ("qwen_mk.h", "mk_util.cuh", "mk_stream.cuh", "mk_matvec.cuh", "mk_attention.cuh", "mk_sample.cuh",
                *(f"phases/{name}.cuh" for name in PHASE_FILES), "qwen_mk.cu")
ABI_VERSION = 13
# MegakernelBackend(long_kernel=...) -> qmk_model.long_kernel
LONG_KERNEL = {"auto": 0, "always": 1, "never": -1}
# MegakernelBackend(prefill=...), default QWEN_FAST_MK_PREFILL, else "fp32". The talker's prefill and
# the prompt's vectors:
#   fp32       in fp32 on the bf16 weights, as the kernel's decode: every product exact on the
#              tensor cores (prefill_graphs.exact_linear), no extra memory;
#   fp32-copy  the same on an fp32 copy of the talker's layers, cuBLAS fp32 products (+1.7 GB for
#              the 0.6B, +5.6 GB for the 1.7B), the fp32 reference's own arithmetic;
#   bf16       at the checkpoint's dtype (before issue 34): K/V rows, hidden state and prompt
#              rounded to bf16, so greedy codes part from the fp32 model's within a few frames.
PREFILL_MODES = ("fp32", "fp32-copy", "bf16")
TRACE_MAX = 8192
MAX_GROUPS = 16
HEAD_DIM = 128
# o_proj items per KV head of the fused talker phase (qwen_mk.cu QMK_TAO_GROUPS): the kernel fuses
# only where they all get a block of their own (talker_fuses).
TALKER_O_ITEMS_PER_KV_HEAD = 16
NVCC_FLAGS = ("-O3", "-std=c++17", "-lineinfo", "-Xcompiler", "-fPIC")


def extra_flags() -> tuple[str, ...]:
    """QWEN_FAST_MK_DEFINES="QMK_TRACE_STEPS ..." builds a variant (own cache entry), e.g. the
    profiling build that stamps the steps inside each phase (bench/megakernel_check.py --steps)."""
    return tuple(f"-D{d}" for d in os.environ.get("QWEN_FAST_MK_DEFINES", "").split())


def source_dir() -> Path:
    override = os.environ.get("QWEN_FAST_CUDA_DIR")
    if override:
        return Path(override)
    checkout = Path(__file__).resolve().parents[2] / "cuda"
    if checkout.is_dir():
        return checkout
    # A wheel install carries the sources as data files (pyproject: tool.setuptools.data-files).
    return Path(sys.prefix) / "share" / "pipecat-qwen-fast" / "cuda"


def source_hash(src: Path | None = None) -> str:
    src = src or source_dir()
    h = hashlib.sha256()
    for name in SOURCE_FILES:
        h.update(name.encode())
        h.update((src / name).read_bytes())
    h.update(" ".join(NVCC_FLAGS + extra_flags()).encode())
    return h.hexdigest()[:16]


def find_nvcc() -> str | None:
    for candidate in (os.environ.get("NVCC"), shutil.which("nvcc")):
        if candidate and Path(candidate).exists():
            return candidate
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    path = Path(home) / "bin" / "nvcc"
    return str(path) if path.exists() else None


def gencode_flags(archs: list[str]) -> list[str]:
    """['sm_80'] -> ['-gencode', 'arch=compute_80,code=sm_80']; Hopper builds its arch-specific
    target: ['sm_90'] -> [..., 'arch=compute_90a,code=sm_90a'] (setmaxnreg: cuda/mk_util.cuh)."""
    out = []
    for arch in archs:
        num = arch.removeprefix("sm_")
        if not num.isdigit():
            raise ValueError(f"GPU architecture must look like 'sm_90', got {arch!r}")
        num = "90a" if num == "90" else num
        out += ["-gencode", f"arch=compute_{num},code=sm_{num}"]
    return out


@functools.cache
def parallel_flags(nvcc: str) -> tuple[str, ...]:
    """`--split-compile=0` (the device optimiser on every core) where this nvcc has it. The first
    build on a machine goes from 59 to 26 s on 16 cores (H200 host; 75-79 -> 40-44 s on 2), and the
    library runs as fast with the same codes (docs/journal/NOTES.md, "The megakernel built in parallel").
    Older nvcc lacks the option, so it is asked, once per path. Not in `source_hash`: it changes
    how long a build takes, not what the kernel computes, so existing caches stay valid."""
    try:
        proc = subprocess.run([nvcc, "--help"], check=False, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return ()
    return ("--split-compile=0",) if "--split-compile" in proc.stdout else ()


def nvcc_command(nvcc: str, archs: list[str], out: Path, shared: bool = True) -> list[str]:
    src = source_dir() / "qwen_mk.cu"
    mode = ["-shared"] if shared else ["-c"]
    return [nvcc, *NVCC_FLAGS, *parallel_flags(nvcc), *extra_flags(), *mode, *gencode_flags(archs), "-o", str(out),
            str(src)]


def cache_root() -> Path:
    return cache_dir() / "megakernel"


def cache_key(arch: str, src_hash: str | None = None, torch_version: str | None = None) -> str:
    """An entry per source (and flags), GPU architecture and torch version: a change of any of them
    builds anew rather than load a library made for something else."""
    torch_version = torch_version or torch.__version__
    return f"{src_hash or source_hash()}-{arch}-torch{torch_version.replace('+', '_')}"


_BUILDS: dict[str, concurrent.futures.Future] = {}


def arch_of(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def start_build(arch: str) -> None:
    """Build `arch`'s library on a thread while the load goes on (weights, vocoder compiles): nvcc
    is a process of its own, so its ~27 s on a cold H200 overlap the rest of the load instead of
    adding to it. `build_library` then waits for it. Nothing starts where the cache already holds
    it or no nvcc is found (the load then says why, as before)."""
    if arch in _BUILDS or digest_matches(cache_root() / cache_key(arch) / "libqwen_mk.so") or find_nvcc() is None:
        return
    future: concurrent.futures.Future = concurrent.futures.Future()

    def build() -> None:
        try:
            future.set_result(_build(arch))
        except BaseException as e:  # noqa: BLE001 - handed to the waiting load, which reports it
            future.set_exception(e)

    _BUILDS[arch] = future
    # A daemon: a load that fails meanwhile must not keep the process alive for nvcc.
    threading.Thread(target=build, name=f"qwen-mk-build-{arch}", daemon=True).start()


def build_library(arch: str) -> Path:
    """Compile (or reuse) libqwen_mk.so for `arch`; returns its path. A cached file is used only
    while its recorded digest matches (a truncated or overwritten entry is rebuilt)."""
    pending = _BUILDS.pop(arch, None)
    if pending is not None:
        with phase(f"waiting for the megakernel build for {arch}"):
            return pending.result()
    return _build(arch)


def _build(arch: str) -> Path:
    target = cache_root() / cache_key(arch) / "libqwen_mk.so"
    if digest_matches(target):
        return target
    if target.exists():
        logger.warning("the cached megakernel library %s does not match its digest; rebuilding it", target)
    nvcc = find_nvcc()
    if nvcc is None:
        raise UnsupportedFeatureError("the megakernel is built on first use and needs nvcc (set NVCC or CUDA_HOME)")
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename, so concurrent first uses never load a half-written file.
    with phase(f"building the megakernel for {arch} (nvcc)"), tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        tmp_out = Path(tmp) / "libqwen_mk.so"
        cmd = nvcc_command(nvcc, [arch], tmp_out)
        logger.info("building the megakernel for %s (first use, cached afterwards)", arch)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"nvcc failed building the megakernel for {arch}:\n{proc.stderr[-4000:]}")
        os.replace(tmp_out, target)
        write_digest(target)
    return target


# ---------------------------------------------------------------------------------------------
# ctypes mirror of cuda/qwen_mk.h


class QmkLayer(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in
                ("input_norm", "q", "k", "v", "q_norm", "k_norm", "o", "post_norm", "gate", "up", "down", "down_t",
                 "o_blk")]


class QmkStack(ctypes.Structure):
    _fields_ = [
        ("hidden", ctypes.c_int32), ("inter", ctypes.c_int32), ("num_layers", ctypes.c_int32),
        ("num_heads", ctypes.c_int32), ("num_kv_heads", ctypes.c_int32), ("max_pos", ctypes.c_int32),
        ("eps", ctypes.c_float), ("split_down", ctypes.c_int32),
        ("fuse_attn_o", ctypes.c_int32), ("group_qkv", ctypes.c_int32), ("merge_first", ctypes.c_int32),
        ("layers", ctypes.c_uint64), ("final_norm", ctypes.c_uint64), ("rope", ctypes.c_uint64),
        ("k_cache", ctypes.c_uint64), ("v_cache", ctypes.c_uint64),
    ]


class QmkSampler(ctypes.Structure):
    _fields_ = [("do_sample", ctypes.c_int32), ("top_k", ctypes.c_int32),
                ("temperature", ctypes.c_float), ("top_p", ctypes.c_float)]


class QmkModel(ctypes.Structure):
    _fields_ = [
        ("talker", QmkStack), ("pred", QmkStack),
        ("vocab", ctypes.c_int32), ("pred_vocab", ctypes.c_int32), ("eos_id", ctypes.c_int32),
        ("num_groups", ctypes.c_int32), ("max_blocks", ctypes.c_int32), ("long_kernel", ctypes.c_int32),
        ("codec_head", ctypes.c_uint64), ("talker_emb", ctypes.c_uint64),
        ("proj_w", ctypes.c_uint64), ("proj_b", ctypes.c_uint64),
        ("pred_emb", ctypes.c_uint64 * (MAX_GROUPS - 1)), ("lm_head", ctypes.c_uint64 * (MAX_GROUPS - 1)),
        ("qkv0", ctypes.c_uint64 * (MAX_GROUPS - 1)),
        ("pending", ctypes.c_uint64), ("hidden", ctypes.c_uint64), ("seen", ctypes.c_uint64),
        ("resid", ctypes.c_uint64), ("mid", ctypes.c_uint64), ("pres", ctypes.c_uint64), ("qkv", ctypes.c_uint64), ("attn", ctypes.c_uint64),
        ("act", ctypes.c_uint64), ("proj_out", ctypes.c_uint64), ("logits", ctypes.c_uint64),
        ("pred_logits", ctypes.c_uint64), ("pred_hidden", ctypes.c_uint64),
        ("attn_part", ctypes.c_uint64), ("attn_count", ctypes.c_uint64), ("barrier", ctypes.c_uint64),
        ("head_ready", ctypes.c_uint64),
    ]


class QmkFrame(ctypes.Structure):
    _fields_ = [
        ("run_talker", ctypes.c_int32), ("run_predictor", ctypes.c_int32), ("pos", ctypes.c_int32),
        ("frame", ctypes.c_int32), ("min_new_tokens", ctypes.c_int32), ("suppress_start", ctypes.c_int32),
        ("rep_penalty", ctypes.c_float), ("trace_steps", ctypes.c_int32),
        ("talker_s", QmkSampler), ("pred_s", QmkSampler),
        ("seed", ctypes.c_uint64), ("trailing", ctypes.c_uint64), ("force_codes", ctypes.c_uint64),
        ("codes_out", ctypes.c_uint64), ("trace", ctypes.c_uint64),
    ]


STRUCTS = (QmkLayer, QmkStack, QmkModel, QmkFrame)


def load_library(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    lib.qmk_abi_version.restype = ctypes.c_int
    lib.qmk_struct_sizes.argtypes = [ctypes.POINTER(ctypes.c_int32)]
    lib.qmk_attn_part_floats.argtypes = [ctypes.c_int32, ctypes.c_int32]
    lib.qmk_attn_part_floats.restype = ctypes.c_int64
    lib.qmk_acc_floats.argtypes = [ctypes.POINTER(ctypes.c_int64)]
    lib.qmk_grid_size.argtypes = [ctypes.POINTER(QmkModel), ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_int32)]
    lib.qmk_uses_long_kernel.argtypes = [ctypes.POINTER(QmkModel), ctypes.POINTER(QmkFrame), ctypes.POINTER(ctypes.c_int32)]
    lib.qmk_merges_first_passes.argtypes = [ctypes.POINTER(QmkModel), ctypes.POINTER(ctypes.c_int32)]
    lib.qmk_uses_talker_fusion.argtypes = [ctypes.POINTER(QmkModel), ctypes.POINTER(QmkFrame), ctypes.POINTER(ctypes.c_int32)]
    lib.qmk_decode_frame.argtypes = [ctypes.POINTER(QmkModel), ctypes.POINTER(QmkFrame), ctypes.c_uint64]
    lib.qmk_error_string.restype = ctypes.c_char_p
    if lib.qmk_abi_version() != ABI_VERSION:
        raise RuntimeError(f"megakernel ABI {lib.qmk_abi_version()} != expected {ABI_VERSION}")
    sizes = (ctypes.c_int32 * 4)()
    lib.qmk_struct_sizes(sizes)
    for struct, size in zip(STRUCTS, sizes):
        if ctypes.sizeof(struct) != size:
            raise RuntimeError(f"ctypes {struct.__name__} is {ctypes.sizeof(struct)} bytes, C has {size}")
    return lib


_LIBS: dict[str, ctypes.CDLL] = {}


def library_for(device: torch.device) -> ctypes.CDLL:
    arch = arch_of(device)
    if arch not in _LIBS:
        path = build_library(arch)
        with phase("loading the megakernel library"):
            _LIBS[arch] = load_library(path)
    return _LIBS[arch]


def check(lib: ctypes.CDLL, code: int, what: str) -> None:
    if code != 0:
        raise RuntimeError(f"megakernel {what} failed: {lib.qmk_error_string(code).decode()} (cuda error {code})")


# ---------------------------------------------------------------------------------------------
# Support check


def megakernel_unsupported_reason(net, device: torch.device, dtype: torch.dtype) -> str | None:
    """None when the megakernel can run this model here, else why not (for the auto fallback)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return "the megakernel needs a CUDA device"
    if dtype != torch.bfloat16:
        return f"the megakernel runs bf16 weights only (dtype is {dtype})"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        return "the megakernel needs compute capability 8.0 or newer"
    talker = getattr(net, "talker", net)
    reason = shape_unsupported_reason(talker)
    if reason:
        return reason
    cached = digest_matches(cache_root() / cache_key(f"sm_{major}{minor}") / "libqwen_mk.so")
    if find_nvcc() is None and not cached:
        return "nvcc was not found to build the megakernel (set NVCC or CUDA_HOME)"
    return launch_unsupported_reason(talker, device)


def launch_unsupported_reason(talker, device: torch.device) -> str | None:
    """Build/load the library and ask it whether the cooperative grid fits on this device (all
    blocks resident, shared memory available), with this model's shapes."""
    try:
        lib = library_for(device)
    except (RuntimeError, OSError, UnsupportedFeatureError) as e:
        return f"the megakernel library could not be built or loaded ({e})"
    t, p = talker.cfg.stack, talker.code_predictor.cfg.stack
    m = QmkModel()
    for field_name, s in (("talker", t), ("pred", p)):
        st = getattr(m, field_name)
        st.hidden, st.inter, st.num_layers = s.hidden_size, s.intermediate_size, s.num_layers
        st.num_heads, st.num_kv_heads = s.num_heads, s.num_kv_heads
    blocks, smem = ctypes.c_int32(), ctypes.c_int32()
    with torch.cuda.device(device):
        code = lib.qmk_grid_size(ctypes.byref(m), ctypes.byref(blocks), ctypes.byref(smem))
    if code != 0:
        return f"the megakernel's cooperative grid cannot run here: {lib.qmk_error_string(code).decode()}"
    return None


# Compile-time limits of the kernel (cuda/qwen_mk.cu, mk_matvec.cuh): matvec operands are held in
# registers as 1024-wide segments, at most 2 for hidden-wide inputs and 3 for the MLP's down
# projection (a 6144-wide one runs as two halves).
MAX_HIDDEN = 2048
INTER_SIZES = (1024, 2048, 3072, 6144)  # wider than 3072: streamed as two 3072-wide halves
MAX_VOCAB = 4096  # sampling keeps 8 logits per thread
MAX_LAYERS = 48  # layer tables of both stacks in shared memory


def shape_unsupported_reason(talker) -> str | None:
    t, p = talker.cfg.stack, talker.code_predictor.cfg.stack
    for name, s in (("talker", t), ("code predictor", p)):
        if s.head_dim != HEAD_DIM:
            return f"{name} head_dim is {s.head_dim}; the megakernel is built for {HEAD_DIM}"
        if s.num_heads != 2 * s.num_kv_heads:
            return f"{name} has {s.num_heads} query / {s.num_kv_heads} kv heads; the megakernel needs 2 query heads per kv head"
        if s.num_heads * HEAD_DIM > MAX_HIDDEN:
            return f"{name} has {s.num_heads} heads; the megakernel supports at most {MAX_HIDDEN // HEAD_DIM}"
        if s.hidden_size % 1024 or s.hidden_size > MAX_HIDDEN:
            return f"{name} hidden size {s.hidden_size} must be a multiple of 1024 and at most {MAX_HIDDEN}"
        if s.intermediate_size not in INTER_SIZES:
            return f"{name} intermediate size {s.intermediate_size} is not one of {INTER_SIZES}"
    if t.num_layers + p.num_layers > MAX_LAYERS:
        return f"{t.num_layers} + {p.num_layers} layers; the megakernel holds at most {MAX_LAYERS}"
    if talker.cfg.vocab_size > MAX_VOCAB or talker.code_predictor.cfg.vocab_size > MAX_VOCAB:
        return f"codec vocabularies must be at most {MAX_VOCAB}"
    if talker.cfg.num_code_groups > MAX_GROUPS:
        return f"at most {MAX_GROUPS} code groups are supported"
    return None


# ---------------------------------------------------------------------------------------------
# Backend


def rope_table(positions: int, theta: float, device: torch.device) -> Tensor:
    """fp32 [positions, 2, 64]: cos then sin, the very values the fp32 torch layers compute."""
    cos, sin = rotary_cos_sin(torch.arange(positions, device=device), HEAD_DIM, theta, torch.float32)
    half = HEAD_DIM // 2
    return torch.stack([cos[:, :half], sin[:, :half]], dim=1).contiguous()


def ptr(t: Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


@torch.no_grad()
def transposed_down(weight: Tensor, device: torch.device) -> Tensor:
    """The MLP's down projection as the split-K path reads it (qmk_layer.down_t): bf16
    [intermediate, hidden], row i = the column that gate/up unit i's activation multiplies."""
    return weight.detach().to(device, torch.bfloat16).t().contiguous()


@torch.no_grad()
def grouped_o(weight: Tensor, kv_heads: int, device: torch.device) -> Tensor:
    """o_proj regrouped per KV head as the fused attention + o_proj phase reads it
    (qmk_layer.o_blk): bf16 [kv_heads, hidden, 2 * 128], so the 64 rows of one head's 256 columns
    that one item multiplies are one contiguous 32 KB tile."""
    w = weight.detach().to(device, torch.bfloat16)
    hidden, width = w.shape
    return w.view(hidden, kv_heads, width // kv_heads).permute(1, 0, 2).contiguous()


@torch.no_grad()
def build_input_tables(talker, device: torch.device) -> list[Tensor]:
    """The megakernel's input tables (qmk_model.qkv0). For predictor pass p = 1..15: the raw
    layer-0 q/k/v projections (fp32 [ids, (H + 2 KV) * 128]) of every input the pass can be fed:
    the code's embedding row (talker codec embedding for p = 1, the predictor's table p - 2 after),
    through the 2048->1024 projection where the model has one, RMS-normed; with a projection, the
    projected row follows (the pass's residual stream starts there). The pass's input is a
    function of one code id, so the kernel reads this row instead of running the projection and
    q/k/v phases. Computed in float64 from the weights the kernel reads (bf16) and rounded once to
    fp32: at least as close to the fp32 reference as the kernel's own sums. 31,744 rows x 16 KB =
    520 MB of device memory (1.7B: + 4 KB a row for the projected input, 650 MB).
    """
    cp = talker.code_predictor
    proj = cp.small_to_mtp_projection
    layer = cp.model.layers[0]
    a = layer.self_attn
    eps = cp.cfg.stack.rms_norm_eps
    f64 = torch.float64

    def w64(t: Tensor) -> Tensor:
        return t.detach().to(device, torch.bfloat16).to(f64)

    norm_w = w64(layer.input_layernorm.weight)
    qkv_w = torch.cat([w64(a.q_proj.weight), w64(a.k_proj.weight), w64(a.v_proj.weight)])
    has_proj = isinstance(proj, torch.nn.Linear)
    proj_w, proj_b = (w64(proj.weight).T, w64(proj.bias)) if has_proj else (None, None)
    tables = []
    embeddings = [talker.model.codec_embedding.weight] + [e.weight for e in cp.model.codec_embedding]
    for emb in embeddings[: talker.cfg.num_code_groups - 1]:
        x = w64(emb)
        if has_proj:
            x = x @ proj_w + proj_b
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * norm_w
        row = [normed @ qkv_w.T] + ([x] if has_proj else [])
        tables.append(torch.cat(row, dim=1).float().contiguous())
        del x, normed, row
    return tables


def carve(device: torch.device, dtype: torch.dtype, zero: bool, shapes: dict[str, tuple[int, ...]]) -> dict[str, Tensor]:
    """Views of one new allocation (zeroed if `zero`), one per shape, each starting on a 512-byte
    boundary of it."""
    align = 512 // torch.empty((), dtype=dtype).element_size()
    offsets, total = {}, 0
    for name, shape in shapes.items():
        offsets[name] = total
        total += -(-math.prod(shape) // align) * align
    arena = (torch.zeros if zero else torch.empty)(total, device=device, dtype=dtype)
    return {name: arena[o:o + math.prod(shape)].view(shape) for (name, shape), o in zip(shapes.items(), offsets.values())}


def prefill_mode(mode: str | None) -> str:
    """`mode`, or QWEN_FAST_MK_PREFILL, or "fp32"; checked against PREFILL_MODES."""
    mode = mode or os.environ.get("QWEN_FAST_MK_PREFILL") or "fp32"
    if mode not in PREFILL_MODES:
        raise ValueError(f"the megakernel's prefill must be one of {list(PREFILL_MODES)}, got {mode!r}")
    return mode


@dataclass
class MegakernelState:
    model: QmkModel
    talker_cache: KVCache
    pred_k: Tensor
    pred_v: Tensor
    params: SamplingParams
    seed: int
    trailing: Tensor
    pad_vec: Tensor
    buffers: dict[str, Tensor]
    frame: int = 0
    preview: Tensor | None = None  # frame 0's codes, made ahead of the frame (preview_frame)
    released: bool = field(default=False)


class MegakernelBackend:
    """The DecodeBackend protocol over the CUDA megakernel, on a loaded `Talker` module."""

    name = "megakernel"

    def __init__(self, talker, device: torch.device, dtype: torch.dtype, warmup: bool = True,
                 input_tables: bool = True, split_down: bool = True, fuse_attn_o: bool = True,
                 group_qkv: bool = True, merge_first: bool = True, fuse_talker_attn_o: bool = True,
                 max_blocks: int = 0, long_kernel: str = "auto", prefills: PrefillGraphs | None = None,
                 prefill: str | None = None):
        if long_kernel not in LONG_KERNEL:
            raise ValueError(f"long_kernel must be one of {sorted(LONG_KERNEL)}, got {long_kernel!r}")
        prefill = prefill_mode(prefill)
        reason = shape_unsupported_reason(talker)
        if reason:
            raise UnsupportedFeatureError(reason)
        if dtype != torch.bfloat16:
            raise UnsupportedFeatureError(f"the megakernel runs bf16 weights only (dtype is {dtype})")
        self.talker = talker
        self.device = device
        self.dtype = dtype
        reason = exact_products_blocker(device) if prefill == "fp32" else None
        if reason:
            logger.warning("the prefill's exact bf16 products cannot run here (%s): fp32-copy instead", reason)
            prefill = "fp32-copy"
        self.prefill_mode = prefill
        if prefill != "bf16":
            # The prompt's vectors at fp32 too (model/prompt.py): the megakernel's calls read the
            # fp32 model's prompt. The auto backend's batch gets them too and rounds them to bf16.
            talker.prompt_dtype = torch.float32
            # One exact product for q/k/v and one for gate/up (prefill_layer_fp32): fused in
            # place, as the batch backend fuses them, before the kernel takes the weights' addresses.
            fuse_projections(talker.model)
        self._prefill_stack = stack_copy(talker.model, torch.float32) if prefill == "fp32-copy" else talker.model
        self.lib = library_for(device)
        # Floats of the residual accumulators (resid, pres): fixed by the library, which gives
        # them several copies each (blocks add into different ones).
        acc = (ctypes.c_int64 * 2)()
        self.lib.qmk_acc_floats(acc)
        self.acc_floats = (acc[0], acc[1])
        self.tcfg, self.pcfg = talker.cfg, talker.code_predictor.cfg
        self.eos_id = self.tcfg.codec_eos_id
        self.num_groups = self.tcfg.num_code_groups
        self._keep: list[Tensor] = []
        # The MLP's down projection split over the blocks' gate/up units (qmk_stack.split_down):
        # one grid barrier less per layer, reading a transposed copy of each down matrix (0.6B:
        # +208 MB, 1.7B: +736 MB). False keeps down as its own phase: bitwise reproducible runs.
        self.split_down = split_down
        # The code predictor's attention and o_proj in one phase (qmk_stack.fuse_attn_o): one
        # grid barrier less per predictor layer, reading o regrouped per KV head (+20 MB). It adds
        # into the residual with atomics, as the split down projection does, so it needs that.
        self.fuse_attn_o = fuse_attn_o and split_down
        # The predictor's q/k/v phase ends without a grid barrier (with fuse_attn_o): 16 blocks
        # per KV head, and the fused phase waits for its head's blocks only (qmk_stack.group_qkv;
        # the kernel keeps the barrier on a grid of fewer than 16 blocks per head). False: always
        # the barrier.
        self.group_qkv = group_qkv
        # Predictor passes 0 and 1 in one pass of phases, each for both positions (qmk_stack.
        # merge_first; needs fuse_attn_o and the input tables): one pass of phases less a frame.
        # The kernel keeps them apart on grids of fewer than 64 blocks (merges_first_passes).
        self.merge_first = merge_first
        # The talker's attention and o_proj in one phase too (qmk_stack.fuse_attn_o on its stack):
        # the attention items publish per head and o_proj items wait for their head instead of a
        # grid barrier, reading o regrouped per KV head (0.6B: +112 MB, 1.7B: +224 MB). -0.024 ms a
        # 0.6B talker step on the H200 (docs/journal/NOTES.md, v25). Only where each o_proj item gets a
        # block of its own (one block per SM, max_blocks applied, as the kernel's grid;
        # uses_talker_fusion): elsewhere the regrouped o would be dead weight. It needs split_down's
        # accumulators.
        blocks = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0
        if max_blocks > 0:
            blocks = min(blocks, max_blocks)
        o_items = self.tcfg.stack.num_kv_heads * TALKER_O_ITEMS_PER_KV_HEAD
        self.fuse_talker_attn_o = fuse_talker_attn_o and split_down and o_items <= blocks
        # At most this many blocks (0: one per SM): a smaller GPU's grid on this one, for tests.
        self.max_blocks = max_blocks
        # The long-context kernel runs a block's talker attention items at once; "auto" launches it
        # once those items outnumber the blocks (from position 512 on an H200), "always" and
        # "never" are for tests and measurements (qmk_model.long_kernel).
        self.long_kernel = long_kernel
        self.talker_layers = self._layer_table(
            talker.model, grouped_kv_heads=self.tcfg.stack.num_kv_heads if self.fuse_talker_attn_o else 0)
        self.pred_layers = self._layer_table(talker.code_predictor.model,
                                             grouped_kv_heads=self.pcfg.stack.num_kv_heads if self.fuse_attn_o else 0)
        self.pred_rope = rope_table(self.num_groups, self.pcfg.stack.rope_theta, device)
        self._rope_shared: Tensor | None = None  # the talker's, grown on demand (_talker_rope)
        # Per-code layer-0 q/k/v of the predictor passes (qmk_model.qkv0): -15 phases a frame.
        with phase("tabulating the predictor's input"):
            self.input_tables = build_input_tables(talker, device) if input_tables else []
        # Every state's QmkModel points at the same weights: their addresses are taken once here,
        # as the layer tables' are, not per request (~34 checks and conversions: ~0.25 ms of host
        # time before the prefill, on the time to first audio; docs/journal/NOTES.md, eighteenth session).
        self._weight_ptrs = self._model_weight_ptrs()
        # The captured prefill per prompt-length bucket: made at warm-up, or shared with another
        # backend on the same weights whose graphs compute what this one's would (the auto
        # backend's batch, with prefill="bf16").
        self.prefills: PrefillGraphs | None = (
            prefills if prefills is not None and prefills.kind == self._prefill_kind() else None)
        if warmup:
            with phase("megakernel warm-up"):
                self.warmup()

    def _model_weight_ptrs(self) -> dict:
        cp = self.talker.code_predictor
        proj = cp.small_to_mtp_projection
        has_proj = isinstance(proj, torch.nn.Linear)
        return {
            "talker_norm": self._w(self.talker.model.norm.weight),
            "pred_norm": self._w(cp.model.norm.weight),
            "codec_head": self._w(self.talker.codec_head.weight),
            "talker_emb": self._w(self.talker.model.codec_embedding.weight),
            "proj_w": self._w(proj.weight) if has_proj else 0,
            "proj_b": self._w(proj.bias) if has_proj else 0,
            "pred_emb": [self._w(cp.model.codec_embedding[g].weight) for g in range(self.num_groups - 1)],
            "lm_head": [self._w(cp.lm_head[g].weight) for g in range(self.num_groups - 1)],
            "qkv0": [ptr(t) for t in self.input_tables] if self.input_tables else [0] * (self.num_groups - 1),
        }

    def _w(self, t: Tensor) -> int:
        if t.device != self.device or t.dtype != torch.bfloat16 or not t.is_contiguous():
            t = t.detach().to(self.device, torch.bfloat16).contiguous()
            self._keep.append(t)
        return t.data_ptr()

    def _layer_table(self, stack, grouped_kv_heads: int = 0) -> Tensor:
        rows = []
        for layer in stack.layers:
            a, mlp = layer.self_attn, layer.mlp
            rows.append([self._w(x) for x in (
                layer.input_layernorm.weight, a.q_proj.weight, a.k_proj.weight, a.v_proj.weight,
                a.q_norm.weight, a.k_norm.weight, a.o_proj.weight, layer.post_attention_layernorm.weight,
                mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)])
            down_t = transposed_down(mlp.down_proj.weight, self.device) if self.split_down else None
            if down_t is not None:
                self._keep.append(down_t)
            rows[-1].append(ptr(down_t))
            o_blk = grouped_o(a.o_proj.weight, grouped_kv_heads, self.device) if grouped_kv_heads else None
            if o_blk is not None:
                self._keep.append(o_blk)
            rows[-1].append(ptr(o_blk))
        return torch.tensor(rows, dtype=torch.int64).to(self.device)

    def _stack(self, cfg, table: Tensor, final_norm: int, rope: Tensor, k: Tensor, v: Tensor, max_pos: int,
               predictor: bool = False) -> QmkStack:
        # group_qkv and merge_first are code-predictor options; the talker's stack never has them.
        fuse = self.fuse_attn_o if predictor else self.fuse_talker_attn_o
        return QmkStack(
            hidden=cfg.hidden_size, inter=cfg.intermediate_size, num_layers=cfg.num_layers,
            num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, max_pos=max_pos, eps=cfg.rms_norm_eps,
            split_down=int(self.split_down), fuse_attn_o=int(fuse),
            group_qkv=int(predictor and self.group_qkv), merge_first=int(predictor and self.merge_first),
            layers=ptr(table), final_norm=final_norm, rope=ptr(rope),
            k_cache=ptr(k), v_cache=ptr(v),
        )

    def _talker_rope(self, positions: int) -> Tensor:
        """The first `positions` rows of one shared table (a row does not depend on the table's
        length): a request no longer computes its own, ~10 launches before its prefill."""
        table = self._rope_shared
        if table is None or table.shape[0] < positions:
            table = rope_table(max(positions, 4096), self.tcfg.stack.rope_theta, self.device)
            self._rope_shared = table
        return table[:positions]

    def new_state(self, *, max_positions: int, params: SamplingParams, seed: int | None, trailing: Tensor,
                  pad_vec: Tensor) -> MegakernelState:
        dev, f32 = self.device, torch.float32
        ts, ps = self.tcfg.stack, self.pcfg.stack
        Dt, Dp = ts.hidden_size, ps.hidden_size
        G = self.num_groups
        talker_cache = KVCache(ts, max_positions, dev, f32)
        pk = torch.empty((ps.num_layers, ps.num_kv_heads, G, HEAD_DIM), device=dev, dtype=f32)
        pv = torch.empty_like(pk)
        part = max(self.lib.qmk_attn_part_floats(max_positions, ts.num_kv_heads),
                   self.lib.qmk_attn_part_floats(G, ps.num_kv_heads))
        # Three allocations, not seventeen: each zeros() or empty() is a host round of its own (a
        # fill launch for zeros) before the prefill can start. Views start 512 bytes apart, as
        # separate allocations would.
        buf = carve(dev, f32, zero=True, shapes={"pending": (Dt,), "hidden": (Dt,), "pred_hidden": (G, Dp)})
        buf |= carve(dev, f32, zero=False, shapes={
            "resid": (self.acc_floats[0],),
            "mid": (max(Dt, Dp),),
            "pres": (self.acc_floats[1],),
            # Two rows: the predictor's pass 1 has its own with merge_first.
            "qkv": (max(ts.num_heads + 2 * ts.num_kv_heads, 2 * (ps.num_heads + 2 * ps.num_kv_heads)) * HEAD_DIM,),
            "attn": (max(ts.num_heads, ps.num_heads) * HEAD_DIM,),
            "act": (max(ts.intermediate_size, ps.intermediate_size),),
            "proj_out": (Dp,),
            "logits": (self.tcfg.vocab_size,),
            "pred_logits": (G - 1, self.pcfg.vocab_size),
            "attn_part": (part,),
        })
        flags = carve(dev, torch.uint8, zero=True, shapes={
            "seen": (self.tcfg.vocab_size,),
            "attn_count": (4 * max(ts.num_kv_heads, ps.num_kv_heads),),
            # The grid barrier counts arrivals from zero; one per state, so two sessions never share it.
            "barrier": (4,),
            "head_ready": (4 * ps.num_kv_heads,),
        })
        buf["seen"] = flags.pop("seen")
        buf |= {name: t.view(torch.int32) for name, t in flags.items()}
        buf |= {
            # fp32, as the fp32 model adds them (qmk_frame.trailing): an fp32 prompt's text
            # vectors rounded to bf16 parted the codes from the fp32 model's within ~60-100 frames
            # (docs/PERFORMANCE.md, "The prefill in fp32").
            "trailing": trailing.to(dev, f32).contiguous(),
            "pad_vec": pad_vec.to(dev, f32).contiguous(),
            "rope": self._talker_rope(max_positions),
        }
        w = self._weight_ptrs
        m = QmkModel(
            talker=self._stack(ts, self.talker_layers, w["talker_norm"], buf["rope"],
                               talker_cache.k, talker_cache.v, max_positions),
            pred=self._stack(ps, self.pred_layers, w["pred_norm"], self.pred_rope, pk, pv, G, predictor=True),
            vocab=self.tcfg.vocab_size, pred_vocab=self.pcfg.vocab_size, eos_id=self.eos_id, num_groups=G,
            max_blocks=self.max_blocks, long_kernel=LONG_KERNEL[self.long_kernel],
            codec_head=w["codec_head"], talker_emb=w["talker_emb"], proj_w=w["proj_w"], proj_b=w["proj_b"],
        )
        for g in range(G - 1):
            m.pred_emb[g] = w["pred_emb"][g]
            m.lm_head[g] = w["lm_head"][g]
            m.qkv0[g] = w["qkv0"][g]
        for name in ("pending", "hidden", "seen", "resid", "mid", "pres", "qkv", "attn", "act", "proj_out", "logits",
                     "pred_logits", "pred_hidden", "attn_part", "attn_count", "barrier", "head_ready"):
            setattr(m, name, ptr(buf[name]))
        return MegakernelState(model=m, talker_cache=talker_cache, pred_k=pk, pred_v=pv, params=params,
                               seed=session_seed(seed) & (2**64 - 1), trailing=buf["trailing"], pad_vec=buf["pad_vec"], buffers=buf)

    @property
    def prefill_dtype(self) -> torch.dtype:
        return self.dtype if self.prefill_mode == "bf16" else torch.float32

    def _prefill_kind(self) -> str:
        """PrefillGraphs.kind of the graphs this backend's prefill runs."""
        return str(self.dtype).removeprefix("torch.") if self.prefill_mode == "bf16" else self.prefill_mode

    def new_prefill_graphs(self) -> PrefillGraphs:
        if self.prefill_mode == "bf16":
            return PrefillGraphs(self.talker, self.device, self.dtype)
        return PrefillGraphs(StackOwner(self.tcfg, self._prefill_stack), self.device, torch.float32,
                             step=prefill_layer_fp32, kind=self.prefill_mode)

    @torch.no_grad()
    def prefill(self, state: MegakernelState, embeds: Tensor) -> None:
        embeds = embeds.to(self.device, self.prefill_dtype)
        n = embeds.shape[0]
        cache = state.talker_cache
        captured = self.prefills.run(embeds) if self.prefills is not None and n <= cache.max_len else None
        if captured is not None:
            # A captured prefill per prompt-length bucket: no per-shape eager cost on first audio.
            k, v, hidden = captured
            self.load_prefill(state, k, v, n, hidden)
            return
        state.buffers["hidden"].copy_(self._eager_prefill(embeds, cache))

    def _eager_prefill(self, embeds: Tensor, cache: KVCache) -> Tensor:
        """One batched torch pass that writes the KV cache in the layout the kernel reads; the
        post-norm hidden of the last position. Prompts past the captured buckets take it."""
        if self.prefill_mode == "bf16":
            # The attention upcasts on store and casts back on read: the fp32 cache takes bf16 values.
            return self.talker.model(embeds, cache)[-1]
        with fp32_matmuls():
            return prefill_from_start(self._prefill_stack, embeds, cache)

    @torch.no_grad()
    def load_prefill(self, state: MegakernelState, k: Tensor, v: Tensor, n: int, hidden: Tensor) -> None:
        """Start `state` from a prefill made elsewhere: K/V [layers, kv_heads, >= n, 128] of positions
        0..n-1 and the post-norm hidden of position n-1, in any float dtype (upcast to the kernel's
        fp32). Used by the captured prefill, and by tests that start the kernel from the fp32
        reference's own prefill."""
        cache = state.talker_cache
        if n > cache.max_len:
            raise RuntimeError(f"KV cache overflow: {n} prefill positions > capacity {cache.max_len}")
        cache.k[:, :, :n].copy_(k[:, :, :n])
        cache.v[:, :, :n].copy_(v[:, :, :n])
        cache.length = n
        state.buffers["hidden"].copy_(hidden)

    def frame_args(self, state: MegakernelState, *, run_talker: bool, run_predictor: bool = True, pos: int | None = None,
                   force: Tensor | None = None, out: Tensor | None = None,
                   trace: Tensor | None = None, next_input: bool = True) -> tuple[QmkFrame, Tensor]:
        """`next_input` False: the frame leaves the next talker input unwritten (its text vector
        is passed as a null address; preview_frame)."""
        p = state.params
        t = state.frame
        trailing = state.trailing[t] if t < state.trailing.shape[0] else state.pad_vec
        if not next_input:
            trailing = None
        if out is None:
            out = torch.empty(MAX_GROUPS, dtype=torch.int64, device=self.device)
        f = QmkFrame(
            run_talker=int(run_talker), run_predictor=int(run_predictor),
            pos=state.talker_cache.length if pos is None else pos, frame=t,
            min_new_tokens=p.min_new_tokens, suppress_start=self.tcfg.vocab_size - 1024,
            rep_penalty=p.repetition_penalty, trace_steps=0,
            talker_s=QmkSampler(int(p.do_sample), p.top_k, p.temperature, p.top_p),
            pred_s=QmkSampler(int(p.subtalker_do_sample), p.subtalker_top_k, p.subtalker_temperature, p.subtalker_top_p),
            seed=state.seed, trailing=ptr(trailing), force_codes=ptr(force), codes_out=ptr(out), trace=ptr(trace),
        )
        # The struct holds raw addresses: keep their tensors alive as long as it lives.
        f._refs = (out, force, trace, trailing)
        return f, out

    def launch(self, state: MegakernelState, f: QmkFrame) -> None:
        stream = torch.cuda.current_stream(self.device).cuda_stream
        check(self.lib, self.lib.qmk_decode_frame(ctypes.byref(state.model), ctypes.byref(f), stream), "launch")

    @torch.no_grad()
    def decode_frame(self, state: MegakernelState, force: Tensor | None = None) -> Tensor:
        """One frame; `force` (LongTensor[16] on the device) teacher-forces the fed-back codes."""
        if state.released:
            raise RuntimeError("decode_frame on a released state")
        if state.preview is not None:  # frame 0's codes were made ahead (preview_frame)
            codes, state.preview = state.preview, None
            self._finish_preview(state, codes)
            state.frame += 1
            return codes
        run_talker = state.frame > 0
        cache = state.talker_cache
        if run_talker and cache.length >= cache.max_len:
            raise RuntimeError(f"KV cache overflow: position {cache.length} >= capacity {cache.max_len}")
        f, out = self.frame_args(state, run_talker=run_talker, force=force)
        self.launch(state, f)
        if run_talker:
            cache.length += 1
        state.frame += 1
        return out[: self.num_groups]

    @torch.no_grad()
    def preview_frame(self, state: MegakernelState) -> Tensor:
        """Frame 0's codes before the frame runs (streamed text, engine/text_session.py): they need
        only the prefill's hidden state, while the frame's next talker input needs trailing[0]
        (spec §4.5: the second text token). One launch without the talker step and without the
        next input; the state stays at frame 0. `decode_frame` then returns these codes and makes
        the frame's rest without a launch (`_finish_preview`)."""
        if state.released:
            raise RuntimeError("preview_frame on a released state")
        if state.frame != 0:
            raise RuntimeError(f"only frame 0 can be previewed (the state is at frame {state.frame})")
        if state.preview is None:
            f, out = self.frame_args(state, run_talker=False, next_input=False)
            self.launch(state, f)
            # The kernel marked code 0 as seen; frame 0 marks it when it runs (nothing was seen
            # before frame 0: the prefill adds no code-0 ids).
            state.buffers["seen"].zero_()
            state.preview = out[: self.num_groups]
        return state.preview

    def _finish_preview(self, state: MegakernelState, codes: Tensor) -> None:
        """What the kernel's frame 0 does after its codes (publish_frame): code 0 marked as seen,
        and the next talker input, the 16 code embeddings summed in fp32 in the kernel's order plus
        the text vector of the step. Each is a chain of fp32 additions of bf16 values, so this
        writes the kernel's bits."""
        t = state.frame
        trailing = state.trailing[t] if t < state.trailing.shape[0] else state.pad_vec
        tables = self._embedding_tables()
        acc = tables[0].index_select(0, codes[:1]).float()
        for g in range(1, self.num_groups):
            acc = acc + tables[g].index_select(0, codes[g : g + 1]).float()
        state.buffers["pending"].copy_((acc + trailing.float())[0])
        state.buffers["seen"].index_fill_(0, codes[:1], 1)

    def _embedding_tables(self) -> list[Tensor]:
        """The bf16 tables the kernel's next input reads (qmk_model.talker_emb, pred_emb)."""
        tables = getattr(self, "_emb_tables", None)
        if tables is None:
            cp = self.talker.code_predictor
            weights = [self.talker.model.codec_embedding.weight]
            weights += [cp.model.codec_embedding[g].weight for g in range(self.num_groups - 1)]
            tables = [w.detach().to(self.device, torch.bfloat16) for w in weights]
            self._emb_tables = tables
        return tables

    def grid_blocks(self, state: MegakernelState) -> int:
        """Blocks of the cooperative grid this state's frames launch with (max_blocks applied)."""
        blocks, smem = ctypes.c_int32(0), ctypes.c_int32(0)
        check(self.lib, self.lib.qmk_grid_size(ctypes.byref(state.model), ctypes.byref(blocks), ctypes.byref(smem)),
              "qmk_grid_size")
        return blocks.value

    def merges_first_passes(self, state: MegakernelState) -> bool:
        """Whether this state's frames run predictor passes 0 and 1 together (merge_first, and a
        grid where both positions' slices fit)."""
        out = ctypes.c_int32(0)
        check(self.lib, self.lib.qmk_merges_first_passes(ctypes.byref(state.model), ctypes.byref(out)),
              "qmk_merges_first_passes")
        return bool(out.value)

    def uses_long_kernel(self, state: MegakernelState) -> bool:
        """Whether this state's next frame launches the long-context kernel (long_kernel)."""
        return self._next_frame_flag(state, "qmk_uses_long_kernel")

    def uses_talker_fusion(self, state: MegakernelState) -> bool:
        """Whether this state's next frame runs the talker's attention and o_proj in one phase."""
        return self._next_frame_flag(state, "qmk_uses_talker_fusion")

    def _next_frame_flag(self, state: MegakernelState, fn: str) -> bool:
        f, _ = self.frame_args(state, run_talker=state.frame > 0)
        out = ctypes.c_int32(0)
        check(self.lib, getattr(self.lib, fn)(ctypes.byref(state.model), ctypes.byref(f), ctypes.byref(out)), fn)
        return bool(out.value)

    def export_state(self, state: MegakernelState) -> SessionSnapshot:
        n, buf = state.talker_cache.length, state.buffers
        # The kernel's draws are a hash of (seed, frame, group), and so are the graph backend's:
        # the adopter continues the same uniforms from the next frame.
        seed = state.seed
        return SessionSnapshot(
            k=state.talker_cache.k[:, :, :n], v=state.talker_cache.v[:, :, :n], frame=state.frame,
            hidden=buf["hidden"], pending=buf["pending"], seen=buf["seen"].bool(), params=state.params, seed=seed,
            trailing=state.trailing, pad_vec=state.pad_vec, max_positions=state.talker_cache.max_len,
        )

    def set_trailing(self, state: MegakernelState, trailing: Tensor) -> None:
        """Replace the text vectors the state's frames add (streamed text grows them as it
        arrives); frame t reads row t when it runs, so only rows of frames not yet run may change."""
        state.trailing = state.buffers["trailing"] = trailing.to(self.device, torch.float32).contiguous()

    def release(self, state: MegakernelState) -> None:
        if state.released:
            return
        state.released = True
        state.talker_cache.k = state.talker_cache.v = torch.empty(0)
        state.pred_k = state.pred_v = torch.empty(0)
        state.preview = None
        state.buffers.clear()

    @torch.no_grad()
    def warmup(self) -> None:
        """Run greedy and sampled frames once so the first request pays no build or load cost."""
        try:
            prefills = self.prefills or self.new_prefill_graphs()
            with phase("capturing the prefill graphs"):
                prefills.capture_all()
            self.prefills = prefills
        except Exception as e:  # noqa: BLE001 - the eager prefill still works; say why it is used
            logger.warning("captured prefill unavailable, prefill runs eagerly: %s: %s", type(e).__name__, e)
            self.prefills = None
        D = self.tcfg.hidden_size
        gen = torch.Generator(device=self.device).manual_seed(0)
        for do_sample in (False, True):
            params = SamplingParams(do_sample=do_sample, subtalker_do_sample=do_sample)
            st = self.new_state(max_positions=8, params=params, seed=0,
                                trailing=torch.zeros((1, D), device=self.device, dtype=self.dtype),
                                pad_vec=torch.zeros(D, device=self.device, dtype=self.dtype))
            embeds = torch.randn((2, D), device=self.device, generator=gen).to(self.dtype) * 0.1
            self.prefill(st, embeds)
            for _ in range(3):
                self.decode_frame(st)
            # The long-context kernel too (a kernel loads on its first launch).
            st.model.long_kernel = LONG_KERNEL["always"]
            self.decode_frame(st)
            torch.cuda.synchronize(self.device)
            self.release(st)


def main(argv: list[str] | None = None) -> int:
    """`python -m pipecat_qwen_fast.backends.megakernel build [--arch sm_90 ...]`: build (or find) the cached
    library for each arch and print its path; without --arch, the current GPU's."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m pipecat_qwen_fast.backends.megakernel")
    ap.add_argument("command", choices=["build"])
    ap.add_argument("--arch", nargs="*", default=None, help="e.g. sm_80 sm_90 (default: the current GPU)")
    args = ap.parse_args(argv)
    archs = args.arch
    if not archs:
        if not torch.cuda.is_available():
            ap.error("no CUDA GPU here: name the target with --arch (e.g. --arch sm_90)")
        major, minor = torch.cuda.get_device_capability()
        archs = [f"sm_{major}{minor}"]
    for arch in archs:
        gencode_flags([arch])
        print(build_library(arch))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
