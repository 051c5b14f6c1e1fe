// Decode attention for one new position, in fp32: QK-norm, rotate-half RoPE, KV-cache append and
// a softmax split over position chunks of QMK_CHUNK. A work item is (kv head g, chunk c); the K/V
// rows of its cached positions arrive in a streamed tile (they are known before the q/k/v
// projections finish), the new position's k and v are computed here. With several chunks the
// last item of a head to finish merges the partial softmaxes.
#pragma once

#include "mk_util.cuh"

#define QMK_HD 128
#define QMK_CHUNK 32   // positions per item: K and V rows of a full chunk fill one 32 KB slot
#define QMK_PART 132   // per (kv head, chunk, q head): m, l, 2 pad, acc[128] (16-byte aligned)
#define QMK_ATTN_SMEM_FLOATS 4  // merge flags, one per warp pair (attention_item)

struct AttnArgs {
    const float* qkv;  // [H*128 q | KV*128 k | KV*128 v], raw projections (the q/k/v phase's output)
    float* out;        // [H*128]
    float* kc;         // this layer's [KV][max_pos][128]
    float* vc;
    const bf16* q_norm;
    const bf16* k_norm;
    const float* rope;  // [max_pos][2][64]
    float* part;
    unsigned* count;
    int pos, num_heads, num_kv_heads, max_pos;
    float eps;
    int out_head0;  // head h's output goes to out + (h - out_head0) * 128
    int append;     // store the new position's k and v (one of the items that compute a head)
    // 1 (the talker's fused attention + o_proj, phases/talker_fused.cuh run_talker_ao): every item publishes
    // its result (the head's output for a single chunk, else its partial softmax) and adds 1 to
    // its head's count with a release; no item merges (the o_proj items do, after an acquire).
    int publish = 0;
#ifdef QMK_TRACE_ATTN
    long long* dbg = nullptr;  // this item's trace row (talker items only; see qmk_attn_trace)
#endif
};

