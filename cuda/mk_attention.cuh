// Decode attention for one new position, in fp32: QK-norm, rotate-half RoPE, KV-cache append and
// a softmax split over position chunks of QMK_CHUNK. A work item is (kv head g, chunk c); the K/V
// rows of its cached positions arrive in a streamed tile (they are known before the q/k/v
// projections finish), the new position's k and v are computed here. With several chunks the
// last item of a head to finish merges the partial softmaxes.
#pragma once

#include "mk_util.cuh"

#define QMK_HD 128
#define QMK_CHUNK 32   // positions per item: K and V rows of a full chunk fill one 32 KB slot
#define QMK_PART 130   // m, l, acc[128] per (kv head, chunk, q head)
#define QMK_ATTN_SMEM_FLOATS (4 * QMK_HD + 2 * QMK_CHUNK + 32 + 2 * 2 * QMK_HD)

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

// One (kv head, chunk) item; `tile` holds the chunk's cached K rows then V rows (null when the
// chunk has none). `sm` holds QMK_ATTN_SMEM_FLOATS floats.
__device__ __noinline__ void attention_item(const AttnArgs& a, int g, int c, int nchunk, const float* tile, float* sm) {
    float* vecs = sm;                     // [4][128]: q0, q1, k (normed + roped), v (raw)
    float* sc = vecs + 4 * QMK_HD;        // [2][QMK_CHUNK] scores, then probabilities
    float* misc = sc + 2 * QMK_CHUNK;     // [0..15] sum of squares per warp, [16..19] m/l, [20] flag
    float* pv = misc + 32;                // [2 halves][2 heads][128]
    const int t = threadIdx.x, lane = t & 31, w = t >> 5;
    const int vi = t >> 7, d = t & (QMK_HD - 1);
    const int H = a.num_heads, KV = a.num_kv_heads, pos = a.pos;
    const int j0 = c * QMK_CHUNK, j1 = min(pos + 1, j0 + QMK_CHUNK), n = j1 - j0;
    const int ncached = min(j1, pos) - j0;  // rows in the tile; the new position (if here) is last
    const bool last = c == nchunk - 1;

    // vi 0, 1: the two query heads of kv head g; 2: its key; 3: its value.
    const int row = vi < 2 ? 2 * g + vi : vi == 2 ? H + g : H + KV + g;
    const float raw = ld_act(a.qkv + (size_t)row * QMK_HD + d);
    float wn = 0.f, cs = 0.f, sn = 0.f;
    if (vi < 3) {
        wn = ld_weight1((vi < 2 ? a.q_norm : a.k_norm) + d);
        cs = __ldg(a.rope + (size_t)pos * QMK_HD + (d & 63));
        sn = __ldg(a.rope + (size_t)pos * QMK_HD + 64 + (d & 63));
    }
    const float ss = warp_sum(raw * raw);
    block_sync();  // the previous item's readers of `sm` are done
    if (lane == 0) misc[w] = ss;
    block_sync();
    if (vi < 3) {
        const float tot = (misc[vi * 4] + misc[vi * 4 + 1]) + (misc[vi * 4 + 2] + misc[vi * 4 + 3]);
        vecs[vi * QMK_HD + d] = (raw * rsqrtf(tot / (float)QMK_HD + a.eps)) * wn;
    }
    block_sync();
    float y = raw;
    if (vi < 3) {
        // x * cos + rotate_half(x) * sin, unfused like the reference's three elementwise ops.
        const float x = vecs[vi * QMK_HD + d];
        const float rot = d < 64 ? -vecs[vi * QMK_HD + d + 64] : vecs[vi * QMK_HD + d - 64];
        y = __fadd_rn(__fmul_rn(x, cs), __fmul_rn(rot, sn));
    }
    block_sync();
    vecs[vi * QMK_HD + d] = y;
    if (last && vi >= 2) (vi == 2 ? a.kc : a.vc)[((size_t)g * a.max_pos + pos) * QMK_HD + d] = y;
    block_sync();

    // Scores: warp w takes positions w and w + 16 of the chunk; lane owns 4 dims.
    const float scale = 0.08838834764831845f;  // 1 / sqrt(128)
    const float* tk = tile;
    const float* tv = tile + (size_t)ncached * QMK_HD;
    {
        const float4 q0 = *reinterpret_cast<const float4*>(vecs + lane * 4);
        const float4 q1 = *reinterpret_cast<const float4*>(vecs + QMK_HD + lane * 4);
        for (int i = w; i < n; i += QMK_WARPS) {
            const float* kr = i < ncached ? tk + (size_t)i * QMK_HD : vecs + 2 * QMK_HD;
            const float4 k = *reinterpret_cast<const float4*>(kr + lane * 4);
            float s0 = q0.x * k.x;
            s0 = fmaf(q0.y, k.y, s0);
            s0 = fmaf(q0.z, k.z, s0);
            s0 = fmaf(q0.w, k.w, s0);
            float s1 = q1.x * k.x;
            s1 = fmaf(q1.y, k.y, s1);
            s1 = fmaf(q1.z, k.z, s1);
            s1 = fmaf(q1.w, k.w, s1);
            s0 = warp_sum(s0);
            s1 = warp_sum(s1);
            if (lane == 0) {
                sc[i] = s0 * scale;
                sc[QMK_CHUNK + i] = s1 * scale;
            }
        }
    }
    block_sync();
    if (w < 2) {
        const float s = lane < n ? sc[w * QMK_CHUNK + lane] : -INFINITY;
        const float m = warp_max(s);
        const float p = lane < n ? expf(s - m) : 0.f;
        const float l = warp_sum(p);
        sc[w * QMK_CHUNK + lane] = p;
        if (lane == 0) {
            misc[16 + w * 2] = m;
            misc[17 + w * 2] = l;
        }
    }
    block_sync();
    {
        // P.V: thread t takes head (t >> 7) & 1, dim d, positions of parity t >> 8.
        const int h = (t >> 7) & 1, half = t >> 8;
        float o = 0.f;
        for (int i = half; i < n; i += 2) {
            const float v = i < ncached ? tv[(size_t)i * QMK_HD + d] : vecs[3 * QMK_HD + d];
            o = fmaf(sc[h * QMK_CHUNK + i], v, o);
        }
        pv[half * 2 * QMK_HD + h * QMK_HD + d] = o;
    }
    block_sync();
    const int h = t >> 7;  // for t < 256
    const float acc = t < 2 * QMK_HD ? pv[t] + pv[2 * QMK_HD + t] : 0.f;
    if (nchunk == 1) {
        if (t < 2 * QMK_HD) a.out[(size_t)(2 * g + h) * QMK_HD + d] = acc / misc[17 + h * 2];
        return;
    }
    float* mine = a.part + ((size_t)(g * nchunk + c) * 2) * QMK_PART;
    if (t < 2 * QMK_HD) {
        mine[h * QMK_PART + 2 + d] = acc;
        if (d == 0) {
            mine[h * QMK_PART] = misc[16 + h * 2];
            mine[h * QMK_PART + 1] = misc[17 + h * 2];
        }
    }
    __threadfence();
    block_sync();
    if (t == 0) {
        const unsigned prev = atomicAdd(a.count + g, 1u);
        misc[20] = prev == (unsigned)(nchunk - 1) ? 1.f : 0.f;
    }
    block_sync();
    if (misc[20] == 0.f) return;
    __threadfence();
    if (t < 2 * QMK_HD) {
        const float* base = a.part + (size_t)g * nchunk * 2 * QMK_PART + h * QMK_PART;
        float M = -INFINITY;
        for (int cc = 0; cc < nchunk; ++cc) M = fmaxf(M, __ldcg(base + (size_t)cc * 2 * QMK_PART));
        float L = 0.f, O = 0.f;
        for (int cc = 0; cc < nchunk; ++cc) {
            const float* p = base + (size_t)cc * 2 * QMK_PART;
            const float e = expf(__ldcg(p) - M);
            L = fmaf(__ldcg(p + 1), e, L);
            O = fmaf(__ldcg(p + 2 + d), e, O);
        }
        a.out[(size_t)(2 * g + h) * QMK_HD + d] = O / L;
    }
    if (t == 0) a.count[g] = 0u;
}
