// bfloat16 GEMM policy of the tile loop for AVX-512-BF16 (vdpbf16ps), "rows in lanes" like
// gemm_f32.h. vdpbf16ps(acc, a, b) adds a[2i]*b[2i] + a[2i+1]*b[2i+1] to float32 lane i, so every
// operand is stored as bf16 PAIRS along the reduction axis (one uint32 per pair, low half first):
//
//   Q   qbuf  [D2][M]   pair (Q[r][2t], Q[r][2t+1]) of row r            (D2 = ceil(D/2), not scaled)
//   K   kt    [nc][ldk] bf16 rows; the pair at column 2t is broadcast as one uint32
//                       (read in place for contiguous unpaged bf16 with even D, else packed)
//   P   pbuf  [C2][RB]  pair (P[r][2c], P[r][2c+1]) of row r (C2 = ceil(nc/2); tile_loop.h's P block)
//   V   vbuf  [ceil(Dv/ND)][C2max][ND]  pair (V[2c][j], V[2c+1][j]) at panel j / ND, row c,
//                       column j % ND (C2max = ceil(BC/2)), always packed: two rows interleaved
//                       into panels of the ND columns one PV micro-tile reads, so its steps walk
//                       one contiguous run (rows of all Dv pairs put each step on a new line,
//                       rows 512 B apart: bench/RESULTS.md session 39)
//
// Odd D / odd nc are padded with zero halves. Products are exact in float32 and accumulate in
// float32; P is rounded to bf16 before P V, as FlashAttention-2 does, while the row sums l use
// the float32 P. The score scale is applied to the float32 S (ScaleAt::qk_output): scaling bf16 Q
// would add a rounding.
#pragma once
#include <immintrin.h>

#include "kernel.h"
#include "policy.h"

namespace fa2cpu {
namespace {

// 16 bf16 pairs (e0[i], e1[i]) as one uint32 each, e0 in the low half (round to nearest even):
// the pair layout of this file. cvtne2ps_pbh(b, a) = [bf16(a) x16, bf16(b) x16]; the permute
// interleaves it to a0 b0 a1 b1 ...
inline __m512i interleave_halves16(__m512i ab) {
    const __m512i inter = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                           23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(inter, ab);
}
inline __m512i bf16_pairs(__m512 e0, __m512 e1) { return interleave_halves16((__m512i)_mm512_cvtne2ps_pbh(e1, e0)); }

template <class V>
struct Bf16Gemm : TransposedO<V> {
    static constexpr int W = 16;
    static constexpr int RV = V::RV, NK = V::NK, ND = V::ND;
    static constexpr int RB = RV * W;
    static constexpr int64_t BC = V::BC;
    static constexpr int64_t kMaxRows = V::MAX_ROWS;
    static constexpr int64_t kRowAlign = W;
    static constexpr ScaleAt kScaleAt = ScaleAt::qk_output;  // scaled for free in the QK store
    static constexpr PStore kPStore = PStore::bf16_pairs;    // softmax writes P as bf16 pairs
    static constexpr bool kTilesEndAtBlocks = false;
    static_assert(V::W == 16, "bf16 pairs fill 16 float32 lanes");

    static int64_t q_floats(int64_t D, int64_t M) { return (D + 1) / 2 * M; }
    static int64_t k_floats(int64_t D) { return BC * ((D + 1) / 2); }
    static int64_t v_floats(int64_t Dv) { return (BC + 1) / 2 * round_up(Dv, ND); }

    static uint32_t pair(uint16_t lo, uint16_t hi) { return uint32_t(lo) | (uint32_t(hi) << 16); }
    // Row r of Q as bf16 pairs at q[t*M + r]: the row rounded to bf16 by V::store_row (vectorised,
    // the bits of f32_to_bf16; an odd D's last pair padded with 0), then one strided store per pair.
    // (The pairs are built from the uint16_t array, not read through a uint32_t view of it: the
    // padding store and such a read do not alias for the compiler, which let a D = 1 or 3 pair read
    // its high half before the 0 was written: NaN rows now and then.)
    static void pack_q_row(float* qbuf, int64_t M, int64_t r, const float* row, int64_t D, float) {
        uint32_t* q = reinterpret_cast<uint32_t*>(qbuf);
        alignas(64) uint16_t h[kMaxHeadDim + 2];
        V::store_row(h, 0, 1, row, D, DType::bf16);
        h[D] = 0;
        for (int64_t t = 0; 2 * t < D; ++t) q[t * M + r] = pair(h[2 * t], h[2 * t + 1]);
    }
    static void zero_q_row(float* qbuf, int64_t M, int64_t r, int64_t D) {
        uint32_t* q = reinterpret_cast<uint32_t*>(qbuf);
        for (int64_t t = 0; 2 * t < D; ++t) q[t * M + r] = 0;
    }

