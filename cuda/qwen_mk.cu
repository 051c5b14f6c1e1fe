// Qwen3-TTS frame megakernel: one cooperative launch per 80 ms frame, fp32 arithmetic on bf16
// weights.
//
// The frame is a fixed list of phases (the Program), each ended by a grid barrier:
//   talker layer: q/k/v | attention | o_proj + residual | gate/up + SiLU | down + residual
//   codec head, code-0 sampling (every block, redundantly: no barrier)
//   15 predictor passes: [2048->1024 projection] 5 layers as above, LM head, sampling
// Each block owns a contiguous slice of every matrix's rows. Because the list is known at launch,
// a block streams its slices (and the K/V rows its attention items read) into a ring of
// shared-memory slots ahead of time (mk_stream.cuh); a phase then costs the barrier, one L2 read
// of its input vector and a matvec from shared memory.
#include <cuda_runtime.h>

// Shared-memory layout (bytes): fixed offsets, so scratch addresses are immediates. Literals here
// because the headers below use them; checked against the headers' sizes after the includes.
#define QMK_MAX_LAYERS 48  // talker + predictor layers
#define QMK_OWN_MAX 256    // residual rows one block may own (hidden / blocks)
#define QMK_SMEM_RING 0                               // RingState (mbarriers, producer cursor)
#define QMK_SMEM_RED (QMK_SMEM_RING + 512)            // float [2][16 rows][4] row partials
#define QMK_SMEM_NSCR (QMK_SMEM_RED + 512)            // float [8] RMSNorm partials
#define QMK_SMEM_SRED (QMK_SMEM_NSCR + 32)            // float [2][16] sampling reductions
#define QMK_SMEM_SCAN (QMK_SMEM_SRED + 128)           // float [16] sampling scan
#define QMK_SMEM_CODES (QMK_SMEM_SCAN + 64)           // int [16] sampled codes
#define QMK_SMEM_FED (QMK_SMEM_CODES + 64)            // int [16] codes fed back
#define QMK_SMEM_STAMPS (QMK_SMEM_FED + 64)           // int [4] trace stamp counter
#define QMK_SMEM_OWN (QMK_SMEM_STAMPS + 16)           // float [QMK_OWN_MAX] owned residual rows
#define QMK_SMEM_ATTN (QMK_SMEM_OWN + 4 * QMK_OWN_MAX)  // float [1120] attention scratch
#define QMK_SMEM_TABLES (QMK_SMEM_ATTN + 4 * 1120)    // qmk_layer [QMK_MAX_LAYERS]
#define QMK_SMEM_SLOTS ((QMK_SMEM_TABLES + 88 * QMK_MAX_LAYERS + 127) / 128 * 128)

#include "mk_attention.cuh"
#include "mk_matvec.cuh"
#include "mk_sample.cuh"
#include "mk_stream.cuh"
#include "mk_util.cuh"
#include "qwen_mk.h"

static_assert(sizeof(RingState) <= 512, "ring state");
static_assert(2 * QMK_TILE_ROWS * 4 * 4 <= 512, "row partials");
static_assert(QMK_ATTN_SMEM_FLOATS <= 1120, "attention scratch");
static_assert(sizeof(qmk_layer) == 88, "layer table entry");

template <class T>
__device__ __forceinline__ T* sm(int off) {
    return reinterpret_cast<T*>(qmk_smem + off);
}

struct Params {
    qmk_model m;
    qmk_frame f;
    int nslot;
};

template <class T>
__device__ __forceinline__ T* dptr(uint64_t a) {
    return reinterpret_cast<T*>(a);
}

__device__ __forceinline__ const bf16* bfp(uint64_t a) { return reinterpret_cast<const bf16*>(a); }

enum Kind { K_QKV = 0, K_ATTN, K_O, K_GU, K_DOWN, K_HEAD_T, K_PROJ, K_HEAD_P };

