// Decode GEMM policy (AVX-512): decode_operands.h's layouts and loops (feature axis in lanes, K/V
// read in place and converted to float32 in registers, items spanning kv heads) with 16-float
// vectors. Decode is memory-bound; this keeps the instruction count per byte read low:
//   QK: acc[4 keys][4 rows] += K[key][16 d] * Q[row][16 d], reduced to one score each at the end
//   PV: O[row][64 dv] += P[row][key] (broadcast) * V[key][64 dv]        (4 rows x 4 vectors)
// The decode route (kernels/common/routes.h) runs it for sequences with at most kRowsPerHead rows
// per kv head; where the cache interleaves heads within a position ((B, N, H, D) layouts, paged
// or not) its items span up to kMaxRows / rows kv heads, whose K/V rows for a key are then one
// contiguous run, streamed once, instead of one short run per item a head-size stride apart.
#pragma once
#include <immintrin.h>

#include <cstring>
#include <type_traits>

#include "../../dispatch/cpu_features.h"
#include "kernel.h"
#include "decode_operands.h"
#include "policy.h"
#include "routes.h"
#include "tile_loop.h"
#include "vec_avx512.h"

namespace fa2cpu {
namespace {

// Element readers: load(p, m) = 16 values (lanes outside m zero) as float32 x 1/kUnit; kCodes:
// codes of a quantized cache (Params::kv_dtype), whose per-key scales (KvTile::scale) the QK
// micro-kernel applies to each score and the PV micro-kernel to each probability, times kUnit,
// both after the key's products: dequantization costs one multiply per key and row.
struct F32Elem {
    using T = float;
    static constexpr bool kCodes = false;
    static constexpr float kUnit = 1.f;
    static __m512 load(const T* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
};
struct Bf16Elem {
    using T = uint16_t;
    static constexpr bool kCodes = false;
    static constexpr float kUnit = 1.f;
    static __m512 load(const T* p, __mmask16 m) {
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
    }
};
struct F16Elem {
    using T = uint16_t;
    static constexpr bool kCodes = false;
    static constexpr float kUnit = 1.f;
    static __m512 load(const T* p, __mmask16 m) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p)); }
};
struct I8Elem {
    using T = int8_t;
    static constexpr bool kCodes = true;
    static constexpr float kUnit = 1.f;
    static __m512 convert(__m128i x) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(x)); }  // 16 codes
    static __m512 load(const T* p, __mmask16 m) { return convert(_mm_maskz_loadu_epi8(m, p)); }
};
// float8_e4m3fn: the code's exponent and mantissa bits moved up into a float16's (sign to bit
// 15, the rest from bit 7) give the same number with a float16 bias (15 for 7): 2^-8 times the
// value, normal and subnormal alike, converted by vcvtph2ps; kUnit = 256 restores it. The NaN
// codes (S.1111.111, which would read as 480 / 256) become NaN. The codes are sign-extended, so
// one shift by 7 moves both: the sign lands on bit 15 with a stray bit 14 for negative codes,
// which the AND clears (the NaN test sees S.1111.111 as 0xff80 once bits 15-14 are set).
struct F8Elem {
    using T = uint8_t;
    static constexpr bool kCodes = true;
    static constexpr float kUnit = 256.f;
    static __m512 convert(__m128i codes) {  // 16 codes
        const __m256i t = _mm256_slli_epi16(_mm256_cvtepi8_epi16(codes), 7);
        const __m256i h = _mm256_and_si256(t, _mm256_set1_epi16(int16_t(0xbfff)));
        const __mmask16 nan = _mm256_cmpeq_epi16_mask(_mm256_or_si256(t, _mm256_set1_epi16(int16_t(0xc000))),
                                                      _mm256_set1_epi16(int16_t(0xff80)));
        return _mm512_mask_mov_ps(_mm512_cvtph_ps(h), nan, _mm512_set1_ps(NAN));
    }
    static __m512 load(const T* p, __mmask16 m) { return convert(_mm_maskz_loadu_epi8(m, p)); }
};

template <class E>
struct DecodeGemm : DecodeOperands<E, 4> {
    using B = DecodeOperands<E, 4>;
    using typename B::T;
    using typename B::Scales;
    using B::RG;
    using B::KBLK;
    using B::dp;
    using B::key_rows;
    using B::head_offsets;
    static constexpr int W = 16, RV = 4, RB = 64;  // 4 row vectors: kMaxRows rows
    static constexpr int64_t kRowAlign = 16;
    static constexpr int KB = 4;             // QK block: 4 keys x 4 rows = 16 accumulators

    // Scores of keys [c, c + nkb): lane i*RG + j of total to s[(c + i)*RB + j].
    static void store_scores(__m512 total, int64_t c, int64_t nkb, float* s) {
        alignas(64) float sum[KB * RG];
        _mm512_store_ps(sum, total);
        for (int i = 0; i < nkb; ++i) std::memcpy(s + (c + i) * RB, sum + i * RG, RG * sizeof(float));
    }

