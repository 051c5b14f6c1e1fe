// What a block's memory operations cost while bulk copies are in flight on its SM.
//
// The megakernel's hypothesis since v13 (docs/journal/NOTES.md) was that a grid arrival's release fence
// waits for the SM's outstanding bulk copies, so a weight ring that refills during a phase makes
// that phase's arrival slower by roughly the refill's transfer time. Nsight Compute puts ~2.3 us
// of membar stall on each talker attention arrival (v24 profile), a phase during which the ring
// streams the o_proj and MLP tiles. This probe measures the effect in isolation, on every SM at
// once (so each SM gets its share of HBM bandwidth, as in the kernel):
//
//   each round: a block barrier; the issuer puts N bulk copies of 32 KB in flight; a bar.sync (or,
//   when the issuer is the cluster peer, a relaxed flag: no fence in between); thread 0 of warp 1
//   waits `delay` cycles, then times one operation (clock64 before / after); then waits for the
//   copies to land (and times that too, from the operation's start).
//
// Operations: the arrival the kernel uses (atom.add.release.gpu), a bare release fence, a relaxed
// atomic and a relaxed L2 load (round trips with no fence), and a relaxed atomic after
// fence.proxy.async. Issuers: another warp of the block (the kernel's producer), the timed thread
// itself, and in a 2-CTA cluster the peer CTA copying into this CTA's shared memory (or this CTA
// copying into the peer's), to tell whether a fence waits for copies its block issued or for
// copies landing in its shared memory. Sources: HBM (a 4 GB buffer walked so no line repeats
// within a run) or L2 (a small buffer every block rereads).
//
// Found on the H200 (bench/results/fence_probe_h200_2026-11-24.json, docs/journal/NOTES.md): a release
// fence completes only once every bulk copy its block issued has landed, wherever they land;
// copies another block issues into its shared memory do not hold it.
//
// Build here and carry the binary (bench/README.md):
//   nvcc -O3 -std=c++17 -arch=sm_90a -o .probe/fence_probe bench/probes/fence_probe.cu
//   .probe/fence_probe > $OUT/fence_probe.json
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "microbench.cuh"

#define SLOT_BYTES (32 * 1024)
#define MAX_COPIES 6
#define ITERS 64

enum Op {
    OP_ATOM_RELEASE = 0,
    OP_FENCE_RELEASE,
    OP_ATOM_RELAXED,
    OP_LOAD_RELAXED,
    OP_PROXY_ATOM,
    OP_BULK_STORE_ARRIVE,
    OP_BULK_RED_ARRIVE,
    OP_COUNT
};
static const char* kOpNames[OP_COUNT] = {"atom.add.release.gpu", "fence.release.gpu (MEMBAR)", "atom.add.relaxed.gpu",
                                         "ld.relaxed.gpu (L2 hit)", "fence.proxy.async + atom.relaxed",
                                         "512 B bulk store, wait_group 0, fence.proxy.async, atom.relaxed",
                                         "512 B bulk reduce-add f32, wait_group 0, fence.proxy.async, atom.relaxed"};
// The last two: a phase's results published without a release fence. The bulk operation's
// completion (wait_group without .read) has the writes performed in global memory before the
// relaxed arrival is issued; does that wait for the block's weight copies too?
#define STAGE_BYTES 512
enum Issuer { ISS_OTHER_WARP = 0, ISS_SAME_THREAD, ISS_PEER_INTO_ME, ISS_ME_INTO_PEER, ISS_COUNT };
static const char* kIssuerNames[ISS_COUNT] = {"another warp of the block", "the timed thread",
                                              "peer CTA of the cluster, into this CTA's smem",
                                              "this CTA (other warp), into the peer's smem"};

struct Args {
    const unsigned char* src;  // copy source
    size_t src_bytes;          // walked modulo this
    int src_l2;                // 1: every block rereads its own 192 KB (L2-resident)
    int op, issuer, ncopies;
    long long delay;
    unsigned* counters;        // per block: atomic target, load target
    float* sink;               // per block: STAGE_BYTES written by the bulk store / reduce
    long long* out;            // [block][ITERS][2]: op cycles, land cycles
};

extern __shared__ __align__(128) unsigned char smem[];


// bar / dst: shared::cluster addresses (this CTA's own, or a peer's through mapa).
__device__ void issue(const Args& a, int iter, uint32_t bar, uint32_t dst, int block) {
    const uint32_t total = (uint32_t)a.ncopies * SLOT_BYTES;
    asm volatile("mbarrier.arrive.expect_tx.release.cluster.shared::cluster.b64 _, [%0], %1;" ::"r"(bar), "r"(total)
                 : "memory");
    for (int k = 0; k < a.ncopies; ++k) {
        size_t off = a.src_l2 ? ((size_t)block * MAX_COPIES + k) * SLOT_BYTES
                              : (((size_t)iter * gridDim.x + block) * MAX_COPIES + k) * SLOT_BYTES;
        off %= a.src_bytes;
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                         dst + k * SLOT_BYTES),
                     "l"(a.src + off), "r"((uint32_t)SLOT_BYTES), "r"(bar)
                     : "memory");
    }
}

