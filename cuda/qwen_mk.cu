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

// K_AO: the predictor's attention and o_proj in one phase (qmk_stack.fuse_attn_o); no Geo.
enum Kind { K_QKV = 0, K_ATTN, K_O, K_GU, K_DOWN, K_HEAD_T, K_PROJ, K_HEAD_P, K_AO };

// Phase ids in the trace (predictor phases add 16), and the steps stamped inside a phase.
enum { PH_QKV = 0, PH_ATTN, PH_O, PH_MLP, PH_DOWN, PH_HEAD, PH_PROJ, PH_SAMPLE, PH_START, PH_AO };
enum { STEP_OPERAND = 1, STEP_TILE, STEP_DOTS, STEP_EPILOGUE, STEP_DONE, STEP_ARRIVED };

struct Phase {
    int kind, layer, pass;  // pass: predictor position, -1 for the talker
};

// The frame's phases in the order the consumer runs them (the producer walks the same list):
//   talker layers (q/k/v, attention, o, gate/up, down) x Lt | codec head |
//   predictor pass 0..G-1: [projection] layers x Lp [LM head, from pass 1]; pass 0 stops after
//   its last layer's attention (only its K/V rows are used)
// With merge_first, passes 0 and 1 are one list of pass 0's phases, each for both positions
// (run_pred_first): all Lp layers, then pass 1's head.
// First phase of the frame.
__device__ __forceinline__ Phase first_phase(const qmk_frame& f) {
    return f.run_talker ? Phase{K_QKV, 0, -1} : Phase{K_HEAD_T, 0, -1};
}

// Pass p >= 1 takes its first layer's q/k/v rows from the per-code table (qmk_model.qkv0)
// instead of a q/k/v phase.
__device__ __forceinline__ bool from_table(const qmk_model& m, int pass) { return pass >= 1 && m.qkv0[pass - 1] != 0; }

// The attention phase of a layer: fused with o_proj where the stack's fuse_attn_o is set (for the
// talker, qmk_decode_frame sets it per launch: talker_fuses), except the predictor's pass 0's
// last layer, which has no o_proj (only its K/V rows are used).
__device__ __forceinline__ int attn_kind(const qmk_model& m, int layer, int pass) {
    if (pass < 0) return m.talker.fuse_attn_o ? K_AO : K_ATTN;
    const bool fused = pass >= 0 && m.pred.fuse_attn_o &&
                       !(pass == 0 && layer + 1 == m.pred.num_layers && !m.pred.merge_first);
    return fused ? K_AO : K_ATTN;
}

// Advance `ph` to the phase after it; false when the frame has no more.
__device__ bool next_phase(const qmk_model& m, const qmk_frame& f, Phase& ph) {
    const int passes = f.run_predictor ? m.num_groups : 0;
    const int has_proj = m.proj_w != 0;
    const auto layer0 = [&](int p) { return Phase{from_table(m, p) ? attn_kind(m, 0, p) : K_QKV, 0, p}; };
    const auto start = [&](int p) { return has_proj && !from_table(m, p) ? Phase{K_PROJ, 0, p} : layer0(p); };
    switch (ph.kind) {
        case K_HEAD_T:
            if (!passes) return false;
            ph = start(0);
            return true;
        case K_HEAD_P:
            if (ph.pass + 1 >= passes) return false;
            ph = start(ph.pass + 1);
            return true;
        case K_PROJ: ph = layer0(ph.pass); return true;
        case K_QKV: ph.kind = attn_kind(m, ph.layer, ph.pass); return true;
        case K_AO: ph.kind = K_GU; return true;  // fuse_attn_o needs split_down: the layer ends there
        case K_DOWN: break;
        case K_GU:
            if ((ph.pass < 0 ? m.talker : m.pred).split_down) break;  // down ran inside gate/up
            ++ph.kind;
            return true;
        case K_ATTN:
            // Pass 0 (the talker hidden) is only there for its K/V rows: its last layer ends once
            // they are appended (run_stack).
            if (ph.pass == 0 && ph.layer + 1 == m.pred.num_layers) {
                if (passes < 2) return false;
                ph = start(1);
                return true;
            }
            ++ph.kind;
            return true;
        default: ++ph.kind; return true;  // q/k/v -> attention -> o -> gate/up -> down
    }
    if (ph.layer + 1 < (ph.pass < 0 ? m.talker.num_layers : m.pred.num_layers)) {
        ph = Phase{K_QKV, ph.layer + 1, ph.pass};
        return true;
    }
    // Pass 0 gets here only merged with pass 1 (it ends at its last attention otherwise, above):
    // pass 1's head.
    ph = ph.pass < 0 ? Phase{K_HEAD_T, 0, -1} : Phase{K_HEAD_P, 0, ph.pass > 0 ? ph.pass : 1};
    return true;
}

// Read-only view of the launch shared by the producer and the consumer (one pointer: everything
// else is recomputed or read from the parameter space and the shared layer tables).
struct Frame {
    const Params* P;

    __device__ const qmk_model& m() const { return P->m; }
    __device__ const qmk_frame& f() const { return P->f; }
    __device__ const qmk_stack& stack(const Phase& ph) const { return ph.pass < 0 ? P->m.talker : P->m.pred; }
    __device__ const qmk_layer& layer(const Phase& ph) const {
        return sm<const qmk_layer>(QMK_SMEM_TABLES)[(ph.pass < 0 ? 0 : P->m.talker.num_layers) + ph.layer];
    }
    __device__ int attn_pos(const Phase& ph) const { return ph.pass < 0 ? P->f.pos : ph.pass; }
};

// ---------------------------------------------------------------------------------------------
// Which bytes each block streams for each phase

// A matrix phase: N output units (rows; gate/up row pairs for K_GU) of K bf16 columns. Block b
// owns units [u0, u1), taken per_tile at a time. Computed once per launch into shared memory.
// A 6144-wide matrix (the 1.7B's down projection) is split into two 3072-wide halves (ksplit 2),
// each streamed as half rows, so the operand held in registers is never wider than 3072.
struct Geo {
    int u0, u1, per_tile, K, ntiles, ksplit;  // K: columns per half; ntiles over both halves
    // Gate/up with a split down projection (qmk_stack.split_down): the first ngu tiles are gate/up
    // rows, the rest rows of down_t for the same units, dpt rows (of K = hidden) per tile.
    int ngu, dpt;

    // A slice longer than the ring (the 1.7B's MLP) frees each tile as soon as it is done, so the
    // producer can refill its slot mid-phase; otherwise all tiles go back at the grid arrival
    // that ends the phase (Ring::defer).
    __device__ bool frees_each_tile(int nslot) const { return ntiles > nslot; }
};

__device__ __forceinline__ const Geo& geo(const Phase& ph) {
    return sm<const Geo>(QMK_SMEM_GEO)[(ph.pass < 0 ? 0 : 8) + ph.kind];
}

// Fused attention + o_proj items: (kv head g, o_proj row group r), g-major, dealt to blocks
// round-robin (qwen_mk.cu, run_attn_o).
__device__ __forceinline__ int ao_row_groups(const qmk_stack& S) { return S.hidden / QMK_AO_ROWS; }
__device__ __forceinline__ int ao_items(const qmk_stack& S) { return S.num_kv_heads * ao_row_groups(S); }
// The talker's fused phase (run_talker_ao): 16 o_proj items per kv head, each of hidden / 16 rows,
// streamed as that many 64-row tiles (one for the 0.6B, two for the 1.7B's 2048 rows), so the
// items never outnumber an H200's blocks.
#define QMK_TAO_GROUPS 16
__host__ __device__ __forceinline__ int tao_items(const qmk_stack& S) { return S.num_kv_heads * QMK_TAO_GROUPS; }
__device__ __forceinline__ int tao_subtiles(const qmk_stack& S) { return S.hidden / (QMK_TAO_GROUPS * QMK_AO_ROWS); }

// Grouped q/k/v (qmk_stack.group_qkv, the predictor's with fuse_attn_o): block 16 g + r computes
// rows 32 r .. 32 r + 31 of kv head g's 512 q/k/v rows (its two query heads, its k, its v), so the
// fused phase's items of head g wait for those 16 blocks (qmk_model.head_ready), not a grid
// barrier. (The talker's attention grouped the same way measured no gain: bench/NOTES.md, v19.)
#define QMK_QKV_GROUP 16
__device__ __forceinline__ bool grouped_qkv(const qmk_model& m, int pass) {
    const qmk_stack& S = m.pred;
    return pass >= 0 && S.group_qkv && S.fuse_attn_o && QMK_QKV_GROUP * S.num_kv_heads <= (int)gridDim.x;
}
__device__ __forceinline__ unsigned* head_ready(const qmk_model& m) { return dptr<unsigned>(m.head_ready); }

__device__ Geo geo_of(const Frame& F, const Phase& ph) {
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
    const int ksplit = K > 3072 ? 2 : 1;
    K /= ksplit;
    const int per_tile = QMK_SLOT_BYTES / (2 * K * rows_per_unit);
    const int B = gridDim.x, b = blockIdx.x;
    int u0 = N * b / B, u1 = N * (b + 1) / B;
    if (ph.kind == K_QKV && grouped_qkv(m, ph.pass)) {
        const int rows = 4 * QMK_HD / QMK_QKV_GROUP, g = b / QMK_QKV_GROUP, p = (b % QMK_QKV_GROUP) * rows;
        const int H = S.num_heads * QMK_HD, KV = S.num_kv_heads * QMK_HD, grouped = QMK_QKV_GROUP * S.num_kv_heads;
        u0 = b >= grouped ? 0 : p < 2 * QMK_HD ? 2 * g * QMK_HD + p
                             : p < 3 * QMK_HD ? H + g * QMK_HD + p - 2 * QMK_HD
                                              : H + KV + g * QMK_HD + p - 3 * QMK_HD;
        u1 = b >= grouped ? 0 : u0 + rows;
    }
    const int ntiles = ksplit * ((u1 - u0 + per_tile - 1) / per_tile);
    if (ph.kind == K_GU && S.split_down) {
        const int dpt = QMK_SLOT_BYTES / (2 * K);
        return {u0, u1, per_tile, K, ntiles + (u1 - u0 + dpt - 1) / dpt, ksplit, ntiles, dpt};
    }
    return {u0, u1, per_tile, K, ntiles, ksplit, ntiles, 0};
}

__device__ __forceinline__ Range rows_of(uint64_t base, int row, int rows, int K) {
    const size_t rb = (size_t)K * 2;
    return {reinterpret_cast<const unsigned char*>(base) + row * rb, (uint32_t)(rows * rb)};
}

