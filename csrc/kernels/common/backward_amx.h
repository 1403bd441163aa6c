// bfloat16 products of the backward on AMX tiles (family amx): BackwardLoop<V512, AmxProducts>
// (backward_loop.h: the same items, row groups, key tiles and softmax gradient as every family)
// with all five tile products in tdpbf16ps, accumulating in float32 tiles. Every product is one
// shape, C[i][j] (+)= sum_t A[i][2t..2t+1] . B[t][j] (tile_gemm below): A bf16 rows (16 x 32
// bf16 per tile), B bf16 pairs along the reduction (16 pairs x 16 columns, one uint32 a pair,
// low half first: the "VNNI" layout), C float32 (16 x 16), on 2 x 2 blocks of C tiles:
//
//   product            C (i x j)            A (i rows, reduction along)    B (pairs x j)
//   S^T  = K Q^T       s [keys][RB]         kr  [keys][ldq]  K rows        qp   [ldq/2][GR] Q pairs
//   dP^T = V dO^T      dp [keys][RB]        vr  [keys][ldo]  V rows        dop  [ldo/2][GR] dO pairs
//   dV  += P^T dO      dvall [keys][ldo]    pT  [BC][GR]     P^T (bf16)    dorp [GR/2][ldo] dO row pairs
//   dK  += dS^T Q      dkall [keys][ldq]    dsT [BC][GR]     dS^T (bf16)   qrp  [GR/2][ldq] Q row pairs
//   dQ^T += K^T dS^T   dqT [ldq][RB]        kT  [ldq][ldkt]  K^T           dsp  [BC/2][GR]  dS key pairs
//
// Padding (BackwardLoop gives it: kRowAlign, kFeatureAlign, kKeyPad, dq_features): rows of a group
// to 32 (zero Q / dO rows, P = dS = 0), D and Dv to 32 (ldq, ldo; zero features), the keys of a
// tile to 32 (np): S / dP of keys past n are computed and ignored, P^T / dS^T / dS rows past n are
// zero, so dK / dV of the next keys (or of the kKeyPad padding rows) get exact zeros. K^T columns
// past the item are zero; a partial last 32-key step of dQ^T reads a zero-padded copy of its K^T
// columns (ktail), so a key outside the tile (maybe inf or NaN) never meets a zero dS pair.
//
// P and dS are rounded to bf16 (round to nearest even) only as operands of dV, dK and dQ, as
// FlashAttention-2 does and as backward_bf16.h does; S, dP, P, dS, D_i and every accumulator stay
// float32. Inputs are bf16 already, so packing them is exact. The tile order of every product is
// fixed by the shapes, so results do not depend on the thread count.
//
// Tiles are configured per item (one configuration: 8 tiles of 16 rows x 64 bytes; tmm0-3 C,
// tmm4-5 A, tmm6-7 B) and released after it. float32 and float16 inputs keep BackwardLoop<V512x46>.
#pragma once
#include <immintrin.h>

#include "amx_tiles.h"
#include "backward_bf16.h"
#include "backward_loop.h"
#include "gemm_bf16.h"
#include "vec_avx512.h"

