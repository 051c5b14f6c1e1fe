// Decode attention for one new position: QK-norm, rotate-half RoPE, KV-cache append and a
// split-over-positions softmax whose partial results are merged by the last block to finish.
#pragma once

#include "mk_util.cuh"

#define QMK_HD 128
#define QMK_MAX_CHUNK 256
#define QMK_MIN_CHUNK 32
#define QMK_PART 130  // m, l, acc[128] per (kv head, chunk, q head)

struct AttnArgs {
    const bf16* qkv;   // [H*128 q | KV*128 k | KV*128 v], raw projections
    bf16* out;         // [H*128]
    bf16* kc;          // this layer's [KV][max_pos][128]
    bf16* vc;
    const bf16* q_norm;
    const bf16* k_norm;
    const bf16* rope;  // [max_pos][2][64]
    float* part;
    unsigned* count;
    int pos, num_heads, num_kv_heads, max_pos;
    float eps;
};

__device__ __forceinline__ int attn_chunk(int npos, int kv_heads) {
    const int per = max(1, (int)gridDim.x / kv_heads);
    int chunk = max(QMK_MIN_CHUNK, (npos + per - 1) / per);
    return min(chunk, QMK_MAX_CHUNK);
}

// Number of attention work items (kv head, position chunk); the others idle or prefetch.
__device__ __forceinline__ int attn_items(int pos, int kv_heads) {
    const int npos = pos + 1;
    const int chunk = attn_chunk(npos, kv_heads);
    return kv_heads * ((npos + chunk - 1) / chunk);
}

