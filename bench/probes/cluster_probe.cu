// The two facts a cluster-based megakernel needs first (docs/journal/NOTES.md, "Targets after the
// twenty-first session"): how many thread-block clusters of each size the GPU holds at once with
// the megakernel's block shape (640 threads, one block per SM for its shared memory), and what a
// cluster barrier and a distributed-shared-memory handoff cost against the grid barrier.
//
// Per cluster size S in 1, 2, 4, 8, 16 (16 is a non-portable size):
//   max_active_clusters  cudaOccupancyMaxActiveClusters for that shape;
//   then on min(128, S x that count) blocks (all resident, so the grid barrier cannot
//   deadlock), per round, p50 / p90 cycles of block 0's thread 0 over
//   ROUNDS rounds of each launch:
//     grid     the megakernel's grid barrier (bench/probes/microbench.cuh) across those blocks;
//     cluster  barrier.cluster arrive.release / wait.acquire across the S blocks;
//     handoff  every block of a cluster stores 1 KB into the rank-0 block's shared memory
//              (st.shared::cluster), a cluster barrier, rank 0 sums what arrived: the
//              attention's partials merged on chip instead of through L2.
//
// Build here and carry the binary (bench/README.md); it needs no library:
//   nvcc -O3 -std=c++17 -arch=sm_90a -o .probe/cluster_probe bench/probes/cluster_probe.cu
//   .probe/cluster_probe > $OUT/cluster_probe.json
// Found on the H200 (bench/results/2026-11-25-h200-stream-probe/cluster_probe_h200_2026-11-25.json):
// at most 7 clusters of 16 and 15 of 8 are resident with this shape, so 128 blocks in clusters of
// 8 or 16 are not; a cluster barrier costs ~630 cycles (~770 at 16) against the grid barrier's ~1900.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "microbench.cuh"

#define THREADS 640
#define GRID 128
#define ROUNDS 200
#define HANDOFF_FLOATS 256  // 1 KB per block
#define MAX_CLUSTER 16
// The megakernel's block holds ~200 KB of shared memory, so one block fits an SM.
#define SMEM_BYTES (200 * 1024)

enum Mode { M_GRID = 0, M_CLUSTER, M_HANDOFF, M_COUNT };
static const char* kModeNames[M_COUNT] = {"grid barrier (atomic arrival, acquire poll)",
                                          "cluster barrier (arrive.release + wait.acquire)",
                                          "1 KB per block into rank 0's shared memory + cluster barrier + rank 0 sums"};

extern __shared__ __align__(16) float smem_f[];


__global__ void __launch_bounds__(THREADS, 1) probe(int mode, unsigned* counter, long long* out, float* sink) {
    const uint32_t rank = cluster_rank();
    float acc = 0.f;
    // Rank r's 1 KB lands at offset r * HANDOFF_FLOATS of rank 0's shared memory.
    const uint32_t mine = (uint32_t)__cvta_generic_to_shared(smem_f + rank * HANDOFF_FLOATS + threadIdx.x);
    uint32_t remote = 0;
    if (mode == M_HANDOFF) asm volatile("mapa.shared::cluster.u32 %0, %1, 0;" : "=r"(remote) : "r"(mine));
    cluster_sync();  // every block of the cluster has started before any remote store
    for (int r = 0; r < ROUNDS; ++r) {
        const long long t0 = clk();
        if (mode == M_GRID) {
            grid_barrier(counter);
        } else if (mode == M_CLUSTER) {
            cluster_sync();
        } else {
            if (threadIdx.x < HANDOFF_FLOATS)
                asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(remote), "f"((float)(r + rank)) : "memory");
            cluster_sync();
            if (rank == 0 && threadIdx.x < HANDOFF_FLOATS) {
                unsigned size;
                asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(size));
                for (unsigned k = 0; k < size; ++k) acc += smem_f[k * HANDOFF_FLOATS + threadIdx.x];
            }
            cluster_sync();  // rank 0 has read before the next round's stores
        }
        const long long t1 = clk();
        if (blockIdx.x == 0 && threadIdx.x == 0) out[r] = t1 - t0;
    }
    if (acc == -1.f) sink[threadIdx.x] = acc;  // never true: keeps the sums
}

int main() {
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    unsigned* counter = nullptr;
    long long* out = nullptr;
    float* sink = nullptr;
    CK(cudaMalloc(&counter, sizeof(unsigned)));
    CK(cudaMemset(counter, 0, sizeof(unsigned)));
    CK(cudaMalloc(&out, sizeof(long long) * ROUNDS));
    CK(cudaMalloc(&sink, sizeof(float) * THREADS));
    CK(cudaFuncSetAttribute(probe, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_BYTES));
    CK(cudaFuncSetAttribute(probe, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    printf("{\"gpu\": \"%s\", \"sms\": %d, \"grid\": %d, \"threads\": %d, \"smem_bytes\": %d, \"rounds\": %d,\n",
           prop.name, prop.multiProcessorCount, GRID, THREADS, SMEM_BYTES, ROUNDS);
    printf(" \"rows\": [\n");
    bool first = true;
    std::vector<long long> host(ROUNDS);
    for (int size : {1, 2, 4, 8, MAX_CLUSTER}) {
        ClusterLaunch launch(size, GRID, THREADS, SMEM_BYTES);
        cudaLaunchConfig_t& cfg = launch.cfg;
        int clusters = 0;
        const cudaError_t occ = cudaOccupancyMaxActiveClusters(&clusters, probe, &cfg);
        printf("%s  {\"cluster_size\": %d, \"max_active_clusters\": %d, \"occupancy_error\": \"%s\"",
               first ? "" : ",\n", size, occ == cudaSuccess ? clusters : -1,
               occ == cudaSuccess ? "" : cudaGetErrorString(occ));
        first = false;
        if (occ != cudaSuccess || clusters < 1) {
            printf(", \"timed\": false}");
            (void)cudaGetLastError();
            continue;
        }
        // Where the GPU cannot hold 128 blocks in clusters of this size, time the barriers on the
        // blocks it can hold, so every block is resident and the grid barrier cannot deadlock.
        const int blocks = std::min(GRID, clusters * size);
        cfg.gridDim = dim3(blocks);
        printf(", \"grid_blocks\": %d", blocks);
        for (int mode = 0; mode < M_COUNT; ++mode) {
            if (mode == M_HANDOFF && size == 1) continue;
            for (int rep = 0; rep < 2; ++rep) {  // the first launch warms up
                CK(cudaLaunchKernelEx(&cfg, probe, mode, counter, out, sink));
                CK(cudaGetLastError());
                CK(cudaDeviceSynchronize());
            }
            CK(cudaMemcpy(host.data(), out, sizeof(long long) * ROUNDS, cudaMemcpyDeviceToHost));
            std::vector<long long> v(host.begin() + 10, host.end());  // a launch's first rounds apart
            const char* key = mode == M_GRID ? "grid" : mode == M_CLUSTER ? "cluster" : "handoff";
            printf(", \"%s_cycles_p50\": %lld, \"%s_cycles_p90\": %lld", key, percentile(v, 0.5), key,
                   percentile(v, 0.9));
        }
        printf(", \"timed\": true}");
        fflush(stdout);
    }
    printf("\n ],\n \"modes\": [\"%s\", \"%s\", \"%s\"]}\n", kModeNames[0], kModeNames[1], kModeNames[2]);
    return 0;
}