namespace fa2cpu {
namespace {

// C[i][j] (+)= sum_{t < pairs} A[i][2t] B[t][j].lo + A[i][2t+1] B[t][j].hi for i < m, j < n
// (m, n multiples of 32, pairs of 16). a: bf16 rows of stride lda elements; b: uint32 pairs of
// stride ldb; c: float32 of stride ldc. a_last (stride lda_last, when not null) replaces a's
// columns of the last 16-pair step.
template <bool kAccumulate>
inline void tile_gemm(const uint16_t* a, int64_t lda, const uint16_t* a_last, int64_t lda_last, const uint32_t* b,
                      int64_t ldb, int64_t pairs, int64_t m, int64_t n, float* c, int64_t ldc) {
    const int64_t last = pairs - 16;
    for (int64_t i = 0; i < m; i += 32) {
        for (int64_t j = 0; j < n; j += 32) {
            float* c0 = c + i * ldc + j;
            float* c1 = c + (i + 16) * ldc + j;
            if (kAccumulate) {
                _tile_loadd(0, c0, ldc * 4);
                _tile_loadd(1, c0 + 16, ldc * 4);
                _tile_loadd(2, c1, ldc * 4);
                _tile_loadd(3, c1 + 16, ldc * 4);
            } else {
                _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            }
            for (int64_t t = 0; t < pairs; t += 16) {
                if (a_last && t == last) {
                    _tile_loadd(4, a_last + i * lda_last, lda_last * 2);
                    _tile_loadd(5, a_last + (i + 16) * lda_last, lda_last * 2);
                } else {
                    _tile_loadd(4, a + i * lda + 2 * t, lda * 2);
                    _tile_loadd(5, a + (i + 16) * lda + 2 * t, lda * 2);
                }
                _tile_loadd(6, b + t * ldb + j, ldb * 4);
                _tile_loadd(7, b + t * ldb + j + 16, ldb * 4);
                _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
            }
            _tile_stored(0, c0, ldc * 4);
            _tile_stored(1, c0 + 16, ldc * 4);
            _tile_stored(2, c1, ldc * 4);
            _tile_stored(3, c1 + 16, ldc * 4);
        }
    }
}

struct AmxProducts {
    static constexpr int W = 16;
#ifndef FA2CPU_AMX_BWD_RB
#define FA2CPU_AMX_BWD_RB 96
#endif
    // Rows per block: 96 = 3 pairs of 16-row tiles. 192 (one block per group) measured no faster
    // (alternating runs, 1 thread, bf16 B=1 H=4 N=2048 D=128, full: 169 and 150 GFLOP/s against
    // 174 and 144 for 96). Only 96 is tested: 32 (with FA2CPU_AMX_BWD_UPDATE_BLOCKS=6) ran
    // 0.96-0.99x and gave other causal bits, failing 2 backward tests (bench/RESULTS.md session 61).
    static constexpr int RB = FA2CPU_AMX_BWD_RB;
    static constexpr int64_t BC = V512::BC;
    // Rows per group (FA2CPU_AMX_BWD_GROUP_ROWS overrides it for experiments): 384 with 2 or 4
    // blocks per update measured 0.95-1.03x against 192 (bench/RESULTS.md, session 41).
#ifndef FA2CPU_AMX_BWD_GROUP_ROWS
#define FA2CPU_AMX_BWD_GROUP_ROWS 192
#endif
    static constexpr int64_t kGroupRows = FA2CPU_AMX_BWD_GROUP_ROWS;
    static constexpr int64_t kRowAlign = 32, kFeatureAlign = 32, kKeyPad = 32;
    // Row blocks per dV / dK update (backward_loop.h F32Products): their C tiles (dvall / dkall,
    // 64 KB each for a 128-key tile at D = 128, from L2) are loaded and stored once per update,
    // beside 3 tdpbf16ps steps per 96 rows. Two blocks (the whole group) halve that traffic:
    // 1.02-1.04x on the 2-core Xeon with AMX, full and causal, same bits (session 41). P^T, dS^T
    // and the dS pairs hold the group's rows side by side (row r of the group in column r), so a
    // run of blocks is one operand.
#ifndef FA2CPU_AMX_BWD_UPDATE_BLOCKS
#define FA2CPU_AMX_BWD_UPDATE_BLOCKS 2
#endif
    static constexpr int kUpdateBlocks = FA2CPU_AMX_BWD_UPDATE_BLOCKS;
    static_assert(kUpdateBlocks * RB <= kGroupRows, "a run lies within its group");
    static int64_t dq_features(int64_t D) { return round_up(D, 32); }
    static_assert(RB % 32 == 0 && kGroupRows % RB == 0 && BC % 32 == 0, "whole 2 x 2 tile blocks");

