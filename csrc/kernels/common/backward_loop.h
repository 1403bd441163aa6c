// The FlashAttention-2 backward (paper, Algorithm 2), written once and instantiated by every
// family with its vector traits V (V512 in vec_avx512.h, V256 in avx2.cpp, VGeneric in
// generic.cpp) and a products policy P: F32Products<V> below (float32 micro-kernels of F32Gemm<V>;
// bf16/fp16 converted while packing) for every family and dtype, except bf16 on the avx512bf16
// family, which runs Bf16Products (backward_bf16.h, vdpbf16ps), and bf16 on the amx family, which
// runs AmxProducts (backward_amx.h, AMX tiles; vdpbf16ps runs at half the float32 FMA rate on
// Intel cores, tdpbf16ps at ~13x). A policy also states the padding its operands need
// (kRowAlign, kFeatureAlign, kKeyPad, dq_features), its row block RB, and may stage rows
// (pack_row, then finish_rows once per group) and store P / dS its own way (store_gradients, or
// pair_store two keys at a time: the amx policy writes its bf16 operands directly).
//
// Work split (csrc/driver/backward.cpp plans it; kernel.h BackwardItem): an item owns the keys
// [kb, ke) of one kv head of one sequence and every query row that can see one of them (all
// heads of the GQA group x query positions [i0, i1)). dK and dV of its keys accumulate in scratch
// over every row and are written once: the GQA sum and the key ownership need no synchronisation.
//
// dQ without atomics: each item accumulates dQ^T of its rows over its keys in scratch. When the
// driver gives a (sequence, kv head) one item (every key), that item writes dq itself; otherwise
// the key axis is split into a number of items fixed by the shapes and the machine's CPU count
// (never by the thread count; backward.cpp) and each writes its float32 dQ rows to a partial
// buffer (streamed: store_dq), which the driver sums in split order, in row chunks queued behind
// the items. Chosen over a second pass that owns dQ per query
// tile: the second pass recomputes S, P and dP (3 of the 5 tile products again, 7 products
// instead of 5, ~1.4x the FLOPs), while the partials cost one float32 copy of dq per split
// (O(N*D)) and one streaming sum. Both orders are fixed, so results are bit-identical for any
// thread count.
//
// Loop order: row groups of kGroupRows rows (V::MAX_ROWS, the forward's item size) outer, key
// tiles of BC keys inner, so a group's Q / dO / dQ panels stay in L2 while every K/V tile of the
// item streams past them (measured: packing all rows of a 2048-row item and looping key tiles
// outer ran the same micro-kernels at 44 instead of 62 GFLOP/s, the panels coming from L3).
//
// Scratch (floats, laid out by `layout`; rows >= the group's real rows are padding):
//   ops: the products policy's operand buffers (P::carve): the item's K / V packed once per item
//        (strides and dtype conversion end there) and the row group's Q / dO in the layouts of
//        its products (F32Products: float32 K/V rows, Q/dO transposed panels and row-major rows)
//   dkall [nkeys][ldq], dvall [nkeys][ldo]: dK / dV accumulators of the item's keys, ldq / ldo =
//                   D / Dv rounded up to W
//   per row group (GR = kGroupRows rows, in row blocks of RB = RV*W rows):
//   dqT panels [Dq][RB]  dQ^T accumulator (dQ^T += K^T dS^T), Dq = P::dq_features(D)
//   lse2, delta, slope [GR]: log2-domain LSE (+inf: the row contributes nothing), D_i =
//                        rowsum(dO o O), alibi slope * log2(e)
//   first_key, last_key, diagonal [GR] int64: visible keys of the row within [kb, ke), its diagonal
//   s, dp [P::kUpdateBlocks][BC][RB]: S then P, dP then dS, of up to kUpdateBlocks row blocks of
//                        one key range (key c, row lane r of the block at c*RB + r of its slot);
//                        a policy with pair_store leaves S and dP there and keeps P / dS
//                        in operands of its own
//
// Per (key tile, row block) with visible keys, on the sub-range [cb, ce) of keys some row of the
// block sees: S^T = K Q^T, dP^T = V dO^T; P = exp2(scale' s - lse2), dS = scale P (dP - D_i)
// (times 1 - tanh^2 with softcap), both exactly 0 outside each row's visible range; then
// dV += P^T dO, dK += dS^T Q, dQ^T += K^T dS^T, the updates once per run of up to
// P::kUpdateBlocks consecutive row blocks that see the same keys (the dV / dK reduction over
// rows continues across the run's blocks; same bits as block by block). No Nq x Nk buffer exists.
#pragma once
#include <type_traits>

#include "gemm_f32.h"
#include "kernel.h"

namespace fa2cpu {
namespace {

// transpose16<V> (policy.h): the panel <-> row copies below.

// Row stride (in 4-byte elements) of an operand panel whose rows are re-read across many rows:
// rows of a whole even number of 64-byte lines get one line more. Rows 512 B apart (D = 128) fall
// into 8 of L1's 64 sets, so the 128 rows of dO / Q that dV / dK re-read per key chunk (and the K
// rows of dQ) could not stay in L1; with an odd number of lines consecutive rows take every set.
// Same bits; fp32 backward 1.03-1.04x (amx and avx2 families, 1 and 2 threads, 2-core Xeon with
// AMX; bench/RESULTS.md, session 39).
inline int64_t odd_lines(int64_t ld) { return ld % 16 == 0 && (ld / 16) % 2 == 0 ? ld + 16 : ld; }

// Scratch handed out in 64-byte steps from base (with base == nullptr: only counted, in `used`).
struct Carver {
    float* base;
    int64_t used = 0;
    float* take(int64_t n) {
        float* at = base ? base + used : nullptr;
        used += round_up(n, 16);
        return at;
    }
};

// The float32 products of the backward (every family; every dtype but bf16 on families with bf16
// hardware, whose products are backward_bf16.h's): operands converted to float32 while packing.
// A products policy P of BackwardLoop<V, P> supplies its operand buffers (`carve`), the packing of
// keys and rows, and the five tile products around the shared softmax gradient:
//   scores:  S^T = K Q^T and dP^T = V dO^T of a row block into s / dp [BC][RB] (float32)
//   updates: dV += P^T dO, dK += dS^T Q, dQ^T += K^T dS^T from P in s and dS in dp (store_gradients)
template <class V>
struct F32Products {
    using G = F32Gemm<V>;
    using vec = typename V::vec;
    static constexpr int W = V::W;
    static constexpr int RB = G::RB;
    static constexpr int64_t kGroupRows = V::MAX_ROWS;
    // Padding the loop gives this policy's operands (backward_amx.h's tiles need more): rows of a
    // group rounded up to kRowAlign, dK / dV rows (ldq / ldo) to kFeatureAlign, dK / dV kKeyPad
    // keys longer than the item, dQ^T panels of dq_features(D) features.
    static constexpr int64_t kRowAlign = W, kFeatureAlign = W, kKeyPad = 0;
    static int64_t dq_features(int64_t D) { return D; }
    // Accumulator registers of the forward's micro-tiles (RV x NK): the dV/dK micro-kernel keeps
    // as many, NJ feature vectors x kAcc/NJ keys (V512: 4 x 6 at D = 128, + 4 loads + 1 broadcast).
    static constexpr int kAcc = V::RV * V::NK;
    static constexpr int kMaxNJ = V::RV;
    // Row blocks whose P / dS one dV / dK update reduces over (the loop scores up to this many
    // consecutive blocks of one key range, then updates once): the dV / dK accumulators are
    // loaded and stored once per kUpdateBlocks * RB rows. With avx2's RB = 16 they were loaded
    // and stored every 16 rows and dV / dK ran ~1.25x slower per product than the scores (phase
    // timers, Zen 3); a harness of the micro-kernel alone: 28-32 flop/tick at 16 rows per call,
    // 36 at 32, 38-40 at 128. Whole backward, Zen 3, 1 thread: 1.04-1.05x at 128 rows, 1.02-1.06
    // at 64, 1.02 at 32 (bench/RESULTS.md, session 32). V512 (RB = 96) keeps one block.
#ifndef FA2CPU_BWD_UPDATE_ROWS
#define FA2CPU_BWD_UPDATE_ROWS 128
#endif
    static constexpr int kUpdateBlocks = RB >= FA2CPU_BWD_UPDATE_ROWS ? 1 : FA2CPU_BWD_UPDATE_ROWS / RB;

