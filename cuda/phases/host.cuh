// The host side: the C API of qwen_mk.h. Sizes the host allocates by (qmk_acc_floats,
// qmk_attn_part_floats), the grid (grid_config: one block per SM, shared memory, ring slots,
// cooperative residency of all four kernels, whether the model fits), the per-launch choices
// (uses_long_kernel, merges_first, talker_fuses) and the launch (qmk_decode_frame).
// QMK_TRACE_ATTN builds add the trace readers.
//
// Part of the qwen_mk.cu translation unit (included there in order, not on its own).

extern "C" int qmk_abi_version(void) { return QMK_ABI_VERSION; }

extern "C" void qmk_struct_sizes(int32_t* out) {
    out[0] = (int32_t)sizeof(qmk_layer);
    out[1] = (int32_t)sizeof(qmk_stack);
    out[2] = (int32_t)sizeof(qmk_model);
    out[3] = (int32_t)sizeof(qmk_frame);
}

// Floats of the residual accumulators: qmk_model.resid (copies of the widest hidden) and
// qmk_model.pres (four pairs: `a` and the copies of `b`).
extern "C" void qmk_acc_floats(int64_t* out) {
    out[0] = (int64_t)QMK_ACC_COPIES * QMK_ACC_STRIDE;
    out[1] = (int64_t)4 * QMK_ACC_PAIR;
}

extern "C" int64_t qmk_attn_part_floats(int32_t max_pos, int32_t kv_heads) {
    return (int64_t)attn_nchunk(max_pos - 1) * kv_heads * 2 * QMK_PART;
}

struct GridConfig {
    int dev = -1, blocks = 0, smem = 0, nslot = 0, threads = 0;
};

// The model must fit the kernel's fixed shared-memory areas on a grid of `blocks` blocks.
static int model_fits(const qmk_model& m, int blocks) {
    if (m.talker.num_layers + m.pred.num_layers > QMK_MAX_LAYERS) return cudaErrorNotSupported;
    const auto rows = [blocks](int n) { return (n + blocks - 1) / blocks; };
    const int widest = m.talker.hidden > m.pred.hidden ? m.talker.hidden : m.pred.hidden;
    if (rows(widest) > QMK_OWN_MAX) return cudaErrorNotSupported;
    // Row partials of a block's largest slice (gate/up rows count twice).
    const qmk_stack* st[2] = {&m.talker, &m.pred};
    int most = rows(m.vocab > m.pred_vocab ? m.vocab : m.pred_vocab);
    for (int i = 0; i < 2; ++i) {
        const int qkv = rows((st[i]->num_heads + 2 * st[i]->num_kv_heads) * QMK_HD), gu = 2 * rows(st[i]->inter);
        most = most > qkv ? most : qkv;
        most = most > gu ? most : gu;
    }
    return most > QMK_RED_ROWS ? cudaErrorNotSupported : cudaSuccess;
}

