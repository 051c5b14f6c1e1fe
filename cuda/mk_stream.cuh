// The weight stream: every block copies the weights (and K/V rows) it will need into a ring of
// shared-memory slots, several tiles ahead of the phase that uses them. Weights do not depend on
// activations, so their HBM reads overlap the grid barriers and the dependent latency of the
// phases before; a phase finds its operands on chip and pays only for the activation it waits on.
//
// One producer warp per block (its lane 0) walks the frame's tile sequence and issues the copies;
// it never joins the consumers' barriers, so a copy instruction that stalls while every SM is
// pulling from HBM at once holds up nobody. Tile i lives in slot i % nslot. full[s] completes
// when tile i's bytes have landed (phase parity (i / nslot) & 1); the consumers' thread 0 arrives
// on empty[s] once every consumer is done with tile i (for a matrix phase: at the grid arrival
// that ends it), which lets the producer put tile i + nslot there.
#pragma once

#include "mk_util.cuh"

#define QMK_SLOT_BYTES (32 * 1024)
#define QMK_MAX_SLOTS 8
#define QMK_TILE_RANGES 5  // half rows of a 6144-wide matrix: 5 x 6 KB per slot

// The block's dynamic shared memory. Every scratch area sits at a fixed offset in it, so their
// addresses are immediates instead of pointers held in registers. The includer defines
// QMK_SMEM_RING (sizeof(RingState), 16-byte aligned) and QMK_SMEM_SLOTS (128-byte aligned).
extern __shared__ __align__(128) unsigned char qmk_smem[];

struct Range {
    const void* src;
    uint32_t bytes;
};

// Up to QMK_TILE_RANGES contiguous global ranges copied back to back into one slot.
struct Tile {
    Range r[QMK_TILE_RANGES];
    int n;
    int kv = 0;  // K/V rows (activations) rather than weights
};

struct RingState {
    uint64_t full[QMK_MAX_SLOTS];
    uint64_t empty[QMK_MAX_SLOTS];
    uint32_t issued;  // set by the producer when it stops
    uint32_t stop;    // set by the consumers when the frame ends (EOS may end it early)
};

__device__ __forceinline__ RingState& ring_state() { return *reinterpret_cast<RingState*>(qmk_smem + QMK_SMEM_RING); }

__device__ __forceinline__ unsigned char* slot_ptr(uint32_t i, int nslot) {
    return qmk_smem + QMK_SMEM_SLOTS + (size_t)(i % nslot) * QMK_SLOT_BYTES;
}

// Thread 0 of the block, before the first __syncthreads.
__device__ __forceinline__ void ring_init(int nslot) {
    RingState& rs = ring_state();
    for (int s = 0; s < nslot; ++s) {
        mbar_init(rs.full + s, 1);   // the producer's arrival (with its bytes)
        mbar_init(rs.empty + s, 1);  // the consumers' thread 0
    }
    rs.issued = 0;
    rs.stop = 0;
#if __CUDA_ARCH__ >= 900
    fence_proxy_async_shared();
#endif
}

// Producer lane: copy tile number `i` into its slot. `written_here`: the source was written by
// generic stores earlier in this launch (K/V rows of the code predictor). `weights`: read once per
// frame, evicted from L2 first (Hopper; sm_80 copies without a hint).
__device__ __forceinline__ void issue_tile(const Tile& t, uint32_t i, int nslot, bool written_here, bool weights) {
    uint64_t* bar = ring_state().full + i % nslot;
    unsigned char* dst = slot_ptr(i, nslot);
#if __CUDA_ARCH__ >= 900
    if (written_here) fence_proxy_async_global();
    uint32_t total = 0;
    for (int k = 0; k < t.n; ++k) total += t.r[k].bytes;
    mbar_expect_tx(bar, total);
    const uint64_t pol = evict_first_policy();
    for (int k = 0; k < t.n; ++k) {
        if (weights) bulk_copy_hint(dst, t.r[k].src, t.r[k].bytes, bar, pol);
        else bulk_copy(dst, t.r[k].src, t.r[k].bytes, bar);
        dst += t.r[k].bytes;
    }
#else
    (void)written_here;
    (void)weights;  // cp.async reads through the generic proxy
    for (int k = 0; k < t.n; ++k) {
        const unsigned char* src = static_cast<const unsigned char*>(t.r[k].src);
        for (uint32_t o = 0; o < t.r[k].bytes; o += 16) cp_async16(dst + o, src + o);
        dst += t.r[k].bytes;
    }
    cp_async_arrive(bar);  // counts when this lane's copies have landed
#endif
}

