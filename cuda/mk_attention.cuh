// Decode attention for one new position, in fp32: QK-norm, rotate-half RoPE, KV-cache append and
// a softmax split over position chunks of QMK_CHUNK. A work item is (kv head g, chunk c); the K/V
// rows of its cached positions arrive in a streamed tile (they are known before the q/k/v
// projections finish), the new position's k and v are computed here. With several chunks the
// last item of a head to finish merges the partial softmaxes.
#pragma once

#include "mk_util.cuh"
#include "qwen_mk.h"

#define QMK_HD 128
#define QMK_CHUNK 32   // positions per item: K and V rows of a full chunk fill one 32 KB slot
#define QMK_PART 132   // per (kv head, chunk, q head): m, l, 2 pad, acc[128] (16-byte aligned)
#define QMK_ATTN_SMEM_FLOATS 4  // the merge flag

struct AttnArgs {
    const float* qkv;  // [H*128 q | KV*128 k | KV*128 v], raw projections
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
};

__host__ __device__ __forceinline__ int attn_nchunk(int pos) { return (pos + QMK_CHUNK) / QMK_CHUNK; }

// One (kv head, chunk) item, computed by warps 0 and 1 (query heads 2g and 2g + 1; lane l owns
// dims 4l .. 4l + 3) with warp shuffles only: the item is a short dependent chain, and block-wide
// barriers inside it would cost more than its arithmetic. `tile` holds the chunk's cached K rows
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

__device__ void attention_item(const AttnArgs& a, int g, int c, int nchunk, const float* tile, float* sm) {
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (w >= 2) return;
    const int H = a.num_heads, KV = a.num_kv_heads, pos = a.pos;
    const int j0 = c * QMK_CHUNK, j1 = min(pos + 1, j0 + QMK_CHUNK), n = j1 - j0;
    const int ncached = min(j1, pos) - j0;  // rows in the tile; the new position (if here) is last
    const bool last = c == nchunk - 1;
    const float* rope = a.rope + (size_t)pos * QMK_HD;
    const float4 q = norm_rope(ld_act4(a.qkv + (size_t)(2 * g + w) * QMK_HD + lane * 4), a.q_norm, rope, a.eps, lane);
    const float4 k = norm_rope(ld_act4(a.qkv + (size_t)(H + g) * QMK_HD + lane * 4), a.k_norm, rope, a.eps, lane);
    const float4 v = ld_act4(a.qkv + (size_t)(H + KV + g) * QMK_HD + lane * 4);
    if (last && w == 0) {
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
    const float scale = 0.08838834764831845f;  // 1 / sqrt(128)
    const float s = lane < n ? part[0] * scale : -INFINITY;
    const float m = warp_max(s);
    const float p = lane < n ? expf(s - m) : 0.f;
    const float l = warp_sum(p);
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int i = 0; i < n; ++i) {
        const float pi = __shfl_sync(0xffffffffu, p, i);
        const float4 vi = i < ncached ? ld_f4(tv + (size_t)i * QMK_HD + lane * 4) : v;
        o.x = fmaf(pi, vi.x, o.x);
        o.y = fmaf(pi, vi.y, o.y);
        o.z = fmaf(pi, vi.z, o.z);
        o.w = fmaf(pi, vi.w, o.w);
    }
    const int h = 2 * g + w;
    if (nchunk == 1) {
        *reinterpret_cast<float4*>(a.out + (size_t)h * QMK_HD + lane * 4) = make_float4(o.x / l, o.y / l, o.z / l, o.w / l);
        return;
    }
    // Several chunks: publish (m, l, acc); the last item of this kv head to finish merges.
    float* mine = a.part + ((size_t)(g * nchunk + c) * 2 + w) * QMK_PART;
    *reinterpret_cast<float4*>(mine + 4 + lane * 4) = o;
    if (lane == 0) {
        mine[0] = m;
        mine[1] = l;
    }
    __threadfence();
    asm volatile("bar.sync 2, 64;" ::: "memory");  // warps 0 and 1
    if (threadIdx.x == 0) {
        const unsigned prev = atomicAdd(a.count + g, 1u);
        sm[0] = prev == (unsigned)(nchunk - 1) ? 1.f : 0.f;
    }
    asm volatile("bar.sync 2, 64;" ::: "memory");
    if (sm[0] == 0.f) return;
    __threadfence();
    const float* base = a.part + (size_t)g * nchunk * 2 * QMK_PART + w * QMK_PART;
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
    *reinterpret_cast<float4*>(a.out + (size_t)h * QMK_HD + lane * 4) = make_float4(O.x / L, O.y / L, O.z / L, O.w / L);
    if (threadIdx.x == 0) a.count[g] = 0u;
}

