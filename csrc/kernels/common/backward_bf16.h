// bfloat16 products of the backward on vdpbf16ps, for the avx512bf16 family (amx has AMX tiles,
// backward_amx.h):
// BackwardLoop<V512, Bf16Products> (backward_loop.h: the same items, row groups, key tiles and
// softmax gradient as float32) with all five tile products on vdpbf16ps, accumulating in float32.
// vdpbf16ps(acc, a, b) adds a[2i]*b[2i] + a[2i+1]*b[2i+1] to float32 lane i, so each product
// stores its operands as bf16 PAIRS along its reduction axis (one uint32 per pair, low half first):
//
//   product            lanes     reduction  a (vector operand)             b (broadcast pair)
//   S^T  = K Q^T       rows      D          qp  [D2][GR]  Q pairs           kb  [nkeys][D2] K rows
//   dP^T = V dO^T      rows      Dv         dop [Dv2][GR] dO pairs          vb  [nkeys][Dv2] V rows
//   dV  += P^T dO      features  rows       dorp [GR/2][lop] dO row pairs   pT  [BC][kLP] bf16 P^T
//   dK  += dS^T Q      features  rows       qrp  [GR/2][lqp] Q row pairs    dsT [BC][kLP] bf16 dS^T
//   dQ^T += K^T dS^T   rows      keys       dsp [BC/2][RB] dS pairs/block   kT  [D][ldkt] K^T rows
//
// (D2 = ceil(D/2); odd D, Dv and padding rows are zero halves.) P and dS are rounded to bf16 (round
// to nearest even) only as operands of dV, dK and dQ, as FlashAttention-2 does for bf16; S, dP, P,
// dS themselves, D_i and every accumulator stay float32. The inputs are bf16 already, so packing
// them is exact. An odd key count n leaves the last dS pair half empty; its K^T half is masked, so
// a key outside [cb, ce) (maybe NaN or inf) never meets the zero half.
//
// float32 and float16 inputs keep BackwardLoop<V512> (F32Products): Bf16Backward picks per call.
#pragma once
#include <immintrin.h>

#include "backward_loop.h"
#include "gemm_bf16.h"
#include "vec_avx512.h"