// Blocks, shared memory and ring slots on the current device (the shared-memory layout is fixed,
// so this depends on the device alone and is remembered per thread: a launch costs no attribute
// or occupancy query), then whether this model fits (cheap, every call: models differ).
static int grid_config(const qmk_model& m, GridConfig* out) {
    static thread_local GridConfig last;
    int dev = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e != cudaSuccess) return e;
    if (dev != last.dev) {
        int coop = 0, sms = 0, optin = 0;
        if ((e = cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, dev)) != cudaSuccess) return e;
        if (!coop) return cudaErrorNotSupported;
        if ((e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev)) != cudaSuccess) return e;
        if ((e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev)) != cudaSuccess)
            return e;
        // As many 32 KB slots as shared memory allows: the deeper the ring, the further ahead of
        // the barriers the weight reads run.
        int nslot = (optin - QMK_SMEM_SLOTS) / QMK_SLOT_BYTES;
        if (nslot > QMK_MAX_SLOTS) nslot = QMK_MAX_SLOTS;
        if (nslot < 2) return cudaErrorNotSupported;
        const int smem = smem_bytes(nslot);
        // The kernels wait on grid barriers, so every block must be resident at once: one block
        // per SM, and only if the occupancy the driver reports allows it (for all four kernels).
        // The block size is the kernel's launch bound, which depends on the architecture it was
        // built for (QMK_BLOCK_THREADS in the device pass).
        const void* kernels[4] = {(const void*)qmk_frame_kernel<false, false>, (const void*)qmk_frame_kernel<true, false>,
                                  (const void*)qmk_frame_kernel<false, true>, (const void*)qmk_frame_kernel<true, true>};
        cudaFuncAttributes attr;
        if ((e = cudaFuncGetAttributes(&attr, kernels[0])) != cudaSuccess) return e;
        const int threads = attr.maxThreadsPerBlock;
        if (threads < QMK_THREADS + 32) return cudaErrorNotSupported;
        for (const void* k : kernels) {
            e = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
            if (e != cudaSuccess) return e;
            int per_sm = 0;
            e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k, threads, smem);
            if (e != cudaSuccess) return e;
            if (per_sm < 1) return cudaErrorCooperativeLaunchTooLarge;
        }
        last = GridConfig{dev, sms, smem, nslot, threads};
    }
    *out = last;
    if (m.max_blocks > 0 && m.max_blocks < out->blocks) out->blocks = m.max_blocks;
    return model_fits(m, out->blocks);
}

extern "C" int qmk_grid_size(const qmk_model* m, int32_t* blocks, int32_t* smem_bytes) {
    GridConfig g;
    const int e = grid_config(*m, &g);
    if (e != cudaSuccess) return e;
    *blocks = g.blocks;
    *smem_bytes = g.smem;
    return cudaSuccess;
}

// The long-context kernel once the talker's attention items ((kv head, chunk) pairs) outnumber
// the blocks: it runs a block's items at once (run_attention). qmk_model.long_kernel overrides.
static bool uses_long_kernel(const qmk_model& m, const qmk_frame& f, int blocks) {
    if (m.long_kernel != 0) return m.long_kernel > 0;
    return f.run_talker && m.talker.num_kv_heads * attn_nchunk(f.pos) > blocks;
}

extern "C" int qmk_uses_long_kernel(const qmk_model* m, const qmk_frame* f, int32_t* out) {
    GridConfig g;
    const int e = grid_config(*m, &g);
    if (e != cudaSuccess) return e;
    *out = uses_long_kernel(*m, *f, g.blocks) ? 1 : 0;
    return cudaSuccess;
}

// Predictor passes 0 and 1 together (qmk_stack.merge_first) where its conditions hold: fused
// attention + o_proj with the split down projection, a layer-0 table for pass 1, a 1024-wide
// predictor (run_gu_first), and on this grid both positions' row partials and activations in a
// block's areas and every tile of its q/k/v and gate/up slices in the ring at once (the second
// position's dots sweep the same slots again).
static bool merges_first(const qmk_model& m, const GridConfig& g) {
    const qmk_stack& S = m.pred;
    if (!S.merge_first || !S.fuse_attn_o || !S.split_down || m.num_groups < 2 || m.qkv0[0] == 0 || S.hidden != 1024)
        return false;
    const auto ceil_div = [](int a, int b) { return (a + b - 1) / b; };
    const int qkv_rows = ceil_div((S.num_heads + 2 * S.num_kv_heads) * QMK_HD, g.blocks);
    const int rows = qkv_rows > 4 * QMK_HD / QMK_QKV_GROUP ? qkv_rows : 4 * QMK_HD / QMK_QKV_GROUP;
    const int units = ceil_div(S.inter, g.blocks);
    if (2 * rows > QMK_RED_ROWS || 4 * units > QMK_RED_ROWS) return false;
    const int per_row = QMK_SLOT_BYTES / (2 * S.hidden);  // q/k/v rows, or down_t rows, per tile
    const int gu = ceil_div(units, per_row / 2) + ceil_div(units, per_row);
    return ceil_div(rows, per_row) <= g.nslot && gu <= g.nslot;
}

