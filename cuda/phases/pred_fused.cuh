// The predictor with attention and o_proj fused (qmk_stack.fuse_attn_o)
//
// Every block adds partials into the residual, so a layer needs two accumulators that start at
// zero: `a` gets the layer's input plus o_proj (the residual after attention, the MLP's operand),
// `b` the same plus the MLP's down partials (the layer's output). The frame's fused layers (pass 0
// has L - 1: its last layer has no o_proj; later passes L each) alternate between two pairs of
// buffers, so layer n's input (layer n - 1's b) is never one of its own. Layer n's pair is zeroed
// during layer n - 1's MLP phase (the codec head's for the first), which neither reads nor adds
// to it; the q/k/v phase in between may end without a grid barrier (grouped_qkv).
//
// Part of the qwen_mk.cu translation unit (included there in order, not on its own).

struct Acc {
    float* a;
    float* b;
};

__device__ __forceinline__ int fused_layer(int L, int pass, int layer) { return pass == 0 ? layer : L - 1 + (pass - 1) * L + layer; }

// pres: four pairs of QMK_ACC_PAIR floats, `a` then the copies of `b` (acc_copy).
#define QMK_ACC_PAIR ((1 + QMK_ACC_COPIES) * QMK_ACC_STRIDE)
__device__ __forceinline__ Acc pred_acc(const qmk_model& m, int n) {
    float* X = dptr<float>(m.pres) + (size_t)(n % 2) * QMK_ACC_PAIR;
    return {X, X + QMK_ACC_STRIDE};
}

// The block's share of both accumulators set to zero.
__device__ __forceinline__ void zero_acc(const Acc& z, int D) {
    const int r0 = D * blockIdx.x / gridDim.x, r1 = D * (blockIdx.x + 1) / gridDim.x;
    for (int i = r0 + (int)threadIdx.x; i < r1; i += QMK_THREADS) {
        z.a[i] = 0.f;
#pragma unroll
        for (int k = 0; k < QMK_ACC_COPIES; ++k) z.b[i + k * QMK_ACC_STRIDE] = 0.f;
    }
}

// Rows 64 r .. 64 r + 63 of o_proj over kv head g's 256 columns (its two query heads' outputs,
// `heads` in shared memory) from the ring's tile `tile` after the consumed ones (qmk_layer.o_blk),
// added into both accumulators; head 0's items also add the layer input's rows. `mine`: the
// block's items in the phase (one: the tile is deferred to the grid arrival).
__device__ __forceinline__ void ao_rows(Ctx& c, int id, int g, int r, int mine, const float* heads, VecRef in,
                                        const Acc& acc, uint32_t tile = 0) {
    float* sums = sm<float>(QMK_SMEM_RED);
    const int row = threadIdx.x >> 3, part = threadIdx.x & 7;
    // 8 threads per o_proj row; thread `part` takes columns 8 part + 64 i (a quarter warp
    // reads 128 contiguous bytes of the row).
    const bf16* w = reinterpret_cast<const bf16*>(c.ring.wait(tile)) + (size_t)row * 2 * QMK_HD;
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int col = 8 * part + 64 * i;
        float wv[8], xv[8];
        unpack8(*reinterpret_cast<const uint4*>(w + col), wv);
        read8(heads + col, xv);
#pragma unroll
        for (int e = 0; e < 8; ++e) s = fmaf(wv[e], xv[e], s);
    }
    s += __shfl_xor_sync(0xffffffffu, s, 4);
    s += __shfl_xor_sync(0xffffffffu, s, 2);
    s += __shfl_xor_sync(0xffffffffu, s, 1);
    if (part == 0) sums[row] = s;
    block_sync();
    c.stamp(id, STEP_DOTS);
    // The o_proj tile goes back at the grid arrival when it is the block's only item (like a
    // matrix phase's); with several items the next one may need its slot.
    if (mine == 1) c.ring.defer(1);
    else c.ring.release(1);
    if (threadIdx.x < QMK_AO_ROWS / 4) {
        const int k = 4 * threadIdx.x, u = r * QMK_AO_ROWS + k;
        float v[4] = {sums[k], sums[k + 1], sums[k + 2], sums[k + 3]};
        if (g == 0) {
            float x[4];
            if (in.kind == VEC_BF16) {
                const uint2 b = *reinterpret_cast<const uint2*>(static_cast<const bf16*>(in.p) + u);
                x[0] = bf_lo(b.x), x[1] = bf_hi(b.x), x[2] = bf_lo(b.y), x[3] = bf_hi(b.y);
            } else {
                const float4 f = ld_vec4(static_cast<const float*>(in.p) + u, in.kind);
                x[0] = f.x, x[1] = f.y, x[2] = f.z, x[3] = f.w;
            }
#pragma unroll
            for (int e = 0; e < 4; ++e) v[e] += x[e];
        }
        red_add4(acc.a + u, v[0], v[1], v[2], v[3]);
        red_add4(acc.b + u, v[0], v[1], v[2], v[3]);
    }
}

