/* Plain C ABI of the Qwen3-TTS decode megakernel (loaded from Python with ctypes).
 *
 * One call of qmk_decode_frame runs one whole 80 ms frame on the GPU in a single cooperative
 * launch: the talker step, the codec head, code-0 sampling, the 15 code-predictor steps with their
 * LM heads, sampling and embedding feedback, and the next talker input. Every address below is a
 * device pointer passed as uint64_t so the layout is identical in C and ctypes.
 *
 * Weights are bf16 in checkpoint layout (row-major [out, in]); the one repacked matrix is the MLP's
 * down projection, also passed transposed (down_t) for the split-K path. Everything the
 * kernel computes is fp32 (activations, K/V cache, logits): the official model's fp32 arithmetic
 * on the checkpoint's bf16 weights, read at bf16 bandwidth.
 */
#ifndef QWEN_MK_H
#define QWEN_MK_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define QMK_ABI_VERSION 13
#define QMK_MAX_GROUPS 16
#define QMK_HEAD_DIM 128

/* One Qwen3 decoder layer (bf16 weights). down_t: down transposed, bf16 [inter][hidden], read
 * instead of down when the stack's split_down is set. o_blk: o regrouped per KV head, bf16
 * [kv_heads][hidden][2 * 128] (o_blk[g][r][c] = o[r][256 g + c]), read instead of o when the
 * stack's fuse_attn_o is set (0 otherwise). */
typedef struct {
    uint64_t input_norm, q, k, v, q_norm, k_norm, o, post_norm, gate, up, down, down_t, o_blk;
} qmk_layer;

/* A stack of layers (talker or code predictor) and its KV cache. */
typedef struct {
    int32_t hidden, inter, num_layers, num_heads, num_kv_heads, max_pos;
    float eps;
    /* 1: each block multiplies its own gate/up outputs by their rows of down_t and adds that
     * partial into the residual with float atomics (no barrier between gate/up and down; the
     * order of the additions varies from run to run in the last bit). 0: down is a phase of its
     * own behind a grid barrier (bitwise reproducible). */
    int32_t split_down;
    /* 1 (needs split_down): attention and o_proj are one phase. Each (KV head, 64 o_proj rows)
     * item adds its o_proj partial with float atomics into accumulators that start at zero; no
     * barrier between attention and o_proj. In the code predictor (at most 32 positions) each
     * item recomputes its head's attention; in the talker the attention items publish per head
     * and an o_proj item waits for its head's count (qmk_model.attn_count); qmk_decode_frame
     * clears it where the talker's 16 o_proj items per KV head outnumber the blocks
     * (qmk_uses_talker_fusion). 0: o_proj is a phase of its own. */
    int32_t fuse_attn_o;
    /* 1 (code predictor with fuse_attn_o; 16 blocks per KV head in the grid): the q/k/v phase
     * gives each head's 512 rows to 16 blocks and ends without a grid barrier; the fused phase's
     * items wait for their head's blocks through qmk_model.head_ready. 0: a grid barrier. */
    int32_t group_qkv;
    /* 1 (code predictor with fuse_attn_o and a layer-0 table for pass 1, qmk_model.qkv0): passes
     * 0 (the talker hidden) and 1 (code 0) run together, each matrix phase multiplying its tiles
     * by both positions' vectors, so the frame has one pass of phases less. qmk_decode_frame
     * keeps them apart where a block's slices do not fit its shared memory twice (grids of fewer
     * than 64 blocks; qmk_merges_first_passes). 0: one pass after the other. */
    int32_t merge_first;
    uint64_t layers;     /* qmk_layer[num_layers] in device memory */
    uint64_t final_norm; /* bf16 [hidden] */
    uint64_t rope;       /* fp32 [max_pos][2][64]: cos then sin per position */
    uint64_t k_cache;    /* fp32 [num_layers][num_kv_heads][max_pos][head_dim] */
    uint64_t v_cache;
} qmk_stack;

typedef struct {
    int32_t do_sample, top_k; /* top_k <= 0: off */
    float temperature, top_p; /* top_p >= 1: off */
} qmk_sampler;