    // K is read in place as bf16 pairs when its rows allow it (unit feature stride, even D, not
    // paged) and lie together (policy.h rows_in_place); else packed, and shared by the kv head's items.
    static bool k_pairs(const Params& p) { return p.k_dim_stride == 1 && p.d % 2 == 0 && !p.block_table; }
    static bool k_in_place(const Params& p, int64_t b) { return k_pairs(p) && rows_in_place(p, b, p.k_row_stride, p.d, kMaxRows); }
    static bool packs_k(const Params& p) { return packs_rows(k_pairs(p), p.k_row_stride, p.d); }
    static bool packs_v(const Params&) { return true; }
    static KvTile k_tile(const Params& p, int64_t b, int64_t c0, int64_t nc, int64_t head, float* buf) {
        const int64_t D = p.d, Dp = round_up(D, 2);
        const uint16_t* k = static_cast<const uint16_t*>(p.k);
        if (k_in_place(p, b))
            return {k + k_row_offset(p, b, c0, p.k_batch_stride, p.k_row_stride) + head, p.k_row_stride, 0, 0};
        uint16_t* out = reinterpret_cast<uint16_t*>(buf);
        for (int64_t c = 0; c < nc; ++c) {
            const uint16_t* src = k + k_row_offset(p, b, c0 + c, p.k_batch_stride, p.k_row_stride) + head;
            if (p.k_dim_stride == 1) std::memcpy(out + c * Dp, src, size_t(D) * sizeof(uint16_t));
            else for (int64_t d = 0; d < D; ++d) out[c * Dp + d] = src[d * p.k_dim_stride];
            if (Dp != D) out[c * Dp + D] = 0;
        }
        return {out, Dp, 0, 0};
    }

