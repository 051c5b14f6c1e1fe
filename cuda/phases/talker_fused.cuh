// The talker with attention and o_proj in one phase (qmk_stack.fuse_attn_o on the talker's stack;
// qmk_decode_frame sets it where the o_proj items fit the grid, talker_fuses, and launches the
// TFUSE kernels, which hold this code and not run_stack's talker: inlined beside it, it cost the
// predictor 0.30 ms a frame in spills)
//
// The (kv head, chunk) attention items run as in the attention phase but only publish (their
// head's output for a single chunk, else their partial softmax) and count; then 16 o_proj items per
// kv head g (hidden / 16 rows each), as in the predictor's fused phase, wait for head g's count,
// merge its partials and multiply their o_proj tiles, which streamed during the attention. One
// grid barrier less per layer; the residual takes the predictor's accumulator pairs (a: after
// attention, b: after the MLP), layer l the pair (L - l) % 2, so the last layer's `b` is pair 1 and
// the codec head phase may zero pairs 0 and 2 for the predictor while it reads it.
//
// Part of the qwen_mk.cu translation unit (included there in order, not on its own).

__device__ __forceinline__ Acc talker_acc(const qmk_model& m, int l) { return pred_acc(m, m.talker.num_layers - l); }
__device__ __forceinline__ VecRef talker_in(const qmk_model& m, int l) {
    return l == 0 ? VecRef{dptr<const float>(m.pending), VEC_F32} : VecRef{talker_acc(m, l - 1).b, VEC_ACC};
}

template <bool LONG>
__device__ void run_talker_ao(Ctx& c, int layer) {
    const qmk_model& m = c.F.m();
    const Phase ph{K_AO, layer, -1};
    const qmk_stack& S = m.talker;
    const AttnItems A = attn_items(c.F, ph);
    unsigned* count = dptr<unsigned>(m.attn_count);
    const float* part = dptr<const float>(m.attn_part);
    const float* out = dptr<const float>(m.attn);
    run_attention<LONG, true>(c, ph, PH_AO, false);
    const int sub = tao_subtiles(S), items = tao_items(S);
    const int mine = blockIdx.x < items ? (items - 1 - blockIdx.x) / gridDim.x + 1 : 0;
    float* heads = sm<float>(QMK_SMEM_XS);
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int it = blockIdx.x; it < items; it += gridDim.x) {
        const int g = it / QMK_TAO_GROUPS, r = (it % QMK_TAO_GROUPS) * sub;
        if (threadIdx.x == 0)
            while (ld_acquire(count + g) < (unsigned)A.nchunk) {
            }
        block_sync();
        if (w < 2) {  // query head 2 g + w; the partials were published with a release: ld.cg
            const float4 o = A.nchunk == 1
                                 ? __ldcg(reinterpret_cast<const float4*>(out + (size_t)(2 * g + w) * QMK_HD + lane * 4))
                                 : merge_head(part + (size_t)g * A.nchunk * 2 * QMK_PART + w * QMK_PART, A.nchunk, lane);
            *reinterpret_cast<float4*>(heads + w * QMK_HD + lane * 4) = o;
        }
        block_sync();
        for (int k = 0; k < sub; ++k) {
            if (k) block_sync();  // the row sums' area is rewritten
            // A deferred tile stays ahead of `consumed`: the next one is `deferred` further on.
            ao_rows(c, PH_AO, g, r + k, mine, heads, talker_in(m, layer), talker_acc(m, layer), c.ring.deferred);
        }
    }
    c.stamp(PH_AO, STEP_EPILOGUE);
}

// The talker's layers with fuse_attn_o, from the step's input (qmk_model.pending). The result is
// the last layer's `b` (talker_acc). LONG: the long-context kernel's attention (run_attention).
template <bool LONG>
__device__ void run_talker_fused(Ctx& c) {
    const qmk_model& m = c.F.m();
    const qmk_stack& S = m.talker;
    const int L = S.num_layers, D = S.hidden;
    for (int l = 0; l < L; ++l) {
        const Phase pq{K_QKV, l, -1};
        {
            Operand<2> x;
            load_xn<2>(talker_in(m, l), bfp(c.F.layer(pq).input_norm), D, S.eps, x);
            if (l == 0) zero_acc(talker_acc(m, 0), D);  // a later layer's pair: during the MLP phase before it
            float* qkv = dptr<float>(m.qkv);
            run_mat<2>(c, pq, PH_QKV, x, [&](int u, int j, const float* red) { qkv[u] = row_sum(red, j); });
        }
        c.sync(PH_QKV);
        run_talker_ao<LONG>(c, l);
        c.sync(PH_AO);
        const Acc acc = talker_acc(m, l);
        Operand<2> xm;
        load_xn<2>(VecRef{acc.a, VEC_F32}, bfp(c.F.layer(pq).post_norm), D, S.eps, xm);
        // Every o_proj item has passed its wait (the barrier above); the next layer's attention
        // items count after two more.
        if (blockIdx.x == 0 && (int)threadIdx.x < S.num_kv_heads) dptr<unsigned>(m.attn_count)[threadIdx.x] = 0u;
        if (l + 1 < L) zero_acc(talker_acc(m, l + 1), D);
        const Phase pg{K_GU, l, -1};
        if (D == 2048) run_gu_split<4>(c, pg, PH_MLP, xm, acc.b);
        else run_gu_split<2>(c, pg, PH_MLP, xm, acc.b);
        c.sync(PH_MLP);
    }
}
