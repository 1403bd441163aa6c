// Decode over a quantized cache (int8 / float8_e4m3fn codes) with bfloat16 queries, on AVX512-BF16:
// DecodeGemm's items and tiles (gemm_decode.h), with both products on vdpbf16ps instead of float32
// FMAs. Decode with codes is bound by the FMA port, not by memory (one byte per element feeds as
// many FMAs as two bytes of a bf16 cache); vdpbf16ps does 32 multiply-adds per instruction:
//   QK: 32 codes -> float32 -> one bf16 vector (exact: int8 and float8 values have <= 8
//       significant bits), dotted with the bf16 query row (exact: q is bf16), summed in float32.
//       The query is stored unscaled; scale, per-key scale and kUnit multiply each score.
//   PV: the keys' probabilities times their V scales, rounded to bf16 pairs (P[r][c], P[r][c+1])
//       once per tile (like the bf16 prefill kernels' P: relative error 2^-9); V rows c, c+1
//       interleaved into bf16 pairs (exact) per 16 columns.
// Layouts: q [M][dp2(D)] uint32 bf16 pairs; P pairs [BC/2][RB] uint32 (ItemOperands::p_pairs);
// O and s as DecodeGemm's.
//
// This header also defines Avx512DecodeRoute, the decode route of the AVX-512 families (routes.h):
// families built with AVX512-BF16 get the DecodeDotGemm loops for bf16 queries over codes.
#pragma once
#include "gemm_decode.h"

namespace fa2cpu {
namespace {
#ifdef __AVX512BF16__

template <class E>
struct DecodeDotGemm : DecodeGemm<E> {
    using Base = DecodeGemm<E>;
    using T = typename Base::T;
    using Scales = typename Base::Scales;
    static constexpr int RB = Base::RB, RG = Base::RG, KB = Base::KB;
    static constexpr int64_t BC = Base::BC, KBLK = Base::KBLK;
    static constexpr ScaleAt kScaleAt = ScaleAt::qk_output;  // the bf16 query is stored exactly
    static_assert(E::kCodes && KBLK % 2 == 0, "codes; key blocks of whole pairs");

    static int64_t dp2(int64_t D) { return round_up(D, 32) / 2; }
    static int64_t q_floats(int64_t D, int64_t M) { return M * dp2(D); }
    static int64_t p_floats() { return BC / 2 * RB; }

    static void pack_q_row(float* qbuf, int64_t, int64_t r, const float* row, int64_t D, float) {
        uint32_t* q = reinterpret_cast<uint32_t*>(qbuf) + r * dp2(D);
        for (int64_t t = 0; t < dp2(D); ++t) {
            const uint32_t lo = 2 * t < D ? f32_to_bf16(row[2 * t]) : 0, hi = 2 * t + 1 < D ? f32_to_bf16(row[2 * t + 1]) : 0;
            q[t] = lo | hi << 16;
        }
    }
    static void zero_q_row(float* qbuf, int64_t, int64_t r, int64_t D) {
        std::memset(reinterpret_cast<uint32_t*>(qbuf) + r * dp2(D), 0, size_t(dp2(D)) * 4);
    }

    // 32 codes (n valid, zeros past them) as bf16, element order kept.
    static __m512bh codes32(const T* p, int64_t n) {
        return _mm512_cvtne2ps_pbh(E::load(p + 16, lanes_below(n - 16)), E::load(p, lanes_below(n)));
    }
    // bf16 pairs (V[c][j + l], V[c+1][j + l]) for 16 columns l (m: valid columns; r1 null: key
    // c + 1 does not exist, zeros).
    static __m512bh pairs16(const T* r0, const T* r1, __mmask16 m) {
        const __m128i a = _mm_maskz_loadu_epi8(m, r0);
        const __m128i b = r1 ? _mm_maskz_loadu_epi8(m, r1) : _mm_setzero_si128();
        return _mm512_cvtne2ps_pbh(E::convert(_mm_unpackhi_epi8(a, b)), E::convert(_mm_unpacklo_epi8(a, b)));
    }

