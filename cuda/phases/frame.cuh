// The frame kernel (qmk_frame_kernel): setup, the producer / consumer split, the talker step, the
// codec head and code-0 sampling, the code predictor's passes with their LM heads, sampling and
// feedback (mk_sample.cuh), and the frame's outputs (publish_frame: codes, `seen`, the next talker
// input).
//
// Part of the qwen_mk.cu translation unit (included there in order, not on its own).

// Codes out, `seen` update and (for a full frame) the next talker input. Callers guarantee that
// every block has finished reading `seen` for this frame.
__device__ void publish_frame(const qmk_model& m, const qmk_frame& f, bool full) {
    const int G = m.num_groups;
    if (blockIdx.x == 0 && (int)threadIdx.x < G)
        dptr<long long>(f.codes_out)[threadIdx.x] = (threadIdx.x == 0 || full) ? codes()[threadIdx.x] : 0;
    if (blockIdx.x == 0 && threadIdx.x == 0) dptr<uint8_t>(m.seen)[fed()[0]] = 1;
    if (!full) return;
    // Next talker input: the 16 embeddings summed in order, then the text vector (fp32, the
    // reference's `total = total + emb` chain; the text vector is the fp32 prompt's own).
    const int Dt = m.talker.hidden;
    const int i = blockIdx.x * QMK_THREADS + threadIdx.x;
    if (i < Dt && f.trailing != 0) {
        float acc = ld_weight1(bfp(m.talker_emb) + (size_t)fed()[0] * Dt + i);
        for (int g = 1; g < G; ++g) acc = acc + ld_weight1(bfp(m.pred_emb[g - 1]) + (size_t)fed()[g] * Dt + i);
        dptr<float>(m.pending)[i] = acc + dptr<const float>(f.trailing)[i];
    }
}

__host__ __device__ __forceinline__ int smem_bytes(int nslot) { return QMK_SMEM_SLOTS + nslot * QMK_SLOT_BYTES; }