    // kall [nkeys][lq], vall [nkeys][lo]: the item's K / V, float32 row-major
    // qT panels [D][RB]: Q transposed per row block (rows in lanes: S^T = K Q^T)
    // qr [GR][lq]: Q row-major, zero padded (dK += dS^T Q, features in lanes)
    // doT panels [Dv][RB], dor [GR][lo]: the same for dO (dP^T = V dO^T, dV += P^T dO)
    struct Bufs {
        float *kall, *vall, *qT, *qr, *doT, *dor;
        int64_t ldq, ldo;  // D / Dv rounded up to W: dK / dV rows (the loop's dkall / dvall)
        int64_t lq, lo;    // rows of kall / qr and vall / dor: ldq / ldo, odd_lines
    };
    static Bufs carve(const Params& p, int64_t keys, float* base, int64_t* floats) {
        Bufs x;
        x.ldq = round_up(p.d, W);
        x.ldo = round_up(p.dv, W);
        x.lq = odd_lines(x.ldq);
        x.lo = odd_lines(x.ldo);
        Carver c{base};
        x.kall = c.take(keys * x.lq);
        x.vall = c.take(keys * x.lo);
        x.qT = c.take(p.d * kGroupRows);
        x.qr = c.take(kGroupRows * x.lq);
        x.doT = c.take(p.dv * kGroupRows);
        x.dor = c.take(kGroupRows * x.lo);
        *floats = c.used;
        return x;
    }
    // Index of (row r, feature f) in row-block panels of `features` x RB (row block r0 starts at r0 * features).
    static int64_t panel(int64_t r, int64_t features, int64_t f) { return (r / RB) * features * RB + f * RB + r % RB; }

    static void pack_key(Bufs& x, int64_t c, const float* k, const float* v, int64_t D, int64_t Dv) {
        std::memcpy(x.kall + c * x.lq, k, size_t(D) * 4);
        std::memcpy(x.vall + c * x.lo, v, size_t(Dv) * 4);
    }
    // Row r of the group (q, dO: float32, D / Dv features) into the row-major buffers; rows past
    // the real ones get zeros. finish_rows transposes them into the panels.
    static void pack_row(Bufs& x, int64_t r, const float* q, const float* dO, int64_t D, int64_t Dv) {
        float* qd = x.qr + r * x.lq;
        float* od = x.dor + r * x.lo;
        for (int64_t d = 0; d < x.ldq; ++d) qd[d] = q && d < D ? q[d] : 0.f;
        for (int64_t j = 0; j < x.ldo; ++j) od[j] = dO && j < Dv ? dO[j] : 0.f;
    }
    static void finish_rows(Bufs& x, int64_t M, int64_t D, int64_t Dv) {
        to_panels(x.qr, x.lq, M, D, x.qT);
        to_panels(x.dor, x.lo, M, Dv, x.doT);
    }
    // rows [M][ld] -> panels (`panel`) of `features` features, by 16 x 16 blocks (transpose16)
    // where whole, element by element for the rest. (Written row by row, D lines per row, the
    // transposes once cost ~4000 cycles per row at D = 128, 5-8 % of the backward.)
    static void to_panels(const float* rows, int64_t ld, int64_t M, int64_t features, float* panels) {
        for (int64_t r0 = 0; r0 < M; r0 += RB) {
            const int64_t rn = M - r0 < RB ? M - r0 : RB;
            float* block = panels + r0 * features;  // panel(r0, features, 0)
            int64_t r = 0;
            for (; r + 16 <= rn; r += 16)  // 16 x 16 blocks, then the rows and features left
                for (int64_t f0 = 0; f0 + 16 <= features; f0 += 16)
                    transpose16<V>(rows + (r0 + r) * ld + f0, ld, block + f0 * RB + r, RB);
            const int64_t fw = features / 16 * 16;
            for (int64_t rr = 0; rr < rn; ++rr)
                for (int64_t f = rr < r ? fw : 0; f < features; ++f) block[f * RB + rr] = rows[(r0 + rr) * ld + f];
        }
    }
    // P and dS of one vector of rows of key c (at = c * RB + row lane) into s / dp.
    static void store_gradients(Bufs&, int64_t, float* sp, float* dpp, typename V::vec pr, typename V::vec ds) {
        V::store(sp, pr);
        V::store(dpp, ds);
    }
    // One reduction pass over all D features (no DC passes, unlike the forward): on the 2-core
    // Zen 4, 1 thread, fp32 B=1 D=128 N=2048, the backward ran 0-6 % faster (median ~2 %) with one
    // pass than with V512's two passes of 64 (the two score products ~8 % faster by phase timers),
    // the same within noise on the AMX Xeon; the forward gained 1.5 % on the Zen 4 and lost 2-3 %
    // on the Xeon at 16 threads, so it keeps DC (bench/RESULTS.md, session 27).
    static void scores(Bufs& x, int nv, int64_t r0, int64_t ck, int64_t n, int64_t D, int64_t Dv, float* s, float* dp) {
        G::template qk_nv<kMaxHeadDim>(nv, x.qT + r0 * D, RB, x.kall + ck * x.lq, x.lq, D, n, s);
        G::template qk_nv<kMaxHeadDim>(nv, x.doT + r0 * Dv, RB, x.vall + ck * x.lo, x.lo, Dv, n, dp);
    }
    // The updates of `rows` rows from r0 (row blocks of RB rows; the last has nv vectors), whose P
    // and dS lie in s / dp, one block per kSlot floats.
    static void updates(Bufs& x, int nv, int64_t r0, int64_t rows, int64_t ck, int64_t n, int64_t D, const float* s,
                        const float* dp, float* dkall, float* dvall, float* dqT) {
        tn(n, rows, s, x.dor + r0 * x.lo, x.lo, x.ldo / W, dvall + ck * x.ldo, x.ldo);
        tn(n, rows, dp, x.qr + r0 * x.lq, x.lq, x.ldq / W, dkall + ck * x.ldq, x.ldq);
        for (int64_t b0 = 0; b0 < rows; b0 += RB)
            G::pv_nv(b0 + RB < rows ? V::RV : nv, dp + b0 / RB * kSlot, n, x.kall + ck * x.lq, x.lq, D,
                     dqT + (r0 + b0) * D, RB);
    }
    static constexpr int64_t kSlot = G::BC * RB;  // floats of one row block's P (or dS): [BC][RB]