__device__ __forceinline__ long long timed_op(const Args& a, unsigned* ctr, uint32_t stage) {
    unsigned v = 0;
    float* sink = a.sink + (size_t)blockIdx.x * (STAGE_BYTES / 4);
    const long long t0 = clk();
    switch (a.op) {
        case OP_BULK_STORE_ARRIVE:
        case OP_BULK_RED_ARRIVE:
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the staged values, written generically
            if (a.op == OP_BULK_STORE_ARRIVE)
                asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(sink), "r"(stage),
                             "r"((uint32_t)STAGE_BYTES)
                             : "memory");
            else
                asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(sink),
                             "r"(stage), "r"((uint32_t)STAGE_BYTES)
                             : "memory");
            asm volatile("cp.async.bulk.commit_group;\ncp.async.bulk.wait_group 0;\nfence.proxy.async.global;" ::: "memory");
            asm volatile("atom.add.relaxed.gpu.global.u32 %0, [%1], 1;" : "=r"(v) : "l"(ctr) : "memory");
            break;
        case OP_ATOM_RELEASE:
            asm volatile("atom.add.release.gpu.global.u32 %0, [%1], 1;" : "=r"(v) : "l"(ctr) : "memory");
            break;
        case OP_FENCE_RELEASE:
            asm volatile("fence.release.gpu;" ::: "memory");
            break;
        case OP_ATOM_RELAXED:
            asm volatile("atom.add.relaxed.gpu.global.u32 %0, [%1], 1;" : "=r"(v) : "l"(ctr) : "memory");
            break;
        case OP_LOAD_RELAXED:
            asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(ctr + 1) : "memory");
            break;
        default:
            asm volatile("fence.proxy.async.global;\natom.add.relaxed.gpu.global.u32 %0, [%1], 1;"
                         : "=r"(v)
                         : "l"(ctr)
                         : "memory");
    }
    // The clock read depends on the result, so a round trip is over before it.
    asm volatile("add.u32 %0, %0, 0;" : "+r"(v)::"memory");
    const long long t1 = clk() + (v == 0xffffffffu ? 1 : 0);
    return t1 - t0;
}

__device__ __forceinline__ void wait_parity(uint32_t bar, unsigned parity) {
    while (!mbar_done(bar, parity)) {
    }
}