// QMK_TRACE_ATTN builds (bench/attention_trace.py) stamp the steps of the talker's attention
// items: a clock read ordered after a value it waits for (a volatile store of the value first,
// in-order issue does the rest), one row of QMK_DBG_SLOTS per (layer, block); phases/stack.cuh adds the
// q/k/v and attention barriers' times to the same rows, and every grid barrier's to its own table.
// QMK_TRACE_ONLY(...) compiles its statement in trace builds only.
#ifdef QMK_TRACE_ATTN
#define QMK_TRACE_ONLY(...) __VA_ARGS__
#define QMK_DBG_SLOTS 24
#define QMK_DBG_BLOCKS 160  // blocks traced (more than any GPU here has SMs)
#define QMK_DBG_LAYERS 64
__device__ long long qmk_attn_trace[QMK_DBG_LAYERS * QMK_DBG_BLOCKS * QMK_DBG_SLOTS];
__device__ __forceinline__ long long dbg_gtime() {
    long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
__device__ __forceinline__ void dbg_mark(long long* row, int k, float dep) {
    if (row == nullptr) return;
    *reinterpret_cast<volatile float*>(row + 23) = dep;
    long long t;
    asm volatile("mov.u64 %0, %%clock64;" : "=l"(t)::"memory");
    row[k] = t;
}
// This block's row for a talker layer (pass < 0), or null.
__device__ __forceinline__ long long* attn_trace_row(int pass, int layer) {
    return pass < 0 && blockIdx.x < QMK_DBG_BLOCKS
               ? qmk_attn_trace + ((size_t)layer * QMK_DBG_BLOCKS + blockIdx.x) * QMK_DBG_SLOTS
               : nullptr;
}
// Thread 0: slot k of `row` = the global timer.
__device__ __forceinline__ void trace_time(long long* row, int k) {
    if (row && threadIdx.x == 0) row[k] = dbg_gtime();
}
#define QMK_DBG(k, dep) dbg_mark(dbgrow, k, dep)
#else
#define QMK_TRACE_ONLY(...)
#define QMK_DBG(k, dep) ((void)0)
#endif

__host__ __device__ __forceinline__ int attn_nchunk(int pos) { return (pos + QMK_CHUNK) / QMK_CHUNK; }

// One (kv head, chunk) item, computed by warp pair `pair` (warps 2 pair and 2 pair + 1: query
// heads 2g and 2g + 1; lane l owns dims 4l .. 4l + 3) with warp shuffles only: the item is a
// short dependent chain, and block-wide barriers inside it would cost more than its arithmetic.
// The long-context kernel runs several items of a block at once, one per pair (merge flag
// sm[pair], named barrier 2 + pair); otherwise pair 0. `qkv`: the position's raw projections
// (a.qkv, or a predictor pass's table row). `tile` holds the chunk's cached K rows
// then V rows (null when the chunk has none). Other warps return at once; the caller's block
// barrier follows.
__device__ __forceinline__ float4 ld_f4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ float dot4(float4 a, float4 b) {
    float s = a.x * b.x;
    s = fmaf(a.y, b.y, s);
    s = fmaf(a.z, b.z, s);
    return fmaf(a.w, b.w, s);
}

// QK-norm then rotate-half RoPE of a 128-dim head held 4 dims per lane: dim d + 64 lives in lane
// l ^ 16. x * cos + rotate_half(x) * sin unfused, like the reference's three elementwise ops.
__device__ __forceinline__ float4 norm_rope(float4 x, const bf16* w, const float* rope, float eps, int lane) {
    const float r = rsqrtf(warp_sum(dot4(x, x)) / (float)QMK_HD + eps);
    const uint2 wb = __ldg(reinterpret_cast<const uint2*>(w + lane * 4));
    const float4 n = make_float4((x.x * r) * bf_lo(wb.x), (x.y * r) * bf_hi(wb.x), (x.z * r) * bf_lo(wb.y),
                                 (x.w * r) * bf_hi(wb.y));
    const float4 cs = __ldg(reinterpret_cast<const float4*>(rope + ((lane * 4) & 63)));
    const float4 sn = __ldg(reinterpret_cast<const float4*>(rope + 64 + ((lane * 4) & 63)));
    const float sign = lane < 16 ? -1.f : 1.f;
    const float4 p = make_float4(sign * __shfl_xor_sync(0xffffffffu, n.x, 16), sign * __shfl_xor_sync(0xffffffffu, n.y, 16),
                                 sign * __shfl_xor_sync(0xffffffffu, n.z, 16), sign * __shfl_xor_sync(0xffffffffu, n.w, 16));
    return make_float4(__fadd_rn(__fmul_rn(n.x, cs.x), __fmul_rn(p.x, sn.x)),
                       __fadd_rn(__fmul_rn(n.y, cs.y), __fmul_rn(p.y, sn.y)),
                       __fadd_rn(__fmul_rn(n.z, cs.z), __fmul_rn(p.z, sn.z)),
                       __fadd_rn(__fmul_rn(n.w, cs.w), __fmul_rn(p.w, sn.w)));
}

// A head's output dims 4 lane .. 4 lane + 3 from its chunks' partials (m, l, acc), merged in chunk
// order. `base`: the head's partial of chunk 0; chunk c lies 2 c QMK_PART floats further.
__device__ __forceinline__ float4 merge_head(const float* base, int nchunk, int lane) {
    float M = -INFINITY;
    for (int cc = 0; cc < nchunk; ++cc) M = fmaxf(M, __ldcg(base + (size_t)cc * 2 * QMK_PART));
    float L = 0.f;
    float4 O = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int cc = 0; cc < nchunk; ++cc) {
        const float* pc = base + (size_t)cc * 2 * QMK_PART;
        const float e = expf(__ldcg(pc) - M);
        L = fmaf(__ldcg(pc + 1), e, L);
        const float4 acc = __ldcg(reinterpret_cast<const float4*>(pc + 4 + lane * 4));
        O.x = fmaf(acc.x, e, O.x);
        O.y = fmaf(acc.y, e, O.y);
        O.z = fmaf(acc.z, e, O.z);
        O.w = fmaf(acc.w, e, O.w);
    }
    return make_float4(O.x / L, O.y / L, O.z / L, O.w / L);
}

template <int HALF>
__device__ __forceinline__ void reduce_step(float* part, int lane) {
    const bool upper = lane & HALF;
#pragma unroll
    for (int i = 0; i < HALF; ++i) {
        const float send = upper ? part[i] : part[i + HALF];
        const float keep = upper ? part[i + HALF] : part[i];
        part[i] = keep + __shfl_xor_sync(0xffffffffu, send, HALF);
    }
}