    // s[c*RB + r] = q_r . k_c for the block's rows, in groups of RG rows (rows past `rows` have
    // zero q). Key blocks of KBLK are the outer loop so that, when an item spans several kv heads
    // of a (B, N, H, D) cache, the rows of all its heads for those keys (contiguous) are read
    // together. A group whose rows share a kv head loads each K vector once for all of them.
    static void qk(const ItemOperands& x, const RowBlock& block, const KvTile& kt, int64_t nc, float* s) {
        const T* k = static_cast<const T*>(kt.data);
        const int64_t D = x.d, Dp = dp(D), ldk = kt.ld;
        const float* q = x.q + block.r0 * Dp;
        B::for_groups(block, kt, nc, [&](int64_t cb, int64_t ce, int r, const int64_t* off, const Scales& ks, bool one, bool pf) {
            if (one) qk_group<true>(q + r * Dp, Dp, D, k, ldk, off, ks, cb, ce, s + r, kt.far_at(cb), pf);
            else qk_group<false>(q + r * Dp, Dp, D, k, ldk, off, ks, cb, ce, s + r, kt.far_at(cb), pf);
        });
    }
    template <bool kOneHead>
    static void qk_group(const float* qr, int64_t Dp, int64_t D, const T* k, int64_t ldk, const int64_t* off,
                         const Scales& ks, int64_t cb, int64_t ce, float* s, int64_t pf, bool prefetch) {
        for (int64_t c = cb; c < ce; c += KB) {
            const int64_t nkb = ce - c < KB ? ce - c : KB;
            const T* kr[KB];
            key_rows(k, c, nkb, ldk, kr);
            __m512 acc[KB][RG];
#pragma GCC unroll 4
            for (int i = 0; i < KB; ++i)
#pragma GCC unroll 4
                for (int j = 0; j < RG; ++j) acc[i][j] = _mm512_setzero_ps();
            for (int64_t d = 0; d < Dp; d += 16) {
                const __mmask16 m = lanes_below(D - d);
                __m512 qv[RG];
#pragma GCC unroll 4
                for (int j = 0; j < RG; ++j) qv[j] = _mm512_loadu_ps(qr + j * Dp + d);
#pragma GCC unroll 4
                for (int i = 0; i < KB; ++i) {
                    if constexpr (kOneHead) {
                        if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(kr[i] + pf + off[0] + d), _MM_HINT_T1);
                        const __m512 kv = E::load(kr[i] + off[0] + d, m);
#pragma GCC unroll 4
                        for (int j = 0; j < RG; ++j) acc[i][j] = _mm512_fmadd_ps(kv, qv[j], acc[i][j]);
                    } else {
#pragma GCC unroll 4
                        for (int j = 0; j < RG; ++j) {
                            if (j == 0 || off[j] != off[j - 1])
                                _mm_prefetch(reinterpret_cast<const char*>(kr[i] + pf + off[j] + d), _MM_HINT_T1);
                            acc[i][j] = _mm512_fmadd_ps(E::load(kr[i] + off[j] + d, m), qv[j], acc[i][j]);
                        }
                    }
                }
            }
            __m512 total = sums16(acc);
            if constexpr (E::kCodes) {
                alignas(64) float f[KB * RG];
                for (int i = 0; i < KB; ++i)
                    for (int j = 0; j < RG; ++j) f[i * RG + j] = i < nkb ? ks.factor(j, c + i) : 0.f;
                total = _mm512_mul_ps(total, _mm512_load_ps(f));
            }
            store_scores(total, c, nkb, s);
        }
    }

    // The 16 horizontal sums of v[i*RG + j] (acc[i][j]) as one vector, lane i*RG + j: a
    // transpose-and-add tree (45 instructions instead of 16 reductions of ~9; in QK with D = 128
    // those were a third of the work). Per 128-bit block: unpack ps pairs, then pd pairs, then
    // fold blocks twice. `add` adds lanes (float32, or int32 sums seen through ps casts).
    static_assert(KB * RG == 16, "one vector of sums");
    template <class Add>
    static __m512 sums16(const __m512* v, Add add) {
        __m512 s1[8], s2[4];
        for (int j = 0; j < 8; ++j)  // block: [a0+a2, b0+b2, a1+a3, b1+b3]
            s1[j] = add(_mm512_unpacklo_ps(v[2 * j], v[2 * j + 1]), _mm512_unpackhi_ps(v[2 * j], v[2 * j + 1]));
        for (int j = 0; j < 4; ++j) {  // block: the block sums of v[4j .. 4j+3]
            const __m512d c = _mm512_castps_pd(s1[2 * j]), d = _mm512_castps_pd(s1[2 * j + 1]);
            s2[j] = add(_mm512_castpd_ps(_mm512_unpacklo_pd(c, d)), _mm512_castpd_ps(_mm512_unpackhi_pd(c, d)));
        }
        auto fold = [&](__m512 x, __m512 y) {  // blocks [x0+x1, x2+x3, y0+y1, y2+y3]
            return add(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
        };
        return fold(fold(s2[0], s2[1]), fold(s2[2], s2[3]));
    }
    static __m512 sums16(const __m512 (&acc)[KB][RG]) {
        return sums16(&acc[0][0], [](__m512 a, __m512 b) { return _mm512_add_ps(a, b); });
    }

    template <int NV, bool kOneHead>
    static void pv_block(const float* s, int64_t cb, int64_t ce, const T* v, int64_t ldv, const int64_t* off,
                         const Scales& vs, int64_t Dv, int64_t j, float* orow, int64_t n, int64_t pf, bool prefetch) {
        __m512 acc[RG][NV];
        __mmask16 m[NV];
#pragma GCC unroll 4
        for (int t = 0; t < NV; ++t) m[t] = lanes_below(Dv - (j + 16 * t));
#pragma GCC unroll 4
        for (int i = 0; i < RG; ++i)
#pragma GCC unroll 4
            for (int t = 0; t < NV; ++t) acc[i][t] = _mm512_loadu_ps(orow + i * n + j + 16 * t);
        for (int64_t c = cb; c < ce; ++c) {
            const T* vr = v + c * ldv + j;
            if constexpr (kOneHead) {
                __m512 vv[NV];
#pragma GCC unroll 4
                for (int t = 0; t < NV; ++t) {
                    if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(vr + pf + off[0] + 16 * t), _MM_HINT_T1);
                    vv[t] = E::load(vr + off[0] + 16 * t, m[t]);
                }
                const float f = E::kCodes ? vs.factor(0, c) : 1.f;  // one head: one scale per key
#pragma GCC unroll 4
                for (int i = 0; i < RG; ++i) {
                    const __m512 pr = _mm512_set1_ps(E::kCodes ? s[c * RB + i] * f : s[c * RB + i]);
#pragma GCC unroll 4
                    for (int t = 0; t < NV; ++t) acc[i][t] = _mm512_fmadd_ps(pr, vv[t], acc[i][t]);
                }
            } else {
#pragma GCC unroll 4
                for (int i = 0; i < RG; ++i) {
                    const __m512 pr = _mm512_set1_ps(E::kCodes ? s[c * RB + i] * vs.factor(i, c) : s[c * RB + i]);
#pragma GCC unroll 4
                    for (int t = 0; t < NV; ++t) {
                        if (i == 0 || off[i] != off[i - 1])
                            _mm_prefetch(reinterpret_cast<const char*>(vr + pf + off[i] + 16 * t), _MM_HINT_T1);
                        acc[i][t] = _mm512_fmadd_ps(pr, E::load(vr + off[i] + 16 * t, m[t]), acc[i][t]);
                    }
                }
            }
        }
#pragma GCC unroll 4
        for (int i = 0; i < RG; ++i)
#pragma GCC unroll 4
            for (int t = 0; t < NV; ++t) _mm512_storeu_ps(orow + i * n + j + 16 * t, acc[i][t]);
    }
    template <bool kOneHead>
    static void pv_group(const float* s, int64_t cb, int64_t ce, const T* v, int64_t ldv, const int64_t* off,
                         const Scales& vs, int64_t Dv, float* orow, int64_t n, int64_t pf, bool prefetch) {
        for (int64_t j = 0; j < n; j += 64) {
            switch ((n - j) / 16) {
                case 1: pv_block<1, kOneHead>(s, cb, ce, v, ldv, off, vs, Dv, j, orow, n, pf, prefetch); break;
                case 2: pv_block<2, kOneHead>(s, cb, ce, v, ldv, off, vs, Dv, j, orow, n, pf, prefetch); break;
                case 3: pv_block<3, kOneHead>(s, cb, ce, v, ldv, off, vs, Dv, j, orow, n, pf, prefetch); break;
                default: pv_block<4, kOneHead>(s, cb, ce, v, ldv, off, vs, Dv, j, orow, n, pf, prefetch); break;
            }
        }
    }

    // O[r0 + r][:] += sum_c P[r][c] V[c][:], key blocks outer (as in qk), 64 columns at a time.
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

