// The backward's driver: checks the BackwardParams contract, plans items (kernel.h BackwardItem),
// runs them on the thread pool (pool.h) with per-thread scratch, and sums the dq partials of
// split kv heads in a fixed order (chunks of rows queued behind the items: run_on_thread). Built
// with no -m flags; the family's BackwardLoop (kernels/common/backward_loop.h, whose header
// explains the dQ choice) does the math.
//
// Determinism: the items, each item's loop order and the partial sums' order depend on the
// shapes only, never on the thread count or on which thread runs what, so dq, dk, dv are
// bit-identical for any num_threads.
//
// Every element of dq, dk, dv is written (fa2cpu/backward.py allocates them uninitialised): items
// cover every key of every (sequence, kv head) with keys or queries, an unsplit item zeroes the
// dq rows that see none of its keys, reduce_chunk writes every row of a split head. A call with
// no query heads returns at once and writes nothing (backward.py gives it zeros).
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "../dispatch/registry.h"
#include "../kernels/common/kernel.h"
#include "driver.h"
#include "pool.h"

namespace fa2cpu {
namespace {

// Key-axis splits: a call aims at target_items() items, splitting each (sequence, kv head) into
// at most kMaxSplits key ranges of whole tiles (the target depends on the machine's CPU count,
// like the cap below, so the plan depends on shapes and the machine, never on the thread count:
// determinism). A split costs every row it sees packed once more, one float32 copy of its rows'
// dq (the partials) and their sum, and buys load balance. The target is the larger of
// FA2CPU_BWD_TARGET_ITEMS (16) and kItemsPerCpu per CPU:
// - 16 items (no split from 16 kv heads on; an unsplit kv head is one item of the same cost as
//   every other, causal or not) measured 12-14 % faster than 64 for causal and ~2 % for full
//   attention on 2 CPUs (2-core dev VM, 2 threads, B=1 H=16 N=2048 D=128, fp32 and bf16);
// - on the 16-core AMX Xeon, 64 items instead of 16 (H=16 N=2048: 4 splits of 512 keys instead of
//   the cap's 2) ran bf16 1.015 / 1.061x (full), 1.106 / 1.113x (causal), H=8 1.147x faster at 16
//   threads, fp32 (3 splits to 4) 0.960 / 0.975x (full), 0.998 / 1.158x (causal) (in-process
//   A/B, bench/RESULTS.md session 43): whole items of ~10 ms on 16 threads left cores idle;
// - kItemsPerCpu (FA2CPU_BWD_ITEMS_PER_CPU) 2, 3, 6, 8 against 4, same machine, 16 threads, in
//   process (session 46): H=16 N=2048 fp32 0.94-0.99x (full), 0.96-0.98x (causal), bf16
//   0.87-0.98x / 0.81-0.96x; only fp32 H=32 N=4096 full read 1.025x at 6 (0.98-1.01x otherwise).
#ifndef FA2CPU_BWD_TARGET_ITEMS
#define FA2CPU_BWD_TARGET_ITEMS 16
#endif
#ifndef FA2CPU_BWD_ITEMS_PER_CPU
#define FA2CPU_BWD_ITEMS_PER_CPU 4
#endif
constexpr int64_t kItemsPerCpu = FA2CPU_BWD_ITEMS_PER_CPU;
constexpr int64_t kMaxSplits = 8;
// A fine schedule tail: on machines of at least FA2CPU_BWD_FINE_TAIL_CPUS CPUs, the last
// ceil(CPUs / want) (sequence, kv head) pairs of a plan that deals each pair `want` splits are
// split twice as finely, so the dynamic schedule ends with half-size items. At 16 threads (AMX
// Xeon, model 207, H=16 N=2048) the threads' last items ended ~0.9 of an item apart (idle probe:
// items busy 81 % of threads x wall, bf16 full), and this tail ran bf16 full 1.08-1.11x, fp32
// full 1.09-1.13x, bf16 causal 0.97-1.04x in process (three orders against the same tree;
// bench/RESULTS.md sessions 55 and 56). Plans whose scratch cap already raised the splits past
// `want` (H=32 N=4096) are left alone: the tail there measured 0.91-0.97x. On 2 CPUs it cost bf16
// with few heads 4-5 % (H=4 N=2048), hence the CPU floor (no machine between 2 and 16 measured).
#ifndef FA2CPU_BWD_FINE_TAIL_CPUS
#define FA2CPU_BWD_FINE_TAIL_CPUS 16
#endif
// dq rows a work item of the partials' sum takes (backward()'s chunks).
#ifndef FA2CPU_BWD_DQ_CHUNK_ROWS
#define FA2CPU_BWD_DQ_CHUNK_ROWS 256
#endif
constexpr int64_t kDqChunkRows = FA2CPU_BWD_DQ_CHUNK_ROWS;
int64_t machine_cpus() {
    static const int64_t cpus = std::max<int64_t>(1, int64_t(std::thread::hardware_concurrency()));
    return cpus;
}
int64_t target_items() { return std::max<int64_t>(FA2CPU_BWD_TARGET_ITEMS, kItemsPerCpu * machine_cpus()); }
// An item streams its scratch (its packed K/V and dK/dV accumulators) once per row group, so
// every busy core holds one item's scratch: long key ranges are split further until one item's
// scratch is at most a budget / (the machine's CPU count). The CPU count is the machine's, never
// the call's thread count, so the plan (and every bit of the result) is the same for any
// num_threads on a machine. Measured on the 16-core AMX Xeon (16 threads, B=1, D=128, fp32):
// capping items at 3 MB ran H=32 N=4096 in 514 / 256 ms (full / causal) instead of 693 / 357,
// H=16 N=2048 in 73 / 40 instead of 92 / 55; bf16 unchanged within noise. Float32 products (fp32
// and fp16 inputs: four float32 rows per key) gained again at 2 MB (32 MB budget; in-process A/B,
// same machine, 16 threads: 1.044x H=32 N=4096, 1.136x H=16 N=2048), where the AMX bf16 items
// lost (0.934x H=32 N=4096 full, 0.981x H=16 N=2048; causal 1.085x), so bf16 inputs keep 48 MB
// (also on families that convert them to float32 products: not measured there). On 2
// CPUs the caps are 16 / 24 MB (items up to ~7K / ~12K keys at D = 128), which the benchmark
// shapes stay under: splitting H=16 N=2048 at 3 MB on 2 cores of that machine ran 4 % faster
// (full) but 16 % slower (causal). A family may divide by more CPUs than the machine has
// (BackwardKernel::bf16_cap_cpus): the avx512bf16 family's bf16 items are capped at 3 MB
// everywhere (backward_bf16.h says why). bench/RESULTS.md "C++ backward", "Backward item size",
// "Session 39", "Session 58".
#ifndef FA2CPU_BWD_CACHE_BUDGET_MB
#define FA2CPU_BWD_CACHE_BUDGET_MB 48
#endif
#ifndef FA2CPU_BWD_F32_BUDGET_MB
#define FA2CPU_BWD_F32_BUDGET_MB 32
#endif
int64_t item_scratch_cap(const Params& p, const BackwardKernel& K) {
    if (DType(p.dtype) == DType::bf16)
        return (int64_t(FA2CPU_BWD_CACHE_BUDGET_MB) << 20) / std::max(machine_cpus(), K.bf16_cap_cpus);
    return (int64_t(FA2CPU_BWD_F32_BUDGET_MB) << 20) / machine_cpus();
}

// A (sequence, kv head) whose dq is the sum of `count` split items' partials, in split order.
struct DqGroup {
    int32_t b, kv_head;
    size_t first;  // the splits are Plan::split_items[first, first + count)
    size_t count;
};
// Rows [r0, r1) of a group's dq (row x = gh * nq + i: query head gh of the group, position i),
// summed by one work item once the group's splits are done.
struct DqChunk {
    int32_t group;
    int64_t r0, r1;
};

struct Plan {
    std::vector<BackwardItem> items;   // longest first
    std::vector<int32_t> item_group;   // items[i]'s DqGroup, -1 for an unsplit item
    std::vector<BackwardItem> split_items;
    std::vector<DqGroup> groups;
    std::vector<DqChunk> chunks;       // in the order the groups' last splits are claimed
    int64_t part_floats = 0;
    int64_t max_keys = 0;  // keys of the longest item (sizes the per-thread scratch)
};

// Query positions [i0, i1) of a sequence (nq x nk) that see at least one key of [kb, ke).
void rows_seeing(const Params& p, int64_t nq, int64_t nk, int64_t kb, int64_t ke, int64_t* i0, int64_t* i1) {
    if (kb >= ke) { *i0 = *i1 = 0; return; }
    // row i sees [i + nk - nq - left, i + nk - nq + right]: i >= kb - (nk - nq) - right and
    // i <= ke - 1 - (nk - nq) + left (saturating: bounds may be as large as an int64 allows)
    const int64_t off = nk - nq;
    int64_t a = p.window_right < 0 ? 0 : sat_sub(sat_sub(kb, off), p.window_right);
    int64_t z = p.window_left < 0 ? nq - 1 : sat_add(sat_sub(ke - 1, off), p.window_left);
    a = std::max<int64_t>(0, std::min(a, nq));
    z = std::min(z, nq - 1);  // last row; the range is empty when z < a
    z = z < a ? a : z + 1;
    *i0 = a;
    *i1 = z;
}

Plan make_plan(const BackwardParams& bp, const BackwardKernel& K) {
    const Params& p = bp.f;
    Plan plan;
    const int64_t G = p.hq / p.hk, tile = K.kv_tile;
    const int64_t pairs = p.batch * p.hk;  // (sequence, kv head) pairs
    const int64_t want = std::min(kMaxSplits, (target_items() + pairs - 1) / pairs);
    const int64_t cap = item_scratch_cap(p, K);
    const int64_t n_fine = machine_cpus() >= FA2CPU_BWD_FINE_TAIL_CPUS && want > 1
                               ? std::min(pairs, (machine_cpus() + want - 1) / want) : 0;
    std::vector<double> cost;
    std::vector<int32_t> group_of;  // per item, before the sort
    for (int64_t b = 0; b < p.batch; ++b) {
        const int64_t nq = seq_nq(p, b), nk = seq_nk(p, b);
        if (nq == 0 && nk == 0) continue;
        const int64_t tiles = (nk + tile - 1) / tile;
        // No split when there is nothing to split or no dq to produce.
        // Else `want` splits, more while one item's scratch exceeds the cap.
        auto capped = [&] {
            int64_t n = want;
            while (n < kMaxSplits && 4 * K.scratch_floats(bp, (tiles + n - 1) / n * tile) > cap) ++n;
            return n;
        };
        const int64_t splits_all = nq == 0 ? std::max<int64_t>(1, tiles) : std::max<int64_t>(1, std::min(capped(), tiles));
        for (int64_t h = 0; h < p.hk; ++h) {
            const size_t first = plan.split_items.size();
            const bool fine = nq > 0 && splits_all == want && b * p.hk + h >= pairs - n_fine;
            const int64_t splits = fine ? std::min(std::min(2 * want, kMaxSplits), tiles) : splits_all;
            for (int64_t s = 0; s < splits; ++s) {
                BackwardItem it{int32_t(b), int32_t(h), 0, 0, 0, 0, -1};
                it.kb = std::min(nk, (tiles * s / splits) * tile);
                it.ke = std::min(nk, (tiles * (s + 1) / splits) * tile);
                rows_seeing(p, nq, nk, it.kb, it.ke, &it.i0, &it.i1);
                const int64_t rows = G * (it.i1 - it.i0);
                if (splits > 1 && nq > 0) {
                    it.part = plan.part_floats;
                    plan.part_floats += rows * p.d;
                    plan.split_items.push_back(it);
                }
                plan.max_keys = std::max(plan.max_keys, it.ke - it.kb);
                plan.items.push_back(it);
                group_of.push_back(splits > 1 && nq > 0 ? int32_t(plan.groups.size()) : -1);
                // rows x keys is the tile work; the constant is the per-item overhead (packing).
                cost.push_back(double(rows) * double(it.ke - it.kb + 64) + double(it.ke - it.kb));
            }
            if (splits > 1 && nq > 0)
                plan.groups.push_back(DqGroup{int32_t(b), int32_t(h), first, plan.split_items.size() - first});
        }
    }
    // Longest first, so the dynamic schedule ends with short items (causal work is triangular).
    std::vector<size_t> order(plan.items.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return cost[a] > cost[b]; });
    std::vector<BackwardItem> sorted;
    sorted.reserve(order.size());
    std::vector<size_t> last_claim(plan.groups.size(), 0);  // a group's last split in the sorted order
    for (size_t i : order) {
        if (group_of[i] >= 0) last_claim[size_t(group_of[i])] = sorted.size();
        sorted.push_back(plan.items[i]);
        plan.item_group.push_back(group_of[i]);
    }
    plan.items.swap(sorted);
    // The dq sums: kDqChunkRows rows a work item, after every split item, groups in the order their
    // last split is claimed (the one likely to finish first comes first).
    std::vector<size_t> gorder(plan.groups.size());
    for (size_t g = 0; g < gorder.size(); ++g) gorder[g] = g;
    std::stable_sort(gorder.begin(), gorder.end(), [&](size_t a, size_t b) { return last_claim[a] < last_claim[b]; });
    for (size_t g : gorder) {
        const int64_t rows = G * seq_nq(p, plan.groups[g].b);
        for (int64_t r = 0; r < rows; r += kDqChunkRows)
            plan.chunks.push_back(DqChunk{int32_t(g), r, std::min(rows, r + kDqChunkRows)});
    }
    return plan;
}

// dq rows [c.r0, c.r1) of one split (sequence, kv head): per row, the partials of the splits
// whose rows hold it, summed in split order from 0.
void reduce_chunk(const BackwardParams& bp, const Plan& plan, const DqChunk& c, const float* part) {
    const Params& p = bp.f;
    const DqGroup& g = plan.groups[size_t(c.group)];
    const int64_t G = p.hq / p.hk, D = p.d, nq = seq_nq(p, g.b);
    const DType dt = DType(p.dtype);
    FA2CPU_CHECK(D <= kMaxHeadDim);
    float acc[kMaxHeadDim];
    for (int64_t x = c.r0; x < c.r1; ++x) {
        const int64_t gh = x / nq, i = x % nq, h = g.kv_head * G + gh;
        for (int64_t d = 0; d < D; ++d) acc[d] = 0.f;
        for (size_t s = 0; s < g.count; ++s) {
            const BackwardItem& it = plan.split_items[g.first + s];
            if (i < it.i0 || i >= it.i1) continue;
            const float* row = part + it.part + (gh * (it.i1 - it.i0) + (i - it.i0)) * D;
            for (int64_t d = 0; d < D; ++d) acc[d] += row[d];
        }
        const int64_t at = q_row_offset(p, g.b, i, bp.dq_batch_stride, bp.dq_row_stride) + h * bp.dq_head_stride;
        for (int64_t d = 0; d < D; ++d) store_scalar(bp.dq, at + d * bp.dq_dim_stride, acc[d], dt);
    }
}

void check_backward(const BackwardParams& bp) {
    const Params& p = bp.f;
    check_params(p, "backward");
    auto fail = [](const std::string& what) { throw std::invalid_argument("fa2cpu::backward: " + what); };
    if (p.mask || p.mask_kind) fail("the backward takes no mask");
    if (p.block_table || p.seqlen_k || p.kv_dtype >= 0) fail("the backward takes no KV cache (block_table, seqlen_k, kv_dtype)");
    if ((p.cu_seqlens_q == nullptr) != (p.cu_seqlens_k == nullptr)) fail("cu_seqlens_q and cu_seqlens_k go together");
    if (p.batch > 0 && p.hq > 0 && (!p.lse || !bp.dout || !bp.dq || !bp.dk || !bp.dv))
        fail("lse, dout, dq, dk and dv must be set");
}

struct RunCtx {
    const BackwardParams* p;
    const BackwardKernel* K;
    const Plan* plan;
    float* part;
    int64_t scratch_floats;
    std::atomic<int> failed{0};
    std::unique_ptr<std::atomic<size_t>[]> splits_done;  // per DqGroup
};

// Work item i of one parallel_for: the plan's items, then its dq chunks. The pool claims items
// one at a time in order (pool.h), so every split item is claimed, and so running, before a chunk
// is; a chunk waits for its group's splits (their partial rows published by the release
// increment) instead of a second parallel_for after a barrier: the sums of the first groups fill
// the idle end of the item phase.
void run_on_thread(int64_t i, void* c) {
    RunCtx& x = *static_cast<RunCtx*>(c);
    const size_t n_items = x.plan->items.size();
    if (size_t(i) < n_items) {
        if (float* scratch = thread_scratch(x.scratch_floats))
            x.K->run_item(*x.p, x.plan->items[size_t(i)], scratch, x.part);
        else
            x.failed.store(1, std::memory_order_relaxed);  // backward() returns 1: MemoryError
        const int32_t g = x.plan->item_group[size_t(i)];
        if (g >= 0) x.splits_done[size_t(g)].fetch_add(1, std::memory_order_release);  // counted even when failed
        return;
    }
    const DqChunk& ch = x.plan->chunks[size_t(i) - n_items];
    const size_t want = x.plan->groups[size_t(ch.group)].count;
    for (int spins = 0; x.splits_done[size_t(ch.group)].load(std::memory_order_acquire) != want;) {
        if (spins < 4096) cpu_relax(), ++spins;  // (the count stops there: a split may run for hours)
        else std::this_thread::yield();  // more threads than cores: leave the core to the splits
    }
    if (!x.failed.load(std::memory_order_relaxed)) reduce_chunk(*x.p, *x.plan, ch, x.part);
}

// The calling thread's dq partials, kept for its next call up to FA2CPU_BWD_KEEP_DQ_MB (a
// training loop calls the backward with the same shapes again and again) and never cleared:
// every partial row the reduction reads is written by its split (BackwardLoop::store_dq) first.
// Fresh pages per call (faulted and zeroed by the kernel on first write) cost 3 % of a 1-thread
// fp32 backward on the 2-core Xeon (H=8 N=2048, 16 MB of partials) and 3-7 % at 16 threads on the
// AMX test machine (H=16 N=2048, H=32 N=4096: up to 256 MB); same bits (bench/RESULTS.md,
// session 37).
#ifndef FA2CPU_BWD_KEEP_DQ_MB
#define FA2CPU_BWD_KEEP_DQ_MB 256
#endif
thread_local ThreadFloats tls_dq_partials{int64_t(FA2CPU_BWD_KEEP_DQ_MB) << 20};

}  // namespace