// Phase ids in the trace (predictor phases add 16).
enum { PH_QKV = 0, PH_ATTN, PH_O, PH_MLP, PH_DOWN, PH_HEAD, PH_PROJ, PH_SAMPLE, PH_START };

struct Phase {
    int kind, layer, pass;  // pass: predictor position, -1 for the talker
};

// The frame's phases in the order the consumer runs them; the producer walks the same list.
struct Program {
    int talker_phases;  // 5 per talker layer, 0 on frame 0
    int pass_len;       // [projection] + 5 per predictor layer
    int passes;         // predictor passes (0: talker only)
    int has_proj;

    __device__ int length() const { return talker_phases + 1 + (passes ? passes * pass_len + passes - 1 : 0); }

    __device__ Phase in_pass(int r, int p) const {
        if (has_proj) {
            if (r == 0) return {K_PROJ, 0, p};
            --r;
        }
        return {r % 5, r / 5, p};
    }

    __device__ Phase at(int i) const {
        if (i < talker_phases) return {i % 5, i / 5, -1};
        i -= talker_phases;
        if (i == 0) return {K_HEAD_T, 0, -1};
        i -= 1;
        if (i < pass_len) return in_pass(i, 0);  // pass 0 (the talker hidden) has no head
        i -= pass_len;
        const int p = 1 + i / (pass_len + 1), r = i % (pass_len + 1);
        return r == pass_len ? Phase{K_HEAD_P, 0, p} : in_pass(r, p);
    }
};

// Read-only view of the launch shared by the producer and the consumer (one pointer: everything
// else is recomputed or read from the parameter space and the shared layer tables).
struct Frame {
    const Params* P;

    __device__ const qmk_model& m() const { return P->m; }
    __device__ const qmk_frame& f() const { return P->f; }
    __device__ Program prog() const {
        const int has_proj = P->m.proj_w != 0;
        return {P->f.run_talker ? 5 * P->m.talker.num_layers : 0, has_proj + 5 * P->m.pred.num_layers,
                P->f.run_predictor ? P->m.num_groups : 0, has_proj};
    }
    __device__ const qmk_stack& stack(const Phase& ph) const { return ph.pass < 0 ? P->m.talker : P->m.pred; }
    __device__ const qmk_layer& layer(const Phase& ph) const {
        return sm<const qmk_layer>(QMK_SMEM_TABLES)[(ph.pass < 0 ? 0 : P->m.talker.num_layers) + ph.layer];
    }
    __device__ int attn_pos(const Phase& ph) const { return ph.pass < 0 ? P->f.pos : ph.pass; }
};

// ---------------------------------------------------------------------------------------------
// Which bytes each block streams for each phase

// A matrix phase: N output units (rows; gate/up row pairs for K_GU) of K bf16 columns. Block b
// owns units [u0, u1), taken per_tile at a time.
struct Mat {
    int N, K, unit_bytes, per_tile, u0, u1;
    __device__ int tiles() const { return (u1 - u0 + per_tile - 1) / per_tile; }
};

__device__ Mat mat_of(const Frame& F, const Phase& ph) {
    const qmk_model& m = F.m();
    const qmk_stack& S = F.stack(ph);
    int N, K, rows_per_unit = 1;
    switch (ph.kind) {
        case K_QKV: N = (S.num_heads + 2 * S.num_kv_heads) * QMK_HD, K = S.hidden; break;
        case K_O: N = S.hidden, K = S.num_heads * QMK_HD; break;
        case K_GU: N = S.inter, K = S.hidden, rows_per_unit = 2; break;
        case K_DOWN: N = S.hidden, K = S.inter; break;
        case K_HEAD_T: N = m.vocab, K = m.talker.hidden; break;
        case K_PROJ: N = m.pred.hidden, K = m.talker.hidden; break;
        default: N = m.pred_vocab, K = m.pred.hidden; break;  // K_HEAD_P
    }
    const int ub = 2 * K * rows_per_unit;
    const int B = gridDim.x, b = blockIdx.x;
    return {N, K, ub, QMK_SLOT_BYTES / ub, (int)((long long)N * b / B), (int)((long long)N * (b + 1) / B)};
}