__device__ Tile mat_tile(const Frame& F, const Phase& ph, const Geo& mt, int t) {
    if (t >= mt.ngu) {  // split down: rows of down_t for this block's gate/up units
        const int a = mt.u0 + (t - mt.ngu) * mt.dpt;
        Tile tl;
        tl.r[0] = rows_of(F.layer(ph).down_t, a, min(mt.dpt, mt.u1 - a), mt.K);
        tl.n = 1;
        return tl;
    }
    const int per_half = mt.ngu / mt.ksplit, h = t / per_half;
    const int a = mt.u0 + (t % per_half) * mt.per_tile, n = min(mt.per_tile, mt.u1 - a);
    Tile tl;
    tl.n = 1;
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
            tl.n = k;
            break;
        }
        case K_GU: {
            const qmk_layer& L = F.layer(ph);
            tl.r[0] = rows_of(L.gate, a, n, mt.K);
            tl.r[1] = rows_of(L.up, a, n, mt.K);
            tl.n = 2;
            break;
        }
        case K_O: tl.r[0] = rows_of(F.layer(ph).o, a, n, mt.K); break;
        case K_DOWN:
            if (mt.ksplit == 1) {
                tl.r[0] = rows_of(F.layer(ph).down, a, n, mt.K);
            } else {  // half h of each row: one range per row
                const unsigned char* base = reinterpret_cast<const unsigned char*>(F.layer(ph).down);
                const size_t rb = (size_t)mt.K * 2 * mt.ksplit;
                for (int k = 0; k < n; ++k) tl.r[k] = {base + (a + k) * rb + h * (size_t)mt.K * 2, (uint32_t)mt.K * 2};
                tl.n = n;
            }
            break;
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
    Tile tl;
    tl.r[0] = {dptr<const float>(S.k_cache) + row, bytes};
    tl.r[1] = {dptr<const float>(S.v_cache) + row, bytes};
    tl.n = 2;
    tl.kv = 1;
    return tl;
}

// A predictor's fused attention + o_proj item streams its head's cached K/V rows (from pass 1 on),
// then its o_proj tile. The talker's fused phase streams the K/V tiles of the block's attention
// items first (as its attention phase would), then one o_proj tile per item (run_talker_ao).
__device__ __forceinline__ int ao_tiles_per_item(const Phase& ph) { return ph.pass > 0 ? 2 : 1; }

__device__ int ao_tiles(const Frame& F, const Phase& ph) {
    if (ph.pass < 0) {
        const qmk_stack& S = F.m().talker;
        const int items = tao_items(S);
        const int mine = blockIdx.x < items ? (items - 1 - blockIdx.x) / gridDim.x + 1 : 0;
        return attn_tiles(F, ph) + mine * tao_subtiles(S);
    }
    const int items = ao_items(F.m().pred);
    const int mine = blockIdx.x < items ? (items - 1 - blockIdx.x) / gridDim.x + 1 : 0;
    return mine * ao_tiles_per_item(ph);
}

__device__ Tile ao_tile(const Frame& F, const Phase& ph, int t) {
    const qmk_stack& S = F.stack(ph);
    Tile tl;
    if (ph.pass < 0) {
        const int att = attn_tiles(F, ph);
        if (t < att) return attn_tile(F, ph, t);
        t -= att;
        const int sub = tao_subtiles(S), it = blockIdx.x + (t / sub) * gridDim.x;
        const int g = it / QMK_TAO_GROUPS, r = (it % QMK_TAO_GROUPS) * sub + t % sub;
        const size_t first = ((size_t)g * S.hidden + (size_t)r * QMK_AO_ROWS) * 2 * QMK_HD;
        tl.r[0] = {bfp(F.layer(ph).o_blk) + first, (uint32_t)QMK_SLOT_BYTES};
        tl.n = 1;
        return tl;
    }
    const int per = ao_tiles_per_item(ph), it = blockIdx.x + (t / per) * gridDim.x;
    const int R = ao_row_groups(S), g = it / R, r = it % R;
    if (per == 2 && t % per == 0) {  // K then V rows of positions 0 .. pass - 1
        const size_t row = ((size_t)ph.layer * S.num_kv_heads + g) * S.max_pos * QMK_HD;
        const uint32_t bytes = (uint32_t)ph.pass * QMK_HD * 4;
        tl.r[0] = {dptr<const float>(S.k_cache) + row, bytes};
        tl.r[1] = {dptr<const float>(S.v_cache) + row, bytes};
        tl.n = 2;
        tl.kv = 1;
        return tl;
    }
    const size_t first = ((size_t)g * S.hidden + (size_t)r * QMK_AO_ROWS) * 2 * QMK_HD;
    tl.r[0] = {bfp(F.layer(ph).o_blk) + first, (uint32_t)QMK_SLOT_BYTES};
    tl.n = 1;
    return tl;
}

__device__ int phase_tiles(const Frame& F, const Phase& ph) {
    if (ph.kind == K_AO) return ao_tiles(F, ph);
    return ph.kind == K_ATTN ? attn_tiles(F, ph) : geo(ph).ntiles;
}

__device__ Tile phase_tile(const Frame& F, const Phase& ph, int t) {
    if (ph.kind == K_AO) return ao_tile(F, ph, t);
    return ph.kind == K_ATTN ? attn_tile(F, ph, t) : mat_tile(F, ph, geo(ph), t);
}

// A position in the frame's tile sequence, in the order the consumers read the tiles.
struct TileCursor {
    Phase ph;
    int tile, ntiles;

    __device__ explicit TileCursor(const Frame& F) : ph(first_phase(F.f())), tile(0), ntiles(phase_tiles(F, ph)) {}

    // Onto the next tile that exists (a phase may have no tiles for this block); false at the end
    // of the frame.
    __device__ bool settle(const Frame& F) {
        while (tile >= ntiles) {
            if (!next_phase(F.m(), F.f(), ph)) return false;
            tile = 0;
            ntiles = phase_tiles(F, ph);
        }
        return true;
    }
};

// The producer warp's lane 0: walk the frame's tiles in the consumers' order and issue each copy
// as soon as its slot is free. Stops at the end of the frame's tiles, or when the consumers end
// the frame early (EOS).
__device__ __noinline__ void produce(const Params* P) {
    const Frame F{P};
    const int nslot = P->nslot;
    TileCursor cur(F);
    uint32_t i = 0;
    while (cur.settle(F)) {
        if (!wait_slot_free(i, nslot)) break;
        // The predictor's K/V rows were stored by other blocks earlier in this launch.
        const Phase& ph = cur.ph;
        const Tile t = phase_tile(F, ph, cur.tile++);
        issue_tile(t, i++, nslot, t.kv && ph.pass >= 0, !t.kv);
    }
    *reinterpret_cast<volatile uint32_t*>(&ring_state().issued) = i;
}

// ---------------------------------------------------------------------------------------------
// Consumer

#ifdef QMK_TRACE_ATTN
// Every grid barrier's arrival, arrival done and exit, per block (global timer), and its phase id
// (+64 for a group arrival): [block][barrier][4].
#define QMK_GRID_SEQ 512
__device__ long long qmk_grid_trace[QMK_DBG_BLOCKS * QMK_GRID_SEQ * 4];
#endif

struct Ctx {
    Frame F;
    Ring ring;
#ifdef QMK_TRACE_ATTN
    int seq = 0;
    __device__ long long* grid_row() {
        return blockIdx.x < QMK_DBG_BLOCKS && seq < QMK_GRID_SEQ ? qmk_grid_trace + ((size_t)blockIdx.x * QMK_GRID_SEQ + seq) * 4
                                                                  : nullptr;
    }
#endif

    // Block 0's thread 0 records (clock, global timer, id): at every barrier exit (step 0), and
    // with trace_steps also at the steps inside a phase (STEP_*), for the per-step profile.
    __device__ void stamp(int id, int step) const {
#ifndef QMK_TRACE_STEPS
        if (step != 0 && step != STEP_DONE) return;  // steps are compiled in for profiling builds only
#endif
        long long* trace = dptr<long long>(F.f().trace);
        // A plain trace keeps the barrier exits and each block-0 "work done" (the phase profile's
        // wait for the other blocks); trace_steps adds the rest.
        const bool wanted = step == 0 || step == STEP_DONE || F.f().trace_steps;
        if (trace == nullptr || blockIdx.x != 0 || threadIdx.x != 0 || !wanted) return;
        int* stamps = sm<int>(QMK_SMEM_STAMPS);
        if (*stamps >= QMK_TRACE_MAX) return;
        long long gt;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(gt));
        trace[3 * *stamps] = clock64();
        trace[3 * *stamps + 1] = gt;
        trace[3 * *stamps + 2] = id + 32 * step;
        ++*stamps;
    }

    // Grid barrier over the consumer threads of every block.
    __device__ void sync(int phase) {
        block_sync();
        if (threadIdx.x == 0) {
            stamp(phase, STEP_DONE);
            unsigned* counter = dptr<unsigned>(F.m().barrier);
#ifdef QMK_TRACE_ATTN
            long long* gr = grid_row();
            if (gr) gr[0] = dbg_gtime(), gr[3] = phase;
#endif
            const unsigned arrived = grid_arrive(counter);
#ifdef QMK_TRACE_ATTN
            if (gr) gr[1] = dbg_gtime();
#endif
            ring.release_deferred();
            stamp(phase, STEP_ARRIVED);
            grid_wait(counter, arrived);
#ifdef QMK_TRACE_ATTN
            if (gr) gr[2] = dbg_gtime();
            ++seq;
#endif
            stamp(phase, 0);
        }
        block_sync();
        ring.end_deferred();
    }

    // The end of a phase that only the blocks of one group wait for: its stores released to them
    // through `counter` (blocks outside any group pass null), the tiles handed back as at a grid
    // arrival, no wait.
    __device__ void group_arrive(unsigned* counter, int phase) {
        block_sync();
        if (threadIdx.x == 0) {
            stamp(phase, STEP_DONE);
#ifdef QMK_TRACE_ATTN
            long long* gr = grid_row();
            if (gr) gr[0] = dbg_gtime(), gr[3] = 64 + phase;
#endif
            if (counter) red_add_release(counter);
#ifdef QMK_TRACE_ATTN
            if (gr) gr[1] = gr[2] = dbg_gtime();
            ++seq;
#endif
            ring.release_deferred();
            stamp(phase, 0);
        }
        block_sync();
        ring.end_deferred();
    }
};

__device__ __forceinline__ float* norm_scratch() { return sm<float>(QMK_SMEM_NSCR); }

// Operand loads through the block's staging buffers (mk_matvec.cuh).
template <int MS>
__device__ __forceinline__ void load_x(VecRef x, int K, Operand<MS>& o) {
    load_operand<MS>(x, K, o, sm<float>(QMK_SMEM_XS));
}

template <int MS>
__device__ __forceinline__ void load_xn(VecRef x, const bf16* w, int K, float eps, Operand<MS>& o) {
    load_normed<MS>(x, w, K, eps, o, norm_scratch(), sm<float>(QMK_SMEM_XS), sm<float>(QMK_SMEM_WS));
}
__device__ __forceinline__ int* codes() { return sm<int>(QMK_SMEM_CODES); }
__device__ __forceinline__ int* fed() { return sm<int>(QMK_SMEM_FED); }

// Floats per row of an input table: the layer-0 q/k/v, then (with a projection) the projected
// input itself, where the pass's residual stream starts.
__device__ __forceinline__ int qkv0_width(const qmk_model& m) { return (m.pred.num_heads + 2 * m.pred.num_kv_heads) * QMK_HD; }
__device__ __forceinline__ int table_row_floats(const qmk_model& m) {
    return qkv0_width(m) + (m.proj_w != 0 ? m.pred.hidden : 0);
}