// Item (g, r): kv head g's two query heads (every row group recomputes them: a predictor position
// attends to at most 16 positions), then rows 64 r .. 64 r + 63 of o_proj (ao_rows). Row group 0
// appends the K/V rows.
// `grouped`: the q/k/v rows come from a grouped q/k/v phase: wait for the head's blocks first.
__device__ void run_attn_o(Ctx& c, const Phase& ph, int id, bool tabled, bool grouped, VecRef in, const Acc& acc) {
    const qmk_model& m = c.F.m();
    const qmk_stack& S = m.pred;
    const qmk_layer& L = c.F.layer(ph);
    const int pos = ph.pass, R = ao_row_groups(S), items = ao_items(S);
    const int mine = blockIdx.x < items ? (items - 1 - blockIdx.x) / gridDim.x + 1 : 0;
    const size_t off = (size_t)ph.layer * S.num_kv_heads * S.max_pos * QMK_HD;
    float* heads = sm<float>(QMK_SMEM_XS);  // the item's two heads' outputs
    for (int it = blockIdx.x; it < items; it += gridDim.x) {
        const int g = it / R, r = it % R;
        const float* kv = pos > 0 ? reinterpret_cast<const float*>(c.ring.wait(0)) : nullptr;
        c.stamp(id, STEP_TILE);
        const AttnArgs a{dptr<const float>(m.qkv), heads, dptr<float>(S.k_cache) + off, dptr<float>(S.v_cache) + off,
                         bfp(L.q_norm), bfp(L.k_norm), dptr<const float>(S.rope), nullptr, nullptr, pos,
                         S.num_heads, S.num_kv_heads, S.max_pos, S.eps, 2 * g, r == 0};
        const float* qkv = tabled ? *sm<const float* volatile>(QMK_SMEM_QSRC) : a.qkv;
        if (grouped) wait_head(m, g);
        attention_item(a, qkv, g, 0, 1, kv, sm<float>(QMK_SMEM_ATTN));
        block_sync();
        if (pos > 0) c.ring.release(1);
        ao_rows(c, id, g, r, mine, heads, in, acc);
    }
    c.stamp(id, STEP_EPILOGUE);
}

// The predictor's layers at one pass with fuse_attn_o; `src` is the pass's input. The result is
// layer L - 1's `b` (the head reads it). The K/V tile, this block's item count and the pass's
// output index are written out here and in ao_tile / the frame rather than shared through helpers:
// that refactor measured +0.008 ms a sampled frame (bench/NOTES.md, v19 review).
__device__ void run_pred_fused(Ctx& c, int pass, VecRef src) {
    const qmk_model& m = c.F.m();
    const qmk_stack& S = m.pred;
    const int L = S.num_layers, D = S.hidden;
    const bool grouped = grouped_qkv(m, pass);
    float* qkv = dptr<float>(m.qkv);
    for (int l = 0; l < L; ++l) {
        const Phase pq{K_QKV, l, pass};
        const qmk_layer& Ly = c.F.layer(pq);
        const bool last0 = pass == 0 && l + 1 == L;
        const VecRef in = l == 0 ? src : VecRef{pred_acc(m, fused_layer(L, pass, l - 1)).b, VEC_ACC};
        const bool tabled = l == 0 && from_table(m, pass);
        if (!tabled) {
            Operand<2> x;
            load_xn<2>(in, bfp(Ly.input_norm), D, S.eps, x);
            run_mat<2>(c, pq, 16 + PH_QKV, x, [&](int u, int j, const float* red) { qkv[u] = row_sum(red, j); });
            // Pass 0's last attention has no barrier after it and reads whole heads: a grid barrier.
            if (grouped && !last0) arrive_head(c, m, 16 + PH_QKV);
            else c.sync(16 + PH_QKV);
        }
        if (last0) {  // only the K/V rows are used; no barrier (as in run_stack)
            run_attention<false>(c, Phase{K_ATTN, l, pass}, 16 + PH_ATTN, false);
            return;
        }
        const Acc acc = pred_acc(m, fused_layer(L, pass, l));
        run_attn_o(c, Phase{K_AO, l, pass}, 16 + PH_AO, tabled, grouped && !tabled, in, acc);
        c.sync(16 + PH_AO);
        if (grouped) reset_head(m);
        Operand<2> xm;
        load_xn<2>(VecRef{acc.a, VEC_F32}, bfp(Ly.post_norm), D, S.eps, xm);
        zero_acc(pred_acc(m, fused_layer(L, pass, l) + 1), D);
        const Phase pg{K_GU, l, pass};
        if (D == 2048) run_gu_split<4>(c, pg, 16 + PH_MLP, xm, acc.b);
        else run_gu_split<2>(c, pg, 16 + PH_MLP, xm, acc.b);
        c.sync(16 + PH_MLP);
    }
}