// The code predictor's attention, every query head, computed by every block: its context is at
// most QMK_MAX_GROUPS positions, so instead of an attention phase (items on 8 blocks, then a grid
// barrier before o_proj) each block reads the few cached K/V rows from L2 itself and leaves all
// heads' outputs in shared memory, where they become the o_proj operand. The whole block works
// on it, so the cached rows arrive in two round trips (K with the q/k/v read, V during the
// softmax), not one per position. Layout: QMK_PRED_KV kv heads of 2 query heads each.
//   `qs` (H * 128 floats): normalised, rotated q, then the output (all heads);
//   `cur` (2 * KV * 128 floats): the new position's k (normalised, rotated) and v;
//   `ps` (H * 16 floats): scores, then probabilities.
// `store_kv`: this block appends the new position's k and v to the cache (one block does; the
// others read them from the next pass on, after grid barriers).
#define QMK_PRED_KV 8
__device__ __forceinline__ float4 ld_row4(const float* p) { return __ldcg(reinterpret_cast<const float4*>(p)); }

__device__ __noinline__ void attention_all_heads(const AttnArgs& a, bool store_kv, float* qs, float* cur, float* ps) {
    constexpr int KV = QMK_PRED_KV, H = 2 * KV, P = QMK_MAX_GROUPS;
    static_assert(KV * P * 4 == QMK_THREADS && KV * 64 == QMK_THREADS, "one thread per (kv head, position, quarter)");
    const int t = threadIdx.x, w = t >> 5, lane = t & 31, pos = a.pos;
    const size_t head_rows = (size_t)a.max_pos * QMK_HD;  // one kv head's cache rows
    // Scores layout: thread (g, j, quarter) dots dims [32 quarter, 32 quarter + 32) of position j.
    const int sg = t / (P * 4), sj = (t / 4) % P, sq = t % 4;
    float4 kr[8];
    if (sj < pos) {
        const float* row = a.kc + sg * head_rows + (size_t)sj * QMK_HD + sq * 32;
#pragma unroll
        for (int i = 0; i < 8; ++i) kr[i] = ld_row4(row + 4 * i);
    }
    // The new position: q of head w, k and v of kv head w (warps < KV).
    const float* rope = a.rope + (size_t)pos * QMK_HD;
    {
        const float4 q = norm_rope(ld_act4(a.qkv + (size_t)w * QMK_HD + lane * 4), a.q_norm, rope, a.eps, lane);
        *reinterpret_cast<float4*>(qs + w * QMK_HD + lane * 4) = q;
        if (w < KV) {
            const float4 k = norm_rope(ld_act4(a.qkv + (size_t)(H + w) * QMK_HD + lane * 4), a.k_norm, rope, a.eps, lane);
            const float4 v = ld_act4(a.qkv + (size_t)(H + KV + w) * QMK_HD + lane * 4);
            *reinterpret_cast<float4*>(cur + w * QMK_HD + lane * 4) = k;
            *reinterpret_cast<float4*>(cur + (KV + w) * QMK_HD + lane * 4) = v;
            if (store_kv) {
                const size_t row = w * head_rows + (size_t)pos * QMK_HD + lane * 4;
                *reinterpret_cast<float4*>(a.kc + row) = k;
                *reinterpret_cast<float4*>(a.vc + row) = v;
            }
        }
    }
    block_sync();
    if (sj == pos) {
#pragma unroll
        for (int i = 0; i < 8; ++i) kr[i] = *reinterpret_cast<const float4*>(cur + sg * QMK_HD + sq * 32 + 4 * i);
    }
    float s0 = 0.f, s1 = 0.f;
    if (sj <= pos) {
        const float* q0 = qs + (2 * sg) * QMK_HD + sq * 32;
        const float* q1 = q0 + QMK_HD;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            s0 += dot4(*reinterpret_cast<const float4*>(q0 + 4 * i), kr[i]);
            s1 += dot4(*reinterpret_cast<const float4*>(q1 + 4 * i), kr[i]);
        }
    }
    s0 += __shfl_xor_sync(0xffffffffu, s0, 1);
    s1 += __shfl_xor_sync(0xffffffffu, s1, 1);
    s0 += __shfl_xor_sync(0xffffffffu, s0, 2);
    s1 += __shfl_xor_sync(0xffffffffu, s1, 2);
    const float scale = 0.08838834764831845f;  // 1 / sqrt(128)
    if (sq == 0 && sj <= pos) {
        ps[(2 * sg) * P + sj] = s0 * scale;
        ps[(2 * sg + 1) * P + sj] = s1 * scale;
    }
    block_sync();
    // V rows for the weighted sum, in flight during the softmax (after the barrier, so they never
    // hold registers while kr does): thread (g, dim pair) reads its two dims of every cached row.
    const int vg = t / 64, vd = (t % 64) * 2;
