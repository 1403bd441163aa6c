// Decode GEMM policy (AVX-512): items of at most 16 query rows (decode, the GQA group of one new
// token, short chunks). There a 16-row vector would be mostly padding, so this policy puts the
// FEATURE axis in lanes instead: each K/V row is streamed once with full-width loads (converted to
// float32 in registers, whatever its dtype, so K/V are read in place unless paged or strided) and
// reused by every query row of the item (the whole GQA group) from registers. Decode is
// memory-bound; this keeps the instruction count per byte read low:
//   QK: acc[4 keys][4 rows] += K[key][16 d] * Q[row][16 d], reduced to one score each at the end
//   PV: O[row][64 dv] += P[row][key] (broadcast) * V[key][64 dv]        (4 rows x 4 vectors)
// Layouts: q [M][Dp] float32 pre-scaled (Dp = D rounded up to 16, zero padded); O row-major
// [M][Dvp]; s [BC][RB] as in tile_loop.h (lanes past the item's rows are never read back).
//
// The decode route (kernels/common/routes.h) runs it for sequences with at most kRowsPerHead rows
// per kv head; where the cache interleaves heads within a position ((B, N, H, D) layouts, paged
// or not) its items span up to kMaxRows / rows kv heads, whose K/V rows for a key are then one
// contiguous run, streamed once, instead of one short run per item a head-size stride apart.
#pragma once
#include <immintrin.h>

#include "kernel.h"
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
// codes (S.1111.111, which would read as 480 / 256) become NaN.
struct F8Elem {
    using T = uint8_t;
    static constexpr bool kCodes = true;
    static constexpr float kUnit = 256.f;
    static __m512 convert(__m128i codes) {  // 16 codes
        const __m256i x = _mm256_cvtepu8_epi16(codes);
        const __m256i mag = _mm256_and_si256(x, _mm256_set1_epi16(0x7f));
        const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_xor_si256(x, mag), 8), _mm256_slli_epi16(mag, 7));
        const __mmask16 nan = _mm256_cmpeq_epi16_mask(mag, _mm256_set1_epi16(0x7f));
        return _mm512_mask_mov_ps(_mm512_cvtph_ps(h), nan, _mm512_set1_ps(NAN));
    }
    static __m512 load(const T* p, __mmask16 m) { return convert(_mm_maskz_loadu_epi8(m, p)); }
};

inline __mmask16 lanes_below(int64_t n) { return n >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n < 0 ? 0 : n)) - 1); }

template <class E>
struct DecodeGemm {
    using T = typename E::T;
    static constexpr int W = 16, RV = 4, RB = 64;
    static constexpr int64_t BC = 256;       // keys per tile: long streams, 64 KiB score block
    static constexpr int64_t kRowsPerHead = 16;  // sequences with more rows per kv head use the tile policies
    static constexpr int64_t kMaxRows = 64;      // rows of an item spanning kv heads (4 row vectors)
    static constexpr int64_t kRowAlign = 16;
    static constexpr ScaleAt kScaleAt = ScaleAt::packed_q;
    static constexpr PStore kPStore = PStore::f32_in_scores;
    static constexpr bool kTilesEndAtBlocks = true;  // paged K/V read in place
    static constexpr bool kReadsCodes = E::kCodes;   // quantized K/V read in place too (tile_loop.h)
    static constexpr int KB = 4, RG = 4;     // QK block: 4 keys x 4 rows = 16 accumulators
    static constexpr int64_t KBLK = 16;      // keys per block of the outer loop (all row groups)
    // K/V rows of a KV cache are often one page apart (B, N, H, D layout), where hardware
    // prefetchers stop; rows this many keys ahead are prefetched while the current ones are used.
    static constexpr int64_t kPrefetchKeys = 32;