// One CTA per SM, 64 threads: warp 0 lane 0 issues (ISS_OTHER_WARP), warp 1 lane 0 is timed.
// CLUSTER: the same with 2-CTA clusters; in ISS_PEER_INTO_ME the rank-1 CTA issues into rank 0's
// slots and only rank 0 is timed; in ISS_ME_INTO_PEER rank 0's warp 0 issues into rank 1's slots.
template <bool CLUSTER>
__device__ void probe(const Args& a) {
    uint64_t* bar = reinterpret_cast<uint64_t*>(smem);
    unsigned char* slots = smem + 128;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const uint32_t rank = CLUSTER ? cluster_rank() : 0;
    if (threadIdx.x == 0) {
        *reinterpret_cast<volatile uint32_t*>(smem + 64) = 0u;
        for (int i = 0; i < STAGE_BYTES / 4; ++i) reinterpret_cast<float*>(smem + 128 + MAX_COPIES * SLOT_BYTES)[i] = 1.f;
        asm volatile("mbarrier.init.shared.b64 [%0], 1;" ::"r"(s32(bar)) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (CLUSTER) cluster_sync();
    unsigned* ctr = a.counters + 32 * blockIdx.x;  // a 128-byte line each
    const bool timed_block = !CLUSTER || rank == 0;
    for (int it = 0; it < ITERS; ++it) {
        __syncthreads();
        if (CLUSTER) cluster_sync();
        // Who issues, into whose slots.
        bool me_issue = false;
        uint32_t bar_addr = s32(bar), dst = s32(slots);
        if (a.issuer == ISS_OTHER_WARP) me_issue = warp == 0 && lane == 0;
        else if (a.issuer == ISS_SAME_THREAD) me_issue = warp == 1 && lane == 0;
        else if (a.issuer == ISS_PEER_INTO_ME) {
            me_issue = CLUSTER && rank == 1 && warp == 0 && lane == 0;
            bar_addr = map_to(s32(bar), 0), dst = map_to(s32(slots), 0);
        } else {
            me_issue = CLUSTER && rank == 0 && warp == 0 && lane == 0;
            bar_addr = map_to(s32(bar), 1), dst = map_to(s32(slots), 1);
        }
        if (me_issue) issue(a, it, bar_addr, dst, blockIdx.x);
        // Between the issue and the timed operation, nothing that fences: a cluster barrier
        // waits for the issuing CTA's release, which waits for its copies (the first version of
        // this probe had one there and read the peer's copies as free to this CTA's fence, when
        // they had landed before it ran).
        volatile uint32_t* flag = reinterpret_cast<volatile uint32_t*>(smem + 64);
        if (CLUSTER && a.issuer == ISS_PEER_INTO_ME) {
            if (me_issue)
                asm volatile("st.relaxed.cluster.shared::cluster.u32 [%0], %1;" ::"r"(map_to(s32(smem + 64), 0)),
                             "r"((uint32_t)it + 1u)
                             : "memory");
            if (rank == 0 && warp == 1 && lane == 0)
                while (*flag != (uint32_t)it + 1u) {
                }
        } else {
            __syncthreads();
        }
        // The CTA whose slots get the copies: the issuer's target (or itself).
        const bool receives = !CLUSTER || (a.issuer == ISS_PEER_INTO_ME ? rank == 0 : a.issuer == ISS_ME_INTO_PEER ? rank == 1 : true);
        if (timed_block && warp == 1 && lane == 0) {
            const long long t0 = clk();
            while (clk() - t0 < a.delay) {
            }
            const long long op = timed_op(a, ctr, s32(smem + 128 + MAX_COPIES * SLOT_BYTES));
            const long long t1 = clk();
            long long land = -1;
            if (receives) {
                wait_parity(s32(bar), it & 1);
                land = clk() - t1 + op;
            }
            long long* o = a.out + ((size_t)blockIdx.x * ITERS + it) * 2;
            o[0] = op;
            o[1] = land;
        } else if (receives && lane == 0 && warp == 1) {
            wait_parity(s32(bar), it & 1);
        }
    }
    __syncthreads();
    if (CLUSTER) cluster_sync();
}

__global__ void probe_plain(Args a) { probe<false>(a); }
__global__ void __cluster_dims__(2, 1, 1) probe_cluster(Args a) { probe<true>(a); }

int main() {
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    int clock_khz = 0;
    CK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
    const int blocks = prop.multiProcessorCount / 2 * 2;
    ProbeBuffers pb;
    CK(alloc_probe_buffers(pb, blocks, ITERS));
    const int smem_bytes = 128 + MAX_COPIES * SLOT_BYTES + STAGE_BYTES;
    float* sink = nullptr;
    CK(cudaMalloc(&sink, (size_t)blocks * STAGE_BYTES));
    CK(cudaMemset(sink, 0, (size_t)blocks * STAGE_BYTES));
    CK(cudaFuncSetAttribute(probe_plain, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
    CK(cudaFuncSetAttribute(probe_cluster, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
    std::vector<long long> host(pb.n_out);
    printf("{\"gpu\": \"%s\", \"sms\": %d, \"blocks\": %d, \"sm_clock_khz_nominal\": %d, \"iters\": %d,\n",
           prop.name, prop.multiProcessorCount, blocks, clock_khz, ITERS);
    printf(" \"rows\": [\n");
    bool first = true;
    const int copies[] = {0, 1, 2, 4, 6};
    const long long delays[] = {0, 4000};
    for (int issuer = 0; issuer < ISS_COUNT; ++issuer)
        for (int src_l2 = 0; src_l2 < 2; ++src_l2)
            for (int op = 0; op < OP_COUNT; ++op)
                for (long long delay : delays)
                    for (int n : copies) {
                        const bool side = op == OP_LOAD_RELAXED || op >= OP_PROXY_ATOM;
                        if (issuer >= ISS_PEER_INTO_ME && side) continue;
                        if (src_l2 && (delay != 0 || side)) continue;
                        Args a{pb.src, src_l2 ? (size_t)blocks * MAX_COPIES * SLOT_BYTES : pb.src_bytes, src_l2, op,
                               issuer, n, delay, pb.counters, sink, pb.out};
                        std::vector<long long> ops, lands;
                        CK(launch_and_collect(
                            pb, ITERS, host,
                            [&] {
                                if (issuer >= ISS_PEER_INTO_ME) probe_cluster<<<blocks, 64, smem_bytes>>>(a);
                                else probe_plain<<<blocks, 64, smem_bytes>>>(a);
                            },
                            ops, lands));
                        printf("%s  {\"issuer\": \"%s\", \"source\": \"%s\", \"op\": \"%s\", \"delay_cycles\": %lld, "
                               "\"copies_32k\": %d, \"samples\": %zu, \"op_cycles_p10\": %lld, \"op_cycles_p50\": %lld, "
                               "\"op_cycles_p90\": %lld, \"land_cycles_p50\": %lld}",
                               first ? "" : ",\n", kIssuerNames[issuer], src_l2 ? "L2" : "HBM", kOpNames[op], delay, n,
                               ops.size(), percentile(ops, 0.1), percentile(ops, 0.5), percentile(ops, 0.9),
                               percentile(lands, 0.5));
                        first = false;
                        fflush(stdout);
                    }
    printf("\n ]}\n");
    return 0;
}
