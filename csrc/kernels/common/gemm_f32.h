// Float32 GEMM policy of the tile loop ("rows in lanes", see tile_loop.h): register-blocked
// micro-kernels for S^T = K Q^T and O^T += V^T P^T that broadcast single K/V elements against
// vectors of W query rows. Every family uses it for float32 and float16 (converted to float32
// while packing, so products keep float32 accuracy).
#pragma once
#include "kernel.h"
#include "policy.h"

namespace fa2cpu {
namespace {

template <class V>
struct F32Gemm : TransposedO<V> {
    using vec = typename V::vec;
    static constexpr int W = V::W;
    static constexpr int RV = V::RV;    // row vectors per micro-tile
    static constexpr int NK = V::NK;    // keys per QK micro-tile
    static constexpr int ND = V::ND;    // output columns per PV micro-tile
    static constexpr int RB = RV * W;   // rows per row block
    static constexpr int64_t BC = V::BC;
    // Reduction passes: QK^T sums over at most DC head-dim entries and PV over at most CC keys
    // per pass (accumulators stored and reloaded between passes, same summation order), so the
    // DC x RB slice of Q^T or the CC x RB slice of P that every micro-tile re-reads stays in L1.
    static constexpr int64_t DC = V::DC;
    static constexpr int64_t CC = V::CC;
    static constexpr int64_t kMaxRows = V::MAX_ROWS;
    static constexpr int64_t kRowAlign = W;
    static constexpr ScaleAt kScaleAt = ScaleAt::packed_q;
    static constexpr PStore kPStore = PStore::f32_in_scores;
    static constexpr bool kTilesEndAtBlocks = false;

    // Scratch (floats) of the Q operand for M rows, of one packed K / V tile, of a P copy.
    static int64_t q_floats(int64_t D, int64_t M) { return D * M; }
    static int64_t k_floats(int64_t D) { return BC * D; }
    static int64_t v_floats(int64_t Dv) { return BC * Dv; }

    // qbuf [D][M]: row r of Q transposed, times qscale.
    static void pack_q_row(float* qbuf, int64_t M, int64_t r, const float* row, int64_t D, float qscale) {
        for (int64_t d = 0; d < D; ++d) qbuf[d * M + r] = row[d] * qscale;
    }
    static void zero_q_row(float* qbuf, int64_t M, int64_t r, int64_t D) {
        for (int64_t d = 0; d < D; ++d) qbuf[d * M + r] = 0.f;
    }
    // Rows r0..r0+15 at once (policy.h): scaled (padding rows zeroed) in `rows`, then moved into
    // qbuf by 16 x 16 transposes: the values pack_q_row / zero_q_row write.
    static void pack_q_rows(float* qbuf, int64_t M, int64_t r0, float* rows, int64_t D, float qscale, int nreal) {
        for (int i = 0; i < 16; ++i)
            for (int64_t d = 0; d < D; ++d) rows[i * D + d] = i < nreal ? rows[i * D + d] * qscale : 0.f;
        int64_t d = 0;
        for (; d + 16 <= D; d += 16) transpose16<V>(rows + d, D, qbuf + d * M + r0, M);
        for (; d < D; ++d)
            for (int i = 0; i < 16; ++i) qbuf[d * M + r0 + i] = rows[i * D + d];
    }
    // K/V tile of nc rows from key position c0: read in place when float32 with unit feature
    // stride, not paged and its rows lie together (policy.h rows_in_place), else packed row-major
    // (strides, paging, dtype conversion end here).
    static bool readable_in_place(const Params& p, int64_t dim_stride) {
        return DType(p.dtype) == DType::f32 && dim_stride == 1 && !p.block_table;
    }
    static bool in_place(const Params& p, int64_t b, int64_t row_stride, int64_t dim_stride, int64_t n) {
        return readable_in_place(p, dim_stride) && rows_in_place(p, b, row_stride, n, kMaxRows);
    }
    static bool packs_k(const Params& p) { return packs_rows(readable_in_place(p, p.k_dim_stride), p.k_row_stride, p.d); }
    static bool packs_v(const Params& p) { return packs_rows(readable_in_place(p, p.v_dim_stride), p.v_row_stride, p.dv); }
    static KvTile k_tile(const Params& p, int64_t b, int64_t c0, int64_t nc, int64_t head, float* buf) {
        return tile(p, p.k, p.k_batch_stride, p.k_row_stride, p.k_dim_stride, p.d, b, c0, nc, head, buf);
    }
    static KvTile v_tile(const Params& p, int64_t b, int64_t c0, int64_t nc, int64_t head, float* buf) {
        return tile(p, p.v, p.v_batch_stride, p.v_row_stride, p.v_dim_stride, p.dv, b, c0, nc, head, buf);
    }
    // A V tile for a shared slot (policy.h v_panels): panels of ND columns, [ceil(Dv/ND)][BC][ND]
    // (columns past Dv zero), so that pv_micro reads its ND columns of consecutive keys from one
    // contiguous run instead of one row per key 4 * Dv bytes apart. Row-major V read in place
    // cost the fp32 forward 6-9 % (in-process A/B, same bits: 2-core Xeon with AMX, amx family,
    // bench/RESULTS.md session 39): each PV step touched a new line for 4 * ND bytes, and rows
    // 512 B apart fall into 8 of L1's 64 sets. Packing costs one pass over V per (sequence, kv
    // head), so only shared slots take this layout; an item's own tiles stay rows.
    static int64_t v_panel_floats(int64_t Dv) { return BC * round_up(Dv, ND); }
    static KvTile v_panels(const Params& p, int64_t b, int64_t c0, int64_t nc, int64_t head, float* buf) {
        const DType dt = DType(p.dtype);
        const int64_t Dv = p.dv, chunks = (Dv + ND - 1) / ND;
        alignas(64) float row[kMaxHeadDim + ND];
        for (int64_t c = 0; c < nc; ++c) {
            V::load_row(row, elem_ptr(p.v, k_row_offset(p, b, c0 + c, p.v_batch_stride, p.v_row_stride) + head, dt), Dv,
                        p.v_dim_stride, dt);
            for (int64_t j = Dv; j < chunks * ND; ++j) row[j] = 0.f;
            for (int64_t k = 0; k < chunks; ++k)
                for (int t = 0; t < ND; ++t) buf[(k * BC + c) * ND + t] = row[k * ND + t];
        }
        KvTile t{buf, BC * ND, 0, 0};
        t.panels = true;
        return t;
    }
    static KvTile tile(const Params& p, const void* base, int64_t batch_stride, int64_t row_stride,
                       int64_t dim_stride, int64_t n, int64_t b, int64_t c0, int64_t nc, int64_t head, float* buf) {
        const DType dt = DType(p.dtype);
        if (in_place(p, b, row_stride, dim_stride, n))
            return {static_cast<const float*>(base) + k_row_offset(p, b, c0, batch_stride, row_stride) + head, row_stride, 0, 0};
        for (int64_t c = 0; c < nc; ++c)
            V::load_row(buf + c * n, elem_ptr(base, k_row_offset(p, b, c0 + c, batch_stride, row_stride) + head, dt), n,
                        dim_stride, dt);
        return {buf, n, 0, 0};
    }

