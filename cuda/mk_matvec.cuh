// Batch-1 matrix-vector products over weight tiles in shared memory.
//
// Thread layout: 128 column threads x 4 row groups. Column thread c owns columns
// [1024 s + 8 c, 1024 s + 8 c + 8) for every 1024-wide segment s of the input, and keeps those
// operand values in registers for the whole phase, so shared memory is read once per weight
// (16 conflict-free bytes per lane) and never for the operand. Row group g takes the tile's rows
// g, g + 4, ...; a row's 128 partial sums are reduced by a warp sum and a 4-way sum in smem.
#pragma once

#include "mk_stream.cuh"
#include "mk_util.cuh"

#define QMK_CT 128      // column threads
#define QMK_RG 4        // row groups
#define QMK_TILE_ROWS 16  // K >= 1024 and 32 KB slots

// MS: the most 1024-wide segments the operand can have (2 for hidden-wide inputs, 3 for the
// MLP's down projection, run in halves when wider); sized at compile time so the operand stays
// in registers.
template <int MS>
struct Operand {
    float v[MS][8];
};

// The residual accumulators that every block adds a hidden-wide partial into (the split down
// projection, phases/mlp.cuh run_gu_split) have QMK_ACC_COPIES copies QMK_ACC_STRIDE floats apart:
// block b adds into copy b % QMK_ACC_COPIES, and readers sum the copies. One copy took 132
// blocks' 16-byte float atomics on each of its lines, which the L2 performs one after another,
// and the arrival's release fence waited for them (~0.85 us a phase; bench/NOTES.md, v23).
#ifndef QMK_ACC_COPIES
#define QMK_ACC_COPIES 4
#endif
#define QMK_ACC_STRIDE 2048  // the widest hidden

// A vector in device memory: fp32 activations (written in this launch: L2 loads), a bf16
// embedding row (read-only), or an fp32 accumulator, the sum of its QMK_ACC_COPIES copies.
// (A kind, not a count of copies: a third field cost registers, and spills, wherever a VecRef
// lives across the frame's loops.)
enum { VEC_F32 = 0, VEC_BF16 = 1, VEC_ACC = 2 };
struct VecRef {
    const void* p;
    int kind;
};

// The copy of accumulator `base` that this block adds into.
__device__ __forceinline__ float* acc_copy(float* base) {
    return base + (blockIdx.x % QMK_ACC_COPIES) * QMK_ACC_STRIDE;
}

__device__ __forceinline__ int col_thread() { return threadIdx.x & (QMK_CT - 1); }
__device__ __forceinline__ int row_group() { return threadIdx.x >> 7; }

__device__ __forceinline__ void unpack8(const uint4 u, float* x) {
    x[0] = bf_lo(u.x);
    x[1] = bf_hi(u.x);
    x[2] = bf_lo(u.y);
    x[3] = bf_hi(u.y);
    x[4] = bf_lo(u.z);
    x[5] = bf_hi(u.z);
    x[6] = bf_lo(u.w);
    x[7] = bf_hi(u.w);
}

// x[i .. i + 3] of an fp32 vector, or of an accumulator's copies summed in copy order.
__device__ __forceinline__ float4 ld_vec4(const float* p, int kind) {
    float4 a = ld_act4(p);
    if (kind == VEC_ACC) {
#pragma unroll
        for (int k = 1; k < QMK_ACC_COPIES; ++k) {
            const float4 b = ld_act4(p + k * QMK_ACC_STRIDE);
            a.x += b.x, a.y += b.y, a.z += b.z, a.w += b.w;
        }
    }
    return a;
}

__device__ __forceinline__ void load8(VecRef x, int i, float* v) {
    if (x.kind == VEC_BF16) {
        unpack8(ld_weight(static_cast<const bf16*>(x.p) + i), v);
    } else {
        const float* p = static_cast<const float*>(x.p) + i;
        const float4 a = ld_vec4(p, x.kind), b = ld_vec4(p + 4, x.kind);
        v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
    }
}