    // ---- dV += P^T dO / dK += dS^T Q: features in lanes, P / dS broadcast -----------------------
    // acc[c*lda + j*W + lane] += sum_{r < rows} pt[r / RB * kSlot + c*RB + r % RB] * x[r*ldx + j*W + lane]
    // for c < NC, j < NJ: the forward's P V micro-kernel (gemm_f32.h pv_micro) with X in the role
    // of P (row stride ldx) and P^T in the role of V (keys RB apart), its reduction continued
    // across row blocks.
    template <int NC, int NJ>
    static inline void tn_micro(const float* pt, int64_t rows, const float* x, int64_t ldx, float* acc, int64_t lda) {
        // acc's rows prefetched now and added after the products (backward_bf16.h PairGemm::micro:
        // loaded first, from L2 or beyond, they held the first FMA of every chain).
#pragma GCC unroll 24
        for (int c = 0; c < NC; ++c)
#pragma GCC unroll 24
            for (int j = 0; j < NJ; ++j) __builtin_prefetch(acc + c * lda + j * W);
        vec a[NJ][NC];
#pragma GCC unroll 24
        for (int c = 0; c < NC; ++c)
#pragma GCC unroll 24
            for (int j = 0; j < NJ; ++j) a[j][c] = V::zero();
        for (int64_t b0 = 0; b0 < rows; b0 += RB, pt += kSlot) {
            const int64_t nr = rows - b0 < RB ? rows - b0 : RB;
            for (int64_t r = 0; r < nr; ++r) {
                vec xr[NJ];
#pragma GCC unroll 24
                for (int j = 0; j < NJ; ++j) xr[j] = V::load(x + (b0 + r) * ldx + j * W);
#pragma GCC unroll 24
                for (int c = 0; c < NC; ++c) {
                    const vec pb = V::set1(pt[c * RB + r]);
#pragma GCC unroll 24
                    for (int j = 0; j < NJ; ++j) a[j][c] = V::fma(xr[j], pb, a[j][c]);
                }
            }
        }
#pragma GCC unroll 24
        for (int c = 0; c < NC; ++c)
#pragma GCC unroll 24
            for (int j = 0; j < NJ; ++j) V::store(acc + c * lda + j * W, V::add(V::load(acc + c * lda + j * W), a[j][c]));
    }
    // n keys in blocks of kAcc/NJ, the remainder in pairs, then one key.
    template <int NJ>
    static void tn_keys(int64_t n, int64_t rows, const float* pt, const float* x, int64_t ldx, float* acc, int64_t lda) {
        constexpr int NC = kAcc / NJ > 0 ? kAcc / NJ : 1;
        int64_t c = 0;
        for (; c + NC <= n; c += NC) tn_micro<NC, NJ>(pt + c * RB, rows, x, ldx, acc + c * lda, lda);
        if constexpr (NC > 2)  // 2 x NJ accumulators keep the FMA pipes busier than NJ
            for (; c + 2 <= n; c += 2) tn_micro<2, NJ>(pt + c * RB, rows, x, ldx, acc + c * lda, lda);
        for (; c < n; ++c) tn_micro<1, NJ>(pt + c * RB, rows, x, ldx, acc + c * lda, lda);
    }
    template <int NJ = kMaxNJ>
    static void tn_nj(int nj, int64_t n, int64_t rows, const float* pt, const float* x, int64_t ldx, float* acc, int64_t lda) {
        if constexpr (NJ >= 1) {
            if (nj == NJ) tn_keys<NJ>(n, rows, pt, x, ldx, acc, lda);
            else tn_nj<NJ - 1>(nj, n, rows, pt, x, ldx, acc, lda);
        }
    }
    // acc [n][lda] += P^T X over `rows` rows; X row-major with `vectors` W-wide feature vectors
    // (zero padded), cut into equal chunks of at most kMaxNJ vectors.
    static void tn(int64_t n, int64_t rows, const float* pt, const float* x, int64_t ldx, int64_t vectors, float* acc,
                   int64_t lda) {
        const int64_t chunks = (vectors + kMaxNJ - 1) / kMaxNJ;
        const int64_t per = (vectors + chunks - 1) / chunks;
        for (int64_t j = 0; j < vectors; j += per) {
            const int nj = int(vectors - j < per ? vectors - j : per);
            tn_nj(nj, n, rows, pt, x + j * W, ldx, acc + j * W, lda);
        }
    }
};

template <class V, class P = F32Products<V>>
struct BackwardLoop {
    using vec = typename V::vec;
    static constexpr int W = V::W;
    static constexpr int RB = P::RB;            // rows per row block
    static constexpr int RV = RB / W;           // row vectors per row block
    static constexpr int64_t BC = F32Gemm<V>::BC;
    static constexpr int64_t kGroupRows = P::kGroupRows;
    static constexpr int64_t kSlot = BC * RB;  // floats of one row block's S / P (or dP / dS): [BC][RB]
    // Policies with pair_store (backward_amx.h) take P and dS two keys at a time, so dS
    // goes straight into its key pairs instead of through float32 dS in dp.
    template <class X, class = void>
    struct HasPairGradients : std::false_type {};
    template <class X>
    struct HasPairGradients<X, std::void_t<decltype(&X::pair_store)>> : std::true_type {};
    static constexpr bool kPairGradients = HasPairGradients<P>::value;
    // Policies with pack_row_raw / pack_key_raw / finish_keys (backward_amx.h, backward_bf16.h)
    // take contiguous bf16 rows as they are (their operands are bf16), not through float32 rows,
    // and complete their key operands once the item's keys are packed.
    template <class X, class = void>
    struct HasRawBf16 : std::false_type {};
    template <class X>
    struct HasRawBf16<X, std::void_t<decltype(&X::pack_row_raw)>> : std::true_type {};
    static constexpr bool kRawBf16 = HasRawBf16<P>::value;
    static_assert(RB % W == 0 && kGroupRows % RB == 0, "row groups are whole row blocks of whole vectors");
    static_assert(P::kRowAlign % W == 0 && RB % P::kRowAlign == 0, "padded rows stay whole vectors of a block");