    static KvTile v_tile(const Params& p, int64_t b, int64_t c0, int64_t nc, int64_t head, float* buf) {
        const int64_t Dv = p.dv;
        const uint16_t* v = static_cast<const uint16_t*>(p.v);
        uint32_t* out = reinterpret_cast<uint32_t*>(buf);
        const int64_t ldp = (BC + 1) / 2 * ND, chunks = (Dv + ND - 1) / ND;
        alignas(64) uint32_t o[kMaxHeadDim + ND];
        for (int64_t c = 0; c < nc; c += 2) {
            const uint16_t* r0 = v + k_row_offset(p, b, c0 + c, p.v_batch_stride, p.v_row_stride) + head;
            const uint16_t* r1 = c + 1 < nc ? v + k_row_offset(p, b, c0 + c + 1, p.v_batch_stride, p.v_row_stride) + head : nullptr;
            int64_t j = 0;
            if (p.v_dim_stride == 1) {
                for (; j + 16 <= Dv; j += 16) {
                    const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0 + j)));
                    const __m512i hi = r1 ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r1 + j)))
                                          : _mm512_setzero_si512();
                    _mm512_storeu_si512(o + j, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
                }
            }
            for (; j < Dv; ++j) o[j] = pair(r0[j * p.v_dim_stride], r1 ? r1[j * p.v_dim_stride] : 0);
            for (; j < chunks * ND; ++j) o[j] = 0;
            for (int64_t k = 0; k < chunks; ++k) std::memcpy(out + k * ldp + (c / 2) * ND, o + k * ND, ND * sizeof(uint32_t));
        }
        return {out, ldp, 0, 0};
    }

    // s[j*RB + v*16 + lane] = post_scale * sum_t qpair[t][row] . kpair[j][t],  j < NKC
    template <int NV, int NKC>
    static inline void qk_micro(const uint32_t* q, int64_t M, const uint16_t* kt, int64_t ldk, int64_t D2,
                                float* s, __m512 post) {
        __m512 acc[NV][NKC];
#pragma GCC unroll 8
        for (int v = 0; v < NV; ++v)
#pragma GCC unroll 8
            for (int j = 0; j < NKC; ++j) acc[v][j] = _mm512_setzero_ps();
        for (int64_t t = 0; t < D2; ++t) {
            __m512i qv[NV];
#pragma GCC unroll 8
            for (int v = 0; v < NV; ++v) qv[v] = _mm512_loadu_si512(q + t * M + v * W);
#pragma GCC unroll 8
            for (int j = 0; j < NKC; ++j) {
                uint32_t kk;
                std::memcpy(&kk, kt + j * ldk + 2 * t, 4);
                const __m512i kb = _mm512_set1_epi32(int(kk));
#pragma GCC unroll 8
                for (int v = 0; v < NV; ++v)
                    acc[v][j] = _mm512_dpbf16_ps(acc[v][j], (__m512bh)qv[v], (__m512bh)kb);
            }
        }
#pragma GCC unroll 8
        for (int j = 0; j < NKC; ++j)
#pragma GCC unroll 8
            for (int v = 0; v < NV; ++v) _mm512_storeu_ps(s + j * RB + v * W, _mm512_mul_ps(acc[v][j], post));
    }

    // oT[j*M + v*16 + lane] += sum_c2 ppair[c2][row] . vpair[c2][j],  j < NDC
    template <int NV, int NDC>
    static inline void pv_micro(const uint32_t* pb, int64_t nc2, const uint32_t* vt, int64_t ldv, float* oT, int64_t M) {
        __m512 acc[NV][NDC];
#pragma GCC unroll 8
        for (int j = 0; j < NDC; ++j)
#pragma GCC unroll 8
            for (int v = 0; v < NV; ++v) acc[v][j] = _mm512_loadu_ps(oT + j * M + v * W);
        for (int64_t c = 0; c < nc2; ++c) {
            __m512i pr[NV];
#pragma GCC unroll 8
            for (int v = 0; v < NV; ++v) pr[v] = _mm512_loadu_si512(pb + c * RB + v * W);
#pragma GCC unroll 8
            for (int j = 0; j < NDC; ++j) {
                const __m512i vb = _mm512_set1_epi32(int(vt[c * ldv + j]));
#pragma GCC unroll 8
                for (int v = 0; v < NV; ++v) acc[v][j] = _mm512_dpbf16_ps(acc[v][j], (__m512bh)pr[v], (__m512bh)vb);
            }
        }
#pragma GCC unroll 8
        for (int j = 0; j < NDC; ++j)
#pragma GCC unroll 8
            for (int v = 0; v < NV; ++v) _mm512_storeu_ps(oT + j * M + v * W, acc[v][j]);
    }

    template <int NV, int T = 1>
    static void qk_tail(int t, const uint32_t* q, int64_t M, const uint16_t* kt, int64_t ldk, int64_t D2, float* s, __m512 post) {
        if constexpr (T < NK) {
            if (t == T) qk_micro<NV, T>(q, M, kt, ldk, D2, s, post);
            else qk_tail<NV, T + 1>(t, q, M, kt, ldk, D2, s, post);
        }
    }
    template <int NV, int T = 1>
    static void pv_tail(int t, const uint32_t* pb, int64_t nc2, const uint32_t* vt, int64_t ldv, float* oT, int64_t M) {
        if constexpr (T < ND) {
            if (t == T) pv_micro<NV, T>(pb, nc2, vt, ldv, oT, M);
            else pv_tail<NV, T + 1>(t, pb, nc2, vt, ldv, oT, M);
        }
    }
    template <int NV = RV>
    static void qk_nv(int nv, const uint32_t* q, int64_t M, const uint16_t* kt, int64_t ldk, int64_t D2, int64_t nc,
                      float* s, __m512 post) {
        if constexpr (NV >= 1) {
            if (nv != NV) return qk_nv<NV - 1>(nv, q, M, kt, ldk, D2, nc, s, post);
            int64_t c = 0;
            for (; c + NK <= nc; c += NK) qk_micro<NV, NK>(q, M, kt + c * ldk, ldk, D2, s + c * RB, post);
            if (c < nc) qk_tail<NV>(int(nc - c), q, M, kt + c * ldk, ldk, D2, s + c * RB, post);
        }
    }
    // vt: V's panels (v_tile), ldp apart
    template <int NV = RV>
    static void pv_nv(int nv, const uint32_t* pb, int64_t nc2, const uint32_t* vt, int64_t ldp, int64_t Dv, float* oT,
                      int64_t M) {
        if constexpr (NV >= 1) {
            if (nv != NV) return pv_nv<NV - 1>(nv, pb, nc2, vt, ldp, Dv, oT, M);
            int64_t j = 0;
            for (; j + ND <= Dv; j += ND) pv_micro<NV, ND>(pb, nc2, vt + j / ND * ldp, ND, oT + j * M, M);
            if (j < Dv) pv_tail<NV>(int(Dv - j), pb, nc2, vt + j / ND * ldp, ND, oT + j * M, M);
        }
    }

    static void qk(const ItemOperands& x, const RowBlock& rows, const KvTile& k, int64_t keys, float* s) {
        qk_nv(rows.vectors, reinterpret_cast<const uint32_t*>(x.q) + rows.r0, x.M, static_cast<const uint16_t*>(k.data),
              k.ld, (x.d + 1) / 2, keys, s, _mm512_set1_ps(x.qk_scale));
    }

    // P of keys (2*c2, 2*c2+1) for row vector v -> bf16 pairs in pbuf [C2][RB] (round to nearest even).
    static void store_p_pair(float* pbuf, int64_t c2, int v, __m512 e0, __m512 e1) {
        _mm512_storeu_si512(reinterpret_cast<uint32_t*>(pbuf) + c2 * RB + v * W, bf16_pairs(e0, e1));
    }

    // O^T += P V from the pairs the softmax wrote (PStore::bf16_pairs).
    static void pv(const ItemOperands& x, const RowBlock& rows, float* s, int64_t keys, const KvTile& v) {
        pv_nv(rows.vectors, reinterpret_cast<const uint32_t*>(s), (keys + 1) / 2,
              static_cast<const uint32_t*>(v.data), v.ld, x.dv, x.o + rows.r0, x.M);
    }
};

