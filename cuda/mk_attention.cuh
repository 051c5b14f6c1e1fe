// Decode attention for one new position: QK-norm, rotate-half RoPE, KV-cache append and a
// split-over-positions softmax whose partial results are merged by the last block to finish.
#pragma once

#include "mk_matvec.cuh"
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

// Smem use: 5*128 + 2*QMK_MAX_CHUNK + 32 + QMK_WARPS*256 floats (< 6144).
__device__ void attention_item(const AttnArgs& a, int g, int c, int chunk, int nchunk, float* sm) {
    float* nrm = sm;                       // [3][128] normalised q0, q1, k
    float* qf = nrm + 3 * QMK_HD;          // [2][128] roped q
    float* s = qf + 2 * QMK_HD;            // [2][QMK_MAX_CHUNK] scores then probabilities
    float* misc = s + 2 * QMK_MAX_CHUNK;   // [16] sumsq partials, [4] m/l, [1] last flag
    float* o = misc + 32;                  // [QMK_WARPS][2 heads][128] per-warp P.V partials
    const int t = threadIdx.x, lane = t & 31, w = t >> 5;
    const int vi = t >> 7, d = t & (QMK_HD - 1);
    const int npos = a.pos + 1;
    const bool last = c == nchunk - 1;
    const int H = a.num_heads, KV = a.num_kv_heads;
    const size_t head_base = (size_t)g * a.max_pos * QMK_HD;

    __syncthreads();
    // vi 0,1: the two query heads of kv head g; 2: its key; 3: its value.
    // Every global read of the prologue is issued up front so their latencies overlap.
    float raw = 0.f, wn = 0.f, cs = 0.f, sn = 0.f;
    if (vi < 3) {
        wn = ld_weight1((vi < 2 ? a.q_norm : a.k_norm) + d);
        cs = ld_weight1(a.rope + (size_t)a.pos * QMK_HD + (d & 63));
        sn = ld_weight1(a.rope + (size_t)a.pos * QMK_HD + 64 + (d & 63));
    }
    if (vi < 2) raw = ld_act(a.qkv + (size_t)(g * 2 + vi) * QMK_HD + d);
    else if (vi == 2) raw = ld_act(a.qkv + (size_t)H * QMK_HD + g * QMK_HD + d);
    const float ss = warp_sum(raw * raw);
    if (lane == 0) misc[w] = ss;
    __syncthreads();
    if (vi < 3) {
        const float tot = misc[vi * 4] + misc[vi * 4 + 1] + misc[vi * 4 + 2] + misc[vi * 4 + 3];
        const float r = rsqrtf(tot / (float)QMK_HD + a.eps);
        nrm[vi * QMK_HD + d] = bf16_round(bf16_round(raw * r) * wn);
    }
    __syncthreads();
    if (vi < 3) {
        // x*cos + rotate_half(x)*sin with a rounding after each op, as the torch reference does
        // in bf16; the cos/sin table holds torch's own bf16 values.
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
        // Up to 8 key rows per warp in flight before the first use.
        for (int jb = j0 + w; jb < j1; jb += 8 * QMK_WARPS) {
            uint2 kr[8];
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                const int j = jb + e * QMK_WARPS;
                if (j < j1) kr[e] = __ldcg(reinterpret_cast<const uint2*>(a.kc + head_base + (size_t)j * QMK_HD + lane * 4));
            }
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                const int j = jb + e * QMK_WARPS;
                if (j < j1) {
                    const float k0 = bf_lo(kr[e].x), k1 = bf_hi(kr[e].x), k2 = bf_lo(kr[e].y), k3 = bf_hi(kr[e].y);
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
        // P.V: warp w takes keys w, w + 16, ...; lane owns dims 4*lane..4*lane+3 of both heads;
        // up to 8 value rows per warp in flight. Partials are summed in warp order (deterministic).
        float o0[4] = {0.f, 0.f, 0.f, 0.f}, o1[4] = {0.f, 0.f, 0.f, 0.f};
        const bf16* vbase = a.vc + head_base + (size_t)j0 * QMK_HD + lane * 4;
        for (int ib = w; ib < n; ib += 8 * QMK_WARPS) {
            uint2 vr[8];
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                const int i = ib + e * QMK_WARPS;
                if (i < n) vr[e] = __ldcg(reinterpret_cast<const uint2*>(vbase + (size_t)i * QMK_HD));
            }
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                const int i = ib + e * QMK_WARPS;
                if (i < n) {
                    const float p0 = s[i], p1 = s[QMK_MAX_CHUNK + i];
                    const float v[4] = {bf_lo(vr[e].x), bf_hi(vr[e].x), bf_lo(vr[e].y), bf_hi(vr[e].y)};
#pragma unroll
                    for (int k = 0; k < 4; ++k) {
                        o0[k] = fmaf(p0, v[k], o0[k]);
                        o1[k] = fmaf(p1, v[k], o1[k]);
                    }
                }
            }
        }
        float* ow = o + w * 2 * QMK_HD;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            ow[lane * 4 + k] = o0[k];
            ow[QMK_HD + lane * 4 + k] = o1[k];
        }
    }
    __syncthreads();
    if (t < 2 * QMK_HD) {
        float acc = 0.f;
        for (int ww = 0; ww < QMK_WARPS; ++ww) acc += o[ww * 2 * QMK_HD + t];
        o[t] = acc;  // each t reads only index t of warp 0's slot before writing it
    }
    __syncthreads();
    if (nchunk == 1) {
        if (t < 2 * QMK_HD) {
            const int h = t >> 7;
            const float acc = o[t];
            st_bf16(a.out + (size_t)(g * 2 + h) * QMK_HD + d, acc / misc[17 + h * 2]);
        }
        return;
    }
    float* mine = a.part + ((size_t)(g * nchunk + c) * 2) * QMK_PART;
    if (t < 2 * QMK_HD) {
        const int h = t >> 7;
        mine[h * QMK_PART + 2 + d] = o[t];
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

// ---------------------------------------------------------------------------------------------
// Short contexts (the code predictor's 16 positions, the talker's first steps): every block
// computes all heads itself from shared memory and goes straight on to o_proj. That removes a
// grid barrier and the partial-merge round trips per layer, at the price of each block reading
// the (small) KV cache from L2.

#define QMK_LOCAL_MAX 16                 // positions (pos + 1) handled this way
#define QMK_KV_STRIDE (QMK_HD + 8)       // bf16 row stride in smem; the pad spreads banks
#define QMK_LOCAL_SMEM_BYTES(H, KV) \
    (2 * (KV) * QMK_LOCAL_MAX * QMK_KV_STRIDE * 2 + ((H) + (KV)) * QMK_HD * 4 + (H) * 32 * 4)

__device__ __forceinline__ bool attn_is_local(int pos) { return pos + 1 <= QMK_LOCAL_MAX; }

// out: [H*128] fp32 holding the bf16-rounded attention output (the o_proj operand).
__device__ void attention_local(const AttnArgs& a, float* out, unsigned char* scratch) {
    const int H = a.num_heads, KV = a.num_kv_heads, npos = a.pos + 1;
    const int t = threadIdx.x, lane = t & 31, w = t >> 5;
    unsigned short* ks = reinterpret_cast<unsigned short*>(scratch);       // [KV][16][stride]
    unsigned short* vs = ks + KV * QMK_LOCAL_MAX * QMK_KV_STRIDE;
    float* nrm = reinterpret_cast<float*>(vs + KV * QMK_LOCAL_MAX * QMK_KV_STRIDE);  // [H+KV][128]
    float* pr = nrm + (H + KV) * QMK_HD;                                    // [H][32]
    const unsigned short* kc = reinterpret_cast<const unsigned short*>(a.kc);
    const unsigned short* vc = reinterpret_cast<const unsigned short*>(a.vc);

    __syncthreads();
    // Cached rows j < pos straight from L2 into shared memory.
    const int per_row = QMK_HD / 8;
    for (int i = t; i < KV * a.pos * per_row; i += QMK_THREADS) {
        const int g = i / (a.pos * per_row), rem = i % (a.pos * per_row), j = rem / per_row, c = rem % per_row;
        const size_t src = ((size_t)g * a.max_pos + j) * QMK_HD + c * 8;
        const int dst = (g * QMK_LOCAL_MAX + j) * QMK_KV_STRIDE + c * 8;
        cp_async16(ks + dst, kc + src);
        cp_async16(vs + dst, vc + src);
    }
    cp_async_commit();
    // QK-norm + RoPE: warp w owns vectors w, w + 16, ... (q heads, then k heads); lane owns 4 dims.
    const int d0 = lane * 4;
    float cs[4], sn[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        cs[e] = ld_weight1(a.rope + (size_t)a.pos * QMK_HD + ((d0 + e) & 63));
        sn[e] = ld_weight1(a.rope + (size_t)a.pos * QMK_HD + 64 + ((d0 + e) & 63));
    }
    for (int vi = w; vi < H + KV; vi += QMK_WARPS) {
        const bf16* src = a.qkv + (size_t)vi * QMK_HD + d0;  // q heads then k heads are contiguous
        const bf16* wn = (vi < H ? a.q_norm : a.k_norm) + d0;
        float x[4], ss = 0.f;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            x[e] = ld_act(src + e);
            ss += x[e] * x[e];
        }
        ss = warp_sum(ss);
        const float r = rsqrtf(ss / (float)QMK_HD + a.eps);
        float* row = nrm + vi * QMK_HD;
#pragma unroll
        for (int e = 0; e < 4; ++e) row[d0 + e] = bf16_round(bf16_round(x[e] * r) * ld_weight1(wn + e));
        __syncwarp();
        float y[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int d = d0 + e;
            const float rot = d < 64 ? -row[d + 64] : row[d - 64];
            y[e] = bf16_round(bf16_round(row[d] * cs[e]) + bf16_round(rot * sn[e]));
        }
        __syncwarp();
#pragma unroll
        for (int e = 0; e < 4; ++e) row[d0 + e] = y[e];
        if (vi >= H) {
            const int g = vi - H;
            const unsigned short* vsrc = reinterpret_cast<const unsigned short*>(a.qkv) + (size_t)(H + KV + g) * QMK_HD + d0;
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const unsigned short kb = __bfloat16_as_ushort(__float2bfloat16_rn(y[e]));
                const unsigned short vb = __ldcg(vsrc + e);
                ks[(g * QMK_LOCAL_MAX + a.pos) * QMK_KV_STRIDE + d0 + e] = kb;
                vs[(g * QMK_LOCAL_MAX + a.pos) * QMK_KV_STRIDE + d0 + e] = vb;
                if (blockIdx.x == 0) {  // one block appends to the cache for later positions
                    reinterpret_cast<unsigned short*>(a.kc)[((size_t)g * a.max_pos + a.pos) * QMK_HD + d0 + e] = kb;
                    reinterpret_cast<unsigned short*>(a.vc)[((size_t)g * a.max_pos + a.pos) * QMK_HD + d0 + e] = vb;
                }
            }
        }
    }
    cp_async_wait_all();
    __syncthreads();
    // Warp h: scores (lane = key), softmax, then P.V (lane = 4 dims) for query head h.
    const float scale = rsqrtf((float)QMK_HD);
    for (int h = w; h < H; h += QMK_WARPS) {
        const int g = h / (H / KV);
        const float* q = nrm + h * QMK_HD;
        float s = -INFINITY;
        if (lane < npos) {
            const unsigned short* krow = ks + (g * QMK_LOCAL_MAX + lane) * QMK_KV_STRIDE;
            float acc = 0.f;
#pragma unroll 4
            for (int c = 0; c < QMK_HD / 8; ++c) {
                const uint4 kv = *reinterpret_cast<const uint4*>(krow + c * 8);
                acc += dot8(kv, q + c * 8);
            }
            s = acc * scale;
        }
        const float m = warp_max(s);
        const float p = lane < npos ? expf(s - m) : 0.f;
        const float l = warp_sum(p);
        pr[h * 32 + lane] = p;
        __syncwarp();
        float o[4] = {0.f, 0.f, 0.f, 0.f};
        for (int j = 0; j < npos; ++j) {
            const float pj = pr[h * 32 + j];
            const uint2 vv = *reinterpret_cast<const uint2*>(vs + (g * QMK_LOCAL_MAX + j) * QMK_KV_STRIDE + d0);
            o[0] = fmaf(pj, bf_lo(vv.x), o[0]);
            o[1] = fmaf(pj, bf_hi(vv.x), o[1]);
            o[2] = fmaf(pj, bf_lo(vv.y), o[2]);
            o[3] = fmaf(pj, bf_hi(vv.y), o[3]);
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) out[h * QMK_HD + d0 + e] = bf16_round(o[e] / l);
    }
    __syncthreads();
}