    struct Layout {
        int64_t ldq, ldo;
        int64_t ops, dkall, dvall, dqT, lse2, delta, slope, first_key, last_key, diagonal, s, dp, total;
    };
    static Layout layout(const BackwardParams& bp, int64_t keys) {
        const Params& p = bp.f;
        Layout L;
        L.ldq = round_up(p.d, P::kFeatureAlign);
        L.ldo = round_up(p.dv, P::kFeatureAlign);
        int64_t o = 0;
        auto take = [&](int64_t n) { int64_t at = o; o += round_up(n, 16); return at; };
        int64_t ops_floats = 0;
        P::carve(p, keys, nullptr, &ops_floats);
        L.ops = take(ops_floats);
        L.dkall = take((keys + P::kKeyPad) * L.ldq);
        L.dvall = take((keys + P::kKeyPad) * L.ldo);
        L.dqT = take(P::dq_features(p.d) * kGroupRows);
        L.lse2 = take(kGroupRows);
        L.delta = take(kGroupRows);
        L.slope = take(kGroupRows);
        L.first_key = take(2 * kGroupRows);  // int64
        L.last_key = take(2 * kGroupRows);
        L.diagonal = take(2 * kGroupRows);
        L.s = take(P::kUpdateBlocks * kSlot);
        L.dp = take(P::kUpdateBlocks * kSlot);
        L.total = o;
        return L;
    }
    // Per-thread scratch of an item of `keys` keys (rows do not matter: they go by row groups).
    static int64_t scratch_floats(const BackwardParams& p, int64_t keys) { return layout(p, keys).total; }
    static int64_t panel(int64_t r, int64_t features, int64_t f) { return P::panel(r, features, f); }