    // s[j*RB + v*W + lane] (+)= sum_d qT[d*M + v*W + lane] * kt[j*ldk + d],  j < NKC, v < NV
    // (kAccumulate: add to s, a later pass over the reduction axis)
    template <int NV, int NKC, bool kAccumulate = false>
    static inline void qk_micro(const float* qT, int64_t M, const float* kt, int64_t ldk, int64_t D, float* s) {
        vec acc[NV][NKC];
#pragma GCC unroll 8
        for (int v = 0; v < NV; ++v)
#pragma GCC unroll 8
            for (int j = 0; j < NKC; ++j) acc[v][j] = kAccumulate ? V::load(s + j * RB + v * W) : V::zero();
        for (int64_t d = 0; d < D; ++d) {
            vec q[NV];
#pragma GCC unroll 8
            for (int v = 0; v < NV; ++v) q[v] = V::load(qT + d * M + v * W);
            const float* kd = kt + d;
#pragma GCC unroll 8
            for (int j = 0; j < NKC; ++j) {
                const vec kb = V::set1(kd[j * ldk]);
#pragma GCC unroll 8
                for (int v = 0; v < NV; ++v) acc[v][j] = V::fma(q[v], kb, acc[v][j]);
            }
        }
#pragma GCC unroll 8
        for (int j = 0; j < NKC; ++j)
#pragma GCC unroll 8
            for (int v = 0; v < NV; ++v) V::store(s + j * RB + v * W, acc[v][j]);
    }

    // oT[j*M + v*W + lane] += sum_c s[c*lds + v*W + lane] * vt[c*ldv + j*kVCol],  j < NDC
    // (lds = RB, kVCol = 1 here; the backward's dV / dK products use other strides: backward_loop.h)
    template <int NV, int NDC, int64_t kVCol = 1>
    static inline void pv_micro(const float* s, int64_t nc, const float* vt, int64_t ldv, float* oT, int64_t M,
                                int64_t lds = RB) {
        vec acc[NV][NDC];
#pragma GCC unroll 24
        for (int j = 0; j < NDC; ++j)
#pragma GCC unroll 24
            for (int v = 0; v < NV; ++v) acc[v][j] = V::load(oT + j * M + v * W);
        for (int64_t c = 0; c < nc; ++c) {
            vec pr[NV];
#pragma GCC unroll 24
            for (int v = 0; v < NV; ++v) pr[v] = V::load(s + c * lds + v * W);
            const float* vc = vt + c * ldv;
#pragma GCC unroll 24
            for (int j = 0; j < NDC; ++j) {
                const vec vb = V::set1(vc[j * kVCol]);
#pragma GCC unroll 24
                for (int v = 0; v < NV; ++v) acc[v][j] = V::fma(pr[v], vb, acc[v][j]);
            }
        }
#pragma GCC unroll 24
        for (int j = 0; j < NDC; ++j)
#pragma GCC unroll 24
            for (int v = 0; v < NV; ++v) V::store(oT + j * M + v * W, acc[v][j]);
    }