__device__ __forceinline__ Range rows_of(uint64_t base, int row, int rows, int K) {
    const size_t rb = (size_t)K * 2;
    return {reinterpret_cast<const unsigned char*>(base) + row * rb, (uint32_t)(rows * rb)};
}

__device__ Tile mat_tile(const Frame& F, const Phase& ph, const Mat& mt, int t) {
    const int a = mt.u0 + t * mt.per_tile, n = min(mt.per_tile, mt.u1 - a);
    Tile tl{{{nullptr, 0u}, {nullptr, 0u}}};
    const qmk_model& m = F.m();
    switch (ph.kind) {
        case K_QKV: {
            // Rows of the virtual q|k|v matrix; a tile (<= 16 rows) crosses at most one boundary.
            const qmk_layer& L = F.layer(ph);
            const qmk_stack& S = F.stack(ph);
            const int nq = S.num_heads * QMK_HD, nk = S.num_kv_heads * QMK_HD, end = a + n;
            int r = a, k = 0;
            while (r < end && k < 2) {
                uint64_t base;
                int off, lim;
                if (r < nq) base = L.q, off = r, lim = nq;
                else if (r < nq + nk) base = L.k, off = r - nq, lim = nq + nk;
                else base = L.v, off = r - nq - nk, lim = end;
                const int cnt = min(end, lim) - r;
                tl.r[k++] = rows_of(base, off, cnt, mt.K);
                r += cnt;
            }
            break;
        }
        case K_GU: {
            const qmk_layer& L = F.layer(ph);
            tl.r[0] = rows_of(L.gate, a, n, mt.K);
            tl.r[1] = rows_of(L.up, a, n, mt.K);
            break;
        }
        case K_O: tl.r[0] = rows_of(F.layer(ph).o, a, n, mt.K); break;
        case K_DOWN: tl.r[0] = rows_of(F.layer(ph).down, a, n, mt.K); break;
        case K_HEAD_T: tl.r[0] = rows_of(m.codec_head, a, n, mt.K); break;
        case K_PROJ: tl.r[0] = rows_of(m.proj_w, a, n, mt.K); break;
        default: tl.r[0] = rows_of(m.lm_head[ph.pass - 1], a, n, mt.K); break;
    }
    return tl;
}

// Attention items (kv head, chunk) are dealt to blocks round-robin; an item whose chunk holds
// cached positions streams their K and V rows as one tile.
struct AttnItems {
    int pos, nchunk, items;
    __device__ bool has_tile(int it) const { return (it % nchunk) * QMK_CHUNK < pos; }
    __device__ int tiles_of_block() const {
        int n = 0;
        for (int it = blockIdx.x; it < items; it += gridDim.x) n += has_tile(it);
        return n;
    }
};

__device__ AttnItems attn_items(const Frame& F, const Phase& ph) {
    const int pos = F.attn_pos(ph), nchunk = attn_nchunk(pos);
    return {pos, nchunk, F.stack(ph).num_kv_heads * nchunk};
}

__device__ int attn_tiles(const Frame& F, const Phase& ph) { return attn_items(F, ph).tiles_of_block(); }

__device__ Tile attn_tile(const Frame& F, const Phase& ph, int t) {
    const AttnItems A = attn_items(F, ph);
    const qmk_stack& S = F.stack(ph);
    int it = blockIdx.x;
    for (;; it += gridDim.x)
        if (A.has_tile(it) && t-- == 0) break;
    const int g = it / A.nchunk, j0 = (it % A.nchunk) * QMK_CHUNK, j1 = min(j0 + QMK_CHUNK, A.pos);
    const size_t row = (((size_t)ph.layer * S.num_kv_heads + g) * S.max_pos + j0) * QMK_HD;
    const uint32_t bytes = (uint32_t)(j1 - j0) * QMK_HD * 4;
    return {{{dptr<const float>(S.k_cache) + row, bytes}, {dptr<const float>(S.v_cache) + row, bytes}}};
}