// Producer lane: wait until the consumers released the tile that last used tile i's slot.
// False when they stopped the frame instead.
__device__ __forceinline__ bool wait_slot_free(uint32_t i, int nslot) {
    if (i < (uint32_t)nslot) return true;
    RingState& rs = ring_state();
    const unsigned parity = ((i / nslot) + 1u) & 1u;  // completion number i / nslot - 1
    while (!mbar_test(rs.empty + i % nslot, parity))
        if (*reinterpret_cast<volatile uint32_t*>(&rs.stop)) return false;
    return true;
}

// Consumer side; `consumed` is the same in every consumer thread.
struct Ring {
    int nslot;
    uint32_t consumed;
    uint32_t deferred;  // tiles done with, released to the producer at the next grid arrival
    // Tiles released one grid arrival after the deferred ones (hold): hold_next for the coming
    // arrival, then [held_at, held_at + held) at the arrival after it.
    uint32_t hold_next, held, held_at;

    // The slot of tile consumed + k, once its bytes have landed.
    __device__ const unsigned char* wait(uint32_t k) const {
        const uint32_t i = consumed + k;
        mbar_wait(ring_state().full + i % nslot, (i / nslot) & 1u);
        return slot_ptr(i, nslot);
    }

    // Thread 0: hand tiles first .. first + n - 1 back to the producer.
    __device__ void arrive_empty(uint32_t first, uint32_t n) const {
        for (uint32_t k = 0; k < n; ++k) mbar_arrive(ring_state().empty + (first + k) % nslot);
    }

    // Every consumer thread, after a block_sync() since the last read of these tiles' slots.
    __device__ void release(uint32_t n) {
        if (threadIdx.x == 0) arrive_empty(consumed, n);
        consumed += n;
    }

    // A matrix phase's tiles are handed back to the producer only once the block has arrived at
    // the grid barrier that ends the phase (every consumer thread calls defer; thread 0 then
    // release_deferred after its arrival; all end_deferred after the barrier). The arrival's
    // release fence completes only once every bulk copy this block issued has landed
    // (bench/fence_probe.cu): releasing before the arrival cost ~0.26 ms a frame (bench/NOTES.md).
    __device__ void defer(uint32_t n) { deferred += n; }

    __device__ void release_deferred() const {
        arrive_empty(consumed, deferred);
        arrive_empty(held_at, held);
    }

    __device__ void end_deferred() {
        held_at = consumed + deferred;
        held = hold_next;
        consumed += deferred + hold_next;
        deferred = hold_next = 0;
    }

    // The n tiles after the deferred ones go back one grid arrival later than those, so one
    // arrival does not hand the producer a whole layer's worth of copies (phases/mlp.cuh,
    // run_gu_split). The phase after must need no more than the slots left.
    __device__ void hold(uint32_t n) { hold_next += n; }

    // The frame is over (every consumer thread): stop the producer, meet it at the block barrier
    // (it calls __syncthreads once it has stopped), then wait for copies still landing in slots
    // nobody will read before the block's shared memory goes away.
    __device__ void finish() {
        block_sync();
        if (threadIdx.x == 0) *reinterpret_cast<volatile uint32_t*>(&ring_state().stop) = 1u;
        __syncthreads();
        const uint32_t issued = *reinterpret_cast<volatile uint32_t*>(&ring_state().issued);
        for (uint32_t i = consumed; i < issued; ++i) mbar_wait(ring_state().full + i % nslot, (i / nslot) & 1u);
    }
};