    // Per-key factors of a quantized cache for the RG rows of a group: row j's scales at
    // row[j][c*ld] (nullptr: 1), times E::kUnit.
    struct Scales {
        const float* const* row;
        int64_t ld;
        float factor(int j, int64_t c) const { return (row[j] ? row[j][c * ld] : 1.f) * E::kUnit; }
    };

    // Rows [r, r + RG) of a row block: each row's kv-head offset into tile t, and their scales.
    static Scales group(const int32_t* kv_head, int r, const KvTile& t, int64_t* off, const float** sc) {
        for (int j = 0; j < RG; ++j) {
            off[j] = kv_head[r + j] * t.head_stride;
            sc[j] = t.scale ? t.scale + kv_head[r + j] * t.scale_head_stride : nullptr;
        }
        return Scales{sc, t.scale_ld};
    }

    static int64_t dp(int64_t n) { return round_up(n, 16); }
    static int64_t q_floats(int64_t D, int64_t M) { return M * dp(D); }
    static int64_t k_floats(int64_t D) { return (BC * dp(D) * int64_t(sizeof(T)) + 3) / 4; }
    static int64_t v_floats(int64_t Dv) { return (BC * dp(Dv) * int64_t(sizeof(T)) + 3) / 4; }
    static int64_t p_floats() { return 0; }

    static void pack_q_row(float* q, int64_t, int64_t r, const float* row, int64_t D, float qscale) {
        float* o = q + r * dp(D);
        for (int64_t d = 0; d < D; ++d) o[d] = row[d] * qscale;
        for (int64_t d = D; d < dp(D); ++d) o[d] = 0.f;
    }
    static void zero_q_row(float* q, int64_t, int64_t r, int64_t D) {
        for (int64_t d = 0; d < dp(D); ++d) q[r * dp(D) + d] = 0.f;
    }

    static int64_t o_floats(int64_t Dv, int64_t M) { return M * dp(Dv); }
    static float o_elem(const float* o, int64_t, int64_t Dv, int64_t r, int64_t j) { return o[r * dp(Dv) + j]; }
    static void rescale_o(float* o, int64_t, int64_t Dv, int64_t r0, __m512 alpha) {
        alignas(64) float a[16];
        _mm512_store_ps(a, alpha);
        const int64_t n = dp(Dv);
        for (int l = 0; l < 16; ++l) {
            if (a[l] == 1.f) continue;
            const __m512 al = _mm512_set1_ps(a[l]);
            float* row = o + (r0 + l) * n;
            for (int64_t j = 0; j < n; j += 16) _mm512_storeu_ps(row + j, _mm512_mul_ps(_mm512_loadu_ps(row + j), al));
        }
    }

    // Rows of a K/V tile: in place for unit feature stride (any dtype; a paged tile lies in one
    // block), else gathered into buf (rows of dp(n) elements, native dtype; then the item holds
    // one kv head: routes.h spans heads only for unit feature strides).
    static KvTile tile(const Params& p, const void* base, int64_t batch_stride, int64_t row_stride, int64_t dim_stride,
                       int64_t head_stride, int64_t n, int64_t b, int64_t c0, int64_t nc, int64_t head, float* buf) {
        const T* src = static_cast<const T*>(base);
        if (dim_stride == 1)
            return {src + k_row_offset(p, b, c0, batch_stride, row_stride) + head, row_stride, head_stride,
                    prefetch_delta(p, batch_stride, row_stride, b, c0)};
        T* out = reinterpret_cast<T*>(buf);
        const int64_t np = dp(n);
        for (int64_t c = 0; c < nc; ++c) {
            const T* r = src + k_row_offset(p, b, c0 + c, batch_stride, row_stride) + head;
            for (int64_t j = 0; j < n; ++j) out[c * np + j] = r[j * dim_stride];
        }
        return {out, np, 0, kPrefetchKeys * np};
    }
    // Prefetch distance (elements): kPrefetchKeys rows further on for a contiguous cache; for a
    // paged one the same row of the sequence's next block (blocks are scattered, out of reach of
    // hardware prefetchers), 0 at the last block.
    static int64_t prefetch_delta(const Params& p, int64_t batch_stride, int64_t row_stride, int64_t b, int64_t c0) {
        if (!p.block_table) return kPrefetchKeys * row_stride;
        const int64_t cur = c0 / p.block_size, next = cur + 1;
        if (next * p.block_size >= seq_nk(p, b)) return 0;  // only validated block-table entries
        const int32_t* row = p.block_table + b * p.block_table_batch_stride;
        return (int64_t(row[next]) - int64_t(row[cur])) * batch_stride;
    }
    static KvTile k_tile(const Params& p, int64_t b, int64_t c0, int64_t nc, int64_t head, float* buf) {
        return tile(p, p.k, p.k_batch_stride, p.k_row_stride, p.k_dim_stride, p.k_head_stride, p.d, b, c0, nc, head, buf);
    }
    static KvTile v_tile(const Params& p, int64_t b, int64_t c0, int64_t nc, int64_t head, float* buf) {
        return tile(p, p.v, p.v_batch_stride, p.v_row_stride, p.v_dim_stride, p.v_head_stride, p.dv, b, c0, nc, head, buf);
    }