    // ---- the item --------------------------------------------------------------------------
    static void run_item(const BackwardParams& bp, const BackwardItem& it, float* scratch, float* dq_part) {
        const Params& p = bp.f;
        FA2CPU_CHECK(p.d <= kMaxHeadDim && p.dv <= kMaxHeadDim);  // the row buffers below
        const int64_t b = it.b, group = p.hq / p.hk, D = p.d, Dv = p.dv;
        const int64_t nq = seq_nq(p, b), nk = seq_nk(p, b);
        const int64_t nqi = it.i1 - it.i0, R = group * nqi, nkeys = it.ke - it.kb;
        const Layout L = layout(bp, nkeys);
        const int64_t ldq = L.ldq, ldo = L.ldo;
        // Scratch regions by offset (`layout`); positions are int64 (exact beyond 2^24 keys).
        auto at = [scratch](int64_t offset) { return scratch + offset; };
        auto at64 = [scratch](int64_t offset) { return reinterpret_cast<int64_t*>(scratch + offset); };
        int64_t ops_floats = 0;
        typename P::Bufs ops = P::carve(p, nkeys, at(L.ops), &ops_floats);
        float* dkall = at(L.dkall);
        float* dvall = at(L.dvall);
        float* dqT = at(L.dqT);
        float* lse2 = at(L.lse2);
        float* delta = at(L.delta);
        float* slope = at(L.slope);
        int64_t* first_key = at64(L.first_key);
        int64_t* last_key = at64(L.last_key);
        int64_t* diagonal = at64(L.diagonal);
        float* s = at(L.s);
        float* dp = at(L.dp);
        const DType dt = DType(p.dtype);

        const int64_t k_head = it.kv_head * p.k_head_stride, v_head = it.kv_head * p.v_head_stride;
        const bool raw = kRawBf16 && dt == DType::bf16;
        const bool raw_keys = raw && p.k_dim_stride == 1 && p.v_dim_stride == 1;
        const bool raw_rows = raw && p.q_dim_stride == 1 && bp.dout_dim_stride == 1 && p.out_dim_stride == 1;
        auto bf16_at = [](const void* base, int64_t off) { return static_cast<const uint16_t*>(base) + off; };
        Careful cf(bp, it);
        for (int64_t c = 0; c < nkeys; ++c) {
            float krow[kMaxHeadDim], vrow[kMaxHeadDim];
            const void* kp = elem_ptr(p.k, k_row_offset(p, b, it.kb + c, p.k_batch_stride, p.k_row_stride) + k_head, dt);
            const bool bad = cf.hides && row_nonfinite(kp, D, p.k_dim_stride, dt);
            if constexpr (kRawBf16) {
                if (raw_keys && !bad) {
                    P::pack_key_raw(ops, c, bf16_at(p.k, k_row_offset(p, b, it.kb + c, p.k_batch_stride, p.k_row_stride) + k_head),
                                    bf16_at(p.v, k_row_offset(p, b, it.kb + c, p.v_batch_stride, p.v_row_stride) + v_head), D, Dv);
                    continue;
                }
            }
            V::load_row(krow, kp, D, p.k_dim_stride, dt);
            if (bad) cf.bad_key(c, krow);
            V::load_row(vrow, elem_ptr(p.v, k_row_offset(p, b, it.kb + c, p.v_batch_stride, p.v_row_stride) + v_head, dt),
                        Dv, p.v_dim_stride, dt);
            P::pack_key(ops, c, krow, vrow, D, Dv);
        }
        if constexpr (kRawBf16) P::finish_keys(ops);
        for (int64_t x = 0; x < (nkeys + P::kKeyPad) * ldq; ++x) dkall[x] = 0.f;
        for (int64_t x = 0; x < (nkeys + P::kKeyPad) * ldo; ++x) dvall[x] = 0.f;
        if (it.part < 0) zero_dq_outside(bp, it);

        for (int64_t g0 = 0; g0 < R; g0 += kGroupRows) {
            const int64_t GRr = R - g0 < kGroupRows ? R - g0 : kGroupRows;  // real rows of the group
            const int64_t M = round_up(GRr, P::kRowAlign);
            // Rows: pack Q and dO, D_i, log2 LSE, visible ranges, alibi.
            int64_t glo = it.ke, ghi = it.kb - 1;
            cf.start_group(g0);
            for (int64_t r = 0; r < M; ++r) {
                float qrow[kMaxHeadDim], orow[kMaxHeadDim], od[kMaxHeadDim];
                if (r >= GRr) {  // padding: zero operands, P = 0, never decides a skip
                    P::pack_row(ops, r, nullptr, nullptr, D, Dv);
                    lse2[r] = INFINITY; delta[r] = 0.f; slope[r] = 0.f;
                    first_key[r] = 0; last_key[r] = nk; diagonal[r] = 0;
                    continue;
                }
                const int64_t h = it.kv_head * group + (g0 + r) / nqi, i = it.i0 + (g0 + r) % nqi;
                const int64_t q_at = q_row_offset(p, b, i, p.q_batch_stride, p.q_row_stride) + h * p.q_head_stride;
                const int64_t do_at = q_row_offset(p, b, i, bp.dout_batch_stride, bp.dout_row_stride) + h * bp.dout_head_stride;
                const int64_t o_at = q_row_offset(p, b, i, p.out_batch_stride, p.out_row_stride) + h * p.out_head_stride;
                bool packed = false;
                // (only under causal / a window can a non-finite q / dO element reach a pair that does not see it)
                const bool bad = cf.hides && (row_nonfinite(elem_ptr(p.q, q_at, dt), D, p.q_dim_stride, dt) ||
                                              row_nonfinite(elem_ptr(bp.dout, do_at, dt), Dv, bp.dout_dim_stride, dt));
                if constexpr (kRawBf16) {
                    if (raw_rows && !bad) {
                        delta[r] = P::pack_row_raw(ops, r, bf16_at(p.q, q_at), bf16_at(bp.dout, do_at), bf16_at(p.out, o_at), D, Dv);
                        packed = true;
                    }
                }
                if (!packed) {
                    V::load_row(qrow, elem_ptr(p.q, q_at, dt), D, p.q_dim_stride, dt);
                    V::load_row(od, elem_ptr(bp.dout, do_at, dt), Dv, bp.dout_dim_stride, dt);
                    V::load_row(orow, elem_ptr(p.out, o_at, dt), Dv, p.out_dim_stride, dt);
                    delta[r] = row_dot(od, orow, Dv);  // from dO as it is
                    if (bad) cf.bad_row(r, qrow, od);
                    P::pack_row(ops, r, qrow, od, D, Dv);
                }
                const float lse = p.lse[q_row_offset(p, b, i, p.lse_batch_stride, p.lse_row_stride) + h * p.lse_head_stride];
                lse2[r] = lse == -INFINITY ? INFINITY : lse * kLog2e;  // no visible key: P = 0, not NaN
                int64_t lo, hi;
                visible_range(p, nq, nk, i, &lo, &hi);
                first_key[r] = lo < it.kb ? it.kb : lo;
                last_key[r] = hi > it.ke - 1 ? it.ke - 1 : hi;
                if (first_key[r] <= last_key[r]) {
                    glo = first_key[r] < glo ? first_key[r] : glo;
                    ghi = last_key[r] > ghi ? last_key[r] : ghi;
                }
                diagonal[r] = nk + (i - nq);
                slope[r] = p.alibi ? -p.alibi[b * p.alibi_batch_stride + h * p.alibi_head_stride] * kLog2e : 0.f;
            }
            P::finish_rows(ops, M, D, Dv);
            for (int64_t x = 0; x < P::dq_features(D) * round_up(M, RB); ++x) dqT[x] = 0.f;

            for (int64_t c0 = glo; c0 <= ghi; c0 += BC) {
                const int64_t nc = ghi + 1 - c0 < BC ? ghi + 1 - c0 : BC;
                // A run: consecutive row blocks [run_r0, run_end) of one key range [run_cb,
                // run_cb + run_n), at most kUpdateBlocks, scored into consecutive slots of s / dp
                // and updated at once.
                int64_t run_r0 = 0, run_end = 0, run_cb = 0, run_n = 0;
                int run_blocks = 0, run_nv = 0;
                auto flush = [&] {
                    if (run_blocks)
                        P::updates(ops, run_nv, run_r0, run_end - run_r0, run_cb - it.kb, run_n, D, s, dp, dkall, dvall, dqT);
                    run_blocks = 0;
                };
                for (int64_t r0 = 0; r0 < M; r0 += RB) {
                    const int nv = int((M - r0) / W < RV ? (M - r0) / W : RV);
                    const int64_t rend = (r0 + nv * W < GRr) ? r0 + nv * W : GRr;
                    // The keys of this tile some row of the block sees: [cb, ce); mask when a row sees less.
                    const BlockKeys bk = block_keys(first_key, last_key, r0, rend);
                    const int64_t cb = bk.lo > c0 ? bk.lo : c0;
                    const int64_t ce = (bk.hi < c0 + nc - 1 ? bk.hi : c0 + nc - 1) + 1;
                    if (run_blocks && (cb != run_cb || ce - cb != run_n || run_blocks == P::kUpdateBlocks)) flush();
                    if (cb >= ce) continue;
                    const int64_t n = ce - cb, ck = cb - it.kb;  // ck: index of key cb in the item's arrays
                    const bool range_mask = bk.lo_max > cb || bk.hi_min < ce - 1;
                    if (!run_blocks) { run_r0 = r0; run_cb = cb; run_n = n; }
                    float* sb = s + run_blocks * kSlot;
                    float* dpb = dp + run_blocks * kSlot;
                    P::scores(ops, nv, r0, ck, n, D, Dv, sb, dpb);
                    if (cf.any()) cf.fix_scores(r0, rend, cb, n, sb, dpb);
                    gradients(ops, p, nv, r0, cb, n, range_mask, first_key, last_key, diagonal, slope, lse2, delta, sb, dpb);
                    run_end = rend;
                    run_nv = nv;
                    ++run_blocks;
                }
                flush();
            }
            if (cf.any()) cf.add_seen(GRr, first_key, last_key, dkall, ldq, dvall, ldo, dqT);
            store_dq(bp, it, g0, GRr, dqT, dq_part);
        }
        for (int64_t c = 0; c < nkeys; ++c) {
            const int64_t k_at = k_row_offset(p, b, it.kb + c, bp.dk_batch_stride, bp.dk_row_stride) + it.kv_head * bp.dk_head_stride;
            const int64_t v_at = k_row_offset(p, b, it.kb + c, bp.dv_batch_stride, bp.dv_row_stride) + it.kv_head * bp.dv_head_stride;
            V::store_row(bp.dk, k_at, bp.dk_dim_stride, dkall + c * ldq, D, dt);
            V::store_row(bp.dv, v_at, bp.dv_dim_stride, dvall + c * ldo, Dv, dt);
        }
    }

    static bool finite(const float* x, int64_t n) { return all_finite<V>(x, n); }