    static void qk(const ItemOperands& x, const RowBlock& block, const KvTile& kt, int64_t nc, float* s) {
        const T* k = static_cast<const T*>(kt.data);
        const int64_t D = x.d, Q2 = dp2(D), ldk = kt.ld, rows = block.rows;
        const uint32_t* q = reinterpret_cast<const uint32_t*>(x.q) + block.r0 * Q2;
        const int32_t* kv_head = block.kv_head;
        for (int64_t cb = 0; cb < nc; cb += KBLK) {
            const int64_t ce = cb + KBLK < nc ? cb + KBLK : nc;
            for (int r = 0; r < rows; r += RG) {
                int64_t off[RG];
                const float* sc[RG];
                for (int j = 0; j < RG; ++j) {
                    off[j] = kv_head[r + j] * kt.head_stride;
                    sc[j] = kt.scale ? kt.scale + kv_head[r + j] * kt.scale_head_stride : nullptr;
                }
                const Scales ks{sc, kt.scale_ld};
                const bool first_of_head = r == 0 || kv_head[r - 1] != kv_head[r];
                if (off[0] == off[RG - 1])
                    qk_group<true>(q + r * Q2, Q2, D, k, ldk, off, ks, x.qk_scale, cb, ce, s + r, kt.prefetch, first_of_head);
                else
                    qk_group<false>(q + r * Q2, Q2, D, k, ldk, off, ks, x.qk_scale, cb, ce, s + r, kt.prefetch, true);
            }
        }
    }
    template <bool kOneHead>
    static void qk_group(const uint32_t* qr, int64_t Q2, int64_t D, const T* k, int64_t ldk, const int64_t* off,
                         const Scales& ks, float qk_scale, int64_t cb, int64_t ce, float* s, int64_t pf, bool prefetch) {
        for (int64_t c = cb; c < ce; c += KB) {
            const int64_t nkb = ce - c < KB ? ce - c : KB;
            const T* kr[KB];
            for (int i = 0; i < KB; ++i) kr[i] = k + (c + (i < nkb ? i : nkb - 1)) * ldk;
            __m512 acc[KB][RG];
#pragma GCC unroll 4
            for (int i = 0; i < KB; ++i)
#pragma GCC unroll 4
                for (int j = 0; j < RG; ++j) acc[i][j] = _mm512_setzero_ps();
            for (int64_t d = 0; d < 2 * Q2; d += 32) {
                __m512bh qv[RG];
#pragma GCC unroll 4
                for (int j = 0; j < RG; ++j) qv[j] = (__m512bh)_mm512_loadu_si512(qr + j * Q2 + d / 2);
#pragma GCC unroll 4
                for (int i = 0; i < KB; ++i) {
                    if constexpr (kOneHead) {
                        if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(kr[i] + pf + off[0] + d), _MM_HINT_T0);
                        const __m512bh kv = codes32(kr[i] + off[0] + d, D - d);
#pragma GCC unroll 4
                        for (int j = 0; j < RG; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], kv, qv[j]);
                    } else {
#pragma GCC unroll 4
                        for (int j = 0; j < RG; ++j) {
                            if (j == 0 || off[j] != off[j - 1])
                                _mm_prefetch(reinterpret_cast<const char*>(kr[i] + pf + off[j] + d), _MM_HINT_T0);
                            acc[i][j] = _mm512_dpbf16_ps(acc[i][j], codes32(kr[i] + off[j] + d, D - d), qv[j]);
                        }
                    }
                }
            }
            alignas(64) float f[KB * RG], sum[KB * RG];
            for (int i = 0; i < KB; ++i)
                for (int j = 0; j < RG; ++j) f[i * RG + j] = i < nkb ? ks.factor(j, c + i) * qk_scale : 0.f;
            _mm512_store_ps(sum, _mm512_mul_ps(Base::sums16(acc), _mm512_load_ps(f)));
            for (int i = 0; i < nkb; ++i) std::memcpy(s + (c + i) * RB, sum + i * RG, RG * sizeof(float));
        }
    }

