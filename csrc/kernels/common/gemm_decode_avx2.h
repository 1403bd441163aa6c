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
// zeroed copy, never past the row. An int8 cache read by bf16 / fp16 queries takes int16 products
// instead (Q16DecodeGemm8, below).
#pragma once
#include <immintrin.h>

#include <cfloat>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "../../dispatch/cpu_features.h"
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
    static constexpr bool kLoad16 = false;  // whether qk reads K 16 codes at a time (load16)
    static constexpr bool kSplit16 = false;  // whether load16 gives features (even | odd), see Bf16x8
    static __m256 load_part(const T* p, int64_t n) {
        alignas(32) T buf[8] = {};
        std::memcpy(buf, p, size_t(n) * sizeof(T));
        return Self::load(buf);
    }
    // 16 values from p: two loads (F8x8 converts all 16 codes with 256-bit integer operations).
    static void load16(const T* p, __m256& lo, __m256& hi) {
        lo = Self::load(p);
        hi = Self::load(p + 8);
    }
};
struct F32x8 : Elem8<F32x8, float> {
    static constexpr bool kCodes = false;
    static constexpr float kUnit = 1.f;
    static __m256 load(const T* p) { return _mm256_loadu_ps(p); }
};
// bfloat16. kSplit: load16 widens 16 values from one 256-bit load as the even features (each
// dword's low half shifted up) and the odd ones (its high half, masked): 2 integer operations per
// 16 instead of 2 zero-extensions (vpmovzxwd ymm, m128: 1.9 cycles each on Zen 1) and 2 shifts.
// Both products then take whole 16-feature blocks in that order: q is packed (pack_q_row) and O is
// kept (o_elem) with each whole block's features as [0, 2, .., 14, 1, 3, .., 15]; a block cut by
// D or Dv stays in natural order (load / load_n). See DecodeGemm8::perm16 and Avx2Bf16Decode.
template <bool kSplit>
struct Bf16x8 : Elem8<Bf16x8<kSplit>, uint16_t> {
    using T = uint16_t;
    static constexpr bool kCodes = false;
    static constexpr bool kLoad16 = kSplit;
    static constexpr bool kSplit16 = kSplit;
    static constexpr float kUnit = 1.f;
    static __m256 load(const T* p) {
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    // The even / odd features of 16 values held in w (one 256-bit load) as float32.
    static __m256 even(__m256i w) { return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)); }
    static __m256 odd(__m256i w) { return _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(int32_t(0xffff0000u)))); }
    // 16 values from p: kSplit, (even features, odd features); else (first 8, next 8).
    static void load16(const T* p, __m256& a, __m256& b) {
        if constexpr (kSplit) {
            const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
            a = even(w);
            b = odd(w);
        } else {
            a = load(p);
            b = load(p + 8);
        }
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
// restores it). The codes are sign-extended to 16 bits, so one shift by 7 puts the magnitude
// (E.MMM) under the float16 exponent / mantissa and the sign at bit 15, with a stray bit 14 for
// negative codes that one AND clears. NaN codes (S.1111.111: the shifted value | 0xc000 is
// 0xff80) become 0xffff, a float16 NaN, while still 16-bit, not by a float32 blend, whose 16->32-bit
// mask widening crosses 128-bit lanes (~1.25 cycles on Zen 3). 6 integer operations and the
// conversion per 8 codes (zero-extension, sign and magnitude apart: 9); load16 does the integer
// part for 16 codes in 256-bit registers (5 operations, a lane extract, two conversions), and
// both products use it: fp8 decode 1.10-1.14x, then 1.12-1.17x on Zen 3 (bench/RESULTS.md).
struct F8x8 : Elem8<F8x8, uint8_t> {
    static constexpr bool kCodes = true;
    static constexpr bool kLoad16 = true;
    static constexpr float kUnit = 256.f;
    static __m256 load(const T* p) {
        const __m128i t = _mm_slli_epi16(_mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))), 7);
        const __m128i nan = _mm_cmpeq_epi16(_mm_or_si128(t, _mm_set1_epi16(int16_t(0xc000))), _mm_set1_epi16(int16_t(0xff80)));
        return _mm256_cvtph_ps(_mm_or_si128(_mm_and_si128(t, _mm_set1_epi16(int16_t(0xbfff))), nan));
    }
    static void load16(const T* p, __m256& lo, __m256& hi) {
        const __m256i t = _mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 7);
        const __m256i nan = _mm256_cmpeq_epi16(_mm256_or_si256(t, _mm256_set1_epi16(int16_t(0xc000))),
                                               _mm256_set1_epi16(int16_t(0xff80)));
        const __m256i h = _mm256_or_si256(_mm256_and_si256(t, _mm256_set1_epi16(int16_t(0xbfff))), nan);
        lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
        hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
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

    // Where feature j of a row of n values (D for q, Dv for O) lies in this policy's q and O
    // rows: E::kSplit16 keeps each whole 16-feature block as its even features, then its odd ones.
    static int64_t perm16(int64_t j, int64_t n) {
        if (!E::kSplit16 || (j / 16) * 16 + 16 > n) return j;
        const int64_t t = j % 16;
        return j - t + (t % 2 ? 8 + t / 2 : t / 2);
    }
    // DecodeOperands' q / O layouts with perm16's order (the same layouts without E::kSplit16).
    static void pack_q_row(float* q, int64_t M, int64_t r, const float* row, int64_t D, float qscale) {
        if constexpr (!E::kSplit16) return B::pack_q_row(q, M, r, row, D, qscale);
        float* o = q + r * dp(D);
        for (int64_t d = 0; d < D; ++d) o[perm16(d, D)] = row[d] * qscale;
        for (int64_t d = D; d < dp(D); ++d) o[d] = 0.f;
    }
    static float o_elem(const float* o, int64_t M, int64_t Dv, int64_t r, int64_t j) {
        return B::o_elem(o, M, Dv, r, perm16(j, Dv));
    }

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
            if (one) qk_group<true>(q + r * Dp, Dp, D, k, ldk, off, ks, cb, ce, s + r, kt.far_at(cb), pf);
            else qk_group<false>(q + r * Dp, Dp, D, k, ldk, off, ks, cb, ce, s + r, kt.far_at(cb), pf);
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
    // 16 features at d (two qk_chunk steps; with E::kSplit16 the block's even features, then its
    // odd ones, against q packed in that order) with the K codes of a key converted together
    // (E::load16); q read from memory (8 q vectors would not fit registers).
    template <bool kOneHead>
    static inline __attribute__((always_inline)) void qk_chunk16(__m256 (&acc)[KB][RG], const float* qr, int64_t Dp,
                                                                 int64_t d, const T* const (&kr)[KB], const int64_t* off,
                                                                 int64_t pf, bool prefetch) {
        if constexpr (E::kSplit16 && kOneHead) {
            // One 256-bit load per key, then each half against q of the group's rows held in
            // registers for both keys (8 accumulators + 2 raw rows + 4 q + 1: 15 registers): half
            // the q loads of the form below, which on Zen 1 (two 128-bit loads a cycle) bounded it.
            __m256i raw[KB];
#pragma GCC unroll 2
            for (int i = 0; i < KB; ++i) {
                const T* at = kr[i] + off[0] + d;
                if (prefetch && (d * int64_t(sizeof(T))) % 64 == 0) _mm_prefetch(reinterpret_cast<const char*>(at + pf), _MM_HINT_T1);
                raw[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at));
            }
#pragma GCC unroll 2
            for (int h = 0; h < 2; ++h) {
                __m256 qv[RG];
#pragma GCC unroll 4
                for (int j = 0; j < RG; ++j) qv[j] = _mm256_loadu_ps(qr + j * Dp + d + 8 * h);
#pragma GCC unroll 2
                for (int i = 0; i < KB; ++i) {
                    const __m256 kv = h == 0 ? E::even(raw[i]) : E::odd(raw[i]);
#pragma GCC unroll 4
                    for (int j = 0; j < RG; ++j) acc[i][j] = _mm256_fmadd_ps(kv, qv[j], acc[i][j]);
                }
            }
            return;
        }