__device__ int phase_tiles(const Frame& F, int i) {
    const Phase ph = F.prog().at(i);
    return ph.kind == K_ATTN ? attn_tiles(F, ph) : mat_of(F, ph).tiles();
}

__device__ Tile phase_tile(const Frame& F, int i, int t) {
    const Phase ph = F.prog().at(i);
    return ph.kind == K_ATTN ? attn_tile(F, ph, t) : mat_tile(F, ph, mat_of(F, ph), t);
}

// Thread 0 only, out of line (its state never occupies the consumers' registers): issue tiles
// until `nslot` are in flight beyond `consumed` or the program ends.
__device__ __noinline__ void produce(const Params* P, uint32_t consumed) {
    const Frame F{P};
    RingState& rs = ring_state();
    const int len = F.prog().length();
    while (rs.issued < consumed + (uint32_t)P->nslot) {
        while (rs.tile >= rs.ntiles) {
            if (rs.phase + 1 >= len) return;
            ++rs.phase;
            rs.tile = 0;
            rs.ntiles = phase_tiles(F, rs.phase);
        }
        issue_tile(phase_tile(F, rs.phase, rs.tile++), rs.issued++, P->nslot);
    }
}

// ---------------------------------------------------------------------------------------------
// Consumer

struct Ctx {
    Frame F;
    Ring ring;
    int red_parity;  // row partials alternate between two buffers, tile by tile

    // Done with the current tile (every thread, after a __syncthreads since its last read).
    __device__ void release() { ++ring.consumed; }

    // A phase with more tiles than slots (the 1.7B's MLP, long contexts' attention) must refill
    // between its own tiles. Then the producer has issued exactly this phase's tiles up to
    // `next - 1`, so its next tile is `next` of this phase: issue it from the caller's geometry
    // (inline: a call here would make every thread save its registers around it).
    __device__ void refill_within(const Tile& t) {
        if (threadIdx.x == 0) {
            RingState& rs = ring_state();
            issue_tile(t, rs.issued++, ring.nslot);
            ++rs.tile;
        }
        ring.after_produce();
    }

    // Grid barrier. Thread 0 arrives, issues the copies for the slots this phase freed, then
    // waits: the producer's work hides in the barrier. With tracing on, block 0 stamps when it
    // leaves.
    __device__ void sync(int phase) {
        __syncthreads();
        if (threadIdx.x == 0) {
            unsigned* counter = dptr<unsigned>(F.m().barrier);
            const unsigned arrived = grid_arrive(counter);
            produce(F.P, ring.consumed);
            grid_wait(counter, arrived);
            long long* trace = dptr<long long>(F.f().trace);
            int* stamps = sm<int>(QMK_SMEM_STAMPS);
            if (trace != nullptr && blockIdx.x == 0 && *stamps < QMK_TRACE_MAX) {
                long long gt;
                asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(gt));
                trace[3 * *stamps] = clock64();
                trace[3 * *stamps + 1] = gt;
                trace[3 * *stamps + 2] = phase;
                ++*stamps;
            }
        }
        ring.after_produce();  // sm_80: every thread copies its share (has its own barriers)
        __syncthreads();
    }
};

__device__ __forceinline__ float* norm_scratch() { return sm<float>(QMK_SMEM_NSCR); }
__device__ __forceinline__ int* codes() { return sm<int>(QMK_SMEM_CODES); }
__device__ __forceinline__ int* fed() { return sm<int>(QMK_SMEM_FED); }