__device__ __forceinline__ void store8(float* p, const float* v) {
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
    *reinterpret_cast<float4*>(p + 4) = make_float4(v[4], v[5], v[6], v[7]);
}

__device__ __forceinline__ void read8(const float* p, float* v) {
    const float4 a = *reinterpret_cast<const float4*>(p), b = *reinterpret_cast<const float4*>(p + 4);
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}

// This thread's chunk of an operand already staged in `xs` (after a block barrier).
template <int MS>
__device__ __forceinline__ void read_staged(int K, Operand<MS>& o, const float* xs) {
    const int c = col_thread(), nseg = K >> 10;
#pragma unroll
    for (int s = 0; s < MS; ++s) {
        if (s < nseg) {
            read8(xs + (s << 10) + c * 8, o.v[s]);
        } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) o.v[s][e] = 0.f;
        }
    }
}

// This thread's operand chunk of x[0..K). Right after a grid barrier every block reads the same
// freshly written lines, so only row group 0 reads them from L2 and stages them in `xs` (K
// floats of shared memory); the other row groups take their chunks from there.
template <int MS>
__device__ __forceinline__ void load_operand(VecRef x, int K, Operand<MS>& o, float* xs) {
    const int c = col_thread(), nseg = K >> 10;
    if (threadIdx.x < QMK_CT) {
#pragma unroll
        for (int s = 0; s < MS; ++s)
            if (s < nseg) {
                float v[8];
                load8(x, (s << 10) + c * 8, v);
                store8(xs + (s << 10) + c * 8, v);
            }
    }
    block_sync();
    read_staged<MS>(K, o, xs);
}

// This thread's chunk of the staged operand (xs) times r and the staged norm weight (ws), in the
// official RMSNorm's order: (x * r) * w.
template <int MS>
__device__ __forceinline__ void normalise_staged(int K, float r, Operand<MS>& o, const float* xs, const float* ws) {
    const int c = col_thread(), nseg = K >> 10;
#pragma unroll
    for (int s = 0; s < MS; ++s) {
        if (s < nseg) {
            float v[8], wv[8];
            read8(xs + (s << 10) + c * 8, v);
            read8(ws + (s << 10) + c * 8, wv);
#pragma unroll
            for (int e = 0; e < 8; ++e) o.v[s][e] = (v[e] * r) * wv[e];
        } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) o.v[s][e] = 0.f;
        }
    }
}

// Qwen3 RMSNorm in fp32, as the official model computes it: w * (x * rsqrt(mean(x^2) + eps)).
// Row group 0 loads x and w (staged in xs and ws, K floats each) and the sum of squares
// (`scratch`, 4 floats); one block barrier, then every thread normalises its own chunk.
template <int MS>
__device__ __forceinline__ void load_normed(VecRef x, const bf16* w, int K, float eps, Operand<MS>& o,
                                            float* scratch, float* xs, float* ws) {
    const int c = col_thread(), nseg = K >> 10;
    if (threadIdx.x < QMK_CT) {
        float ss = 0.f;
#pragma unroll
        for (int s = 0; s < MS; ++s)
            if (s < nseg) {
                float v[8], wv[8];
                load8(x, (s << 10) + c * 8, v);
                unpack8(ld_weight(w + (s << 10) + c * 8), wv);
                store8(xs + (s << 10) + c * 8, v);
                store8(ws + (s << 10) + c * 8, wv);
#pragma unroll
                for (int e = 0; e < 8; ++e) ss = fmaf(v[e], v[e], ss);
            }
        ss = warp_sum(ss);
        if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = ss;
    }
    block_sync();
    const float total = (scratch[0] + scratch[1]) + (scratch[2] + scratch[3]);
    const float r = rsqrtf(total / (float)K + eps);
    normalise_staged<MS>(K, r, o, xs, ws);
}

