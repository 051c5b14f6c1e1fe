// Microbenchmark: what does it cost every SM to add a full hidden-wide partial vector into one
// accumulator between two grid barriers? This is the price of a split-K down projection: each
// block multiplies its slice of the MLP activations by the matching rows of down^T and adds the
// resulting hidden-wide partial into the residual, instead of a grid barrier between gate/up and
// down.
//
//   nvcc -O3 -arch=sm_90 -o /tmp/rp bench/probes/reduce_partials.cu && /tmp/rp
//
// One persistent launch of one block per SM (512 threads, 150 KB of unused shared memory, like the
// megakernel's consumers). Each iteration: a grid barrier (release arrival, acquire wait), then
// the block's work, and the next barrier's arrival waits for it. Modes:
//   barrier   nothing (the floor)
//   store     each block stores its own hidden/blocks floats (today's down epilogue)
//   red_u64   every thread converts its hidden/512 floats to 2^-32 fixed point and adds them with
//             red.global.add.u64 (deterministic: integer sums do not depend on order)
//   red_f32   red.global.add.f32 per float (order-dependent)
//   red_f32x4 red.global.add.v4.f32 (sm_90), a quarter of the requests (order-dependent)
// Block 0's thread 0 records the cycles between consecutive barrier exits; prints medians (us at
// the boost clock) and the event-timed iteration, per mode and width, as JSON. It also checks that
// red_u64 sums exactly.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "microbench.cuh"

enum Mode { M_BARRIER = 0, M_STORE, M_RED_U64, M_RED_F32, M_RED_F32X4, M_COUNT };
static const char* kModes[] = {"barrier", "store", "red_u64", "red_f32", "red_f32x4"};

__global__ void reduce_kernel(int mode, int width, int iters, unsigned* counter, long long* cycles,
                              unsigned long long* acc64, float* acc32) {
    const int per = width / blockDim.x;  // floats per thread: 2 or 4
    long long last = 0;
    grid_barrier(counter);
    for (int it = 0; it < iters; ++it) {
        // A partial that differs per block and iteration, as a real one would.
        float v[4];
        // Unfused (no FMA), so the host's check computes the same floats.
        for (int e = 0; e < 4; ++e)
            v[e] = __fadd_rn(__fmul_rn(0.001f, (float)((blockIdx.x * 7 + threadIdx.x * 3 + e + it) % 97)), -0.048f);
        const int i0 = threadIdx.x * per;
        switch (mode) {
            case M_STORE: {
                const int rows = width / gridDim.x + 1;
                if ((int)threadIdx.x < rows && blockIdx.x * rows + threadIdx.x < (unsigned)width)
                    __stcg(acc32 + blockIdx.x * rows + threadIdx.x, v[0]);
                break;
            }
            case M_RED_U64:
                for (int e = 0; e < per; ++e) {
                    const long long q = __float2ll_rn(v[e] * 4294967296.f);
                    asm volatile("red.relaxed.gpu.global.add.u64 [%0], %1;" ::"l"(acc64 + i0 + e), "l"(q) : "memory");
                }
                break;
            case M_RED_F32:
                for (int e = 0; e < per; ++e)
                    asm volatile("red.relaxed.gpu.global.add.f32 [%0], %1;" ::"l"(acc32 + i0 + e), "f"(v[e]) : "memory");
                break;
            case M_RED_F32X4:
#if __CUDA_ARCH__ >= 900
                if ((int)threadIdx.x * 4 < width)
                    asm volatile("red.relaxed.gpu.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(acc32 + threadIdx.x * 4),
                                 "f"(v[0]), "f"(v[1]), "f"(v[2]), "f"(v[3])
                                 : "memory");
#endif
                break;
            default: break;
        }
        grid_barrier(counter);
        if (blockIdx.x == 0 && threadIdx.x == 0) {
            const long long now = clock64();
            if (it > 0) cycles[it - 1] = now - last;
            last = now;
        }
    }
}

int main() {
    int sms = 0, clock_khz = 0;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0);
    const int iters = 400, threads = 512, smem = 150 * 1024;
    unsigned* counter;
    long long* cycles;
    unsigned long long* acc64;
    float* acc32;
    cudaMalloc(&counter, 4);
    cudaMemset(counter, 0, 4);
    cudaMalloc(&cycles, iters * sizeof(long long));
    cudaMalloc(&acc64, 2048 * 8);
    cudaMalloc(&acc32, 2048 * 4);
    cudaFuncSetAttribute(reduce_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    std::vector<long long> host(iters - 1);
    printf("{\"sms\": %d, \"boost_clock_mhz\": %.0f, \"threads_per_block\": %d, \"iters\": %d, \"rows\": [\n", sms,
           clock_khz / 1e3, threads, iters);
    bool first = true, exact = true;
    for (int width : {1024, 2048}) {
        for (int mode = 0; mode < M_COUNT; ++mode) {
            cudaMemset(acc64, 0, 2048 * 8);
            cudaMemset(acc32, 0, 2048 * 4);
            reduce_kernel<<<sms, threads, smem>>>(mode, width, 20, counter, cycles, acc64, acc32);  // warm-up
            cudaMemset(acc64, 0, 2048 * 8);
            const float ms = launch_ms(
                [&] { reduce_kernel<<<sms, threads, smem>>>(mode, width, iters, counter, cycles, acc64, acc32); });
            cudaMemcpy(host.data(), cycles, (iters - 1) * sizeof(long long), cudaMemcpyDeviceToHost);
            std::sort(host.begin(), host.end());
            const double med = (double)host[host.size() / 2], p90 = (double)host[host.size() * 9 / 10];
            if (mode == M_RED_U64) {
                // The integer sum is exact: compare with the same fixed-point values summed on the host.
                std::vector<unsigned long long> got(width);
                cudaMemcpy(got.data(), acc64, width * 8, cudaMemcpyDeviceToHost);
                const int per = width / threads;
                for (int i = 0; i < width; ++i) {
                    long long want = 0;
                    const int t = i / per, e = i % per;
                    for (int it = 0; it < iters; ++it)
                        for (int blk = 0; blk < sms; ++blk) {
                            const float v = 0.001f * (float)((blk * 7 + t * 3 + e + it) % 97) - 0.048f;
                            want += llrintf(v * 4294967296.f);
                        }
                    if ((long long)got[i] != want) exact = false;
                }
            }
            printf("%s  {\"width\": %d, \"mode\": \"%s\", \"median_us_at_boost\": %.3f, \"p90_us_at_boost\": %.3f, "
                   "\"iteration_us\": %.3f}",
                   first ? "" : ",\n", width, kModes[mode], med / (clock_khz / 1e3), p90 / (clock_khz / 1e3),
                   ms * 1e3 / iters);
            first = false;
        }
    }
    printf("\n], \"red_u64_exact\": %s}\n", exact ? "true" : "false");
    const cudaError_t e = cudaDeviceSynchronize();
    if (e != cudaSuccess) {
        fprintf(stderr, "CUDA error: %s\n", cudaGetErrorString(e));
        return 1;
    }
    return exact ? 0 : 2;
}
