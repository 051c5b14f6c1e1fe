// The producer: which bytes each block streams for each phase (a matrix phase's row tiles, an
// attention item's K/V rows, a fused attention + o_proj item's K/V rows and o_blk tile), in the
// order the consumers read them (TileCursor), and the producer warp's loop (produce) that issues
// them into the ring (mk_stream.cuh).
//
// Part of the qwen_mk.cu translation unit (included there in order, not on its own).

__device__ __forceinline__ Range rows_of(uint64_t base, int row, int rows, int K) {
    const size_t rb = (size_t)K * 2;
    return {reinterpret_cast<const unsigned char*>(base) + row * rb, (uint32_t)(rows * rb)};
}

__device__ Tile mat_tile(const Frame& F, const Phase& ph, const Geo& mt, int t) {
    if (t >= mt.ngu) {  // split down: rows of down_t for this block's gate/up units
        const int a = mt.u0 + (t - mt.ngu) * mt.dpt;
        Tile tl;
        tl.r[0] = rows_of(F.layer(ph).down_t, a, min(mt.dpt, mt.u1 - a), mt.K);
        tl.n = 1;
        return tl;
    }
    const int per_half = mt.ngu / mt.ksplit, h = t / per_half;
    const int a = mt.u0 + (t % per_half) * mt.per_tile, n = min(mt.per_tile, mt.u1 - a);
    Tile tl;
    tl.n = 1;
    const qmk_model& m = F.m();
    switch (ph.kind) {
        case K_QKV: {
            // Rows of the virtual q|k|v matrix; a tile (<= 16 rows) crosses at most one boundary.
            const qmk_layer& L = F.layer(ph);
            const qmk_stack& S = F.stack(ph);
            const int nq = S.num_heads * QMK_HD, nk = S.num_kv_heads * QMK_HD, end = a + n;
            int r = a, k = 0;
            while (r < end && k < 2) {
                uint64_t base;
                int off, lim;
                if (r < nq) base = L.q, off = r, lim = nq;
                else if (r < nq + nk) base = L.k, off = r - nq, lim = nq + nk;
                else base = L.v, off = r - nq - nk, lim = end;
                const int cnt = min(end, lim) - r;
                tl.r[k++] = rows_of(base, off, cnt, mt.K);
                r += cnt;
            }
            tl.n = k;
            break;
        }
        case K_GU: {
            const qmk_layer& L = F.layer(ph);
            tl.r[0] = rows_of(L.gate, a, n, mt.K);
            tl.r[1] = rows_of(L.up, a, n, mt.K);
            tl.n = 2;
            break;
        }
        case K_O: tl.r[0] = rows_of(F.layer(ph).o, a, n, mt.K); break;
        case K_DOWN:
            if (mt.ksplit == 1) {
                tl.r[0] = rows_of(F.layer(ph).down, a, n, mt.K);
            } else {  // half h of each row: one range per row
                const unsigned char* base = reinterpret_cast<const unsigned char*>(F.layer(ph).down);
                const size_t rb = (size_t)mt.K * 2 * mt.ksplit;
                for (int k = 0; k < n; ++k) tl.r[k] = {base + (a + k) * rb + h * (size_t)mt.K * 2, (uint32_t)mt.K * 2};
                tl.n = n;
            }
            break;
        case K_HEAD_T: tl.r[0] = rows_of(m.codec_head, a, n, mt.K); break;
        case K_PROJ: tl.r[0] = rows_of(m.proj_w, a, n, mt.K); break;
        default: tl.r[0] = rows_of(m.lm_head[ph.pass - 1], a, n, mt.K); break;
    }
    return tl;
}

// Attention items (kv head, chunk) are dealt to blocks round-robin; an item whose chunk holds
// cached positions streams their K and V rows as one tile.
struct AttnItems {
    int pos, nchunk, items;
    __device__ bool has_tile(int it) const { return (it % nchunk) * QMK_CHUNK < pos; }
    __device__ int tiles_of_block() const {
        int n = 0;
        for (int it = blockIdx.x; it < items; it += gridDim.x) n += has_tile(it);
        return n;
    }
};

__device__ AttnItems attn_items(const Frame& F, const Phase& ph) {
    const int pos = F.attn_pos(ph), nchunk = attn_nchunk(pos);
    return {pos, nchunk, F.stack(ph).num_kv_heads * nchunk};
}

__device__ int attn_tiles(const Frame& F, const Phase& ph) { return attn_items(F, ph).tiles_of_block(); }

__device__ Tile attn_tile(const Frame& F, const Phase& ph, int t) {
    const AttnItems A = attn_items(F, ph);
    const qmk_stack& S = F.stack(ph);
    int it = blockIdx.x;
    for (;; it += gridDim.x)
        if (A.has_tile(it) && t-- == 0) break;
    const int g = it / A.nchunk, j0 = (it % A.nchunk) * QMK_CHUNK, j1 = min(j0 + QMK_CHUNK, A.pos);
    const size_t row = (((size_t)ph.layer * S.num_kv_heads + g) * S.max_pos + j0) * QMK_HD;
    const uint32_t bytes = (uint32_t)(j1 - j0) * QMK_HD * 4;
    Tile tl;
    tl.r[0] = {dptr<const float>(S.k_cache) + row, bytes};
    tl.r[1] = {dptr<const float>(S.v_cache) + row, bytes};
    tl.n = 2;
    tl.kv = 1;
    return tl;
}