// Q16DecodeGemm<C>: a quantized cache read by 16-bit queries with both decode products as
// pairwise 16-bit dot products (32 multiply-adds per instruction, twice an FMA's), the codes
// widened 32 at a time by C. Two instances:
//
// C = I8Int16Codes, an int8 cache read by bfloat16 / float16 queries on AVX-512: both decode
// products as int16 dot products (vpdpwssd, or vpmaddwd + vpaddd with the same bits on CPUs
// without AVX512-VNNI: I8Int16CodesT<false>; one vpmovsxbw per 32 codes instead of two
// conversions per 16). On the 2-core Xeon the float32 route
// spent ~110 cycles per (key, kv head) where a bf16 cache streams at ~55 on one core: the codes'
// arithmetic, not their bytes, set its speed.
//   QK: each q row is rounded to int16 with one float32 scale per row (a power of two times the
//       score scale, max |code| in [2^14, 2^15)); s[c][r] = qscale_r * kscale_c *
//       sum_d q16[r][d] * code[c][d], the sum exact in int32 (|sum| <= 32767 * 128 * kMaxHeadDim
//       < 2^31).
//   PV: per tile and row, w_c = P[r][c] * vscale_c is rounded to int16 with one scale per (row,
//       tile) (its max |w| maps to 32767); keys (c, c+1) share a dword (vpdpwssd's pairs) and their
//       V codes are interleaved bytewise, then sign-extended; int32 sums over a tile (<= BC = 256
//       keys: |sum| <= 32767 * 128 * 256 < 2^31) join the float32 O times that scale.
// Rounding: q to 2^-15 of its row's max |q| (bf16 values within 2^7 of it exact), each weight to
// 2^-16 of its tile's max weight; beside bf16 / fp16 outputs (2^-9 / 2^-11 relative) that is
// noise, so float32 queries keep the float32 route (tests/conftest.py's tolerance table). A non-finite q row or weight makes its row NaN.
// Layouts: Q int16 [M/RG][d32(D)/32][RG][32] (zero padded; a group's rows side by side per 32
// features: one pointer serves the QK loop), then a rotated copy of the same size (store_rotated:
// the one-head groups' QK), then float32 row scales [M]; O float32 [M][dp(Dv)]
// (DecodeGemm's), then the tile's int32 PV sums [M][d32(Dv)] in pair order: a 32-column group's
// first vector holds columns 0-7 and 16-23, its second 8-15 and 24-31 (the order vpunpck*bw
// leaves), put back in order when the tile's sums join O. P's int16 pairs overwrite s in place:
// pair c/2 of row r at dword [c/2][r].
// K / V lines are prefetched into L2 (_MM_HINT_T1) 64 keys ahead: 64 KB of codes for 8 kv heads,
// more than L1 holds beside the score block (prefetcht0 that far measured 10-15 % slower); and
// into L1 (_MM_HINT_T0) one key block (KBLK keys) ahead (prefetch_line).
//
// C = F8Bf16Codes, a float8_e4m3fn cache read by bfloat16 queries on AVX512-BF16: both products
// as bf16 pair dot products (vdpbf16ps), float32 sums. Every e4m3 value (subnormals included:
// the smallest, 2^-9, is a normal bf16) is a bf16 exactly, found by a 128-entry table lookup on
// the code's magnitude (two vpermt2w) with the sign or'ed in: ~7 operations per 32 codes where
// the float32 route spends ~18 per 32 and twice the FMAs. q rows are stored as they are (bf16
// values: exact) with the score scale applied per score, as above; P x v_scale is rounded to
// bf16 (<= 2^-8 of each weight, as much as the bf16 output's own rounding: the AMX prefill rounds
// P the same way), so float16 / float32 queries keep the float32 route. Same layouts, with bf16
// for int16 and float32 sums for int32 (row and weight scales 1 unless non-finite). Zen 4, B=16
// Hq=32 Hk=8 Nk=8192 bf16 q: 1.80-1.86x the float32 route's speed, about the bf16 cache's; on the
// AMX Xeon 1.12-1.22x (vdpbf16ps issues at half the FMA rate there: only the conversions gained).
// kVnni: vpdpwssd; else vpmaddwd + vpaddd (AVX-512 BW, for CPUs without AVX512-VNNI): the same
// exact int32 sums (no pair sum reaches 2^31: |q| <= 2^15 - 1, |code| <= 128), so the same bits.
template <bool kVnni>
struct I8Int16CodesT {
    using Elem = I8Elem;
    static constexpr bool kIntQ = true;  // q and P rounded to int16 with per-row / per-tile scales
    static __m512i widen(__m256i codes) { return _mm512_cvtepi8_epi16(codes); }
    // acc + pairwise products of a and b (vpdpwssd). Written as asm: gcc's builtin copies the
    // accumulator to a fresh register and back around every instruction (and spills them). The
    // asm also needs no -mavx512vnni: the avx512 family, built without it, runs this form only on
    // CPUs that have it (I8Decode16Loop below).
    static inline __attribute__((always_inline)) __m512i dot(__m512i acc, __m512i a, __m512i b) {
        if constexpr (kVnni) {
            __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "vm"(b));
            return acc;
        } else {
            return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
        }
    }
    static __m512 add(__m512 a, __m512 b) {  // the int32 sums, seen through float casts
        return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)));
    }
    static __m512 to_float(__m512 sums) { return _mm512_cvtepi32_ps(_mm512_castps_si512(sums)); }
    static __m512 to_float(__m512i sums) { return _mm512_cvtepi32_ps(sums); }
};
using I8Int16Codes = I8Int16CodesT<true>;