    struct Bufs {
        uint16_t *kr, *vr, *kT, *ktail, *pT, *dsT, *qs, *dos;
        uint32_t *qp, *dop, *qrp, *dorp, *dsp;
        int64_t keys, ldq, ldo, ldkt;  // ldq / ldo: D / Dv rounded up to 32 (dkall / dvall too)
        int64_t r0;                    // the row block scores() took last, whose P / dS follow
    };
    // kr [keys + 32][ldq], vr [keys + 32][ldo]: K / V rows, bf16, zero padded (A of S, dP)
    // kT [ldq][ldkt]: K^T, zero past D and past the keys (A of dQ^T); ktail [ldq][32]: see above
    // qp [ldq/2][GR], dop [ldo/2][GR]: Q / dO pairs along features (B of S, dP)
    // qrp [GR/2][ldq], dorp [GR/2][ldo]: Q / dO pairs of rows (B of dK, dV)
    // pT, dsT [BC][GR] bf16: P^T, dS^T of the group's rows (A of dV, dK); dsp [BC/2][GR]: dS key pairs
    // qs [GR][ldq], dos [GR][ldo]: the group's Q / dO rows in bf16 (pack_row), which finish_rows
    //   turns into the four pair layouts by 16 x 16 transposes and row-pair interleaves
    static Bufs carve(const Params& p, int64_t keys, float* base, int64_t* floats) {
        Bufs x;
        x.ldq = round_up(p.d, 32);
        x.ldo = round_up(p.dv, 32);
        x.keys = keys;
        x.ldkt = round_up(keys, 32) + 32;
        Carver c{base};
        auto pairs = [&](int64_t n) { return reinterpret_cast<uint32_t*>(c.take(n)); };
        auto halves = [&](int64_t n) { return reinterpret_cast<uint16_t*>(c.take((n + 1) / 2)); };
        x.kr = halves((keys + kKeyPad) * x.ldq);
        x.vr = halves((keys + kKeyPad) * x.ldo);
        x.kT = halves(x.ldq * x.ldkt);
        x.ktail = halves(x.ldq * 32);
        x.pT = halves(BC * kGroupRows);
        x.dsT = halves(BC * kGroupRows);
        x.qp = pairs(x.ldq / 2 * kGroupRows);
        x.dop = pairs(x.ldo / 2 * kGroupRows);
        x.qrp = pairs(kGroupRows / 2 * x.ldq);
        x.dorp = pairs(kGroupRows / 2 * x.ldo);
        x.dsp = pairs(BC / 2 * kGroupRows);
        x.qs = halves(kGroupRows * x.ldq);
        x.dos = halves(kGroupRows * x.ldo);
        *floats = c.used;
        return x;
    }
    static int64_t panel(int64_t r, int64_t features, int64_t f) { return (r / RB) * features * RB + f * RB + r % RB; }