    // ---- non-finite operands of pairs a row cannot see -------------------------------------
    // The updates take every (row, key) pair of a block with P = dS = 0 where causal / a window
    // hides the key from the row, and 0 x inf = NaN would carry an inf / NaN of q or dO into
    // dK / dV of keys the row never sees, and one of k into dQ of rows that never see it (API.md:
    // NaN / inf propagate into the affected rows only). Under causal / a window, a row or key
    // holding one is packed with those elements 0 (both of its layouts; D_i from dO as it is);
    // the scores of its pairs (S, dP: raw dot products) then get the lost elements' products back,
    // so P and dS of visible pairs are what the elements make them; and every visible pair adds
    // its share of the lost elements after the products: to dV, dO's element (p x dO for p > 0:
    // finite q and k) or NaN (then p is NaN or 0: an inf / NaN score); to dK and dQ, NaN (dS is
    // NaN or 0 wherever q or k is not finite). Rows and keys without one take the usual path:
    // nothing but the check (one pass over each packed row) costs anything.
    struct Careful {
        const BackwardParams& bp;
        const BackwardItem& it;
        const bool hides;
        int64_t g0 = 0;
        int32_t *keys = nullptr, *rows = nullptr;  // item key indices / group row indices with a non-finite element
        int64_t nkeys_bad = 0, nrows_bad = 0;
        Careful(const BackwardParams& b, const BackwardItem& i)
            : bp(b), it(i), hides(b.f.window_left >= 0 || b.f.window_right >= 0) {}
        bool any() const { return nkeys_bad > 0 || nrows_bad > 0; }
        void start_group(int64_t first) { g0 = first; nrows_bad = 0; }
        // Element offsets of key c of the item (arrays laid out like k) and of item row `row`
        // (like q); rows and elements of the inputs as float32.
        int64_t key_at(int64_t c, int64_t bs, int64_t rs, int64_t hs) const {
            return k_row_offset(bp.f, it.b, it.kb + c, bs, rs) + it.kv_head * hs;
        }
        int64_t row_at(int64_t row, int64_t bs, int64_t rs, int64_t hs) const {
            const Params& p = bp.f;
            const int64_t nqi = it.i1 - it.i0, h = it.kv_head * (p.hq / p.hk) + row / nqi, i = it.i0 + row % nqi;
            return q_row_offset(p, it.b, i, bs, rs) + h * hs;
        }
        DType dt() const { return DType(bp.f.dtype); }
        float elem(const void* base, int64_t at) const {
            float x;
            load_row_scalar(&x, elem_ptr(base, at, dt()), 1, 1, dt());
            return x;
        }
        void load_k(int64_t c, float* x) const {
            const Params& p = bp.f;
            V::load_row(x, elem_ptr(p.k, key_at(c, p.k_batch_stride, p.k_row_stride, p.k_head_stride), dt()), p.d, p.k_dim_stride, dt());
        }
        void load_q(int64_t row, float* x) const {
            const Params& p = bp.f;
            V::load_row(x, elem_ptr(p.q, row_at(row, p.q_batch_stride, p.q_row_stride, p.q_head_stride), dt()), p.d, p.q_dim_stride, dt());
        }
        void load_do(int64_t row, float* x) const {
            V::load_row(x, elem_ptr(bp.dout, row_at(row, bp.dout_batch_stride, bp.dout_row_stride, bp.dout_head_stride), dt()),
                        bp.f.dv, bp.dout_dim_stride, dt());
        }
        float k_elem(int64_t c, int64_t d) const {
            const Params& p = bp.f;
            return elem(p.k, key_at(c, p.k_batch_stride, p.k_row_stride, p.k_head_stride) + d * p.k_dim_stride);
        }
        float v_elem(int64_t c, int64_t d) const {
            const Params& p = bp.f;
            return elem(p.v, key_at(c, p.v_batch_stride, p.v_row_stride, p.v_head_stride) + d * p.v_dim_stride);
        }
        float q_elem(int64_t row, int64_t d) const {
            const Params& p = bp.f;
            return elem(p.q, row_at(row, p.q_batch_stride, p.q_row_stride, p.q_head_stride) + d * p.q_dim_stride);
        }
        static void zero_nonfinite(float* x, int64_t n) {
            for (int64_t d = 0; d < n; ++d) if (!std::isfinite(x[d])) x[d] = 0.f;
        }
        // (lists of at most the item's keys / a group's rows, in kernel.h's rare_memory; without
        // memory the key or row stays as it is)
        void bad_key(int64_t c, float* krow) {
            if (!keys) keys = static_cast<int32_t*>(rare_memory(RareSlot::bad_keys, size_t(it.ke - it.kb) * 4));
            if (!keys) return;
            keys[nkeys_bad++] = int32_t(c);
            zero_nonfinite(krow, bp.f.d);
        }
        void bad_row(int64_t r, float* qrow, float* od) {
            if (!rows) rows = static_cast<int32_t*>(rare_memory(RareSlot::bad_rows, size_t(kGroupRows) * 4));
            if (!rows) return;
            rows[nrows_bad++] = int32_t(r);
            zero_nonfinite(qrow, bp.f.d);
            zero_nonfinite(od, bp.f.dv);
        }
        // The non-finite elements of a row: their features and values.
        struct Lost {
            int32_t d[kMaxHeadDim];
            float x[kMaxHeadDim];
            int64_t n = 0;
            Lost(const float* row, int64_t features) {
                for (int64_t f = 0; f < features; ++f)
                    if (!std::isfinite(row[f])) { d[n] = int32_t(f); x[n++] = row[f]; }
            }
        };
        bool key_is_bad(int64_t c) const {
            for (int64_t e = 0; e < nkeys_bad; ++e) if (keys[e] == c) return true;
            return false;
        }
        // S and dP of rows [r0, rend) (group rows) x keys [cb, cb + n) (positions) in s / dp
        // ([key][RB], row lane r - r0): the products of the elements packing set to 0.
        void fix_scores(int64_t r0, int64_t rend, int64_t cb, int64_t n, float* s, float* dp) const {
            const Params& p = bp.f;
            float x[kMaxHeadDim];
            for (int64_t e = 0; e < nkeys_bad; ++e) {  // a key's lost elements, with every row
                const int64_t c = keys[e], at = it.kb + c - cb;
                if (at < 0 || at >= n) continue;
                load_k(c, x);
                const Lost lk(x, p.d);
                for (int64_t r = r0; r < rend; ++r)
                    for (int64_t j = 0; j < lk.n; ++j) s[at * RB + (r - r0)] += lk.x[j] * q_elem(g0 + r, lk.d[j]);
            }
            for (int64_t e = 0; e < nrows_bad; ++e) {  // a row's lost elements, with every key
                const int64_t r = rows[e];
                if (r < r0 || r >= rend) continue;
                load_q(g0 + r, x);
                const Lost lq(x, p.d);
                load_do(g0 + r, x);
                const Lost lo(x, p.dv);
                for (int64_t at = 0; at < n; ++at) {
                    const int64_t c = cb + at - it.kb;
                    for (int64_t j = 0; j < lq.n; ++j) s[at * RB + (r - r0)] += lq.x[j] * k_elem(c, lq.d[j]);
                    for (int64_t j = 0; j < lo.n; ++j) dp[at * RB + (r - r0)] += lo.x[j] * v_elem(c, lo.d[j]);
                }
            }
        }
        // After a group's updates: each visible pair's share of the lost elements (see above).
        void add_seen(int64_t rows_real, const int64_t* first_key, const int64_t* last_key, float* dkall, int64_t ldq,
                      float* dvall, int64_t ldo, float* dqT) const {
            const Params& p = bp.f;
            const int64_t Dq = P::dq_features(p.d);
            float x[kMaxHeadDim];
            for (int64_t e = 0; e < nrows_bad; ++e) {
                const int64_t r = rows[e];
                load_q(g0 + r, x);
                const Lost lq(x, p.d);
                load_do(g0 + r, x);
                const Lost lo(x, p.dv);
                for (int64_t key = first_key[r]; key <= last_key[r]; ++key) {
                    const int64_t c = key - it.kb;
                    const bool nan_p = lq.n > 0 || key_is_bad(c);  // p is NaN or 0 there, else > 0
                    for (int64_t j = 0; j < lq.n; ++j) dkall[c * ldq + lq.d[j]] += NAN;
                    for (int64_t j = 0; j < lo.n; ++j) dvall[c * ldo + lo.d[j]] += nan_p ? NAN : lo.x[j];
                }
            }
            for (int64_t e = 0; e < nkeys_bad; ++e) {
                const int64_t c = keys[e], key = it.kb + c;
                load_k(c, x);
                const Lost lk(x, p.d);
                for (int64_t r = 0; r < rows_real; ++r) {
                    if (key < first_key[r] || key > last_key[r]) continue;
                    for (int64_t j = 0; j < lk.n; ++j) dqT[panel(r, Dq, lk.d[j])] += NAN;
                }
            }
        }
    };