#ifdef __AVX512BF16__
// bf16 bits of the e4m3fn magnitude m (code & 0x7f): exponent e = m >> 3, mantissa f = m & 7;
// e > 0: (1 + f/8) 2^(e-7); e = 0: f 2^-9 (normalised: the top bit of f becomes the implicit one);
// m = 0x7f: NaN. Every e4m3 value is a normal bf16 (the smallest, 2^-9, included).
constexpr uint16_t e4m3_bf16_bits(int m) {
    const int e = m >> 3, f = m & 7;
    if (m == 0x7f) return 0x7fc0;
    if (e > 0) return uint16_t(((e + 120) << 7) | (f << 4));
    if (f == 0) return 0;
    const int h = f >= 4 ? 2 : f >= 2 ? 1 : 0;  // f = 2^h (1 + g / 2^h)
    return uint16_t(((h - 9 + 127) << 7) | ((f - (1 << h)) << (7 - h)));
}
struct E4m3Bf16Table {
    alignas(64) uint16_t bits[128];
    constexpr E4m3Bf16Table() : bits{} {
        for (int m = 0; m < 128; ++m) bits[m] = e4m3_bf16_bits(m);
    }
};
constexpr E4m3Bf16Table kE4m3Bf16{};

struct F8Bf16Codes {
    using Elem = F8Elem;
    static constexpr bool kIntQ = false;  // q as bf16, P x v_scale rounded to bf16
    // 32 codes -> their bf16 values: two 64-entry lookups (vpermt2w reads index bits 0-5), the
    // upper half's where bit 6 is set, then the sign bit moved up from bit 7.
    static __m512i widen(__m256i codes) {
        const __m512i x = _mm512_cvtepu8_epi16(codes);
        const __m512i* t = reinterpret_cast<const __m512i*>(kE4m3Bf16.bits);
        const __m512i lo = _mm512_permutex2var_epi16(_mm512_load_si512(t), x, _mm512_load_si512(t + 1));
        const __m512i hi = _mm512_permutex2var_epi16(_mm512_load_si512(t + 2), x, _mm512_load_si512(t + 3));
        const __m512i mag = _mm512_mask_mov_epi16(lo, _mm512_test_epi16_mask(x, _mm512_set1_epi16(0x40)), hi);
        return _mm512_ternarylogic_epi32(mag, _mm512_slli_epi16(x, 8), _mm512_set1_epi16(short(0x8000)), 0xf8);  // a | (b & c)
    }
    // acc + a.lo * b.lo + a.hi * b.hi per float32 lane, bf16 pairs (vdpbf16ps; asm as above).
    static inline __attribute__((always_inline)) __m512i dot(__m512i acc, __m512i a, __m512i b) {
        __asm__("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(a), "vm"(b));
        return acc;
    }
    static __m512 add(__m512 a, __m512 b) { return _mm512_add_ps(a, b); }
    static __m512 to_float(__m512 sums) { return sums; }
    static __m512 to_float(__m512i sums) { return _mm512_castsi512_ps(sums); }
    static __m256i to_bf16(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }  // to nearest even
};
#endif

template <class C>
struct Q16DecodeGemm : DecodeGemm<typename C::Elem> {
    using Base = DecodeGemm<typename C::Elem>;
    using Base::W;
    using Base::RB;
    using Base::RG;
    using Base::KB;
    using Base::KBLK;
    using Base::dp;
    using Base::key_rows;
    using Base::store_scores;
    using Base::head_offsets;
    using Base::sums16;
    using Code = typename C::Elem::T;  // int8_t / uint8_t
    // Lanes of x that are inf or NaN (a q row or weight with one makes its row NaN).
    static __mmask16 nonfinite(__m512 x) { return _mm512_cmp_ps_mask(_mm512_abs_ps(x), _mm512_set1_ps(FLT_MAX), _CMP_NLE_UQ); }
    static int64_t d32(int64_t n) { return round_up(n, 32); }
    static int64_t q_floats(int64_t D, int64_t M) { return M * d32(D) + M; }
    // Row r's first 32 features (its group's block, then r % RG rows in); rotated: the same
    // block of the rotated copy (qk_group's one-head form), M * d32(D) int16 further on.
    template <class F>
    static auto q16(F* q, int64_t D, int64_t r) {
        using I = std::conditional_t<std::is_const<F>::value, const int16_t, int16_t>;
        return reinterpret_cast<I*>(q) + (r / RG) * RG * d32(D) + (r % RG) * 32;
    }
    template <class F>
    static auto q16_rotated(F* q, int64_t M, int64_t D, int64_t r) { return q16(q, D, r) + M * d32(D); }
    static float* row_scales(float* q, int64_t M, int64_t D) { return q + M * d32(D); }
    static const float* row_scales(const float* q, int64_t M, int64_t D) { return q + M * d32(D); }
    // The rotated copy of row r (j = r % RG) of its group: per 32 features, rotation k's vector
    // holds in 128-bit block b (features 8b .. 8b+7) the row (b + k) % RG, so row j's block b
    // goes to rotation (j - b) % RG. A K vector times the four rotations gives every row's
    // products, each in a different block; sums_rotated gathers them (RG = 4 blocks).
    static void store_rotated(float* q, int64_t M, int64_t r, int64_t D) {
        static_assert(RG == 4, "one row per 128-bit block");
        const int16_t* src = q16(q, D, r);
        int16_t* dst = q16_rotated(q, M, D, r - r % RG);
        const int j = int(r % RG);
        for (int64_t c = 0; c < d32(D) / 32; ++c)
            for (int b = 0; b < RG; ++b)
                std::memcpy(dst + (c * RG + ((j - b) & (RG - 1))) * 32 + 8 * b, src + c * RG * 32 + 8 * b, 8 * sizeof(int16_t));
    }
    static int64_t o_floats(int64_t Dv, int64_t M) { return M * dp(Dv) + M * d32(Dv); }