#ifndef QMK_PRED_V_HALVES
    float2 vr[P];
#pragma unroll
    for (int j = 0; j < P; ++j)
        if (j < pos) vr[j] = __ldcg(reinterpret_cast<const float2*>(a.vc + vg * head_rows + (size_t)j * QMK_HD + vd));
#endif
    {  // softmax of head w over positions 0..pos (lanes 0..15)
        const bool in = lane < P && lane <= pos;
        const float s = in ? ps[w * P + lane] : -INFINITY;
        const float m = warp_max(s);
        const float e = in ? expf(s - m) : 0.f;
        const float l = warp_sum(e);
        if (in) ps[w * P + lane] = e / l;
    }
    block_sync();
    {
        const float2 vn = *reinterpret_cast<const float2*>(cur + (KV + vg) * QMK_HD + vd);
        const float* p0 = ps + (2 * vg) * P;
        const float* p1 = p0 + P;
        float2 o0 = make_float2(0.f, 0.f), o1 = make_float2(0.f, 0.f);
#ifdef QMK_PRED_V_HALVES
        // Comparison build: V rows in two batches of 8 (fewer registers, one more round trip).
#pragma unroll
        for (int h = 0; h < P; h += 8) {
            float2 vr[8];
#pragma unroll
            for (int j = 0; j < 8; ++j)
                if (h + j < pos)
                    vr[j] = __ldcg(reinterpret_cast<const float2*>(a.vc + vg * head_rows + (size_t)(h + j) * QMK_HD + vd));
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                if (h + j <= pos) {
                    const float2 v = h + j < pos ? vr[j] : vn;
                    o0.x = fmaf(p0[h + j], v.x, o0.x);
                    o0.y = fmaf(p0[h + j], v.y, o0.y);
                    o1.x = fmaf(p1[h + j], v.x, o1.x);
                    o1.y = fmaf(p1[h + j], v.y, o1.y);
                }
            }
        }
#else
#pragma unroll
        for (int j = 0; j < P; ++j) {
            if (j <= pos) {
                const float2 v = j < pos ? vr[j] : vn;
                o0.x = fmaf(p0[j], v.x, o0.x);
                o0.y = fmaf(p0[j], v.y, o0.y);
                o1.x = fmaf(p1[j], v.x, o1.x);
                o1.y = fmaf(p1[j], v.y, o1.y);
            }
        }
#endif
        // qs is free: every thread passed the barrier after its last read of q.
        *reinterpret_cast<float2*>(qs + (2 * vg) * QMK_HD + vd) = o0;
        *reinterpret_cast<float2*>(qs + (2 * vg + 1) * QMK_HD + vd) = o1;
    }
}
