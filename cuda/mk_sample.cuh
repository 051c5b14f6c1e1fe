// Logits processing and sampling by one block (spec §6 order). Every block of the grid runs it on
// the same logits with the same counter-based random number, so all blocks know the sampled id
// without a grid barrier.
#pragma once

#include "mk_util.cuh"
#include "qwen_mk.h"

#define QMK_MAX_PER_THREAD 8  // vocab <= 8 * QMK_THREADS

struct TalkerRules {
    const uint8_t* seen;
    float penalty;
    int mask_eos;
    int eos;
    int suppress_start;
};

// Monotone map float -> uint32 so that comparisons and reductions can run on integers.
__device__ __forceinline__ unsigned order_key(float v) {
    const unsigned u = __float_as_uint(v);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float key_value(unsigned k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// Exclusive prefix sum over the block in thread order; `scratch` holds QMK_WARPS floats.
__device__ __forceinline__ float block_exclusive_scan(float local, float* scratch) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    float x = local;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const float y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
    }
    block_sync();
    if (lane == 31) scratch[w] = x;
    block_sync();
    float before = 0.f;
    for (int i = 0; i < w; ++i) before += scratch[i];
    return before + x - local;
}

// The k-th largest of the block's keys: the largest K with count(key >= K) >= k. Found four bits
// at a time from the top: a round counts, for all 15 nonzero values d of the next digit at once,
// the keys >= (bits found so far | d), and keeps the largest d whose count reaches k. That is 8
// block barriers where a bit-by-bit search takes 32 (the barriers are most of the cost).
// Counts travel as 4-bit fields of one 64-bit word per thread (<= 8 keys each), then as two 16-bit
// fields per 32-bit word through warp and block sums (<= 4096 keys). `scratch`: 2 x 8 x QMK_WARPS
// words, alternating halves so that one barrier per round suffices (BlockReducer's argument).
static_assert(QMK_WARPS == 16, "kth_largest_key's read pattern: 4 lanes x 4 warps per word");

template <int EM>
__device__ __forceinline__ unsigned kth_largest_key(const unsigned* key, int E, unsigned k, unsigned* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    unsigned th = 0;
#pragma unroll 1
    for (int shift = 28, half = 0; shift >= 0; shift -= 4, half ^= 1) {
        // th has no bits below shift + 4 yet: comparing the bits above the digit against th orders
        // a key against every candidate at once.
        const unsigned above = shift == 28 ? 0u : 0xffffffffu << (shift + 4);
        unsigned long long fields = 0;  // field d - 1: keys >= th | d << shift, d = 1..15
#pragma unroll
        for (int e = 0; e < EM; ++e) {
            if (e < E) {
                const unsigned hi = key[e] & above;
                const unsigned reach = hi > th ? 15u : hi < th ? 0u : (key[e] >> shift) & 15u;
                fields += 0x0111111111111111ull & ((1ull << (4 * reach)) - 1ull);
            }
        }
        unsigned* s = scratch + half * 8 * QMK_WARPS;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const unsigned w = (unsigned)((fields >> (8 * j)) & 15ull) | ((unsigned)((fields >> (8 * j + 4)) & 15ull) << 16);
            const unsigned total = __reduce_add_sync(0xffffffffu, w);
            if (lane == 0) s[j * QMK_WARPS + warp] = total;
        }
        block_sync();
        // Lane l adds word l / 4 of warps 4 (l % 4) .. 4 (l % 4) + 3, then the four lanes of that word
        // combine: lane 4 j holds the counts for d = 2 j + 1 (low half) and 2 j + 2 (high half).
        const uint4 q = *reinterpret_cast<const uint4*>(s + (lane >> 2) * QMK_WARPS + (lane & 3) * 4);
        unsigned t = (q.x + q.y) + (q.z + q.w);
        t += __shfl_xor_sync(0xffffffffu, t, 1);
        t += __shfl_xor_sync(0xffffffffu, t, 2);
        // Counts fall as d grows, so the digit is the number of candidates that reach k.
        const bool lead = (lane & 3) == 0;
        const unsigned lo = __ballot_sync(0xffffffffu, lead && (t & 0xffffu) >= k);
        const unsigned hi = __ballot_sync(0xffffffffu, lead && (t >> 16) >= k);  // d = 16 counts 0
        th |= (unsigned)(__popc(lo) + __popc(hi)) << shift;
    }
    return th;
}

// Thread t owns ids [t*E, t*E + E): contiguous ranges keep the draw in id order. `mark(step)`
// after each stage (SAMPLE_*): the profiling build's stamps.
enum { SAMPLE_LOADED = 7, SAMPLE_MAX, SAMPLE_TOPK, SAMPLE_TOTAL, SAMPLE_SCAN, SAMPLE_PICKED };

