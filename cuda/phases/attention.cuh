// The attention phase (run_attention): (kv head, 32-position chunk) items dealt to the blocks, one
// at a time (the short kernel) or up to QMK_ATTN_PAIRS at once (LONG, the long-context kernel);
// the item itself is mk_attention.cuh. Also the grouped q/k/v phase's per-head arrival, wait and
// reset (arrive_head, wait_head, reset_head).
//
// Part of the qwen_mk.cu translation unit (included there in order, not on its own).

// Grouped q/k/v: the end of the phase (this block's head counter, if it has rows), the wait for
// head g's blocks (thread 0, then the block), and the reset once every waiter has passed a grid
// barrier since (the block of row group 0, before the next q/k/v phase's barrier).
__device__ __forceinline__ void arrive_head(Ctx& c, const qmk_model& m, int id) {
    const int b = blockIdx.x;
    c.group_arrive(b < QMK_QKV_GROUP * m.pred.num_kv_heads ? head_ready(m) + b / QMK_QKV_GROUP : nullptr, id);
}
__device__ __forceinline__ void wait_head(const qmk_model& m, int g) {
    if (threadIdx.x == 0)
        while (ld_acquire(head_ready(m) + g) < (unsigned)QMK_QKV_GROUP) {
        }
    block_sync();
}
__device__ __forceinline__ void reset_head(const qmk_model& m) {
    const int b = blockIdx.x;
    if (threadIdx.x == 0 && b < QMK_QKV_GROUP * m.pred.num_kv_heads && b % QMK_QKV_GROUP == 0)
        head_ready(m)[b / QMK_QKV_GROUP] = 0u;
}

// `tabled`: the position's raw q/k/v projections are this pass's table row (feed), not the q/k/v
// phase's output. LONG (the long-context kernel, chosen per launch: qmk_decode_frame): a block
// with several items runs up to QMK_ATTN_PAIRS of them at once, one per warp pair, their tiles in
// the ring together. The short kernel keeps one item at a time: the pairs' code, merely present,
// cost 0.03 ms a frame at position 100 (register allocation; bench/NOTES.md, v20).
// PUBLISH: the fused talker's attention (run_talker_ao): items publish and count, none merges.
template <bool LONG, bool PUBLISH = false>
__device__ void run_attention(Ctx& c, const Phase& ph, int id, bool tabled) {
    const qmk_model& m = c.F.m();
    const qmk_stack& S = c.F.stack(ph);
    const qmk_layer& L = c.F.layer(ph);
    const AttnItems A = attn_items(c.F, ph);
    const size_t off = (size_t)ph.layer * S.num_kv_heads * S.max_pos * QMK_HD;
    const AttnArgs a{dptr<const float>(m.qkv), dptr<float>(m.attn),   dptr<float>(S.k_cache) + off,
                     dptr<float>(S.v_cache) + off, bfp(L.q_norm), bfp(L.k_norm), dptr<const float>(S.rope),
                     dptr<float>(m.attn_part), dptr<unsigned>(m.attn_count), A.pos, S.num_heads,
                     S.num_kv_heads, S.max_pos, S.eps, 0, 1, PUBLISH};
    if constexpr (!LONG) {
        for (int it = blockIdx.x; it < A.items; it += gridDim.x) {
#ifdef QMK_TRACE_ATTN
            long long* row = attn_trace_row(ph.pass, ph.layer);
            if (row && threadIdx.x == 0) row[0] = dbg_gtime(), row[11] = it, row[9] = 0;
            AttnArgs ad = a;
            ad.dbg = row;
#define QMK_ATTN_ARGS ad
#else
#define QMK_ATTN_ARGS a
#endif
            const bool has = A.has_tile(it);
            const float* tile = has ? reinterpret_cast<const float*>(c.ring.wait(0)) : nullptr;
            c.stamp(id, STEP_TILE);
            QMK_TRACE_ONLY(trace_time(row, 1);)
            // The table row's address is read here, where it is used: run_attention is at the
            // register limit.
            const float* qkv = tabled ? *sm<const float* volatile>(QMK_SMEM_QSRC) : a.qkv;
            attention_item(QMK_ATTN_ARGS, qkv, it / A.nchunk, it % A.nchunk, A.nchunk, tile, sm<float>(QMK_SMEM_ATTN));
#undef QMK_ATTN_ARGS
            block_sync();
#ifdef QMK_TRACE_ATTN
            if (row && threadIdx.x == 0) row[10] = dbg_gtime(), row[12] = clock64();
#endif
            // One tile per item; a long context gives a block more items than the ring has slots, so
            // each goes back at once (deferring K/V tiles to the arrival measured 0.02 ms slower).
            if (has) c.ring.release(1);
        }
        return;
    }
    const int P = min(QMK_ATTN_PAIRS, c.ring.nslot), k = threadIdx.x >> 6;
    for (int first = blockIdx.x; first < A.items; first += P * gridDim.x) {
        int nt = 0, mine = -1;  // tiles of the round; this pair's among them
        for (int j = 0; j < P; ++j) {
            const int it = first + j * gridDim.x;
            if (it >= A.items) break;
            if (j == k && A.has_tile(it)) mine = nt;
            nt += A.has_tile(it);
        }
        const int it = first + k * gridDim.x;
        if (k < P && it < A.items) {
            const float* tile = mine >= 0 ? reinterpret_cast<const float*>(c.ring.wait(mine)) : nullptr;
            c.stamp(id, STEP_TILE);
            const float* qkv = tabled ? *sm<const float* volatile>(QMK_SMEM_QSRC) : a.qkv;
            attention_item(a, qkv, it / A.nchunk, it % A.nchunk, A.nchunk, tile, sm<float>(QMK_SMEM_ATTN), k);
        }
        block_sync();
        if (nt) c.ring.release(nt);  // a round's tiles go back at once
    }
}