__device__ void attention_item(const AttnArgs& a, const float* qkv, int g, int c, int nchunk, const float* tile, float* sm,
                               int pair = 0) {
    const int w = (threadIdx.x >> 5) - 2 * pair, lane = threadIdx.x & 31;
    if (w < 0 || w >= 2) return;
    const int H = a.num_heads, KV = a.num_kv_heads, pos = a.pos;
    const int j0 = c * QMK_CHUNK, j1 = min(pos + 1, j0 + QMK_CHUNK), n = j1 - j0;
    const int ncached = min(j1, pos) - j0;  // rows in the tile; the new position (if here) is last
    const bool last = c == nchunk - 1;
#ifdef QMK_TRACE_ATTN
    long long* dbgrow = (w == 0 && lane == 0) ? a.dbg : nullptr;
    QMK_DBG(2, 0.f);
#endif
    const float* rope = a.rope + (size_t)pos * QMK_HD;
    const float4 q = norm_rope(ld_act4(qkv + (size_t)(2 * g + w) * QMK_HD + lane * 4), a.q_norm, rope, a.eps, lane);
    const float4 k = norm_rope(ld_act4(qkv + (size_t)(H + g) * QMK_HD + lane * 4), a.k_norm, rope, a.eps, lane);
    const float4 v = ld_act4(qkv + (size_t)(H + KV + g) * QMK_HD + lane * 4);
    QMK_DBG(3, q.x + k.x + v.x);
    if (last && w == 0 && a.append) {
        const size_t row = ((size_t)g * a.max_pos + pos) * QMK_HD + lane * 4;
        *reinterpret_cast<float4*>(a.kc + row) = k;
        *reinterpret_cast<float4*>(a.vc + row) = v;
    }
    // Scores: every lane's partial dot for every position, then a transposing reduction that
    // leaves position i's full score in lane i (31 shuffles for 32 positions).
    const float* tk = tile;
    const float* tv = tile + (size_t)ncached * QMK_HD;
    float part[QMK_CHUNK];
#pragma unroll
    for (int i = 0; i < QMK_CHUNK; ++i) {
        part[i] = 0.f;
        if (i < ncached) part[i] = dot4(q, ld_f4(tk + (size_t)i * QMK_HD + lane * 4));
        else if (i == ncached && i < n) part[i] = dot4(q, k);
    }
    reduce_step<16>(part, lane);
    reduce_step<8>(part, lane);
    reduce_step<4>(part, lane);
    reduce_step<2>(part, lane);
    reduce_step<1>(part, lane);
    QMK_DBG(4, part[0]);
    const float scale = 0.08838834764831845f;  // 1 / sqrt(128)
    const float s = lane < n ? part[0] * scale : -INFINITY;
    const float m = warp_max(s);
    const float p = lane < n ? expf(s - m) : 0.f;
    const float l = warp_sum(p);
    QMK_DBG(5, l);
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int i = 0; i < n; ++i) {
        const float pi = __shfl_sync(0xffffffffu, p, i);
        const float4 vi = i < ncached ? ld_f4(tv + (size_t)i * QMK_HD + lane * 4) : v;
        o.x = fmaf(pi, vi.x, o.x);
        o.y = fmaf(pi, vi.y, o.y);
        o.z = fmaf(pi, vi.z, o.z);
        o.w = fmaf(pi, vi.w, o.w);
    }
    QMK_DBG(6, o.x + o.y + o.z + o.w);
    const int h = 2 * g + w;
    if (nchunk == 1) {
        *reinterpret_cast<float4*>(a.out + (size_t)(h - a.out_head0) * QMK_HD + lane * 4) =
            make_float4(o.x / l, o.y / l, o.z / l, o.w / l);
        if (a.publish) {
            asm volatile("bar.sync %0, 64;" ::"r"(2 + pair) : "memory");
            if (w == 0 && lane == 0) red_add_release(a.count + g);
        }
        return;
    }
    // Several chunks: publish (m, l, acc); the last item of this kv head to finish merges.
    float* mine = a.part + ((size_t)(g * nchunk + c) * 2 + w) * QMK_PART;
    *reinterpret_cast<float4*>(mine + 4 + lane * 4) = o;
    if (lane == 0) {
        mine[0] = m;
        mine[1] = l;
    }
    // One acquire-release count: the pair's barrier orders both warps' stores before lane 0's
    // release, and the merging item reads the partials with ld.cg after its acquire and the pair's
    // barrier. (Two __threadfence, as before v24, compile to MEMBAR.SC.GPU + CCTL.IVALL each: the
    // talker step was 0.02 ms slower; bench/NOTES.md, v24.)
    asm volatile("bar.sync %0, 64;" ::"r"(2 + pair) : "memory");  // the pair's two warps
    if (a.publish) {
        if (w == 0 && lane == 0) red_add_release(a.count + g);
        return;
    }
    if (w == 0 && lane == 0) {
        const unsigned prev = atom_add_acq_rel(a.count + g, 1u);
        sm[pair] = prev == (unsigned)(nchunk - 1) ? 1.f : 0.f;
    }
    asm volatile("bar.sync %0, 64;" ::"r"(2 + pair) : "memory");
    QMK_DBG(7, sm[pair]);
    if (sm[pair] == 0.f) return;
    const float* base = a.part + (size_t)g * nchunk * 2 * QMK_PART + w * QMK_PART;
    const float4 merged = merge_head(base, nchunk, lane);
    *reinterpret_cast<float4*>(a.out + (size_t)h * QMK_HD + lane * 4) = merged;
    QMK_DBG(8, merged.x);