template <bool TALKER, int EM, class Mark>
__device__ int sample_block(const float* logits, int n, const qmk_sampler& cfg, const TalkerRules& rules, float u,
                            BlockReducer& red, float* scan_scratch, unsigned* topk_scratch, Mark mark) {
    const int E = (n + QMK_THREADS - 1) / QMK_THREADS;
    const int base = threadIdx.x * E;
    float v[EM];
    unsigned key[EM];
#pragma unroll
    for (int e = 0; e < EM; ++e) {
        const int i = base + e;
        const bool valid = e < E && i < n;
        float x = -INFINITY;
        if (valid) {
            x = __ldcg(logits + i);
            if (TALKER) {
                // repetition penalty -> EOS mask for the first frames -> suppression, HF order.
                if (__ldcg(rules.seen + i)) x = x < 0.f ? x * rules.penalty : x / rules.penalty;
                if (rules.mask_eos && i == rules.eos) x = -INFINITY;
                if (i >= rules.suppress_start && i != rules.eos) x = -INFINITY;
            }
            if (cfg.do_sample) x = x / cfg.temperature;
        }
        v[e] = x;
        key[e] = valid ? order_key(x) : 0u;  // padding sorts below -inf
    }
    mark(SAMPLE_LOADED);

    unsigned mk = 0;
#pragma unroll
    for (int e = 0; e < EM; ++e) mk = max(mk, key[e]);
    mk = red.umax(mk);
    mark(SAMPLE_MAX);

    if (!cfg.do_sample) {
        // argmax, lowest id on ties (torch.argmax semantics)
        unsigned idx = 0xffffffffu;
#pragma unroll
        for (int e = EM - 1; e >= 0; --e)
            if (key[e] == mk && e < E) idx = base + e;
        const int id = (int)red.umin(idx);
        mark(SAMPLE_PICKED);
        return id;
    }

    // top-k: the k-th largest key; ties with it are kept, like HF's `scores < topk(...)[-1]` removal.
    unsigned th = 0;
    if (cfg.top_k > 0 && cfg.top_k < n) th = kth_largest_key<EM>(key, E, (unsigned)cfg.top_k, topk_scratch);
    mark(SAMPLE_TOPK);
    const float M = key_value(mk);
    float p[EM];
    float local = 0.f;
#pragma unroll
    for (int e = 0; e < EM; ++e) {
        p[e] = key[e] >= th ? expf(v[e] - M) : 0.f;
        local += p[e];
    }
    float Z = red.sum(local);
    mark(SAMPLE_TOTAL);

    if (cfg.top_p < 1.f) {
        // Keep the smallest top set whose mass reaches top_p: the largest key K with
        // mass(key >= K) >= top_p * Z.
        const float target = cfg.top_p * Z;
        unsigned th2 = 0;
        for (int b = 31; b >= 0; --b) {
            const unsigned cand = th2 | (1u << b);
            float m = 0.f;
#pragma unroll
            for (int e = 0; e < EM; ++e) m += key[e] >= cand ? p[e] : 0.f;
            if (red.sum(m) >= target) th2 = cand;
        }
        local = 0.f;
#pragma unroll
        for (int e = 0; e < EM; ++e) {
            if (key[e] < th2) p[e] = 0.f;
            local += p[e];
        }
        Z = red.sum(local);
    }

    const float r = u * Z;
    float running = block_exclusive_scan(local, scan_scratch);
    mark(SAMPLE_SCAN);
    unsigned found = 0xffffffffu;
#pragma unroll
    for (int e = 0; e < EM; ++e) {
        if (p[e] > 0.f) {
            running += p[e];
            if (running > r && found == 0xffffffffu) found = base + e;
        }
    }
    unsigned res = red.umin(found);
    if (res == 0xffffffffu) {
        // r landed past the float total by rounding: take the last id with mass.
        unsigned last = 0;
#pragma unroll
        for (int e = 0; e < EM; ++e)
            if (p[e] > 0.f) last = base + e + 1;
        res = red.umax(last) - 1;
    }
    mark(SAMPLE_PICKED);
    return (int)res;
}

// The draw with per-thread arrays just wide enough for the vocabulary: 4 ids per thread for the
// predictor's 2048, 6 for the talker's 3072. The loops above are unrolled to their width, and
// every block runs them redundantly, so width 8 for every vocabulary cost 0.02-0.03 ms a frame.
template <bool TALKER, class Mark>
__device__ __forceinline__ int sample_vocab(const float* logits, int n, const qmk_sampler& cfg, const TalkerRules& rules,
                                            float u, BlockReducer& red, float* scan_scratch, unsigned* topk_scratch,
                                            Mark mark) {
    if (n <= 4 * QMK_THREADS) return sample_block<TALKER, 4>(logits, n, cfg, rules, u, red, scan_scratch, topk_scratch, mark);
    if (n <= 6 * QMK_THREADS) return sample_block<TALKER, 6>(logits, n, cfg, rules, u, red, scan_scratch, topk_scratch, mark);
    return sample_block<TALKER, QMK_MAX_PER_THREAD>(logits, n, cfg, rules, u, red, scan_scratch, topk_scratch, mark);
}