// Row group 0 writes the operand back (the normalised hidden state the tests and the predictor
// read).
template <int MS>
__device__ __forceinline__ void store_operand(const Operand<MS>& o, int K, float* dst) {
    if (row_group() != 0) return;
    const int c = col_thread(), nseg = K >> 10;
#pragma unroll
    for (int s = 0; s < MS; ++s)
        if (s < nseg) {
            float* p = dst + (s << 10) + c * 8;
            *reinterpret_cast<float4*>(p) = make_float4(o.v[s][0], o.v[s][1], o.v[s][2], o.v[s][3]);
            *reinterpret_cast<float4*>(p + 4) = make_float4(o.v[s][4], o.v[s][5], o.v[s][6], o.v[s][7]);
        }
}

__device__ __forceinline__ void store_rows(const float* acc, int n, int rpu, float* red);

// Dot products of the tile's rows (bf16, K wide, row-major in smem) with the operand. The tile
// holds `n` units of `rpu` rows each (rpu 2: the n gate rows, then the n up rows); row r of unit
// j leaves its four partial sums in red[(j * rpu + part) * 4 + 0..3] (part 0 gate, 1 up), so a
// unit's rows are adjacent. No barrier here: a phase reduces all its tiles after one __syncthreads.
template <int MS>
__device__ __forceinline__ void tile_dots(const unsigned char* tile, int n, int rpu, int K, const Operand<MS>& o,
                                          float* red) {
    const int c = col_thread(), g = row_group(), nseg = K >> 10, rows = n * rpu;
    const bf16* base = reinterpret_cast<const bf16*>(tile);
    float acc[QMK_TILE_ROWS / QMK_RG];
#pragma unroll
    for (int i = 0; i < QMK_TILE_ROWS / QMK_RG; ++i) {
        const int r = g + i * QMK_RG;
        acc[i] = 0.f;
        if (r < rows) {
            const bf16* row = base + (size_t)r * K + c * 8;
#pragma unroll
            for (int s = 0; s < MS; ++s) {
                if (s < nseg) {
                    float w[8];
                    unpack8(*reinterpret_cast<const uint4*>(row + (s << 10)), w);
#pragma unroll
                    for (int e = 0; e < 8; ++e) acc[i] = fmaf(w[e], o.v[s][e], acc[i]);
                }
            }
        }
    }
    store_rows(acc, n, rpu, red);
}

// Reduce the warp's four rows across its 32 lanes by halving: after the xor-16 and xor-8
// exchanges each lane keeps one row (bits 4 and 3 of the lane pick it), then three more
// halvings finish it: 6 shuffles instead of 4 x 5. Each row's partial goes to red as in tile_dots.
__device__ __forceinline__ void store_rows(const float* acc, int n, int rpu, float* red) {
    static_assert(QMK_TILE_ROWS / QMK_RG == 4, "the exchange below reduces four rows");
    const int g = row_group(), rows = n * rpu;
    const int lane = threadIdx.x & 31;
    const bool hi16 = lane & 16, hi8 = lane & 8;
    const float a0 = __shfl_xor_sync(0xffffffffu, hi16 ? acc[0] : acc[2], 16);
    const float a1 = __shfl_xor_sync(0xffffffffu, hi16 ? acc[1] : acc[3], 16);
    const float k0 = (hi16 ? acc[2] : acc[0]) + a0, k1 = (hi16 ? acc[3] : acc[1]) + a1;
    float v = (hi8 ? k1 : k0) + __shfl_xor_sync(0xffffffffu, hi8 ? k0 : k1, 8);
    v += __shfl_xor_sync(0xffffffffu, v, 4);
    v += __shfl_xor_sync(0xffffffffu, v, 2);
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    const int r = g + ((hi16 ? 2 : 0) + (hi8 ? 1 : 0)) * QMK_RG;
    if ((lane & 7) == 0 && r < rows) {
        const int slot = rpu == 1 ? r : (r < n ? 2 * r : 2 * (r - n) + 1);
        red[slot * 4 + ((threadIdx.x >> 5) & 3)] = v;
    }
}

__device__ __forceinline__ float row_sum(const float* red, int r) {
    return (red[r * 4] + red[r * 4 + 1]) + (red[r * 4 + 2] + red[r * 4 + 3]);
}