int backward(const BackwardParams& bp) {
    check_backward(bp);
    const Params& p = bp.f;
    if (p.batch == 0 || p.hq == 0) return 0;  // nothing to compute (and hq / hk would be 0); nothing written
    const BackwardKernel& K = current_table().backward;
    const int threads = std::max(1, std::min(p.num_threads, max_useful_threads()));
    const Plan plan = make_plan(bp, K);
    if (plan.items.empty()) return 0;
    // dq partials of split kv heads (kernel.h BackwardItem::part), float32 row-major per item
    // (O(N * D) floats per split), in the calling thread's buffer, kept for its next call; 64-byte
    // aligned (alloc_large), as BackwardLoop::store_dq's streamed whole lines need.
    float* part = nullptr;
    if (plan.part_floats > 0) {
        part = tls_dq_partials.reserve(plan.part_floats);
        if (!part) return 1;
    }
    RunCtx ctx;
    ctx.p = &bp;
    ctx.K = &K;
    ctx.plan = &plan;
    ctx.part = part;
    ctx.scratch_floats = K.scratch_floats(bp, plan.max_keys);
    ctx.splits_done.reset(new std::atomic<size_t>[plan.groups.size()]);
    for (size_t g = 0; g < plan.groups.size(); ++g) ctx.splits_done[g].store(0, std::memory_order_relaxed);
    parallel_for(int64_t(plan.items.size() + plan.chunks.size()), threads, &run_on_thread, &ctx);
    tls_dq_partials.trim();
    return ctx.failed.load() ? 1 : 0;
}

}  // namespace fa2cpu