    // s[c*RB + r] = q_r . k_c for the block's rows, in groups of RG rows (rows past `rows` have
    // zero q). Key blocks of KBLK are the outer loop so that, when an item spans several kv heads
    // of a (B, N, H, D) cache, the rows of all its heads for those keys (contiguous) are read
    // together. A group whose rows share a kv head loads each K vector once for all of them.
    static void qk(const ItemOperands& x, const RowBlock& block, const KvTile& kt, int64_t nc, float* s) {
        const T* k = static_cast<const T*>(kt.data);
        const int64_t D = x.d, Dp = dp(D), ldk = kt.ld, rows = block.rows;
        const float* q = x.q + block.r0 * Dp;
        const int32_t* kv_head = block.kv_head;
        for (int64_t cb = 0; cb < nc; cb += KBLK) {
            const int64_t ce = cb + KBLK < nc ? cb + KBLK : nc;
            for (int r = 0; r < rows; r += RG) {
                int64_t off[RG];
                const float* sc[RG];
                const Scales ks = group(kv_head, r, kt, off, sc);
                const bool first_of_head = r == 0 || kv_head[r - 1] != kv_head[r];
                if (off[0] == off[RG - 1]) qk_group<true>(q + r * Dp, Dp, D, k, ldk, off, ks, cb, ce, s + r, kt.prefetch, first_of_head);
                else qk_group<false>(q + r * Dp, Dp, D, k, ldk, off, ks, cb, ce, s + r, kt.prefetch, true);
            }
        }
    }
    template <bool kOneHead>
    static void qk_group(const float* qr, int64_t Dp, int64_t D, const T* k, int64_t ldk, const int64_t* off,
                         const Scales& ks, int64_t cb, int64_t ce, float* s, int64_t pf, bool prefetch) {
        for (int64_t c = cb; c < ce; c += KB) {
            const int64_t nkb = ce - c < KB ? ce - c : KB;
            const T* kr[KB];
            for (int i = 0; i < KB; ++i) kr[i] = k + (c + (i < nkb ? i : nkb - 1)) * ldk;
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
                        if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(kr[i] + pf + off[0] + d), _MM_HINT_T0);
                        const __m512 kv = E::load(kr[i] + off[0] + d, m);
#pragma GCC unroll 4
                        for (int j = 0; j < RG; ++j) acc[i][j] = _mm512_fmadd_ps(kv, qv[j], acc[i][j]);
                    } else {
#pragma GCC unroll 4
                        for (int j = 0; j < RG; ++j) {
                            if (j == 0 || off[j] != off[j - 1])
                                _mm_prefetch(reinterpret_cast<const char*>(kr[i] + pf + off[j] + d), _MM_HINT_T0);
                            acc[i][j] = _mm512_fmadd_ps(E::load(kr[i] + off[j] + d, m), qv[j], acc[i][j]);
                        }
                    }
                }
            }
            alignas(64) float sum[KB * RG];
            __m512 total = sums16(acc);
            if constexpr (E::kCodes) {
                alignas(64) float f[KB * RG];
                for (int i = 0; i < KB; ++i)
                    for (int j = 0; j < RG; ++j) f[i * RG + j] = i < nkb ? ks.factor(j, c + i) : 0.f;
                total = _mm512_mul_ps(total, _mm512_load_ps(f));
            }
            _mm512_store_ps(sum, total);
            for (int i = 0; i < nkb; ++i) std::memcpy(s + (c + i) * RB, sum + i * RG, RG * sizeof(float));
        }
    }

    // The 16 horizontal sums of acc[i][j] as one vector, lane i*RG + j: a transpose-and-add tree
    // (45 instructions instead of 16 reductions of ~9; in QK with D = 128 those were a third of
    // the work). Per 128-bit block: unpack ps pairs, then pd pairs, then fold blocks twice.
    static_assert(KB * RG == 16, "one vector of sums");
    static __m512 sums16(const __m512 (&acc)[KB][RG]) {
        const __m512* v = &acc[0][0];
        __m512 s1[8], s2[4];
        for (int j = 0; j < 8; ++j)  // block: [a0+a2, b0+b2, a1+a3, b1+b3]
            s1[j] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * j], v[2 * j + 1]), _mm512_unpackhi_ps(v[2 * j], v[2 * j + 1]));
        for (int j = 0; j < 4; ++j) {  // block: the block sums of v[4j .. 4j+3]
            const __m512d c = _mm512_castps_pd(s1[2 * j]), d = _mm512_castps_pd(s1[2 * j + 1]);
            s2[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(c, d)), _mm512_castpd_ps(_mm512_unpackhi_pd(c, d)));
        }
        auto fold = [](__m512 x, __m512 y) {  // blocks [x0+x1, x2+x3, y0+y1, y2+y3]
            return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
        };
        return fold(fold(s2[0], s2[1]), fold(s2[2], s2[3]));
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
                    if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(vr + pf + off[0] + 16 * t), _MM_HINT_T0);
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
                            _mm_prefetch(reinterpret_cast<const char*>(vr + pf + off[i] + 16 * t), _MM_HINT_T0);
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
        const int64_t Dv = x.dv, n = dp(Dv), ldv = vt.ld, rows = block.rows;
        const int32_t* kv_head = block.kv_head;
        for (int64_t cb = 0; cb < nc; cb += KBLK) {
            const int64_t ce = cb + KBLK < nc ? cb + KBLK : nc;
            for (int r = 0; r < rows; r += RG) {
                int64_t off[RG];
                const float* sc[RG];
                const Scales vs = group(kv_head, r, vt, off, sc);
                const bool first_of_head = r == 0 || kv_head[r - 1] != kv_head[r];
                float* orow = x.o + (block.r0 + r) * n;
                if (off[0] == off[RG - 1]) pv_group<true>(s + r, cb, ce, v, ldv, off, vs, Dv, orow, n, vt.prefetch, first_of_head);
                else pv_group<false>(s + r, cb, ce, v, ldv, off, vs, Dv, orow, n, vt.prefetch, true);
            }
        }
    }
};

// The decode route of the AVX-512 families (routes.h).
using Avx512DecodeRoute = DecodeRoute<TileLoop<V512, DecodeGemm<F32Elem>>, TileLoop<V512, DecodeGemm<F16Elem>>,
                                      TileLoop<V512, DecodeGemm<Bf16Elem>>, TileLoop<V512, DecodeGemm<I8Elem>>,
                                      TileLoop<V512, DecodeGemm<F8Elem>>>;

}  // namespace
}  // namespace fa2cpu
