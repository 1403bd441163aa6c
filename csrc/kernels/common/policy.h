// The interface between the tile loop (tile_loop.h) and a GEMM policy (gemm_f32.h, gemm_bf16.h,
// gemm_decode.h, amx.cpp's AmxGemm): operand layouts, packing and the two products of a tile.
// A policy is a struct of compile-time traits (like flash-attn's kernel_traits) and static
// functions:
//
//   traits   W lanes, RV row vectors per row block, RB = RV*W rows per row block, BC keys per K/V
//            tile, kMaxRows rows per item, kRowAlign (item rows are padded to it), kScaleAt,
//            kPStore, kTilesEndAtBlocks (paged K/V read in place: a tile, or each run of one
//            (kRunKeys, optional), never crosses a block)
//   scratch  q_floats(D, M), o_floats(Dv, M), k_floats(D), v_floats(Dv)
//   Q        pack_q_row(q, M, r, row, D, scale), zero_q_row(q, M, r, D)
//   K, V     k_tile / v_tile(p, b, c0, nc, head_offset, buf) -> KvTile (in place or packed in buf);
//            packs_k / packs_v(p): whether whole tiles are packed (then they can be shared)
//   products qk(ops, rows, k_tile, keys, s): S block of `rows`;  pv(ops, rows, s, keys, v_tile): O += P V
//   O        o_elem(o, M, Dv, r, j), rescale_o(o, M, Dv, r, alpha) (TransposedO below for most)
//   optional: v_panels(p, b, c0, nc, head, buf) -> KvTile and v_panel_floats(Dv): a V tile in a
//            layout worth packing only for a shared slot (gemm_f32.h; the tile loop uses it for
//            slots, the routes size V's slots by it; an item's own tiles still come from v_tile)
//   optional, used when the item's padded rows M are a multiple of 16 (whole blocks of 16):
//            pack_q_rows(q, M, r0, rows, D, scale, nreal): rows r0..r0+15 at once from
//            rows[i * D + d] (i < nreal real, the rest padding), the values of pack_q_row /
//            zero_q_row; gather_o_rows(o, M, Dv, r0, dst): rows r0..r0+15 of O into dst[i * Dv + j]
#pragma once
#include <type_traits>

#include "kernel.h"