// The backward's softmax gradient of keys c and c+1 (c even; c+1 only when `both`) for one vector
// of rows (lanes v*16..), stored without going through float32: P^T and dS^T as bf16 rows of
// [key][RB] (the dV / dK operands) and dS as key pair c/2 of [pairs][RB] (the dQ operand, this
// file's pair layout; ds1 is zero for an odd last key). backward_loop.h calls it through the amx
// policy's pair_store (backward_amx.h: 1.00-1.03x, same bits). The vdpbf16ps policy
// (backward_bf16.h) keeps float32 P / dS and converts them in its updates: this store measured
// 0.987-0.996x there (2-core Xeon, FA2CPU_ISA=avx512bf16, bench/RESULTS.md session 38).
template <int RB>
inline void store_gradient_pair_bf16(uint16_t* pT, uint16_t* dsT, uint32_t* dsp, int64_t c, int v, bool both,
                                     __m512 pr0, __m512 ds0, __m512 pr1, __m512 ds1) {
    const int64_t at = c * RB + v * 16;
    // One conversion of both keys, [bf16(key c) x16, bf16(key c+1) x16]: its halves are the two
    // P^T / dS^T rows, its interleave the dS pair (same bits as converting each; 1.01x, session
    // 53). An odd last key (not both) passes pr1 = ds1 = 0: its dS pair gets zeros for key c + 1
    // and no row c + 1 is stored.
    const __m512i pp = (__m512i)_mm512_cvtne2ps_pbh(pr1, pr0), dd = (__m512i)_mm512_cvtne2ps_pbh(ds1, ds0);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pT + at), _mm512_castsi512_si256(pp));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dsT + at), _mm512_castsi512_si256(dd));
    if (both) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pT + at + RB), _mm512_extracti64x4_epi64(pp, 1));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dsT + at + RB), _mm512_extracti64x4_epi64(dd, 1));
    }
    _mm512_storeu_si512(dsp + (c / 2) * RB + v * 16, interleave_halves16(dd));
}

}  // namespace
}  // namespace fa2cpu