namespace fa2cpu {
namespace {

// A row group's Q / dO rows staged as bf16 and turned into the pair layouts of the bf16 products
// (Bf16Products below, AmxProducts in backward_amx.h): rows [M][ld] (ld a multiple of 32) ->
// fp [ld/2][GR] pairs along features (row i's uint32 pairs are column i: 16 x 16 transposes) and
// rp [M/2][ldr] row pairs (rows 2p, 2p+1 interleaved per feature; ldr >= ld). Written row by row
// (a scatter of 4-byte pairs per row), the avx512bf16 family's packing cost ~2 % of its backward.
struct Bf16RowStage {
    // n bf16 values, then zeros to ld (a multiple of 32).
    static void copy_bf16(uint16_t* dst, int64_t ld, const uint16_t* src, int64_t n) {
        for (int64_t j = 0; j < ld; j += 32) {
            const int64_t left = n - j;
            const __mmask32 m = left >= 32 ? ~__mmask32(0) : left <= 0 ? __mmask32(0) : (__mmask32(1) << left) - 1;
            _mm512_storeu_si512(dst + j, _mm512_maskz_loadu_epi16(m, src + j));
        }
    }
    // n float32 values (bf16 values: exact) as bf16, then zeros to ld (a multiple of 16); row null: all zeros.
    static void to_bf16(uint16_t* dst, int64_t ld, const float* row, int64_t n) {
        int64_t j = 0;
        if (row) {
            for (; j < n; j += 16) {
                const __mmask16 m = n - j >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - j)) - 1);
                const __m512 f = _mm512_maskz_loadu_ps(m, row + j);
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j), (__m256i)_mm512_cvtneps_pbh(f));
            }
        }
        for (; j < ld; j += 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j), _mm256_setzero_si256());
    }
    // D_i = sum_j dO[j] O[j] of bf16 rows with BackwardLoop::row_dot's arithmetic on the same
    // float32 values (same bits as the float32 route).
    static float row_dot(const uint16_t* dO, const uint16_t* o, int64_t Dv) {
        auto widen = [](const uint16_t* h) {
            return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h))), 16));
        };
        __m512 acc = _mm512_setzero_ps();
        int64_t j = 0;
        for (; j + 16 <= Dv; j += 16) acc = _mm512_fmadd_ps(widen(dO + j), widen(o + j), acc);
        alignas(64) float lanes[16];
        _mm512_store_ps(lanes, acc);
        float sum = 0.f;
        for (int l = 0; l < 16; ++l) sum += lanes[l];
        for (; j < Dv; ++j) sum += bf16_to_f32(dO[j]) * bf16_to_f32(o[j]);
        return sum;
    }
    // M (a multiple of 16) staged rows into the pair layouts.
    template <int64_t GR>
    static void to_pairs(const uint16_t* rows, int64_t ld, int64_t M, uint32_t* fp, uint32_t* rp, int64_t ldr) {
        const uint32_t* r32 = reinterpret_cast<const uint32_t*>(rows);
        const int64_t ld2 = ld / 2;
        for (int64_t r0 = 0; r0 < M; r0 += 16)
            for (int64_t t0 = 0; t0 < ld2; t0 += 16) {
                __m512i v[16];
                for (int i = 0; i < 16; ++i) v[i] = _mm512_loadu_si512(r32 + (r0 + i) * ld2 + t0);
                transpose16x16_epi32(v);
                for (int i = 0; i < 16; ++i) _mm512_storeu_si512(fp + (t0 + i) * GR + r0, v[i]);
            }
        for (int64_t p = 0; p < M / 2; ++p)
            for (int64_t j = 0; j < ld; j += 16) {
                const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows + 2 * p * ld + j)));
                const __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows + (2 * p + 1) * ld + j)));
                _mm512_storeu_si512(rp + p * ldr + j, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
            }
    }
};