    // P pairs of the tile: pp[cp*RB + r] = (bf16(P[r][2cp] f), bf16(P[r][2cp+1] f')), f the key's V
    // scale (of row r's kv head) times kUnit; the pair past an odd last key is (., 0).
    static void p_pairs(const RowBlock& block, const float* s, int64_t nc, const KvTile& vt, uint32_t* pp) {
        alignas(64) static const int16_t kInterleave[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                             8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
        const __m512i order = _mm512_load_si512(kInterleave);
        for (int v = 0; v < block.vectors; ++v) {
            const float* rs[16];
            for (int l = 0; l < 16; ++l)
                rs[l] = vt.scale ? vt.scale + block.kv_head[v * 16 + l] * vt.scale_head_stride : nullptr;
            auto factors = [&](int64_t c) {
                alignas(64) float f[16];
                for (int l = 0; l < 16; ++l) f[l] = (rs[l] ? rs[l][c * vt.scale_ld] : 1.f) * E::kUnit;
                return _mm512_load_ps(f);
            };
            for (int64_t c = 0; c < nc; c += 2) {
                const __m512 x0 = _mm512_mul_ps(_mm512_loadu_ps(s + c * RB + v * 16), factors(c));
                const __m512 x1 = c + 1 < nc ? _mm512_mul_ps(_mm512_loadu_ps(s + (c + 1) * RB + v * 16), factors(c + 1))
                                             : _mm512_setzero_ps();
                const __m512i bf = (__m512i)_mm512_cvtne2ps_pbh(x1, x0);  // x0 in the low half
                _mm512_storeu_si512(pp + (c / 2) * RB + v * 16, _mm512_permutexvar_epi16(order, bf));
            }
        }
    }

    // O[r0 + r][:] += sum_c P[r][c] V[c][:], key blocks outer (as in qk), 64 columns at a time.
    static void pv(const ItemOperands& x, const RowBlock& block, float* s, int64_t nc, const KvTile& vt) {
        const T* v = static_cast<const T*>(vt.data);
        const int64_t Dv = x.dv, n = Base::dp(Dv), ldv = vt.ld, rows = block.rows;
        uint32_t* pp = reinterpret_cast<uint32_t*>(x.p_pairs);
        p_pairs(block, s, nc, vt, pp);
        for (int64_t cb = 0; cb < nc; cb += KBLK) {
            const int64_t ce = cb + KBLK < nc ? cb + KBLK : nc;
            for (int r = 0; r < rows; r += RG) {
                int64_t off[RG];
                for (int j = 0; j < RG; ++j) off[j] = block.kv_head[r + j] * vt.head_stride;
                const bool first_of_head = r == 0 || block.kv_head[r - 1] != block.kv_head[r];
                float* orow = x.o + (block.r0 + r) * n;
                for (int64_t j = 0; j < n; j += 64) {
                    const bool one = off[0] == off[RG - 1];
                    switch ((n - j) / 16) {
                        case 1: one ? pv_block<1, true>(pp + r, cb, ce, nc, v, ldv, off, Dv, j, orow, n, vt.prefetch, first_of_head)
                                    : pv_block<1, false>(pp + r, cb, ce, nc, v, ldv, off, Dv, j, orow, n, vt.prefetch, true); break;
                        case 2: one ? pv_block<2, true>(pp + r, cb, ce, nc, v, ldv, off, Dv, j, orow, n, vt.prefetch, first_of_head)
                                    : pv_block<2, false>(pp + r, cb, ce, nc, v, ldv, off, Dv, j, orow, n, vt.prefetch, true); break;
                        case 3: one ? pv_block<3, true>(pp + r, cb, ce, nc, v, ldv, off, Dv, j, orow, n, vt.prefetch, first_of_head)
                                    : pv_block<3, false>(pp + r, cb, ce, nc, v, ldv, off, Dv, j, orow, n, vt.prefetch, true); break;
                        default: one ? pv_block<4, true>(pp + r, cb, ce, nc, v, ldv, off, Dv, j, orow, n, vt.prefetch, first_of_head)
                                     : pv_block<4, false>(pp + r, cb, ce, nc, v, ldv, off, Dv, j, orow, n, vt.prefetch, true); break;
                    }
                }
            }
        }
    }
    template <int NV, bool kOneHead>
    static void pv_block(const uint32_t* pp, int64_t cb, int64_t ce, int64_t nc, const T* v, int64_t ldv,
                         const int64_t* off, int64_t Dv, int64_t j, float* orow, int64_t n, int64_t pf, bool prefetch) {
        __m512 acc[RG][NV];
        __mmask16 m[NV];
#pragma GCC unroll 4
        for (int t = 0; t < NV; ++t) m[t] = lanes_below(Dv - (j + 16 * t));
#pragma GCC unroll 4
        for (int i = 0; i < RG; ++i)
#pragma GCC unroll 4
            for (int t = 0; t < NV; ++t) acc[i][t] = _mm512_loadu_ps(orow + i * n + j + 16 * t);
        for (int64_t c = cb; c < ce; c += 2) {
            const T* v0 = v + c * ldv + j;
            const T* v1 = c + 1 < nc ? v0 + ldv : nullptr;
            const uint32_t* pc = pp + (c / 2) * RB;
            if constexpr (kOneHead) {
                __m512bh vv[NV];
#pragma GCC unroll 4
                for (int t = 0; t < NV; ++t) {
                    if (prefetch) {
                        _mm_prefetch(reinterpret_cast<const char*>(v0 + pf + off[0] + 16 * t), _MM_HINT_T0);
                        _mm_prefetch(reinterpret_cast<const char*>(v0 + ldv + pf + off[0] + 16 * t), _MM_HINT_T0);
                    }
                    vv[t] = pairs16(v0 + off[0] + 16 * t, v1 ? v1 + off[0] + 16 * t : nullptr, m[t]);
                }
#pragma GCC unroll 4
                for (int i = 0; i < RG; ++i) {
                    const __m512bh pb = (__m512bh)_mm512_set1_epi32(int(pc[i]));
#pragma GCC unroll 4
                    for (int t = 0; t < NV; ++t) acc[i][t] = _mm512_dpbf16_ps(acc[i][t], vv[t], pb);
                }
            } else {
#pragma GCC unroll 4
                for (int i = 0; i < RG; ++i) {
                    const __m512bh pb = (__m512bh)_mm512_set1_epi32(int(pc[i]));
#pragma GCC unroll 4
                    for (int t = 0; t < NV; ++t) {
                        const __m512bh vv = pairs16(v0 + off[i] + 16 * t, v1 ? v1 + off[i] + 16 * t : nullptr, m[t]);
                        acc[i][t] = _mm512_dpbf16_ps(acc[i][t], vv, pb);
                    }
                }
            }
        }
#pragma GCC unroll 4
        for (int i = 0; i < RG; ++i)
#pragma GCC unroll 4
            for (int t = 0; t < NV; ++t) _mm512_storeu_ps(orow + i * n + j + 16 * t, acc[i][t]);
    }
};

using Avx512DecodeRoute =
    DecodeRoute<TileLoop<V512, DecodeGemm<F32Elem>>, TileLoop<V512, DecodeGemm<F16Elem>>, TileLoop<V512, DecodeGemm<Bf16Elem>>,
                TileLoop<V512, DecodeGemm<I8Elem>>, TileLoop<V512, DecodeGemm<F8Elem>>,
                TileLoop<V512, DecodeDotGemm<I8Elem>>, TileLoop<V512, DecodeDotGemm<F8Elem>>>;
#else
using Avx512DecodeRoute =
    DecodeRoute<TileLoop<V512, DecodeGemm<F32Elem>>, TileLoop<V512, DecodeGemm<F16Elem>>, TileLoop<V512, DecodeGemm<Bf16Elem>>,
                TileLoop<V512, DecodeGemm<I8Elem>>, TileLoop<V512, DecodeGemm<F8Elem>>>;
#endif  // __AVX512BF16__

}  // namespace
}  // namespace fa2cpu