// One matrix phase: for each of the block's tiles, dot products from shared memory, then
// `epi(unit, index in tile, units in tile, partials)` on threads [0, units).
template <int MS, class Epi>
__device__ void run_mat(Ctx& c, const Phase& ph, const Operand<MS>& x, Epi epi) {
    const Mat mt = mat_of(c.F, ph);
    const int rows_per_unit = ph.kind == K_GU ? 2 : 1;
    const int nt = mt.tiles();
    for (int t = 0; t < nt; ++t) {
        const int a = mt.u0 + t * mt.per_tile, n = min(mt.per_tile, mt.u1 - a);
        const unsigned char* tile = c.ring.wait();
        c.red_parity ^= 1;
        float* red = sm<float>(QMK_SMEM_RED) + c.red_parity * QMK_TILE_ROWS * 4;
        tile_dots<MS>(tile, n * rows_per_unit, mt.K, x, red);
        if ((int)threadIdx.x < n) epi(a + (int)threadIdx.x, (int)threadIdx.x, n, red);
        c.release();
        if (t + c.ring.nslot < nt) c.refill_within(mat_tile(c.F, ph, mt, t + c.ring.nslot));
    }
}

__device__ void run_attention(Ctx& c, const Phase& ph) {
    const qmk_model& m = c.F.m();
    const qmk_stack& S = c.F.stack(ph);
    const qmk_layer& L = c.F.layer(ph);
    const AttnItems A = attn_items(c.F, ph);
    const size_t off = (size_t)ph.layer * S.num_kv_heads * S.max_pos * QMK_HD;
    const AttnArgs a{dptr<const float>(m.qkv), dptr<float>(m.attn),   dptr<float>(S.k_cache) + off,
                     dptr<float>(S.v_cache) + off, bfp(L.q_norm), bfp(L.k_norm), dptr<const float>(S.rope),
                     dptr<float>(m.attn_part), dptr<unsigned>(m.attn_count), A.pos, S.num_heads,
                     S.num_kv_heads, S.max_pos, S.eps};
    int k = 0;  // tiles consumed in this phase
    for (int it = blockIdx.x; it < A.items; it += gridDim.x) {
        const bool has = A.has_tile(it);
        const float* tile = has ? reinterpret_cast<const float*>(c.ring.wait()) : nullptr;
        attention_item(a, it / A.nchunk, it % A.nchunk, A.nchunk, tile, sm<float>(QMK_SMEM_ATTN));
        __syncthreads();
        if (has) {
            c.release();
            if (++k + c.ring.nslot <= A.tiles_of_block()) c.refill_within(attn_tile(c.F, ph, k + c.ring.nslot - 1));
        }
    }
}

// A stack of layers at one position; `src` is the stack's input (the residual stream's start).
__device__ void run_stack(Ctx& c, int pass, VecRef src) {
    const qmk_model& m = c.F.m();
    const Phase probe{K_QKV, 0, pass};
    const qmk_stack& S = c.F.stack(probe);
    const int D = S.hidden, I = S.inter, nq = S.num_heads * QMK_HD, tid = threadIdx.x;
    const int ph0 = pass < 0 ? 0 : 16;
    float* resid = dptr<float>(m.resid);
    float* qkv = dptr<float>(m.qkv);
    float* act = dptr<float>(m.act);
    float* own = sm<float>(QMK_SMEM_OWN);
    // The o_proj and down phases both have D output rows, so a block owns the same residual rows
    // in both and keeps them in shared memory between the two.
    const int r0 = (int)((long long)D * blockIdx.x / gridDim.x);
    for (int i = tid; i < (int)((long long)D * (blockIdx.x + 1) / gridDim.x) - r0; i += QMK_THREADS)
        own[i] = src.is_bf16 ? ld_weight1(static_cast<const bf16*>(src.p) + r0 + i)
                             : ld_act(static_cast<const float*>(src.p) + r0 + i);
    for (int l = 0; l < S.num_layers; ++l) {
        const Phase pq{K_QKV, l, pass}, pa{K_ATTN, l, pass}, po{K_O, l, pass}, pg{K_GU, l, pass},
            pd{K_DOWN, l, pass};
        const qmk_layer& L = c.F.layer(pq);
        {
            Operand<2> x;
            load_normed<2>(l == 0 ? src : VecRef{resid, 0}, bfp(L.input_norm), D, S.eps, x, norm_scratch());
            run_mat<2>(c, pq, x, [&](int u, int i, int, const float* red) { qkv[u] = row_sum(red, i); });
        }
        c.sync(ph0 + PH_QKV);
        run_attention(c, pa);
        c.sync(ph0 + PH_ATTN);
        {
            Operand<2> x;
            load_operand<2>(VecRef{dptr<const float>(m.attn), 0}, nq, x);
            run_mat<2>(c, po, x, [&](int u, int i, int, const float* red) {
                const float v = own[u - r0] + row_sum(red, i);
                own[u - r0] = v;
                resid[u] = v;
            });
        }
        c.sync(ph0 + PH_O);
        {
            Operand<2> x;
            load_normed<2>(VecRef{resid, 0}, bfp(L.post_norm), D, S.eps, x, norm_scratch());
            run_mat<2>(c, pg, x, [&](int u, int i, int n, const float* red) {
                const float g = row_sum(red, i), up = row_sum(red, n + i);
                act[u] = (g / (1.f + expf(-g))) * up;
            });
        }
        c.sync(ph0 + PH_MLP);
        {
            Operand<6> x;
            load_operand<6>(VecRef{act, 0}, I, x);
            run_mat<6>(c, pd, x, [&](int u, int i, int, const float* red) {
                const float v = own[u - r0] + row_sum(red, i);
                own[u - r0] = v;
                resid[u] = v;
            });
        }
        c.sync(ph0 + PH_DOWN);
    }
}