// Two positions' operands at once (the code predictor's passes 0 and 1, phases/pred_first.cuh):
// row group 0 stages both vectors and the norm weight (xs: x0 then x1, K floats each; ws), one
// block barrier, then each thread normalises its chunk of x0 into `o` as load_normed does; x1
// stays staged and is normalised inside tile_dots_pair (its rsqrt in *r1), so only one operand
// occupies registers.
template <int MS>
__device__ __forceinline__ void load_normed_pair(VecRef x0, VecRef x1, const bf16* w, int K, float eps, Operand<MS>& o,
                                                 float* r1, float* scratch, float* xs, float* ws) {
    const int c = col_thread(), nseg = K >> 10;
    if (threadIdx.x < QMK_CT) {
        float ss0 = 0.f, ss1 = 0.f;
#pragma unroll
        for (int s = 0; s < MS; ++s)
            if (s < nseg) {
                float v[8], u[8], wv[8];
                load8(x0, (s << 10) + c * 8, v);
                load8(x1, (s << 10) + c * 8, u);
                unpack8(ld_weight(w + (s << 10) + c * 8), wv);
                store8(xs + (s << 10) + c * 8, v);
                store8(xs + K + (s << 10) + c * 8, u);
                store8(ws + (s << 10) + c * 8, wv);
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    ss0 = fmaf(v[e], v[e], ss0);
                    ss1 = fmaf(u[e], u[e], ss1);
                }
            }
        ss0 = warp_sum(ss0);
        ss1 = warp_sum(ss1);
        if ((threadIdx.x & 31) == 0) {
            scratch[threadIdx.x >> 5] = ss0;
            scratch[4 + (threadIdx.x >> 5)] = ss1;
        }
    }
    block_sync();
    const float r = rsqrtf(((scratch[0] + scratch[1]) + (scratch[2] + scratch[3])) / (float)K + eps);
    *r1 = rsqrtf(((scratch[4] + scratch[5]) + (scratch[6] + scratch[7])) / (float)K + eps);
    normalise_staged<MS>(K, r, o, xs, ws);
}

// tile_dots for both operands in one read of the tile: x0 in registers, x1 staged raw at
// xs + K and normalised per segment (the same (x * r) * w as load_normed). Each row's sums add
// in tile_dots' order.
template <int MS>
__device__ __forceinline__ void tile_dots_pair(const unsigned char* tile, int n, int rpu, int K, const Operand<MS>& o,
                                               const float* xs, const float* ws, float r1, float* red, float* red1) {
    const int c = col_thread(), g = row_group(), nseg = K >> 10, rows = n * rpu;
    const bf16* base = reinterpret_cast<const bf16*>(tile);
    float acc[QMK_TILE_ROWS / QMK_RG], acc1[QMK_TILE_ROWS / QMK_RG];
#pragma unroll
    for (int i = 0; i < QMK_TILE_ROWS / QMK_RG; ++i) acc[i] = acc1[i] = 0.f;
#pragma unroll
    for (int s = 0; s < MS; ++s) {
        if (s < nseg) {
            float y[8], wv[8];
            read8(xs + K + (s << 10) + c * 8, y);
            read8(ws + (s << 10) + c * 8, wv);
#pragma unroll
            for (int e = 0; e < 8; ++e) y[e] = (y[e] * r1) * wv[e];
#pragma unroll
            for (int i = 0; i < QMK_TILE_ROWS / QMK_RG; ++i) {
                const int r = g + i * QMK_RG;
                if (r < rows) {
                    float w[8];
                    unpack8(*reinterpret_cast<const uint4*>(base + (size_t)r * K + c * 8 + (s << 10)), w);
#pragma unroll
                    for (int e = 0; e < 8; ++e) {
                        acc[i] = fmaf(w[e], o.v[s][e], acc[i]);
                        acc1[i] = fmaf(w[e], y[e], acc1[i]);
                    }
                }
            }
        }
    }
    store_rows(acc, n, rpu, red);
    store_rows(acc1, n, rpu, red1);
}
