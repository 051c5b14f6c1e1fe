// Would the weight stream keep HBM busy if the grid arrivals stopped waiting for the copies?
//
// The megakernel's layer costs ~20 us where its bytes stream in ~6.4 (docs/journal/NOTES.md, "Targets
// after the twenty-first session"). The fence probe found why the two do not overlap: a release
// (the grid arrival) waits for every bulk copy its block issued, so the ring hands a phase's slots
// back only at its arrival and the next phase's tiles start streaming after it. A design whose
// compute blocks never issue a copy (copier blocks in a cluster, filling the compute blocks'
// slots through distributed shared memory) could hand each slot back as soon as it is read. This
// probe prices that before anything is built, on the talker's layer shape with no arithmetic:
//
//   per layer, phases of 2, 1 and 5 tiles of 32 KB per block (q/k/v; o_proj; gate/up + down:
//   256 KB a block, 32.8 MB a layer on 128 blocks, the 0.6B's layer is 30.8 MB); per phase every
//   block reads a 4 KB operand from L2, waits for and reads its tiles from a 6-slot ring, writes
//   32 bytes of result and passes a grid barrier among the compute blocks.
//
// `stream_probe layout`, each pattern of kPatterns (3, 2 or 1 grid barriers a layer) with these
// variants (one launch of LAYERS layers, a median over LAUNCHES launches, no line read twice):
//   arrival    the kernel today: one producer lane per block, slots back at the grid arrival
//              (after its release), release arrival and acquire poll;
//   early      slots back as soon as the tile is read, release arrival (the fence then waits for
//              the copies issued meanwhile);
//   relaxed    early, with relaxed arrivals and polls: what the stream gives with no fence at all
//              (not a correct publication, a bound);
//   copier-S   clusters of S blocks, rank S - 1 a copier that never fences: one lane per compute
//              rank fills that rank's slots (remote expect_tx, bulk copy, relaxed remote arrival);
//              compute blocks hand slots back early with a remote release arrival and take part in
//              a release / acquire grid barrier. Fewer compute blocks, each with 128 / n times the
//              tiles, so a layer's bytes stay the same.
//
//   (the 1-barrier pattern runs only where a phase's tiles fit the ring or slots go back early)
//
// `stream_probe prefetch`: the 3-barrier layer with stand-in arithmetic (kSpin: cycles of waiting
// per phase, calibrated to the kernel's phase times), today's ring against the same with L2
// prefetches ahead of it, from 4 spare blocks (bulk prefetches, paced by the compute blocks'
// progress) or from the compute blocks' own consumers (one line a thread, evict_last).
//
// Found on the H200 (bench/results/2026-11-25-h200-stream-probe/, docs/journal/NOTES.md): the bare
// skeleton takes 11.3-11.9 us a layer with today's ring, 9.7-10.4 with no fences, 9.3-9.5 with two
// barriers a layer and no fences, 8.5-8.6 with one; copier blocks are no faster at equal bytes; with
// the stand-in arithmetic today's ring takes 20.1-20.3 us (the kernel: ~20), and both kinds of L2
// prefetch make it slower (22.7-39.0 us).
//
// Build here and carry the binary (bench/README.md):
//   nvcc -O3 -std=c++17 -arch=sm_90a -o .probe/stream_probe bench/probes/stream_probe.cu
//   .probe/stream_probe [layout|prefetch] > $OUT/stream_probe.json
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "microbench.cuh"

#define SLOT_BYTES (32 * 1024)
#define NSLOT 6
#define CONSUMERS 512
#define THREADS (CONSUMERS + 32)
#define MAX_PHASE 3
#define MAX_RANKS 16
#define LAYERS 28
#define LAUNCHES 7
#define VEC 1024
// mbarriers first (full[NSLOT], then empty[MAX_RANKS][NSLOT]), the slots from 2 KB on.
#define SLOTS_OFF 2048
#define SMEM_BYTES (SLOTS_OFF + NSLOT * SLOT_BYTES)