    // Key c's K and V rows, bf16 (BackwardLoop: pack_key from float32 rows, or, for contiguous
    // bf16 rows, pack_key_raw from the input itself); finish_keys then builds K^T from the rows.
    static void pack_key(Bufs& x, int64_t c, const float* k, const float* v, int64_t D, int64_t Dv) {
        if (c == 0) pad_keys(x);
        // k, v hold bf16 values (this policy runs bf16 inputs only): the conversions are exact.
        Bf16RowStage::to_bf16(x.kr + c * x.ldq, x.ldq, k, D);
        Bf16RowStage::to_bf16(x.vr + c * x.ldo, x.ldo, v, Dv);
    }
    static void pack_key_raw(Bufs& x, int64_t c, const uint16_t* k, const uint16_t* v, int64_t D, int64_t Dv) {
        if (c == 0) pad_keys(x);
        Bf16RowStage::copy_bf16(x.kr + c * x.ldq, x.ldq, k, D);
        Bf16RowStage::copy_bf16(x.vr + c * x.ldo, x.ldo, v, Dv);
    }
    // The padding: K / V rows past the keys, K^T columns past them (its rows past D come from
    // the K rows' zero features).
    static void pad_keys(Bufs& x) {
        std::memset(x.kr + x.keys * x.ldq, 0, size_t(kKeyPad * x.ldq) * 2);
        std::memset(x.vr + x.keys * x.ldo, 0, size_t(kKeyPad * x.ldo) * 2);
        for (int64_t d = 0; d < x.ldq; ++d)
            std::memset(x.kT + d * x.ldkt + x.keys, 0, size_t(x.ldkt - x.keys) * 2);
    }
    // K^T [ldq][ldkt] from the K rows (vec_avx512.h).
    static void finish_keys(Bufs& x) { transpose_bf16_rows(x.kr, x.ldq, x.keys, x.ldq, x.kT, x.ldkt); }
    // Row r of the group from contiguous bf16 rows as they are (the float32 round trip of
    // pack_row gives the same operands: tdpbf16ps reads bf16 denormals as zero either way), and
    // its D_i = sum_j dO[j] O[j] with BackwardLoop::row_dot's arithmetic on the same float32
    // values (same bits).
    static float pack_row_raw(Bufs& x, int64_t r, const uint16_t* q, const uint16_t* dO, const uint16_t* o, int64_t D,
                              int64_t Dv) {
        Bf16RowStage::copy_bf16(x.qs + r * x.ldq, x.ldq, q, D);
        Bf16RowStage::copy_bf16(x.dos + r * x.ldo, x.ldo, dO, Dv);
        return Bf16RowStage::row_dot(dO, o, Dv);
    }
    // Row r of the group into the bf16 staging rows (q / dO null: a padding row of zeros).
    static void pack_row(Bufs& x, int64_t r, const float* q, const float* dO, int64_t D, int64_t Dv) {
        Bf16RowStage::to_bf16(x.qs + r * x.ldq, x.ldq, q, D);
        Bf16RowStage::to_bf16(x.dos + r * x.ldo, x.ldo, dO, Dv);
    }
    // The M staged rows (M a multiple of 32) into the pair layouts (backward_bf16.h).
    static void finish_rows(Bufs& x, int64_t M, int64_t, int64_t) {
        Bf16RowStage::to_pairs<kGroupRows>(x.qs, x.ldq, M, x.qp, x.qrp, x.ldq);
        Bf16RowStage::to_pairs<kGroupRows>(x.dos, x.ldo, M, x.dop, x.dorp, x.ldo);
    }