// out[j*ldo + v*16 + lane] (+)= sum_{t < T} a[t*lda + v*16 + lane] . b[j*ldb + 2t .. 2t+1],
// j < nj, v < nv (<= 6): a holds pairs in lanes, b pairs broadcast. Register blocking NV x NJ with
// NV*NJ <= 24 accumulators (6 x 4 like the forward's micro-tiles, 4 x 6 for the feature-lane
// products, whose 8 vectors at D = 128 split 4 + 4), NV loads and one broadcast: <= 31 zmm.
// half_last: the last pair of b has its high half masked to 0 (an odd reduction length).
struct PairGemm {
    static constexpr int kMaxNV = 6;
    template <int NV, int NJ, bool kMaskHigh>
    static inline __attribute__((always_inline)) void step(__m512 (&acc)[NV][NJ], const uint32_t* a, const uint16_t* b,
                                                           int64_t ldb) {
        __m512i av[NV];
#pragma GCC unroll 8
        for (int v = 0; v < NV; ++v) av[v] = _mm512_loadu_si512(a + v * 16);
#pragma GCC unroll 8
        for (int j = 0; j < NJ; ++j) {
            uint32_t kk;
            std::memcpy(&kk, b + j * ldb, 4);
            const __m512i bb = _mm512_set1_epi32(int(kMaskHigh ? kk & 0xffffu : kk));
#pragma GCC unroll 8
            for (int v = 0; v < NV; ++v) acc[v][j] = _mm512_dpbf16_ps(acc[v][j], (__m512bh)av[v], (__m512bh)bb);
        }
    }
    template <int NV, int NJ, bool kAccumulate>
    static inline void micro(const uint32_t* a, int64_t lda, const uint16_t* b, int64_t ldb, int64_t T, bool half_last,
                             float* out, int64_t ldo) {
        // Accumulating, out's rows are prefetched now and added after the products: loaded first
        // (from L2 or beyond: dK / dV rows of a 128-key tile are 64 KB each), they held the first
        // vdpbf16ps of every chain, ~10 % of the dV / dK time on a Zen 4 (rdtsc around the calls).
        if (kAccumulate)
#pragma GCC unroll 8
            for (int j = 0; j < NJ; ++j)
#pragma GCC unroll 8
                for (int v = 0; v < NV; ++v) _mm_prefetch(reinterpret_cast<const char*>(out + j * ldo + v * 16), _MM_HINT_T0);
        __m512 acc[NV][NJ];
#pragma GCC unroll 8
        for (int j = 0; j < NJ; ++j)
#pragma GCC unroll 8
            for (int v = 0; v < NV; ++v) acc[v][j] = _mm512_setzero_ps();
        // The masked last pair apart: a plain pair broadcasts from memory (load port), a masked
        // one through a general register (the vector ALU port vdpbf16ps needs).
        const int64_t full = half_last ? T - 1 : T;
        for (int64_t t = 0; t < full; ++t) step<NV, NJ, false>(acc, a + t * lda, b + 2 * t, ldb);
        if (half_last) step<NV, NJ, true>(acc, a + (T - 1) * lda, b + 2 * (T - 1), ldb);
#pragma GCC unroll 8
        for (int j = 0; j < NJ; ++j)
#pragma GCC unroll 8
            for (int v = 0; v < NV; ++v)
                _mm512_storeu_ps(out + j * ldo + v * 16,
                                 kAccumulate ? _mm512_add_ps(_mm512_loadu_ps(out + j * ldo + v * 16), acc[v][j]) : acc[v][j]);
    }
    template <int NV, bool kAcc, int NJ>
    static void tail(int nj, const uint32_t* a, int64_t lda, const uint16_t* b, int64_t ldb, int64_t T, bool half,
                     float* out, int64_t ldo) {
        if constexpr (NJ >= 1) {
            if (nj == NJ) micro<NV, NJ, kAcc>(a, lda, b, ldb, T, half, out, ldo);
            else tail<NV, kAcc, NJ - 1>(nj, a, lda, b, ldb, T, half, out, ldo);
        }
    }
    template <bool kAcc, int NV = kMaxNV>
    static void run(int nv, int64_t nj, const uint32_t* a, int64_t lda, const uint16_t* b, int64_t ldb, int64_t T,
                    bool half, float* out, int64_t ldo) {
        if constexpr (NV >= 1) {
            if (nv != NV) return run<kAcc, NV - 1>(nv, nj, a, lda, b, ldb, T, half, out, ldo);
            constexpr int NJ = 24 / NV < 8 ? 24 / NV : 8;
            int64_t j = 0;
            for (; j + NJ <= nj; j += NJ) micro<NV, NJ, kAcc>(a, lda, b + j * ldb, ldb, T, half, out + j * ldo, ldo);
            if (j < nj) tail<NV, kAcc, NJ - 1>(int(nj - j), a, lda, b + j * ldb, ldb, T, half, out + j * ldo, ldo);
        }
    }
    // Feature-lane products (dV, dK): `vectors` 16-wide feature vectors cut into equal chunks of <= 6.
    static void run_features(int64_t vectors, int64_t nj, const uint32_t* a, int64_t lda, const uint16_t* b, int64_t ldb,
                             int64_t T, float* out, int64_t ldo) {
        const int64_t chunks = (vectors + kMaxNV - 1) / kMaxNV;
        const int64_t per = (vectors + chunks - 1) / chunks;
        for (int64_t f = 0; f < vectors; f += per) {
            const int nv = int(vectors - f < per ? vectors - f : per);
            run<true>(nv, nj, a + f * 16, lda, b, ldb, T, false, out + f * 16, ldo);
        }
    }
};