// Thread 0: code group g is fed `code`; pass g + 1 takes its layer-0 q/k/v (and projected input)
// from that code's table row, if it has a table (from_table).
__device__ __forceinline__ void feed(const qmk_model& m, int g, int code) {
    fed()[g] = code;
    const float* row = nullptr;
    if (g + 1 < m.num_groups && from_table(m, g + 1))
        row = dptr<const float>(m.qkv0[g]) + (size_t)code * table_row_floats(m);
    *sm<const float*>(QMK_SMEM_QSRC) = row;
}

// SwiGLU of gate/up unit j from its row partials: silu(gate) * up.
__device__ __forceinline__ float swiglu(const float* red, int j) {
    const float g = row_sum(red, 2 * j), up = row_sum(red, 2 * j + 1);
    return (g / (1.f + expf(-g))) * up;
}

// Dot products of tiles [t0, t1) of a matrix phase (tile t covers units
// (t % per_half) * per_tile ...) into red.
template <int MS>
__device__ void dots_tiles(Ctx& c, const Geo& g, int rpu, int t0, int t1, const Operand<MS>& x, float* red, int id) {
    const int per_half = g.ngu / g.ksplit;
    const bool within = g.frees_each_tile(c.ring.nslot);
    for (int t = t0; t < t1; ++t) {
        const int tt = t % per_half;
        const int n = min(g.per_tile, g.u1 - g.u0 - tt * g.per_tile);
        const unsigned char* tile = c.ring.wait(within ? 0 : t);
        c.stamp(id, STEP_TILE);
        tile_dots<MS>(tile, n, rpu, g.K, x, red + tt * g.per_tile * rpu * 4);
        if (within) {
            block_sync();
            c.ring.release(1);
        }
    }
}

// Every consumer is done with the phase's tiles: partials complete; the slots go back to the
// producer at the grid arrival (Ring::defer).
__device__ __forceinline__ void end_tiles(Ctx& c, const Geo& g, int id) {
    block_sync();
    c.stamp(id, STEP_DOTS);
    if (!g.frees_each_tile(c.ring.nslot)) c.ring.defer(g.ntiles);
}

// One matrix phase: dot products of every tile of the block's slice from shared memory, one
// barrier, then `epi(unit, index in the slice, partials)` on one thread per unit.
template <int MS, class Epi>
__device__ void run_mat(Ctx& c, const Phase& ph, int id, const Operand<MS>& x, Epi epi) {
    c.stamp(id, STEP_OPERAND);
    const Geo g = geo(ph);
    const int rpu = ph.kind == K_GU ? 2 : 1;
    float* red = sm<float>(QMK_SMEM_RED);
    dots_tiles<MS>(c, g, rpu, 0, g.ntiles, x, red, id);
    end_tiles(c, g, id);
    for (int j = threadIdx.x; j < g.u1 - g.u0; j += QMK_THREADS) epi(g.u0 + j, j, red);
    c.stamp(id, STEP_EPILOGUE);
}

// The MLP's down projection: `epi(unit, index in the slice, sum)` after both halves when the
// matrix is split.
template <class Epi>
__device__ void run_down(Ctx& c, const Phase& ph, int id, const float* act, Epi epi) {
    const Geo g = geo(ph);
    const int units = g.u1 - g.u0, per_half = g.ngu / g.ksplit;
    float* red = sm<float>(QMK_SMEM_RED);
    for (int h = 0; h < g.ksplit; ++h) {
        Operand<3> x;
        load_x<3>(VecRef{act + h * g.K, VEC_F32}, g.K, x);
        c.stamp(id, STEP_OPERAND);
        dots_tiles<3>(c, g, 1, h * per_half, (h + 1) * per_half, x, red + h * units * 4, id);
    }
    end_tiles(c, g, id);
    for (int j = threadIdx.x; j < units; j += QMK_THREADS) {
        float v = row_sum(red, j);
        if (g.ksplit == 2) v += row_sum(red + units * 4, j);
        epi(g.u0 + j, j, v);
    }
    c.stamp(id, STEP_EPILOGUE);
}

// The end of a split gate/up phase whose tiles all stay in the ring: the gate/up slots go back at
// the grid arrival, the down_t ones one arrival later if the next phase (q/k/v or the head) still
// finds its slots (run_gu_split).
__device__ __forceinline__ void defer_mlp_tiles(Ctx& c, const Geo& g, const Phase& ph) {
    const int nslot = c.ring.nslot, dt = g.ntiles - g.ngu;
    const Geo &nq = geo(Phase{K_QKV, 0, ph.pass}), &nh = geo(Phase{ph.pass < 0 ? K_HEAD_T : K_HEAD_P, 0, ph.pass});
    const int need = max(nq.frees_each_tile(nslot) ? 1 : nq.ntiles, nh.frees_each_tile(nslot) ? 1 : nh.ntiles);
    const int held = dt + need <= nslot ? dt : 0;
    c.ring.defer(g.ntiles - held);
    c.ring.hold(held);
}

// Gate/up with the down projection split over the blocks (qmk_stack.split_down): the block's
// gate/up units give their activations (shared memory, never global), which multiply the same
// units' rows of down_t into a hidden-wide partial; every block adds its partial into `resid`,
// which the o_proj epilogue set to the residual after attention. This takes one grid barrier, one
// operand read and one phase's latency chain off every layer (bench/NOTES.md, v16); the float
// atomics (one 16-byte request per 4 columns) sum in an order that varies between runs.
// CPT: columns per consumer thread (hidden / QMK_THREADS: 2 or 4).
template <int CPT>
__device__ void run_gu_split(Ctx& c, const Phase& ph, int id, const Operand<2>& x, float* resid) {
    c.stamp(id, STEP_OPERAND);
    const Geo g = geo(ph);
    const int units = g.u1 - g.u0;
    const bool within = g.frees_each_tile(c.ring.nslot);
    float* red = sm<float>(QMK_SMEM_RED);
    float* acts = sm<float>(QMK_SMEM_ACTS);
    dots_tiles<2>(c, g, 2, 0, g.ngu, x, red, id);
    block_sync();
    c.stamp(id, STEP_DOTS);
    for (int j = threadIdx.x; j < units; j += QMK_THREADS) acts[j] = swiglu(red, j);
    block_sync();
    float acc[CPT];
#pragma unroll
    for (int e = 0; e < CPT; ++e) acc[e] = 0.f;
    const int col = threadIdx.x * CPT;
    resid = acc_copy(resid);
    for (int t = g.ngu; t < g.ntiles; ++t) {
        const int r0 = (t - g.ngu) * g.dpt, n = min(g.dpt, units - r0);
        const bf16* tile = reinterpret_cast<const bf16*>(c.ring.wait(within ? 0 : t)) + col;
        c.stamp(id, STEP_TILE);
        // Four rows per step, their loads issued together (a tile holds 16 or 8 rows; the last
        // tile may end mid-step: its missing rows count as zero activations, and the float4 read
        // past the slice stays inside the area's 4 spare floats).
        for (int r = 0; r < n; r += 4) {
            float a[4], w[4][CPT];
            const float4 a4 = *reinterpret_cast<const float4*>(acts + r0 + r);
            a[0] = a4.x, a[1] = a4.y, a[2] = a4.z, a[3] = a4.w;
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const bf16* row = tile + (size_t)min(r + k, n - 1) * g.K;
                if constexpr (CPT == 2) {
                    const uint32_t u = *reinterpret_cast<const uint32_t*>(row);
                    w[k][0] = bf_lo(u), w[k][1] = bf_hi(u);
                } else {
                    const uint2 u = *reinterpret_cast<const uint2*>(row);
                    w[k][0] = bf_lo(u.x), w[k][1] = bf_hi(u.x), w[k][2] = bf_lo(u.y), w[k][3] = bf_hi(u.y);
                }
                if (r + k >= n) a[k] = 0.f;
            }
#pragma unroll
            for (int k = 0; k < 4; ++k)
#pragma unroll
                for (int e = 0; e < CPT; ++e) acc[e] = fmaf(a[k], w[k][e], acc[e]);
        }
        if (within) {
            block_sync();
            c.ring.release(1);
        }
    }
    if constexpr (CPT == 2) {  // lane pairs: the even lane adds both threads' four columns
        const float b0 = __shfl_down_sync(0xffffffffu, acc[0], 1), b1 = __shfl_down_sync(0xffffffffu, acc[1], 1);
        if ((threadIdx.x & 1) == 0) red_add4(resid + col, acc[0], acc[1], b0, b1);
    } else {
        static_assert(CPT == 4, "hidden widths 1024 and 2048");
        red_add4(resid + col, acc[0], acc[1], acc[2], acc[3]);
    }
    // The barrier that ends the phase (Ctx::sync) orders the additions before its arrival.
    // The down_t slots go back one grid arrival after the gate/up ones: handing all five back at
    // once queued ~160 KB of copies ahead of the next phase's arrival fence (-0.026 ms a frame).
    // Only if the phase after (the next layer's q/k/v or the head) still finds its slots.
    if (!within) defer_mlp_tiles(c, g, ph);
    c.stamp(id, STEP_EPILOGUE);
}

// Grouped q/k/v: the end of the phase (this block's head counter, if it has rows), the wait for
// head g's blocks (thread 0, then the block), and the reset once every waiter has passed a grid
// barrier since (the block of row group 0, before the next q/k/v phase's barrier).
__device__ __forceinline__ void arrive_head(Ctx& c, const qmk_model& m, int id) {
    const int b = blockIdx.x;
    c.group_arrive(b < QMK_QKV_GROUP * m.pred.num_kv_heads ? head_ready(m) + b / QMK_QKV_GROUP : nullptr, id);
}
__device__ __forceinline__ void wait_head(const qmk_model& m, int g) {
    if (threadIdx.x == 0)
        while (ld_acquire(head_ready(m) + g) < (unsigned)QMK_QKV_GROUP) {
        }
    block_sync();
}
__device__ __forceinline__ void reset_head(const qmk_model& m) {
    const int b = blockIdx.x;
    if (threadIdx.x == 0 && b < QMK_QKV_GROUP * m.pred.num_kv_heads && b % QMK_QKV_GROUP == 0)
        head_ready(m)[b / QMK_QKV_GROUP] = 0u;
}