// Tiles a block per phase on 128 compute blocks: the layer as today (q/k/v | o_proj | MLP), as
// with one grid barrier less (q/k/v and o_proj in one phase, the cluster design's count), and as one
// phase (a barrier a layer).
struct Pattern {
    const char* name;
    int nphase;
    int tiles[MAX_PHASE];
};
// Stand-in arithmetic for the 3-barrier layer, calibrated so the bare skeleton's layer (phases 5.6,
// 3.0 and 2.3 us on the H200) comes to the kernel's at talker position 100 (20.1 us: q/k/v 5.2,
// attention + o_proj 9.0, MLP 5.9 in bench/results/2026-11-25-h200-split-compile/'s profile): the
// attention before the o_proj tile, the MLP's around its tiles.
static const int kSpinPre[MAX_PHASE] = {0, 11000, 3600};
static const int kSpinPost[MAX_PHASE] = {2000, 0, 3700};
static const Pattern kPatterns[] = {{"3 barriers a layer", 3, {2, 1, 5}},
                                    {"2 barriers a layer", 2, {3, 5, 0}},
                                    {"1 barrier a layer", 1, {8, 0, 0}}};

enum Flags { F_EARLY = 1, F_RELAXED = 2, F_COPIER = 4, F_SELF_PF = 8 };

struct Args {
    const unsigned char* src;
    size_t src_tiles;   // the source holds this many 32 KB tiles; tile numbers wrap
    size_t base;        // the launch's first global tile number
    int nphase;
    int tiles[MAX_PHASE];  // per compute block
    int flags;
    int ncompute;       // compute blocks (grid barrier participants)
    int prefetch_ahead;    // tiles; 0: no prefetcher blocks
    int spin_pre[MAX_PHASE], spin_post[MAX_PHASE];  // cycles of stand-in arithmetic per phase
    unsigned* progress;    // tiles consumed, after each barrier (compute block 0)
    unsigned* counter;
    float* vec;         // [2][VEC]: operands, written in one phase and read in the next
    long long* stamps;  // compute block 0: clock at the start and at each phase's end
    float* sink;
};

extern __shared__ __align__(128) unsigned char smem[];

__device__ __forceinline__ uint64_t* full_bar(int s) { return reinterpret_cast<uint64_t*>(smem) + s; }
__device__ __forceinline__ uint64_t* empty_bar(int rank, int s) {
    return reinterpret_cast<uint64_t*>(smem) + NSLOT + rank * NSLOT + s;
}
__device__ __forceinline__ unsigned char* slot(int s) { return smem + SLOTS_OFF + s * SLOT_BYTES; }
__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, %0;" ::"n"(CONSUMERS) : "memory"); }
__device__ __forceinline__ void wait_parity(uint32_t bar, unsigned parity, bool cluster_scope) {
    uint32_t ok = 0;
    while (!ok) {
        if (cluster_scope)
            asm volatile(
                "{\n .reg .pred p;\n mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n selp.u32 "
                "%0, 1, 0, p;\n}"
                : "=r"(ok)
                : "r"(bar), "r"(parity)
                : "memory");
        else ok = mbar_done(bar, parity);
    }
}

// Which global tile the compute block `cb` reads as its i-th of the launch: consecutive blocks'
// tiles are adjacent, as a matrix's row slices are.
__device__ __forceinline__ const unsigned char* tile_src(const Args& a, uint32_t i, int cb) {
    return a.src + (((a.base + i) * a.ncompute + cb) % a.src_tiles) * SLOT_BYTES;
}

// The grid barrier among the compute blocks (leader: compute block 0), release or relaxed.
__device__ __forceinline__ void compute_barrier(const Args& a, int cb) {
    consumers_sync();
    if (threadIdx.x == 0) {
        const unsigned add = cb == 0 ? 0x80000000u - (a.ncompute - 1) : 1u;
        unsigned old, cur;
        if (a.flags & F_RELAXED) {
            asm volatile("atom.add.relaxed.gpu.global.u32 %0, [%1], %2;" : "=r"(old) : "l"(a.counter), "r"(add) : "memory");
            do {
                asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(cur) : "l"(a.counter) : "memory");
            } while (((old ^ cur) & 0x80000000u) == 0);
        } else {
            asm volatile("atom.add.release.gpu.global.u32 %0, [%1], %2;" : "=r"(old) : "l"(a.counter), "r"(add) : "memory");
            do {
                asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(cur) : "l"(a.counter) : "memory");
            } while (((old ^ cur) & 0x80000000u) == 0);
        }
    }
}