// LONG: the long-context kernel, launched when the talker's attention items outnumber the blocks
// (qmk_decode_frame); it differs only in run_attention. TFUSE: the talker's attention and o_proj
// in one phase (run_talker_fused).
template <bool LONG, bool TFUSE>
__global__ void __launch_bounds__(QMK_BLOCK_THREADS, 1) qmk_frame_kernel(const __grid_constant__ Params P) {
    const qmk_model& m = P.m;
    const qmk_frame& f = P.f;
    const int tid = threadIdx.x;
    {
        const int nt = m.talker.num_layers * (int)(sizeof(qmk_layer) / 8);
        const int np = m.pred.num_layers * (int)(sizeof(qmk_layer) / 8);
        uint64_t* dst = sm<uint64_t>(QMK_SMEM_TABLES);
        for (int i = tid; i < nt + np; i += (int)blockDim.x)
            dst[i] = i < nt ? dptr<const uint64_t>(m.talker.layers)[i] : dptr<const uint64_t>(m.pred.layers)[i - nt];
        if (tid == 0) *sm<int>(QMK_SMEM_STAMPS) = 0;
    }
    Ctx c;
    c.F = Frame{&P};
    if (tid < 16) {
        const int k = tid % 8;
        const Phase ph{k, 0, tid < 8 ? -1 : 0};
        if (k != K_ATTN) sm<Geo>(QMK_SMEM_GEO)[tid] = geo_of(c.F, ph);
    }
    if (tid == 0) ring_init(P.nslot);
    __syncthreads();  // tables, geometry and mbarriers in place for both roles
    if (tid >= QMK_THREADS) {
        // The producer warp (warpgroup on sm_90a): lane 0 streams the frame's tiles; the warps
        // then wait at the block barrier for the consumers to finish (Ring::finish). Each role
        // sets its register count only once it has branched off for good: ptxas holds code after
        // both a decrease and an increase to the smaller count (setmaxnreg ahead of the setup
        // above spilled 752 bytes).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(QMK_PRODUCER_REGS));
#endif
        if (tid == QMK_THREADS) produce(&P);
        __syncwarp();
        __syncthreads();
        return;
    }
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(QMK_CONSUMER_REGS));
#endif
    c.ring.nslot = P.nslot;
    c.ring.consumed = 0;
    c.ring.deferred = 0;
    c.ring.hold_next = c.ring.held = c.ring.held_at = 0;
    if (f.trace != 0) c.sync(PH_START);
    const int has_proj = m.proj_w != 0;

    const int G = m.num_groups, Dt = m.talker.hidden, Dp = m.pred.hidden;
    const long long* force = dptr<const long long>(f.force_codes);

    // Talker step + codec head.
    {
        const Phase ph{K_HEAD_T, 0, -1};
        Operand<2> x;
        if (f.run_talker) {
            const VecRef step_in{dptr<const float>(m.pending), VEC_F32};
            if constexpr (TFUSE) run_talker_fused<LONG>(c);
            else run_stack<LONG>(c, -1, step_in);
            const float* out = TFUSE ? talker_acc(m, m.talker.num_layers - 1).b : dptr<const float>(m.resid);
            load_xn<2>(VecRef{out, TFUSE || m.talker.split_down ? VEC_ACC : VEC_F32},
                       bfp(m.talker.final_norm), Dt, m.talker.eps, x);
            if (blockIdx.x == 0) store_operand<2>(x, Dt, dptr<float>(m.hidden));
        } else {
            load_x<2>(VecRef{dptr<const float>(m.hidden), VEC_F32}, Dt, x);
        }
        float* logits = dptr<float>(m.logits);
        if (m.pred.fuse_attn_o) zero_acc(pred_acc(m, 0), Dp);  // the predictor's first fused layer
        if (m.pred.merge_first) zero_acc(first_acc(m, 1, 0), Dp);  // and pass 1's, merged with it
        run_mat<2>(c, ph, PH_HEAD, x, [&](int u, int j, const float* red) { logits[u] = row_sum(red, j); });
        c.sync(PH_HEAD);
    }
    BlockReducer sred{sm<float>(QMK_SMEM_SRED), 0};
    const TalkerRules rules{dptr<const uint8_t>(m.seen), f.rep_penalty, f.frame < f.min_new_tokens, m.eos_id,
                            f.suppress_start};
    const int c0 = sample_vocab<true>(dptr<const float>(m.logits), m.vocab, f.talker_s, rules,
                                      uniform01(f.seed, (uint32_t)f.frame, 0), sred, sm<float>(QMK_SMEM_SCAN),
                                      sm<unsigned>(QMK_SMEM_TOPK), [&](int step) { c.stamp(PH_SAMPLE, step); });
    if (tid == 0) {
        codes()[0] = c0;
        feed(m, 0, force ? (int)force[0] : c0);
    }
    block_sync();
    if (fed()[0] == m.eos_id || !f.run_predictor) {
        // No barrier follows sampling on this path: wait for every block to finish reading
        // `seen` before block 0 updates it.
        c.sync(PH_SAMPLE);
        publish_frame(m, f, false);
        c.ring.finish();
        return;
    }

    // 15 code-predictor steps (positions 0..15; position 0 is the talker hidden, no head).
    float* proj_out = dptr<float>(m.proj_out);
    for (int pp = 0; pp < G; ++pp) {
        VecRef src{dptr<const float>(m.hidden), VEC_F32};
        if (pp == 1) src = VecRef{bfp(m.talker_emb) + (size_t)fed()[0] * Dt, VEC_BF16};
        if (pp >= 2) src = VecRef{bfp(m.pred_emb[pp - 2]) + (size_t)fed()[pp - 1] * Dt, VEC_BF16};
        if (has_proj && from_table(m, pp)) {
            src = VecRef{*sm<const float* volatile>(QMK_SMEM_QSRC) + qkv0_width(m), VEC_F32};
        } else if (has_proj) {
            Operand<2> x;
            load_x<2>(src, Dt, x);
            const bf16* bias = bfp(m.proj_b);
            run_mat<2>(c, Phase{K_PROJ, 0, pp}, 16 + PH_PROJ, x,
                       [&](int u, int j, const float* red) { proj_out[u] = row_sum(red, j) + ld_weight1(bias + u); });
            c.sync(16 + PH_PROJ);
            src = VecRef{proj_out, VEC_F32};
        }
        const bool fused = m.pred.fuse_attn_o, merged = pp == 0 && m.pred.merge_first;
        const int Lp = m.pred.num_layers;
        if (merged) {  // passes 0 and 1; pass 1 then goes on to its head
            const VecRef src1 = has_proj ? VecRef{*sm<const float* volatile>(QMK_SMEM_QSRC) + qkv0_width(m), VEC_F32}
                                         : VecRef{bfp(m.talker_emb) + (size_t)fed()[0] * Dt, VEC_BF16};
            run_pred_first(c, src, src1);
            pp = 1;
        } else if (fused) {
            run_pred_fused(c, pp, src);
        } else {
            run_stack<false>(c, pp, src);
        }
        if (pp == 0) continue;
        float* lg = dptr<float>(m.pred_logits) + (size_t)(pp - 1) * m.pred_vocab;
        {
            Operand<2> x;
            const float* out = !fused ? dptr<const float>(m.resid)
                               : merged ? first_acc(m, 1, Lp - 1).b
                                        : pred_acc(m, fused_layer(Lp, pp, Lp - 1)).b;
            load_xn<2>(VecRef{out, fused || m.pred.split_down ? VEC_ACC : VEC_F32}, bfp(m.pred.final_norm), Dp,
                       m.pred.eps, x);
            if (blockIdx.x == 0) store_operand<2>(x, Dp, dptr<float>(m.pred_hidden) + (size_t)pp * Dp);
            run_mat<2>(c, Phase{K_HEAD_P, 0, pp}, 16 + PH_HEAD, x, [&](int u, int j, const float* red) { lg[u] = row_sum(red, j); });
        }
        c.sync(16 + PH_HEAD);
        const int code = sample_vocab<false>(lg, m.pred_vocab, f.pred_s, rules, uniform01(f.seed, (uint32_t)f.frame, pp),
                                             sred, sm<float>(QMK_SMEM_SCAN), sm<unsigned>(QMK_SMEM_TOPK),
                                             [&](int step) { c.stamp(16 + PH_SAMPLE, step); });
        if (tid == 0) {
            codes()[pp] = code;
            feed(m, pp, force ? (int)force[pp] : code);
        }
        block_sync();
    }
    publish_frame(m, f, true);
    c.ring.finish();
}