// `tabled`: the position's raw q/k/v projections are this pass's table row (feed), not the q/k/v
// phase's output. LONG (the long-context kernel, chosen per launch: qmk_decode_frame): a block
// with several items runs up to QMK_ATTN_PAIRS of them at once, one per warp pair, their tiles in
// the ring together. The short kernel keeps one item at a time: the pairs' code, merely present,
// cost 0.03 ms a frame at position 100 (register allocation; bench/NOTES.md, v20).
// PUBLISH: the fused talker's attention (run_talker_ao): items publish and count, none merges.
template <bool LONG, bool PUBLISH = false>
__device__ void run_attention(Ctx& c, const Phase& ph, int id, bool tabled) {
    const qmk_model& m = c.F.m();
    const qmk_stack& S = c.F.stack(ph);
    const qmk_layer& L = c.F.layer(ph);
    const AttnItems A = attn_items(c.F, ph);
    const size_t off = (size_t)ph.layer * S.num_kv_heads * S.max_pos * QMK_HD;
    const AttnArgs a{dptr<const float>(m.qkv), dptr<float>(m.attn),   dptr<float>(S.k_cache) + off,
                     dptr<float>(S.v_cache) + off, bfp(L.q_norm), bfp(L.k_norm), dptr<const float>(S.rope),
                     dptr<float>(m.attn_part), dptr<unsigned>(m.attn_count), A.pos, S.num_heads,
                     S.num_kv_heads, S.max_pos, S.eps, 0, 1, PUBLISH};
    if constexpr (!LONG) {
        for (int it = blockIdx.x; it < A.items; it += gridDim.x) {
#ifdef QMK_TRACE_ATTN
            long long* row = attn_trace_row(ph.pass, ph.layer);
            if (row && threadIdx.x == 0) row[0] = dbg_gtime(), row[11] = it, row[9] = 0;
            AttnArgs ad = a;
            ad.dbg = row;
#define QMK_ATTN_ARGS ad
#else
#define QMK_ATTN_ARGS a
#endif
            const bool has = A.has_tile(it);
            const float* tile = has ? reinterpret_cast<const float*>(c.ring.wait(0)) : nullptr;
            c.stamp(id, STEP_TILE);
            QMK_TRACE_ONLY(trace_time(row, 1);)
            // The table row's address is read here, where it is used: run_attention is at the
            // register limit.
            const float* qkv = tabled ? *sm<const float* volatile>(QMK_SMEM_QSRC) : a.qkv;
            attention_item(QMK_ATTN_ARGS, qkv, it / A.nchunk, it % A.nchunk, A.nchunk, tile, sm<float>(QMK_SMEM_ATTN));
#undef QMK_ATTN_ARGS
            block_sync();
#ifdef QMK_TRACE_ATTN
            if (row && threadIdx.x == 0) row[10] = dbg_gtime(), row[12] = clock64();
#endif
            // One tile per item; a long context gives a block more items than the ring has slots, so
            // each goes back at once (deferring K/V tiles to the arrival measured 0.02 ms slower).
            if (has) c.ring.release(1);
        }
        return;
    }
    const int P = min(QMK_ATTN_PAIRS, c.ring.nslot), k = threadIdx.x >> 6;
    for (int first = blockIdx.x; first < A.items; first += P * gridDim.x) {
        int nt = 0, mine = -1;  // tiles of the round; this pair's among them
        for (int j = 0; j < P; ++j) {
            const int it = first + j * gridDim.x;
            if (it >= A.items) break;
            if (j == k && A.has_tile(it)) mine = nt;
            nt += A.has_tile(it);
        }
        const int it = first + k * gridDim.x;
        if (k < P && it < A.items) {
            const float* tile = mine >= 0 ? reinterpret_cast<const float*>(c.ring.wait(mine)) : nullptr;
            c.stamp(id, STEP_TILE);
            const float* qkv = tabled ? *sm<const float* volatile>(QMK_SMEM_QSRC) : a.qkv;
            attention_item(a, qkv, it / A.nchunk, it % A.nchunk, A.nchunk, tile, sm<float>(QMK_SMEM_ATTN), k);
        }
        block_sync();
        if (nt) c.ring.release(nt);  // a round's tiles go back at once
    }
}

// ---------------------------------------------------------------------------------------------
// The predictor with attention and o_proj fused (qmk_stack.fuse_attn_o)
//
// Every block adds partials into the residual, so a layer needs two accumulators that start at
// zero: `a` gets the layer's input plus o_proj (the residual after attention, the MLP's operand),
// `b` the same plus the MLP's down partials (the layer's output). The frame's fused layers (pass 0
// has L - 1: its last layer has no o_proj; later passes L each) alternate between two pairs of
// buffers, so layer n's input (layer n - 1's b) is never one of its own. Layer n's pair is zeroed
// during layer n - 1's MLP phase (the codec head's for the first), which neither reads nor adds
// to it; the q/k/v phase in between may end without a grid barrier (grouped_qkv).
struct Acc {
    float* a;
    float* b;
};

__device__ __forceinline__ int fused_layer(int L, int pass, int layer) { return pass == 0 ? layer : L - 1 + (pass - 1) * L + layer; }

// pres: four pairs of QMK_ACC_PAIR floats, `a` then the copies of `b` (acc_copy).
#define QMK_ACC_PAIR ((1 + QMK_ACC_COPIES) * QMK_ACC_STRIDE)
__device__ __forceinline__ Acc pred_acc(const qmk_model& m, int n) {
    float* X = dptr<float>(m.pres) + (size_t)(n % 2) * QMK_ACC_PAIR;
    return {X, X + QMK_ACC_STRIDE};
}

// The block's share of both accumulators set to zero.
__device__ __forceinline__ void zero_acc(const Acc& z, int D) {
    const int r0 = D * blockIdx.x / gridDim.x, r1 = D * (blockIdx.x + 1) / gridDim.x;
    for (int i = r0 + (int)threadIdx.x; i < r1; i += QMK_THREADS) {
        z.a[i] = 0.f;
#pragma unroll
        for (int k = 0; k < QMK_ACC_COPIES; ++k) z.b[i + k * QMK_ACC_STRIDE] = 0.f;
    }
}

// Rows 64 r .. 64 r + 63 of o_proj over kv head g's 256 columns (its two query heads' outputs,
// `heads` in shared memory) from the ring's tile `tile` after the consumed ones (qmk_layer.o_blk),
// added into both accumulators; head 0's items also add the layer input's rows. `mine`: the
// block's items in the phase (one: the tile is deferred to the grid arrival).
__device__ __forceinline__ void ao_rows(Ctx& c, int id, int g, int r, int mine, const float* heads, VecRef in,
                                        const Acc& acc, uint32_t tile = 0) {
    float* sums = sm<float>(QMK_SMEM_RED);
    const int row = threadIdx.x >> 3, part = threadIdx.x & 7;
    // 8 threads per o_proj row; thread `part` takes columns 8 part + 64 i (a quarter warp
    // reads 128 contiguous bytes of the row).
    const bf16* w = reinterpret_cast<const bf16*>(c.ring.wait(tile)) + (size_t)row * 2 * QMK_HD;
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int col = 8 * part + 64 * i;
        float wv[8], xv[8];
        unpack8(*reinterpret_cast<const uint4*>(w + col), wv);
        read8(heads + col, xv);
#pragma unroll
        for (int e = 0; e < 8; ++e) s = fmaf(wv[e], xv[e], s);
    }
    s += __shfl_xor_sync(0xffffffffu, s, 4);
    s += __shfl_xor_sync(0xffffffffu, s, 2);
    s += __shfl_xor_sync(0xffffffffu, s, 1);
    if (part == 0) sums[row] = s;
    block_sync();
    c.stamp(id, STEP_DOTS);
    // The o_proj tile goes back at the grid arrival when it is the block's only item (like a
    // matrix phase's); with several items the next one may need its slot.
    if (mine == 1) c.ring.defer(1);
    else c.ring.release(1);
    if (threadIdx.x < QMK_AO_ROWS / 4) {
        const int k = 4 * threadIdx.x, u = r * QMK_AO_ROWS + k;
        float v[4] = {sums[k], sums[k + 1], sums[k + 2], sums[k + 3]};
        if (g == 0) {
            float x[4];
            if (in.kind == VEC_BF16) {
                const uint2 b = *reinterpret_cast<const uint2*>(static_cast<const bf16*>(in.p) + u);
                x[0] = bf_lo(b.x), x[1] = bf_hi(b.x), x[2] = bf_lo(b.y), x[3] = bf_hi(b.y);
            } else {
                const float4 f = ld_vec4(static_cast<const float*>(in.p) + u, in.kind);
                x[0] = f.x, x[1] = f.y, x[2] = f.z, x[3] = f.w;
            }
#pragma unroll
            for (int e = 0; e < 4; ++e) v[e] += x[e];
        }
        red_add4(acc.a + u, v[0], v[1], v[2], v[3]);
        red_add4(acc.b + u, v[0], v[1], v[2], v[3]);
    }
}

// Item (g, r): kv head g's two query heads (every row group recomputes them: a predictor position
// attends to at most 16 positions), then rows 64 r .. 64 r + 63 of o_proj (ao_rows). Row group 0
// appends the K/V rows.
// `grouped`: the q/k/v rows come from a grouped q/k/v phase: wait for the head's blocks first.
__device__ void run_attn_o(Ctx& c, const Phase& ph, int id, bool tabled, bool grouped, VecRef in, const Acc& acc) {
    const qmk_model& m = c.F.m();
    const qmk_stack& S = m.pred;
    const qmk_layer& L = c.F.layer(ph);
    const int pos = ph.pass, R = ao_row_groups(S), items = ao_items(S);
    const int mine = blockIdx.x < items ? (items - 1 - blockIdx.x) / gridDim.x + 1 : 0;
    const size_t off = (size_t)ph.layer * S.num_kv_heads * S.max_pos * QMK_HD;
    float* heads = sm<float>(QMK_SMEM_XS);  // the item's two heads' outputs
    for (int it = blockIdx.x; it < items; it += gridDim.x) {
        const int g = it / R, r = it % R;
        const float* kv = pos > 0 ? reinterpret_cast<const float*>(c.ring.wait(0)) : nullptr;
        c.stamp(id, STEP_TILE);
        const AttnArgs a{dptr<const float>(m.qkv), heads, dptr<float>(S.k_cache) + off, dptr<float>(S.v_cache) + off,
                         bfp(L.q_norm), bfp(L.k_norm), dptr<const float>(S.rope), nullptr, nullptr, pos,
                         S.num_heads, S.num_kv_heads, S.max_pos, S.eps, 2 * g, r == 0};
        const float* qkv = tabled ? *sm<const float* volatile>(QMK_SMEM_QSRC) : a.qkv;
        if (grouped) wait_head(m, g);
        attention_item(a, qkv, g, 0, 1, kv, sm<float>(QMK_SMEM_ATTN));
        block_sync();
        if (pos > 0) c.ring.release(1);
        ao_rows(c, id, g, r, mine, heads, in, acc);
    }
    c.stamp(id, STEP_EPILOGUE);
}