// Codes out, `seen` update and (for a full frame) the next talker input. Callers guarantee that
// every block has finished reading `seen` for this frame.
__device__ void publish_frame(const qmk_model& m, const qmk_frame& f, bool full) {
    const int G = m.num_groups;
    if (blockIdx.x == 0 && (int)threadIdx.x < G)
        dptr<long long>(f.codes_out)[threadIdx.x] = (threadIdx.x == 0 || full) ? codes()[threadIdx.x] : 0;
    if (blockIdx.x == 0 && threadIdx.x == 0) dptr<uint8_t>(m.seen)[fed()[0]] = 1;
    if (!full) return;
    // Next talker input: the 16 embeddings summed in order, then the text vector (fp32, the
    // reference's `total = total + emb` chain).
    const int Dt = m.talker.hidden;
    const int i = blockIdx.x * QMK_THREADS + threadIdx.x;
    if (i < Dt && f.trailing != 0) {
        float acc = ld_weight1(bfp(m.talker_emb) + (size_t)fed()[0] * Dt + i);
        for (int g = 1; g < G; ++g) acc = acc + ld_weight1(bfp(m.pred_emb[g - 1]) + (size_t)fed()[g] * Dt + i);
        dptr<float>(m.pending)[i] = acc + ld_weight1(bfp(f.trailing) + i);
    }
}

__host__ __device__ __forceinline__ int smem_bytes(int nslot) { return QMK_SMEM_SLOTS + nslot * QMK_SLOT_BYTES; }