    // Row r: the codes row[d] * 2^-e (a power of two: a bf16 row's values within 2^7 of its max
    // |q|, a float16 row's within 2^4, are then exact), max |code| in [2^14, 2^15); scale
    // qscale * 2^e (the score scale applied with the row's, not rounded into the codes).
    // (F8Bf16Codes: the row's values as bf16, exact for a bf16 row; scale qscale.)
    static void pack_q_row(float* q, int64_t M, int64_t r, const float* row, int64_t D, float qscale) {
        int16_t* o = q16(q, D, r);
        if constexpr (!C::kIntQ) {
            bool finite = true;
            for (int64_t d = 0; d < d32(D); d += 16) {
                const __m512 x = _mm512_maskz_loadu_ps(lanes_below(D - d), row + d);
                finite &= nonfinite(x) == 0;
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + (d / 32) * RG * 32 + d % 32), C::to_bf16(x));
            }
            row_scales(q, M, D)[r] = finite ? qscale : NAN;
            store_rotated(q, M, r, D);
            return;
        }
        __m512 amax = _mm512_setzero_ps();
        __mmask16 bad = 0;
        for (int64_t d = 0; d < D; d += 16) {
            const __m512 x = _mm512_maskz_loadu_ps(lanes_below(D - d), row + d);
            bad |= nonfinite(x);
            amax = _mm512_max_ps(amax, _mm512_abs_ps(x));
        }
        const bool finite = bad == 0;
        const float mx = _mm512_reduce_max_ps(amax);
        int e = 0;
        std::frexp(mx, &e);  // mx = f * 2^e, f in [0.5, 1)
        const __m512 shift = _mm512_set1_ps(float(15 - e));
        for (int64_t d = 0; d < d32(D); d += 16) {  // x * 2^(15-e), rounded to nearest even, saturated
            const __m512 x = finite ? _mm512_maskz_loadu_ps(lanes_below(D - d), row + d) : _mm512_setzero_ps();
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + (d / 32) * RG * 32 + d % 32),
                                _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_scalef_ps(x, shift))));
        }
        row_scales(q, M, D)[r] = finite ? float(std::ldexp(double(qscale), e - 15)) : NAN;
        store_rotated(q, M, r, D);
    }
    static void zero_q_row(float* q, int64_t M, int64_t r, int64_t D) {
        for (int64_t d = 0; d < d32(D); d += 32) std::memset(q16(q, D, r) + (d / 32) * RG * 32, 0, 32 * sizeof(int16_t));
        row_scales(q, M, D)[r] = 0.f;
        store_rotated(q, M, r, D);
    }

    // The scales of key c of a K/V tile for 16 row lanes whose kv heads (relative to the item's
    // first) are kv_head[0..15], non-decreasing and adjacent: one load and a permute where the
    // heads' scales are adjacent too (head stride 1: the (B, N, H) scale layout), else two
    // gathers; 1 without scales.
    struct LaneScales {
        const float* base = nullptr;
        int64_t ld = 0;
        bool adjacent = false;
        __m512i idx, idx_lo, idx_hi;
        __mmask16 m = 0;
        LaneScales(const KvTile& t, const int32_t* kv_head) {
            if (!t.scale) return;
            base = t.scale + kv_head[0] * t.scale_head_stride;
            ld = t.scale_ld;
            alignas(64) int32_t rel[16];
            alignas(64) int64_t at[16];
            for (int l = 0; l < 16; ++l) {
                rel[l] = kv_head[l] - kv_head[0];
                at[l] = int64_t(rel[l]) * t.scale_head_stride;
            }
            adjacent = t.scale_head_stride == 1;
            idx = _mm512_load_si512(rel);
            idx_lo = _mm512_load_si512(at);
            idx_hi = _mm512_load_si512(at + 8);
            m = lanes_below(rel[15] + 1);
        }
        __m512 at(int64_t c) const {
            if (!base) return _mm512_set1_ps(1.f);
            const float* p = base + c * ld;
            if (adjacent) return _mm512_permutexvar_ps(idx, _mm512_maskz_loadu_ps(m, p));
            return _mm512_insertf32x8(_mm512_castps256_ps512(_mm512_i64gather_ps(idx_lo, p, 4)),
                                      _mm512_i64gather_ps(idx_hi, p, 4), 1);
        }
    };

    // 32 codes from p; kMasked: only n of them (lanes past n zero, nothing read there).
    template <bool kMasked>
    static __m256i bytes32(const Code* p, int64_t n) {
        if (!kMasked) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
        return _mm256_maskz_loadu_epi8(n <= 0 ? __mmask32(0) : n >= 32 ? ~__mmask32(0) : __mmask32((1ull << n) - 1), p);
    }

    // s[c*RB + r] = q_r . k_c for the block's rows: int32 dot products (groups of RG rows, key
    // blocks outer as in DecodeGemm::qk), then one pass over the block scaling each by its row's
    // and key's scales.
    static void qk(const ItemOperands& x, const RowBlock& block, const KvTile& kt, int64_t nc, float* s) {
        const Code* k = static_cast<const Code*>(kt.data);
        const int64_t D = x.d, Dq = d32(D), ldk = kt.ld, rows = block.rows;
        const int16_t* q = q16(x.q, D, block.r0);
        const int16_t* qr = q16_rotated(x.q, x.M, D, block.r0);
        const int32_t* kv_head = block.kv_head;
        for (int64_t cb = 0; cb < nc; cb += KBLK) {
            const int64_t ce = cb + KBLK < nc ? cb + KBLK : nc;
            for (int r = 0; r < rows; r += RG) {
                int64_t off[RG];
                head_offsets(kv_head, r, kt, off);
                const bool first_of_head = r == 0 || kv_head[r - 1] != kv_head[r];
                if (off[0] == off[RG - 1]) qk_group<true>(qr + r * Dq, D, k, ldk, off, cb, ce, s + r, kt.far_at(cb), kt.near_at(cb), first_of_head);
                else qk_group<false>(q + r * Dq, D, k, ldk, off, cb, ce, s + r, kt.far_at(cb), kt.near_at(cb), true);
            }
        }
        const float* qs = row_scales(x.q, x.M, D) + block.r0;
        for (int v = 0; v < block.vectors; ++v) {
            const LaneScales ks(kt, kv_head + v * W);
            const __m512 rs = _mm512_loadu_ps(qs + v * W);
            for (int64_t c = 0; c < nc; ++c) {
                float* sp = s + c * RB + v * W;
                _mm512_storeu_ps(sp, _mm512_mul_ps(_mm512_loadu_ps(sp), _mm512_mul_ps(rs, ks.at(c))));
            }
        }
    }
    // One-head groups (rotated q, store_rotated): v[i*RG + k] holds key i's products with
    // rotation k, row (b + k) % RG in block b. Each key's rotations are turned so that block r
    // holds row r and added (3 block shuffles + 3 adds), then the four keys' block sums reduced
    // within blocks (9 operations) and reordered to lane i*RG + r as sums16 leaves them: 34
    // operations for 16 scores where sums16 takes 45, 30 of them shuffles on one port on Intel
    // cores. The same int32 sums (float32 for F8Bf16Codes, added in another order).
    static __m512 sums_rotated(const __m512* v) {
        __m512 u[KB];
        for (int i = 0; i < KB; ++i) {
            const __m512* a = v + i * RG;  // block r of the turned rotation k = its block (r - k) % 4
            u[i] = C::add(C::add(a[0], _mm512_shuffle_f32x4(a[1], a[1], _MM_SHUFFLE(2, 1, 0, 3))),
                          C::add(_mm512_shuffle_f32x4(a[2], a[2], _MM_SHUFFLE(1, 0, 3, 2)),
                                 _mm512_shuffle_f32x4(a[3], a[3], _MM_SHUFFLE(0, 3, 2, 1))));
        }
        // per block: [u0 0+2, u1 0+2, u0 1+3, u1 1+3], then [u0, u1, u2, u3] sums: lane 4r + i
        const __m512 a = C::add(_mm512_unpacklo_ps(u[0], u[1]), _mm512_unpackhi_ps(u[0], u[1]));
        const __m512 b = C::add(_mm512_unpacklo_ps(u[2], u[3]), _mm512_unpackhi_ps(u[2], u[3]));
        const __m512d ad = _mm512_castps_pd(a), bd = _mm512_castps_pd(b);
        const __m512 t = C::add(_mm512_castpd_ps(_mm512_unpacklo_pd(ad, bd)), _mm512_castpd_ps(_mm512_unpackhi_pd(ad, bd)));
        return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), t);
    }
    // The line of a K / V row at p prefetched into L2 prefetch_keys ahead (pf) and into L1 one key
    // block ahead (pf0 = KvTile::prefetch_near: KBLK rows, ~16 KB of codes for 8 kv heads), as
    // the avx2 route does. With the far prefetch alone every code line came from L2 on use; the
    // near one made the int8 decode 1.05-1.07x faster (2-core Xeon with AMX, 1 and 2 threads;
    // 8 / 32 keys ahead 1.01-1.03x, 24 1.02x; bench/RESULTS.md, session 40). The float caches'
    // DecodeGemm gained nothing from it (bf16 1.00-1.01x) and keeps the far prefetch only.
    static inline __attribute__((always_inline)) void prefetch_line(const Code* p, int64_t pf, int64_t pf0) {
        _mm_prefetch(reinterpret_cast<const char*>(p + pf), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(p + pf0), _MM_HINT_T0);
    }
    template <bool kOneHead, bool kMasked>
    static inline __attribute__((always_inline)) void qk_chunk(__m512i (&acc)[KB][RG], const int16_t* qg, int64_t d,
                                                               int64_t D, const Code* const (&kr)[KB], const int64_t* off,
                                                               int64_t pf, int64_t pf0, bool prefetch) {
        __m512i qv[RG];
#pragma GCC unroll 4
        for (int j = 0; j < RG; ++j) qv[j] = _mm512_loadu_si512(qg + d * RG + j * 32);
#pragma GCC unroll 4
        for (int i = 0; i < KB; ++i) {
            if constexpr (kOneHead) {
                if (prefetch && d % 64 == 0) prefetch_line(kr[i] + off[0] + d, pf, pf0);
                const __m512i kv = C::widen(bytes32<kMasked>(kr[i] + off[0] + d, D - d));
#pragma GCC unroll 4
                for (int j = 0; j < RG; ++j) acc[i][j] = C::dot(acc[i][j], kv, qv[j]);
            } else {
#pragma GCC unroll 4
                for (int j = 0; j < RG; ++j) {
                    if (d % 64 == 0 && (j == 0 || off[j] != off[j - 1])) prefetch_line(kr[i] + off[j] + d, pf, pf0);
                    const __m512i kv = C::widen(bytes32<kMasked>(kr[i] + off[j] + d, D - d));
                    acc[i][j] = C::dot(acc[i][j], kv, qv[j]);
                }
            }
        }
    }
    template <bool kOneHead>
    static void qk_group(const int16_t* qg, int64_t D, const Code* k, int64_t ldk, const int64_t* off,
                         int64_t cb, int64_t ce, float* s, int64_t pf, int64_t pf0, bool prefetch) {
        for (int64_t c = cb; c < ce; c += KB) {
            const int64_t nkb = ce - c < KB ? ce - c : KB;
            const Code* kr[KB];
            key_rows(k, c, nkb, ldk, kr);
            __m512i acc[KB][RG];
#pragma GCC unroll 4
            for (int i = 0; i < KB; ++i)
#pragma GCC unroll 4
                for (int j = 0; j < RG; ++j) acc[i][j] = _mm512_setzero_si512();
            // 32 features at a time: whole chunks with plain loads, the tail (D % 32) masked
            int64_t d = 0;
            for (; d + 32 <= D; d += 32) qk_chunk<kOneHead, false>(acc, qg, d, D, kr, off, pf, pf0, prefetch);
            if (d < D) qk_chunk<kOneHead, true>(acc, qg, d, D, kr, off, pf, pf0, prefetch);
            __m512 v[KB * RG];
            for (int i = 0; i < KB; ++i)
                for (int j = 0; j < RG; ++j) v[i * RG + j] = _mm512_castsi512_ps(acc[i][j]);
            const __m512 total = C::to_float(kOneHead ? sums_rotated(v) : sums16(v, C::add));
            store_scores(total, c, nkb, s);
        }
    }

    // P of one row vector (s + v*W, nc keys) -> int16 pairs in place; wscale[l] = lane l's scale.
    // (F8Bf16Codes: bf16 pairs, rounded to nearest even; wscale 1.)
    static void quantize_p(float* s, int64_t nc, const KvTile& vt, const int32_t* kv_head, float* wscale) {
        const LaneScales vs(vt, kv_head);
        if constexpr (!C::kIntQ) {
            __mmask16 bad = 0;
            int32_t* pairs = reinterpret_cast<int32_t*>(s);
            for (int64_t c = 0; c < nc; c += 2) {  // pair c/2 lands at key slot c/2 <= c: read before written
                const __m512 lo = _mm512_mul_ps(_mm512_loadu_ps(s + c * RB), vs.at(c));
                const __m512 hi = c + 1 < nc ? _mm512_mul_ps(_mm512_loadu_ps(s + (c + 1) * RB), vs.at(c + 1)) : _mm512_setzero_ps();
                bad |= nonfinite(lo) | nonfinite(hi);
                _mm512_storeu_si512(pairs + (c / 2) * RB, _mm512_or_si512(_mm512_cvtepu16_epi32(C::to_bf16(lo)),
                                                                          _mm512_slli_epi32(_mm512_cvtepu16_epi32(C::to_bf16(hi)), 16)));
            }
            _mm512_storeu_ps(wscale, _mm512_mask_mov_ps(_mm512_set1_ps(1.f), bad, _mm512_set1_ps(NAN)));
            return;
        }
        __m512 wmax = _mm512_setzero_ps();
        __mmask16 bad = 0;
        for (int64_t c = 0; c < nc; ++c) {
            const __m512 w = _mm512_mul_ps(_mm512_loadu_ps(s + c * RB), vs.at(c));
            _mm512_storeu_ps(s + c * RB, w);
            bad |= nonfinite(w);
            wmax = _mm512_max_ps(wmax, _mm512_abs_ps(w));
        }
        // inv <= 32767 / wmax keeps |w| * inv <= 32767 (rounded: 32767); 0 for an all-zero row
        const __m512 inv = _mm512_min_ps(_mm512_maskz_div_ps(_mm512_cmp_ps_mask(wmax, _mm512_setzero_ps(), _CMP_GT_OQ),
                                                             _mm512_set1_ps(32767.f), wmax),
                                         _mm512_set1_ps(FLT_MAX));
        _mm512_storeu_ps(wscale, _mm512_mask_mov_ps(_mm512_mul_ps(wmax, _mm512_set1_ps(1.f / 32767.f)), bad, _mm512_set1_ps(NAN)));
        int32_t* pairs = reinterpret_cast<int32_t*>(s);
        for (int64_t c = 0; c < nc; c += 2) {  // pair c/2 lands at key slot c/2 <= c: read before written
            const __m512i lo = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(s + c * RB), inv));
            const __m512i hi = c + 1 < nc ? _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(s + (c + 1) * RB), inv))
                                          : _mm512_setzero_si512();
            _mm512_storeu_si512(pairs + (c / 2) * RB,
                                _mm512_or_si512(_mm512_and_si512(lo, _mm512_set1_epi32(0xffff)), _mm512_slli_epi32(hi, 16)));
        }
    }

    // The codes of keys c and c+1 (rows p0, p1), columns [j, j + 32*NH), interleaved in pairs
    // and sign-extended: x[2h], x[2h+1] = columns j+32h + {0-7, 16-23}, {8-15, 24-31}.
    template <int NH, bool kMasked>
    static void pair_codes(const Code* p0, const Code* p1, int64_t n, __m512i* x) {
#pragma GCC unroll 2
        for (int h = 0; h < NH; ++h) {
            const __m256i a = bytes32<kMasked>(p0 + 32 * h, n - 32 * h), b = bytes32<kMasked>(p1 + 32 * h, n - 32 * h);
            x[2 * h] = C::widen(_mm256_unpacklo_epi8(a, b));
            x[2 * h + 1] = C::widen(_mm256_unpackhi_epi8(a, b));
        }
    }
    // acc[i][...] += sum over keys [cb, ce) of the pairs' products, columns [j, j + 32*NH).
    // kOne: the tile is this one key block; its sums start from zero and are added to O (o: the
    // group's first row, stride ldo; wscale: the rows' weight scales) instead of being stored.
    template <int NH, bool kOneHead, bool kMasked, bool kOne>
    static void pv_block(const int32_t* wp, int64_t cb, int64_t ce, const Code* v, int64_t ldv, const int64_t* off,
                         int64_t n, int64_t j, int32_t* acc, int64_t lda, int64_t pf, int64_t pf0, bool prefetch,
                         float* o, int64_t ldo, const float* wscale) {
        constexpr int T = 2 * NH;
        __m512i a[RG][T], x[T];
#pragma GCC unroll 4
        for (int i = 0; i < RG; ++i)
#pragma GCC unroll 4
            for (int t = 0; t < T; ++t) a[i][t] = kOne ? _mm512_setzero_si512() : _mm512_loadu_si512(acc + i * lda + j + 16 * t);
        for (int64_t c = cb; c < ce; c += 2) {
            const Code* v0 = v + c * ldv + j;
            const Code* v1 = c + 1 < ce ? v0 + ldv : v0;  // an odd last key pairs with itself (weight 0)
            const int32_t* w = wp + (c / 2) * RB;
#pragma GCC unroll 4
            for (int i = 0; i < RG; ++i) {
                if (kOneHead ? i == 0 : (i == 0 || off[i] != off[i - 1])) {
                    if (prefetch || !kOneHead) {
                        prefetch_line(v0 + off[i], pf, pf0);
                        prefetch_line(v1 + off[i], pf, pf0);
                    }
                    pair_codes<NH, kMasked>(v0 + off[i], v1 + off[i], n - j, x);
                }
                const __m512i wi = _mm512_set1_epi32(w[i]);
#pragma GCC unroll 4
                for (int t = 0; t < T; ++t) a[i][t] = C::dot(a[i][t], x[t], wi);
            }
        }
#pragma GCC unroll 4
        for (int i = 0; i < RG; ++i) {
            if constexpr (kOne) {
#pragma GCC unroll 2
                for (int h = 0; h < NH; ++h)
                    if (j + 32 * h < ldo) join32(a[i][2 * h], a[i][2 * h + 1], wscale[i], o + i * ldo + j + 32 * h, ldo - j - 32 * h);
            } else {
#pragma GCC unroll 4
                for (int t = 0; t < T; ++t) _mm512_storeu_si512(acc + i * lda + j + 16 * t, a[i][t]);
            }
        }
    }
    // o[0 .. min(32, left)) += the sums of 32 columns in pair order (lo, hi: see Layouts) x f, in
    // column order (left: the O row's columns from o on, a multiple of 16).
    static inline __attribute__((always_inline)) void join32(__m512i lo, __m512i hi, float f, float* o, int64_t left) {
        const __m512 fv = _mm512_set1_ps(f);
        const __m512 first = C::to_float(_mm512_shuffle_i32x4(lo, hi, _MM_SHUFFLE(1, 0, 1, 0)));
        _mm512_storeu_ps(o, _mm512_fmadd_ps(first, fv, _mm512_loadu_ps(o)));
        if (left > 16) {
            const __m512 second = C::to_float(_mm512_shuffle_i32x4(lo, hi, _MM_SHUFFLE(3, 2, 3, 2)));
            _mm512_storeu_ps(o + 16, _mm512_fmadd_ps(second, fv, _mm512_loadu_ps(o + 16)));
        }
    }
    // Every column block of one row group and key block: whole 64-column blocks with plain loads,
    // then the tail (33..63 or 1..32 columns) masked.
    template <bool kOne>
    static inline __attribute__((always_inline)) void pv_columns(const int32_t* wp, int64_t cb, int64_t ce, const Code* v,
                                                                 int64_t ldv, const int64_t* off, int64_t Dv, int32_t* a,
                                                                 int64_t lda, int64_t pf, int64_t pf0, bool one,
                                                                 bool first_of_head, float* o, int64_t ldo,
                                                                 const float* wscale) {
        const bool pfo = one ? first_of_head : true;
        int64_t j = 0;
        for (; j + 64 <= Dv; j += 64) {
            if (one) pv_block<2, true, false, kOne>(wp, cb, ce, v, ldv, off, Dv, j, a, lda, pf, pf0, pfo, o, ldo, wscale);
            else pv_block<2, false, false, kOne>(wp, cb, ce, v, ldv, off, Dv, j, a, lda, pf, pf0, pfo, o, ldo, wscale);
        }
        if (j < Dv && lda - j > 32) {
            if (one) pv_block<2, true, true, kOne>(wp, cb, ce, v, ldv, off, Dv, j, a, lda, pf, pf0, pfo, o, ldo, wscale);
            else pv_block<2, false, true, kOne>(wp, cb, ce, v, ldv, off, Dv, j, a, lda, pf, pf0, pfo, o, ldo, wscale);
        } else if (j < Dv) {
            if (one) pv_block<1, true, true, kOne>(wp, cb, ce, v, ldv, off, Dv, j, a, lda, pf, pf0, pfo, o, ldo, wscale);
            else pv_block<1, false, true, kOne>(wp, cb, ce, v, ldv, off, Dv, j, a, lda, pf, pf0, pfo, o, ldo, wscale);
        }
    }

    // O[r0 + r][:] += sum_c P[r][c] V[c][:]: P rounded to int16 pairs, int32 sums per tile (key
    // blocks outer as in DecodeGemm::pv), then added to O in column order times their scale. A
    // tile of one key block (a paged cache of 16-key blocks) keeps its sums in registers and adds
    // them to O at once (pv_block's kOne): 1.08-1.10x faster there (2-core Xeon with AMX, int8
    // block 16). Longer tiles measured 0.97-0.98x when their first block started from zero and
    // their last one added to O, and keep the memory sums.
    static void pv(const ItemOperands& x, const RowBlock& block, float* s, int64_t nc, const KvTile& vt) {
        const Code* v = static_cast<const Code*>(vt.data);
        const int64_t Dv = x.dv, n = dp(Dv), na = d32(Dv), ldv = vt.ld, rows = round_up(block.rows, RG);
        const int32_t* kv_head = block.kv_head;
        alignas(64) float wscale[RB];
        for (int vv = 0; vv < block.vectors; ++vv) quantize_p(s + vv * W, nc, vt, kv_head + vv * W, wscale + vv * W);
        int32_t* acc = reinterpret_cast<int32_t*>(x.o + x.M * n) + block.r0 * na;
        const bool one_block = nc <= KBLK;
        if (!one_block) std::memset(acc, 0, size_t(rows * na) * sizeof(int32_t));
        const int32_t* pairs = reinterpret_cast<const int32_t*>(s);
        for (int64_t cb = 0; cb < nc; cb += KBLK) {
            static_assert(KBLK % 2 == 0, "key blocks hold whole pairs");
            const int64_t ce = cb + KBLK < nc ? cb + KBLK : nc;
            for (int r = 0; r < rows; r += RG) {
                int64_t off[RG];
                head_offsets(kv_head, r, vt, off);
                const bool one = off[0] == off[RG - 1], first_of_head = r == 0 || kv_head[r - 1] != kv_head[r];
                float* o = x.o + (block.r0 + r) * n;
                if (one_block) pv_columns<true>(pairs + r, cb, ce, v, ldv, off, Dv, acc + r * na, na, vt.far_at(cb), vt.near_at(cb), one, first_of_head, o, n, wscale + r);
                else pv_columns<false>(pairs + r, cb, ce, v, ldv, off, Dv, acc + r * na, na, vt.far_at(cb), vt.near_at(cb), one, first_of_head, o, n, wscale + r);
            }
        }
        if (one_block) return;
        for (int64_t r = 0; r < rows; ++r) {
            float* o = x.o + (block.r0 + r) * n;
            const int32_t* a = acc + r * na;
            for (int64_t j = 0; j < n; j += 32) join32(_mm512_loadu_si512(a + j), _mm512_loadu_si512(a + j + 16), wscale[r], o + j, n - j);
        }
    }
};
#ifdef __AVX512VNNI__
using I8Decode16Loop = TileLoop<V512, Q16DecodeGemm<I8Int16Codes>>;
#else
// The avx512 family, built without AVX512-VNNI (Skylake-SP has none), and API.md fixes the family
// names: the int16 products with vpdpwssd where the CPU has AVX512-VNNI but no AVX512-BF16
// (Cascade Lake, Ice Lake: no avx512bf16 family there), else with vpmaddwd + vpaddd (same bits).
// Its float32 route read the int8 cache no faster than the bf16 cache on a 2-core Ice Lake-SP
// (B=16 Hq=32 Hk=8 Nk=8192 D=128, bf16 q); the vpdpwssd form ran 1.6-1.8x faster, the vpmaddwd
// form 1.4-1.5x (bench/RESULTS.md, session 60; no Skylake-SP measured). FA2CPU_I8_DECODE=float
// or =madd forces a form (read once per process; for A/B runs and tests).
struct I8Decode16Pick {
    static constexpr const char* kEnv = "FA2CPU_I8_DECODE";
    static constexpr const char* kNames[] = {nullptr, "madd", "float"};  // vpdpwssd: only where the CPU has it
    static int index() { return cpu_features().avx512vnni ? 0 : 1; }
};
using I8Decode16Loop = PickedLoop<I8Decode16Pick, TileLoop<V512, Q16DecodeGemm<I8Int16CodesT<true>>>,
                                  TileLoop<V512, Q16DecodeGemm<I8Int16CodesT<false>>>, TileLoop<V512, DecodeGemm<I8Elem>>>;
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BF16__)
using F8Decode16Loop = TileLoop<V512, Q16DecodeGemm<F8Bf16Codes>>;
#else
using F8Decode16Loop = TileLoop<V512, DecodeGemm<F8Elem>>;  // no AVX512-BF16: the float32 route
#endif

// The decode route of the AVX-512 families (routes.h).
using Avx512DecodeRoute = DecodeRoute<TileLoop<V512, DecodeGemm<F32Elem>>, TileLoop<V512, DecodeGemm<F16Elem>>,
                                      TileLoop<V512, DecodeGemm<Bf16Elem>>, TileLoop<V512, DecodeGemm<I8Elem>>,
                                      TileLoop<V512, DecodeGemm<F8Elem>>, I8Decode16Loop, F8Decode16Loop>;

}  // namespace
}  // namespace fa2cpu