// The predictor's layers at one pass with fuse_attn_o; `src` is the pass's input. The result is
// layer L - 1's `b` (the head reads it). The K/V tile, this block's item count and the pass's
// output index are written out here and in ao_tile / the frame rather than shared through helpers:
// that refactor measured +0.008 ms a sampled frame (bench/NOTES.md, v19 review).
__device__ void run_pred_fused(Ctx& c, int pass, VecRef src) {
    const qmk_model& m = c.F.m();
    const qmk_stack& S = m.pred;
    const int L = S.num_layers, D = S.hidden;
    const bool grouped = grouped_qkv(m, pass);
    float* qkv = dptr<float>(m.qkv);
    for (int l = 0; l < L; ++l) {
        const Phase pq{K_QKV, l, pass};
        const qmk_layer& Ly = c.F.layer(pq);
        const bool last0 = pass == 0 && l + 1 == L;
        const VecRef in = l == 0 ? src : VecRef{pred_acc(m, fused_layer(L, pass, l - 1)).b, VEC_ACC};
        const bool tabled = l == 0 && from_table(m, pass);
        if (!tabled) {
            Operand<2> x;
            load_xn<2>(in, bfp(Ly.input_norm), D, S.eps, x);
            run_mat<2>(c, pq, 16 + PH_QKV, x, [&](int u, int j, const float* red) { qkv[u] = row_sum(red, j); });
            // Pass 0's last attention has no barrier after it and reads whole heads: a grid barrier.
            if (grouped && !last0) arrive_head(c, m, 16 + PH_QKV);
            else c.sync(16 + PH_QKV);
        }
        if (last0) {  // only the K/V rows are used; no barrier (as in run_stack)
            run_attention<false>(c, Phase{K_ATTN, l, pass}, 16 + PH_ATTN, false);
            return;
        }
        const Acc acc = pred_acc(m, fused_layer(L, pass, l));
        run_attn_o(c, Phase{K_AO, l, pass}, 16 + PH_AO, tabled, grouped && !tabled, in, acc);
        c.sync(16 + PH_AO);
        if (grouped) reset_head(m);
        Operand<2> xm;
        load_xn<2>(VecRef{acc.a, VEC_F32}, bfp(Ly.post_norm), D, S.eps, xm);
        zero_acc(pred_acc(m, fused_layer(L, pass, l) + 1), D);
        const Phase pg{K_GU, l, pass};
        if (D == 2048) run_gu_split<4>(c, pg, 16 + PH_MLP, xm, acc.b);
        else run_gu_split<2>(c, pg, 16 + PH_MLP, xm, acc.b);
        c.sync(16 + PH_MLP);
    }
}

// ---------------------------------------------------------------------------------------------
// The talker with attention and o_proj in one phase (qmk_stack.fuse_attn_o on the talker's stack;
// qmk_decode_frame sets it where the o_proj items fit the grid, talker_fuses, and launches the
// TFUSE kernels, which hold this code and not run_stack's talker: inlined beside it, it cost the
// predictor 0.30 ms a frame in spills)
//
// The (kv head, chunk) attention items run as in the attention phase but only publish (their
// head's output for a single chunk, else their partial softmax) and count; then 16 o_proj items per
// kv head g (hidden / 16 rows each), as in the predictor's fused phase, wait for head g's count,
// merge its partials and multiply their o_proj tiles, which streamed during the attention. One
// grid barrier less per layer; the residual takes the predictor's accumulator pairs (a: after
// attention, b: after the MLP), layer l the pair (L - l) % 2, so the last layer's `b` is pair 1 and
// the codec head phase may zero pairs 0 and 2 for the predictor while it reads it.
__device__ __forceinline__ Acc talker_acc(const qmk_model& m, int l) { return pred_acc(m, m.talker.num_layers - l); }
__device__ __forceinline__ VecRef talker_in(const qmk_model& m, int l) {
    return l == 0 ? VecRef{dptr<const float>(m.pending), VEC_F32} : VecRef{talker_acc(m, l - 1).b, VEC_ACC};
}

template <bool LONG>
__device__ void run_talker_ao(Ctx& c, int layer) {
    const qmk_model& m = c.F.m();
    const Phase ph{K_AO, layer, -1};
    const qmk_stack& S = m.talker;
    const AttnItems A = attn_items(c.F, ph);
    unsigned* count = dptr<unsigned>(m.attn_count);
    const float* part = dptr<const float>(m.attn_part);
    const float* out = dptr<const float>(m.attn);
    run_attention<LONG, true>(c, ph, PH_AO, false);
    const int sub = tao_subtiles(S), items = tao_items(S);
    const int mine = blockIdx.x < items ? (items - 1 - blockIdx.x) / gridDim.x + 1 : 0;
    float* heads = sm<float>(QMK_SMEM_XS);
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int it = blockIdx.x; it < items; it += gridDim.x) {
        const int g = it / QMK_TAO_GROUPS, r = (it % QMK_TAO_GROUPS) * sub;
        if (threadIdx.x == 0)
            while (ld_acquire(count + g) < (unsigned)A.nchunk) {
            }
        block_sync();
        if (w < 2) {  // query head 2 g + w; the partials were published with a release: ld.cg
            const float4 o = A.nchunk == 1
                                 ? __ldcg(reinterpret_cast<const float4*>(out + (size_t)(2 * g + w) * QMK_HD + lane * 4))
                                 : merge_head(part + (size_t)g * A.nchunk * 2 * QMK_PART + w * QMK_PART, A.nchunk, lane);
            *reinterpret_cast<float4*>(heads + w * QMK_HD + lane * 4) = o;
        }
        block_sync();
        for (int k = 0; k < sub; ++k) {
            if (k) block_sync();  // the row sums' area is rewritten
            // A deferred tile stays ahead of `consumed`: the next one is `deferred` further on.
            ao_rows(c, PH_AO, g, r + k, mine, heads, talker_in(m, layer), talker_acc(m, layer), c.ring.deferred);
        }
    }
    c.stamp(PH_AO, STEP_EPILOGUE);
}

// The talker's layers with fuse_attn_o, from the step's input (qmk_model.pending). The result is
// the last layer's `b` (talker_acc). LONG: the long-context kernel's attention (run_attention).
template <bool LONG>
__device__ void run_talker_fused(Ctx& c) {
    const qmk_model& m = c.F.m();
    const qmk_stack& S = m.talker;
    const int L = S.num_layers, D = S.hidden;
    for (int l = 0; l < L; ++l) {
        const Phase pq{K_QKV, l, -1};
        {
            Operand<2> x;
            load_xn<2>(talker_in(m, l), bfp(c.F.layer(pq).input_norm), D, S.eps, x);
            if (l == 0) zero_acc(talker_acc(m, 0), D);  // a later layer's pair: during the MLP phase before it
            float* qkv = dptr<float>(m.qkv);
            run_mat<2>(c, pq, PH_QKV, x, [&](int u, int j, const float* red) { qkv[u] = row_sum(red, j); });
        }
        c.sync(PH_QKV);
        run_talker_ao<LONG>(c, l);
        c.sync(PH_AO);
        const Acc acc = talker_acc(m, l);
        Operand<2> xm;
        load_xn<2>(VecRef{acc.a, VEC_F32}, bfp(c.F.layer(pq).post_norm), D, S.eps, xm);
        // Every o_proj item has passed its wait (the barrier above); the next layer's attention
        // items count after two more.
        if (blockIdx.x == 0 && (int)threadIdx.x < S.num_kv_heads) dptr<unsigned>(m.attn_count)[threadIdx.x] = 0u;
        if (l + 1 < L) zero_acc(talker_acc(m, l + 1), D);
        const Phase pg{K_GU, l, -1};
        if (D == 2048) run_gu_split<4>(c, pg, PH_MLP, xm, acc.b);
        else run_gu_split<2>(c, pg, PH_MLP, xm, acc.b);
        c.sync(PH_MLP);
    }
}

// ---------------------------------------------------------------------------------------------
// Predictor passes 0 and 1 together (qmk_stack.merge_first)
//
// Pass 0 (the talker hidden) and pass 1 (code 0, layer-0 q/k/v from its table row) both start
// once code 0 is sampled, and position 1 attends only to position 0. So each phase of pass 0
// also computes pass 1: the matrix phases multiply the block's tiles by both vectors in one read
// of each tile (qmk_decode_frame checks that the tiles all fit the ring at once),
// and the fused attention + o_proj item runs position 0 on warps 0-1 and position 1 on warps 2-3.
// The frame has one pass of phases less; the weights are read once for both positions.
// Position 0 keeps pred_acc's pairs (its fused layers 0 .. L - 2); position 1 has two pairs of
// its own (the third and fourth pairs of pres), so pass 2 finds its first pair where the passes
// one after the other leave it.
__device__ __forceinline__ Acc first_acc(const qmk_model& m, int p, int l) {
    if (p == 0) return pred_acc(m, l);
    float* X = dptr<float>(m.pres) + (size_t)(2 + l % 2) * QMK_ACC_PAIR;
    return {X, X + QMK_ACC_STRIDE};
}

// Both positions' operands (load_normed_pair), and dot products of every tile of the block's
// slices with both in one read of each tile (tile_dots_pair). Every tile stays in the ring
// (qmk_decode_frame checks the slices fit it), and the K of a predictor matrix is 1024.
__device__ void dots_pair(Ctx& c, const Geo& g, int rpu, int ntiles, VecRef in0, VecRef in1, const bf16* norm,
                          float* red, float* red1, int id) {
    const qmk_stack& S = c.F.m().pred;
    Operand<2> x;
    float r1;
    float* xs = sm<float>(QMK_SMEM_XS);
    float* ws = sm<float>(QMK_SMEM_WS);
    load_normed_pair<2>(in0, in1, norm, S.hidden, S.eps, x, &r1, norm_scratch(), xs, ws);
    c.stamp(id, STEP_OPERAND);
    for (int t = 0; t < ntiles; ++t) {
        const int n = min(g.per_tile, g.u1 - g.u0 - t * g.per_tile), o = t * g.per_tile * rpu * 4;
        const unsigned char* tile = c.ring.wait(t);
        c.stamp(id, STEP_TILE);
        tile_dots_pair<2>(tile, n, rpu, g.K, x, xs, ws, r1, red + o, red1 + o);
    }
}

// A matrix phase for both positions: `epi(unit, index in the slice, partials 0, partials 1)`.
template <class Epi>
__device__ void run_mat_first(Ctx& c, const Phase& ph, int id, VecRef in0, VecRef in1, const bf16* norm, Epi epi) {
    const Geo g = geo(ph);
    float* red = sm<float>(QMK_SMEM_RED);
    float* red1 = red + (g.u1 - g.u0) * 4;
    dots_pair(c, g, 1, g.ntiles, in0, in1, norm, red, red1, id);
    end_tiles(c, g, id);
    for (int j = threadIdx.x; j < g.u1 - g.u0; j += QMK_THREADS) epi(g.u0 + j, j, red, red1);
    c.stamp(id, STEP_EPILOGUE);
}