__global__ void __launch_bounds__(QMK_THREADS, 1) qmk_frame_kernel(const __grid_constant__ Params P) {
    const qmk_model& m = P.m;
    const qmk_frame& f = P.f;
    const int tid = threadIdx.x;
    {
        const int nt = m.talker.num_layers * (int)(sizeof(qmk_layer) / 8);
        const int np = m.pred.num_layers * (int)(sizeof(qmk_layer) / 8);
        uint64_t* dst = sm<uint64_t>(QMK_SMEM_TABLES);
        for (int i = tid; i < nt + np; i += QMK_THREADS)
            dst[i] = i < nt ? dptr<const uint64_t>(m.talker.layers)[i] : dptr<const uint64_t>(m.pred.layers)[i - nt];
        if (tid == 0) *sm<int>(QMK_SMEM_STAMPS) = 0;
    }
    Ctx c;
    c.F = Frame{&P};
    c.red_parity = 0;
    if (tid == 0) {
        RingState& rs = ring_state();
        rs.phase = -1;
        rs.tile = rs.ntiles = 0;
    }
    c.ring.nslot = P.nslot;
    c.ring.init();  // ends with __syncthreads: the tables are in place for the producer
    if (tid == 0) produce(&P, 0);
    c.ring.after_produce();
    if (f.trace != 0) c.sync(PH_START);
    const int has_proj = m.proj_w != 0;

    const int G = m.num_groups, Dt = m.talker.hidden, Dp = m.pred.hidden;
    const long long* force = dptr<const long long>(f.force_codes);

    // Talker step + codec head.
    {
        const Phase ph{K_HEAD_T, 0, -1};
        Operand<2> x;
        if (f.run_talker) {
            run_stack(c, -1, VecRef{dptr<const float>(m.pending), 0});
            load_normed<2>(VecRef{dptr<const float>(m.resid), 0}, bfp(m.talker.final_norm), Dt, m.talker.eps, x,
                           norm_scratch());
            if (blockIdx.x == 0) store_operand<2>(x, Dt, dptr<float>(m.hidden));
        } else {
            load_operand<2>(VecRef{dptr<const float>(m.hidden), 0}, Dt, x);
        }
        float* logits = dptr<float>(m.logits);
        run_mat<2>(c, ph, x, [&](int u, int i, int, const float* red) { logits[u] = row_sum(red, i); });
        c.sync(PH_HEAD);
    }
    BlockReducer sred{sm<float>(QMK_SMEM_SRED), 0};
    const TalkerRules rules{dptr<const uint8_t>(m.seen), f.rep_penalty, f.frame < f.min_new_tokens, m.eos_id,
                            f.suppress_start};
    const int c0 = sample_block<true>(dptr<const float>(m.logits), m.vocab, f.talker_s, rules,
                                      uniform01(f.seed, (uint32_t)f.frame, 0), sred, sm<float>(QMK_SMEM_SCAN));
    if (tid == 0) {
        codes()[0] = c0;
        fed()[0] = force ? (int)force[0] : c0;
    }
    __syncthreads();
    if (fed()[0] == m.eos_id || !f.run_predictor) {
        // No barrier follows sampling on this path: wait for every block to finish reading
        // `seen` before block 0 updates it.
        c.sync(PH_SAMPLE);
        publish_frame(m, f, false);
        c.ring.drain();
        return;
    }

    // 15 code-predictor steps (positions 0..15; position 0 is the talker hidden, no head).
    float* proj_out = dptr<float>(m.proj_out);
    for (int pp = 0; pp < G; ++pp) {
        VecRef src{dptr<const float>(m.hidden), 0};
        if (pp == 1) src = VecRef{bfp(m.talker_emb) + (size_t)fed()[0] * Dt, 1};
        if (pp >= 2) src = VecRef{bfp(m.pred_emb[pp - 2]) + (size_t)fed()[pp - 1] * Dt, 1};
        if (has_proj) {
            Operand<2> x;
            load_operand<2>(src, Dt, x);
            const bf16* bias = bfp(m.proj_b);
            run_mat<2>(c, Phase{K_PROJ, 0, pp}, x,
                       [&](int u, int i, int, const float* red) { proj_out[u] = row_sum(red, i) + ld_weight1(bias + u); });
            c.sync(16 + PH_PROJ);
            src = VecRef{proj_out, 0};
        }
        run_stack(c, pp, src);
        if (pp == 0) continue;
        float* lg = dptr<float>(m.pred_logits) + (size_t)(pp - 1) * m.pred_vocab;
        {
            Operand<2> x;
            load_normed<2>(VecRef{dptr<const float>(m.resid), 0}, bfp(m.pred.final_norm), Dp, m.pred.eps, x, norm_scratch());
            if (blockIdx.x == 0) store_operand<2>(x, Dp, dptr<float>(m.pred_hidden) + (size_t)pp * Dp);
            run_mat<2>(c, Phase{K_HEAD_P, 0, pp}, x, [&](int u, int i, int, const float* red) { lg[u] = row_sum(red, i); });
        }
        c.sync(16 + PH_HEAD);
        const int code = sample_block<false>(lg, m.pred_vocab, f.pred_s, rules, uniform01(f.seed, (uint32_t)f.frame, pp),
                                             sred, sm<float>(QMK_SMEM_SCAN));
        if (tid == 0) {
            codes()[pp] = code;
            fed()[pp] = force ? (int)force[pp] : code;
        }
        __syncthreads();
    }
    publish_frame(m, f, true);
    c.ring.drain();
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
    return (int64_t)attn_nchunk(max_pos - 1) * kv_heads * 2 * QMK_PART;
}