struct Bf16Products {
    using G = Bf16Gemm<V512>;
    static constexpr int W = 16;
    static constexpr int RB = G::RB;
    static constexpr int64_t BC = V512::BC;
    static constexpr int64_t kGroupRows = V512::MAX_ROWS;
    static constexpr int64_t kRowAlign = W, kFeatureAlign = W, kKeyPad = 0;  // backward_loop.h F32Products
    // Row blocks per dV / dK update (backward_loop.h F32Products), as the amx policy does: the
    // dkall / dvall rows of a 128-key tile (64 KB each at D = 128, from L2 or beyond) are loaded
    // and stored once per update, by micro-kernels that ran ~15 % of their time in that load on
    // the Zen 4 (perf, 1 thread). Two blocks (the whole group) halve it; same bits, the row pairs
    // being reduced in the same order. P^T and dS^T hold the run's rows side by side (row r of
    // the run in column r, rows kLP apart), the dS pairs one [BC/2][RB] panel per block.
#ifndef FA2CPU_BWD_BF16_UPDATE_BLOCKS
#define FA2CPU_BWD_BF16_UPDATE_BLOCKS 2
#endif
    static constexpr int kUpdateBlocks = FA2CPU_BWD_BF16_UPDATE_BLOCKS;
    static constexpr int64_t kLP = kUpdateBlocks * RB, kSlot = BC * RB, kDsPanel = (BC + 1) / 2 * RB;
    static_assert(kUpdateBlocks * RB <= kGroupRows, "a run lies within its group");
    static int64_t dq_features(int64_t D) { return D; }
    static_assert(RB % 2 == 0 && kGroupRows % 2 == 0, "row pairs never straddle a row block");

    struct Bufs {
        uint32_t *qp, *dop, *qrp, *dorp, *dsp;  // pair layouts of the table above
        uint16_t *kb, *vb, *kT, *pT, *dsT, *qs, *dos;
        int64_t keys, d, ldq, ldo, d2, dv2, ldkt;  // ldq / ldo: D / Dv rounded up to 16 (dkall / dvall too)
        int64_t lsq, lso;  // staging rows qs [GR][lsq], dos [GR][lso]: D / Dv rounded up to 32
        int64_t lqp, lop;  // row pairs of qrp / dorp: lsq / lso, odd_lines (backward_loop.h)
    };
    static Bufs carve(const Params& p, int64_t keys, float* base, int64_t* floats) {
        Bufs x;
        x.d = p.d;
        x.ldq = round_up(p.d, W);
        x.ldo = round_up(p.dv, W);
        x.d2 = (p.d + 1) / 2;
        x.dv2 = (p.dv + 1) / 2;
        x.lsq = round_up(p.d, 32);
        x.lso = round_up(p.dv, 32);
        x.lqp = odd_lines(x.lsq);
        x.lop = odd_lines(x.lso);
        x.keys = keys;
        x.ldkt = round_up(keys + 1, 2);  // + 1: a masked half pair may read one key past the item
        Carver c{base};
        auto pairs = [&](int64_t n) { return reinterpret_cast<uint32_t*>(c.take(n)); };
        auto halves = [&](int64_t n) { return reinterpret_cast<uint16_t*>(c.take((n + 1) / 2)); };
        x.qp = pairs(x.lsq / 2 * kGroupRows);
        x.dop = pairs(x.lso / 2 * kGroupRows);
        x.qrp = pairs(kGroupRows / 2 * x.lqp);
        x.dorp = pairs(kGroupRows / 2 * x.lop);
        x.dsp = pairs(kUpdateBlocks * kDsPanel);
        x.kb = halves(keys * 2 * x.d2);
        x.vb = halves(keys * 2 * x.dv2);
        x.kT = halves(p.d * x.ldkt);
        x.pT = halves(BC * kLP);
        x.dsT = halves(BC * kLP);
        x.qs = halves(kGroupRows * x.lsq);
        x.dos = halves(kGroupRows * x.lso);
        *floats = c.used;
        return x;
    }
    static int64_t panel(int64_t r, int64_t features, int64_t f) { return (r / RB) * features * RB + f * RB + r % RB; }

