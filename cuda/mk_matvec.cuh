// Batch-1 matrix-vector products: one warp per row (or row pair), 16-byte weight loads, the input
// vector in shared memory as fp32. K must be a multiple of 256.
#pragma once

#include "mk_util.cuh"

// Rows are dealt to warps block-first (slot = warp * grid + block) so that a 1024-row matrix
// still spreads over every SM instead of filling the first few.
__device__ __forceinline__ int warp_slot() { return (threadIdx.x >> 5) * gridDim.x + blockIdx.x; }
__device__ __forceinline__ int num_slots() { return QMK_WARPS * gridDim.x; }

// Weight loads issued before a grid barrier go straight to shared memory with cp.async (sm_80+):
// the first unit of the next matvec, up to QMK_PRE 16-byte chunks per lane, lands while the
// barrier waits, and holds no registers. Each lane reads back only the chunks it copied itself,
// so a per-thread wait is the only synchronisation needed.
#define QMK_PRE 12
#define QMK_STAGE_BYTES (QMK_WARPS * QMK_PRE * 32 * 16)

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

// This warp's staging slots: chunk j of lane l at [j * 32 + l].
__device__ __forceinline__ uint4* warp_stage(uint4* stage) { return stage + (threadIdx.x >> 5) * QMK_PRE * 32; }

// Chunk j of a unit: row j / cpr, 256-column block j % cpr (cpr = K / 256), lane's 8 columns.
template <int R>
__device__ __forceinline__ const bf16* chunk_ptr(const bf16* const* w, int cpr, int j) {
    const int r = (R == 2 && j >= cpr) ? 1 : 0;
    return w[r] + (j - r * cpr) * 256 + (threadIdx.x & 31) * 8;
}

// `staged`: the first min(total, QMK_PRE) chunks wait in shared memory.
template <int R>
__device__ __forceinline__ void dot_unit(const bf16* const* w, const float* xs, int K, const uint4* staged,
                                         float* acc) {
    const int lane = threadIdx.x & 31, cpr = K >> 8, total = R * cpr;
    float a0 = 0.f, a1 = 0.f;
    int j0 = 0;
    if (staged != nullptr) {
        cp_async_wait_all();
#pragma unroll
        for (int j = 0; j < QMK_PRE; ++j) {
            if (j < total) {
                const int r = (R == 2 && j >= cpr) ? 1 : 0;
                const float d = dot8(staged[j * 32 + lane], xs + (j - r * cpr) * 256 + lane * 8);
                if (r) a1 += d;
                else a0 += d;
            }
        }
        j0 = QMK_PRE;
    }
    for (; j0 < total; j0 += 8) {
        uint4 q[8];
#pragma unroll
        for (int j = 0; j < 8; ++j)
            if (j0 + j < total) q[j] = ld_weight(chunk_ptr<R>(w, cpr, j0 + j));
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const int jj = j0 + j;
            if (jj < total) {
                const int r = (R == 2 && jj >= cpr) ? 1 : 0;
                const float d = dot8(q[j], xs + (jj - r * cpr) * 256 + lane * 8);
                if (r) a1 += d;
                else a0 += d;
            }
        }
    }
    acc[0] = warp_sum(a0);
    if (R == 2) acc[1] = warp_sum(a1);
}

// Before the barrier: shared memory for this warp's first unit, L2 prefetch for its later ones.
template <int R, typename Rows>
__device__ __forceinline__ void stage_matvec(int units, int K, Rows rows, uint4* stage) {
    const int u0 = warp_slot();
    const int lane = threadIdx.x & 31, cpr = K >> 8;
    if (u0 < units) {
        const bf16* w[R];
        rows(u0, w);
        uint4* st = warp_stage(stage);
#pragma unroll
        for (int j = 0; j < QMK_PRE; ++j)
            if (j < R * cpr) cp_async16(st + j * 32 + lane, chunk_ptr<R>(w, cpr, j));
        cp_async_commit();
    }
    const int lines = K * 2 / 128;
    for (int u = u0 + num_slots(); u < units; u += num_slots()) {
        const bf16* w[R];
        rows(u, w);
#pragma unroll
        for (int r = 0; r < R; ++r)
            for (int l = lane; l < lines; l += 32) prefetch_l2(reinterpret_cast<const char*>(w[r]) + l * 128);
    }
}

// Ask L2 for every row of a later matvec (for blocks idle in the current phase).
template <int R, typename Rows>
__device__ __forceinline__ void prefetch_matvec(int units, int K, Rows rows) {
    const int lane = threadIdx.x & 31, lines = K * 2 / 128;
    for (int u = warp_slot(); u < units; u += num_slots()) {
        const bf16* w[R];
        rows(u, w);
#pragma unroll
        for (int r = 0; r < R; ++r)
            for (int l = lane; l < lines; l += 32) prefetch_l2(reinterpret_cast<const char*>(w[r]) + l * 128);
    }
}

// For each unit u in [0, units): rows(u, w) names R weight rows, out(u, acc) consumes the R dot
// products (called on lane 0 only). The first unit's weights were staged by stage_matvec.
template <int R, typename Rows, typename Out>
__device__ __forceinline__ void matvec(int units, int K, const float* xs, Rows rows, Out out, uint4* stage) {
    int u = warp_slot();
    if (u < units) {
        const bf16* w[R];
        rows(u, w);
        float acc[R];
        dot_unit<R>(w, xs, K, warp_stage(stage), acc);
        if ((threadIdx.x & 31) == 0) out(u, acc);
    }
    for (u += num_slots(); u < units; u += num_slots()) {
        const bf16* w[R];
        rows(u, w);
        float acc[R];
        dot_unit<R>(w, xs, K, nullptr, acc);
        if ((threadIdx.x & 31) == 0) out(u, acc);
    }
}
