// Logits processing and sampling by one block (spec §6 order). Every block of the grid runs it on
// the same logits with the same counter-based random number, so all blocks know the sampled id
// without a grid barrier.
#pragma once

#include "mk_util.cuh"
#include "qwen_mk.h"

#define QMK_MAX_PER_THREAD 8  // vocab <= 8 * QMK_THREADS
#define QMK_TOPK_WORDS (4 * 256)  // kth_largest_key: a 256-bin histogram per 8-bit round

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

// The k-th largest of the block's keys (the largest K with count(key >= K) >= k) by a radix
// select, eight bits a round: a shared-memory histogram of the next digit over the keys that
// match the digits found so far, one block barrier, then every warp finds the digit from the
// histogram itself, so a round has one barrier and the select 4 (a round's dependent chain, not its
// per-key work, is the cost: 4-bit rounds took 8 x 0.65 us). Plain atomics: aggregating a warp's
// equal bins first (__match_any_sync) measured slower, though the first round's keys share few bins.
// `hist`: QMK_TOPK_WORDS words, zeroed before the block barrier that precedes the call (zero_hist).
__device__ __forceinline__ void zero_hist(unsigned* hist) {
    for (int i = threadIdx.x; i < QMK_TOPK_WORDS; i += QMK_THREADS) hist[i] = 0u;
}

template <int EM>
__device__ __forceinline__ unsigned kth_largest_key(const unsigned* key, int E, unsigned k, unsigned* hist) {
    const int lane = threadIdx.x & 31;
    unsigned th = 0, krem = k;
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        const int shift = 24 - 8 * r;
        const unsigned above = r == 0 ? 0u : 0xffffffffu << (shift + 8);
        unsigned* h = hist + r * 256;
#pragma unroll
        for (int e = 0; e < EM; ++e) {
            if (e < E && (key[e] & above) == th) {
                atomicAdd(h + ((key[e] >> shift) & 255u), 1u);
            }
        }
        block_sync();
        // Lane l holds bins 8 l .. 8 l + 7; S: the keys in bins >= 8 l.
        const uint4 a = *reinterpret_cast<const uint4*>(h + lane * 8), b = *reinterpret_cast<const uint4*>(h + lane * 8 + 4);
        const unsigned cnt[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
        const unsigned tot = ((cnt[0] + cnt[1]) + (cnt[2] + cnt[3])) + ((cnt[4] + cnt[5]) + (cnt[6] + cnt[7]));
        unsigned S = tot;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const unsigned y = __shfl_down_sync(0xffffffffu, S, o);
            if (lane + o < 32) S += y;
        }
        // The digit's lane: the last whose suffix still reaches krem (suffixes fall with the lane).
        const int L = 31 - __clz(__ballot_sync(0xffffffffu, S >= krem));
        unsigned acc = S - tot, before = 0;
        int d = 0;
        bool found = false;
#pragma unroll
        for (int j = 7; j >= 0; --j) {
            if (!found && acc + cnt[j] >= krem) {
                found = true;
                d = j;
                before = acc;
            }
            acc += cnt[j];
        }
        d = __shfl_sync(0xffffffffu, 8 * lane + d, L);
        before = __shfl_sync(0xffffffffu, before, L);
        th |= (unsigned)d << shift;
        krem -= before;
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

    if (cfg.do_sample) zero_hist(topk_scratch);  // ordered before the first round by umax's barrier
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