#pragma GCC unroll 2
        for (int i = 0; i < KB; ++i) {
#pragma GCC unroll 4
            for (int j = 0; j < RG; ++j) {
                if (kOneHead && j > 0) continue;
                const T* at = kr[i] + off[j] + d;
                if ((prefetch || !kOneHead) && (d * int64_t(sizeof(T))) % 64 == 0 && (j == 0 || off[j] != off[j - 1]))
                    _mm_prefetch(reinterpret_cast<const char*>(at + pf), _MM_HINT_T1);
                __m256 k0, k1;
                E::load16(at, k0, k1);
                if constexpr (kOneHead) {
#pragma GCC unroll 4
                    for (int jj = 0; jj < RG; ++jj)
                        acc[i][jj] = _mm256_fmadd_ps(k1, _mm256_loadu_ps(qr + jj * Dp + d + 8),
                                                     _mm256_fmadd_ps(k0, _mm256_loadu_ps(qr + jj * Dp + d), acc[i][jj]));
                } else {
                    acc[i][j] = _mm256_fmadd_ps(k1, _mm256_loadu_ps(qr + j * Dp + d + 8),
                                                _mm256_fmadd_ps(k0, _mm256_loadu_ps(qr + j * Dp + d), acc[i][j]));
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
            if constexpr (E::kLoad16)
                for (; d + 16 <= D; d += 16) qk_chunk16<kOneHead>(acc, qr, Dp, d, kr, off, pf, prefetch);
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

    // Columns [j, j + 16) of O's rows of a group (E::kSplit16 and a whole block: in perm16's
    // order, as load16 gives V's) += sum over keys [0, nk) of P x V; P[c][i] at
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
        // The 16 columns of V row `at` (kPart: the row's last Dv - j, zeros after).
        auto load = [&](const T* at, __m256& v0, __m256& v1) {
            if constexpr (kPart) {
                v0 = load_n(at, Dv - j);
                v1 = load_n(at + 8, Dv - j - 8);
            } else {
                E::load16(at, v0, v1);
            }
        };
        // One prefetch per 64-byte line, spread over the key loop: issued all at once (per key
        // block, in QK and PV) they ran the float32 cache 0.76x as fast on the 2-core Zen 3.
        const bool line = (j * int64_t(sizeof(T))) % 64 == 0;
        for (int64_t c = 0; c < nk; ++c) {
            const T* vr = v + c * ldv + j;
            const float* pc = p + c * ldp;
            if constexpr (kOneHead) {
                if (prefetch && line) _mm_prefetch(reinterpret_cast<const char*>(vr + pf + off[0]), _MM_HINT_T1);
                __m256 v0, v1;
                load(vr + off[0], v0, v1);
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
                    __m256 v0, v1;
                    load(vr + off[i], v0, v1);
                    acc[i][0] = _mm256_fmadd_ps(pr, v0, acc[i][0]);
                    acc[i][1] = _mm256_fmadd_ps(pr, v1, acc[i][1]);
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
            if (one) pv_group<true>(s + r, cb, ce, v, ldv, off, vs, Dv, orow, n, vt.far_at(cb), pf);
            else pv_group<false>(s + r, cb, ce, v, ldv, off, vs, Dv, orow, n, vt.far_at(cb), pf);
        });
    }
};

// Q16DecodeGemm8: an int8 cache read by bfloat16 / float16 queries, both decode products as
// pairwise int16 dot products (vpmaddwd: 16 multiply-adds in one instruction, plus a vpaddd into
// the int32 sums: the FMA's rate, without its two conversions per 8 codes). gemm_decode.h's
// Q16DecodeGemm<I8Int16Codes> (AVX512-VNNI) with 8-lane vectors, same rounding rules:
//   QK: each q row rounded to int16 with one float32 scale per row (a power of two times the
//       score scale, max |code| in [2^14, 2^15], 2^15 saturated); s[c][r] = qscale_r * kscale_c *
//       sum_d q16[r][d] * code[c][d], exact in int32 (|sum| <= 32768 * 128 * kMaxHeadDim = 2^30).
//   PV: per tile and row, w_c = P[r][c] * vscale_c rounded to int16 with one scale per (row,
//       tile) (max |w| maps to 32767); keys (c, c+1) share a dword (vpmaddwd's pairs): their V
//       codes sign-extended, then interleaved by 16-bit unpacks (see pv_block for the column
//       order); int32 sums over a tile (<= 256 keys: < 2^31) join the float32 O times that scale.
// Rounding (q to 2^-15 of its row's max |q|, weights to 2^-16 of the tile's max) is noise beside
// a bf16 / fp16 output; float32 queries keep the float32 route (tests/test_kvcache_quant.py's
// int16 tests bound the error). Why: on the 2-core Zen 3 the float32 route spent ~120 cycles per
// (key, kv head) of an int8 cache even with the cache in L3 (4 query rows: 128 FMAs, 64 cycles at
// two FMAs a cycle, plus 32 conversions, vpmovsxbd among them), and read 43 % of the bandwidth
// with 2 threads; this route ran that decode (B=16 Hq=32 Hk=8 Nk=8192 D=128, bf16 q) 1.26-1.44x
// as fast (bench/ab_inproc.py, same process, 1 and 2 threads).
// Layouts: Q int16 [M/RG][dp(D)/16][RG][16] (zero padded: a group's rows side by side per 16
// features), then float32 row scales [M]; O float32 [M][dp(Dv)] (DecodeGemm8's), then the tile's
// int32 PV sums [M][dp(Dv)] in pv_block's column order; P's int16 pairs overwrite s in place:
// pair c/2 of row r at dword [c/2][r].
struct Q16DecodeGemm8 : DecodeGemm8<I8x8> {
    using Base = DecodeGemm8<I8x8>;
    using Code = int8_t;
    static int64_t q_floats(int64_t D, int64_t M) { return M * dp(D) / 2 + M; }
    static int64_t o_floats(int64_t Dv, int64_t M) { return M * dp(Dv) + M * dp(Dv); }
    // Row r's first 16 features (its group's block, then r % RG rows in).
    template <class F>
    static auto q16(F* q, int64_t D, int64_t r) {
        using I = std::conditional_t<std::is_const<F>::value, const int16_t, int16_t>;
        return reinterpret_cast<I*>(q) + (r / RG) * RG * dp(D) + (r % RG) * 16;
    }

    // Row r: row[d] * 2^(15-e) rounded to nearest even (max |row| = f 2^e, f in [0.5, 1): codes
    // in [2^14, 2^15], 2^15 saturated), scale qscale * 2^(e-15); a non-finite row: zeros, NaN.
    // Vectorized: per call every q row passes here (a scalar loop cost ~40 us for 32 rows).
    static void pack_q_row(float* q, int64_t M, int64_t r, const float* row, int64_t D, float qscale) {
        int16_t* o = q16(q, D, r);
        const __m256 sign = _mm256_set1_ps(-0.f);
        __m256 amax = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) {
            const __m256 a = _mm256_andnot_ps(sign, D - d >= 8 ? _mm256_loadu_ps(row + d) : F32x8::load_part(row + d, D - d));
            bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, _mm256_set1_ps(FLT_MAX), _CMP_NLE_UQ));  // inf or NaN
            amax = _mm256_max_ps(amax, a);
        }
        alignas(32) float m8[8];
        _mm256_store_ps(m8, amax);
        float mx = 0.f;
        for (float x : m8) mx = std::fmax(mx, x);
        const bool ok = _mm256_movemask_ps(bad) == 0;
        int e = 0;
        if (ok) std::frexp(mx, &e);  // (a non-finite row's codes are zeros, below)
        // 2^(15-e) as one float when it is one (always, but for rows below ~2^-110)
        const bool direct = 15 - e <= 127;
        const __m256 f = _mm256_set1_ps(direct ? std::ldexp(1.f, 15 - e) : 0.f);
        for (int64_t d = 0; d < dp(D); d += 8) {
            const int64_t n = D - d < 8 ? D - d : 8;
            __m256i c = _mm256_setzero_si256();
            if (ok && n > 0 && direct) {
                c = _mm256_cvtps_epi32(_mm256_mul_ps(n == 8 ? _mm256_loadu_ps(row + d) : F32x8::load_part(row + d, n), f));  // exact product, nearest even
            } else if (ok && n > 0) {
                alignas(32) int32_t t[8] = {};
                for (int64_t i = 0; i < n; ++i) t[i] = int32_t(std::nearbyint(std::ldexp(row[d + i], 15 - e)));
                c = _mm256_load_si256(reinterpret_cast<const __m256i*>(t));
            }
            c = _mm256_min_epi32(c, _mm256_set1_epi32(32767));  // 2^15 (a rounded-up max) saturated
            const __m128i h = _mm_packs_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
            _mm_storeu_si128(reinterpret_cast<__m128i*>(o + (d / 16) * RG * 16 + d % 16), h);
        }
        q[M * dp(D) / 2 + r] = ok ? float(std::ldexp(double(qscale), e - 15)) : NAN;
    }
    static void zero_q_row(float* q, int64_t M, int64_t r, int64_t D) {
        for (int64_t d = 0; d < dp(D); d += 16) std::memset(q16(q, D, r) + (d / 16) * RG * 16, 0, 16 * sizeof(int16_t));
        q[M * dp(D) / 2 + r] = 0.f;
    }

    // Lanes below n as a vector mask.
    static __m256i lanes_below8(int n) { return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)); }
    // The scales of key c of a K/V tile for 8 row lanes whose kv heads (relative to the item's
    // first) are kv_head[0..7], non-decreasing and adjacent: a masked load and a permute where the
    // heads' scales are adjacent too (head stride 1: the (B, N, H) scale layout), else per lane;
    // 1 without scales.
    struct LaneScales {
        const float* base = nullptr;
        int64_t ld = 0;
        bool adjacent = false;
        __m256i idx, m;
        int64_t at[8];
        LaneScales(const KvTile& t, const int32_t* kv_head) {
            if (!t.scale) return;
            base = t.scale + kv_head[0] * t.scale_head_stride;
            ld = t.scale_ld;
            alignas(32) int32_t rel[8];
            for (int l = 0; l < 8; ++l) {
                rel[l] = kv_head[l] - kv_head[0];
                at[l] = int64_t(rel[l]) * t.scale_head_stride;
            }
            adjacent = t.scale_head_stride == 1;
            idx = _mm256_load_si256(reinterpret_cast<const __m256i*>(rel));
            m = lanes_below8(rel[7] + 1);
        }
        __m256 at_key(int64_t c) const {
            if (!base) return _mm256_set1_ps(1.f);
            const float* p = base + c * ld;
            if (adjacent) return _mm256_permutevar8x32_ps(_mm256_maskload_ps(p, m), idx);
            return _mm256_setr_ps(p[at[0]], p[at[1]], p[at[2]], p[at[3]], p[at[4]], p[at[5]], p[at[6]], p[at[7]]);
        }
    };
    // 16 codes from p; kMasked: only n of them (zeros past n, nothing read there).
    template <bool kMasked>
    static __m128i bytes16(const Code* p, int64_t n) {
        if (!kMasked) return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
        alignas(16) Code buf[16] = {};
        if (n > 0) std::memcpy(buf, p, size_t(n < 16 ? n : 16));
        return _mm_load_si128(reinterpret_cast<const __m128i*>(buf));
    }
    // acc + pairwise products of a and b (vpmaddwd, vpaddd into acc). Written as asm: gcc's
    // builtins put each sum in a fresh register and copied it back (a vmovdqa per product).
    static inline __attribute__((always_inline)) __m256i dot(__m256i acc, __m256i a, __m256i b) {
        __m256i t;
        __asm__("vpmaddwd %3, %2, %1\n\tvpaddd %1, %0, %0" : "+x"(acc), "=&x"(t) : "x"(a), "xm"(b));
        return acc;
    }
    static inline __attribute__((always_inline)) __m256i dot_r(__m256i acc, __m256i a, __m256i b) {  // b in a register
        __m256i t;
        __asm__("vpmaddwd %3, %2, %1\n\tvpaddd %1, %0, %0" : "+x"(acc), "=&x"(t) : "x"(a), "x"(b));
        return acc;
    }
    // The 8 horizontal sums of v[0..7] as one vector (lane i = sum of v[i]) by in-lane unpacks
    // and adds (vphaddd costs ~2.2 cycles on Zen 3, an unpack or add 0.25-0.5), then one
    // exchange of the 128-bit halves.
    static __m256i sums8(const __m256i* v) {
        auto pair = [](__m256i a, __m256i b) {  // [a0+a2, b0+b2, a1+a3, b1+b3] per half
            return _mm256_add_epi32(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b));
        };
        auto quad = [](__m256i ab, __m256i cd) {  // [a, b, c, d] per half
            return _mm256_add_epi32(_mm256_unpacklo_epi64(ab, cd), _mm256_unpackhi_epi64(ab, cd));
        };
        const __m256i lo = quad(pair(v[0], v[1]), pair(v[2], v[3])), hi = quad(pair(v[4], v[5]), pair(v[6], v[7]));
        return _mm256_add_epi32(_mm256_permute2x128_si256(lo, hi, 0x20), _mm256_permute2x128_si256(lo, hi, 0x31));
    }

    // s[c*RB + r] = q_r . k_c: int32 dot products by groups of RG rows (key blocks outer, as in
    // DecodeGemm8::qk), then one pass over the block scaling each by its row's and key's scales.
    static void qk(const ItemOperands& x, const RowBlock& block, const KvTile& kt, int64_t nc, float* s) {
        const Code* k = static_cast<const Code*>(kt.data);
        const int64_t D = x.d, Dq = dp(D), ldk = kt.ld;
        const int16_t* q = q16(x.q, D, block.r0);
        const int32_t* kv_head = block.kv_head;
        for (int64_t cb = 0; cb < nc; cb += KBLK) {
            const int64_t ce = cb + KBLK < nc ? cb + KBLK : nc;
            for (int r = 0; r < block.rows; r += RG) {
                int64_t off[RG];
                head_offsets(kv_head, r, kt, off);
                const bool first_of_head = r == 0 || kv_head[r - 1] != kv_head[r];
                if (off[0] == off[RG - 1]) qk_group<true>(q + r * Dq, D, k, ldk, off, cb, ce, s + r, kt.far_at(cb), kt.near_at(cb), first_of_head);
                else qk_group<false>(q + r * Dq, D, k, ldk, off, cb, ce, s + r, kt.far_at(cb), kt.near_at(cb), true);
            }
        }
        const float* qs = x.q + x.M * Dq / 2 + block.r0;
        for (int v = 0; v < block.vectors; ++v) {
            const LaneScales ks(kt, kv_head + v * W);
            const __m256 rs = _mm256_loadu_ps(qs + v * W);
            for (int64_t c = 0; c < nc; ++c) {
                float* sp = s + c * RB + v * W;
                _mm256_storeu_ps(sp, _mm256_mul_ps(_mm256_loadu_ps(sp), _mm256_mul_ps(rs, ks.at_key(c))));
            }
        }
    }
    // The K lines at feature d of keys kr (the group's distinct heads) prefetched: into L2
    // prefetch_keys ahead (pf), into L1 one key block ahead (a block is ~5 us of work at 8 heads;
    // measured 1.07-1.10x on the 2-core Zen 3 over the far prefetch alone).
    template <bool kOneHead>
    static inline __attribute__((always_inline)) void qk_prefetch(const Code* const (&kr)[KB], const int64_t* off, int64_t d,
                                                                  int64_t pf, int64_t pf0) {
#pragma GCC unroll 2
        for (int i = 0; i < KB; ++i)
#pragma GCC unroll 4
            for (int j = 0; j < (kOneHead ? 1 : RG); ++j)
                if (j == 0 || off[j] != off[j - 1]) {
                    _mm_prefetch(reinterpret_cast<const char*>(kr[i] + pf + off[j] + d), _MM_HINT_T1);
                    _mm_prefetch(reinterpret_cast<const char*>(kr[i] + pf0 + off[j] + d), _MM_HINT_T0);
                }
    }
    // 16 features at d of the group's rows (q: qg + d * RG, row j 16 further) against keys kr.
    template <bool kOneHead, bool kMasked>
    static inline __attribute__((always_inline)) void qk_chunk(__m256i (&acc)[KB][RG], const int16_t* qg, int64_t d,
                                                               int64_t D, const Code* const (&kr)[KB], const int64_t* off) {
        // q in registers for both keys: loads (two 32-byte loads a cycle) bound this loop else
        __m256i qv[RG];
#pragma GCC unroll 4
        for (int j = 0; j < RG; ++j) qv[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg + d * RG) + j);
