// Predictor passes 0 and 1 together (qmk_stack.merge_first)
//
// Pass 0 (the talker hidden) and pass 1 (code 0, layer-0 q/k/v from its table row) both start
// once code 0 is sampled, and position 1 attends only to position 0. So each phase of pass 0
// also computes pass 1: the matrix phases multiply the block's tiles by both vectors in one read
// of each tile (qmk_decode_frame checks that the tiles all fit the ring at once),
// and the fused attention + o_proj item runs position 0 on warps 0-1 and position 1 on warps 2-3.
// The frame has one pass of phases less; the weights are read once for both positions.
// Position 0 keeps pred_acc's pairs (its fused layers 0 .. L - 2); position 1 has two pairs of
// its own (the third and fourth pairs of pres), so pass 2 finds its first pair where the passes
// one after the other leave it.
//
// Part of the qwen_mk.cu translation unit (included there in order, not on its own).

__device__ __forceinline__ Acc first_acc(const qmk_model& m, int p, int l) {
    if (p == 0) return pred_acc(m, l);
    float* X = dptr<float>(m.pres) + (size_t)(2 + l % 2) * QMK_ACC_PAIR;
    return {X, X + QMK_ACC_STRIDE};
}

// Both positions' operands (load_normed_pair), and dot products of every tile of the block's
// slices with both in one read of each tile (tile_dots_pair). Every tile stays in the ring
// (qmk_decode_frame checks the slices fit it), and the K of a predictor matrix is 1024.
__device__ void dots_pair(Ctx& c, const Geo& g, int rpu, int ntiles, VecRef in0, VecRef in1, const bf16* norm,
                          float* red, float* red1, int id) {
    const qmk_stack& S = c.F.m().pred;
    Operand<2> x;
    float r1;
    float* xs = sm<float>(QMK_SMEM_XS);
    float* ws = sm<float>(QMK_SMEM_WS);
    load_normed_pair<2>(in0, in1, norm, S.hidden, S.eps, x, &r1, norm_scratch(), xs, ws);
    c.stamp(id, STEP_OPERAND);
    for (int t = 0; t < ntiles; ++t) {
        const int n = min(g.per_tile, g.u1 - g.u0 - t * g.per_tile), o = t * g.per_tile * rpu * 4;
        const unsigned char* tile = c.ring.wait(t);
        c.stamp(id, STEP_TILE);
        tile_dots_pair<2>(tile, n, rpu, g.K, x, xs, ws, r1, red + o, red1 + o);
    }
}

// A matrix phase for both positions: `epi(unit, index in the slice, partials 0, partials 1)`.
template <class Epi>
__device__ void run_mat_first(Ctx& c, const Phase& ph, int id, VecRef in0, VecRef in1, const bf16* norm, Epi epi) {
    const Geo g = geo(ph);
    float* red = sm<float>(QMK_SMEM_RED);
    float* red1 = red + (g.u1 - g.u0) * 4;
    dots_pair(c, g, 1, g.ntiles, in0, in1, norm, red, red1, id);
    end_tiles(c, g, id);
    for (int j = threadIdx.x; j < g.u1 - g.u0; j += QMK_THREADS) epi(g.u0 + j, j, red, red1);
    c.stamp(id, STEP_EPILOGUE);
}