// Gate/up with the split down projection (run_gu_split) for both positions: gate/up tiles read
// once for both operands, down_t's once for both activations.
__device__ void run_gu_first(Ctx& c, const Phase& ph, int id, const float* mid0, const float* mid1, const bf16* norm,
                             float* resid0, float* resid1) {
    const Geo g = geo(ph);
    const int units = g.u1 - g.u0;
    float* red = sm<float>(QMK_SMEM_RED);
    float* red1 = red + units * 2 * 4;
    float* acts = sm<float>(QMK_SMEM_ACTS);
    float* acts1 = acts + QMK_ACTS_SECOND;
    dots_pair(c, g, 2, g.ngu, VecRef{mid0, VEC_F32}, VecRef{mid1, VEC_F32}, norm, red, red1, id);
    block_sync();
    c.stamp(id, STEP_DOTS);
    for (int j = threadIdx.x; j < units; j += QMK_THREADS) {
        acts[j] = swiglu(red, j);
        acts1[j] = swiglu(red1, j);
    }
    block_sync();
    // Two columns per thread (hidden 1024): as run_gu_split<2>, with both positions' sums.
    float acc[2][2] = {{0.f, 0.f}, {0.f, 0.f}};
    const int col = threadIdx.x * 2;
    for (int t = g.ngu; t < g.ntiles; ++t) {
        const int r0 = (t - g.ngu) * g.dpt, n = min(g.dpt, units - r0);
        const bf16* tile = reinterpret_cast<const bf16*>(c.ring.wait(t)) + col;
        c.stamp(id, STEP_TILE);
        for (int r = 0; r < n; r += 4) {
            float a[2][4], w[4][2];
            const float4 a4 = *reinterpret_cast<const float4*>(acts + r0 + r);
            const float4 b4 = *reinterpret_cast<const float4*>(acts1 + r0 + r);
            a[0][0] = a4.x, a[0][1] = a4.y, a[0][2] = a4.z, a[0][3] = a4.w;
            a[1][0] = b4.x, a[1][1] = b4.y, a[1][2] = b4.z, a[1][3] = b4.w;
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const uint32_t u = *reinterpret_cast<const uint32_t*>(tile + (size_t)min(r + k, n - 1) * g.K);
                w[k][0] = bf_lo(u), w[k][1] = bf_hi(u);
                if (r + k >= n) a[0][k] = a[1][k] = 0.f;
            }
#pragma unroll
            for (int p = 0; p < 2; ++p)
#pragma unroll
                for (int k = 0; k < 4; ++k)
#pragma unroll
                    for (int e = 0; e < 2; ++e) acc[p][e] = fmaf(a[p][k], w[k][e], acc[p][e]);
        }
    }
    float* resid[2] = {acc_copy(resid0), acc_copy(resid1)};
#pragma unroll
    for (int p = 0; p < 2; ++p) {
        const float b0 = __shfl_down_sync(0xffffffffu, acc[p][0], 1), b1 = __shfl_down_sync(0xffffffffu, acc[p][1], 1);
        if ((threadIdx.x & 1) == 0) red_add4(resid[p] + col, acc[p][0], acc[p][1], b0, b1);
    }
    defer_mlp_tiles(c, g, ph);  // every tile is in the ring (qmk_decode_frame)
    c.stamp(id, STEP_EPILOGUE);
}

// The fused attention + o_proj phase (run_attn_o) for both positions (attention_first_pair).
// `acc0` null: the last layer, where position 0 only appends its K/V rows.
__device__ void run_attn_o_first(Ctx& c, const Phase& ph, int id, bool grouped, VecRef in0, VecRef in1,
                                 const Acc* acc0, const Acc& acc1) {
    const qmk_model& m = c.F.m();
    const qmk_stack& S = m.pred;
    const qmk_layer& L = c.F.layer(ph);
    const int R = ao_row_groups(S), items = ao_items(S), H = S.num_heads, KV = S.num_kv_heads;
    const int mine = blockIdx.x < items ? (items - 1 - blockIdx.x) / gridDim.x + 1 : 0;
    const size_t off = (size_t)ph.layer * KV * S.max_pos * QMK_HD;
    float* heads = sm<float>(QMK_SMEM_XS);  // [position][2 heads][128]
    float* sums = sm<float>(QMK_SMEM_RED);  // [position][64]
    const float* qkv0 = dptr<const float>(m.qkv);
    const int row = threadIdx.x >> 3, part = threadIdx.x & 7;
    for (int it = blockIdx.x; it < items; it += gridDim.x) {
        const int g = it / R, r = it % R;
        c.stamp(id, STEP_TILE);
        const AttnArgs a{qkv0, heads, dptr<float>(S.k_cache) + off, dptr<float>(S.v_cache) + off, bfp(L.q_norm),
                         bfp(L.k_norm), dptr<const float>(S.rope), nullptr, nullptr, 0, H, KV, S.max_pos, S.eps,
                         2 * g, r == 0};
        const float* qkv1 = ph.layer == 0 ? *sm<const float* volatile>(QMK_SMEM_QSRC) : qkv0 + qkv0_width(m);
        if (grouped) wait_head(m, g);
        attention_first_pair(a, qkv0, qkv1, g, heads, heads + 2 * QMK_HD);
        block_sync();
        const bf16* w = reinterpret_cast<const bf16*>(c.ring.wait(0)) + (size_t)row * 2 * QMK_HD;
        float s0 = 0.f, s1 = 0.f;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int col = 8 * part + 64 * i;
            float wv[8], xv[8], yv[8];
            unpack8(*reinterpret_cast<const uint4*>(w + col), wv);
            read8(heads + col, xv);
            read8(heads + 2 * QMK_HD + col, yv);
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                s0 = fmaf(wv[e], xv[e], s0);
                s1 = fmaf(wv[e], yv[e], s1);
            }
        }
#pragma unroll
        for (int o = 4; o; o >>= 1) {
            s0 += __shfl_xor_sync(0xffffffffu, s0, o);
            s1 += __shfl_xor_sync(0xffffffffu, s1, o);
        }
        if (part == 0) {
            sums[row] = s0;
            sums[QMK_AO_ROWS + row] = s1;
        }
        block_sync();
        c.stamp(id, STEP_DOTS);
        if (mine == 1) c.ring.defer(1);
        else c.ring.release(1);
        // ao_rows' epilogue, per position. (Shared through one inlined helper it changed the
        // short kernel's instructions, so it stays written out twice.)
        const int p = threadIdx.x / (QMK_AO_ROWS / 4);
        if (p < 2 && (p == 1 || acc0 != nullptr)) {
            const int k = 4 * (threadIdx.x % (QMK_AO_ROWS / 4)), u = r * QMK_AO_ROWS + k;
            const Acc& acc = p == 0 ? *acc0 : acc1;
            const VecRef in = p == 0 ? in0 : in1;
            float v[4] = {sums[p * QMK_AO_ROWS + k], sums[p * QMK_AO_ROWS + k + 1], sums[p * QMK_AO_ROWS + k + 2],
                          sums[p * QMK_AO_ROWS + k + 3]};
            if (g == 0) {
                float x[4];
                if (in.kind == VEC_BF16) {
                    const uint2 b = *reinterpret_cast<const uint2*>(static_cast<const bf16*>(in.p) + u);
                    x[0] = bf_lo(b.x), x[1] = bf_hi(b.x), x[2] = bf_lo(b.y), x[3] = bf_hi(b.y);
                } else {
                    const float4 f = ld_vec4(static_cast<const float*>(in.p) + u, in.kind);
                    x[0] = f.x, x[1] = f.y, x[2] = f.z, x[3] = f.w;
                }
#pragma unroll
                for (int e = 0; e < 4; ++e) v[e] += x[e];
            }
            red_add4(acc.a + u, v[0], v[1], v[2], v[3]);
            red_add4(acc.b + u, v[0], v[1], v[2], v[3]);
        }
    }
    c.stamp(id, STEP_EPILOGUE);
}

// Passes 0 and 1 (merge_first): `src0` the talker hidden (or its projection), `src1` pass 1's
// input (code 0's embedding row, or its table row's projection). Position 1's output is its
// last layer's `b` (first_acc), the head's input. (Not inlined, the kernel measured 0.02 ms a
// frame slower: bench/NOTES.md, v21.)
__device__ void run_pred_first(Ctx& c, VecRef src0, VecRef src1) {
    const qmk_model& m = c.F.m();
    const qmk_stack& S = m.pred;
    const int L = S.num_layers, D = S.hidden;
    const bool grouped = grouped_qkv(m, 0);
    float* qkv = dptr<float>(m.qkv);
    float* qkv1 = qkv + qkv0_width(m);
    for (int l = 0; l < L; ++l) {
        const Phase pq{K_QKV, l, 0};
        const qmk_layer& Ly = c.F.layer(pq);
        const bool last = l + 1 == L;
        const VecRef in0 = l == 0 ? src0 : VecRef{first_acc(m, 0, l - 1).b, VEC_ACC};
        const VecRef in1 = l == 0 ? src1 : VecRef{first_acc(m, 1, l - 1).b, VEC_ACC};
        if (l == 0) {  // position 1's layer-0 q/k/v is its table row
            Operand<2> x;
            load_xn<2>(in0, bfp(Ly.input_norm), D, S.eps, x);
            run_mat<2>(c, pq, 16 + PH_QKV, x, [&](int u, int j, const float* red) { qkv[u] = row_sum(red, j); });
        } else {
            run_mat_first(c, pq, 16 + PH_QKV, in0, in1, bfp(Ly.input_norm),
                          [&](int u, int j, const float* r0, const float* r1) {
                              qkv[u] = row_sum(r0, j);
                              qkv1[u] = row_sum(r1, j);
                          });
        }
        if (grouped) arrive_head(c, m, 16 + PH_QKV);
        else c.sync(16 + PH_QKV);
        const Acc a0 = first_acc(m, 0, l), a1 = first_acc(m, 1, l);
        run_attn_o_first(c, Phase{K_AO, l, 0}, 16 + PH_AO, grouped, in0, in1, last ? nullptr : &a0, a1);
        c.sync(16 + PH_AO);
        if (grouped) reset_head(m);
        const Phase pg{K_GU, l, 0};
        if (last) {  // position 1 alone; pass 2's first pair zeroed as pass 1's last layer does
            Operand<2> xm;
            load_xn<2>(VecRef{a1.a, VEC_F32}, bfp(Ly.post_norm), D, S.eps, xm);
            zero_acc(pred_acc(m, fused_layer(L, 1, L - 1) + 1), D);
            run_gu_split<2>(c, pg, 16 + PH_MLP, xm, a1.b);
        } else {
            if (l + 1 < L - 1) zero_acc(first_acc(m, 0, l + 1), D);
            zero_acc(first_acc(m, 1, l + 1), D);
            run_gu_first(c, pg, 16 + PH_MLP, a0.a, a1.a, bfp(Ly.post_norm), a0.b, a1.b);
        }
        c.sync(16 + PH_MLP);
    }
}

