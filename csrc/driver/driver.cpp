// The driver: checks the Params contract, plans work items, runs them on the thread pool
// (pool.h) with per-thread scratch, and merges split-KV partial results. Built with no -m flags;
// all SIMD work happens in the family's run_item through the dispatch table.
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>
#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "../dispatch/registry.h"
#include "../kernels/common/kernel.h"
#include "driver.h"
#include "pool.h"

namespace fa2cpu {

// Per-thread scratch, reused across calls (the pool keeps its threads alive).
namespace {
struct ThreadScratch {
    float* ptr = nullptr;
    int64_t floats = 0;
    ~ThreadScratch() { std::free(ptr); }
    float* get(int64_t n) {
        if (n > floats) {
            std::free(ptr);
            ptr = static_cast<float*>(std::aligned_alloc(64, size_t(round_up(n, 16)) * 4));
            floats = ptr ? n : 0;
        }
        return ptr;
    }
};
thread_local ThreadScratch tls_scratch;
}  // namespace

float* thread_scratch(int64_t floats) { return tls_scratch.get(floats); }

int64_t env_count(const char* name, int64_t fallback, int64_t max) {
    const char* s = std::getenv(name);
    if (!s || !*s) return fallback;
    char* end = nullptr;
    const long long v = std::strtoll(s, &end, 10);
    return end && *end == 0 && v >= 0 ? std::min<int64_t>(v, max) : fallback;
}

float* alloc_large(size_t bytes) {
    constexpr size_t kHuge = size_t(2) << 20;
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (bytes >= 4 * kHuge) {
        const size_t size = (bytes + kHuge - 1) / kHuge * kHuge;
        void* p = std::aligned_alloc(kHuge, size);
        if (p) madvise(p, size, MADV_HUGEPAGE);  // advice only: a refusal leaves 4 KB pages
        return static_cast<float*>(p);
    }
#endif
    return static_cast<float*>(std::aligned_alloc(64, (bytes + 63) / 64 * 64));
}

ThreadFloats::~ThreadFloats() { std::free(data); }
float* ThreadFloats::reserve(int64_t n) {
    if (n <= floats) return data;
    std::free(data);
    data = alloc_large(size_t(round_up(n, 16)) * 4);
    floats = data ? n : 0;
    return data;
}
void ThreadFloats::trim() {
    if (floats * 4 > keep_bytes) { std::free(data); data = nullptr; floats = 0; }
}

void check_params(const Params& p, const char* entry) {
    auto fail = [entry](const std::string& what) { throw std::invalid_argument(std::string("fa2cpu::") + entry + ": " + what); };
    if (p.dtype < 0 || p.dtype >= int(DType::count) || is_code_dtype(DType(p.dtype)))
        fail("dtype must be a float type code (float32, float16 or bfloat16)");
    if (p.kv_dtype < -1 || p.kv_dtype >= int(DType::count)) fail("kv_dtype code out of range");
    if (p.kv_dtype >= 0 && p.kv_dtype != p.dtype && !is_code_dtype(DType(p.kv_dtype)))
        fail("kv_dtype must be -1, dtype, or a quantized cache's code type (int8, float8_e4m3fn)");
    if ((p.k_scale || p.v_scale) && !is_code_dtype(kv_dtype(p))) fail("k_scale / v_scale need a quantized cache");
    if (kv_dtype(p) == DType::i8 && (!p.k_scale || !p.v_scale)) fail("an int8 cache needs k_scale and v_scale");
    if (p.batch < 0 || p.hq < 0 || p.nq < 0 || p.nk < 0) fail("batch, hq, nq and nk must be >= 0");
    if (p.hk < 1) fail("hk must be >= 1");
    if (p.hq % p.hk) fail("hq must be a multiple of hk");
    if (p.d < 1 || p.d > kMaxHeadDim || p.dv < 1 || p.dv > kMaxHeadDim)
        fail("head dims d and dv must be in 1.." + std::to_string(kMaxHeadDim));
    if (p.window_left < -1 || p.window_right < -1) fail("window bounds must be >= -1");
    if (p.num_splits < 0) fail("num_splits must be >= 0");
    if (p.mask_kind < 0 || p.mask_kind > 2 || (p.mask_kind != 0) != (p.mask != nullptr))
        fail("mask_kind must be 0 without a mask, 1 or 2 with one");
    if (p.block_table && p.block_size < 1) fail("block_size must be >= 1 with a block table");
    if (!(p.scale == p.scale) || std::isinf(p.scale)) fail("scale must be finite");
    if (!(p.softcap >= 0.f) || std::isinf(p.softcap)) fail("softcap must be finite and >= 0");
    if (p.batch > 0 && p.hq > 0 && (!p.q || !p.k || !p.v || !p.out)) fail("q, k, v and out must be set");
}

namespace {

// Split-KV policy (flash-decoding): with `num_splits = 0`, split the key axis only when the base
// items cannot give every thread kMinItemsPerThread items, and never into pieces shorter than
// kMinKeysPerSplit keys (a split costs a partial write + merge of its rows and an item's start).
// Items that span several kv heads (decode of an interleaved cache) read kv_heads times the bytes
// per key: their minimum is kMinSplitBytes of K/V instead, when that is fewer keys (128 KB is one
// bf16 kv head's 256 keys at D = 128). Without it, B=1 with 4 kv heads of 2048 keys (one item for
// all heads) got 4 items on 16 threads and ran at the speed of 4 cores (bench/RESULTS.md, issue
// 9). 128 KB rather than 256: with the merge tree, 32 splits of that decode beat 16 by 1.21x at 16
// threads on the AMX machine (hot; in the model within its spread). (Only such items' pieces
// halve: 2048 keys keep 16 splits on 8 threads.) Single-head items keep the key minimum: only
// the multi-head case was measured to gain.
// From kManyThreads threads on, those multi-head items aim at kSpanItemsPerThread per thread:
// with 2, a slow core holding one of a thread's 2 items set the call's time. On the AMX test
// machine, B=16 Hq=32 Hk=8 Nk=8192 D=128 bf16 q (bench/RESULTS.md session 43): 8 splits (8 items
// a thread) instead of 2 ran the bf16 cache 1.32-1.39x and the int8 one 1.22-1.27x as fast at 16
// threads, 4 splits instead of none 1.16 / 1.21x at 8 threads; B=64 Nk=2048 at 16 threads, 2
// splits instead of none 1.08 / 1.17x. On 2 threads (2-core Zen 1) more splits cost 2-7 % (B=1,
// 2, 4), so fewer threads keep 2 a thread (3 to 7 threads were not measured). Those extra splits
// keep kSpanMinKeys keys each (the sweep's splits held 256 to 1024 keys; B=64 Nk=2048 ran 8 splits
// of 256 keys slower than 4), so B=1 keeps its 32 splits of the rule above.
constexpr int64_t kMinItemsPerThread = 2;
constexpr int64_t kSpanItemsPerThread = 8;
constexpr int kManyThreads = 8;
constexpr int64_t kSpanMinKeys = 256;
constexpr int64_t kMinKeysPerSplit = 512;
constexpr int64_t kMinSplitBytes = int64_t(128) << 10;
// Split boundaries fall on multiples of kSplitKeys keys, or of the route's K/V tile when the call
// shares tiles (a slot holds one whole natural tile). Not the tile always: the decode route's
// 256-key tiles let 2048 keys of an interleaved 4-head cache (16 items wanted by the byte rule)
// make only 8 items, half of 16 threads idle (bench/RESULTS.md, issue 9).
constexpr int64_t kSplitKeys = 64;
// The split items' partial rows (each split's O rows and LSE, float32) of a call stay within this
// many bytes, shared evenly by its unsplit items: an explicit num_splits on a long chunked prefill
// (N = 32768, 512 splits) asked 2 GB of partials, O(Nq x splits) against API.md / DESIGN.md's
// O(N x D). The automatic rule splits decode-sized items, far below it.
constexpr int64_t kMaxPartBytes = int64_t(64) << 20;
// Shared K/V tiles (kernel.h SharedTiles) are used when they fit in this many bytes; the buffer
// is kept for the calling thread's next call up to 64 MB (driver.h ThreadFloats).
constexpr int64_t kSharedTilesBudgetBytes = int64_t(512) << 20;

struct MergeGroup {
    WorkItem base;   // rows of the group (kb/ke unused)
    int64_t part0;   // partial rows of split s start at part0 + s*rows
    int64_t splits;
};

struct Plan {
    std::vector<WorkItem> items;
    std::vector<double> cost;
    std::vector<int64_t> group;  // per item: its merge group, or -1 (an unsplit item)
    std::vector<MergeGroup> merges;
    int64_t part_rows = 0;
    int64_t route_rows[kMaxRoutes] = {};  // most rows of an item per route (sizes the scratch)
    int shared_route = -1;                // every item's route when K/V tiles are shared, else -1
    int64_t shared_floats[2] = {0, 0};    // per slot of K / V
    int64_t tiles_per_seq = 0;
};

// Whether packing K/V once per (sequence, kv head) pays: one route for all sequences (one tile
// size), an operand it packs, tiles that start at multiples of the tile (no left window bound),
// more than one item per kv head, and the slots within budget. FA2CPU_SHARED_TILES=0 turns it off
// (read per call, for in-process A/B measurements: bench/vs_torch.py --ab-env).
void plan_shared_tiles(const Params& p, const KernelTable& T, const std::vector<int>& seq_route, int64_t items_per_head,
                       Plan& plan) {
    if (p.window_left >= 0 || items_per_head < 2 || seq_route.empty()) return;
    const char* off = std::getenv("FA2CPU_SHARED_TILES");
    if (off && off[0] == '0') return;
    for (int r : seq_route)
        if (r != seq_route[0]) return;
    const Route& R = T.routes[seq_route[0]];
    int64_t nk_max = 0;
    for (int64_t b = 0; b < p.batch; ++b) nk_max = std::max(nk_max, seq_nk(p, b));
    const int64_t tiles = (nk_max + R.kv_tile - 1) / R.kv_tile;
    const int64_t fk = R.shared_tile_floats(p, 0), fv = R.shared_tile_floats(p, 1);
    const double bytes = double(p.batch) * double(p.hk) * double(tiles) * double(fk + fv) * 4.0;
    if (fk + fv == 0 || tiles == 0 || bytes > double(kSharedTilesBudgetBytes)) return;
    plan.shared_route = seq_route[0];
    plan.shared_floats[0] = fk;
    plan.shared_floats[1] = fv;
    plan.tiles_per_seq = tiles;
}

// The first of the family's routes that serves a sequence with `rows_per_kv_head` rows per kv head.
int pick_route(const Params& p, const KernelTable& T, int64_t rows_per_kv_head) {
    for (int r = 0; r < T.num_routes; ++r)
        if (T.routes[r].serves(p, rows_per_kv_head)) return r;
    return T.num_routes - 1;  // the last route serves everything (make_table's contract)
}

// Work items: per sequence, the route that serves it decides the item shape (rows, kv heads
// spanned) and the key tile; items are then split along the key axis (flash-decoding) when there
// are too few for the threads, every kSplitKeys keys (whole tiles when tiles are shared).
Plan make_plan(const Params& p, const KernelTable& T, int threads) {
    Plan plan;
    const int64_t G = p.hq / p.hk;
    struct Base { WorkItem it; int64_t kb, ke; double cost; int64_t chunk; };
    std::vector<Base> bases;
    std::vector<int> seq_route;
    int64_t items_per_head = 0, chunk = 0;
    auto add = [&](WorkItem it, int64_t nq, int64_t nk) {
        int64_t lo0, hi0, lo1, hi1;
        visible_range(p, nq, nk, it.i0, &lo0, &hi0);
        visible_range(p, nq, nk, it.i1 - 1, &lo1, &hi1);
        const int64_t kb = std::min(lo0, lo1), ke = std::max(hi0, hi1) + 1;
        const double rows = double((it.g1 - it.g0) * (it.i1 - it.i0));
        bases.push_back({it, kb, ke, rows * double(std::max<int64_t>(0, ke - kb) + 64), chunk});
    };
    for (int64_t b = 0; b < p.batch; ++b) {
        const int64_t nq = seq_nq(p, b), nk = seq_nk(p, b);
        if (nq <= 0) continue;
        const int route = pick_route(p, T, G * nq);
        const Route& R = T.routes[route];
        seq_route.push_back(route);
        const int64_t span = std::min<int64_t>(p.hk, std::max<int64_t>(1, R.kv_heads_per_item(p, G * nq)));
        if (span > 1) {  // all rows of `span` kv heads per item
            for (int64_t h = 0; h < p.hk; h += span) {
                const int64_t n = std::min(span, p.hk - h);
                add(WorkItem{int32_t(b), int32_t(h), 0, int32_t(n * G), 0, nq, 0, nk, -1, int32_t(n), route}, nq, nk);
            }
            continue;
        }
        // Rows per item: all heads of the GQA group together (K/V tiles packed once for all of
        // them), as many query positions as fit in max_rows, chunks balanced so none is a sliver.
        const int64_t gh = std::min<int64_t>(G, R.max_rows);
        const int64_t want = std::max<int64_t>(1, R.max_rows / gh);
        const int64_t chunks = (nq + want - 1) / want;
        const int64_t nqi = (nq + chunks - 1) / chunks;
        items_per_head = std::max(items_per_head, chunks * ((G + gh - 1) / gh));
        for (int64_t h = 0; h < p.hk; ++h) {
            chunk = 0;
            for (int64_t g0 = 0; g0 < G; g0 += gh)
                for (int64_t i0 = 0; i0 < nq; i0 += nqi, ++chunk) {
                    const int64_t g1 = std::min(G, g0 + gh), i1 = std::min(nq, i0 + nqi);
                    add(WorkItem{int32_t(b), int32_t(h), int32_t(g0), int32_t(g1), i0, i1, 0, nk, -1, 1, route}, nq, nk);
                }
        }
    }
    plan_shared_tiles(p, T, seq_route, items_per_head, plan);
    // With shared tiles, heads are taken `threads` (>= 1) at a time and, within such a group, the
    // first items of every head come first (chunk-major order, kept by the stable cost sort below):
    // concurrent threads then pack different heads' tiles, and later items find them ready, rather
    // than all threads racing for the same head's first tile; while a group runs, only its heads'
    // K/V are in use (one thread: a head's items back to back, as without shared tiles).
    if (plan.shared_route >= 0) {
        auto key = [&](const Base& x) { return std::make_pair((int64_t(x.it.b) * p.hk + x.it.kv_head) / threads, x.chunk); };
        std::stable_sort(bases.begin(), bases.end(), [&](const Base& x, const Base& y) { return key(x) < key(y); });
    }
    const int64_t nbase = int64_t(bases.size());
    for (const Base& bs : bases) {
        const int64_t rows = (bs.it.g1 - bs.it.g0) * (bs.it.i1 - bs.it.i0);
        const int64_t unit = plan.shared_route >= 0 ? T.routes[bs.it.route].kv_tile
                                                    : std::min<int64_t>(T.routes[bs.it.route].kv_tile, kSplitKeys);
        int64_t& route_rows = plan.route_rows[bs.it.route];
        route_rows = std::max(route_rows, rows);
        const int64_t span = bs.ke - bs.kb;
        int64_t splits = p.num_splits;
        if (splits == 0) {
            // Splits that give every thread `per_thread` items, none shorter than min_keys.
            auto rule = [&](int64_t per_thread, int64_t min_keys) {
                const int64_t want = (int64_t(threads) * per_thread + nbase - 1) / std::max<int64_t>(nbase, 1);
                return std::min(want, span / min_keys);
            };
            const int64_t key_bytes = int64_t(bs.it.kv_heads) * (p.d + p.dv) * int64_t(dtype_size(kv_dtype(p)));
            const int64_t min_keys =
                bs.it.kv_heads > 1 ? std::clamp<int64_t>(kMinSplitBytes / std::max<int64_t>(key_bytes, 1), 1, kMinKeysPerSplit)
                                   : kMinKeysPerSplit;
            splits = rule(kMinItemsPerThread, min_keys);
            if (bs.it.kv_heads > 1 && threads >= kManyThreads) splits = std::max(splits, rule(kSpanItemsPerThread, kSpanMinKeys));
        }
        // Each split holds at least one unit and starts a whole number of units after the first key.
        const int64_t units = (span + unit - 1) / unit;
        const int64_t part_cap = kMaxPartBytes / (int64_t(sizeof(float)) * (p.dv + 1) * std::max<int64_t>(rows, 1) * nbase);
        splits = std::max<int64_t>(1, std::min({splits, units, part_cap}));
        if (splits == 1) {
            plan.items.push_back(bs.it);
            plan.cost.push_back(bs.cost);
            plan.group.push_back(-1);
            continue;
        }
        MergeGroup mg{bs.it, plan.part_rows, splits};
        for (int64_t s = 0; s < splits; ++s) {
            WorkItem it = bs.it;
            it.kb = bs.kb + (units * s / splits) * unit;
            it.ke = std::min(bs.ke, bs.kb + (units * (s + 1) / splits) * unit);
            it.part = plan.part_rows + s * rows;
            plan.items.push_back(it);
            plan.cost.push_back(bs.cost / double(splits));
            plan.group.push_back(int64_t(plan.merges.size()));
        }
        plan.part_rows += splits * rows;
        plan.merges.push_back(mg);
    }
    // Longest first, so the dynamic schedule ends with short items (causal work is triangular),
    // but by cost bands (a quarter of the longest item's cost each), keeping the build order
    // above within a band: a head's items then run back to back and find its K/V tiles still in
    // the caches. Sorted by exact cost, a causal call took the heads in turns (item t of every
    // head, then t - 1, ...), streaming each head's K/V again from memory for every item: 2-core
    // Zen 3, fp32 H=16 N=2048 causal, 1.04-1.20x faster by bands (1 and 2 threads); AMX test
    // machine 1.04x at 1 thread, unchanged at 16 (bench/RESULTS.md, session 31). The last item
    // dealt out costs at most a quarter of the longest.
    constexpr int kCostBands = 4;
    double longest = 0;
    for (double c : plan.cost) longest = std::max(longest, c);
    std::vector<int> band(plan.cost.size(), 0);
    if (longest > 0)
        for (size_t i = 0; i < band.size(); ++i) band[i] = std::min(kCostBands - 1, int(plan.cost[i] / longest * kCostBands));
    std::vector<size_t> order(plan.items.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return band[a] > band[b]; });
    std::vector<WorkItem> sorted;
    std::vector<int64_t> group;
    sorted.reserve(order.size());
    group.reserve(order.size());
    for (size_t i : order) {
        sorted.push_back(plan.items[i]);
        group.push_back(plan.group[i]);
    }
    plan.items.swap(sorted);
    plan.group.swap(group);
    return plan;
}

// Split-KV merge: a binary tree over each group's splits, joined by the threads that finish them.
// Node (l, k) of level l >= 1 joins nodes (l-1, 2k) and (l-1, 2k+1) of the level below (level
// 0: the splits; a missing right child passes the left one up); its result, rows normalised
// over its keys plus their log2-sum-exp, lives in the partial rows of its first split, k * 2^l.
// Each node counts its children down; the thread that completes a node's last child joins the
// node and climbs on, so the joins run in parallel on the threads that finish splits, with no
// waiting and no second parallel region, and the root's join writes the output rows (with the
// sink). Which thread joins a node never changes what it computes: the same bits for one plan.
// Why a tree: the thread that ran a group's last split used to merge all of it alone, reading
// every split's partial rows from the cores that wrote them: at 16 threads a 16-split decode
// spent as long in that merge as in its splits (bench/RESULTS.md, issue 9).
int64_t level_nodes(int64_t splits, int l) { return ((splits - 1) >> l) + 1; }  // ceil(splits / 2^l)

// Weights of two normalised partial rows with log2-sum-exps la, lb in their union:
// o = fa * o_a + fb * o_b, log2-sum-exp lse. A NaN in makes NaN out (`x > m` alone would drop it);
// no keys on either side (both -inf): o = 0, lse = -inf.
struct JoinWeights {
    float fa, fb, lse;
};
JoinWeights join_weights(float la, float lb) {
    if (std::isnan(la) || std::isnan(lb)) return {NAN, NAN, NAN};
    const float m = std::max(la, lb);
    if (m == -INFINITY) return {0.f, 0.f, -INFINITY};
    // exp2(x - m), exactly 1 at the maximum (also when it is +inf)
    const float wa = la == m ? 1.f : std::exp2(la - m), wb = lb == m ? 1.f : std::exp2(lb - m);
    const float t = wa + wb;
    return {wa / t, wb / t, m + std::log2(t)};
}

// dst[j] = fa * a[j] + fb * b[j]; an operand of weight 0 is not read, so the rows of a split that
// saw no key never matter.
void join_row(float* dst, const float* a, float fa, const float* b, float fb, int64_t n) {
    if (fa == 0.f && fb == 0.f) {
        for (int64_t j = 0; j < n; ++j) dst[j] = 0.f;
    } else if (fb == 0.f) {
        for (int64_t j = 0; j < n; ++j) dst[j] = fa * a[j];
    } else if (fa == 0.f) {
        for (int64_t j = 0; j < n; ++j) dst[j] = fb * b[j];
    } else {
        for (int64_t j = 0; j < n; ++j) dst[j] = fa * a[j] + fb * b[j];
    }
}

// Rows of a merge group (of each of its splits' partials).
int64_t group_rows(const MergeGroup& mg) { return (mg.base.g1 - mg.base.g0) * (mg.base.i1 - mg.base.i0); }

// Join the results held by splits `left` and `right` of a group: into left's partial rows, or, at
// the root, into the output rows with the sink (one more logit with no value).
void join_node(const Params& p, const MergeGroup& mg, Partials parts, int64_t left, int64_t right, bool root) {
    const WorkItem& it = mg.base;
    const int64_t G = p.hq / p.hk, Dv = p.dv, nqi = it.i1 - it.i0, rows = group_rows(mg);
    FA2CPU_CHECK(Dv <= kMaxHeadDim);  // check_params
    const int64_t a0 = mg.part0 + left * rows, b0 = mg.part0 + right * rows;
    alignas(64) float buf[kMaxHeadDim];
    for (int64_t r = 0; r < rows; ++r) {
        const float* a = parts.o + (a0 + r) * Dv;
        const float* b = parts.o + (b0 + r) * Dv;
        JoinWeights w = join_weights(parts.lse[a0 + r], parts.lse[b0 + r]);
        if (!root) {
            join_row(parts.o + (a0 + r) * Dv, a, w.fa, b, w.fb, Dv);
            parts.lse[a0 + r] = w.lse;
            continue;
        }
        const int64_t h = it.kv_head * G + it.g0 + r / nqi, i = it.i0 + r % nqi;
        if (p.sinks) {  // the sink's -inf (none) leaves the row as it is
            const JoinWeights s = join_weights(w.lse, p.sinks[h] * kLog2e);
            w = {w.fa * s.fa, w.fb * s.fa, s.lse};
        }
        join_row(buf, a, w.fa, b, w.fb, Dv);
        const int64_t out_at = q_row_offset(p, it.b, i, p.out_batch_stride, p.out_row_stride) + h * p.out_head_stride;
        store_row(p.out, out_at, p.out_dim_stride, buf, Dv, DType(p.dtype));
        if (p.lse) p.lse[q_row_offset(p, it.b, i, p.lse_batch_stride, p.lse_row_stride) + h * p.lse_head_stride] = w.lse * kLn2;
    }
}


// forward's contract (check_params, driver.h).
void check_forward(const Params& p) { check_params(p, "forward"); }

struct RunCtx {
    const Params* p;
    const KernelTable* T;
    const Plan* plan;
    Partials parts;
    SharedTiles* shared;
    int64_t scratch_floats;
    std::atomic<int> failed{0};
    // The merge trees' nodes (levels >= 1), per group from node_base[g], level by level: each
    // counts its children not yet complete.
    std::unique_ptr<std::atomic<int>[]> nodes;
    std::vector<int64_t> node_base;
};

// The calling thread's shared K/V tiles and their slots.
struct SharedTileMemory {
    ThreadFloats mem;
    std::vector<SharedSlot> slots[2];
};
thread_local SharedTileMemory tls_shared;

// The calling thread's split-KV partials (output rows, then LSEs), never cleared: every partial
// row is written by its split before the merge reads it. (A fresh, zero-filled vector per call
// was a serial memset on the caller before the items started: 128 KB for a 16-split decode of 16
// rows at Dv = 128.)
thread_local ThreadFloats tls_partials;

void run_item_on_thread(int64_t i, void* c) {
    RunCtx& x = *static_cast<RunCtx*>(c);
    float* scratch = thread_scratch(x.scratch_floats);
    if (!scratch) {
        x.failed.store(1, std::memory_order_relaxed);
        return;
    }
    const WorkItem& it = x.plan->items[size_t(i)];
    x.T->routes[it.route].run_item(*x.p, it, ItemContext{scratch, x.parts, x.shared});
    const int64_t g = x.plan->group[size_t(i)];
    if (g < 0) return;
    // Climb the group's merge tree from this split while this thread completes nodes. acq_rel:
    // the thread that completes a node sees both children's partial rows.
    const MergeGroup& mg = x.plan->merges[size_t(g)];
    const int64_t s = (it.part - mg.part0) / group_rows(mg);
    std::atomic<int>* level = x.nodes.get() + x.node_base[size_t(g)];
    for (int l = 1;; ++l) {
        const int64_t n = level_nodes(mg.splits, l), k = s >> l;
        if (level[k].fetch_sub(1, std::memory_order_acq_rel) != 1) return;  // the other child is running
        const int64_t left = k << l, right = left + (int64_t(1) << (l - 1));
        if (n == 1) {  // the root: the level below had two nodes or more, so both children exist
            join_node(*x.p, mg, x.parts, left, right, true);
            return;
        }
        if (right < mg.splits) join_node(*x.p, mg, x.parts, left, right, false);  // else: passed up
        level += n;
    }
}

}  // namespace

