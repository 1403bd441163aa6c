// Decode GEMM policy for AVX2 + FMA + F16C (the avx2 family): decode_operands.h's layouts and
// loops with 8-float vectors. Without it the avx2 family ran decode through its tile loop, whose
// 8-row vectors are mostly padding there and which packs every K/V tile: 34 % (float32 cache)
// and 14 % (bf16) of the read bandwidth on a 2-core Zen 3 (B=16 Hq=32 Hk=8 Nk=8192 D=128,
// bench/RESULTS.md "2-core AMD EPYC Zen 3").
//   QK: acc[2 keys][4 rows] += K[key][8 d] * Q[row][8 d], 8 accumulators + 4 q + 1 K vector of
//       the 16 ymm registers, reduced to one score each by an 8-vector hadd tree
//   PV: O[row][16 dv] += P[row][key] (broadcast) * V[key][16 dv]   (4 rows x 2 vectors)
// Every element type is converted to float32 in registers (int8 / float8 codes too: their scales
// join per key, as in gemm_decode.h's DecodeGemm); rows shorter than a vector are read through a
// zeroed copy, never past the row.
#pragma once
#include <immintrin.h>

#include <cstring>

#include "decode_operands.h"
#include "routes.h"
#include "tile_loop.h"

namespace fa2cpu {
namespace {

// Element readers: load(p) = 8 values as float32 x 1/kUnit (see gemm_decode.h's F32Elem ...);
// load_part(p, n) the first n < 8 of them, zeros after, reading only those n.
template <class Self, class T_>
struct Elem8 {
    using T = T_;
    static __m256 load_part(const T* p, int64_t n) {
        alignas(32) T buf[8] = {};
        std::memcpy(buf, p, size_t(n) * sizeof(T));
        return Self::load(buf);
    }
};
struct F32x8 : Elem8<F32x8, float> {
    static constexpr bool kCodes = false;
    static constexpr float kUnit = 1.f;
    static __m256 load(const T* p) { return _mm256_loadu_ps(p); }
};
struct Bf16x8 : Elem8<Bf16x8, uint16_t> {
    static constexpr bool kCodes = false;
    static constexpr float kUnit = 1.f;
    static __m256 load(const T* p) {
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
};
struct F16x8 : Elem8<F16x8, uint16_t> {
    static constexpr bool kCodes = false;
    static constexpr float kUnit = 1.f;
    static __m256 load(const T* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
};
struct I8x8 : Elem8<I8x8, int8_t> {
    static constexpr bool kCodes = true;
    static constexpr float kUnit = 1.f;
    static __m256 load(const T* p) {
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    }
};
// float8_e4m3fn: the float16 trick of gemm_decode.h's F8Elem (2^-8 times the value; kUnit = 256
// restores it), NaN codes (S.1111.111) made NaN by a blend.
struct F8x8 : Elem8<F8x8, uint8_t> {
    static constexpr bool kCodes = true;
    static constexpr float kUnit = 256.f;
    static __m256 load(const T* p) {
        const __m128i x = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
        const __m128i mag = _mm_and_si128(x, _mm_set1_epi16(0x7f));
        const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_xor_si128(x, mag), 8), _mm_slli_epi16(mag, 7));
        const __m256 nan = _mm256_castsi256_ps(_mm256_cvtepi16_epi32(_mm_cmpeq_epi16(mag, _mm_set1_epi16(0x7f))));
        return _mm256_blendv_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(NAN), nan);
    }
};

template <class E>
struct DecodeGemm8 : DecodeOperands<E, 4> {
    using B = DecodeOperands<E, 4>;
    using typename B::T;
    using typename B::Scales;
    using B::RG;
    using B::dp;
    static constexpr int W = 8, RV = 8, RB = 64;  // 8 row vectors: kMaxRows rows
    static constexpr int64_t kRowAlign = 8;
    static constexpr int KB = 2;  // QK block: 2 keys x 4 rows = 8 accumulators, one vector of sums
    static_assert(KB * RG == 8, "one vector of sums");

    // n (may be <= 0 or >= 8) values from p: a plain load for 8, zeros for none.
    static __m256 load_n(const T* p, int64_t n) {
        return n >= 8 ? E::load(p) : n > 0 ? E::load_part(p, n) : _mm256_setzero_ps();
    }