// A stack of layers at one position; `src` is the stack's input (the residual stream's start).
// LONG: the long-context kernel's attention (run_attention), for the talker.
template <bool LONG>
__device__ void run_stack(Ctx& c, int pass, VecRef src) {
    const qmk_model& m = c.F.m();
    const Phase probe{K_QKV, 0, pass};
    const qmk_stack& S = c.F.stack(probe);
    const int D = S.hidden, nq = S.num_heads * QMK_HD, tid = threadIdx.x;
    const int ph0 = pass < 0 ? 0 : 16;
    float* resid = dptr<float>(m.resid);
    float* mid = dptr<float>(m.mid);
    float* qkv = dptr<float>(m.qkv);
    float* act = dptr<float>(m.act);
    float* own = sm<float>(QMK_SMEM_OWN);
    // The o_proj epilogue adds to the residual rows the block owns (o_proj's output rows; the down
    // phase has the same ones), kept in shared memory: from the stack's input here, then from
    // each q/k/v phase's staged operand, which is the residual stream itself.
    // (Both phases' epilogues index `own` by the unit's index in the slice.)
    {
        const Geo& rows = geo(Phase{K_O, 0, pass});
        for (int i = tid; i < rows.u1 - rows.u0; i += QMK_THREADS)
            own[i] = src.kind == VEC_BF16 ? ld_weight1(static_cast<const bf16*>(src.p) + rows.u0 + i)
                                 : ld_act(static_cast<const float*>(src.p) + rows.u0 + i);
    }
    for (int l = 0; l < S.num_layers; ++l) {
        const Phase pq{K_QKV, l, pass}, pa{K_ATTN, l, pass}, po{K_O, l, pass}, pg{K_GU, l, pass},
            pd{K_DOWN, l, pass};
        const qmk_layer& L = c.F.layer(pq);
        const bool tabled = l == 0 && from_table(m, pass);
        if (!tabled) {
            Operand<2> x;
            load_xn<2>(l == 0 ? src : VecRef{resid, S.split_down ? VEC_ACC : VEC_F32}, bfp(L.input_norm), D,
                       S.eps, x);
            if (l > 0) {  // with a split down projection, no block held these rows' sums before
                const Geo& rows = geo(po);
                const float* xs = sm<const float>(QMK_SMEM_XS);
                for (int i = tid; i < rows.u1 - rows.u0; i += QMK_THREADS) own[i] = xs[rows.u0 + i];
            }
            run_mat<2>(c, pq, ph0 + PH_QKV, x, [&](int u, int j, const float* red) { qkv[u] = row_sum(red, j); });
            QMK_TRACE_ONLY(trace_time(attn_trace_row(pass, l), 15);)
            c.sync(ph0 + PH_QKV);
            QMK_TRACE_ONLY(trace_time(attn_trace_row(pass, l), 16);)
        }
        run_attention<LONG>(c, pa, ph0 + PH_ATTN, tabled);
        // Pass 0's last layer: nothing reads its output, only the K/V rows just appended, and
        // the next pass reads those after many more grid barriers. No barrier here: the blocks
        // without an attention item start the next pass at once.
        if (pass == 0 && l + 1 == S.num_layers) return;
        QMK_TRACE_ONLY(trace_time(attn_trace_row(pass, l), 13);)
        c.sync(ph0 + PH_ATTN);
        QMK_TRACE_ONLY(trace_time(attn_trace_row(pass, l), 14);)
        {
            Operand<2> x;
            load_x<2>(VecRef{dptr<const float>(m.attn), VEC_F32}, nq, x);
            run_mat<2>(c, po, ph0 + PH_O, x, [&](int u, int j, const float* red) {
                const float v = own[j] + row_sum(red, j);
                own[j] = v;
                mid[u] = v;
                resid[u] = v;  // where a split down projection adds its partials (acc_copy)
#pragma unroll
                for (int k = 1; k < QMK_ACC_COPIES; ++k) resid[u + k * QMK_ACC_STRIDE] = 0.f;
            });
        }
        c.sync(ph0 + PH_O);
        Operand<2> xm;
        load_xn<2>(VecRef{mid, VEC_F32}, bfp(L.post_norm), D, S.eps, xm);
        if (S.split_down) {
            if (D == 2048) run_gu_split<4>(c, pg, ph0 + PH_MLP, xm, resid);
            else run_gu_split<2>(c, pg, ph0 + PH_MLP, xm, resid);
            c.sync(ph0 + PH_MLP);
            continue;
        }
        run_mat<2>(c, pg, ph0 + PH_MLP, xm, [&](int u, int j, const float* red) { act[u] = swiglu(red, j); });
        c.sync(ph0 + PH_MLP);
        run_down(c, pd, ph0 + PH_DOWN, act, [&](int u, int j, float sum) { resid[u] = own[j] + sum; });
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

// LONG: the long-context kernel, launched when the talker's attention items outnumber the blocks
// (qmk_decode_frame); it differs only in run_attention. TFUSE: the talker's attention and o_proj
// in one phase (run_talker_fused).
template <bool LONG, bool TFUSE>
__global__ void __launch_bounds__(QMK_BLOCK_THREADS, 1) qmk_frame_kernel(const __grid_constant__ Params P) {
    const qmk_model& m = P.m;
    const qmk_frame& f = P.f;
    const int tid = threadIdx.x;
    {
        const int nt = m.talker.num_layers * (int)(sizeof(qmk_layer) / 8);
        const int np = m.pred.num_layers * (int)(sizeof(qmk_layer) / 8);
        uint64_t* dst = sm<uint64_t>(QMK_SMEM_TABLES);
        for (int i = tid; i < nt + np; i += (int)blockDim.x)
            dst[i] = i < nt ? dptr<const uint64_t>(m.talker.layers)[i] : dptr<const uint64_t>(m.pred.layers)[i - nt];
        if (tid == 0) *sm<int>(QMK_SMEM_STAMPS) = 0;
    }
    Ctx c;
    c.F = Frame{&P};
    if (tid < 16) {
        const int k = tid % 8;
        const Phase ph{k, 0, tid < 8 ? -1 : 0};
        if (k != K_ATTN) sm<Geo>(QMK_SMEM_GEO)[tid] = geo_of(c.F, ph);
    }
    if (tid == 0) ring_init(P.nslot);
    __syncthreads();  // tables, geometry and mbarriers in place for both roles
    if (tid >= QMK_THREADS) {
        // The producer warp (warpgroup on sm_90a): lane 0 streams the frame's tiles; the warps
        // then wait at the block barrier for the consumers to finish (Ring::finish). Each role
        // sets its register count only once it has branched off for good: ptxas holds code after
        // both a decrease and an increase to the smaller count (setmaxnreg ahead of the setup
        // above spilled 752 bytes).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(QMK_PRODUCER_REGS));
#endif
        if (tid == QMK_THREADS) produce(&P);
        __syncwarp();
        __syncthreads();
        return;
    }
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(QMK_CONSUMER_REGS));
#endif
    c.ring.nslot = P.nslot;
    c.ring.consumed = 0;
    c.ring.deferred = 0;
    c.ring.hold_next = c.ring.held = c.ring.held_at = 0;
    if (f.trace != 0) c.sync(PH_START);
    const int has_proj = m.proj_w != 0;

    const int G = m.num_groups, Dt = m.talker.hidden, Dp = m.pred.hidden;
    const long long* force = dptr<const long long>(f.force_codes);

    // Talker step + codec head.
    {
        const Phase ph{K_HEAD_T, 0, -1};
        Operand<2> x;
        if (f.run_talker) {
            const VecRef step_in{dptr<const float>(m.pending), VEC_F32};
            if constexpr (TFUSE) run_talker_fused<LONG>(c);
            else run_stack<LONG>(c, -1, step_in);
            const float* out = TFUSE ? talker_acc(m, m.talker.num_layers - 1).b : dptr<const float>(m.resid);
            load_xn<2>(VecRef{out, TFUSE || m.talker.split_down ? VEC_ACC : VEC_F32},
                       bfp(m.talker.final_norm), Dt, m.talker.eps, x);
            if (blockIdx.x == 0) store_operand<2>(x, Dt, dptr<float>(m.hidden));
        } else {
            load_x<2>(VecRef{dptr<const float>(m.hidden), VEC_F32}, Dt, x);
        }
        float* logits = dptr<float>(m.logits);
        if (m.pred.fuse_attn_o) zero_acc(pred_acc(m, 0), Dp);  // the predictor's first fused layer
        if (m.pred.merge_first) zero_acc(first_acc(m, 1, 0), Dp);  // and pass 1's, merged with it
        run_mat<2>(c, ph, PH_HEAD, x, [&](int u, int j, const float* red) { logits[u] = row_sum(red, j); });
        c.sync(PH_HEAD);
    }
    BlockReducer sred{sm<float>(QMK_SMEM_SRED), 0};
    const TalkerRules rules{dptr<const uint8_t>(m.seen), f.rep_penalty, f.frame < f.min_new_tokens, m.eos_id,
                            f.suppress_start};
    const int c0 = sample_vocab<true>(dptr<const float>(m.logits), m.vocab, f.talker_s, rules,
                                      uniform01(f.seed, (uint32_t)f.frame, 0), sred, sm<float>(QMK_SMEM_SCAN),
                                      sm<unsigned>(QMK_SMEM_TOPK), [&](int step) { c.stamp(PH_SAMPLE, step); });
    if (tid == 0) {
        codes()[0] = c0;
        feed(m, 0, force ? (int)force[0] : c0);
    }
    block_sync();
    if (fed()[0] == m.eos_id || !f.run_predictor) {
        // No barrier follows sampling on this path: wait for every block to finish reading
        // `seen` before block 0 updates it.
        c.sync(PH_SAMPLE);
        publish_frame(m, f, false);
        c.ring.finish();
        return;
    }

    // 15 code-predictor steps (positions 0..15; position 0 is the talker hidden, no head).
    float* proj_out = dptr<float>(m.proj_out);
    for (int pp = 0; pp < G; ++pp) {
        VecRef src{dptr<const float>(m.hidden), VEC_F32};
        if (pp == 1) src = VecRef{bfp(m.talker_emb) + (size_t)fed()[0] * Dt, VEC_BF16};
        if (pp >= 2) src = VecRef{bfp(m.pred_emb[pp - 2]) + (size_t)fed()[pp - 1] * Dt, VEC_BF16};
        if (has_proj && from_table(m, pp)) {
            src = VecRef{*sm<const float* volatile>(QMK_SMEM_QSRC) + qkv0_width(m), VEC_F32};
        } else if (has_proj) {
            Operand<2> x;
            load_x<2>(src, Dt, x);
            const bf16* bias = bfp(m.proj_b);
            run_mat<2>(c, Phase{K_PROJ, 0, pp}, 16 + PH_PROJ, x,
                       [&](int u, int j, const float* red) { proj_out[u] = row_sum(red, j) + ld_weight1(bias + u); });
            c.sync(16 + PH_PROJ);
            src = VecRef{proj_out, VEC_F32};
        }
        const bool fused = m.pred.fuse_attn_o, merged = pp == 0 && m.pred.merge_first;
        const int Lp = m.pred.num_layers;
        if (merged) {  // passes 0 and 1; pass 1 then goes on to its head
            const VecRef src1 = has_proj ? VecRef{*sm<const float* volatile>(QMK_SMEM_QSRC) + qkv0_width(m), VEC_F32}
                                         : VecRef{bfp(m.talker_emb) + (size_t)fed()[0] * Dt, VEC_BF16};
            run_pred_first(c, src, src1);
            pp = 1;
        } else if (fused) {
            run_pred_fused(c, pp, src);
        } else {
            run_stack<false>(c, pp, src);
        }
        if (pp == 0) continue;
        float* lg = dptr<float>(m.pred_logits) + (size_t)(pp - 1) * m.pred_vocab;
        {
            Operand<2> x;
            const float* out = !fused ? dptr<const float>(m.resid)
                               : merged ? first_acc(m, 1, Lp - 1).b
                                        : pred_acc(m, fused_layer(Lp, pp, Lp - 1)).b;
            load_xn<2>(VecRef{out, fused || m.pred.split_down ? VEC_ACC : VEC_F32}, bfp(m.pred.final_norm), Dp,
                       m.pred.eps, x);
            if (blockIdx.x == 0) store_operand<2>(x, Dp, dptr<float>(m.pred_hidden) + (size_t)pp * Dp);
            run_mat<2>(c, Phase{K_HEAD_P, 0, pp}, 16 + PH_HEAD, x, [&](int u, int j, const float* red) { lg[u] = row_sum(red, j); });
        }
        c.sync(16 + PH_HEAD);
        const int code = sample_vocab<false>(lg, m.pred_vocab, f.pred_s, rules, uniform01(f.seed, (uint32_t)f.frame, pp),
                                             sred, sm<float>(QMK_SMEM_SCAN), sm<unsigned>(QMK_SMEM_TOPK),
                                             [&](int step) { c.stamp(16 + PH_SAMPLE, step); });
        if (tid == 0) {
            codes()[pp] = code;
            feed(m, pp, force ? (int)force[pp] : code);
        }
        block_sync();
    }
    publish_frame(m, f, true);
    c.ring.finish();
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

// Floats of the residual accumulators: qmk_model.resid (copies of the widest hidden) and
// qmk_model.pres (four pairs: `a` and the copies of `b`).
extern "C" void qmk_acc_floats(int64_t* out) {
    out[0] = (int64_t)QMK_ACC_COPIES * QMK_ACC_STRIDE;
    out[1] = (int64_t)4 * QMK_ACC_PAIR;
}

extern "C" int64_t qmk_attn_part_floats(int32_t max_pos, int32_t kv_heads) {
    return (int64_t)attn_nchunk(max_pos - 1) * kv_heads * 2 * QMK_PART;
}

struct GridConfig {
    int dev = -1, blocks = 0, smem = 0, nslot = 0, threads = 0;
};

// The model must fit the kernel's fixed shared-memory areas on a grid of `blocks` blocks.
static int model_fits(const qmk_model& m, int blocks) {
    if (m.talker.num_layers + m.pred.num_layers > QMK_MAX_LAYERS) return cudaErrorNotSupported;
    const auto rows = [blocks](int n) { return (n + blocks - 1) / blocks; };
    const int widest = m.talker.hidden > m.pred.hidden ? m.talker.hidden : m.pred.hidden;
    if (rows(widest) > QMK_OWN_MAX) return cudaErrorNotSupported;
    // Row partials of a block's largest slice (gate/up rows count twice).
    const qmk_stack* st[2] = {&m.talker, &m.pred};
    int most = rows(m.vocab > m.pred_vocab ? m.vocab : m.pred_vocab);
    for (int i = 0; i < 2; ++i) {
        const int qkv = rows((st[i]->num_heads + 2 * st[i]->num_kv_heads) * QMK_HD), gu = 2 * rows(st[i]->inter);
        most = most > qkv ? most : qkv;
        most = most > gu ? most : gu;
    }
    return most > QMK_RED_ROWS ? cudaErrorNotSupported : cudaSuccess;
}

// Blocks, shared memory and ring slots on the current device (the shared-memory layout is fixed,
// so this depends on the device alone and is remembered per thread: a launch costs no attribute
// or occupancy query), then whether this model fits (cheap, every call: models differ).
static int grid_config(const qmk_model& m, GridConfig* out) {
    static thread_local GridConfig last;
    int dev = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e != cudaSuccess) return e;
    if (dev != last.dev) {
        int coop = 0, sms = 0, optin = 0;
        if ((e = cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, dev)) != cudaSuccess) return e;
        if (!coop) return cudaErrorNotSupported;
        if ((e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev)) != cudaSuccess) return e;
        if ((e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev)) != cudaSuccess)
            return e;
        // As many 32 KB slots as shared memory allows: the deeper the ring, the further ahead of
        // the barriers the weight reads run.
        int nslot = (optin - QMK_SMEM_SLOTS) / QMK_SLOT_BYTES;
        if (nslot > QMK_MAX_SLOTS) nslot = QMK_MAX_SLOTS;
        if (nslot < 2) return cudaErrorNotSupported;
        const int smem = smem_bytes(nslot);
        // The kernels wait on grid barriers, so every block must be resident at once: one block
        // per SM, and only if the occupancy the driver reports allows it (for all four kernels).
        // The block size is the kernel's launch bound, which depends on the architecture it was
        // built for (QMK_BLOCK_THREADS in the device pass).
        const void* kernels[4] = {(const void*)qmk_frame_kernel<false, false>, (const void*)qmk_frame_kernel<true, false>,
                                  (const void*)qmk_frame_kernel<false, true>, (const void*)qmk_frame_kernel<true, true>};
        cudaFuncAttributes attr;
        if ((e = cudaFuncGetAttributes(&attr, kernels[0])) != cudaSuccess) return e;
        const int threads = attr.maxThreadsPerBlock;
        if (threads < QMK_THREADS + 32) return cudaErrorNotSupported;
        for (const void* k : kernels) {
            e = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
            if (e != cudaSuccess) return e;
            int per_sm = 0;
            e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k, threads, smem);
            if (e != cudaSuccess) return e;
            if (per_sm < 1) return cudaErrorCooperativeLaunchTooLarge;
        }
        last = GridConfig{dev, sms, smem, nslot, threads};
    }
    *out = last;
    if (m.max_blocks > 0 && m.max_blocks < out->blocks) out->blocks = m.max_blocks;
    return model_fits(m, out->blocks);
}

