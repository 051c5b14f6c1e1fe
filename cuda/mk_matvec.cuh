// Batch-1 matrix-vector products: one warp per row (or row pair), 16-byte weight loads, the input
// vector in shared memory as fp32. K must be a multiple of 1024.
#pragma once

#include "mk_util.cuh"

// Rows are dealt to warps block-first (slot = warp * grid + block) so that a 1024-row matrix
// still spreads over every SM instead of filling the first few.
__device__ __forceinline__ int warp_slot() { return (threadIdx.x >> 5) * gridDim.x + blockIdx.x; }
__device__ __forceinline__ int num_slots() { return QMK_WARPS * gridDim.x; }

// R rows of K columns against xs; U 16-byte loads per lane per row are issued before any use so
// that R * U * 512 bytes per warp are in flight. K must be a multiple of U * 256.
template <int R, int U>
__device__ __forceinline__ void dot_rows_u(const bf16* const* w, const float* xs, int K, float* acc) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.f;
    for (int k0 = lane * 8; k0 < K; k0 += U * 256) {
        uint4 u[R][U];
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int j = 0; j < U; ++j) u[r][j] = ld_weight(w[r] + k0 + j * 256);
#pragma unroll
        for (int j = 0; j < U; ++j) {
            const float4 xa = *reinterpret_cast<const float4*>(xs + k0 + j * 256);
            const float4 xb = *reinterpret_cast<const float4*>(xs + k0 + j * 256 + 4);
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const uint4 v = u[r][j];
                float a = acc[r];
                a = fmaf(bf_lo(v.x), xa.x, a);
                a = fmaf(bf_hi(v.x), xa.y, a);
                a = fmaf(bf_lo(v.y), xa.z, a);
                a = fmaf(bf_hi(v.y), xa.w, a);
                a = fmaf(bf_lo(v.z), xb.x, a);
                a = fmaf(bf_hi(v.z), xb.y, a);
                a = fmaf(bf_lo(v.w), xb.z, a);
                a = fmaf(bf_hi(v.w), xb.w, a);
                acc[r] = a;
            }
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = warp_sum(acc[r]);
}

template <int R>
__device__ __forceinline__ void dot_rows(const bf16* const* w, const float* xs, int K, float* acc) {
    if (R == 1 && K % 3072 == 0) {
        dot_rows_u<R, 12>(w, xs, K, acc);
    } else if (K % 2048 == 0) {
        dot_rows_u<R, 8>(w, xs, K, acc);
    } else {
        dot_rows_u<R, 4>(w, xs, K, acc);
    }
}

// For each unit u in [0, units): rows(u, w) names R weight rows, out(u, acc) consumes the R dot
// products (called on lane 0 only).
template <int R, typename Rows, typename Out>
__device__ __forceinline__ void matvec(int units, int K, const float* xs, Rows rows, Out out) {
    for (int u = warp_slot(); u < units; u += num_slots()) {
        const bf16* w[R];
        rows(u, w);
        float acc[R];
        dot_rows<R>(w, xs, K, acc);
        if ((threadIdx.x & 31) == 0) out(u, acc);
    }
}

__device__ __forceinline__ void cp_async16(const void* smem, const void* gmem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

__device__ __forceinline__ float dot8(const uint4 v, const float* x) {
    const float4 xa = *reinterpret_cast<const float4*>(x);
    const float4 xb = *reinterpret_cast<const float4*>(x + 4);
    float a = bf_lo(v.x) * xa.x;
    a = fmaf(bf_hi(v.x), xa.y, a);
    a = fmaf(bf_lo(v.y), xa.z, a);
    a = fmaf(bf_hi(v.y), xa.w, a);
    a = fmaf(bf_lo(v.z), xb.x, a);
    a = fmaf(bf_hi(v.z), xb.y, a);
    a = fmaf(bf_lo(v.w), xb.z, a);
    a = fmaf(bf_hi(v.w), xb.w, a);
    return a;
}

// Ask L2 for the rows this block will read in a later matvec with the same unit layout, so the
// HBM latency overlaps the grid barrier in between.
template <int R, typename Rows>
__device__ __forceinline__ void prefetch_rows(int units, int K, Rows rows) {
    const int lane = threadIdx.x & 31;
    const int lines = K * 2 / 128;  // 128-byte lines per row
    for (int u = warp_slot(); u < units; u += num_slots()) {
        const bf16* w[R];
        rows(u, w);
#pragma unroll
        for (int r = 0; r < R; ++r)
            for (int l = lane; l < lines; l += 32) prefetch_l2(reinterpret_cast<const char*>(w[r]) + l * 128);
    }
}