    // The 8 horizontal sums of v[0..7] as one vector (lane i = sum of v[i]).
    static __m256 sums8(const __m256* v) {
        const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));  // [0..3 lo | 0..3 hi]
        const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
        return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
    }

    static void qk(const ItemOperands& x, const RowBlock& block, const KvTile& kt, int64_t nc, float* s) {
        const T* k = static_cast<const T*>(kt.data);
        const int64_t D = x.d, Dp = dp(D), ldk = kt.ld;
        const float* q = x.q + block.r0 * Dp;
        B::for_groups(block, kt, nc, [&](int64_t cb, int64_t ce, int r, const int64_t* off, const Scales& ks, bool one, bool pf) {
            if (one) qk_group<true>(q + r * Dp, Dp, D, k, ldk, off, ks, cb, ce, s + r, kt.prefetch, pf);
            else qk_group<false>(q + r * Dp, Dp, D, k, ldk, off, ks, cb, ce, s + r, kt.prefetch, pf);
        });
    }
    // 8 features at d of the group's rows against keys kr: kPart reads only D - d of them.
    template <bool kOneHead, bool kPart>
    static inline __attribute__((always_inline)) void qk_chunk(__m256 (&acc)[KB][RG], const float* qr, int64_t Dp,
                                                               int64_t d, int64_t D, const T* const (&kr)[KB],
                                                               const int64_t* off, int64_t pf, bool prefetch) {
        __m256 qv[RG];
#pragma GCC unroll 4
        for (int j = 0; j < RG; ++j) qv[j] = _mm256_loadu_ps(qr + j * Dp + d);
#pragma GCC unroll 2
        for (int i = 0; i < KB; ++i) {
#pragma GCC unroll 4
            for (int j = 0; j < RG; ++j) {
                if (kOneHead && j > 0) {  // one K vector for the group's rows
                    continue;
                }
                const T* at = kr[i] + off[j] + d;
                // One prefetch per 64-byte line: d is a multiple of 8 elements.
                if ((prefetch || !kOneHead) && (d * int64_t(sizeof(T))) % 64 == 0 && (j == 0 || off[j] != off[j - 1]))
                    _mm_prefetch(reinterpret_cast<const char*>(at + pf), _MM_HINT_T1);
                const __m256 kv = kPart ? E::load_part(at, D - d) : E::load(at);
                if constexpr (kOneHead) {
#pragma GCC unroll 4
                    for (int jj = 0; jj < RG; ++jj) acc[i][jj] = _mm256_fmadd_ps(kv, qv[jj], acc[i][jj]);
                } else {
                    acc[i][j] = _mm256_fmadd_ps(kv, qv[j], acc[i][j]);
                }
            }
        }
    }
    template <bool kOneHead>
    static void qk_group(const float* qr, int64_t Dp, int64_t D, const T* k, int64_t ldk, const int64_t* off,
                         const Scales& ks, int64_t cb, int64_t ce, float* s, int64_t pf, bool prefetch) {
        for (int64_t c = cb; c < ce; c += KB) {
            const int64_t nkb = ce - c < KB ? ce - c : KB;
            const T* kr[KB];
            B::key_rows(k, c, nkb, ldk, kr);
            __m256 acc[KB][RG];
#pragma GCC unroll 2
            for (int i = 0; i < KB; ++i)
#pragma GCC unroll 4
                for (int j = 0; j < RG; ++j) acc[i][j] = _mm256_setzero_ps();
            int64_t d = 0;
            for (; d + 8 <= D; d += 8) qk_chunk<kOneHead, false>(acc, qr, Dp, d, D, kr, off, pf, prefetch);
            if (d < D) qk_chunk<kOneHead, true>(acc, qr, Dp, d, D, kr, off, pf, prefetch);
            __m256 total = sums8(&acc[0][0]);  // lane i*RG + j: key c+i, row j
            if constexpr (E::kCodes) {
                alignas(32) float f[KB * RG];
                for (int i = 0; i < KB; ++i)
                    for (int j = 0; j < RG; ++j) f[i * RG + j] = i < nkb ? ks.factor(j, c + i) : 0.f;
                total = _mm256_mul_ps(total, _mm256_load_ps(f));
            }
            alignas(32) float sum[KB * RG];
            _mm256_store_ps(sum, total);
            for (int i = 0; i < nkb; ++i) std::memcpy(s + (c + i) * RB, sum + i * RG, RG * sizeof(float));
        }
    }

    // Columns [j, j + 16) of O's rows of a group += sum over keys [0, nk) of P x V; P[c][i] at
    // p[c * ldp + i] (V's scales already in), V row c at v + c * ldv; kPart: the last columns of
    // a row shorter than j + 16 (V read only up to Dv).
    template <bool kOneHead, bool kPart>
    static void pv_block(const float* p, int64_t ldp, int64_t nk, const T* v, int64_t ldv, const int64_t* off,
                         int64_t Dv, int64_t j, float* orow, int64_t n, int64_t pf, bool prefetch) {
        constexpr int NV = 2;
        __m256 acc[RG][NV];
#pragma GCC unroll 4
        for (int i = 0; i < RG; ++i)
#pragma GCC unroll 2
            for (int t = 0; t < NV; ++t) acc[i][t] = _mm256_loadu_ps(orow + i * n + j + 8 * t);
        auto load = [&](const T* at, int t) { return kPart ? load_n(at + 8 * t, Dv - j - 8 * t) : E::load(at + 8 * t); };
        // One prefetch per 64-byte line, spread over the key loop: issued all at once (per key
        // block, in QK and PV) they ran the float32 cache 0.76x as fast on the 2-core Zen 3.
        const bool line = (j * int64_t(sizeof(T))) % 64 == 0;
        for (int64_t c = 0; c < nk; ++c) {
            const T* vr = v + c * ldv + j;
            const float* pc = p + c * ldp;
            if constexpr (kOneHead) {
                if (prefetch && line) _mm_prefetch(reinterpret_cast<const char*>(vr + pf + off[0]), _MM_HINT_T1);
                const __m256 v0 = load(vr + off[0], 0), v1 = load(vr + off[0], 1);
#pragma GCC unroll 4
                for (int i = 0; i < RG; ++i) {
                    const __m256 pr = _mm256_broadcast_ss(pc + i);
                    acc[i][0] = _mm256_fmadd_ps(pr, v0, acc[i][0]);
                    acc[i][1] = _mm256_fmadd_ps(pr, v1, acc[i][1]);
                }
            } else {
#pragma GCC unroll 4
                for (int i = 0; i < RG; ++i) {
                    if (line && (i == 0 || off[i] != off[i - 1]))
                        _mm_prefetch(reinterpret_cast<const char*>(vr + pf + off[i]), _MM_HINT_T1);
                    const __m256 pr = _mm256_broadcast_ss(pc + i);
                    acc[i][0] = _mm256_fmadd_ps(pr, load(vr + off[i], 0), acc[i][0]);
                    acc[i][1] = _mm256_fmadd_ps(pr, load(vr + off[i], 1), acc[i][1]);
                }
            }
        }
#pragma GCC unroll 4
        for (int i = 0; i < RG; ++i)
#pragma GCC unroll 2
            for (int t = 0; t < NV; ++t) _mm256_storeu_ps(orow + i * n + j + 8 * t, acc[i][t]);
    }
    // Keys [cb, ce) of a group: the V scales of a quantized cache folded into P once per key and
    // row (not once per column block), then the column blocks.
    template <bool kOneHead>
    static void pv_group(const float* s, int64_t cb, int64_t ce, const T* v, int64_t ldv, const int64_t* off,
                         const Scales& vs, int64_t Dv, float* orow, int64_t n, int64_t pf, bool prefetch) {
        const float* p = s + cb * RB;
        int64_t ldp = RB;
        alignas(32) float scaled[B::KBLK * RG];
        if constexpr (E::kCodes) {
            for (int64_t c = cb; c < ce; ++c)
                for (int i = 0; i < RG; ++i) scaled[(c - cb) * RG + i] = s[c * RB + i] * vs.factor(i, c);
            p = scaled;
            ldp = RG;
        }
        const T* vb = v + cb * ldv;
        int64_t j = 0;
        for (; j + 16 <= Dv; j += 16) pv_block<kOneHead, false>(p, ldp, ce - cb, vb, ldv, off, Dv, j, orow, n, pf, prefetch);
        if (j < Dv) pv_block<kOneHead, true>(p, ldp, ce - cb, vb, ldv, off, Dv, j, orow, n, pf, prefetch);
    }
    static void pv(const ItemOperands& x, const RowBlock& block, float* s, int64_t nc, const KvTile& vt) {
        const T* v = static_cast<const T*>(vt.data);
        const int64_t Dv = x.dv, n = dp(Dv), ldv = vt.ld;
        B::for_groups(block, vt, nc, [&](int64_t cb, int64_t ce, int r, const int64_t* off, const Scales& vs, bool one, bool pf) {
            float* orow = x.o + (block.r0 + r) * n;
            if (one) pv_group<true>(s + r, cb, ce, v, ldv, off, vs, Dv, orow, n, vt.prefetch, pf);
            else pv_group<false>(s + r, cb, ce, v, ldv, off, vs, Dv, orow, n, vt.prefetch, pf);
        });
    }
};

// The decode route of the avx2 family (routes.h): every K/V dtype through the float32 products.
template <class V256>
using Avx2DecodeRoute = DecodeRoute<TileLoop<V256, DecodeGemm8<F32x8>>, TileLoop<V256, DecodeGemm8<F16x8>>,
                                    TileLoop<V256, DecodeGemm8<Bf16x8>>, TileLoop<V256, DecodeGemm8<I8x8>>,
                                    TileLoop<V256, DecodeGemm8<F8x8>>>;

}  // namespace
}  // namespace fa2cpu
