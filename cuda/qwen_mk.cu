// Qwen3-TTS frame megakernel: one cooperative launch per 80 ms frame.
//
// Phases of a decoder layer, each followed by a grid barrier:
//   1. RMSNorm (every block, redundantly) + q/k/v projections
//   2. QK-norm, RoPE, KV append, attention (kv head x position chunk per block)
//   3. o_proj + residual
//   4. RMSNorm (redundant) + gate/up + SiLU*up
//   5. down_proj + residual
// Heads (codec head, 15 predictor LM heads) are one more phase each. Sampling runs in every block
// on the same logits, so its result needs no barrier. Before each barrier a block asks L2 for the
// weight rows it will stream right after it, so HBM latency overlaps the barrier. For short
// contexts (all predictor passes) phase 2 runs inside phase 3 in every block, one barrier less.
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include "mk_attention.cuh"
#include "mk_matvec.cuh"
#include "mk_sample.cuh"
#include "mk_util.cuh"
#include "qwen_mk.h"

namespace cg = cooperative_groups;

struct Params {
    qmk_model m;
    qmk_frame f;
};

template <class T>
__device__ __forceinline__ T* dptr(uint64_t a) {
    return reinterpret_cast<T*>(a);
}

struct Block {
    cg::grid_group grid;
    float* xs;  // vector operand of the current matvec (fp32)
    BlockReducer red;
    float* scan;
    int* codes;  // [16] sampled codes of this frame
    int* fed;    // [16] codes fed back (sampled, or forced when teacher forcing)
    unsigned char* local;   // attention_local scratch
    const qmk_layer* tl;    // layer tables copied to shared memory at launch
    const qmk_layer* pl;
    long long* trace;

    // Grid barrier; with tracing on, block 0 stamps when it leaves it (counter in smem, so the
    // trace costs no registers).
    __device__ __forceinline__ void sync(int phase) {
        grid.sync();
        if (trace != nullptr && blockIdx.x == 0 && threadIdx.x == 0) {
            int* stamps = fed + 16;
            if (*stamps < QMK_TRACE_MAX) {
                long long gt;
                asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(gt));
                trace[3 * *stamps] = clock64();
                trace[3 * *stamps + 1] = gt;
                trace[3 * *stamps + 2] = phase;
                ++*stamps;
            }
        }
    }
};

// Phase ids in the trace (predictor phases add 16).
enum { PH_QKV = 0, PH_ATTN, PH_O, PH_MLP, PH_DOWN, PH_HEAD, PH_PROJ, PH_SAMPLE, PH_START };

struct LayerPtrs {
    const bf16 *input_norm, *q, *k, *v, *q_norm, *k_norm, *o, *post_norm, *gate, *up, *down;
};

// From the shared-memory copy: a global read here would put a dependent round trip in front of
// every phase.
__device__ __forceinline__ LayerPtrs layer_ptrs(const qmk_layer* table, int l) {
    const qmk_layer& L = table[l];
    return {dptr<const bf16>(L.input_norm), dptr<const bf16>(L.q),      dptr<const bf16>(L.k),
            dptr<const bf16>(L.v),          dptr<const bf16>(L.q_norm), dptr<const bf16>(L.k_norm),
            dptr<const bf16>(L.o),          dptr<const bf16>(L.post_norm), dptr<const bf16>(L.gate),
            dptr<const bf16>(L.up),         dptr<const bf16>(L.down)};
}

// Row pairs of the fused q|k|v output; pairs never straddle a matrix (boundaries are multiples
// of 128).
struct QkvRows {
    const bf16 *q, *k, *v;
    int nq, nk, D;
    __device__ void operator()(int u, const bf16** w) const {
        const int r = 2 * u;
        const bf16* p;
        if (r < nq) p = q + (size_t)r * D;
        else if (r < nq + nk) p = k + (size_t)(r - nq) * D;
        else p = v + (size_t)(r - nq - nk) * D;
        w[0] = p;
        w[1] = p + D;
    }
};

struct PairRows {  // row u of two matrices (gate/up)
    const bf16 *a, *b;
    int K;
    __device__ void operator()(int u, const bf16** w) const {
        w[0] = a + (size_t)u * K;
        w[1] = b + (size_t)u * K;
    }
};