#pragma GCC unroll 2
        for (int i = 0; i < KB; ++i) {
            if constexpr (kOneHead) {
                const __m256i kv = _mm256_cvtepi8_epi16(bytes16<kMasked>(kr[i] + off[0] + d, D - d));
#pragma GCC unroll 4
                for (int j = 0; j < RG; ++j) acc[i][j] = dot_r(acc[i][j], kv, qv[j]);
            } else {
#pragma GCC unroll 4
                for (int j = 0; j < RG; ++j) {
                    const __m256i kv = _mm256_cvtepi8_epi16(bytes16<kMasked>(kr[i] + off[j] + d, D - d));
                    acc[i][j] = dot_r(acc[i][j], kv, qv[j]);
                }
            }
        }
    }
    template <bool kOneHead>
    static void qk_group(const int16_t* qg, int64_t D, const Code* k, int64_t ldk, const int64_t* off, int64_t cb,
                         int64_t ce, float* s, int64_t pf, int64_t pf0, bool prefetch) {
        for (int64_t c = cb; c < ce; c += KB) {
            const int64_t nkb = ce - c < KB ? ce - c : KB;
            const Code* kr[KB];
            key_rows(k, c, nkb, ldk, kr);
            __m256i acc[KB][RG];
#pragma GCC unroll 2
            for (int i = 0; i < KB; ++i)
#pragma GCC unroll 4
                for (int j = 0; j < RG; ++j) acc[i][j] = _mm256_setzero_si256();
            // 64 features (one line of codes) at a time, then 16, then the tail (D % 16) through a copy
            int64_t d = 0;
            for (; d + 64 <= D; d += 64) {
                if (prefetch) qk_prefetch<kOneHead>(kr, off, d, pf, pf0);
#pragma GCC unroll 4
                for (int64_t e = d; e < d + 64; e += 16) qk_chunk<kOneHead, false>(acc, qg, e, D, kr, off);
            }
            if (d < D && prefetch) qk_prefetch<kOneHead>(kr, off, d, pf, pf0);
            for (; d + 16 <= D; d += 16) qk_chunk<kOneHead, false>(acc, qg, d, D, kr, off);
            if (d < D) qk_chunk<kOneHead, true>(acc, qg, d, D, kr, off);
            const __m256i t = sums8(&acc[0][0]);  // lane i*RG + j: key c+i, row j
            alignas(32) float sum[KB * RG];
            _mm256_store_ps(sum, _mm256_cvtepi32_ps(t));
            for (int i = 0; i < nkb; ++i) std::memcpy(s + (c + i) * RB, sum + i * RG, RG * sizeof(float));
        }
    }

    // P of one row vector (s + v*W, nc keys) times V's scales -> int16 pairs in place;
    // wscale[l] = lane l's scale (NaN where a weight is not finite).
    static void quantize_p(float* s, int64_t nc, const KvTile& vt, const int32_t* kv_head, float* wscale) {
        const LaneScales vs(vt, kv_head);
        const __m256 inf = _mm256_set1_ps(INFINITY), sign = _mm256_set1_ps(-0.f);
        __m256 wmax = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
        for (int64_t c = 0; c < nc; ++c) {
            const __m256 w = _mm256_mul_ps(_mm256_loadu_ps(s + c * RB), vs.at_key(c));
            _mm256_storeu_ps(s + c * RB, w);
            const __m256 aw = _mm256_andnot_ps(sign, w);
            bad = _mm256_or_ps(bad, _mm256_cmp_ps(aw, inf, _CMP_NLT_UQ));  // inf or NaN
            wmax = _mm256_max_ps(wmax, aw);  // may drop a NaN: `bad` keeps it
        }
        // inv <= 32767 / wmax keeps |w| * inv <= 32767 (rounded: 32767); 0 for an all-zero row
        const __m256 pos = _mm256_cmp_ps(wmax, _mm256_setzero_ps(), _CMP_GT_OQ);
        const __m256 inv = _mm256_and_ps(pos, _mm256_min_ps(_mm256_div_ps(_mm256_set1_ps(32767.f), wmax), _mm256_set1_ps(FLT_MAX)));
        _mm256_storeu_ps(wscale, _mm256_blendv_ps(_mm256_mul_ps(wmax, _mm256_set1_ps(1.f / 32767.f)), _mm256_set1_ps(NAN), bad));
        int32_t* pairs = reinterpret_cast<int32_t*>(s);
        for (int64_t c = 0; c < nc; c += 2) {  // pair c/2 lands at key slot c/2 <= c: read before written
            const __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(s + c * RB), inv));
            const __m256i hi = c + 1 < nc ? _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(s + (c + 1) * RB), inv))
                                          : _mm256_setzero_si256();
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(pairs + (c / 2) * RB),
                                _mm256_or_si256(_mm256_and_si256(lo, _mm256_set1_epi32(0xffff)), _mm256_slli_epi32(hi, 16)));
        }
    }

    // acc[i][j, j + 16) += sum over keys [cb, ce) of the pairs' products: the codes of keys c and
    // c+1 sign-extended (from memory: vpmovsxbw from a register costs ~1.25 cycles on Zen 3, from
    // memory 0.5) and interleaved by 16-bit unpacks, which stay in their 128-bit halves: x[0] =
    // columns j + {0-3, 8-11}, x[1] = j + {4-7, 12-15}, each as (c, c+1) pairs (pv puts the
    // columns back in order).
    // kPf: prefetch the lines of both keys (a block whose j starts a line), into L2
    // prefetch_keys ahead (pf) and into L1 one key block ahead, as qk_prefetch.
    template <bool kOneHead, bool kMasked, bool kPf>
    static inline __attribute__((always_inline)) void pv_pair(__m256i (&a)[RG][2], const Code* v0, const Code* v1,
                                                              const int32_t* w, const int64_t* off, int64_t left,
                                                              int64_t pf, int64_t pf0) {
        __m256i x[2];
#pragma GCC unroll 4
        for (int i = 0; i < RG; ++i) {
            if (kOneHead ? i == 0 : (i == 0 || off[i] != off[i - 1])) {
                if (kPf) {
                    _mm_prefetch(reinterpret_cast<const char*>(v0 + pf + off[i]), _MM_HINT_T1);
                    _mm_prefetch(reinterpret_cast<const char*>(v1 + pf + off[i]), _MM_HINT_T1);
                    _mm_prefetch(reinterpret_cast<const char*>(v0 + pf0 + off[i]), _MM_HINT_T0);
                    _mm_prefetch(reinterpret_cast<const char*>(v1 + pf0 + off[i]), _MM_HINT_T0);
                }
                const __m256i a = _mm256_cvtepi8_epi16(bytes16<kMasked>(v0 + off[i], left));
                const __m256i b = _mm256_cvtepi8_epi16(bytes16<kMasked>(v1 + off[i], left));
                x[0] = _mm256_unpacklo_epi16(a, b);
                x[1] = _mm256_unpackhi_epi16(a, b);
            }
            const __m256i wi = _mm256_set1_epi32(w[i]);
            a[i][0] = dot(a[i][0], x[0], wi);
            a[i][1] = dot(a[i][1], x[1], wi);
        }
    }
    template <bool kOneHead, bool kMasked, bool kPf>
    static void pv_pairs(__m256i (&a)[RG][2], int64_t cb, int64_t ce, const Code* v0, int64_t ldv, const int32_t* w,
                         const int64_t* off, int64_t left, int64_t pf, int64_t pf0) {
        int64_t c = cb;
        for (; c + 1 < ce; c += 2, v0 += 2 * ldv, w += RB) pv_pair<kOneHead, kMasked, kPf>(a, v0, v0 + ldv, w, off, left, pf, pf0);
        if (c < ce) pv_pair<kOneHead, kMasked, kPf>(a, v0, v0, w, off, left, pf, pf0);  // an odd last key pairs with itself (weight 0)
    }
    // kOne: the tile is this one key block; its sums start from zero and are added to O (o: the
    // group's first row, stride ldo; wscale: the rows' weight scales) instead of being stored.
    template <bool kOneHead, bool kMasked, bool kOne>
    static void pv_block(const int32_t* wp, int64_t cb, int64_t ce, const Code* v, int64_t ldv, const int64_t* off,
                         int64_t n, int64_t j, int32_t* acc, int64_t lda, int64_t pf, int64_t pf0, bool prefetch,
                         float* o, int64_t ldo, const float* wscale) {
        __m256i a[RG][2];
#pragma GCC unroll 4
        for (int i = 0; i < RG; ++i)
#pragma GCC unroll 2
            for (int t = 0; t < 2; ++t)
                a[i][t] = kOne ? _mm256_setzero_si256() : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc + i * lda + j + 8 * t));
        const Code* v0 = v + cb * ldv + j;
        const int32_t* w = wp + (cb / 2) * RB;
        if ((prefetch || !kOneHead) && j % 64 == 0) pv_pairs<kOneHead, kMasked, true>(a, cb, ce, v0, ldv, w, off, n - j, pf, pf0);
        else pv_pairs<kOneHead, kMasked, false>(a, cb, ce, v0, ldv, w, off, n - j, pf, pf0);