    // D_i = sum_j dO[j] O[j]: W lanes of partial sums (then in lane order), the tail one by one.
    static float row_dot(const float* a, const float* b, int64_t n) {
        vec acc = V::zero();
        int64_t j = 0;
        for (; j + W <= n; j += W) acc = V::fma(V::load(a + j), V::load(b + j), acc);
        alignas(64) float lanes[W];
        V::store(lanes, acc);
        float sum = 0.f;
        for (int l = 0; l < W; ++l) sum += lanes[l];
        for (; j < n; ++j) sum += a[j] * b[j];
        return sum;
    }

    // S, dP of a row block (keys [cb, cb + n)) -> P (in s) and dS (in dp), dS already carrying the
    // score scale (and softcap's 1 - tanh^2): dQ and dK need no final scaling. Invisible keys get
    // exactly 0 in both, whatever the scores (NaN or inf in a hidden key stays out).
    static void gradients(typename P::Bufs& ops, const Params& p, int nv, int64_t r0, int64_t cb, int64_t n, bool range_mask,
                          const int64_t* first_key, const int64_t* last_key, const int64_t* diagonal,
                          const float* slope, const float* lse2, const float* delta, float* s, float* dp) {
        const bool use_softcap = p.softcap > 0.f, alibi = p.alibi != nullptr;
        const vec qs = V::set1(use_softcap ? p.scale / p.softcap : p.scale * kLog2e);
        const vec cap = V::set1(p.softcap * kLog2e), one = V::set1(1.f), ds_scale = V::set1(p.scale), zero = V::zero();
        // A policy whose P and dS feed bf16 products only (pair_store) takes P from exp2_bf16p
        // (3.0e-6 relative error, far below the 2^-9 of their bf16 rounding) and dS as P (dP scale
        // - D_i scale) with D_i scale per row (one fused op fewer than scale P (dP - D_i)); the
        // float32-operand policies keep exp2 and scale P (dP - D_i). With the loop below (a
        // block's LSE and D_i scale in registers) and store_gradient_pair_bf16 converting both
        // keys at once, the amx backward ran 1.04-1.07x faster (2-core Xeon with AMX, bf16 B=1
        // D=128 N=2048, 1 and 2 threads, full and causal; bench/RESULTS.md session 53).
        auto p_exp2 = [](vec x) {
            if constexpr (kPairGradients) return V::exp2_bf16p(x);
            else return V::exp2(x);
        };
        alignas(64) float dsc[RV * W];  // D_i scale (the pair policies' dS)
        if constexpr (kPairGradients) {
            for (int v = 0; v < nv; ++v) V::store(dsc + v * W, V::mul(V::load(delta + r0 + v * W), ds_scale));
            if (!use_softcap && !alibi && !range_mask) {  // keys outer, vectors inner: s, dp in address order
                const auto store = P::pair_store(ops);
                // P, dS of key c for row vector v (the loop below without its options)
                auto grad = [&](int64_t c, int v, vec l2, vec dsv, vec& pr, vec& ds) {
                    pr = p_exp2(V::sub(V::mul(V::load(s + c * RB + v * W), qs), l2));
                    ds = V::mul(pr, V::sub(V::mul(V::load(dp + c * RB + v * W), ds_scale), dsv));
                };
                int64_t c = 0;
                if (nv == RV) {  // a whole block: its rows' LSE and D_i scale stay in registers
                    vec l2[RV], dsv[RV];
                    for (int v = 0; v < RV; ++v) l2[v] = V::load(lse2 + r0 + v * W), dsv[v] = V::load(dsc + v * W);
                    for (; c + 1 < n; c += 2) {
#pragma GCC unroll 8
                        for (int v = 0; v < RV; ++v) {
                            vec pr0, ds0, pr1, ds1;
                            grad(c, v, l2[v], dsv[v], pr0, ds0);
                            grad(c + 1, v, l2[v], dsv[v], pr1, ds1);
                            store(c, v, true, pr0, ds0, pr1, ds1);
                        }
                    }
                }
                for (; c < n; c += 2)  // a smaller block; an odd last key with zeros
                    for (int v = 0; v < nv; ++v) {
                        const vec l2 = V::load(lse2 + r0 + v * W), dsv = V::load(dsc + v * W);
                        vec pr0, ds0, pr1 = zero, ds1 = zero;
                        grad(c, v, l2, dsv, pr0, ds0);
                        if (c + 1 < n) grad(c + 1, v, l2, dsv, pr1, ds1);
                        store(c, v, c + 1 < n, pr0, ds0, pr1, ds1);
                    }
                return;
            }
        }
        for (int v = 0; v < nv; ++v) {
            const int64_t rv = r0 + v * W;
            // Row bounds and diagonals relative to cb (policy.h row_bounds).
            const RowBounds<V> rb = row_bounds<V>(first_key, last_key, diagonal, rv, cb, n);
            const vec lo = rb.lo, hi = rb.hi, rl = rb.rl, sl = V::load(slope + rv);
            const vec l2 = V::load(lse2 + rv), di = V::load(delta + rv);
            const vec dis = kPairGradients ? V::load(dsc + v * W) : zero;
            // P and dS of key c for this vector of rows
            auto grad = [&](int64_t c, vec& pr, vec& ds) {
                vec x = V::mul(V::load(s + c * RB + v * W), qs);
                vec t = zero;
                if (use_softcap) {
                    t = V::tanh(x);
                    x = V::mul(cap, t);
                }
                const vec kc = V::set1(float(c));
                if (alibi) x = V::fma(sl, V::abs(V::sub(rl, kc)), x);
                pr = p_exp2(V::sub(x, l2));
                if constexpr (kPairGradients) ds = V::mul(pr, V::sub(V::mul(V::load(dp + c * RB + v * W), ds_scale), dis));
                else ds = V::mul(V::mul(pr, V::sub(V::load(dp + c * RB + v * W), di)), ds_scale);
                if (use_softcap) ds = V::mul(ds, V::sub(one, V::mul(t, t)));
                if (range_mask) {
                    pr = V::mask_outside(pr, kc, lo, hi, zero);
                    ds = V::mask_outside(ds, kc, lo, hi, zero);
                }
            };
            if constexpr (kPairGradients) {  // keys c, c+1 together (an odd last key with zeros)
                const auto store = P::pair_store(ops);
                for (int64_t c = 0; c < n; c += 2) {
                    vec pr0, ds0, pr1 = zero, ds1 = zero;
                    grad(c, pr0, ds0);
                    if (c + 1 < n) grad(c + 1, pr1, ds1);
                    store(c, v, c + 1 < n, pr0, ds0, pr1, ds1);
                }
            } else {
                for (int64_t c = 0; c < n; ++c) {
                    vec pr, ds;
                    grad(c, pr, ds);
                    P::store_gradients(ops, c * RB + v * W, s + c * RB + v * W, dp + c * RB + v * W, pr, ds);
                }
            }
        }
    }

