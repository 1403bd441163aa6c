// Routes: how a family's file declares which loop computes which items. A family lists its routes
// (best first) and `make_table` derives the dispatch-table row: the planner picks, per sequence,
// the first route that serves it, sizes items by the route's own max_rows (split-KV boundaries
// fall on its kv_tile boundaries when K/V tiles are shared; driver.cpp) and runs items with its run_item.
//
//   Route type         serves                                   items
//   TileRoute<L, S>    S::serves(p, rows per kv head)           L = TileLoop<V, GEMM policy>
//   DecodeRoute<...>   <= kRowsPerHead rows per kv head         TileLoop<V512, DecodeGemm<dtype>> or
//                      (decode, GQA group of a token;           TileLoop<V256, DecodeGemm8<dtype>> (avx2),
//                      decode_operands.h)                       spanning kv heads where heads interleave;
//                                                               int8 cache + 16-bit q: Q16DecodeGemm(8)
//
// Selectors S: AnyInput, Bf16Input, Bf16Rows<n> (bf16 with >= n rows per kv head).
#pragma once
#include <cstdlib>
#include <cstring>
#include <tuple>

#include "kernel.h"
#include "backward_loop.h"
#include "tile_loop.h"

namespace fa2cpu {
namespace {

struct AnyInput {
    static bool serves(const Params&, int64_t) { return true; }
};
// The bf16 product routes take bf16 K/V: not a quantized cache, whose dequantized values
// (code x float32 scale) bf16 would round; the float32 route reads those exactly.
struct Bf16Input {
    static bool serves(const Params& p, int64_t) { return DType(p.dtype) == DType::bf16 && kv_dtype(p) == DType::bf16; }
};
template <int64_t kMinRows>
struct Bf16Rows {
    static bool serves(const Params& p, int64_t rows) { return Bf16Input::serves(p, rows) && rows >= kMinRows; }
};

inline int64_t one_kv_head(const Params&, int64_t) { return 1; }

inline int64_t no_shared_tiles(const Params&, int) { return 0; }

template <class Loop, class Select = AnyInput>
struct TileRoute {
    using G = typename Loop::G;
    // A quantized cache's tiles reach G dequantized (tile_loop.h): whether G packs them then.
    static int64_t shared_tile_floats(const Params& p, int which) {
        const bool staged = is_code_dtype(kv_dtype(p)) && !ReadsCodes<G>::value;
        if (which == 0) return G::packs_k(staged ? Loop::template staged_params<0>(p, nullptr) : p) ? G::k_floats(p.d) : 0;
        if constexpr (HasVPanels<G>::value) return G::v_panel_floats(p.dv);  // (worth sharing whatever the input)
        return G::packs_v(staged ? Loop::template staged_params<1>(p, nullptr) : p) ? G::v_floats(p.dv) : 0;
    }
    static constexpr Route route(const char* name) {
        return Route{name, &Select::serves, &one_kv_head, G::kMaxRows, Loop::BC,
                     &Loop::scratch_floats, &shared_tile_floats, &Loop::run_item};
    }
};

// The decode route over one tile loop per K/V element type (float32, float16, bfloat16, and the
// int8 / float8_e4m3fn codes of a quantized cache, all read in place: gemm_decode.h's
// DecodeGemm<F32Elem>, ..., <F8Elem>), chosen per call by kv_dtype(p); an int8 cache read by
// 16-bit queries takes LoopI8Q16 (int16 products where the family has them), a float8 cache read
// by bfloat16 queries LoopF8Q16 (bf16 products where the family has them).
template <class LoopF32, class LoopF16, class LoopBf16, class LoopI8, class LoopF8, class LoopI8Q16 = LoopI8,
          class LoopF8Q16 = LoopF8>
struct DecodeRoute {
    using G = typename LoopF32::G;
    static_assert(LoopF16::BC == LoopF32::BC && LoopBf16::BC == LoopF32::BC && LoopI8::BC == LoopF32::BC &&
                      LoopF8::BC == LoopF32::BC && LoopI8Q16::BC == LoopF32::BC && LoopF8Q16::BC == LoopF32::BC,
                  "one tile size for every dtype");
    static bool serves(const Params&, int64_t rows_per_kv_head) { return rows_per_kv_head <= G::kRowsPerHead; }
    static bool q16(const Params& p) { return DType(p.dtype) == DType::bf16 || DType(p.dtype) == DType::f16; }
    static bool qbf16(const Params& p) { return DType(p.dtype) == DType::bf16; }
    // Items span kv heads when the cache interleaves heads within a position and K/V are read in
    // place (unit feature stride: a packed tile holds one head).
    static int64_t kv_heads_per_item(const Params& p, int64_t rows_per_kv_head) {
        const bool interleaved = p.k_dim_stride == 1 && p.v_dim_stride == 1 &&
                                 std::llabs(p.k_head_stride) <= std::llabs(p.k_row_stride) &&
                                 std::llabs(p.v_head_stride) <= std::llabs(p.v_row_stride);
        if (!interleaved || p.hk < 2) return 1;
        const int64_t n = G::kMaxRows / (rows_per_kv_head < 1 ? 1 : rows_per_kv_head);
        return n < 1 ? 1 : n > p.hk ? p.hk : n;
    }
    static int64_t scratch_floats(const Params& p, int64_t rows) {
        switch (kv_dtype(p)) {
            case DType::bf16: return LoopBf16::scratch_floats(p, rows);
            case DType::f16: return LoopF16::scratch_floats(p, rows);
            case DType::i8: return q16(p) ? LoopI8Q16::scratch_floats(p, rows) : LoopI8::scratch_floats(p, rows);
            case DType::f8e4m3: return qbf16(p) ? LoopF8Q16::scratch_floats(p, rows) : LoopF8::scratch_floats(p, rows);
            default: return LoopF32::scratch_floats(p, rows);
        }
    }
    static void run_item(const Params& p, const WorkItem& it, const ItemContext& ctx) {
        switch (kv_dtype(p)) {
            case DType::bf16: return LoopBf16::run_item(p, it, ctx);
            case DType::f16: return LoopF16::run_item(p, it, ctx);
            case DType::i8: return q16(p) ? LoopI8Q16::run_item(p, it, ctx) : LoopI8::run_item(p, it, ctx);
            case DType::f8e4m3: return qbf16(p) ? LoopF8Q16::run_item(p, it, ctx) : LoopF8::run_item(p, it, ctx);
            default: return LoopF32::run_item(p, it, ctx);
        }
    }
    // Decode reads each kv head's K/V once per call: nothing to share.
    static constexpr Route route(const char* name) {
        return Route{name, &serves, &kv_heads_per_item, G::kMaxRows, LoopF32::BC, &scratch_floats, &no_shared_tiles,
                     &run_item};
    }
};

// One of several forms of a loop, picked once per process (a function-local static): Pick::index()
// is the position in Loops, e.g. from a CPU feature, unless the environment variable Pick::kEnv
// names a form (Pick::kNames, in Loops' order; for tests and A/B runs). Other values, and a form
// whose name is null (one that needs an instruction the CPU may lack), are ignored.
// The forms compute the same items with the same tile size (the avx512 family's int8 decode,
// gemm_decode.h; the avx2 family's bf16 decode, gemm_decode_avx2.h).
template <class Pick, class... Loops>
struct PickedLoop {
    static constexpr int64_t BC = std::tuple_element_t<0, std::tuple<Loops...>>::BC;
    static_assert(((Loops::BC == BC) && ...), "one tile size");
    static_assert(sizeof(Pick::kNames) / sizeof(Pick::kNames[0]) == sizeof...(Loops), "a name per form");
    static int form() {
        static const int f = [] {
            if (const char* e = std::getenv(Pick::kEnv))
                for (int i = 0; i < int(sizeof...(Loops)); ++i)
                    if (Pick::kNames[i] && std::strcmp(e, Pick::kNames[i]) == 0) return i;
            return Pick::index();
        }();
        return f;
    }
    static int64_t scratch_floats(const Params& p, int64_t rows) {
        const int f = form();
        int64_t floats = 0;
        int i = 0;
        ((i++ == f ? (floats = Loops::scratch_floats(p, rows)) : 0), ...);
        return floats;
    }
    static void run_item(const Params& p, const WorkItem& it, const ItemContext& ctx) {
        const int f = form();
        int i = 0;
        ((i++ == f ? (Loops::run_item(p, it, ctx), 0) : 0), ...);
    }
};

// A family's backward: one BackwardLoop<V> (backward_loop.h) serves every dtype and option.
// kBf16CapCpus, where the backward declares it, is BackwardKernel::bf16_cap_cpus (else 1).
template <class Loop, class = void>
struct Bf16CapCpus {
    static constexpr int64_t value = 1;
};
template <class Loop>
struct Bf16CapCpus<Loop, std::void_t<decltype(Loop::kBf16CapCpus)>> {
    static constexpr int64_t value = Loop::kBf16CapCpus;
};
template <class Loop>
struct BackwardRoute {
    static constexpr BackwardKernel kernel() {
        return BackwardKernel{Loop::BC, &Loop::scratch_floats, &Loop::run_item, Bf16CapCpus<Loop>::value};
    }
};

// The dispatch-table row of a family: its backward and its forward routes, best first (the last
// must serve everything).
template <class Backward, class... Routes>
constexpr KernelTable make_table(double (*peak)(int, double), Backward, Routes... routes) {
    static_assert(sizeof...(Routes) <= kMaxRoutes, "raise kMaxRoutes");
    return KernelTable{{routes...}, int(sizeof...(Routes)), peak, Backward::kernel()};
}

}  // namespace
}  // namespace fa2cpu
