// Internal contract between the driver (csrc/driver) and the per-ISA kernel files (csrc/kernels).
// Everything here is in an anonymous namespace or is a plain struct: this header is compiled with
// different -m flags in different translation units, and inline functions with external linkage
// could be merged by the linker across them (an AVX-512 copy running on an AVX2 machine).
#pragma once
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "fa2cpu/fa2cpu.h"

namespace fa2cpu {

// One unit of parallel work: query rows of sequence b against its key positions [kb, ke).
// The rows are heads kv_head*G + [g0, g1) x query positions [i0, i1): row r is head
// kv_head*G + g0 + r/(i1-i0), query i0 + r%(i1-i0). Usually g1 <= G (one kv head); a route whose
// kv_heads_per_item > 1 gets items spanning kv heads (g0 = 0, g1 = kv_heads*G).
struct WorkItem {
    int32_t b, kv_head, g0, g1;
    int64_t i0, i1;
    int64_t kb, ke;
    int64_t part;          // -1: write the final output; else row offset into the split-KV partials
    int32_t kv_heads = 1;  // kv heads the rows span
    int32_t route = 0;     // index into the family's routes (chosen once per sequence by the planner)
};

// Partial results of split-KV items: o[(part + r)*dv + j] is row r's output normalised over the
// split's keys, lse[part + r] its log2-sum-exp (-inf when the split saw no key).
struct Partials {
    float* o;
    float* lse;
};

// A K or V tile as a GEMM policy's micro-kernels read it: key c of kv head (first + h) at
// data + c*ld + h*head_stride (elements); prefetch: distance (elements) to the same row of the
// next tile's keys, 0 for none.
// Quantized caches (Params::kv_dtype): scale of key c of kv head (first + h) at
// scale[c*scale_ld + h*scale_head_stride]; scale == nullptr: every scale is 1. Set by the tile loop
// for policies that read codes (gemm_decode.h); others get dequantized float tiles.
struct KvTile {
    const void* data;
    int64_t ld, head_stride, prefetch;
    // (decode policies, decode_operands.h) the near prefetch's distance in elements; in a paged
    // cache the rows prefetched lie in a later block for the tile's keys from far_switch /
    // near_switch on, which then take prefetch2 / prefetch_near2 instead (far_at / near_at: the
    // distances of the key block starting at key c of the tile)
    int64_t prefetch_near = 0;
    int64_t far_switch = INT64_MAX, near_switch = INT64_MAX, prefetch2 = 0, prefetch_near2 = 0;
    int64_t far_at(int64_t c) const { return c < far_switch ? prefetch : prefetch2; }
    int64_t near_at(int64_t c) const { return c < near_switch ? prefetch_near : prefetch_near2; }
    const float* scale = nullptr;
    int64_t scale_ld = 0, scale_head_stride = 0;
    bool panels = false;  // V in the policy's v_panels layout (gemm_f32.h), not rows
};

// K/V tiles packed once per (sequence, kv head) and shared by every item of that head (the driver
// owns the memory). Slot (b, h, t) of operand w (0 K, 1 V) holds tile t, keys [t*tile, ...), in the
// policy's packed layout; its state goes 0 (empty) -> 1 (being packed) -> 2 (ready) once. The
// tile loop uses a slot only for a whole natural tile (tile_loop.h); an item that finds a slot
// being packed waits briefly, then packs its own copy: nothing ever blocks on another thread.
struct SharedSlot {
    std::atomic<int> state;
    KvTile tile;
};
struct SharedTiles {
    SharedSlot* slots[2];   // [batch][hk][tiles_per_seq] per operand
    float* data[2];         // slot i's buffer at data[w] + i*floats[w]
    int64_t floats[2];      // floats per slot; 0: that operand is read in place, not shared
    int64_t tiles_per_seq;
};

// What run_item gets besides the item: per-thread scratch, the split-KV partials, shared tiles
// (nullptr when the call shares none).
struct ItemContext {
    float* scratch;
    Partials parts;
    SharedTiles* shared;
};

// One way a family computes items (a loop + GEMM policy); kernels/common/routes.h derives these
// fields from the route's compile-time traits.
struct Route {
    const char* name;
    // Serves sequences whose items hold `rows_per_kv_head` rows per kv head (query heads of a
    // GQA group x query positions) for p's dtype and layouts? A family's first serving route wins.
    bool (*serves)(const Params& p, int64_t rows_per_kv_head);
    // kv heads one item may span (1 for most routes): all G*nq rows of that many kv heads.
    int64_t (*kv_heads_per_item)(const Params& p, int64_t rows_per_kv_head);
    int64_t max_rows;  // rows of one item (heads x queries); sizes the Q/O scratch
    int64_t kv_tile;   // keys per K/V tile (split-KV boundaries fall on multiples of it when tiles are shared)
    int64_t (*scratch_floats)(const Params& p, int64_t rows);  // per-thread scratch, <= rows rows
    // Floats of one shared K (which = 0) / V (1) tile slot; 0 when the route reads it in place.
    int64_t (*shared_tile_floats)(const Params& p, int which);
    void (*run_item)(const Params& p, const WorkItem& it, const ItemContext& ctx);
};

// One unit of backward work (csrc/driver/backward.cpp, kernels/common/backward_loop.h): keys
// [kb, ke) of kv head kv_head of sequence b against the rows that can see one of them: every
// query head of the GQA group x query positions [i0, i1). Row r is head kv_head*G + r/(i1-i0),
// query i0 + r%(i1-i0). The item writes dk/dv of its keys (its keys belong to no other item).
// dq: part < 0: the item sees every key of the sequence and writes dq of all G x nq rows of its
// kv head (zeros outside [i0, i1)); else it writes its float32 dq contribution, row-major
// [r][d] (d < D), at dq_part + part, for the driver's fixed-order reduction.
struct BackwardItem {
    int32_t b, kv_head;
    int64_t i0, i1;
    int64_t kb, ke;
    int64_t part;
};
// A family's backward (kernels/common/routes.h derives it from a BackwardLoop).
struct BackwardKernel {
    int64_t kv_tile;  // keys per K/V tile: the driver's key splits fall on multiples of it
    int64_t (*scratch_floats)(const BackwardParams& p, int64_t keys);  // per-thread scratch, items of <= keys keys
    void (*run_item)(const BackwardParams& p, const BackwardItem& it, float* scratch, float* dq_part);
    // The driver caps an item's bf16 scratch at its budget / max(the machine's CPUs, this)
    // (backward.cpp item_scratch_cap): 1 unless the family measured smaller items faster.
    int64_t bf16_cap_cpus;
};

// One row of the dispatch table (one per compiled family of catalogue.def).
constexpr int kMaxRoutes = 4;
struct KernelTable {
    Route routes[kMaxRoutes];
    int num_routes;
    // One thread's peak of the family's main multiply-add instruction for dtype (DType code),
    // GFLOP/s, measured for about `seconds`.
    double (*peak_one_thread)(int dtype, double seconds);
    BackwardKernel backward;
};

namespace {

// Scores live in the log2 domain inside the kernels (exp2 softmax); LSE goes out in natural log.
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Aborts with a message: for sizes the scratch layout relies on, which check_params (driver.cpp)
// guarantees; reaching one means a caller bypassed it.
#define FA2CPU_CHECK(cond)                                                                  \
    do {                                                                                    \
        if (!(cond)) {                                                                      \
            std::fprintf(stderr, "fa2cpu: internal check failed: %s (%s:%d)\n", #cond, __FILE__, __LINE__); \
            std::abort();                                                                   \
        }                                                                                   \
    } while (0)

inline int64_t seq_nq(const Params& p, int64_t b) {
    return p.cu_seqlens_q ? p.cu_seqlens_q[b + 1] - p.cu_seqlens_q[b] : p.nq;
}
inline int64_t seq_nk(const Params& p, int64_t b) {
    if (p.seqlen_k) return p.seqlen_k[b];
    return p.cu_seqlens_k ? p.cu_seqlens_k[b + 1] - p.cu_seqlens_k[b] : p.nk;
}
// Element offset of query row i (of sequence b) for arrays laid out like q.
inline int64_t q_row_offset(const Params& p, int64_t b, int64_t i, int64_t batch_stride, int64_t row_stride) {
    return p.cu_seqlens_q ? (p.cu_seqlens_q[b] + i) * row_stride : b * batch_stride + i * row_stride;
}
// Element offset of key position pos of sequence b for arrays laid out like k (a block's stride
// is batch_stride when paged).
inline int64_t k_row_offset(const Params& p, int64_t b, int64_t pos, int64_t batch_stride, int64_t row_stride) {
    if (p.block_table) {
        const int64_t blk = p.block_table[b * p.block_table_batch_stride + pos / p.block_size];
        return blk * batch_stride + (pos % p.block_size) * row_stride;
    }
    return p.cu_seqlens_k ? (p.cu_seqlens_k[b] + pos) * row_stride : b * batch_stride + pos * row_stride;
}

// Element type of K/V: the quantized cache's codes, else q's dtype.
inline DType kv_dtype(const Params& p) { return p.kv_dtype < 0 ? DType(p.dtype) : DType(p.kv_dtype); }
inline bool is_code_dtype(DType dt) { return dt == DType::i8 || dt == DType::f8e4m3; }

// Saturating int64 add/sub: window bounds may be as large as an int64 allows.
inline int64_t sat_add(int64_t a, int64_t b) {
    int64_t r;
    return __builtin_add_overflow(a, b, &r) ? (b > 0 ? INT64_MAX : INT64_MIN) : r;
}
inline int64_t sat_sub(int64_t a, int64_t b) {
    int64_t r;
    return __builtin_sub_overflow(a, b, &r) ? (b < 0 ? INT64_MAX : INT64_MIN) : r;
}

// Visible keys of query row i (bottom-right aligned): [lo, hi] clipped to [0, nk-1]; lo > hi means
// none. Integer arithmetic end to end (positions beyond 2^24 stay exact), saturating.
inline void visible_range(const Params& p, int64_t nq, int64_t nk, int64_t i, int64_t* lo, int64_t* hi) {
    const int64_t diag = nk + (i - nq);  // 0 <= i < nq: no overflow
    const int64_t a = p.window_left < 0 ? 0 : sat_sub(diag, p.window_left);
    const int64_t z = p.window_right < 0 ? nk - 1 : sat_add(diag, p.window_right);
    *lo = a < 0 ? 0 : a;
    *hi = z > nk - 1 ? nk - 1 : z;
}

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Visible keys of a row block, from its rows' ranges [first[r], last[r]] (r in [r0, rend)):
// lo..hi is their union; every row sees all of [lo_max, hi_min] (lo_max = INT64_MAX when a row
// sees nothing, so a block holding such a row always needs the per-row mask).
struct BlockKeys {
    int64_t lo, hi, lo_max, hi_min;
};
inline BlockKeys block_keys(const int64_t* first, const int64_t* last, int64_t r0, int64_t rend) {
    BlockKeys k{INT64_MAX, INT64_MIN, INT64_MIN, INT64_MAX};
    for (int64_t r = r0; r < rend; ++r) {
        if (first[r] > last[r]) { k.lo_max = INT64_MAX; continue; }  // row sees nothing
        k.lo = first[r] < k.lo ? first[r] : k.lo;
        k.hi = last[r] > k.hi ? last[r] : k.hi;
        k.lo_max = first[r] > k.lo_max ? first[r] : k.lo_max;
        k.hi_min = last[r] < k.hi_min ? last[r] : k.hi_min;
    }
    return k;
}

// Spin-wait hint.
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

// ---- scalar dtype conversions (round to nearest even, NaN kept) ----
inline float bf16_to_f32(uint16_t h) {
    uint32_t u = uint32_t(h) << 16; float f; std::memcpy(&f, &u, 4); return f;
}
inline uint16_t f32_to_bf16(float f) {
    uint32_t u; std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return uint16_t(u >> 16);
}
inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = uint32_t(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
    if (exp == 0x1f) u = sign | 0x7f800000u | (man << 13);            // inf / nan
    else if (exp != 0) u = sign | ((exp + 112) << 23) | (man << 13);  // normal
    else if (man == 0) u = sign;                                      // zero
    else {                                                            // subnormal: normalise
        int e = -1;
        do { ++e; man <<= 1; } while (!(man & 0x400u));
        u = sign | uint32_t(112 - e) << 23 | ((man & 0x3ffu) << 13);
    }
    float f; std::memcpy(&f, &u, 4); return f;
}
inline uint16_t f32_to_f16(float f) {
    uint32_t u; std::memcpy(&u, &f, 4);
    const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
    const uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return uint16_t(sign | 0x7e00u);        // nan
    if (a >= 0x477ff000u) return uint16_t(sign | 0x7c00u);       // overflow (>= 65520) -> inf
    if (a < 0x38800000u) {                                       // result subnormal or zero
        if (a < 0x33000000u) return sign;                        // < 2^-25 rounds to 0
        const uint32_t e = a >> 23, man = (a & 0x7fffffu) | 0x800000u;
        const uint32_t shift = 126 - e;                          // 14..24
        uint32_t r = man >> shift;
        const uint32_t rem = man & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (r & 1u))) ++r;
        return uint16_t(sign | r);
    }
    uint32_t r = a - 0x38000000u;                                // rebias 127 -> 15
    r += 0xfffu + ((r >> 13) & 1u);
    return uint16_t(sign | (r >> 13));
}

// float8_e4m3fn (ml_dtypes / OCP FP8 E4M3, no infinities): sign, 4 exponent bits (bias 7), 3
// mantissa bits; S.1111.111 is NaN; exponent 0 is subnormal (m * 2^-9). Exact in float32.
inline float f8e4m3_to_f32(uint8_t x) {
    const int e = (x >> 3) & 0xf, m = x & 7;
    const float mag = (e == 15 && m == 7) ? NAN : e == 0 ? std::ldexp(float(m), -9) : std::ldexp(float(8 + m), e - 10);
    return (x & 0x80) ? -mag : mag;
}
// The 256 float8_e4m3fn values, by code.
inline const float* f8e4m3_values() {
    static const struct Table {
        float v[256];
        Table() { for (int i = 0; i < 256; ++i) v[i] = f8e4m3_to_f32(uint8_t(i)); }
    } table;
    return table.v;
}

// Whether n elements (stride in elements) of a float type hold an inf / NaN, by their exponent
// bits (all ones): a pass the compiler vectorises for unit strides, no conversion.
inline bool row_nonfinite(const void* src, int64_t n, int64_t stride, DType dt) {
    if (dt == DType::f32) {
        const uint32_t* u = static_cast<const uint32_t*>(src);
        uint32_t m = ~0u;  // 0 once an element's exponent bits are all ones
        if (stride == 1) for (int64_t j = 0; j < n; ++j) m = std::min(m, (u[j] & 0x7f800000u) ^ 0x7f800000u);
        else for (int64_t j = 0; j < n; ++j) m = std::min(m, (u[j * stride] & 0x7f800000u) ^ 0x7f800000u);
        return m == 0;
    }
    const uint16_t e = dt == DType::bf16 ? 0x7f80 : 0x7c00;
    const uint16_t* u = static_cast<const uint16_t*>(src);
    uint16_t m = 0xffff;
    if (stride == 1) for (int64_t j = 0; j < n; ++j) m = std::min<uint16_t>(m, uint16_t((u[j] & e) ^ e));
    else for (int64_t j = 0; j < n; ++j) m = std::min<uint16_t>(m, uint16_t((u[j * stride] & e) ^ e));
    return m == 0;
}

// Thread-local memory for rare paths (inf / NaN kept out of rows that cannot see it:
// tile_loop.h Hidden, backward_loop.h Careful), one block per slot, grown on demand and kept;
// null when it cannot be had (the callers then take their usual path).
enum class RareSlot : int { hidden_keys, clean_tile, hidden_sums, bad_keys, bad_rows, count };
inline void* rare_memory(RareSlot slot, size_t bytes) {
    struct Slots {
        void* p[int(RareSlot::count)] = {};
        size_t n[int(RareSlot::count)] = {};
        ~Slots() { for (void* x : p) std::free(x); }
    };
    static thread_local Slots slots;
    const int k = int(slot);
    if (slots.n[k] < bytes) {
        std::free(slots.p[k]);
        slots.p[k] = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
        slots.n[k] = slots.p[k] ? bytes : 0;
    }
    return slots.p[k];
}

// Reads n elements (stride in elements) of dtype dt as float32.
inline void load_row_scalar(float* dst, const void* src, int64_t n, int64_t stride, DType dt) {
    if (dt == DType::f32) {
        const float* s = static_cast<const float*>(src);
        if (stride == 1) { std::memcpy(dst, s, size_t(n) * 4); return; }
        for (int64_t j = 0; j < n; ++j) dst[j] = s[j * stride];
    } else if (dt == DType::bf16) {
        const uint16_t* s = static_cast<const uint16_t*>(src);
        for (int64_t j = 0; j < n; ++j) dst[j] = bf16_to_f32(s[j * stride]);
    } else {
        const uint16_t* s = static_cast<const uint16_t*>(src);
        for (int64_t j = 0; j < n; ++j) dst[j] = f16_to_f32(s[j * stride]);
    }
}
inline void store_scalar(void* base, int64_t idx, float x, DType dt) {
    if (dt == DType::f32) static_cast<float*>(base)[idx] = x;
    else if (dt == DType::bf16) static_cast<uint16_t*>(base)[idx] = f32_to_bf16(x);
    else static_cast<uint16_t*>(base)[idx] = f32_to_f16(x);
}
// n floats from src to elements idx, idx + stride, ... of base (dtype dt).
inline void store_row(void* base, int64_t idx, int64_t stride, const float* src, int64_t n, DType dt) {
    if (dt == DType::f32 && stride == 1) { std::memcpy(static_cast<float*>(base) + idx, src, size_t(n) * 4); return; }
    for (int64_t j = 0; j < n; ++j) store_scalar(base, idx + j * stride, src[j], dt);
}
inline size_t dtype_size(DType dt) {
    constexpr size_t kBytes[] = {
#define FA2CPU_DTYPE(name, numpy_name, bytes) bytes,
#include "fa2cpu/catalogue.def"
    };
    return kBytes[int(dt)];
}
inline const void* elem_ptr(const void* base, int64_t off, DType dt) {
    return static_cast<const char*>(base) + off * int64_t(dtype_size(dt));
}

}  // namespace
}  // namespace fa2cpu
