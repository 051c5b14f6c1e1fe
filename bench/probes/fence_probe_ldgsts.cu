// Does a block's release fence wait for another warp's weight loads when they are not bulk copies?
//
// bench/probes/fence_probe.cu found that a release fence (and so a grid arrival) completes only once
// every bulk copy (cp.async.bulk, the TMA) its block issued has landed. That is why the
// megakernel's ring hands a phase's slots back only at the phase's grid arrival, and so why each
// phase starts with its weight tiles still in flight (docs/journal/NOTES.md, "The fence and the weight
// ring, measured"). If weights loaded another way do not hold the fence, the ring could refill
// slots before the arrival and a phase would find its tiles on chip.
//
// Each round, on every SM at once (one CTA each, so each SM gets its share of HBM): issuer warps
// put 32 KB x N of loads in flight by one mechanism; a bar.sync (no fence); thread 0 of the timed
// warp times one operation (clock64 before / after); then the time until the loads landed is taken
// from the operation's start. Mechanisms:
//   bulk   one lane: cp.async.bulk into shared memory, mbarrier complete_tx (the kernel's today)
//   ldgsts 32 lanes of one warp: cp.async.cg 16 B each (Ampere's LDGSTS), cp.async.mbarrier.arrive
//   ldgsts4 the same over 4 warps
//   ldg    4 warps: ld.global.nc.v4 into registers (16 each), then stored to shared memory
//
// Found on the H200 (bench/results/2026-11-24-h200-ldgsts-ring/, docs/journal/NOTES.md): another warp's
// LDGSTS hold a release fence far less than bulk copies do (two slots in flight: 1035 cycles against
// 2374), but a ring built on them streamed the MLP tiles too slowly and lost 0.38 ms a frame.
//
// Build on the device (nvcc is there) and write the JSON to $OUT:
//   nvcc -O3 -std=c++17 -arch=sm_90a -o .probe/fence_probe_ldgsts bench/probes/fence_probe_ldgsts.cu
//   .probe/fence_probe_ldgsts > $OUT/fence_probe_ldgsts.json
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "microbench.cuh"

#define SLOT_BYTES (32 * 1024)
#define MAX_SLOTS 4
#define ITERS 64
#define ISSUER_WARPS 4
#define THREADS ((ISSUER_WARPS + 1) * 32)
#define TIMED_WARP ISSUER_WARPS
#define LDG_PER_THREAD 16  // 4 warps x 32 lanes x 16 x 16 B = one 32 KB slot

enum Mech { M_NONE = 0, M_BULK, M_LDGSTS, M_LDGSTS4, M_LDG, M_COUNT };
static const char* kMechNames[M_COUNT] = {"none", "cp.async.bulk, one lane", "cp.async.cg 16 B, one warp",
                                          "cp.async.cg 16 B, four warps", "ld.global.nc.v4 into registers, four warps"};
enum Op { OP_ATOM_RELEASE = 0, OP_FENCE_RELEASE, OP_ATOM_RELAXED, OP_COUNT };
static const char* kOpNames[OP_COUNT] = {"atom.add.release.gpu", "fence.release.gpu (MEMBAR)", "atom.add.relaxed.gpu"};

struct Args {
    const unsigned char* src;
    size_t src_bytes;
    int mech, op, slots;
    unsigned* counters;
    long long* out;  // [block][ITERS][2]: op cycles, landed cycles
};

extern __shared__ __align__(128) unsigned char smem[];

__device__ __forceinline__ long long timed_op(int op, unsigned* ctr) {
    unsigned v = 0;
    const long long t0 = clk();
    if (op == OP_ATOM_RELEASE)
        asm volatile("atom.add.release.gpu.global.u32 %0, [%1], 1;" : "=r"(v) : "l"(ctr) : "memory");
    else if (op == OP_FENCE_RELEASE)
        asm volatile("fence.release.gpu;" ::: "memory");
    else
        asm volatile("atom.add.relaxed.gpu.global.u32 %0, [%1], 1;" : "=r"(v) : "l"(ctr) : "memory");
    asm volatile("add.u32 %0, %0, 0;" : "+r"(v)::"memory");  // the clock read waits for the reply
    return clk() + (v == 0xffffffffu ? 1 : 0) - t0;
}