// Gate/up with the split down projection (run_gu_split) for both positions: gate/up tiles read
// once for both operands, down_t's once for both activations.
__device__ void run_gu_first(Ctx& c, const Phase& ph, int id, const float* mid0, const float* mid1, const bf16* norm,
                             float* resid0, float* resid1) {
    const Geo g = geo(ph);
    const int units = g.u1 - g.u0;
    float* red = sm<float>(QMK_SMEM_RED);
    float* red1 = red + units * 2 * 4;
    float* acts = sm<float>(QMK_SMEM_ACTS);
    float* acts1 = acts + QMK_ACTS_SECOND;
    dots_pair(c, g, 2, g.ngu, VecRef{mid0, VEC_F32}, VecRef{mid1, VEC_F32}, norm, red, red1, id);
    block_sync();
    c.stamp(id, STEP_DOTS);
    for (int j = threadIdx.x; j < units; j += QMK_THREADS) {
        acts[j] = swiglu(red, j);
        acts1[j] = swiglu(red1, j);
    }
    block_sync();
    // Two columns per thread (hidden 1024): as run_gu_split<2>, with both positions' sums.
    float acc[2][2] = {{0.f, 0.f}, {0.f, 0.f}};
    const int col = threadIdx.x * 2;
    for (int t = g.ngu; t < g.ntiles; ++t) {
        const int r0 = (t - g.ngu) * g.dpt, n = min(g.dpt, units - r0);
        const bf16* tile = reinterpret_cast<const bf16*>(c.ring.wait(t)) + col;
        c.stamp(id, STEP_TILE);
        for (int r = 0; r < n; r += 4) {
            float a[2][4], w[4][2];
            const float4 a4 = *reinterpret_cast<const float4*>(acts + r0 + r);
            const float4 b4 = *reinterpret_cast<const float4*>(acts1 + r0 + r);
            a[0][0] = a4.x, a[0][1] = a4.y, a[0][2] = a4.z, a[0][3] = a4.w;
            a[1][0] = b4.x, a[1][1] = b4.y, a[1][2] = b4.z, a[1][3] = b4.w;
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const uint32_t u = *reinterpret_cast<const uint32_t*>(tile + (size_t)min(r + k, n - 1) * g.K);
                w[k][0] = bf_lo(u), w[k][1] = bf_hi(u);
                if (r + k >= n) a[0][k] = a[1][k] = 0.f;
            }
#pragma unroll
            for (int p = 0; p < 2; ++p)
#pragma unroll
                for (int k = 0; k < 4; ++k)
#pragma unroll
                    for (int e = 0; e < 2; ++e) acc[p][e] = fmaf(a[p][k], w[k][e], acc[p][e]);
        }
    }
    float* resid[2] = {acc_copy(resid0), acc_copy(resid1)};
#pragma unroll
    for (int p = 0; p < 2; ++p) {
        const float b0 = __shfl_down_sync(0xffffffffu, acc[p][0], 1), b1 = __shfl_down_sync(0xffffffffu, acc[p][1], 1);
        if ((threadIdx.x & 1) == 0) red_add4(resid[p] + col, acc[p][0], acc[p][1], b0, b1);
    }
    defer_mlp_tiles(c, g, ph);  // every tile is in the ring (qmk_decode_frame)
    c.stamp(id, STEP_EPILOGUE);
}

// The fused attention + o_proj phase (run_attn_o) for both positions (attention_first_pair).
// `acc0` null: the last layer, where position 0 only appends its K/V rows.
__device__ void run_attn_o_first(Ctx& c, const Phase& ph, int id, bool grouped, VecRef in0, VecRef in1,
                                 const Acc* acc0, const Acc& acc1) {
    const qmk_model& m = c.F.m();
    const qmk_stack& S = m.pred;
    const qmk_layer& L = c.F.layer(ph);
    const int R = ao_row_groups(S), items = ao_items(S), H = S.num_heads, KV = S.num_kv_heads;
    const int mine = blockIdx.x < items ? (items - 1 - blockIdx.x) / gridDim.x + 1 : 0;
    const size_t off = (size_t)ph.layer * KV * S.max_pos * QMK_HD;
    float* heads = sm<float>(QMK_SMEM_XS);  // [position][2 heads][128]
    float* sums = sm<float>(QMK_SMEM_RED);  // [position][64]
    const float* qkv0 = dptr<const float>(m.qkv);
    const int row = threadIdx.x >> 3, part = threadIdx.x & 7;
    for (int it = blockIdx.x; it < items; it += gridDim.x) {
        const int g = it / R, r = it % R;
        c.stamp(id, STEP_TILE);
        const AttnArgs a{qkv0, heads, dptr<float>(S.k_cache) + off, dptr<float>(S.v_cache) + off, bfp(L.q_norm),
                         bfp(L.k_norm), dptr<const float>(S.rope), nullptr, nullptr, 0, H, KV, S.max_pos, S.eps,
                         2 * g, r == 0};
        const float* qkv1 = ph.layer == 0 ? *sm<const float* volatile>(QMK_SMEM_QSRC) : qkv0 + qkv0_width(m);
        if (grouped) wait_head(m, g);
        attention_first_pair(a, qkv0, qkv1, g, heads, heads + 2 * QMK_HD);
        block_sync();
        const bf16* w = reinterpret_cast<const bf16*>(c.ring.wait(0)) + (size_t)row * 2 * QMK_HD;
        float s0 = 0.f, s1 = 0.f;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int col = 8 * part + 64 * i;
            float wv[8], xv[8], yv[8];
            unpack8(*reinterpret_cast<const uint4*>(w + col), wv);
            read8(heads + col, xv);
            read8(heads + 2 * QMK_HD + col, yv);
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                s0 = fmaf(wv[e], xv[e], s0);
                s1 = fmaf(wv[e], yv[e], s1);
            }
        }