struct AdjacentRows {  // rows 2u, 2u+1 of one matrix (heads)
    const bf16* a;
    int K;
    __device__ void operator()(int u, const bf16** w) const {
        w[0] = a + (size_t)(2 * u) * K;
        w[1] = w[0] + K;
    }
};

struct SingleRows {
    const bf16* a;
    int K;
    __device__ void operator()(int u, const bf16** w) const { w[0] = a + (size_t)u * K; }
};

__device__ void run_layer(const qmk_model& m, const qmk_stack& S, const qmk_layer* table, int l, const bf16* x_in,
                          int pos, Block& b, int ph) {
    const LayerPtrs L = layer_ptrs(table, l);
    const int D = S.hidden, I = S.inter, H = S.num_heads, KV = S.num_kv_heads;
    const int nq = H * QMK_HD, nk = KV * QMK_HD;
    bf16* resid = dptr<bf16>(m.resid);
    bf16* qkv = dptr<bf16>(m.qkv);
    bf16* attn = dptr<bf16>(m.attn);
    bf16* act = dptr<bf16>(m.act);
    const QkvRows qkv_rows{L.q, L.k, L.v, nq, nk, D};
    const SingleRows o_rows{L.o, nq};
    const PairRows gu_rows{L.gate, L.up, D};
    const SingleRows down_rows{L.down, I};
    const bool local = attn_is_local(pos);
    const size_t cache_off = (size_t)l * KV * S.max_pos * QMK_HD;
    const AttnArgs a{qkv,
                     attn,
                     dptr<bf16>(S.k_cache) + cache_off,
                     dptr<bf16>(S.v_cache) + cache_off,
                     L.q_norm,
                     L.k_norm,
                     dptr<const bf16>(S.rope),
                     dptr<float>(m.attn_part),
                     dptr<unsigned>(m.attn_count),
                     pos,
                     H,
                     KV,
                     S.max_pos,
                     S.eps};

    // 1. norm + qkv
    rms_norm_to_smem(x_in, L.input_norm, D, S.eps, b.xs, b.red);
    matvec<2>((nq + 2 * nk) / 2, D, b.xs, qkv_rows, [&](int u, const float* acc) {
        st_bf16(qkv + 2 * u, acc[0]);
        st_bf16(qkv + 2 * u + 1, acc[1]);
    });
    prefetch_rows<1>(D, nq, o_rows);
    b.sync(ph + PH_QKV);

    // 2. attention over position chunks (long contexts); idle blocks warm L2 with MLP rows.
    if (!local) {
        if ((int)blockIdx.x >= attn_items(pos, KV)) {
            prefetch_rows<2>(I, D, gu_rows);
            prefetch_rows<1>(D, I, down_rows);
        }
        attention_phase(a, b.xs);
        b.sync(ph + PH_ATTN);
    }

    // 3. (short contexts: attention in every block) + o_proj + residual
    if (local) attention_local(a, b.xs, b.local);
    else load_to_smem(attn, nq, b.xs);
    matvec<1>(D, nq, b.xs, o_rows, [&](int u, const float* acc) {
        st_bf16(resid + u, ld_act(x_in + u) + bf16_round(acc[0]));
    });
    prefetch_rows<2>(I, D, gu_rows);
    b.sync(ph + PH_O);

    // 4. norm + gate/up + SiLU * up
    rms_norm_to_smem(resid, L.post_norm, D, S.eps, b.xs, b.red);
    matvec<2>(I, D, b.xs, gu_rows, [&](int u, const float* acc) {
        const float g = bf16_round(acc[0]), up = bf16_round(acc[1]);
        const float s = bf16_round(g / (1.f + expf(-g)));
        st_bf16(act + u, s * up);
    });
    prefetch_rows<1>(D, I, down_rows);
    b.sync(ph + PH_MLP);

    // 5. down_proj + residual
    load_to_smem(act, I, b.xs);
    matvec<1>(D, I, b.xs, down_rows, [&](int u, const float* acc) {
        st_bf16(resid + u, ld_act(resid + u) + bf16_round(acc[0]));
    });
    if (l + 1 < S.num_layers) {
        const LayerPtrs N = layer_ptrs(table, l + 1);
        prefetch_rows<2>((nq + 2 * nk) / 2, D, QkvRows{N.q, N.k, N.v, nq, nk, D});
    }
    b.sync(ph + PH_DOWN);
}