// A predictor's fused attention + o_proj item streams its head's cached K/V rows (from pass 1 on),
// then its o_proj tile. The talker's fused phase streams the K/V tiles of the block's attention
// items first (as its attention phase would), then one o_proj tile per item (run_talker_ao).
__device__ __forceinline__ int ao_tiles_per_item(const Phase& ph) { return ph.pass > 0 ? 2 : 1; }

__device__ int ao_tiles(const Frame& F, const Phase& ph) {
    if (ph.pass < 0) {
        const qmk_stack& S = F.m().talker;
        const int items = tao_items(S);
        const int mine = blockIdx.x < items ? (items - 1 - blockIdx.x) / gridDim.x + 1 : 0;
        return attn_tiles(F, ph) + mine * tao_subtiles(S);
    }
    const int items = ao_items(F.m().pred);
    const int mine = blockIdx.x < items ? (items - 1 - blockIdx.x) / gridDim.x + 1 : 0;
    return mine * ao_tiles_per_item(ph);
}

__device__ Tile ao_tile(const Frame& F, const Phase& ph, int t) {
    const qmk_stack& S = F.stack(ph);
    Tile tl;
    if (ph.pass < 0) {
        const int att = attn_tiles(F, ph);
        if (t < att) return attn_tile(F, ph, t);
        t -= att;
        const int sub = tao_subtiles(S), it = blockIdx.x + (t / sub) * gridDim.x;
        const int g = it / QMK_TAO_GROUPS, r = (it % QMK_TAO_GROUPS) * sub + t % sub;
        const size_t first = ((size_t)g * S.hidden + (size_t)r * QMK_AO_ROWS) * 2 * QMK_HD;
        tl.r[0] = {bfp(F.layer(ph).o_blk) + first, (uint32_t)QMK_SLOT_BYTES};
        tl.n = 1;
        return tl;
    }
    const int per = ao_tiles_per_item(ph), it = blockIdx.x + (t / per) * gridDim.x;
    const int R = ao_row_groups(S), g = it / R, r = it % R;
    if (per == 2 && t % per == 0) {  // K then V rows of positions 0 .. pass - 1
        const size_t row = ((size_t)ph.layer * S.num_kv_heads + g) * S.max_pos * QMK_HD;
        const uint32_t bytes = (uint32_t)ph.pass * QMK_HD * 4;
        tl.r[0] = {dptr<const float>(S.k_cache) + row, bytes};
        tl.r[1] = {dptr<const float>(S.v_cache) + row, bytes};
        tl.n = 2;
        tl.kv = 1;
        return tl;
    }
    const size_t first = ((size_t)g * S.hidden + (size_t)r * QMK_AO_ROWS) * 2 * QMK_HD;
    tl.r[0] = {bfp(F.layer(ph).o_blk) + first, (uint32_t)QMK_SLOT_BYTES};
    tl.n = 1;
    return tl;
}

__device__ int phase_tiles(const Frame& F, const Phase& ph) {
    if (ph.kind == K_AO) return ao_tiles(F, ph);
    return ph.kind == K_ATTN ? attn_tiles(F, ph) : geo(ph).ntiles;
}

__device__ Tile phase_tile(const Frame& F, const Phase& ph, int t) {
    if (ph.kind == K_AO) return ao_tile(F, ph, t);
    return ph.kind == K_ATTN ? attn_tile(F, ph, t) : mat_tile(F, ph, geo(ph), t);
}

// A position in the frame's tile sequence, in the order the consumers read the tiles.
struct TileCursor {
    Phase ph;
    int tile, ntiles;

    __device__ explicit TileCursor(const Frame& F) : ph(first_phase(F.f())), tile(0), ntiles(phase_tiles(F, ph)) {}

    // Onto the next tile that exists (a phase may have no tiles for this block); false at the end
    // of the frame.
    __device__ bool settle(const Frame& F) {
        while (tile >= ntiles) {
            if (!next_phase(F.m(), F.f(), ph)) return false;
            tile = 0;
            ntiles = phase_tiles(F, ph);
        }
        return true;
    }
};

// The producer warp's lane 0: walk the frame's tiles in the consumers' order and issue each copy
// as soon as its slot is free. Stops at the end of the frame's tiles, or when the consumers end
// the frame early (EOS).
__device__ __noinline__ void produce(const Params* P) {
    const Frame F{P};
    const int nslot = P->nslot;
    TileCursor cur(F);
    uint32_t i = 0;
    while (cur.settle(F)) {
        if (!wait_slot_free(i, nslot)) break;
        // The predictor's K/V rows were stored by other blocks earlier in this launch.
        const Phase& ph = cur.ph;
        const Tile t = phase_tile(F, ph, cur.tile++);
        issue_tile(t, i++, nslot, t.kv && ph.pass >= 0, !t.kv);
    }
    *reinterpret_cast<volatile uint32_t*>(&ring_state().issued) = i;
}
