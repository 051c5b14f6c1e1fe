// What the standalone microbenchmarks in bench/ share: the megakernel's grid barrier and the
// wall time of one launch.
#pragma once

#include <cuda_runtime.h>

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