namespace fa2cpu {
namespace {

// Where the score scale (scale*log2e, or scale/softcap) is applied.
enum class ScaleAt {
    packed_q,   // Q is packed pre-scaled (float32 Q: exact enough, and free)
    qk_output,  // the QK micro-kernel multiplies its float32 output (bf16 Q: scaling would round)
    softmax,    // the softmax / bias pass scales S (AMX stores tiles unscaled)
};
// Where the softmax leaves P for the PV product.
enum class PStore {
    f32_in_scores,  // float32 P overwrites S
    bf16_pairs,     // bf16 pairs along the key axis, [ceil(nc/2)][RB] uint32, written by the
                    // policy's store_p_pair into a block of their own (tile_loop.h softmax_update)
};

// One item's operands as the micro-kernels see them.
struct ItemOperands {
    const float* q;  // the policy's Q layout for M rows
    float* o;        // the policy's O accumulator layout for M rows
    int64_t M, d, dv;
    float qk_scale;  // ScaleAt::qk_output: factor for the QK output (else 1)
};
// A row block: rows [r0, r0 + rows) of the item, `vectors` row vectors of W lanes (rows past
// `rows` are padding). kv_head[r - r0]: kv head of row r relative to the item's first (items that
// span kv heads; 0 otherwise).
struct RowBlock {
    int64_t r0;
    int vectors, rows;
    const int32_t* kv_head;
};
// A 16 x 16 block copied transposed, dst[i * ldd + j] = src[j * lds + i]: V::transpose16 when
// the family has one (V512: in registers), else element by element. Used where a "rows in lanes"
// layout meets row-major rows: the forward's Q packing and output rows (below, gemm_f32.h), the
// backward's panels (backward_loop.h). bench/RESULTS.md, sessions 27-28: element-by-element
// copies cost 9-11 % of the AMX bf16 backward and 2.6 % / 4.3 % of the Zen 4 fp32 forward
// (full / causal).
template <class V, class = void>
struct HasTranspose16 : std::false_type {};
// Whether n floats hold no inf / NaN: x - x is NaN exactly there, summed in vectors and looked
// at once (the non-finite checks of tile_loop.h and backward_loop.h).
template <class V>
inline bool all_finite(const float* x, int64_t n) {
    constexpr int W = V::W;
    typename V::vec acc = V::zero();
    int64_t j = 0;
    for (; j + W <= n; j += W) {
        const typename V::vec y = V::load(x + j);
        acc = V::add(acc, V::sub(y, y));
    }
    alignas(64) float lanes[W];
    V::store(lanes, acc);
    float t = 0.f;
    for (int l = 0; l < W; ++l) t += lanes[l];
    for (; j < n; ++j) t += x[j] - x[j];
    return t == t;
}

template <class V>
struct HasTranspose16<V, std::void_t<decltype(&V::transpose16)>> : std::true_type {};
template <class V>
inline void transpose16(const float* src, int64_t lds, float* dst, int64_t ldd) {
    if constexpr (HasTranspose16<V>::value) {
        V::transpose16(src, lds, dst, ldd);
    } else {
        for (int i = 0; i < 16; ++i)
            for (int j = 0; j < 16; ++j) dst[i * ldd + j] = src[j * lds + i];
    }
}

// Whether a K/V tile that a policy could read in place (its own test: element type, unit feature
// stride, not paged) is read in place: when its rows lie together (row stride = the row's length
// n), or when sequence b fills no whole item of max_rows query rows per kv head (one item per head:
// nothing is shared, so each item would copy its tiles; 0.97x at 64 rows). Rows that lie apart (a
// bshd array or cache: Hk x n apart) are packed otherwise, and shared by the kv head's items
// (packs_k / packs_v say so: packs_rows below): in place, every line of a row maps to the
// cache sets of that line in every other row (rows 4 KB apart share one L1 set) and the
// micro-kernels, which re-read a tile per row block, crowded a few sets: fp32 on Zen 3 ran 1.10x
// / 1.19x / 1.42x slower at H = 4 / 8 / 16 with such K/V than with contiguous ones, 1.00-1.04x
// packed (bench/tools/layout_cost.py; bench/RESULTS.md, session 33).
inline bool rows_in_place(const Params& p, int64_t b, int64_t row_stride, int64_t n, int64_t max_rows) {
    return row_stride == n || (p.hq / p.hk) * seq_nq(p, b) < max_rows;
}
// packs_k / packs_v of such a policy: whole tiles are packed (and can be shared) when the policy
// cannot read them in place at all, or when their rows lie apart.
inline bool packs_rows(bool readable_in_place, int64_t row_stride, int64_t n) {
    return !readable_in_place || row_stride != n;
}

// The O accumulator of the "rows in lanes" policies: O^T [Dv][M], row r's column j at o[j*M + r].
template <class V>
struct TransposedO {
    static int64_t o_floats(int64_t Dv, int64_t M) { return Dv * M; }
    static float o_elem(const float* o, int64_t M, int64_t, int64_t r, int64_t j) { return o[j * M + r]; }
    static void gather_o_rows(const float* o, int64_t M, int64_t Dv, int64_t r0, float* dst) {
        int64_t j = 0;
        for (; j + 16 <= Dv; j += 16) transpose16<V>(o + j * M + r0, M, dst + j, Dv);
        for (; j < Dv; ++j)
            for (int i = 0; i < 16; ++i) dst[i * Dv + j] = o[j * M + r0 + i];
    }
    static void rescale_o(float* o, int64_t M, int64_t Dv, int64_t r, typename V::vec alpha) {
        for (int64_t j = 0; j < Dv; ++j) V::store(o + j * M + r, V::mul(V::load(o + j * M + r), alpha));
    }
};

// The visible-key bounds lo/hi and diagonals rl of the W rows rv.. relative to key c0, as float
// vectors for the masks and alibi of a tile (tile_loop.h's epilogue, backward_loop.h's gradients):
// lo/hi clamped to [-1, n] and key offsets c < n <= BC are exact in float32 whatever the positions.
template <class V>
struct RowBounds {
    typename V::vec lo, hi, rl;
};
template <class V>
inline RowBounds<V> row_bounds(const int64_t* first_key, const int64_t* last_key, const int64_t* diagonal, int64_t rv,
                               int64_t c0, int64_t n) {
    alignas(64) float lo_t[V::W], hi_t[V::W], rl_t[V::W];
    for (int t = 0; t < V::W; ++t) {
        const int64_t a = first_key[rv + t] - c0, z = last_key[rv + t] - c0;
        lo_t[t] = float(a < -1 ? -1 : a > n ? n : a);
        hi_t[t] = float(z < -1 ? -1 : z > n ? n : z);
        rl_t[t] = float(diagonal[rv + t] - c0);
    }
    return RowBounds<V>{V::load(lo_t), V::load(hi_t), V::load(rl_t)};
}

}  // namespace
}  // namespace fa2cpu