__global__ void __launch_bounds__(THREADS, 1) probe(Args a) {
    uint64_t* bar = reinterpret_cast<uint64_t*>(smem);
    unsigned char* slots = smem + 128;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    // Arrivals the mbarrier expects per round: the bulk issuer's one, or one per LDGSTS lane.
    const unsigned count = a.mech == M_LDGSTS ? 32 : a.mech == M_LDGSTS4 ? 32 * ISSUER_WARPS : 1;
    if (threadIdx.x == 0) {
        asm volatile("mbarrier.init.shared.b64 [%0], %1;" ::"r"(s32(bar)), "r"(count) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    unsigned* ctr = a.counters + 32 * blockIdx.x;
    const uint32_t total = (uint32_t)a.slots * SLOT_BYTES;
    for (int it = 0; it < ITERS; ++it) {
        __syncthreads();
        const size_t base = (((size_t)it * gridDim.x + blockIdx.x) * MAX_SLOTS * SLOT_BYTES) % a.src_bytes;
        const unsigned char* src = a.src + base;
        uint4 held[LDG_PER_THREAD];
        if (warp < ISSUER_WARPS && a.slots > 0) {
            if (a.mech == M_BULK && warp == 0 && lane == 0) {
                asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(s32(bar)), "r"(total)
                             : "memory");
                for (int k = 0; k < a.slots; ++k)
                    asm volatile(
                        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                            s32(slots + k * SLOT_BYTES)),
                        "l"(src + (size_t)k * SLOT_BYTES), "r"((uint32_t)SLOT_BYTES), "r"(s32(bar))
                        : "memory");
            } else if ((a.mech == M_LDGSTS && warp == 0) || a.mech == M_LDGSTS4) {
                const int nthr = a.mech == M_LDGSTS ? 32 : 32 * ISSUER_WARPS;
                const int t = a.mech == M_LDGSTS ? lane : threadIdx.x;
                for (uint32_t o = 16u * t; o < total; o += 16u * nthr)
                    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s32(slots + o)), "l"(src + o)
                                 : "memory");
                asm volatile("cp.async.mbarrier.arrive.noinc.shared.b64 [%0];" ::"r"(s32(bar)) : "memory");
            } else if (a.mech == M_LDG) {
                // One slot at most: that is what four warps' registers hold.
                const uint4* s4 = reinterpret_cast<const uint4*>(src);
#pragma unroll
                for (int k = 0; k < LDG_PER_THREAD; ++k)
                    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                                 : "=r"(held[k].x), "=r"(held[k].y), "=r"(held[k].z), "=r"(held[k].w)
                                 : "l"(s4 + k * 32 * ISSUER_WARPS + threadIdx.x));
            }
        }
        __syncthreads();  // no fence between the issue and the timed operation
        if (warp == TIMED_WARP && lane == 0) {
            const long long op = timed_op(a.op, ctr);
            const long long t1 = clk();
            long long landed = -1;
            if (a.slots > 0 && a.mech != M_LDG && a.mech != M_NONE) {
                while (!mbar_done(s32(bar), it & 1)) {
                }
                landed = clk() - t1 + op;
            }
            long long* o = a.out + ((size_t)blockIdx.x * ITERS + it) * 2;
            o[0] = op;
            o[1] = landed;
        }
        if (a.mech == M_LDG && warp < ISSUER_WARPS && a.slots > 0) {
            // The registers are used only now, so the loads were in flight during the timed operation.
            uint4* d = reinterpret_cast<uint4*>(slots);
#pragma unroll
            for (int k = 0; k < LDG_PER_THREAD; ++k) d[k * 32 * ISSUER_WARPS + threadIdx.x] = held[k];
        }
        if (a.mech != M_LDG && a.mech != M_NONE && a.slots > 0 && warp == 0 && lane == 0)
            while (!mbar_done(s32(bar), it & 1)) {
            }
    }
    __syncthreads();
}

int main() {
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    const int blocks = prop.multiProcessorCount;
    ProbeBuffers pb;
    CK(alloc_probe_buffers(pb, blocks, ITERS));
    const int smem_bytes = 128 + MAX_SLOTS * SLOT_BYTES;
    CK(cudaFuncSetAttribute(probe, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
    std::vector<long long> host(pb.n_out);
    printf("{\"gpu\": \"%s\", \"sms\": %d, \"blocks\": %d, \"iters\": %d,\n \"rows\": [\n", prop.name,
           prop.multiProcessorCount, blocks, ITERS);
    bool first = true;
    for (int mech = 0; mech < M_COUNT; ++mech)
        for (int op = 0; op < OP_COUNT; ++op)
            for (int slots : {1, 2, 4}) {
                if (mech == M_NONE && slots != 1) continue;
                if (mech == M_LDG && slots != 1) continue;
                Args a{pb.src, pb.src_bytes, mech, op, mech == M_NONE ? 0 : slots, pb.counters, pb.out};
                std::vector<long long> ops, lands;
                CK(launch_and_collect(pb, ITERS, host, [&] { probe<<<blocks, THREADS, smem_bytes>>>(a); }, ops, lands));
                printf("%s  {\"loads\": \"%s\", \"op\": \"%s\", \"slots_32k\": %d, \"samples\": %zu, "
                       "\"op_cycles_p10\": %lld, \"op_cycles_p50\": %lld, \"op_cycles_p90\": %lld, "
                       "\"landed_cycles_p50\": %lld}",
                       first ? "" : ",\n", kMechNames[mech], kOpNames[op], a.slots, ops.size(), percentile(ops, 0.1),
                       percentile(ops, 0.5), percentile(ops, 0.9), percentile(lands, 0.5));
                first = false;
                fflush(stdout);
            }
    printf("\n ]}\n");
    return 0;
}
