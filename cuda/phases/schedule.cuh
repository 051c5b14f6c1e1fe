// The phase schedule: launch parameters, the phase kinds and trace ids, the frame's list of phases
// (first_phase, next_phase: the one list the producer and the consumers both walk), the launch view
// shared by both roles (Frame), and each block's slice of every matrix phase (Geo, geo_of),
// computed once per launch into shared memory. Fused-item counts (ao_items, tao_items) and the
// grouped q/k/v test (grouped_qkv) live here because both roles need them.
//
// Part of the qwen_mk.cu translation unit (included there in order, not on its own).

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
// round-robin (pred_fused.cuh, run_attn_o).
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