    // Key c's K and V rows as bf16 (an odd D's last half 0): pack_key from float32 rows (rounded
    // by V512::store_row, the bits of f32_to_bf16; exact here, the inputs being bf16), pack_key_raw
    // from contiguous bf16 rows as they are; finish_keys then builds K^T from the K rows.
    static void pack_key(Bufs& x, int64_t c, const float* k, const float* v, int64_t D, int64_t Dv) {
        uint16_t* kb = x.kb + c * 2 * x.d2;
        uint16_t* vb = x.vb + c * 2 * x.dv2;
        V512::store_row(kb, 0, 1, k, D, DType::bf16);
        V512::store_row(vb, 0, 1, v, Dv, DType::bf16);
        if (D % 2) kb[D] = 0;
        if (Dv % 2) vb[Dv] = 0;
    }
    static void pack_key_raw(Bufs& x, int64_t c, const uint16_t* k, const uint16_t* v, int64_t D, int64_t Dv) {
        uint16_t* kb = x.kb + c * 2 * x.d2;
        uint16_t* vb = x.vb + c * 2 * x.dv2;
        std::memcpy(kb, k, size_t(D) * 2);
        std::memcpy(vb, v, size_t(Dv) * 2);
        if (D % 2) kb[D] = 0;
        if (Dv % 2) vb[Dv] = 0;
    }
    // K^T [D][ldkt] (vec_avx512.h), its padding columns [keys, ldkt) zero.
    static void finish_keys(Bufs& x) {
        transpose_bf16_rows(x.kb, 2 * x.d2, x.keys, x.d, x.kT, x.ldkt);
        for (int64_t d = 0; d < x.d; ++d)
            for (int64_t e = x.keys; e < x.ldkt; ++e) x.kT[d * x.ldkt + e] = 0;
    }
    // Row r of the group into the bf16 staging rows: pack_row from float32 rows (q / dO null: a
    // padding row of zeros), pack_row_raw from contiguous bf16 rows as they are (returns D_i);
    // finish_rows then builds the four pair layouts.
    static void pack_row(Bufs& x, int64_t r, const float* q, const float* dO, int64_t D, int64_t Dv) {
        Bf16RowStage::to_bf16(x.qs + r * x.lsq, x.lsq, q, D);
        Bf16RowStage::to_bf16(x.dos + r * x.lso, x.lso, dO, Dv);
    }
    static float pack_row_raw(Bufs& x, int64_t r, const uint16_t* q, const uint16_t* dO, const uint16_t* o, int64_t D,
                              int64_t Dv) {
        Bf16RowStage::copy_bf16(x.qs + r * x.lsq, x.lsq, q, D);
        Bf16RowStage::copy_bf16(x.dos + r * x.lso, x.lso, dO, Dv);
        return Bf16RowStage::row_dot(dO, o, Dv);
    }
    static void finish_rows(Bufs& x, int64_t M, int64_t, int64_t) {
        Bf16RowStage::to_pairs<kGroupRows>(x.qs, x.lsq, M, x.qp, x.qrp, x.lqp);
        Bf16RowStage::to_pairs<kGroupRows>(x.dos, x.lso, M, x.dop, x.dorp, x.lop);
    }
    static void store_gradients(Bufs&, int64_t, float* sp, float* dpp, __m512 pr, __m512 ds) {
        _mm512_storeu_ps(sp, pr);
        _mm512_storeu_ps(dpp, ds);
    }
    static void scores(Bufs& x, int nv, int64_t r0, int64_t ck, int64_t n, int64_t, int64_t, float* s, float* dp) {
        PairGemm::run<false>(nv, n, x.qp + r0, kGroupRows, x.kb + ck * 2 * x.d2, 2 * x.d2, x.d2, false, s, RB);
        PairGemm::run<false>(nv, n, x.dop + r0, kGroupRows, x.vb + ck * 2 * x.dv2, 2 * x.dv2, x.dv2, false, dp, RB);
    }
    // The updates of `rows` rows from r0: row blocks of RB rows (P in s, dS in dp, one block per
    // kSlot floats), all full but the last, which has nv vectors.
    static void updates(Bufs& x, int nv, int64_t r0, int64_t rows, int64_t ck, int64_t n, int64_t D, const float* s,
                        const float* dp, float* dkall, float* dvall, float* dqT) {
        // P^T, dS^T as bf16 rows of keys (rows along), dS as pairs of keys (rows in lanes).
        const int64_t blocks = (rows + RB - 1) / RB, n2 = (n + 1) / 2;
        for (int64_t bi = 0; bi < blocks; ++bi) {
            const int nvb = bi + 1 < blocks ? G::RV : nv;
            const float *sb = s + bi * kSlot, *dpb = dp + bi * kSlot;
            for (int64_t c = 0; c < n; ++c)
                for (int v = 0; v < nvb; ++v) {
                    const int64_t at = c * RB + v * W, to = c * kLP + bi * RB + v * W;
                    _mm256_storeu_si256(reinterpret_cast<__m256i*>(x.pT + to), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(sb + at)));
                    _mm256_storeu_si256(reinterpret_cast<__m256i*>(x.dsT + to), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(dpb + at)));
                }
            for (int64_t c2 = 0; c2 < n2; ++c2)
                for (int v = 0; v < nvb; ++v) {
                    const __m512 e0 = _mm512_loadu_ps(dpb + 2 * c2 * RB + v * W);
                    const __m512 e1 = 2 * c2 + 1 < n ? _mm512_loadu_ps(dpb + (2 * c2 + 1) * RB + v * W) : _mm512_setzero_ps();
                    G::store_p_pair(reinterpret_cast<float*>(x.dsp + bi * kDsPanel), c2, v, e0, e1);
                }
        }
        const int64_t rows2 = (rows + 1) / 2, pr0 = r0 / 2;  // padding rows: P = dS = 0, zero operands
        PairGemm::run_features(x.ldo / W, n, x.dorp + pr0 * x.lop, x.lop, x.pT, kLP, rows2, dvall + ck * x.ldo, x.ldo);
        PairGemm::run_features(x.ldq / W, n, x.qrp + pr0 * x.lqp, x.lqp, x.dsT, kLP, rows2, dkall + ck * x.ldq, x.ldq);
        for (int64_t bi = 0; bi < blocks; ++bi)
            PairGemm::run<true>(bi + 1 < blocks ? G::RV : nv, D, x.dsp + bi * kDsPanel, RB, x.kT + ck, x.ldkt, n2, n % 2 != 0,
                                dqT + (r0 + bi * RB) * D, RB);
    }
};