extern "C" int qmk_merges_first_passes(const qmk_model* m, int32_t* out) {
    GridConfig g;
    const int e = grid_config(*m, &g);
    if (e != cudaSuccess) return e;
    *out = merges_first(*m, g) ? 1 : 0;
    return cudaSuccess;
}

// The talker's attention and o_proj in one phase (run_talker_fused) where asked for: with the split
// down projection (its accumulators), and where every o_proj item has a block of its own
// (tao_items: 128), in the short and the long-context kernel alike. With
// 64-row items the 1.7B's 256 on 132 blocks, two a block one after the other, ran 0.022 ms a step
// slower than its o_proj phase (bench/NOTES.md, v25); its items are 128 rows since.
// QMK_NO_TALKER_FUSE builds never fuse (A/B timing of the same build).
static bool talker_fuses(const qmk_model& m, const qmk_frame& f, int blocks) {
#ifdef QMK_NO_TALKER_FUSE
    return false;
#else
    return m.talker.fuse_attn_o && m.talker.split_down && f.run_talker && tao_items(m.talker) <= blocks;
#endif
}

extern "C" int qmk_uses_talker_fusion(const qmk_model* m, const qmk_frame* f, int32_t* out) {
    GridConfig g;
    const int e = grid_config(*m, &g);
    if (e != cudaSuccess) return e;
    *out = talker_fuses(*m, *f, g.blocks) ? 1 : 0;
    return cudaSuccess;
}

extern "C" int qmk_decode_frame(const qmk_model* m, const qmk_frame* f, uint64_t stream) {
    GridConfig g;
    const int e = grid_config(*m, &g);
    if (e != cudaSuccess) return e;
    Params p;
    p.m = *m;
    p.m.pred.merge_first = merges_first(*m, g) ? 1 : 0;
    const bool long_kernel = uses_long_kernel(*m, *f, g.blocks);
    p.m.talker.fuse_attn_o = talker_fuses(*m, *f, g.blocks) ? 1 : 0;
    p.f = *f;
    p.nslot = g.nslot;
    void* args[] = {&p};
    const void* kernels[2][2] = {{(const void*)qmk_frame_kernel<false, false>, (const void*)qmk_frame_kernel<false, true>},
                                 {(const void*)qmk_frame_kernel<true, false>, (const void*)qmk_frame_kernel<true, true>}};
    const void* kernel = kernels[long_kernel][p.m.talker.fuse_attn_o];
    return cudaLaunchCooperativeKernel(kernel, dim3(g.blocks), dim3(g.threads), args, (size_t)g.smem,
                                       reinterpret_cast<cudaStream_t>(stream));
}

#ifdef QMK_TRACE_ATTN
// The talker attention trace (QMK_TRACE_ATTN builds): [layer][block][QMK_DBG_SLOTS] int64.
extern "C" int qmk_attn_trace_read(void* dst, int64_t bytes) {
    return (int)cudaMemcpyFromSymbol(dst, qmk_attn_trace, (size_t)bytes);
}
extern "C" int qmk_grid_trace_read(void* dst, int64_t bytes) {
    return (int)cudaMemcpyFromSymbol(dst, qmk_grid_trace, (size_t)bytes);
}
extern "C" int qmk_attn_trace_clear(void) {
    void* p = nullptr;
    cudaError_t e = cudaGetSymbolAddress(&p, qmk_attn_trace);
    if (e == cudaSuccess) e = cudaMemset(p, 0, sizeof(qmk_attn_trace));
    if (e == cudaSuccess) e = cudaGetSymbolAddress(&p, qmk_grid_trace);
    return (int)(e != cudaSuccess ? e : cudaMemset(p, 0, sizeof(qmk_grid_trace)));
}
#endif

extern "C" const char* qmk_error_string(int code) { return cudaGetErrorString((cudaError_t)code); }
