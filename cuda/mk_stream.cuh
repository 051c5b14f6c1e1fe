// The weight stream: every block copies the weights (and K/V rows) it will need into a ring of
// shared-memory slots, several tiles ahead of the phase that uses them. Weights do not depend on
// activations, so their HBM reads overlap the grid barriers and the dependent latency of the
// phases before; a phase finds its operands on chip and pays only for the activation it waits on.
//
// A tile is at most two contiguous global ranges copied back to back into one slot. Tile i lives
// in slot i % nslot and completes phase (i / nslot) & 1 of that slot's mbarrier. The consumer
// (every thread) counts the tiles it has finished with; the producer cursor (which tile comes
// next) lives in shared memory and is advanced by thread 0 alone, in a function the caller keeps
// out of line, so the hot loops never hold its state in registers.
#pragma once

#include "mk_util.cuh"

#define QMK_SLOT_BYTES (32 * 1024)
#define QMK_MAX_SLOTS 8

// The block's dynamic shared memory. Every scratch area sits at a fixed offset in it, so their
// addresses are immediates instead of pointers held in registers. The includer defines
// QMK_SMEM_RING (sizeof(RingState), 16-byte aligned) and QMK_SMEM_SLOTS (128-byte aligned).
extern __shared__ __align__(128) unsigned char qmk_smem[];

struct Range {
    const void* src;
    uint32_t bytes;
};

struct Tile {
    Range r[2];  // r[1].bytes may be 0
};

// Producer state, in shared memory.
struct RingState {
    uint64_t bars[QMK_MAX_SLOTS];
    uint32_t issued;          // tiles issued so far
    int phase, tile, ntiles;  // cursor: next tile is `tile` of phase `phase` (ntiles tiles)
#if __CUDA_ARCH__ < 900
    // sm_80 hand-off: thread 0 names the tiles, every thread copies a share of them.
    uint32_t first, count;
    Tile pending[QMK_MAX_SLOTS];
#endif
};

__device__ __forceinline__ RingState& ring_state() { return *reinterpret_cast<RingState*>(qmk_smem + QMK_SMEM_RING); }

__device__ __forceinline__ unsigned char* slot_ptr(uint32_t i, int nslot) {
    return qmk_smem + QMK_SMEM_SLOTS + (size_t)(i % nslot) * QMK_SLOT_BYTES;
}

// Thread 0: start copying tile number `i` (sm_90), or queue it for every thread (sm_80).
__device__ __forceinline__ void issue_tile(const Tile& t, uint32_t i, int nslot) {
    RingState& rs = ring_state();
#if __CUDA_ARCH__ >= 900
    uint64_t* bar = rs.bars + i % nslot;
    unsigned char* dst = slot_ptr(i, nslot);
    fence_proxy_async();
    mbar_expect_tx(bar, t.r[0].bytes + t.r[1].bytes);
    bulk_copy(dst, t.r[0].src, t.r[0].bytes, bar);
    if (t.r[1].bytes) bulk_copy(dst + t.r[0].bytes, t.r[1].src, t.r[1].bytes, bar);
#else
    if (rs.count == 0) rs.first = i;
    rs.pending[rs.count++] = t;
#endif
}

// Consumer side; `consumed` is the same in every thread.
struct Ring {
    int nslot;
    uint32_t consumed;

    // Thread 0 has set up the producer cursor; mbarriers initialised here.
    __device__ void init() {
        RingState& rs = ring_state();
        if (threadIdx.x == 0) {
            for (int s = 0; s < nslot; ++s) {
#if __CUDA_ARCH__ >= 900
                mbar_init(rs.bars + s, 1);  // one arrive.expect_tx per tile
#else
                mbar_init(rs.bars + s, QMK_THREADS);  // every thread's cp.async arrival
#endif
            }
            rs.issued = 0;
#if __CUDA_ARCH__ >= 900
            fence_proxy_async();
#else
            rs.count = 0;
#endif
        }
        consumed = 0;
        __syncthreads();
    }

    // The next tile's slot, once its bytes have landed.
    __device__ const unsigned char* wait() const {
        mbar_wait(ring_state().bars + consumed % nslot, (consumed / nslot) & 1u);
        return slot_ptr(consumed, nslot);
    }

    // After `produce` (thread 0) ran: on sm_80 every thread copies its share of the queued
    // tiles. Called by every thread.
    __device__ void after_produce() {
#if __CUDA_ARCH__ < 900
        __syncthreads();
        RingState& rs = ring_state();
        for (uint32_t k = 0; k < rs.count; ++k) {
            const Tile& t = rs.pending[k];
            unsigned char* dst = slot_ptr(rs.first + k, nslot);
            for (int j = 0; j < 2; ++j) {
                const unsigned char* src = static_cast<const unsigned char*>(t.r[j].src);
                for (uint32_t o = threadIdx.x * 16u; o < t.r[j].bytes; o += QMK_THREADS * 16u) cp_async16(dst + o, src + o);
                dst += t.r[j].bytes;
            }
            cp_async_arrive(ring_state().bars + (rs.first + k) % nslot);
        }
        __syncthreads();
        if (threadIdx.x == 0) rs.count = 0;
#endif
    }

    // Before the block exits: copies may still be landing in slots nobody will read.
    __device__ void drain() {
        __syncthreads();
        const uint32_t issued = ring_state().issued;
        for (uint32_t i = consumed; i < issued; ++i) mbar_wait(ring_state().bars + i % nslot, (i / nslot) & 1u);
        __syncthreads();
    }
};
