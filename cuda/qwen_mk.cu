// Qwen3-TTS frame megakernel: one cooperative launch per 80 ms frame, fp32 arithmetic on bf16
// weights.
//
// The frame is a fixed list of phases (next_phase), each ended by a grid barrier:
//   talker layer: q/k/v | attention | o_proj + residual | gate/up + SiLU [+ split-K down] | [down]
//   codec head, code-0 sampling (every block, redundantly: no barrier)
//   16 predictor passes: [2048->1024 projection] 5 layers as above, LM head, sampling; pass 0
//   (the talker hidden) has no head and ends at its last layer's attention
// Each block owns a contiguous slice of every matrix's rows. Because the list is known at launch,
// a block streams its slices (and the K/V rows its attention items read) into a ring of
// shared-memory slots ahead of time (mk_stream.cuh); a phase then costs the barrier, one L2 read
// of its input vector and a matvec from shared memory.
//
// This file is the library's one translation unit: the shared-memory layout, the primitives
// (mk_*.cuh), then the phases (phases/*.cuh), included in this order (each part uses the ones
// before it; one unit keeps the compiled code what it was before the split):
//   schedule      phase kinds, the frame's phase list, each block's slice of a matrix phase
//   producer      which bytes each block streams per phase; the producer warp's loop
//   consumer      the consumers' context: trace stamps, grid barrier, group arrival
//   matvec        a matrix phase (staged operand, dots from the ring, epilogue per row)
//   mlp           the down phase; gate/up with the split down projection
//   attention     the attention phase (short and long-context items); grouped q/k/v waits
//   pred_fused    the predictor's layers with attention + o_proj in one phase
//   talker_fused  the talker's layers with attention + o_proj in one phase (TFUSE kernels)
//   pred_first    predictor passes 0 and 1 in one list of phases (merge_first)
//   stack         a stack's layers as separate phases
//   frame         the frame kernel: talker step, codec head, sampling, predictor passes, outputs
//   host          the C API: grid sizing, per-launch choices, the launch
#include <cuda_runtime.h>

// Shared-memory layout (bytes): fixed offsets, so scratch addresses are immediates. Literals here
// because the headers below use them; checked against the headers' sizes after the includes.
#define QMK_MAX_LAYERS 48  // talker + predictor layers
#define QMK_OWN_MAX 256    // residual rows one block may own (hidden / blocks)
#define QMK_RED_ROWS 192   // matrix rows one block may own in a phase (gate and up count twice)
#define QMK_AO_ROWS 64     // o_proj rows per fused attention + o_proj item
#define QMK_SMEM_RING 0                               // RingState (mbarriers, producer cursor)
#define QMK_SMEM_GEO (QMK_SMEM_RING + 512)            // Geo [16]: this block's slice per matrix kind
#define QMK_SMEM_RED (QMK_SMEM_GEO + 512)             // float [QMK_RED_ROWS][4] row partials
#define QMK_SMEM_NSCR (QMK_SMEM_RED + 16 * QMK_RED_ROWS)  // float [8] RMSNorm partials
#define QMK_SMEM_SRED (QMK_SMEM_NSCR + 32)            // float [2][16] sampling reductions
#define QMK_SMEM_SCAN (QMK_SMEM_SRED + 128)           // float [16] sampling scan
#define QMK_SMEM_CODES (QMK_SMEM_SCAN + 64)           // int [16] sampled codes
#define QMK_SMEM_FED (QMK_SMEM_CODES + 64)            // int [16] codes fed back
#define QMK_SMEM_STAMPS (QMK_SMEM_FED + 64)           // int [4] trace stamp counter
#define QMK_SMEM_OWN (QMK_SMEM_STAMPS + 16)           // float [QMK_OWN_MAX] owned residual rows
#define QMK_SMEM_ATTN (QMK_SMEM_OWN + 4 * QMK_OWN_MAX)  // float [4] attention merge flag
#define QMK_SMEM_QSRC (QMK_SMEM_ATTN + 16)            // const float*: next pass's table row (feed)
#define QMK_SMEM_ACTS (QMK_SMEM_QSRC + 16)            // float [QMK_RED_ROWS / 2 + 8] this block's MLP activations
#define QMK_ACTS_SECOND (QMK_RED_ROWS / 4 + 4)        // where a second position's start (merge_first)
#define QMK_SMEM_TABLES (QMK_SMEM_ACTS + 2 * QMK_RED_ROWS + 32)  // qmk_layer [QMK_MAX_LAYERS]
#define QMK_SMEM_TOPK (QMK_SMEM_TABLES + 104 * QMK_MAX_LAYERS)  // unsigned [4][256] top-k counts
#define QMK_SMEM_XS (QMK_SMEM_TOPK + 4096)            // float [3072] staged operand
#define QMK_SMEM_WS (QMK_SMEM_XS + 4 * 3072)          // float [2048] staged norm weight
#define QMK_SMEM_SLOTS ((QMK_SMEM_WS + 4 * 2048 + 127) / 128 * 128)

#include "mk_attention.cuh"
#include "mk_matvec.cuh"
#include "mk_sample.cuh"
#include "mk_stream.cuh"
#include "mk_util.cuh"
#include "qwen_mk.h"

static_assert(sizeof(RingState) <= 512, "ring state");
static_assert(QMK_TILE_ROWS / QMK_RG * QMK_RG == QMK_TILE_ROWS, "tile rows");
static_assert(QMK_RED_ROWS >= QMK_TILE_ROWS, "row partials");
static_assert(QMK_ATTN_SMEM_FLOATS <= 4, "attention scratch");
#ifndef QMK_ATTN_PAIRS
#define QMK_ATTN_PAIRS 4  // attention items a block runs at once (a merge flag each)
#endif
static_assert(QMK_ATTN_PAIRS >= 1 && QMK_ATTN_PAIRS <= QMK_ATTN_SMEM_FLOATS && 2 * QMK_ATTN_PAIRS <= QMK_WARPS, "attention pairs");
static_assert(QMK_SMEM_XS % 16 == 0 && QMK_SMEM_WS % 16 == 0, "staged operands are read as float4");
static_assert(QMK_SMEM_ACTS % 16 == 0 && QMK_ACTS_SECOND % 4 == 0, "activations are read as float4");
static_assert(QMK_SMEM_TOPK % 16 == 0 && 4 * QMK_TOPK_WORDS <= QMK_SMEM_XS - QMK_SMEM_TOPK, "top-k histograms, read as uint4");
static_assert(sizeof(qmk_layer) == 104, "layer table entry");
static_assert(QMK_THREADS == 8 * QMK_AO_ROWS, "fused attention + o_proj: 8 threads per o_proj row");
static_assert(QMK_AO_ROWS * 2 * QMK_HD * 2 == QMK_SLOT_BYTES, "fused attention + o_proj: one item's rows fill a slot");

#include "phases/schedule.cuh"
#include "phases/producer.cuh"
#include "phases/consumer.cuh"
#include "phases/matvec.cuh"
#include "phases/mlp.cuh"
#include "phases/attention.cuh"
#include "phases/pred_fused.cuh"
#include "phases/talker_fused.cuh"
#include "phases/pred_first.cuh"
#include "phases/stack.cuh"
#include "phases/frame.cuh"
#include "phases/host.cuh"