// The backward of the bf16 families: bf16 inputs on Bf16Products, the others on float32.
struct Bf16Backward {
    using F32 = BackwardLoop<V512>;
    using Bf16 = BackwardLoop<V512, Bf16Products>;
    static_assert(F32::BC == Bf16::BC, "one key tile for the driver's splits");
    static constexpr int64_t BC = F32::BC;
    // bf16 items capped as on 16 CPUs (3 MB) on any machine: on the 2-core Zen 4 (2 threads,
    // B=1 H=32 N=4096 D=128 full, in process against the machine's 24 MB cap) 1.006-1.055x over
    // six orders (median 1.044x), and 1.10 / 1.11x in session 57; causal 0.99-1.08x; H=16 N=2048
    // (two splits instead of one) 0.98-1.05x, full and causal, 1 and 2 threads. bench/RESULTS.md,
    // sessions 57 and 58.
    static constexpr int64_t kBf16CapCpus = 16;
    static int64_t scratch_floats(const BackwardParams& p, int64_t keys) {
        return DType(p.f.dtype) == DType::bf16 ? Bf16::scratch_floats(p, keys) : F32::scratch_floats(p, keys);
    }
    static void run_item(const BackwardParams& p, const BackwardItem& it, float* scratch, float* dq_part) {
        if (DType(p.f.dtype) == DType::bf16) Bf16::run_item(p, it, scratch, dq_part);
        else F32::run_item(p, it, scratch, dq_part);
    }
};

}  // namespace
}  // namespace fa2cpu
