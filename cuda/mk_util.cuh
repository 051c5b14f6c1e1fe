// Loads, bf16 rounding and block reductions shared by every phase of the megakernel.
#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

#define QMK_THREADS 512
#define QMK_WARPS (QMK_THREADS / 32)

typedef __nv_bfloat16 bf16;

// The torch reference rounds to bf16 after every op; we round at the same points so the two
// paths differ only by accumulation order.
__device__ __forceinline__ float bf16_round(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }
__device__ __forceinline__ float bf_lo(uint32_t u) { return __uint_as_float(u << 16); }
__device__ __forceinline__ float bf_hi(uint32_t u) { return __uint_as_float(u & 0xffff0000u); }

// Weights never change during a launch and each byte is used once: read-only path, no L1 line.
__device__ __forceinline__ uint4 ld_weight(const bf16* p) {
    uint4 r;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
        : "l"(p));
    return r;
}

__device__ __forceinline__ float ld_weight1(const bf16* p) {
    return __uint_as_float(((uint32_t)__ldg(reinterpret_cast<const unsigned short*>(p))) << 16);
}

// Activations are written by other blocks of the same launch; L1 is not coherent, so read them
// from L2.
__device__ __forceinline__ float ld_act(const bf16* p) {
    return __uint_as_float(((uint32_t)__ldcg(reinterpret_cast<const unsigned short*>(p))) << 16);
}

__device__ __forceinline__ void st_bf16(bf16* p, float v) { *p = __float2bfloat16_rn(v); }

// Hint L2 to fetch [p, p + bytes) now; the matching loads come a phase later.
__device__ __forceinline__ void prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Block reductions over a [2][QMK_WARPS] scratch with alternating halves: a half is rewritten
// only two calls later, after a barrier every thread passed once done reading it, so one
// __syncthreads per reduction suffices.
struct BlockReducer {
    float* buf;  // 2 * QMK_WARPS floats
    int parity;

    __device__ float* slot() {
        float* s = buf + parity * QMK_WARPS;
        parity ^= 1;
        return s;
    }

    __device__ float sum(float v) {
        v = warp_sum(v);
        float* s = slot();
        if ((threadIdx.x & 31) == 0) s[threadIdx.x >> 5] = v;
        __syncthreads();
        float t = 0.f;
#pragma unroll
        for (int i = 0; i < QMK_WARPS; ++i) t += s[i];
        return t;
    }

    __device__ unsigned umax(unsigned v) {
        v = __reduce_max_sync(0xffffffffu, v);
        unsigned* s = reinterpret_cast<unsigned*>(slot());
        if ((threadIdx.x & 31) == 0) s[threadIdx.x >> 5] = v;
        __syncthreads();
        unsigned t = 0;
#pragma unroll
        for (int i = 0; i < QMK_WARPS; ++i) t = max(t, s[i]);
        return t;
    }

    __device__ unsigned umin(unsigned v) {
        v = __reduce_min_sync(0xffffffffu, v);
        unsigned* s = reinterpret_cast<unsigned*>(slot());
        if ((threadIdx.x & 31) == 0) s[threadIdx.x >> 5] = v;
        __syncthreads();
        unsigned t = 0xffffffffu;
#pragma unroll
        for (int i = 0; i < QMK_WARPS; ++i) t = min(t, s[i]);
        return t;
    }

    __device__ unsigned count(unsigned v) {
        v = __reduce_add_sync(0xffffffffu, v);
        unsigned* s = reinterpret_cast<unsigned*>(slot());
        if ((threadIdx.x & 31) == 0) s[threadIdx.x >> 5] = v;
        __syncthreads();
        unsigned t = 0;
#pragma unroll
        for (int i = 0; i < QMK_WARPS; ++i) t += s[i];
        return t;
    }
};

// Qwen3 RMSNorm of a bf16 vector (n <= 4 * QMK_THREADS) into shared memory as fp32 holding bf16
// values: w * bf16(x * rsqrt(mean(x^2) + eps)), rounded like the torch module. x and w are
// loaded together so their latencies overlap.
__device__ __forceinline__ void rms_norm_to_smem(const bf16* x, const bf16* w, int n, float eps, float* xs,
                                                 BlockReducer& red) {
    __syncthreads();
    float xv[4], wv[4];
    float ss = 0.f;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        const int i = threadIdx.x + e * QMK_THREADS;
        xv[e] = 0.f;
        wv[e] = 0.f;
        if (i < n) {
            xv[e] = ld_act(x + i);
            wv[e] = ld_weight1(w + i);
        }
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) ss += xv[e] * xv[e];
    ss = red.sum(ss);
    const float r = rsqrtf(ss / (float)n + eps);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        const int i = threadIdx.x + e * QMK_THREADS;
        if (i < n) xs[i] = bf16_round(bf16_round(xv[e] * r) * wv[e]);
    }
    __syncthreads();
}

__device__ __forceinline__ void load_to_smem(const bf16* x, int n, float* xs) {
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += QMK_THREADS) xs[i] = ld_act(x + i);
    __syncthreads();
}

__device__ __forceinline__ uint64_t splitmix64(uint64_t z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// Counter-based uniform in [0, 1): every block draws the same number for (seed, frame, group),
// which is what lets all blocks sample redundantly and agree without a barrier.
__device__ __forceinline__ float uniform01(uint64_t seed, uint32_t frame, uint32_t group) {
    const uint64_t z = splitmix64(seed ^ splitmix64(((uint64_t)frame << 8) | group));
    return (float)(z >> 40) * (1.0f / 16777216.0f);
}