#pragma unroll
        for (int o = 4; o; o >>= 1) {
            s0 += __shfl_xor_sync(0xffffffffu, s0, o);
            s1 += __shfl_xor_sync(0xffffffffu, s1, o);
        }
        if (part == 0) {
            sums[row] = s0;
            sums[QMK_AO_ROWS + row] = s1;
        }
        block_sync();
        c.stamp(id, STEP_DOTS);
        if (mine == 1) c.ring.defer(1);
        else c.ring.release(1);
        // ao_rows' epilogue, per position. (Shared through one inlined helper it changed the
        // short kernel's instructions, so it stays written out twice.)
        const int p = threadIdx.x / (QMK_AO_ROWS / 4);
        if (p < 2 && (p == 1 || acc0 != nullptr)) {
            const int k = 4 * (threadIdx.x % (QMK_AO_ROWS / 4)), u = r * QMK_AO_ROWS + k;
            const Acc& acc = p == 0 ? *acc0 : acc1;
            const VecRef in = p == 0 ? in0 : in1;
            float v[4] = {sums[p * QMK_AO_ROWS + k], sums[p * QMK_AO_ROWS + k + 1], sums[p * QMK_AO_ROWS + k + 2],
                          sums[p * QMK_AO_ROWS + k + 3]};
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
    c.stamp(id, STEP_EPILOGUE);
}

// Passes 0 and 1 (merge_first): `src0` the talker hidden (or its projection), `src1` pass 1's
// input (code 0's embedding row, or its table row's projection). Position 1's output is its
// last layer's `b` (first_acc), the head's input. (Not inlined, the kernel measured 0.02 ms a
// frame slower: bench/NOTES.md, v21.)
__device__ void run_pred_first(Ctx& c, VecRef src0, VecRef src1) {
    const qmk_model& m = c.F.m();
    const qmk_stack& S = m.pred;
    const int L = S.num_layers, D = S.hidden;
    const bool grouped = grouped_qkv(m, 0);
    float* qkv = dptr<float>(m.qkv);
    float* qkv1 = qkv + qkv0_width(m);
    for (int l = 0; l < L; ++l) {
        const Phase pq{K_QKV, l, 0};
        const qmk_layer& Ly = c.F.layer(pq);
        const bool last = l + 1 == L;
        const VecRef in0 = l == 0 ? src0 : VecRef{first_acc(m, 0, l - 1).b, VEC_ACC};
        const VecRef in1 = l == 0 ? src1 : VecRef{first_acc(m, 1, l - 1).b, VEC_ACC};
        if (l == 0) {  // position 1's layer-0 q/k/v is its table row
            Operand<2> x;
            load_xn<2>(in0, bfp(Ly.input_norm), D, S.eps, x);
            run_mat<2>(c, pq, 16 + PH_QKV, x, [&](int u, int j, const float* red) { qkv[u] = row_sum(red, j); });
        } else {
            run_mat_first(c, pq, 16 + PH_QKV, in0, in1, bfp(Ly.input_norm),
                          [&](int u, int j, const float* r0, const float* r1) {
                              qkv[u] = row_sum(r0, j);
                              qkv1[u] = row_sum(r1, j);
                          });
        }
        if (grouped) arrive_head(c, m, 16 + PH_QKV);
        else c.sync(16 + PH_QKV);
        const Acc a0 = first_acc(m, 0, l), a1 = first_acc(m, 1, l);
        run_attn_o_first(c, Phase{K_AO, l, 0}, 16 + PH_AO, grouped, in0, in1, last ? nullptr : &a0, a1);
        c.sync(16 + PH_AO);
        if (grouped) reset_head(m);
        const Phase pg{K_GU, l, 0};
        if (last) {  // position 1 alone; pass 2's first pair zeroed as pass 1's last layer does
            Operand<2> xm;
            load_xn<2>(VecRef{a1.a, VEC_F32}, bfp(Ly.post_norm), D, S.eps, xm);
            zero_acc(pred_acc(m, fused_layer(L, 1, L - 1) + 1), D);
            run_gu_split<2>(c, pg, 16 + PH_MLP, xm, a1.b);
        } else {
            if (l + 1 < L - 1) zero_acc(first_acc(m, 0, l + 1), D);
            zero_acc(first_acc(m, 1, l + 1), D);
            run_gu_first(c, pg, 16 + PH_MLP, a0.a, a1.a, bfp(Ly.post_norm), a0.b, a1.b);
        }
        c.sync(16 + PH_MLP);
    }
}
