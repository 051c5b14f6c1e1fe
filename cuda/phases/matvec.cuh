// A matrix phase (run_mat): the operand staged once per block (load_x, load_xn: RMSNorm in fp32),
// dot products of the block's tiles from the ring (dots_tiles), one barrier, then an epilogue per
// output row. Also the per-block code slots (codes, fed), the per-code input tables' row (feed)
// and SwiGLU, which several phases share.
//
// Part of the qwen_mk.cu translation unit (included there in order, not on its own).

__device__ __forceinline__ float* norm_scratch() { return sm<float>(QMK_SMEM_NSCR); }

// Operand loads through the block's staging buffers (mk_matvec.cuh).
template <int MS>
__device__ __forceinline__ void load_x(VecRef x, int K, Operand<MS>& o) {
    load_operand<MS>(x, K, o, sm<float>(QMK_SMEM_XS));
}

template <int MS>
__device__ __forceinline__ void load_xn(VecRef x, const bf16* w, int K, float eps, Operand<MS>& o) {
    load_normed<MS>(x, w, K, eps, o, norm_scratch(), sm<float>(QMK_SMEM_XS), sm<float>(QMK_SMEM_WS));
}
__device__ __forceinline__ int* codes() { return sm<int>(QMK_SMEM_CODES); }
__device__ __forceinline__ int* fed() { return sm<int>(QMK_SMEM_FED); }

// Floats per row of an input table: the layer-0 q/k/v, then (with a projection) the projected
// input itself, where the pass's residual stream starts.
__device__ __forceinline__ int qkv0_width(const qmk_model& m) { return (m.pred.num_heads + 2 * m.pred.num_kv_heads) * QMK_HD; }
__device__ __forceinline__ int table_row_floats(const qmk_model& m) {
    return qkv0_width(m) + (m.proj_w != 0 ? m.pred.hidden : 0);
}

// Thread 0: code group g is fed `code`; pass g + 1 takes its layer-0 q/k/v (and projected input)
// from that code's table row, if it has a table (from_table).
__device__ __forceinline__ void feed(const qmk_model& m, int g, int code) {
    fed()[g] = code;
    const float* row = nullptr;
    if (g + 1 < m.num_groups && from_table(m, g + 1))
        row = dptr<const float>(m.qkv0[g]) + (size_t)code * table_row_floats(m);
    *sm<const float*>(QMK_SMEM_QSRC) = row;
}

// SwiGLU of gate/up unit j from its row partials: silu(gate) * up.
__device__ __forceinline__ float swiglu(const float* red, int j) {
    const float g = row_sum(red, 2 * j), up = row_sum(red, 2 * j + 1);
    return (g / (1.f + expf(-g))) * up;
}

// Dot products of tiles [t0, t1) of a matrix phase (tile t covers units
// (t % per_half) * per_tile ...) into red.
template <int MS>
__device__ void dots_tiles(Ctx& c, const Geo& g, int rpu, int t0, int t1, const Operand<MS>& x, float* red, int id) {
    const int per_half = g.ngu / g.ksplit;
    const bool within = g.frees_each_tile(c.ring.nslot);
    for (int t = t0; t < t1; ++t) {
        const int tt = t % per_half;
        const int n = min(g.per_tile, g.u1 - g.u0 - tt * g.per_tile);
        const unsigned char* tile = c.ring.wait(within ? 0 : t);
        c.stamp(id, STEP_TILE);
        tile_dots<MS>(tile, n, rpu, g.K, x, red + tt * g.per_tile * rpu * 4);
        if (within) {
            block_sync();
            c.ring.release(1);
        }
    }
}

// Every consumer is done with the phase's tiles: partials complete; the slots go back to the
// producer at the grid arrival (Ring::defer).
__device__ __forceinline__ void end_tiles(Ctx& c, const Geo& g, int id) {
    block_sync();
    c.stamp(id, STEP_DOTS);
    if (!g.frees_each_tile(c.ring.nslot)) c.ring.defer(g.ntiles);
}

// One matrix phase: dot products of every tile of the block's slice from shared memory, one
// barrier, then `epi(unit, index in the slice, partials)` on one thread per unit.
template <int MS, class Epi>
__device__ void run_mat(Ctx& c, const Phase& ph, int id, const Operand<MS>& x, Epi epi) {
    c.stamp(id, STEP_OPERAND);
    const Geo g = geo(ph);
    const int rpu = ph.kind == K_GU ? 2 : 1;
    float* red = sm<float>(QMK_SMEM_RED);
    dots_tiles<MS>(c, g, rpu, 0, g.ntiles, x, red, id);
    end_tiles(c, g, id);
    for (int j = threadIdx.x; j < g.u1 - g.u0; j += QMK_THREADS) epi(g.u0 + j, j, red);
    c.stamp(id, STEP_EPILOGUE);
}