__device__ void run_stack(const qmk_model& m, const qmk_stack& S, const qmk_layer* table, const bf16* x_in, int pos,
                          Block& b, int ph) {
    for (int l = 0; l < S.num_layers; ++l)
        run_layer(m, S, table, l, l == 0 ? x_in : dptr<const bf16>(m.resid), pos, b, ph);
}

// Final norm of the stack's residual into smem (block 0 also stores it), then rows of `head`
// into fp32 logits (bf16-rounded, as the torch head returns bf16). Ends with a grid barrier.
__device__ void run_head(const qmk_stack& S, const bf16* src, bool normalize, const bf16* head, int rows,
                         float* logits, bf16* hidden_out, Block& b, int ph) {
    const int D = S.hidden;
    if (normalize) rms_norm_to_smem(src, dptr<const bf16>(S.final_norm), D, S.eps, b.xs, b.red);
    else load_to_smem(src, D, b.xs);
    if (blockIdx.x == 0 && hidden_out != nullptr)
        for (int i = threadIdx.x; i < D; i += QMK_THREADS) st_bf16(hidden_out + i, b.xs[i]);
    matvec<2>(rows / 2, D, b.xs, AdjacentRows{head, D}, [&](int u, const float* acc) {
        logits[2 * u] = bf16_round(acc[0]);
        logits[2 * u + 1] = bf16_round(acc[1]);
    });
    b.sync(ph + PH_HEAD);
}

// Predictor input of position p, in the talker's width (projected when widths differ).
__device__ const bf16* predictor_source(const qmk_model& m, int p, const Block& b) {
    const size_t Dt = m.talker.hidden;
    if (p == 0) return dptr<const bf16>(m.hidden);
    if (p == 1) return dptr<const bf16>(m.talker_emb) + (size_t)b.fed[0] * Dt;
    return dptr<const bf16>(m.pred_emb[p - 2]) + (size_t)b.fed[p - 1] * Dt;
}

__device__ const bf16* project_input(const qmk_model& m, const bf16* src, Block& b) {
    if (m.proj_w == 0) return src;
    const int Dt = m.talker.hidden, Dp = m.pred.hidden;
    const bf16* bias = dptr<const bf16>(m.proj_b);
    bf16* out = dptr<bf16>(m.proj_out);
    load_to_smem(src, Dt, b.xs);
    matvec<1>(Dp, Dt, b.xs, SingleRows{dptr<const bf16>(m.proj_w), Dt}, [&](int u, const float* acc) {
        st_bf16(out + u, acc[0] + ld_weight1(bias + u));
    });
    b.sync(16 + PH_PROJ);
    return out;
}

// Codes out, `seen` update and (for a full frame) the next talker input. Callers guarantee that
// every block has finished reading `seen` for this frame.
__device__ void publish_frame(const qmk_model& m, const qmk_frame& f, bool full, Block& b) {
    const int G = m.num_groups;
    if (blockIdx.x == 0 && threadIdx.x < G)
        dptr<long long>(f.codes_out)[threadIdx.x] = (threadIdx.x == 0 || full) ? b.codes[threadIdx.x] : 0;
    if (blockIdx.x == 0 && threadIdx.x == 0) dptr<uint8_t>(m.seen)[b.fed[0]] = 1;
    if (!full) return;
    // Next talker input: the 16 embeddings summed in order with a bf16 rounding after each add,
    // then the text vector (the torch reference's `total = total + emb` chain).
    const int Dt = m.talker.hidden;
    const int i = blockIdx.x * QMK_THREADS + threadIdx.x;
    if (i < Dt && f.trailing != 0) {
        float acc = ld_act(dptr<const bf16>(m.talker_emb) + (size_t)b.fed[0] * Dt + i);
        for (int g = 1; g < G; ++g)
            acc = bf16_round(acc + ld_act(dptr<const bf16>(m.pred_emb[g - 1]) + (size_t)b.fed[g] * Dt + i));
        st_bf16(dptr<bf16>(m.pending) + i, acc + ld_act(dptr<const bf16>(f.trailing) + i));
    }
}