struct GridConfig {
    int dev = -1, misc = -1, blocks = 0, smem = 0, nslot = 0;
};

// Blocks, shared memory and ring slots for this model on the current device. The answer depends
// only on the device and the model's shared-memory needs: remember the last one so a launch
// costs no attribute or occupancy queries.
static int grid_config(const qmk_model& m, GridConfig* out) {
    static thread_local GridConfig last;
    int dev = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e != cudaSuccess) return e;
    const int misc = QMK_SMEM_SLOTS;
    if (m.talker.num_layers + m.pred.num_layers > QMK_MAX_LAYERS) return cudaErrorNotSupported;
    if (dev == last.dev && misc == last.misc) {
        *out = last;
        return cudaSuccess;
    }
    int coop = 0, sms = 0, optin = 0;
    if ((e = cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, dev)) != cudaSuccess) return e;
    if (!coop) return cudaErrorNotSupported;
    if ((e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev)) != cudaSuccess) return e;
    if ((e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev)) != cudaSuccess) return e;
    // As many 32 KB slots as shared memory allows: the deeper the ring, the further ahead of the
    // barriers the weight reads run.
    int nslot = (optin - misc) / QMK_SLOT_BYTES;
    if (nslot > QMK_MAX_SLOTS) nslot = QMK_MAX_SLOTS;
    if (nslot < 2) return cudaErrorNotSupported;
    const int widest = m.talker.hidden > m.pred.hidden ? m.talker.hidden : m.pred.hidden;
    if ((widest + sms - 1) / sms > QMK_OWN_MAX) return cudaErrorNotSupported;
    const int smem = smem_bytes(nslot);
    e = cudaFuncSetAttribute(qmk_frame_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return e;
    // The kernel waits on grid barriers, so every block must be resident at once: one block per
    // SM, and only if the occupancy the driver reports allows it.
    int per_sm = 0;
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, qmk_frame_kernel, QMK_THREADS, smem);
    if (e != cudaSuccess) return e;
    if (per_sm < 1) return cudaErrorCooperativeLaunchTooLarge;
    last = GridConfig{dev, misc, sms, smem, nslot};
    *out = last;
    return cudaSuccess;
}

extern "C" int qmk_grid_size(const qmk_model* m, int32_t* blocks, int32_t* smem_bytes) {
    GridConfig g;
    const int e = grid_config(*m, &g);
    if (e != cudaSuccess) return e;
    *blocks = g.blocks;
    *smem_bytes = g.smem;
    return cudaSuccess;
}

extern "C" int qmk_decode_frame(const qmk_model* m, const qmk_frame* f, uint64_t stream) {
    GridConfig g;
    const int e = grid_config(*m, &g);
    if (e != cudaSuccess) return e;
    Params p;
    p.m = *m;
    p.f = *f;
    p.nslot = g.nslot;
    void* args[] = {&p};
    return cudaLaunchCooperativeKernel((const void*)qmk_frame_kernel, dim3(g.blocks), dim3(QMK_THREADS), args,
                                       (size_t)g.smem, reinterpret_cast<cudaStream_t>(stream));
}

extern "C" const char* qmk_error_string(int code) { return cudaGetErrorString((cudaError_t)code); }
