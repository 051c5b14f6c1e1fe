// The consumers' context (Ctx): the launch view, the ring's consumer side, trace stamps, the grid
// barrier that ends a phase (sync) and the group arrival that ends one without it (group_arrive).
// QMK_TRACE_ATTN builds also record every block's barrier times (qmk_grid_trace).
//
// Part of the qwen_mk.cu translation unit (included there in order, not on its own).

#ifdef QMK_TRACE_ATTN
// Every grid barrier's arrival, arrival done and exit, per block (global timer), and its phase id
// (+64 for a group arrival): [block][barrier][4].
#define QMK_GRID_SEQ 512
__device__ long long qmk_grid_trace[QMK_DBG_BLOCKS * QMK_GRID_SEQ * 4];
#endif

struct Ctx {
    Frame F;
    Ring ring;
#ifdef QMK_TRACE_ATTN
    int seq = 0;
    __device__ long long* grid_row() {
        return blockIdx.x < QMK_DBG_BLOCKS && seq < QMK_GRID_SEQ ? qmk_grid_trace + ((size_t)blockIdx.x * QMK_GRID_SEQ + seq) * 4
                                                                  : nullptr;
    }
#endif

    // Block 0's thread 0 records (clock, global timer, id): at every barrier exit (step 0), and
    // with trace_steps also at the steps inside a phase (STEP_*), for the per-step profile.
    __device__ void stamp(int id, int step) const {
#ifndef QMK_TRACE_STEPS
        if (step != 0 && step != STEP_DONE) return;  // steps are compiled in for profiling builds only
#endif
        long long* trace = dptr<long long>(F.f().trace);
        // A plain trace keeps the barrier exits and each block-0 "work done" (the phase profile's
        // wait for the other blocks); trace_steps adds the rest.
        const bool wanted = step == 0 || step == STEP_DONE || F.f().trace_steps;
        if (trace == nullptr || blockIdx.x != 0 || threadIdx.x != 0 || !wanted) return;
        int* stamps = sm<int>(QMK_SMEM_STAMPS);
        if (*stamps >= QMK_TRACE_MAX) return;
        long long gt;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(gt));
        trace[3 * *stamps] = clock64();
        trace[3 * *stamps + 1] = gt;
        trace[3 * *stamps + 2] = id + 32 * step;
        ++*stamps;
    }

    // Grid barrier over the consumer threads of every block.
    __device__ void sync(int phase) {
        block_sync();
        if (threadIdx.x == 0) {
            stamp(phase, STEP_DONE);
            unsigned* counter = dptr<unsigned>(F.m().barrier);
#ifdef QMK_TRACE_ATTN
            long long* gr = grid_row();
            if (gr) gr[0] = dbg_gtime(), gr[3] = phase;
#endif
            const unsigned arrived = grid_arrive(counter);
#ifdef QMK_TRACE_ATTN
            if (gr) gr[1] = dbg_gtime();
#endif
            ring.release_deferred();
            stamp(phase, STEP_ARRIVED);
            grid_wait(counter, arrived);
#ifdef QMK_TRACE_ATTN
            if (gr) gr[2] = dbg_gtime();
            ++seq;
#endif
            stamp(phase, 0);
        }
        block_sync();
        ring.end_deferred();
    }

    // The end of a phase that only the blocks of one group wait for: its stores released to them
    // through `counter` (blocks outside any group pass null), the tiles handed back as at a grid
    // arrival, no wait.
    __device__ void group_arrive(unsigned* counter, int phase) {
        block_sync();
        if (threadIdx.x == 0) {
            stamp(phase, STEP_DONE);
#ifdef QMK_TRACE_ATTN
            long long* gr = grid_row();
            if (gr) gr[0] = dbg_gtime(), gr[3] = 64 + phase;
#endif
            if (counter) red_add_release(counter);
#ifdef QMK_TRACE_ATTN
            if (gr) gr[1] = gr[2] = dbg_gtime();
            ++seq;
#endif
            ring.release_deferred();
            stamp(phase, 0);
        }
        block_sync();
        ring.end_deferred();
    }
};
