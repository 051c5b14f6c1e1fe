// Microbenchmark: how long does it take every SM to read the same N KB from L2 at once (what each
// megakernel phase does with its operand right after a grid barrier), against every SM reading
// its own N KB?
//
//   nvcc -O3 -arch=sm_90 -o /tmp/broadcast_read bench/probes/broadcast_read.cu && /tmp/broadcast_read
//
// One persistent launch of one block per SM (150 KB of unused shared memory keeps it to one) (128 reading threads, like the
// megakernel's row group 0). Each iteration: a grid barrier, then every block reads `kb` KB with
// 16-byte L2 loads (ld.global.cg) and folds them into a register; block 0's thread 0 records the
// cycles from the barrier's exit to the block's last load landing (a __syncthreads). Prints the
// median over iterations in microseconds, per size, for "same" (all blocks read one buffer) and
// "own" (block b reads buffer b).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "microbench.cuh"

__global__ void read_kernel(const float4* src, size_t stride4, int n4, int iters, unsigned* counter,
                            long long* cycles, float* sink) {
    const float4* p = src + blockIdx.x * stride4;
    float acc = 0.f;
    for (int it = 0; it < iters; ++it) {
        grid_barrier(counter);
        const long long t0 = clock64();
        for (int i = threadIdx.x; i < n4; i += blockDim.x) {
            const float4 v = __ldcg(p + i);
            acc += v.x + v.y + v.z + v.w;
        }
        __syncthreads();
        if (blockIdx.x == 0 && threadIdx.x == 0) cycles[it] = clock64() - t0;
    }
    if (acc == 12345.f) *sink = acc;  // keeps the loads
}

int main() {
    int sms = 0, clock_khz = 0;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0);
    const int iters = 400, threads = 128;
    const int sizes_kb[] = {2, 4, 8, 12, 16, 32, 64, 128};
    const size_t max_bytes = 128 * 1024;
    float4* buf;
    unsigned* counter;
    long long* cycles;
    float* sink;
    cudaMalloc(&buf, max_bytes * sms);
    cudaMemset(buf, 0, max_bytes * sms);
    cudaMalloc(&counter, 4);
    cudaMemset(counter, 0, 4);
    cudaMalloc(&cycles, iters * sizeof(long long));
    cudaMalloc(&sink, 4);
    std::vector<long long> host(iters);
    // Unused shared memory so that only one block fits per SM: one reader per SM, like the kernel.
    const int smem = 150 * 1024;
    cudaFuncSetAttribute(read_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    printf("{\"sms\": %d, \"boost_clock_mhz\": %.0f, \"threads_per_block\": %d, \"iters\": %d, \"rows\": [\n", sms,
           clock_khz / 1e3, threads, iters);
    bool first = true;
    for (int kb : sizes_kb) {
        for (int own = 0; own < 2; ++own) {
            const int n4 = kb * 1024 / 16;
            const size_t stride4 = own ? max_bytes / 16 : 0;
            read_kernel<<<sms, threads, smem>>>(buf, stride4, n4, 20, counter, cycles, sink);  // warm-up
            const float ms =
                launch_ms([&] { read_kernel<<<sms, threads, smem>>>(buf, stride4, n4, iters, counter, cycles, sink); });
            cudaMemcpy(host.data(), cycles, iters * sizeof(long long), cudaMemcpyDeviceToHost);
            std::sort(host.begin(), host.end());
            const double med_cyc = (double)host[iters / 2];
            const double us = med_cyc / (clock_khz / 1e3);
            printf("%s  {\"kb\": %d, \"mode\": \"%s\", \"median_cycles\": %.0f, \"median_us_at_boost\": %.3f, "
                   "\"iteration_us\": %.3f, \"aggregate_GBps\": %.1f}",
                   first ? "" : ",\n", kb, own ? "own" : "same", med_cyc, us, ms * 1e3 / iters,
                   (double)kb * 1024 * sms / (us * 1e-6) / 1e9);
            first = false;
        }
    }
    printf("\n]}\n");
    const cudaError_t e = cudaDeviceSynchronize();
    if (e != cudaSuccess) {
        fprintf(stderr, "CUDA error: %s\n", cudaGetErrorString(e));
        return 1;
    }
    return 0;
}