#pragma GCC unroll 4
        for (int i = 0; i < RG; ++i) {
            if constexpr (kOne) {
                join16(a[i][0], a[i][1], wscale[i], o + i * ldo + j);
            } else {
#pragma GCC unroll 2
                for (int t = 0; t < 2; ++t) _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + i * lda + j + 8 * t), a[i][t]);
            }
        }
    }
    // o[0..15] += the sums of pv_block's order ({0-3, 8-11}, {4-7, 12-15}) x f, in column order.
    static inline __attribute__((always_inline)) void join16(__m256i x0, __m256i x1, float f, float* o) {
        const __m256 fv = _mm256_set1_ps(f);
        const __m256 first = _mm256_cvtepi32_ps(_mm256_permute2x128_si256(x0, x1, 0x20));
        const __m256 second = _mm256_cvtepi32_ps(_mm256_permute2x128_si256(x0, x1, 0x31));
        _mm256_storeu_ps(o, _mm256_fmadd_ps(first, fv, _mm256_loadu_ps(o)));
        _mm256_storeu_ps(o + 8, _mm256_fmadd_ps(second, fv, _mm256_loadu_ps(o + 8)));
    }
    template <bool kOne>
    static inline __attribute__((always_inline)) void pv_columns(const int32_t* wp, int64_t cb, int64_t ce, const Code* v,
                                                                 int64_t ldv, const int64_t* off, int64_t Dv, int32_t* a,
                                                                 int64_t lda, int64_t pf, int64_t pf0, bool one,
                                                                 bool first_of_head, float* o, int64_t ldo,
                                                                 const float* wscale) {
        int64_t j = 0;
        for (; j + 16 <= Dv; j += 16) {  // whole 16-column blocks: plain loads
            if (one) pv_block<true, false, kOne>(wp, cb, ce, v, ldv, off, Dv, j, a, lda, pf, pf0, first_of_head, o, ldo, wscale);
            else pv_block<false, false, kOne>(wp, cb, ce, v, ldv, off, Dv, j, a, lda, pf, pf0, true, o, ldo, wscale);
        }
        if (j < Dv) {                    // the tail: 1..15 columns
            if (one) pv_block<true, true, kOne>(wp, cb, ce, v, ldv, off, Dv, j, a, lda, pf, pf0, first_of_head, o, ldo, wscale);
            else pv_block<false, true, kOne>(wp, cb, ce, v, ldv, off, Dv, j, a, lda, pf, pf0, true, o, ldo, wscale);
        }
    }

    // O[r0 + r][:] += sum_c P[r][c] V[c][:]: P rounded to int16 pairs, int32 sums per tile (key
    // blocks outer as in DecodeGemm8::pv), then added to O times their scale; a tile of one key
    // block (a paged cache of 16-key blocks) keeps its sums in registers (pv_block's kOne), as
    // gemm_decode.h's Q16DecodeGemm::pv does.
    static void pv(const ItemOperands& x, const RowBlock& block, float* s, int64_t nc, const KvTile& vt) {
        const Code* v = static_cast<const Code*>(vt.data);
        const int64_t Dv = x.dv, n = dp(Dv), ldv = vt.ld, rows = round_up(block.rows, RG);
        const int32_t* kv_head = block.kv_head;
        alignas(32) float wscale[RB];
        for (int vv = 0; vv < block.vectors; ++vv) quantize_p(s + vv * W, nc, vt, kv_head + vv * W, wscale + vv * W);
        int32_t* acc = reinterpret_cast<int32_t*>(x.o + x.M * n) + block.r0 * n;
        const bool one_block = nc <= KBLK;
        if (!one_block) std::memset(acc, 0, size_t(rows * n) * sizeof(int32_t));
        const int32_t* pairs = reinterpret_cast<const int32_t*>(s);
        for (int64_t cb = 0; cb < nc; cb += KBLK) {
            static_assert(KBLK % 2 == 0, "key blocks hold whole pairs");
            const int64_t ce = cb + KBLK < nc ? cb + KBLK : nc;
            for (int r = 0; r < rows; r += RG) {
                int64_t off[RG];
                head_offsets(kv_head, r, vt, off);
                const bool one = off[0] == off[RG - 1], first_of_head = r == 0 || kv_head[r - 1] != kv_head[r];
                float* o = x.o + (block.r0 + r) * n;
                if (one_block) pv_columns<true>(pairs + r, cb, ce, v, ldv, off, Dv, acc + r * n, n, vt.far_at(cb), vt.near_at(cb), one, first_of_head, o, n, wscale + r);
                else pv_columns<false>(pairs + r, cb, ce, v, ldv, off, Dv, acc + r * n, n, vt.far_at(cb), vt.near_at(cb), one, first_of_head, o, n, wscale + r);
            }
        }
        if (one_block) return;
        for (int64_t r = 0; r < rows; ++r) {
            float* o = x.o + (block.r0 + r) * n;
            const int32_t* a = acc + r * n;
            for (int64_t j = 0; j < n; j += 16)
                join16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + j)),
                       _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + j + 8)), wscale[r], o + j);
        }
    }
};