    static void scores(Bufs& x, int nv, int64_t r0, int64_t ck, int64_t n, int64_t, int64_t, float* s, float* dp) {
        const int64_t np = round_up(n, 32), rows = nv * W;
        x.r0 = r0;
        tile_gemm<false>(x.kr + ck * x.ldq, x.ldq, nullptr, 0, x.qp + r0, kGroupRows, x.ldq / 2, np, rows, s, RB);
        tile_gemm<false>(x.vr + ck * x.ldo, x.ldo, nullptr, 0, x.dop + r0, kGroupRows, x.ldo / 2, np, rows, dp, RB);
    }
    // P^T, dS^T and the dS pairs straight from the softmax gradient (gemm_bf16.h); nothing in
    // float32. BackwardLoop takes a PairStore per row block: its pointers live in locals, where a
    // call through Bufs reloaded them after every vector store (which may alias Bufs' fields).
    struct PairStore {
        uint16_t *pT, *dsT;
        uint32_t* dsp;
        void operator()(int64_t c, int v, bool both, __m512 pr0, __m512 ds0, __m512 pr1, __m512 ds1) const {
            store_gradient_pair_bf16<kGroupRows>(pT, dsT, dsp, c, v, both, pr0, ds0, pr1, ds1);
        }
    };
    static PairStore pair_store(const Bufs& x) { return {x.pT + x.r0, x.dsT + x.r0, x.dsp + x.r0}; }
    // The run's rows [r0, r0 + real) (whole blocks of RB but the group's last, all of one key
    // range; rows to kRowAlign are padding, P = dS = 0): dV and dK reduce over all of them at
    // once, dQ^T block by block (its panels).
    static void updates(Bufs& x, int, int64_t r0, int64_t real, int64_t ck, int64_t n, int64_t, const float*,
                        const float*, float* dkall, float* dvall, float* dqT) {
        const int64_t np = round_up(n, 32), rows = round_up(real, kRowAlign);
        // P^T, dS^T (pair_store) zero past n, the dS pairs past ceil(n / 2).
        for (int64_t c = n; c < np; ++c)
            for (int64_t r = r0; r < r0 + rows; r += W) {
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(x.pT + c * kGroupRows + r), _mm256_setzero_si256());
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(x.dsT + c * kGroupRows + r), _mm256_setzero_si256());
            }
        for (int64_t c2 = (n + 1) / 2; c2 < np / 2; ++c2)
            for (int64_t r = r0; r < r0 + rows; r += W) _mm512_storeu_si512(x.dsp + c2 * kGroupRows + r, _mm512_setzero_si512());
        const int64_t pr0 = r0 / 2;
        tile_gemm<true>(x.pT + r0, kGroupRows, nullptr, 0, x.dorp + pr0 * x.ldo, x.ldo, rows / 2, np, x.ldo, dvall + ck * x.ldo, x.ldo);
        tile_gemm<true>(x.dsT + r0, kGroupRows, nullptr, 0, x.qrp + pr0 * x.ldq, x.ldq, rows / 2, np, x.ldq, dkall + ck * x.ldq, x.ldq);
        // dQ^T: the last step's K^T columns from a zero-padded copy when n is not whole steps.
        const uint16_t* tail = nullptr;
        if (n % 32) {
            const int64_t c0 = ck + (n / 32) * 32, m = n % 32;
            for (int64_t d = 0; d < x.ldq; ++d) {
                std::memcpy(x.ktail + d * 32, x.kT + d * x.ldkt + c0, size_t(m) * 2);
                std::memset(x.ktail + d * 32 + m, 0, size_t(32 - m) * 2);
            }
            tail = x.ktail;
        }
        for (int64_t b = r0; b < r0 + rows; b += RB) {
            const int64_t m = r0 + rows - b < RB ? r0 + rows - b : RB;
            tile_gemm<true>(x.kT + ck, x.ldkt, tail, 32, x.dsp + b, kGroupRows, np / 2, x.ldq, m, dqT + b * x.ldq, RB);
        }
    }
};

// The backward of the amx family: bf16 inputs on AMX tiles, float32 / float16 on float32 FMAs.
struct AmxBackward {
    using F32 = BackwardLoop<V512x46>;  // vec_avx512.h: 4 x 6 blocking on Intel
    using Amx = BackwardLoop<V512, AmxProducts>;
    static_assert(F32::BC == Amx::BC, "one key tile for the driver's splits");
    static constexpr int64_t BC = F32::BC;
    static int64_t scratch_floats(const BackwardParams& p, int64_t keys) {
        return DType(p.f.dtype) == DType::bf16 ? Amx::scratch_floats(p, keys) : F32::scratch_floats(p, keys);
    }
    static void run_item(const BackwardParams& p, const BackwardItem& it, float* scratch, float* dq_part) {
        if (DType(p.f.dtype) != DType::bf16) return F32::run_item(p, it, scratch, dq_part);
        configure_full_tiles();
        Amx::run_item(p, it, scratch, dq_part);
        _tile_release();
    }
};

}  // namespace
}  // namespace fa2cpu