    // dq of the rows [g0, g0 + rows) of the item: final (dtype) rows when it owns its kv head's dq,
    // else its float32 partial rows.
    static void store_dq(const BackwardParams& bp, const BackwardItem& it, int64_t g0, int64_t rows, const float* dqT,
                         float* dq_part) {
        const Params& p = bp.f;
        const int64_t D = p.d, Dq = P::dq_features(D), group = p.hq / p.hk, nqi = it.i1 - it.i0;
        // RC rows at a time through row-major rows (the panels read RC = 16 rows = one line at a
        // time); the RC rows lie in one row block, so (row r0 + r, feature d) is src[d * RB + r].
        constexpr int64_t RC = RB % 16 == 0 ? 16 : RB;
        static_assert(RB % RC == 0, "chunks of RC rows stay in one row block");
        float buf[RC * kMaxHeadDim];
        const DType dt = DType(p.dtype);
        for (int64_t r0 = 0; r0 < rows; r0 += RC) {
            const int64_t rn = rows - r0 < RC ? rows - r0 : RC;
            float* out = it.part >= 0 ? dq_part + it.part + (g0 + r0) * D : buf;
            const float* src = dqT + panel(r0, Dq, 0);
            int64_t d0 = 0;
#ifdef __AVX512F__
            // Partial rows are written with non-temporal stores (whole 64-byte lines: the buffer
            // is 64-byte aligned and D % 16 == 0 keeps every row so): a split item otherwise waits
            // on the read-for-ownership of every line of a buffer that no cache holds (the
            // partials of a call are O(splits * N * D)). Same bits; amx family, in process:
            // 2-core Xeon with AMX, H=4 N=2048 (4 key splits) 1.02-1.04x at 1 and 2 threads;
            // 16 threads (model 207) 0.99-1.10x over backward.cpp's dq chunks, 1.01-1.22x over the
            // driver before them, in 9 of 10 runs (the 10th drifted; bench/RESULTS.md, session 54;
            // session 48's try, before the chunks, read 0.79-1.14x there).
            if (rn == 16 && it.part >= 0 && D % 16 == 0) {
                alignas(64) float tb[256];
                for (; d0 + 16 <= D; d0 += 16) {
                    transpose16<V>(src + d0 * RB, RB, tb, 16);
                    for (int r = 0; r < 16; ++r) _mm512_stream_ps(out + r * D + d0, _mm512_load_ps(tb + r * 16));
                }
            }
#endif
            if (rn == 16)
                for (; d0 + 16 <= D; d0 += 16) transpose16<V>(src + d0 * RB, RB, out + d0, D);
            for (int64_t d = d0; d < D; ++d)
                for (int64_t r = 0; r < rn; ++r) out[r * D + d] = src[d * RB + r];
            if (it.part >= 0) continue;
            for (int64_t r = 0; r < rn; ++r) {
                const int64_t h = it.kv_head * group + (g0 + r0 + r) / nqi, i = it.i0 + (g0 + r0 + r) % nqi;
                const int64_t at = q_row_offset(p, it.b, i, bp.dq_batch_stride, bp.dq_row_stride) + h * bp.dq_head_stride;
                V::store_row(bp.dq, at, bp.dq_dim_stride, buf + r * D, D, dt);
            }
        }
#ifdef __AVX512F__
        if (it.part >= 0) _mm_sfence();  // the streamed rows before the item's release (backward.cpp)
#endif
    }
    // Zero dq rows of the item's kv head that see none of its keys (it owns that head's dq).
    static void zero_dq_outside(const BackwardParams& bp, const BackwardItem& it) {
        const Params& p = bp.f;
        const int64_t D = p.d, group = p.hq / p.hk, nq = seq_nq(p, it.b);
        for (int64_t g = 0; g < group; ++g)
            for (int64_t i = 0; i < nq; ++i) {
                if (i >= it.i0 && i < it.i1) continue;
                const int64_t h = it.kv_head * group + g;
                const int64_t at = q_row_offset(p, it.b, i, bp.dq_batch_stride, bp.dq_row_stride) + h * bp.dq_head_stride;
                for (int64_t d = 0; d < D; ++d) store_scalar(bp.dq, at + d * bp.dq_dim_stride, 0.f, DType(p.dtype));
            }
    }
};

}  // namespace
}  // namespace fa2cpu