    // Full NK/ND chunks, then one tail chunk of 1..NK-1 keys / 1..ND-1 columns, so K and V can be
    // read in place (no padding past the tile) when they need no packing.
    template <int NV, bool kAccumulate, int T = 1>
    static void qk_tail(int t, const float* qT, int64_t M, const float* kt, int64_t ldk, int64_t D, float* s) {
        if constexpr (T < NK) {
            if (t == T) qk_micro<NV, T, kAccumulate>(qT, M, kt, ldk, D, s);
            else qk_tail<NV, kAccumulate, T + 1>(t, qT, M, kt, ldk, D, s);
        }
    }
    template <int NV, int T = 1>
    static void pv_tail(int t, const float* s, int64_t nc, const float* vt, int64_t ldv, float* oT, int64_t M) {
        if constexpr (T < ND) {
            if (t == T) pv_micro<NV, T>(s, nc, vt, ldv, oT, M);
            else pv_tail<NV, T + 1>(t, s, nc, vt, ldv, oT, M);
        }
    }
    template <int NV, bool kAccumulate>
    static void qk_pass(const float* qT, int64_t M, const float* kt, int64_t ldk, int64_t D, int64_t nc, float* s) {
        int64_t c = 0;
        for (; c + NK <= nc; c += NK) qk_micro<NV, NK, kAccumulate>(qT, M, kt + c * ldk, ldk, D, s + c * RB);
        if (c < nc) qk_tail<NV, kAccumulate>(int(nc - c), qT, M, kt + c * ldk, ldk, D, s + c * RB);
    }
    // Passes of at most kDC features (DC for the forward; the backward passes its own, below).
    template <int NV, int64_t kDC = DC>
    static void qk_block(const float* qT, int64_t M, const float* kt, int64_t ldk, int64_t D, int64_t nc, float* s) {
        qk_pass<NV, false>(qT, M, kt, ldk, D < kDC ? D : kDC, nc, s);
        for (int64_t d0 = kDC; d0 < D; d0 += kDC)
            qk_pass<NV, true>(qT + d0 * M, M, kt + d0, ldk, D - d0 < kDC ? D - d0 : kDC, nc, s);
    }
    // (kPanels: V in panels of ND columns, column j of key c at vt[(j / ND) * ldv + c * ND + j % ND],
    // ldv the panels' stride; the same products in the same order as rows)
    template <int NV, bool kPanels = false>
    static void pv_block(const float* s, int64_t nc, const float* vt, int64_t ldv, int64_t Dv, float* oT, int64_t M) {
        const int64_t step = kPanels ? ND : ldv;  // between keys
        for (int64_t c0 = 0; c0 < nc; c0 += CC) {
            const int64_t n = nc - c0 < CC ? nc - c0 : CC;
            const float* sc = s + c0 * RB;
            auto at = [&](int64_t j) { return kPanels ? vt + j / ND * ldv + c0 * ND : vt + c0 * ldv + j; };
            int64_t j = 0;
            for (; j + ND <= Dv; j += ND) pv_micro<NV, ND>(sc, n, at(j), step, oT + j * M, M);
            if (j < Dv) pv_tail<NV>(int(Dv - j), sc, n, at(j), step, oT + j * M, M);
        }
    }
    // Row blocks of nv = 1..RV vectors (the last block of an item may be partial).
    template <int64_t kDC = DC, int NV = RV>
    static void qk_nv(int nv, const float* qT, int64_t M, const float* kt, int64_t ldk, int64_t D, int64_t nc, float* s) {
        if constexpr (NV >= 1) {
            if (nv == NV) qk_block<NV, kDC>(qT, M, kt, ldk, D, nc, s);
            else qk_nv<kDC, NV - 1>(nv, qT, M, kt, ldk, D, nc, s);
        }
    }
    template <int NV = RV, bool kPanels = false>
    static void pv_nv(int nv, const float* s, int64_t nc, const float* vt, int64_t ldv, int64_t Dv, float* oT, int64_t M) {
        if constexpr (NV >= 1) {
            if (nv == NV) pv_block<NV, kPanels>(s, nc, vt, ldv, Dv, oT, M);
            else pv_nv<NV - 1, kPanels>(nv, s, nc, vt, ldv, Dv, oT, M);
        }
    }

    // The tile loop's interface (policy.h): S of a row block (log2-domain logits before biases)
    // and O^T += P V for it.
    static void qk(const ItemOperands& x, const RowBlock& rows, const KvTile& k, int64_t keys, float* s) {
        qk_nv(rows.vectors, x.q + rows.r0, x.M, static_cast<const float*>(k.data), k.ld, x.d, keys, s);
    }
    static void pv(const ItemOperands& x, const RowBlock& rows, float* s, int64_t keys, const KvTile& v) {
        const float* vt = static_cast<const float*>(v.data);
        if (v.panels) pv_nv<RV, true>(rows.vectors, s, keys, vt, v.ld, x.dv, x.o + rows.r0, x.M);
        else pv_nv(rows.vectors, s, keys, vt, v.ld, x.dv, x.o + rows.r0, x.M);
    }
};

}  // namespace
}  // namespace fa2cpu