// Bytes of attention_local's scratch for the wider of the two stacks (a multiple of 16).
__host__ __device__ __forceinline__ int local_bytes(const qmk_model& m) {
    const int a = QMK_LOCAL_SMEM_BYTES(m.talker.num_heads, m.talker.num_kv_heads);
    const int b = QMK_LOCAL_SMEM_BYTES(m.pred.num_heads, m.pred.num_kv_heads);
    return ((a > b ? a : b) + 15) / 16 * 16;
}

// Floats of the largest matvec operand (and of the split-attention scratch, which shares it).
__host__ __device__ __forceinline__ int max_operand(const qmk_model& m) {
    int k = 6144;  // attention_item's scratch (see mk_attention.cuh)
    const qmk_stack* s[2] = {&m.talker, &m.pred};
    for (int i = 0; i < 2; ++i) {
        k = k > s[i]->hidden ? k : s[i]->hidden;
        k = k > s[i]->inter ? k : s[i]->inter;
        k = k > s[i]->num_heads * QMK_HD ? k : s[i]->num_heads * QMK_HD;
    }
    return k;
}

// Shared memory: [128 floats: reducer, scan, codes, fed, stamp counter] [xs: max_operand floats]
// [attention_local scratch] [layer tables].
__host__ __device__ __forceinline__ int frame_smem_bytes(const qmk_model& m) {
    return (128 + max_operand(m)) * 4 + local_bytes(m) + (m.talker.num_layers + m.pred.num_layers) * (int)sizeof(qmk_layer);
}

__global__ void __launch_bounds__(QMK_THREADS, 1) qmk_frame_kernel(const __grid_constant__ Params P) {
    extern __shared__ float4 smem4[];
    float* smem = reinterpret_cast<float*>(smem4);
    const qmk_model& m = P.m;
    const qmk_frame& f = P.f;
    unsigned char* local = reinterpret_cast<unsigned char*>(smem + 128 + max_operand(m));
    qmk_layer* tables = reinterpret_cast<qmk_layer*>(local + local_bytes(m));
    Block b{cg::this_grid(),
            smem + 128,
            BlockReducer{smem, 0},
            smem + 2 * QMK_WARPS,
            reinterpret_cast<int*>(smem + 3 * QMK_WARPS),
            reinterpret_cast<int*>(smem + 3 * QMK_WARPS + 16),
            local,
            tables,
            tables + m.talker.num_layers,
            dptr<long long>(f.trace)};
    {
        const int nt = m.talker.num_layers * (int)(sizeof(qmk_layer) / 8);
        const int np = m.pred.num_layers * (int)(sizeof(qmk_layer) / 8);
        uint64_t* dst = reinterpret_cast<uint64_t*>(tables);
        for (int i = threadIdx.x; i < nt + np; i += QMK_THREADS)
            dst[i] = i < nt ? dptr<const uint64_t>(m.talker.layers)[i] : dptr<const uint64_t>(m.pred.layers)[i - nt];
        if (threadIdx.x == 0) b.fed[16] = 0;  // trace stamp counter
        __syncthreads();
    }
    if (b.trace != nullptr) b.sync(PH_START);
    const int G = m.num_groups;
    const long long* force = dptr<const long long>(f.force_codes);

    // Talker step + codec head.
    if (f.run_talker) {
        run_stack(m, m.talker, b.tl, dptr<const bf16>(m.pending), f.pos, b, 0);
        run_head(m.talker, dptr<const bf16>(m.resid), true, dptr<const bf16>(m.codec_head), m.vocab,
                 dptr<float>(m.logits), dptr<bf16>(m.hidden), b, 0);
    } else {
        run_head(m.talker, dptr<const bf16>(m.hidden), false, dptr<const bf16>(m.codec_head), m.vocab,
                 dptr<float>(m.logits), nullptr, b, 0);
    }
    const TalkerRules rules{dptr<const uint8_t>(m.seen), f.rep_penalty, f.frame < f.min_new_tokens, m.eos_id,
                            f.suppress_start};
    const int c0 = sample_block<true>(dptr<const float>(m.logits), m.vocab, f.talker_s, rules,
                                      uniform01(f.seed, (uint32_t)f.frame, 0), b.red, b.scan);
    if (threadIdx.x == 0) {
        b.codes[0] = c0;
        b.fed[0] = force ? (int)force[0] : c0;
    }
    __syncthreads();
    const bool eos = b.fed[0] == m.eos_id;
    if (eos || !f.run_predictor) {
        // No barrier follows sampling on this path: wait for every block to finish reading
        // `seen` before block 0 updates it.
        b.sync(PH_SAMPLE);
        publish_frame(m, f, false, b);
        return;
    }

    // 15 code-predictor steps (positions 0..15; position 0 is the talker hidden, no head).
    const qmk_stack& S = m.pred;
    for (int p = 0; p < G; ++p) {
        const bf16* x = project_input(m, predictor_source(m, p, b), b);
        run_stack(m, S, b.pl, x, p, b, 16);
        if (p == 0) continue;
        float* lg = dptr<float>(m.pred_logits) + (size_t)(p - 1) * m.pred_vocab;
        run_head(S, dptr<const bf16>(m.resid), true, dptr<const bf16>(m.lm_head[p - 1]), m.pred_vocab, lg,
                 dptr<bf16>(m.pred_hidden) + (size_t)p * S.hidden, b, 16);
        const int c = sample_block<false>(lg, m.pred_vocab, f.pred_s, rules, uniform01(f.seed, (uint32_t)f.frame, p),
                                          b.red, b.scan);
        if (threadIdx.x == 0) {
            b.codes[p] = c;
            b.fed[p] = force ? (int)force[p] : c;
        }
        __syncthreads();
    }
    publish_frame(m, f, true, b);
}