// The bf16 cache's decode loop of the avx2 family: the split widening (Bf16x8<true>) on AMD cores,
// the zero-extension form elsewhere, chosen once per process. In-process A/B against the
// zero-extension form (bench/ab_inproc.py T decode bf16, B=16 Hq=32 Hk=8 Nk=8192 D=128): Zen 1
// 1.16x at 2 threads; the AMX test machine's Intel cores with the avx2 family forced 0.87-1.02x
// over 13 pairs (median 0.95; that machine's two-package A/Bs are loose, a same-code control
// moved 20 % in a later call). A suspect there: one 32-byte load per 16 values crosses a line at
// every other step of NumPy's rows, which start 16 bytes past a line; two 16-byte loads cost Zen 1
// 5 % and did not help on Intel. FA2CPU_AVX2_BF16_WIDEN=split|zext overrides the choice (tests
// run both).
struct Avx2Bf16Pick {
    static constexpr const char* kEnv = "FA2CPU_AVX2_BF16_WIDEN";
    static constexpr const char* kNames[] = {"split", "zext"};
    static int index() { return cpu_features().amd ? 0 : 1; }
};
template <class V256>
using Avx2Bf16Decode =
    PickedLoop<Avx2Bf16Pick, TileLoop<V256, DecodeGemm8<Bf16x8<true>>>, TileLoop<V256, DecodeGemm8<Bf16x8<false>>>>;

// The decode route of the avx2 family (routes.h): every K/V dtype through the float32 products,
// but an int8 cache read by 16-bit queries: int16 products.
template <class V256>
using Avx2DecodeRoute = DecodeRoute<TileLoop<V256, DecodeGemm8<F32x8>>, TileLoop<V256, DecodeGemm8<F16x8>>,
                                    Avx2Bf16Decode<V256>, TileLoop<V256, DecodeGemm8<I8x8>>,
                                    TileLoop<V256, DecodeGemm8<F8x8>>, TileLoop<V256, Q16DecodeGemm8>>;

}  // namespace
}  // namespace fa2cpu