int forward(const Params& p) {
    check_forward(p);
    if (p.batch == 0 || p.hq == 0) return 0;  // nothing to compute (and hq / hk would be 0)
    const KernelTable& T = current_table();
    // More threads than CPUs never helps and thousands cannot be created: capped, never fatal.
    const int threads = std::max(1, std::min(p.num_threads, max_useful_threads()));
    Plan plan = make_plan(p, T, threads);
    if (plan.items.empty()) return 0;
    float* parts = plan.part_rows > 0 ? tls_partials.reserve(plan.part_rows * (p.dv + 1)) : nullptr;
    if (plan.part_rows > 0 && !parts) return 1;
    RunCtx ctx;
    ctx.p = &p;
    ctx.T = &T;
    ctx.plan = &plan;
    ctx.parts = Partials{parts, parts ? parts + plan.part_rows * p.dv : nullptr};
    ctx.shared = nullptr;
    SharedTiles shared{};
    if (plan.shared_route >= 0) {
        const int64_t slots = p.batch * p.hk * plan.tiles_per_seq;
        if (float* mem = tls_shared.mem.reserve(slots * (plan.shared_floats[0] + plan.shared_floats[1]))) {
            for (int w = 0; w < 2; ++w) {
                std::vector<SharedSlot> fresh(size_t(plan.shared_floats[w] ? slots : 0));
                for (SharedSlot& s : fresh) s.state.store(0, std::memory_order_relaxed);
                tls_shared.slots[w].swap(fresh);
                shared.slots[w] = tls_shared.slots[w].data();
                shared.floats[w] = plan.shared_floats[w];
            }
            shared.data[0] = mem;
            shared.data[1] = mem + slots * plan.shared_floats[0];
            shared.tiles_per_seq = plan.tiles_per_seq;
            ctx.shared = &shared;
        }
    }
    ctx.scratch_floats = 0;
    for (int r = 0; r < T.num_routes; ++r)
        if (plan.route_rows[r] > 0)
            ctx.scratch_floats = std::max(ctx.scratch_floats, T.routes[r].scratch_floats(p, plan.route_rows[r]));
    int64_t nodes = 0;
    for (const MergeGroup& mg : plan.merges) {
        ctx.node_base.push_back(nodes);
        for (int l = 1; level_nodes(mg.splits, l - 1) > 1; ++l) nodes += level_nodes(mg.splits, l);
    }
    ctx.nodes.reset(new std::atomic<int>[size_t(nodes)]);
    for (size_t g = 0; g < plan.merges.size(); ++g) {
        std::atomic<int>* level = ctx.nodes.get() + ctx.node_base[g];
        const int64_t splits = plan.merges[g].splits;
        for (int l = 1; level_nodes(splits, l - 1) > 1; ++l) {
            const int64_t below = level_nodes(splits, l - 1), n = level_nodes(splits, l);
            for (int64_t k = 0; k < n; ++k) level[k].store(int(std::min<int64_t>(2, below - 2 * k)), std::memory_order_relaxed);
            level += n;
        }
    }
    parallel_for(int64_t(plan.items.size()), threads, &run_item_on_thread, &ctx);
    tls_shared.mem.trim();
    tls_partials.trim();
    return ctx.failed.load() ? 1 : 0;
}