// ---------------------------------------------------------------------------------------------
// Host side

extern "C" int qmk_abi_version(void) { return QMK_ABI_VERSION; }

extern "C" void qmk_struct_sizes(int32_t* out) {
    out[0] = (int32_t)sizeof(qmk_layer);
    out[1] = (int32_t)sizeof(qmk_stack);
    out[2] = (int32_t)sizeof(qmk_model);
    out[3] = (int32_t)sizeof(qmk_frame);
}

extern "C" int64_t qmk_attn_part_floats(int32_t max_pos, int32_t kv_heads) {
    const int64_t chunks = (max_pos + QMK_MIN_CHUNK - 1) / QMK_MIN_CHUNK;
    return chunks * kv_heads * 2 * QMK_PART;
}

extern "C" int qmk_grid_size(const qmk_model* m, int32_t* blocks, int32_t* smem_bytes) {
    int dev = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e != cudaSuccess) return e;
    // The answer depends only on the device and the shared-memory size: remember the last one so
    // a launch costs no attribute and occupancy queries.
    static thread_local int last_dev = -1, last_smem = -1, last_blocks = 0;
    if (dev == last_dev && frame_smem_bytes(*m) == last_smem) {
        *blocks = last_blocks;
        *smem_bytes = last_smem;
        return cudaSuccess;
    }
    int coop = 0, sms = 0;
    if ((e = cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, dev)) != cudaSuccess) return e;
    if (!coop) return cudaErrorNotSupported;
    if ((e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev)) != cudaSuccess) return e;
    const int smem = frame_smem_bytes(*m);
    if (smem > 48 * 1024) {
        e = cudaFuncSetAttribute(qmk_frame_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
        if (e != cudaSuccess) return e;
    }
    // The kernel waits on grid barriers, so every block must be resident at once: size the grid
    // from the occupancy the driver reports, never more.
    int per_sm = 0;
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, qmk_frame_kernel, QMK_THREADS, smem);
    if (e != cudaSuccess) return e;
    if (per_sm < 1) return cudaErrorCooperativeLaunchTooLarge;
    *blocks = sms;  // one block per SM: more would only split the same bandwidth
    *smem_bytes = smem;
    last_dev = dev;
    last_smem = smem;
    last_blocks = sms;
    return cudaSuccess;
}

extern "C" int qmk_decode_frame(const qmk_model* m, const qmk_frame* f, uint64_t stream) {
    int32_t blocks = 0, smem = 0;
    int e = qmk_grid_size(m, &blocks, &smem);
    if (e != cudaSuccess) return e;
    Params p;
    p.m = *m;
    p.f = *f;
    void* args[] = {&p};
    return cudaLaunchCooperativeKernel((const void*)qmk_frame_kernel, dim3(blocks), dim3(QMK_THREADS), args,
                                       (size_t)smem, reinterpret_cast<cudaStream_t>(stream));
}

extern "C" const char* qmk_error_string(int code) { return cudaGetErrorString((cudaError_t)code); }
