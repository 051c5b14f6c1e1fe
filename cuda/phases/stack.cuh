// A stack's layers as separate phases (run_stack): q/k/v | attention | o_proj + residual |
// gate/up [+ split down] | [down]. The talker's unless the TFUSE kernels fuse it
// (talker_fused.cuh); the predictor's where fuse_attn_o is off.
//
// Part of the qwen_mk.cu translation unit (included there in order, not on its own).

// A stack of layers at one position; `src` is the stack's input (the residual stream's start).
// LONG: the long-context kernel's attention (run_attention), for the talker.
template <bool LONG>
__device__ void run_stack(Ctx& c, int pass, VecRef src) {
    const qmk_model& m = c.F.m();
    const Phase probe{K_QKV, 0, pass};
    const qmk_stack& S = c.F.stack(probe);
    const int D = S.hidden, nq = S.num_heads * QMK_HD, tid = threadIdx.x;
    const int ph0 = pass < 0 ? 0 : 16;
    float* resid = dptr<float>(m.resid);
    float* mid = dptr<float>(m.mid);
    float* qkv = dptr<float>(m.qkv);
    float* act = dptr<float>(m.act);
    float* own = sm<float>(QMK_SMEM_OWN);
    // The o_proj epilogue adds to the residual rows the block owns (o_proj's output rows; the down
    // phase has the same ones), kept in shared memory: from the stack's input here, then from
    // each q/k/v phase's staged operand, which is the residual stream itself.
    // (Both phases' epilogues index `own` by the unit's index in the slice.)
    {
        const Geo& rows = geo(Phase{K_O, 0, pass});
        for (int i = tid; i < rows.u1 - rows.u0; i += QMK_THREADS)
            own[i] = src.kind == VEC_BF16 ? ld_weight1(static_cast<const bf16*>(src.p) + rows.u0 + i)
                                 : ld_act(static_cast<const float*>(src.p) + rows.u0 + i);
    }
    for (int l = 0; l < S.num_layers; ++l) {
        const Phase pq{K_QKV, l, pass}, pa{K_ATTN, l, pass}, po{K_O, l, pass}, pg{K_GU, l, pass},
            pd{K_DOWN, l, pass};
        const qmk_layer& L = c.F.layer(pq);
        const bool tabled = l == 0 && from_table(m, pass);
        if (!tabled) {
            Operand<2> x;
            load_xn<2>(l == 0 ? src : VecRef{resid, S.split_down ? VEC_ACC : VEC_F32}, bfp(L.input_norm), D,
                       S.eps, x);
            if (l > 0) {  // with a split down projection, no block held these rows' sums before
                const Geo& rows = geo(po);
                const float* xs = sm<const float>(QMK_SMEM_XS);
                for (int i = tid; i < rows.u1 - rows.u0; i += QMK_THREADS) own[i] = xs[rows.u0 + i];
            }
            run_mat<2>(c, pq, ph0 + PH_QKV, x, [&](int u, int j, const float* red) { qkv[u] = row_sum(red, j); });
            QMK_TRACE_ONLY(trace_time(attn_trace_row(pass, l), 15);)
            c.sync(ph0 + PH_QKV);
            QMK_TRACE_ONLY(trace_time(attn_trace_row(pass, l), 16);)
        }
        run_attention<LONG>(c, pa, ph0 + PH_ATTN, tabled);
        // Pass 0's last layer: nothing reads its output, only the K/V rows just appended, and
        // the next pass reads those after many more grid barriers. No barrier here: the blocks
        // without an attention item start the next pass at once.
        if (pass == 0 && l + 1 == S.num_layers) return;
        QMK_TRACE_ONLY(trace_time(attn_trace_row(pass, l), 13);)
        c.sync(ph0 + PH_ATTN);
        QMK_TRACE_ONLY(trace_time(attn_trace_row(pass, l), 14);)
        {
            Operand<2> x;
            load_x<2>(VecRef{dptr<const float>(m.attn), VEC_F32}, nq, x);
            run_mat<2>(c, po, ph0 + PH_O, x, [&](int u, int j, const float* red) {
                const float v = own[j] + row_sum(red, j);
                own[j] = v;
                mid[u] = v;
                resid[u] = v;  // where a split down projection adds its partials (acc_copy)
#pragma unroll
                for (int k = 1; k < QMK_ACC_COPIES; ++k) resid[u + k * QMK_ACC_STRIDE] = 0.f;
            });
        }
        c.sync(ph0 + PH_O);
        Operand<2> xm;
        load_xn<2>(VecRef{mid, VEC_F32}, bfp(L.post_norm), D, S.eps, xm);
        if (S.split_down) {
            if (D == 2048) run_gu_split<4>(c, pg, ph0 + PH_MLP, xm, resid);
            else run_gu_split<2>(c, pg, ph0 + PH_MLP, xm, resid);
            c.sync(ph0 + PH_MLP);
            continue;
        }
        run_mat<2>(c, pg, ph0 + PH_MLP, xm, [&](int u, int j, const float* red) { act[u] = swiglu(red, j); });
        c.sync(ph0 + PH_MLP);
        run_down(c, pd, ph0 + PH_DOWN, act, [&](int u, int j, float sum) { resid[u] = own[j] + sum; });
        c.sync(ph0 + PH_DOWN);
    }
}
