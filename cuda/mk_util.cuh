// Loads, reductions, the grid barrier and the shared-memory copy primitives used by every phase.
#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

#define QMK_THREADS 512                      // consumer threads: every phase's work
#define QMK_WARPS (QMK_THREADS / 32)
// + the producer streaming weights (mk_stream.cuh): one warp, or on Hopper built with its
// arch-specific features (sm_90a) a whole warpgroup that hands its registers to the consumers
// (setmaxnreg, qmk_frame_kernel). A 17-warp block is held to 96 registers a thread (5 warps on
// one scheduler partition) and the consumers spill; the block's registers are fixed at launch
// (640 x 96), so a producer warpgroup at 32 leaves the consumers 112 (128 x 32 + 512 x 112). Its
// lane-0 loop then spills a little; at 24 it spilled more and slowed the 1.7B talker, whose MLP
// slots are refilled mid-phase (bench/NOTES.md, v22). The host reads the block size from the
// kernel (grid_config).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define QMK_PRODUCER_THREADS 128
#define QMK_CONSUMER_REGS 112
#define QMK_PRODUCER_REGS 32
#else
#define QMK_PRODUCER_THREADS 32
#endif
#define QMK_BLOCK_THREADS (QMK_THREADS + QMK_PRODUCER_THREADS)

typedef __nv_bfloat16 bf16;

// Barrier over the consumer threads only (named barrier 1): the producer warp never joins it, so
// a copy that stalls under memory back-pressure never holds up a phase.
__device__ __forceinline__ void block_sync() { asm volatile("bar.sync 1, %0;" ::"n"(QMK_THREADS) : "memory"); }

__device__ __forceinline__ float bf_lo(uint32_t u) { return __uint_as_float(u << 16); }
__device__ __forceinline__ float bf_hi(uint32_t u) { return __uint_as_float(u & 0xffff0000u); }

// Read-only data (weights, embeddings, tables): never written during a launch.
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

// Activations are written by other blocks of the same launch and L1 is not coherent: read them
// from L2.
__device__ __forceinline__ float ld_act(const float* p) { return __ldcg(p); }
__device__ __forceinline__ float4 ld_act4(const float* p) { return __ldcg(reinterpret_cast<const float4*>(p)); }

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

// Block reductions (consumer threads) over a [2][QMK_WARPS] scratch with alternating halves: a
// half is rewritten only two calls later, after a barrier every thread passed once done reading
// it, so one block_sync per reduction suffices.
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
        block_sync();
        float t = 0.f;
#pragma unroll
        for (int i = 0; i < QMK_WARPS; ++i) t += s[i];
        return t;
    }

    __device__ unsigned umax(unsigned v) {
        v = __reduce_max_sync(0xffffffffu, v);
        unsigned* s = reinterpret_cast<unsigned*>(slot());
        if ((threadIdx.x & 31) == 0) s[threadIdx.x >> 5] = v;
        block_sync();
        unsigned t = 0;
#pragma unroll
        for (int i = 0; i < QMK_WARPS; ++i) t = max(t, s[i]);
        return t;
    }

    __device__ unsigned umin(unsigned v) {
        v = __reduce_min_sync(0xffffffffu, v);
        unsigned* s = reinterpret_cast<unsigned*>(slot());
        if ((threadIdx.x & 31) == 0) s[threadIdx.x >> 5] = v;
        block_sync();
        unsigned t = 0xffffffffu;
#pragma unroll
        for (int i = 0; i < QMK_WARPS; ++i) t = min(t, s[i]);
        return t;
    }
};

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

// Adds four consecutive floats (16-byte aligned) in L2 without returning anything: one vector
// request on Hopper, four on older GPUs. Order-dependent in the last bit, like any float atomic.
__device__ __forceinline__ void red_add4(float* p, float a, float b, float c, float d) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.relaxed.gpu.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(a), "f"(b), "f"(c), "f"(d)
                 : "memory");
#else
    atomicAdd(p, a);
    atomicAdd(p + 1, b);
    atomicAdd(p + 2, c);
    atomicAdd(p + 3, d);
#endif
}