/* Weights plus one session's buffers. */
typedef struct {
    qmk_stack talker, pred;
    int32_t vocab, pred_vocab, eos_id, num_groups;
    /* 0: one block per SM. n > 0: at most n blocks (a smaller GPU's grid, for tests: the fused
     * phase then deals several items to a block and the q/k/v phase keeps its grid barrier). */
    int32_t max_blocks;
    /* Which kernel a frame launches: 0 by the talker's position (the long-context one once its
     * attention items outnumber the blocks), 1 always the long-context one, -1 never. */
    int32_t long_kernel;
    uint64_t codec_head;  /* bf16 [vocab][Dt] */
    uint64_t talker_emb;  /* bf16 [vocab][Dt] */
    uint64_t proj_w;      /* bf16 [Dp][Dt] or 0 when Dt == Dp */
    uint64_t proj_b;      /* bf16 [Dp] */
    uint64_t pred_emb[QMK_MAX_GROUPS - 1]; /* bf16 [pred_vocab][Dt] */
    uint64_t lm_head[QMK_MAX_GROUPS - 1];  /* bf16 [pred_vocab][Dp] */
    /* fp32 [ids][(Hp + 2 KVp) * 128 (+ Dp with proj_w)] or 0: for predictor pass g + 1's input
     * for every code id it can be fed (pass 1: talker_emb rows, pass p >= 2: pred_emb[p - 2]
     * rows), the raw layer-0 q/k/v projections of the RMS-normed input, then (with proj_w) the
     * projected input itself. A pass with a table runs no projection and no layer-0 q/k/v phase. */
    uint64_t qkv0[QMK_MAX_GROUPS - 1];
    /* session state */
    uint64_t pending;     /* fp32 [Dt] next talker input (16-way embedding sum + text vector) */
    uint64_t hidden;      /* fp32 [Dt] post-norm talker hidden at the newest position */
    uint64_t seen;        /* uint8 [vocab] code-0 ids generated so far */
    /* scratch (fp32 unless noted) */
    uint64_t resid;       /* residual stream (after the MLP): qmk_acc_floats()[0] floats, the copies that
                             the split down projection adds into (cuda/mk_matvec.cuh, acc_copy) */
    uint64_t mid;         /* [max(Dt, Dp)] residual stream after attention (the MLP's input) */
    uint64_t pres;        /* the predictor's residual accumulators with fuse_attn_o: qmk_acc_floats()[1]
                             floats (four pairs, each `a` and the copies of `b`) */
    uint64_t qkv;         /* [2][(H + 2 KV) * 128], raw projections (the second row: pass 1's,
                             with merge_first) */
    uint64_t attn;        /* [H * 128] attention output */
    uint64_t act;         /* [max(It, Ip)] MLP activations (the down phase's input; unused when split) */
    uint64_t proj_out;    /* [Dp] */
    uint64_t logits;      /* [vocab] codec-head logits */
    uint64_t pred_logits; /* [num_groups - 1][pred_vocab] */
    uint64_t pred_hidden; /* [num_groups][Dp] post-norm predictor hidden per position */
    uint64_t attn_part;   /* split-attention partials, qmk_attn_part_floats() */
    uint64_t attn_count;  /* uint32 [max KV heads], zero-initialised, self-resetting */
    uint64_t barrier;     /* uint32 [1], zero-initialised: the grid barrier's counter */
    uint64_t head_ready;  /* uint32 [pred kv heads], zero-initialised, self-resetting: blocks done
                             with a head's q/k/v rows (group_qkv) */
} qmk_model;

/* Per-frame arguments. */
typedef struct {
    int32_t run_talker;    /* 0 on frame 0: the prefill already produced the hidden state */
    int32_t run_predictor; /* 0 only for timing the talker alone */
    int32_t pos;           /* talker position of this step */
    int32_t frame;         /* number of code-0 ids sampled before this frame */
    int32_t min_new_tokens;
    int32_t suppress_start; /* ids >= this (except EOS) may never be code 0 */
    float rep_penalty;
    int32_t trace_steps;  /* with `trace`: also stamp the steps inside each phase (phases/schedule.cuh STEP_*) */
    qmk_sampler talker_s, pred_s;
    uint64_t seed;
    uint64_t trailing;    /* fp32 [Dt] text vector added to the next talker input */
    uint64_t force_codes; /* int64 [16] teacher forcing (feedback uses these) or 0 */
    uint64_t codes_out;   /* int64 [16] */
    uint64_t trace;       /* int64 [3 * QMK_TRACE_MAX] (clock64, globaltimer, phase id + 32 * step) of
                             block 0, at each barrier exit (step 0) and, with trace_steps, inside phases */
} qmk_frame;

#define QMK_TRACE_MAX 8192

int qmk_abi_version(void);
/* sizeof of qmk_layer, qmk_stack, qmk_model, qmk_frame into out[0..3]. */
void qmk_struct_sizes(int32_t* out);
/* Floats needed by attn_part for a stack of max_pos positions and kv_heads heads. */
int64_t qmk_attn_part_floats(int32_t max_pos, int32_t kv_heads);
/* out[0]: floats of qmk_model.resid, out[1]: of qmk_model.pres. */
void qmk_acc_floats(int64_t* out);
/* Blocks and dynamic shared memory of the cooperative grid on the current device; returns a
 * cudaError_t (cudaErrorCooperativeLaunchTooLarge / cudaErrorNotSupported when co-residency
 * cannot be guaranteed). */
int qmk_grid_size(const qmk_model* m, int32_t* blocks, int32_t* smem_bytes);
/* *out = 1 when qmk_decode_frame(m, f) launches the long-context kernel (qmk_model.long_kernel). */
int qmk_uses_long_kernel(const qmk_model* m, const qmk_frame* f, int32_t* out);
/* *out = 1 when qmk_decode_frame(m, ...) runs predictor passes 0 and 1 together (merge_first). */
int qmk_merges_first_passes(const qmk_model* m, int32_t* out);
/* *out = 1 when qmk_decode_frame(m, f) runs the talker's attention and o_proj in one phase. */
int qmk_uses_talker_fusion(const qmk_model* m, const qmk_frame* f, int32_t* out);
/* Launch one frame on `stream` (a cudaStream_t); returns a cudaError_t. */
int qmk_decode_frame(const qmk_model* m, const qmk_frame* f, uint64_t stream);
const char* qmk_error_string(int code);

#ifdef __cplusplus
}
#endif

#endif