#ifdef QMK_TRACE_ATTN
    if (dbgrow) dbgrow[9] = 1;
#endif
    if (w == 0 && lane == 0) a.count[g] = 0u;
}

// KV head g at positions 0 and 1 of the code predictor, run together (phases/pred_first.cuh, merge_first),
// on warps 0-3 (others return at once). Warps 0-1: position 0, which attends only to itself, so
// its heads' output is its V row (what the softmax of a single score gives, exactly); warp 0
// stores its K/V rows. Warps 2-3: position 1 (query heads 2g, 2g + 1), which attends to position
// 0 (its K row normed and roped here again) and itself. `qkv0`, `qkv1`: the positions' raw
// projections; a.rope is position 0's row.
__device__ void attention_first_pair(const AttnArgs& a, const float* qkv0, const float* qkv1, int g, float* out0,
                                     float* out1) {
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (w >= 4) return;
    const int H = a.num_heads, KV = a.num_kv_heads;
    const float4 v0 = ld_act4(qkv0 + (size_t)(H + KV + g) * QMK_HD + lane * 4);
    const float4 k0 = norm_rope(ld_act4(qkv0 + (size_t)(H + g) * QMK_HD + lane * 4), a.k_norm, a.rope, a.eps, lane);
    if (w < 2) {
        if (w == 0 && a.append) {
            const size_t row = (size_t)g * a.max_pos * QMK_HD + lane * 4;
            *reinterpret_cast<float4*>(a.kc + row) = k0;
            *reinterpret_cast<float4*>(a.vc + row) = v0;
        }
        *reinterpret_cast<float4*>(out0 + (size_t)w * QMK_HD + lane * 4) = v0;
        return;
    }
    const float* rope1 = a.rope + QMK_HD;
    const float4 q = norm_rope(ld_act4(qkv1 + (size_t)(2 * g + w - 2) * QMK_HD + lane * 4), a.q_norm, rope1, a.eps, lane);
    const float4 k1 = norm_rope(ld_act4(qkv1 + (size_t)(H + g) * QMK_HD + lane * 4), a.k_norm, rope1, a.eps, lane);
    const float4 v1 = ld_act4(qkv1 + (size_t)(H + KV + g) * QMK_HD + lane * 4);
    if (w == 2 && a.append) {
        const size_t row = ((size_t)g * a.max_pos + 1) * QMK_HD + lane * 4;
        *reinterpret_cast<float4*>(a.kc + row) = k1;
        *reinterpret_cast<float4*>(a.vc + row) = v1;
    }
    const float scale = 0.08838834764831845f;  // 1 / sqrt(128)
    const float s0 = warp_sum(dot4(q, k0)) * scale, s1 = warp_sum(dot4(q, k1)) * scale;
    const float m = fmaxf(s0, s1);
    const float p0 = expf(s0 - m), p1 = expf(s1 - m), l = p0 + p1;
    *reinterpret_cast<float4*>(out1 + (size_t)(w - 2) * QMK_HD + lane * 4) =
        make_float4(fmaf(p1, v1.x, p0 * v0.x) / l, fmaf(p1, v1.y, p0 * v0.y) / l, fmaf(p1, v1.z, p0 * v0.z) / l,
                    fmaf(p1, v1.w, p0 * v0.w) / l);
}