// Stand-in for a phase's arithmetic: `cycles` of waiting, folded into acc so it stays in order.
__device__ __forceinline__ void spin(int cycles, float& acc) {
    if (cycles <= 0) return;
    const long long t0 = clk();
    while (clk() - t0 < cycles) acc += 1e-30f;
}

__global__ void __launch_bounds__(THREADS, 1) stream(const Args a) {
    const bool copier_mode = a.flags & F_COPIER;
    uint32_t S = 1u;
    if (copier_mode) asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(S));
    const uint32_t rank = copier_mode ? cluster_rank() : 0u;
    const bool copier = copier_mode && rank == S - 1;
    const int cb = copier_mode ? (int)(blockIdx.x / S * (S - 1) + rank) : (int)blockIdx.x;
    int T = 0;
    for (int p = 0; p < a.nphase; ++p) T += a.tiles[p];
    T *= LAYERS;
    if (threadIdx.x == 0) {
        for (int s = 0; s < NSLOT; ++s) asm volatile("mbarrier.init.shared.b64 [%0], 1;" ::"r"(s32(full_bar(s))) : "memory");
        for (int r = 0; r < MAX_RANKS; ++r)
            for (int s = 0; s < NSLOT; ++s)
                asm volatile("mbarrier.init.shared.b64 [%0], 1;" ::"r"(s32(empty_bar(r, s))) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;\nfence.proxy.async.shared::cta;" ::: "memory");
    }
    __syncthreads();
    if (copier_mode) cluster_sync();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

    if (a.prefetch_ahead && (int)blockIdx.x >= a.ncompute) {
        // An L2 prefetcher: never fences, never joins a barrier. Its lanes together cover every
        // compute block's tile i once fewer than prefetch_ahead tiles separate i from what the
        // compute blocks have consumed.
        if (warp == 0) {
            const int g = ((int)blockIdx.x - a.ncompute) * 32 + lane, ng = ((int)gridDim.x - a.ncompute) * 32;
            for (int i = 0; i < T; ++i) {
                unsigned done;
                do {
                    asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(done) : "l"(a.progress) : "memory");
                } while ((int)done + a.prefetch_ahead <= i);
                for (int c2 = g; c2 < a.ncompute; c2 += ng)
                    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(tile_src(a, i, c2)),
                                 "r"((uint32_t)SLOT_BYTES)
                                 : "memory");
            }
        }
        return;
    }

    if (copier) {  // lane r fills compute rank r's ring
        if (warp == 0 && lane < (int)S - 1) {
            const int rcb = (int)(blockIdx.x / S * (S - 1)) + lane;
            for (int i = 0; i < T; ++i) {
                const int s = i % NSLOT;
                if (i >= NSLOT) wait_parity(s32(empty_bar(lane, s)), ((i / NSLOT) + 1) & 1, true);
                const uint32_t bar = map_to(s32(full_bar(s)), lane), dst = map_to(s32(slot(s)), lane);
                asm volatile("mbarrier.expect_tx.relaxed.cluster.shared::cluster.b64 [%0], %1;" ::"r"(bar),
                             "r"((uint32_t)SLOT_BYTES)
                             : "memory");
                asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                                 dst),
                             "l"(tile_src(a, i, rcb)), "r"((uint32_t)SLOT_BYTES), "r"(bar)
                             : "memory");
                asm volatile("mbarrier.arrive.relaxed.cluster.shared::cluster.b64 _, [%0];" ::"r"(bar) : "memory");
            }
        }
        __syncthreads();
        cluster_sync();  // the compute ranks are done with this block's barriers
        return;
    }
    if (warp == CONSUMERS / 32) {  // own producer lane (not the copier variant)
        if (!copier_mode && lane == 0) {
            for (int i = 0; i < T; ++i) {
                const int s = i % NSLOT;
                if (i >= NSLOT) wait_parity(s32(empty_bar(0, s)), ((i / NSLOT) + 1) & 1, false);
                asm volatile("mbarrier.arrive.expect_tx.shared.b64 _, [%0], %1;" ::"r"(s32(full_bar(s))),
                             "r"((uint32_t)SLOT_BYTES)
                             : "memory");
                asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                                 s32(slot(s))),
                             "l"(tile_src(a, i, cb)), "r"((uint32_t)SLOT_BYTES), "r"(s32(full_bar(s)))
                             : "memory");
            }
        }
        if (copier_mode) cluster_sync();
        return;
    }

    // Consumers.
    const int tid = threadIdx.x;
    float acc = 0.f;
    uint32_t consumed = 0;
    int step = 0;
    auto release = [&](uint32_t i) {  // thread 0: tile i's slot back to whoever fills it
        const int s = i % NSLOT;
        if (copier_mode)
            asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(
                             map_to(s32(empty_bar(rank, s)), S - 1))
                         : "memory");
        else asm volatile("mbarrier.arrive.shared.b64 _, [%0];" ::"r"(s32(empty_bar(0, s))) : "memory");
    };
    if (cb == 0 && tid == 0) a.stamps[0] = clk();
    for (int l = 0; l < LAYERS; ++l) {
        for (int p = 0; p < a.nphase; ++p, ++step) {
            const float* in = a.vec + (step & 1) * VEC;
            acc += __ldcg(in + tid) + __ldcg(in + tid + CONSUMERS);
            if (a.flags & F_SELF_PF) {
                // Each phase, the block's own consumers ask L2 for as many tiles as the phase
                // has, prefetch_ahead tiles ahead of it: one 128-byte line a thread, no fence
                // waits for them.
                for (int k = 0; k < a.tiles[p]; ++k) {
                    const uint32_t i = consumed + a.prefetch_ahead + k;
                    if ((int)i < T && tid < SLOT_BYTES / 128)
                        asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(tile_src(a, i, cb) + tid * 128) : "memory");
                }
            }
            spin(a.spin_pre[p], acc);
            for (int k = 0; k < a.tiles[p]; ++k) {
                const uint32_t i = consumed + k;
                wait_parity(s32(full_bar(i % NSLOT)), (i / NSLOT) & 1, false);
                const float4* t = reinterpret_cast<const float4*>(slot(i % NSLOT));
#pragma unroll
                for (int j = 0; j < SLOT_BYTES / 16 / CONSUMERS; ++j) {
                    const float4 v = t[tid + j * CONSUMERS];
                    acc += v.x + v.y + v.z + v.w;
                }
                if (a.flags & F_EARLY) {
                    consumers_sync();
                    if (tid == 0) release(i);
                }
            }
            spin(a.spin_post[p], acc);
            if (tid < 8) a.vec[((step + 1) & 1) * VEC + (cb * 8 + tid) % VEC] = acc;
            compute_barrier(a, cb);
            if (!(a.flags & F_EARLY) && tid == 0)
                for (int k = 0; k < a.tiles[p]; ++k) release(consumed + k);
            consumed += a.tiles[p];
            if (cb == 0 && tid == 0 && a.prefetch_ahead)
                asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(a.progress), "r"(consumed) : "memory");
            consumers_sync();
            if (cb == 0 && tid == 0) a.stamps[1 + step] = clk();
        }
    }
    if (acc == -1.f) a.sink[tid] = acc;  // never true: keeps the reads
    if (copier_mode) cluster_sync();
}