// Smem use: 4*128 + 2*QMK_MAX_CHUNK + 512 + 32 floats.
__device__ __noinline__ void attention_item(const AttnArgs& a, int g, int c, int chunk, int nchunk, float* sm) {
    float* nrm = sm;                       // [3][128] normalised q0, q1, k
    float* qf = nrm + 3 * QMK_HD;          // [2][128] roped q
    float* s = qf + 2 * QMK_HD;            // [2][QMK_MAX_CHUNK] scores then probabilities
    float* o = s + 2 * QMK_MAX_CHUNK;      // [2 halves][2 heads][128]
    float* misc = o + 4 * QMK_HD;          // [16] sumsq partials, [4] m/l, [1] last flag
    const int t = threadIdx.x, lane = t & 31, w = t >> 5;
    const int vi = t >> 7, d = t & (QMK_HD - 1);
    const int npos = a.pos + 1;
    const bool last = c == nchunk - 1;
    const int H = a.num_heads, KV = a.num_kv_heads;
    const size_t head_base = (size_t)g * a.max_pos * QMK_HD;

    __syncthreads();
    // vi 0,1: the two query heads of kv head g; 2: its key; 3: its value.
    float raw = 0.f;
    if (vi < 2) raw = ld_act(a.qkv + (size_t)(g * 2 + vi) * QMK_HD + d);
    else if (vi == 2) raw = ld_act(a.qkv + (size_t)H * QMK_HD + g * QMK_HD + d);
    const float ss = warp_sum(raw * raw);
    if (lane == 0) misc[w] = ss;
    __syncthreads();
    if (vi < 3) {
        const float tot = misc[vi * 4] + misc[vi * 4 + 1] + misc[vi * 4 + 2] + misc[vi * 4 + 3];
        const float r = rsqrtf(tot / (float)QMK_HD + a.eps);
        const float wn = ld_weight1((vi < 2 ? a.q_norm : a.k_norm) + d);
        nrm[vi * QMK_HD + d] = bf16_round(bf16_round(raw * r) * wn);
    }
    __syncthreads();
    if (vi < 3) {
        // x*cos + rotate_half(x)*sin with a rounding after each op, as the torch reference does
        // in bf16; the cos/sin table holds torch's own bf16 values.
        const float cs = ld_weight1(a.rope + (size_t)a.pos * QMK_HD + (d & 63));
        const float sn = ld_weight1(a.rope + (size_t)a.pos * QMK_HD + 64 + (d & 63));
        const float x = nrm[vi * QMK_HD + d];
        const float rot = d < 64 ? -nrm[vi * QMK_HD + d + 64] : nrm[vi * QMK_HD + d - 64];
        const float y = bf16_round(bf16_round(x * cs) + bf16_round(rot * sn));
        if (vi < 2) qf[vi * QMK_HD + d] = y;
        else if (last) st_bf16(a.kc + head_base + (size_t)a.pos * QMK_HD + d, y);
    } else if (last) {
        reinterpret_cast<unsigned short*>(a.vc)[head_base + (size_t)a.pos * QMK_HD + d] =
            __ldcg(reinterpret_cast<const unsigned short*>(a.qkv) + (size_t)(H + KV) * QMK_HD + g * QMK_HD + d);
    }
    __syncthreads();

    const int j0 = c * chunk, j1 = min(npos, j0 + chunk), n = j1 - j0;
    const float scale = rsqrtf((float)QMK_HD);
    {
        const float4 q0 = *reinterpret_cast<const float4*>(qf + lane * 4);
        const float4 q1 = *reinterpret_cast<const float4*>(qf + QMK_HD + lane * 4);
        for (int j = j0 + w; j < j1; j += QMK_WARPS) {
            const uint2 kv = __ldcg(reinterpret_cast<const uint2*>(a.kc + head_base + (size_t)j * QMK_HD + lane * 4));
            const float k0 = bf_lo(kv.x), k1 = bf_hi(kv.x), k2 = bf_lo(kv.y), k3 = bf_hi(kv.y);
            float s0 = q0.x * k0 + q0.y * k1 + q0.z * k2 + q0.w * k3;
            float s1 = q1.x * k0 + q1.y * k1 + q1.z * k2 + q1.w * k3;
            s0 = warp_sum(s0);
            s1 = warp_sum(s1);
            if (lane == 0) {
                s[j - j0] = s0 * scale;
                s[QMK_MAX_CHUNK + j - j0] = s1 * scale;
            }
        }
    }
    __syncthreads();
    if (w < 2) {
        float* sh = s + w * QMK_MAX_CHUNK;
        float m = -INFINITY;
        for (int i = lane; i < n; i += 32) m = fmaxf(m, sh[i]);
        m = warp_max(m);
        float l = 0.f;
        for (int i = lane; i < n; i += 32) {
            const float p = expf(sh[i] - m);
            sh[i] = p;
            l += p;
        }
        l = warp_sum(l);
        if (lane == 0) {
            misc[16 + w * 2] = m;
            misc[17 + w * 2] = l;
        }
    }
    __syncthreads();
    {
        const int half = t >> 8, h = (t >> 7) & 1;
        const float* ph = s + h * QMK_MAX_CHUNK;
        const bf16* vbase = a.vc + head_base + (size_t)j0 * QMK_HD + d;
        float acc = 0.f;
#pragma unroll 4
        for (int i = half; i < n; i += 2) acc = fmaf(ph[i], ld_act(vbase + (size_t)i * QMK_HD), acc);
        o[t] = acc;
    }
    __syncthreads();
    if (nchunk == 1) {
        if (t < 2 * QMK_HD) {
            const int h = t >> 7;
            const float acc = o[t] + o[2 * QMK_HD + t];
            st_bf16(a.out + (size_t)(g * 2 + h) * QMK_HD + d, acc / misc[17 + h * 2]);
        }
        return;
    }
    float* mine = a.part + ((size_t)(g * nchunk + c) * 2) * QMK_PART;
    if (t < 2 * QMK_HD) {
        const int h = t >> 7;
        mine[h * QMK_PART + 2 + d] = o[t] + o[2 * QMK_HD + t];
        if (d == 0) {
            mine[h * QMK_PART] = misc[16 + h * 2];
            mine[h * QMK_PART + 1] = misc[17 + h * 2];
        }
    }
    __threadfence();
    __syncthreads();
    if (t == 0) {
        const unsigned prev = atomicAdd(a.count + g, 1u);
        misc[20] = prev == (unsigned)(nchunk - 1) ? 1.f : 0.f;
    }
    __syncthreads();
    if (misc[20] == 0.f) return;
    __threadfence();
    if (t < 2 * QMK_HD) {
        const int h = t >> 7;
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
        st_bf16(a.out + (size_t)(g * 2 + h) * QMK_HD + d, O / L);
    }
    if (t == 0) a.count[g] = 0u;
}

__device__ __forceinline__ void attention_phase(const AttnArgs& a, float* sm) {
    const int npos = a.pos + 1;
    const int chunk = attn_chunk(npos, a.num_kv_heads);
    const int nchunk = (npos + chunk - 1) / chunk;
    const int items = a.num_kv_heads * nchunk;
    for (int it = blockIdx.x; it < items; it += gridDim.x) attention_item(a, it / nchunk, it % nchunk, chunk, nchunk, sm);
}
