// The MLP: the down projection as its own phase (run_down), and gate/up with the down projection
// split over the blocks' gate/up units (run_gu_split, qmk_stack.split_down), adding hidden-wide
// partials into the residual accumulators with 16-byte float atomics.
//
// Part of the qwen_mk.cu translation unit (included there in order, not on its own).

// The MLP's down projection: `epi(unit, index in the slice, sum)` after both halves when the
// matrix is split.
template <class Epi>
__device__ void run_down(Ctx& c, const Phase& ph, int id, const float* act, Epi epi) {
    const Geo g = geo(ph);
    const int units = g.u1 - g.u0, per_half = g.ngu / g.ksplit;
    float* red = sm<float>(QMK_SMEM_RED);
    for (int h = 0; h < g.ksplit; ++h) {
        Operand<3> x;
        load_x<3>(VecRef{act + h * g.K, VEC_F32}, g.K, x);
        c.stamp(id, STEP_OPERAND);
        dots_tiles<3>(c, g, 1, h * per_half, (h + 1) * per_half, x, red + h * units * 4, id);
    }
    end_tiles(c, g, id);
    for (int j = threadIdx.x; j < units; j += QMK_THREADS) {
        float v = row_sum(red, j);
        if (g.ksplit == 2) v += row_sum(red + units * 4, j);
        epi(g.u0 + j, j, v);
    }
    c.stamp(id, STEP_EPILOGUE);
}

// The end of a split gate/up phase whose tiles all stay in the ring: the gate/up slots go back at
// the grid arrival, the down_t ones one arrival later if the next phase (q/k/v or the head) still
// finds its slots (run_gu_split).
__device__ __forceinline__ void defer_mlp_tiles(Ctx& c, const Geo& g, const Phase& ph) {
    const int nslot = c.ring.nslot, dt = g.ntiles - g.ngu;
    const Geo &nq = geo(Phase{K_QKV, 0, ph.pass}), &nh = geo(Phase{ph.pass < 0 ? K_HEAD_T : K_HEAD_P, 0, ph.pass});
    const int need = max(nq.frees_each_tile(nslot) ? 1 : nq.ntiles, nh.frees_each_tile(nslot) ? 1 : nh.ntiles);
    const int held = dt + need <= nslot ? dt : 0;
    c.ring.defer(g.ntiles - held);
    c.ring.hold(held);
}

// Gate/up with the down projection split over the blocks (qmk_stack.split_down): the block's
// gate/up units give their activations (shared memory, never global), which multiply the same
// units' rows of down_t into a hidden-wide partial; every block adds its partial into `resid`,
// which the o_proj epilogue set to the residual after attention. This takes one grid barrier, one
// operand read and one phase's latency chain off every layer (bench/NOTES.md, v16); the float
// atomics (one 16-byte request per 4 columns) sum in an order that varies between runs.
// CPT: columns per consumer thread (hidden / QMK_THREADS: 2 or 4).
template <int CPT>
__device__ void run_gu_split(Ctx& c, const Phase& ph, int id, const Operand<2>& x, float* resid) {
    c.stamp(id, STEP_OPERAND);
    const Geo g = geo(ph);
    const int units = g.u1 - g.u0;
    const bool within = g.frees_each_tile(c.ring.nslot);
    float* red = sm<float>(QMK_SMEM_RED);
    float* acts = sm<float>(QMK_SMEM_ACTS);
    dots_tiles<2>(c, g, 2, 0, g.ngu, x, red, id);
    block_sync();
    c.stamp(id, STEP_DOTS);
    for (int j = threadIdx.x; j < units; j += QMK_THREADS) acts[j] = swiglu(red, j);
    block_sync();
    float acc[CPT];
#pragma unroll
    for (int e = 0; e < CPT; ++e) acc[e] = 0.f;
    const int col = threadIdx.x * CPT;
    resid = acc_copy(resid);
    for (int t = g.ngu; t < g.ntiles; ++t) {
        const int r0 = (t - g.ngu) * g.dpt, n = min(g.dpt, units - r0);
        const bf16* tile = reinterpret_cast<const bf16*>(c.ring.wait(within ? 0 : t)) + col;
        c.stamp(id, STEP_TILE);
        // Four rows per step, their loads issued together (a tile holds 16 or 8 rows; the last
        // tile may end mid-step: its missing rows count as zero activations, and the float4 read
        // past the slice stays inside the area's 4 spare floats).
        for (int r = 0; r < n; r += 4) {
            float a[4], w[4][CPT];
            const float4 a4 = *reinterpret_cast<const float4*>(acts + r0 + r);
            a[0] = a4.x, a[1] = a4.y, a[2] = a4.z, a[3] = a4.w;
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const bf16* row = tile + (size_t)min(r + k, n - 1) * g.K;
                if constexpr (CPT == 2) {
                    const uint32_t u = *reinterpret_cast<const uint32_t*>(row);
                    w[k][0] = bf_lo(u), w[k][1] = bf_hi(u);
                } else {
                    const uint2 u = *reinterpret_cast<const uint2*>(row);
                    w[k][0] = bf_lo(u.x), w[k][1] = bf_hi(u.x), w[k][2] = bf_lo(u.y), w[k][3] = bf_hi(u.y);
                }
                if (r + k >= n) a[k] = 0.f;
            }
#pragma unroll
            for (int k = 0; k < 4; ++k)
#pragma unroll
                for (int e = 0; e < CPT; ++e) acc[e] = fmaf(a[k], w[k][e], acc[e]);
        }
        if (within) {
            block_sync();
            c.ring.release(1);
        }
    }
    if constexpr (CPT == 2) {  // lane pairs: the even lane adds both threads' four columns
        const float b0 = __shfl_down_sync(0xffffffffu, acc[0], 1), b1 = __shfl_down_sync(0xffffffffu, acc[1], 1);
        if ((threadIdx.x & 1) == 0) red_add4(resid + col, acc[0], acc[1], b0, b1);
    } else {
        static_assert(CPT == 4, "hidden widths 1024 and 2048");
        red_add4(resid + col, acc[0], acc[1], acc[2], acc[3]);
    }
    // The barrier that ends the phase (Ctx::sync) orders the additions before its arrival.
    // The down_t slots go back one grid arrival after the gate/up ones: handing all five back at
    // once queued ~160 KB of copies ahead of the next phase's arrival fence (-0.026 ms a frame).
    // Only if the phase after (the next layer's q/k/v or the head) still finds its slots.
    if (!within) defer_mlp_tiles(c, g, ph);
    c.stamp(id, STEP_EPILOGUE);
}