// ---------------------------------------------------------------------------------------------
// Grid barrier over a zero-initialised counter. Block 0 adds 2^31 - (blocks - 1), every other
// block 1: the top bit flips exactly when the last block arrives, so the counter never needs a
// reset between barriers or launches (the scheme of cooperative groups' grid sync, with the
// counter in a buffer we own so the barrier can be traced).

__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// Add 1 with release semantics, no value returned (a count that others acquire).
__device__ __forceinline__ void red_add_release(unsigned* p) {
    asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(p) : "memory");
}

__device__ __forceinline__ unsigned atom_add_acq_rel(unsigned* p, unsigned v) {
    unsigned old;
    asm volatile("atom.add.acq_rel.gpu.global.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
    return old;
}

// Arrive and wait are separate so a trace can stamp the arrival. Thread 0 only, after a
// block_sync: the release orders the whole block's earlier writes (the barrier made them visible
// to thread 0) before the arrival; the acquire that sees the flip orders the other blocks'
// writes before what follows the next block_sync.
__device__ __forceinline__ unsigned grid_arrive(unsigned* counter) {
    const unsigned add = blockIdx.x == 0 ? 0x80000000u - (gridDim.x - 1) : 1u;
    unsigned old;
    asm volatile("atom.add.release.gpu.global.u32 %0, [%1], %2;" : "=r"(old) : "l"(counter), "r"(add) : "memory");
    return old;
}

__device__ __forceinline__ void grid_wait(const unsigned* counter, unsigned arrived) {
    while (((arrived ^ ld_acquire(counter)) & 0x80000000u) == 0) {
    }
}

// ---------------------------------------------------------------------------------------------
// Shared-memory tiles filled asynchronously and completed on an mbarrier. On Hopper the producer
// lane issues a bulk copy per contiguous range (the copy engine, no registers, no L1); on sm_80 it
// issues 16-byte cp.async pieces and its arrival counts once they have landed. Consumers wait the
// same way on both.

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void mbar_init(uint64_t* bar, unsigned count) {
    asm volatile("mbarrier.init.shared.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}

__device__ __forceinline__ bool mbar_test(const uint64_t* bar, unsigned parity) {
    uint32_t ok;
#if __CUDA_ARCH__ >= 900
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
        : "=r"(ok)
        : "r"(smem_u32(bar)), "r"(parity)
        : "memory");
#else
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.test_wait.parity.shared.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
        : "=r"(ok)
        : "r"(smem_u32(bar)), "r"(parity)
        : "memory");
#endif
    return ok != 0;
}

__device__ __forceinline__ void mbar_wait(const uint64_t* bar, unsigned parity) {
    while (!mbar_test(bar, parity)) {
    }
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
    asm volatile("{\n .reg .b64 st;\n mbarrier.arrive.shared.b64 st, [%0];\n}" ::"r"(smem_u32(bar)) : "memory");
}

#if __CUDA_ARCH__ >= 900
// Orders global memory this thread has seen written through the generic proxy (K/V rows another
// block stored in this launch, acquired through the grid barrier) before its async-proxy copies.
__device__ __forceinline__ void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;" ::: "memory"); }
// Makes freshly initialised mbarriers visible to the async proxy.
__device__ __forceinline__ void fence_proxy_async_shared() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}

// Weights are read once per frame (once per pass for the predictor, which is larger than L2): their
// lines are the first to go, so the small data read at every phase (activations, norm weights,
// K/V rows) stays in L2. Measured: -0.05..0.09 ms per frame (bench/NOTES.md).
__device__ __forceinline__ uint64_t evict_first_policy() {
    uint64_t pol;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
    return pol;
}

__device__ __forceinline__ void bulk_copy_hint(void* dst, const void* src, uint32_t bytes, uint64_t* bar, uint64_t pol) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;" ::"r"(
            smem_u32(dst)),
        "l"(src), "r"(bytes), "r"(smem_u32(bar)), "l"(pol)
        : "memory");
}

__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
            smem_u32(dst)),
        "l"(src), "r"(bytes), "r"(smem_u32(bar))
        : "memory");
}
#else
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_u32(dst)), "l"(src) : "memory");
}

__device__ __forceinline__ void cp_async_arrive(uint64_t* bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared.b64 [%0];" ::"r"(smem_u32(bar)) : "memory");
}
#endif