int main(int argc, char** argv) {
    // "layout" (the first two calls: fences, copiers, barriers a layer) or "prefetch".
    const bool prefetch_set = argc > 1 && std::string(argv[1]) == "prefetch";
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    int clock_khz = 0;
    CK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
    const size_t src_bytes = (size_t)8 << 30;
    unsigned char* src = nullptr;
    CK(cudaMalloc(&src, src_bytes));
    CK(cudaMemset(src, 1, src_bytes));
    unsigned* counter = nullptr;
    float *vec = nullptr, *sink = nullptr;
    long long* stamps = nullptr;
    const int nstamp = 1 + LAYERS * MAX_PHASE;
    unsigned* progress = nullptr;
    CK(cudaMalloc(&counter, 128));
    CK(cudaMemset(counter, 0, 128));
    CK(cudaMalloc(&progress, 128));
    CK(cudaMalloc(&vec, sizeof(float) * 2 * VEC));
    CK(cudaMemset(vec, 0, sizeof(float) * 2 * VEC));
    CK(cudaMalloc(&sink, sizeof(float) * THREADS));
    CK(cudaMalloc(&stamps, sizeof(long long) * nstamp));
    CK(cudaFuncSetAttribute(stream, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_BYTES));
    CK(cudaFuncSetAttribute(stream, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));

    struct Variant {
        const char* name;
        int flags, cluster, prefetch, spin, patterns;  // patterns: bit k runs kPatterns[k]
    };
    // copier-16 was measured in the first call and left out since: one copier lane per 15
    // ranks streamed at half the rate (docs/journal/NOTES.md).
    const Variant layout[] = {{"arrival", 0, 1, 0, 0, 7},
                              {"early", F_EARLY, 1, 0, 0, 7},
                              {"relaxed", F_EARLY | F_RELAXED, 1, 0, 0, 7},
                              {"arrival-relaxed", F_RELAXED, 1, 0, 0, 7},
                              {"copier-2", F_COPIER | F_EARLY, 2, 0, 0, 7},
                              {"copier-4", F_COPIER | F_EARLY, 4, 0, 0, 7},
                              {"copier-8", F_COPIER | F_EARLY, 8, 0, 0, 7}};
    // Today's ring with 4 more blocks that prefetch into L2 ahead of it, on the bare skeleton and
    // with stand-in arithmetic (kSpin).
    // The first prefetch call (bulk prefetches from 4 spare blocks) showed those blocks' copy
    // engines stream only ~0.86 TB/s between them: they fell behind the ring and helped nothing.
    // So the blocks themselves prefetch here, one line a thread (self-pf).
    const Variant prefetch[] = {{"arrival", 0, 1, 0, 1, 1},
                                {"arrival+pf12 (4 blocks)", 0, 1, 12, 1, 1},
                                {"arrival+self-pf8", F_SELF_PF, 1, 8, 1, 1},
                                {"arrival+self-pf12", F_SELF_PF, 1, 12, 1, 1},
                                {"arrival+self-pf16", F_SELF_PF, 1, 16, 1, 1},
                                {"arrival+self-pf8", F_SELF_PF, 1, 8, 0, 1},
                                {"arrival", 0, 1, 0, 0, 1},
                                {"relaxed", F_EARLY | F_RELAXED, 1, 0, 1, 1},
                                {"relaxed+self-pf12", F_EARLY | F_RELAXED | F_SELF_PF, 1, 12, 1, 1},
                                {"arrival", 0, 1, 0, 1, 1}};
    const Variant* variants = prefetch_set ? prefetch : layout;
    const int nvariants = prefetch_set ? (int)(sizeof(prefetch) / sizeof(Variant)) : (int)(sizeof(layout) / sizeof(Variant));
    printf("{\"gpu\": \"%s\", \"sms\": %d, \"clock_khz\": %d, \"layers\": %d, \"slot_bytes\": %d, \"slots\": %d, "
           "\"set\": \"%s\", \"spin_pre\": [%d, %d, %d], \"spin_post\": [%d, %d, %d],\n",
           prop.name, prop.multiProcessorCount, clock_khz, LAYERS, SLOT_BYTES, NSLOT, prefetch_set ? "prefetch" : "layout",
           kSpinPre[0], kSpinPre[1], kSpinPre[2], kSpinPost[0], kSpinPost[1], kSpinPost[2]);
    printf(" \"rows\": [\n");
    size_t base = 0;
    bool first = true;
    for (int pi = 0; pi < (int)(sizeof(kPatterns) / sizeof(Pattern)); ++pi) {
        const Pattern& pat = kPatterns[pi];
        for (int vi = 0; vi < nvariants; ++vi) {
            const Variant& v = variants[vi];
            if (!(v.patterns >> pi & 1)) continue;
            ClusterLaunch launch(v.cluster, v.cluster, THREADS, SMEM_BYTES);  // the grid is set below
            cudaLaunchConfig_t& cfg = launch.cfg;
            int clusters = 0;
            CK(cudaOccupancyMaxActiveClusters(&clusters, stream, &cfg));
            // Resident blocks only (the grid barrier would deadlock otherwise), at most 128 compute.
            int nclusters, ncompute, extra = 0;
            if (v.flags & F_COPIER) {
                nclusters = std::min(clusters, (128 + v.cluster - 2) / (v.cluster - 1));
                ncompute = nclusters * (v.cluster - 1);
            } else {
                nclusters = std::min(std::min(clusters, prop.multiProcessorCount), 128);
                ncompute = nclusters;
                if (v.prefetch && !(v.flags & F_SELF_PF)) extra = std::min(clusters, prop.multiProcessorCount) - ncompute;
            }
            if (v.prefetch && !(v.flags & F_SELF_PF) && extra < 1) continue;
            // A phase's tiles must fit the ring when they are handed back only at its arrival.
            bool fits = true;
            Args a{};
            a.nphase = pat.nphase;
            long long tiles_layer = 0;
            for (int p = 0; p < pat.nphase; ++p) {
                // The layer's bytes as on 128 blocks, spread over the compute blocks (rounded up).
                a.tiles[p] = (pat.tiles[p] * 128 + ncompute - 1) / ncompute;
                tiles_layer += (long long)a.tiles[p] * ncompute;
                if (!(v.flags & F_EARLY) && a.tiles[p] > NSLOT) fits = false;
                a.spin_pre[p] = v.spin ? kSpinPre[p] : 0;
                a.spin_post[p] = v.spin ? kSpinPost[p] : 0;
            }
            if (!fits) continue;
            cfg.gridDim = dim3(nclusters * v.cluster + extra);
            a.src = src;
            a.src_tiles = src_bytes / SLOT_BYTES;
            a.flags = v.flags;
            a.ncompute = ncompute;
            a.prefetch_ahead = v.prefetch;
            a.progress = progress;
            a.counter = counter;
            a.vec = vec;
            a.stamps = stamps;
            a.sink = sink;
            const long long tiles_launch = tiles_layer * LAYERS / ncompute;
            std::vector<float> ms;
            std::vector<long long> phase_cycles[MAX_PHASE];
            std::vector<long long> host(nstamp);
            for (int rep = 0; rep < LAUNCHES; ++rep) {
                a.base = base;
                base += tiles_launch;
                CK(cudaMemset(progress, 0, 128));
                const float t = launch_ms([&] { (void)cudaLaunchKernelEx(&cfg, stream, a); });
                CK(cudaGetLastError());
                CK(cudaDeviceSynchronize());
                if (rep == 0) continue;  // warm-up
                ms.push_back(t);
                CK(cudaMemcpy(host.data(), stamps, sizeof(long long) * nstamp, cudaMemcpyDeviceToHost));
                for (int s = 0; s < LAYERS * pat.nphase; ++s) phase_cycles[s % pat.nphase].push_back(host[s + 1] - host[s]);
            }
            std::sort(ms.begin(), ms.end());
            const double med = ms[ms.size() / 2];
            const double layer_us = med * 1e3 / LAYERS;
            const double bytes_layer = (double)tiles_layer * SLOT_BYTES;
            printf("%s  {\"pattern\": \"%s\", \"variant\": \"%s\", \"stand_in_arithmetic\": %s, \"cluster\": %d, "
                   "\"max_active_clusters\": %d, \"blocks\": %d, \"compute_blocks\": %d, \"prefetch_ahead_tiles\": %d, "
                   "\"tiles_per_phase\": [%d, %d, %d], \"layer_mb\": %.2f, "
                   "\"launch_ms_median\": %.4f, \"launch_ms_min\": %.4f, \"us_per_layer\": %.3f, \"stream_gbps\": %.0f, "
                   "\"phase_cycles_p50\": [%lld, %lld, %lld]}",
                   first ? "" : ",\n", pat.name, v.name, v.spin ? "true" : "false", v.cluster, clusters,
                   nclusters * v.cluster + extra, ncompute, v.prefetch, a.tiles[0], a.tiles[1], a.tiles[2],
                   bytes_layer / 1e6, med, ms[0], layer_us, bytes_layer / (layer_us * 1e3),
                   percentile(phase_cycles[0], 0.5), percentile(phase_cycles[1], 0.5), percentile(phase_cycles[2], 0.5));
            first = false;
            fflush(stdout);
        }
    }
    printf("\n ]}\n");
    return 0;
}