double peak_gflops(int isa, int dtype, int threads, double seconds) {
    const KernelTable* T = family_table(isa);
    if (!T) return 0.0;
    double total = 0.0;
#pragma omp parallel num_threads(std::max(1, threads)) reduction(+ : total)
    total += T->peak_one_thread(dtype, seconds);
    return total;
}

// The read bandwidth the kernels can meet: a buffer like the arrays they read (NumPy puts arrays
// of 4 MB and more on 2 MB pages where the kernel allows it; alloc_large does the same), each
// thread summing its own contiguous share as 64-bit integers in four independent sums, which the
// compiler vectorizes with the baseline's 16-byte loads. The first form (a std::vector of 4 KB
// pages, one float64 sum) read 8.5-11.3 / 16.7-18.8 GB/s at 1 / 2 threads on the 2-core Xeon
// with AMX, where this reads 16.9-18.1 / 33.6-36.5 and the decode kernels streamed 13.5 GB/s on
// one core: "% of the read bandwidth" above 100 (bench/RESULTS.md, session 50). A loop of
// 64-byte loads read less there (16.0 / 30.6 GB/s against 18.2 / 36.0 for 16-byte ones).
double read_bandwidth_gbs(int threads, int64_t nbytes) {
    const int64_t n = std::max<int64_t>(nbytes / 8, 1024) / 32 * 32;
    uint64_t* buf = reinterpret_cast<uint64_t*>(alloc_large(size_t(n) * 8));
    if (!buf) throw std::bad_alloc();  // MemoryError in Python, as the std::vector before gave
    const int nt = std::max(1, threads);
    const int64_t share = n / nt / 32 * 32;  // the last thread also reads the rest
    auto first = [&](int t) { return t * share; };
    auto last = [&](int t) { return t == nt - 1 ? n : (t + 1) * share; };
#pragma omp parallel num_threads(nt)
    {
        const int t = omp_get_thread_num();
        for (int64_t i = first(t); i < last(t); ++i) buf[i] = uint64_t(i & 7);  // first touch by the reader
    }
    double best = 0.0;
    uint64_t sink = 0;
    for (int rep = 0; rep < 5; ++rep) {
        const auto t0 = std::chrono::steady_clock::now();
        uint64_t total = 0;
#pragma omp parallel num_threads(nt) reduction(+ : total)
        {
            const int t = omp_get_thread_num();
            uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
            for (int64_t i = first(t), end = last(t); i < end; i += 4) {
                s0 += buf[i];
                s1 += buf[i + 1];
                s2 += buf[i + 2];
                s3 += buf[i + 3];
            }
            total += (s0 + s1) + (s2 + s3);
        }
        const double el = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        sink += total;
        best = std::max(best, double(n) * 8.0 / el * 1e-9);
    }
    std::free(buf);
    volatile uint64_t keep = sink;
    (void)keep;
    return best;
}

}  // namespace fa2cpu