extern "C" int qmk_grid_size(const qmk_model* m, int32_t* blocks, int32_t* smem_bytes) {
    GridConfig g;
    const int e = grid_config(*m, &g);
    if (e != cudaSuccess) return e;
    *blocks = g.blocks;
    *smem_bytes = g.smem;
    return cudaSuccess;
}

// The long-context kernel once the talker's attention items ((kv head, chunk) pairs) outnumber
// the blocks: it runs a block's items at once (run_attention). qmk_model.long_kernel overrides.
static bool uses_long_kernel(const qmk_model& m, const qmk_frame& f, int blocks) {
    if (m.long_kernel != 0) return m.long_kernel > 0;
    return f.run_talker && m.talker.num_kv_heads * attn_nchunk(f.pos) > blocks;
}

extern "C" int qmk_uses_long_kernel(const qmk_model* m, const qmk_frame* f, int32_t* out) {
    GridConfig g;
    const int e = grid_config(*m, &g);
    if (e != cudaSuccess) return e;
    *out = uses_long_kernel(*m, *f, g.blocks) ? 1 : 0;
    return cudaSuccess;
}

// Predictor passes 0 and 1 together (qmk_stack.merge_first) where its conditions hold: fused
// attention + o_proj with the split down projection, a layer-0 table for pass 1, a 1024-wide
// predictor (run_gu_first), and on this grid both positions' row partials and activations in a
// block's areas and every tile of its q/k/v and gate/up slices in the ring at once (the second
// position's dots sweep the same slots again).
static bool merges_first(const qmk_model& m, const GridConfig& g) {
    const qmk_stack& S = m.pred;
    if (!S.merge_first || !S.fuse_attn_o || !S.split_down || m.num_groups < 2 || m.qkv0[0] == 0 || S.hidden != 1024)
        return false;
    const auto ceil_div = [](int a, int b) { return (a + b - 1) / b; };
    const int qkv_rows = ceil_div((S.num_heads + 2 * S.num_kv_heads) * QMK_HD, g.blocks);
    const int rows = qkv_rows > 4 * QMK_HD / QMK_QKV_GROUP ? qkv_rows : 4 * QMK_HD / QMK_QKV_GROUP;
    const int units = ceil_div(S.inter, g.blocks);
    if (2 * rows > QMK_RED_ROWS || 4 * units > QMK_RED_ROWS) return false;
    const int per_row = QMK_SLOT_BYTES / (2 * S.hidden);  // q/k/v rows, or down_t rows, per tile
    const int gu = ceil_div(units, per_row / 2) + ceil_div(units, per_row);
    return ceil_div(rows, per_row) <= g.nslot && gu <= g.nslot;
}

extern "C" int qmk_merges_first_passes(const qmk_model* m, int32_t* out) {
    GridConfig g;
    const int e = grid_config(*m, &g);
    if (e != cudaSuccess) return e;
    *out = merges_first(*m, g) ? 1 : 0;
    return cudaSuccess;
}

// The talker's attention and o_proj in one phase (run_talker_fused) where asked for: with the split
// down projection (its accumulators), and where every o_proj item has a block of its own
// (tao_items: 128), in the short and the long-context kernel alike. With
// 64-row items the 1.7B's 256 on 132 blocks, two a block one after the other, ran 0.022 ms a step
// slower than its o_proj phase (bench/NOTES.md, v25); its items are 128 rows since.
// QMK_NO_TALKER_FUSE builds never fuse (A/B timing of the same build).
static bool talker_fuses(const qmk_model& m, const qmk_frame& f, int blocks) {
#ifdef QMK_NO_TALKER_FUSE
    return false;
#else
    return m.talker.fuse_attn_o && m.talker.split_down && f.run_talker && tao_items(m.talker) <= blocks;
#endif
}

extern "C" int qmk_uses_talker_fusion(const qmk_model* m, const qmk_frame* f, int32_t* out) {
    GridConfig g;
    const int e = grid_config(*m, &g);
    if (e != cudaSuccess) return e;
    *out = talker_fuses(*m, *f, g.blocks) ? 1 : 0;
    return cudaSuccess;
}

extern "C" int qmk_decode_frame(const qmk_model* m, const qmk_frame* f, uint64_t stream) {
    GridConfig g;
    const int e = grid_config(*m, &g);
    if (e != cudaSuccess) return e;
    Params p;
    p.m = *m;
    p.m.pred.merge_first = merges_first(*m, g) ? 1 : 0;
    const bool long_kernel = uses_long_kernel(*m, *f, g.blocks);
    p.m.talker.fuse_attn_o = talker_fuses(*m, *f, g.blocks) ? 1 : 0;
    p.f = *f;
    p.nslot = g.nslot;
    void* args[] = {&p};
    const void* kernels[2][2] = {{(const void*)qmk_frame_kernel<false, false>, (const void*)qmk_frame_kernel<false, true>},
                                 {(const void*)qmk_frame_kernel<true, false>, (const void*)qmk_frame_kernel<true, true>}};
    const void* kernel = kernels[long_kernel][p.m.talker.fuse_attn_o];
    return cudaLaunchCooperativeKernel(kernel, dim3(g.blocks), dim3(g.threads), args, (size_t)g.smem,
                                       reinterpret_cast<cudaStream_t>(stream));
}

#ifdef QMK_TRACE_ATTN
// The talker attention trace (QMK_TRACE_ATTN builds): [layer][block][QMK_DBG_SLOTS] int64.
extern "C" int qmk_attn_trace_read(void* dst, int64_t bytes) {
    return (int)cudaMemcpyFromSymbol(dst, qmk_attn_trace, (size_t)bytes);
}
extern "C" int qmk_grid_trace_read(void* dst, int64_t bytes) {
    return (int)cudaMemcpyFromSymbol(dst, qmk_grid_trace, (size_t)bytes);
}
extern "C" int qmk_attn_trace_clear(void) {
    void* p = nullptr;
    cudaError_t e = cudaGetSymbolAddress(&p, qmk_attn_trace);
    if (e == cudaSuccess) e = cudaMemset(p, 0, sizeof(qmk_attn_trace));
    if (e == cudaSuccess) e = cudaGetSymbolAddress(&p, qmk_grid_trace);
    return (int)(e != cudaSuccess ? e : cudaMemset(p, 0, sizeof(qmk_grid_trace)));
}
#endif

extern "C" const char* qmk_error_string(int code) { return cudaGetErrorString((cudaError_t)code); }
