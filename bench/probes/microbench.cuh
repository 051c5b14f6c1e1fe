// What the standalone microbenchmarks and probes in bench/ share: error checks, the cycle counter,
// an mbarrier test, shared-memory and cluster addressing, a cluster launch configuration, percentiles, the fence probes' buffers and round summary,
// the megakernel's grid barrier and the wall time of one launch.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

// A CUDA call in a probe's main(): on failure, say which and where, and return 1.
#define CK(x)                                                                                   \
    do {                                                                                        \
        cudaError_t e_ = (x);                                                                   \
        if (e_ != cudaSuccess) {                                                                \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
            return 1;                                                                           \
        }                                                                                       \
    } while (0)

// The SM's cycle counter, ordered with the memory operations around it.
__device__ __forceinline__ long long clk() {
    long long t;
    asm volatile("mov.u64 %0, %%clock64;" : "=l"(t)::"memory");
    return t;
}

// Whether the mbarrier at shared address `bar` has completed the phase of this parity.
__device__ __forceinline__ bool mbar_done(uint32_t bar, unsigned parity) {
    uint32_t ok;
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
                 : "=r"(ok)
                 : "r"(bar), "r"(parity)
                 : "memory");
    return ok != 0;
}

// Shared-memory and cluster helpers of the probes that use mbarriers and clusters.
__device__ __forceinline__ uint32_t s32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ uint32_t cluster_rank() {
    uint32_t r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
// The shared::cluster address of `addr` (this block's shared memory) in cluster rank `rank`.
__device__ __forceinline__ uint32_t map_to(uint32_t addr, uint32_t rank) {
    uint32_t r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(addr), "r"(rank));
    return r;
}
// Every thread of every block of the cluster.
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// The q-quantile of v (sorted in place); -1 when empty.
inline long long percentile(std::vector<long long>& v, double q) {
    if (v.empty()) return -1;
    std::sort(v.begin(), v.end());
    return v[std::min(v.size() - 1, (size_t)(q * (v.size() - 1)))];
}

// What the fence probes share: a 4 GB source that a run walks so no line repeats (HBM reads), a
// 128-byte counter line per block, and per block and round two cycle counts (the timed operation,
// and when the copies landed or -1), set to -1 before each variant.
struct ProbeBuffers {
    unsigned char* src = nullptr;
    size_t src_bytes = (size_t)4 << 30;
    unsigned* counters = nullptr;
    long long* out = nullptr;
    size_t n_out = 0;
};

inline cudaError_t alloc_probe_buffers(ProbeBuffers& b, int blocks, int iters) {
    cudaError_t e;
    if ((e = cudaMalloc(&b.src, b.src_bytes)) != cudaSuccess || (e = cudaMemset(b.src, 1, b.src_bytes)) != cudaSuccess)
        return e;
    const size_t ctr_bytes = sizeof(unsigned) * 32 * blocks;
    if ((e = cudaMalloc(&b.counters, ctr_bytes)) != cudaSuccess ||
        (e = cudaMemset(b.counters, 0, ctr_bytes)) != cudaSuccess)
        return e;
    b.n_out = (size_t)blocks * iters * 2;
    return cudaMalloc(&b.out, b.n_out * sizeof(long long));
}

// The rounds of `host` (a copy of ProbeBuffers::out) that ran, each launch's first 4 left out:
// the timed operation's cycles into `ops`, the landing times that were taken into `lands`.
inline void collect_rounds(const std::vector<long long>& host, int iters, std::vector<long long>& ops,
                           std::vector<long long>& lands) {
    for (size_t i = 0; i + 1 < host.size(); i += 2) {
        if (host[i] < 0 || (int)((i / 2) % iters) < 4) continue;
        ops.push_back(host[i]);
        if (host[i + 1] >= 0) lands.push_back(host[i + 1]);
    }
}

// Two launches of `launch()` (the first warms up) on ProbeBuffers::out set to -1, then the second
// launch's rounds (collect_rounds) into `ops` and `lands`; `host` is the copy's buffer.
template <class Launch>
cudaError_t launch_and_collect(const ProbeBuffers& b, int iters, std::vector<long long>& host, Launch launch,
                               std::vector<long long>& ops, std::vector<long long>& lands) {
    cudaError_t e;
    if ((e = cudaMemset(b.out, 0xff, b.n_out * sizeof(long long))) != cudaSuccess) return e;
    for (int rep = 0; rep < 2; ++rep) {
        launch();
        if ((e = cudaGetLastError()) != cudaSuccess || (e = cudaDeviceSynchronize()) != cudaSuccess) return e;
    }
    if ((e = cudaMemcpy(host.data(), b.out, b.n_out * sizeof(long long), cudaMemcpyDeviceToHost)) != cudaSuccess)
        return e;
    collect_rounds(host, iters, ops, lands);
    return cudaSuccess;
}

// A launch configuration with a 1-D cluster dimension. `cfg.attrs` points into the object, so it is
// neither copied nor moved.
struct ClusterLaunch {
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute attr[1] = {};
    ClusterLaunch(int cluster, int grid, int threads, size_t smem_bytes) {
        cfg.gridDim = dim3(grid);
        cfg.blockDim = dim3(threads);
        cfg.dynamicSmemBytes = smem_bytes;
        attr[0].id = cudaLaunchAttributeClusterDimension;
        attr[0].val.clusterDim.x = cluster;
        attr[0].val.clusterDim.y = 1;
        attr[0].val.clusterDim.z = 1;
        cfg.attrs = attr;
        cfg.numAttrs = 1;
    }
    ClusterLaunch(const ClusterLaunch&) = delete;
    ClusterLaunch& operator=(const ClusterLaunch&) = delete;
};

// The megakernel's grid barrier (cuda/mk_util.cuh: top-bit flip on a counter that never resets,
// release arrival, acquire wait) over all threads of the block. One block per SM, every block
// resident: the launches size the grid that way.
__device__ __forceinline__ void grid_barrier(unsigned* counter) {
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned add = blockIdx.x == 0 ? 0x80000000u - (gridDim.x - 1) : 1u;
        unsigned old, cur;
        asm volatile("atom.add.release.gpu.global.u32 %0, [%1], %2;" : "=r"(old) : "l"(counter), "r"(add) : "memory");
        do {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(cur) : "l"(counter) : "memory");
        } while (((old ^ cur) & 0x80000000u) == 0);
    }
    __syncthreads();
}

// Milliseconds between CUDA events recorded around `launch()` on the default stream.
template <class Launch>
float launch_ms(Launch launch) {
    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    cudaEventRecord(a);
    launch();
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    float ms = 0.f;
    cudaEventElapsedTime(&ms, a, b);
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    return ms;
}
