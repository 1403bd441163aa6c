// The FlashAttention-2 tile loop, written once and instantiated by every route with its vector
// traits V (vector math: generic.cpp / avx2.cpp / vec_avx512.h) and a GEMM policy G (operand
// layouts, packing and micro-kernels: policy.h describes the interface).
//
// Formulation: "rows in lanes". A work item holds R query rows (heads x query positions); vector
// lane l of row-vector v is row v*W + l. Per item (scratch laid out by `layout`):
//
//   q      G's Q operand for M rows, zero rows >= R
//   o      unnormalised output accumulator, float32, in G's layout
//   m, l   [M] running max (log2 domain) and running sum per row
//   kp, vp one packed K / V tile in G's layout (unused when G reads K/V in place)
//   ks, vs quantized caches read by a policy without G::kReadsCodes: one K / V tile dequantized
//          (codes x scales) into float32 [BC][D] row-major; G (the float32 policy: routes.h keeps
//          quantized caches off the bf16 ones) reads it like an ordinary contiguous float32 tile
//   s      [BC][RB] float32 scores of one row block (RB = G::RB rows), then float32 P in place
//   p      PStore::bf16_pairs: P as G's bf16 pairs [ceil(BC/2)][RB] (s stays the scores)
//
// with M = R rounded up to G::kRowAlign (a multiple of W). The score scale is scale*log2e, or
// scale/softcap with softcap (tanh takes the unscaled logit), applied where G::kScaleAt says.
// Scores are kept in the log2 domain so the softmax uses exp2; LSE is converted back at the end.
// Because rows are in lanes, the row max/sum are vertical vector ops and neither K nor V needs a
// transpose while packing (the micro-kernels broadcast single K/V elements).
#pragma once
#include <cfloat>

#include "kernel.h"
#include "policy.h"

namespace fa2cpu {
namespace {

// Whether policy G reads quantized K/V codes itself (G::kReadsCodes, gemm_decode.h) instead of
// tiles dequantized by the loop.
template <class G, class = void>
struct ReadsCodes { static constexpr bool value = false; };
template <class G>
struct ReadsCodes<G, decltype(void(G::kReadsCodes))> { static constexpr bool value = G::kReadsCodes; };
// Whether policy G packs V tiles for shared slots in a layout of their own (G::v_panels,
// gemm_f32.h): then a slot of V holds G::v_panel_floats(Dv) floats.
template <class G, class = void>
struct HasVPanels : std::false_type {};
template <class G>
struct HasVPanels<G, std::void_t<decltype(&G::v_panels)>> : std::true_type {};

// Policy G's tiles of a paged cache span blocks of G::kRunKeys to 2 G::kRunKeys - 1 keys, one run
// per block (decode_operands.h; run_pass); 0: G's tiles never cross a block when it has
// kTilesEndAtBlocks.
template <class G, class = void>
struct RunKeys { static constexpr int64_t value = 0; };
template <class G>
struct RunKeys<G, decltype(void(G::kRunKeys))> { static constexpr int64_t value = G::kRunKeys; };

template <class V, class Gm>
struct TileLoop {
    using G = Gm;
    using vec = typename V::vec;
    static constexpr int W = V::W;
    static constexpr int RV = G::RV;    // row vectors per row block
    static constexpr int RB = RV * W;   // rows per row block
    static constexpr int64_t BC = G::BC;
    static_assert(G::W == W && G::kRowAlign % W == 0, "the policy's rows fill the vector lanes");
    static constexpr int64_t kRunKeys = RunKeys<G>::value;
    static constexpr int kMaxRuns = kRunKeys > 0 ? int((BC + kRunKeys - 1) / kRunKeys) : 1;
    // runs take P at key c at pb + c * RB: P in place of the scores
    static_assert(kRunKeys == 0 || (G::kTilesEndAtBlocks && G::kPStore == PStore::f32_in_scores), "runs read P in place");
    // Q packed and O read 16 rows at a time when the policy offers it (policy.h's optional
    // pack_q_rows / gather_o_rows) and the item holds whole blocks of 16 rows (M % 16 == 0:
    // always where kRowAlign is a multiple of 16; 8-lane families pad items to 8 rows only).
    template <class X, class = void>
    struct HasPackQRows : std::false_type {};
    template <class X>
    struct HasPackQRows<X, std::void_t<decltype(&X::pack_q_rows)>> : std::true_type {};
    template <class X, class = void>
    struct HasORows : std::false_type {};
    template <class X>
    struct HasORows<X, std::void_t<decltype(&X::gather_o_rows)>> : std::true_type {};
    static constexpr bool kBlockQ = HasPackQRows<G>::value;
    static constexpr bool kBlockO = HasORows<G>::value;
    // How far (log2 units) a row's tile max may pass its running max before softmax_update moves
    // the max and rescales O and l: probabilities then stay <= 2^8 (fine in float32 and bf16; O
    // and l may grow 2^8 times larger than against the exact max, so |V| beyond ~FLT_MAX / (2^8 x
    // keys), ~3e32 at 4096 keys, overflows O where FLT_MAX / keys did before). Rescaling a row
    // vector's O costs Dv loads, multiplies and stores, ~6 % of a tile's products at D = 128 by
    // instruction count, and with 16 rows per vector some row's max moved in almost every tile
    // (FlashAttention-4 skips rescales the same way; measured 1-4 % faster: bench/RESULTS.md).
    static constexpr float kRescaleLog2 = 8.f;

    struct Layout {
        int64_t M;
        int64_t q, o, kp, vp, ks, vs, s, p, m, l;
        int64_t first_key, last_key, diagonal, slope, mask_row_offset, mask_values, row_kv_head, total;
    };
    static Layout layout(const Params& p, int64_t rows) {
        Layout L;
        L.M = round_up(rows < 1 ? 1 : rows, G::kRowAlign);
        int64_t o = 0;
        auto take = [&](int64_t n) { int64_t at = o; o += round_up(n, 16); return at; };
        L.q = take(G::q_floats(p.d, L.M));
        L.o = take(G::o_floats(p.dv, L.M));
        L.kp = take(G::k_floats(p.d));
        L.vp = take(G::v_floats(p.dv));
        const bool stage = is_code_dtype(kv_dtype(p)) && !ReadsCodes<G>::value;
        L.ks = take(stage ? BC * p.d : 0);
        L.vs = take(stage ? BC * p.dv : 0);
        L.s = take(BC * RB);
        L.p = take(G::kPStore == PStore::bf16_pairs ? (BC + 1) / 2 * RB : 0);
        L.m = take(L.M);
        L.l = take(L.M);
        L.first_key = take(2 * L.M);        // int64 key positions: the row's visible range
        L.last_key = take(2 * L.M);
        L.diagonal = take(2 * L.M);         // int64: key position aligned with the row (alibi)
        L.slope = take(L.M);
        L.mask_row_offset = take(2 * L.M);  // int64
        L.mask_values = take(BC * RB);      // mask values of one row block (float, gathered)
        L.row_kv_head = take(L.M);          // int32 kv head of each row, relative to the item's first
        L.total = o;
        return L;
    }
    static int64_t scratch_floats(const Params& p, int64_t rows) { return layout(p, rows).total; }

    // ---- the item ------------------------------------------------------------------------
    static void run_item(const Params& p, const WorkItem& it, const ItemContext& ctx) {
        if (!run_pass(p, it, ctx, false)) run_pass(p, it, ctx, true);  // Hidden: the careful pass
    }
    // One pass over the item; careful: V's non-finite values kept out of rows that do not see
    // them (Hidden). A pass that is not careful returns false, writing nothing, when some block
    // hid keys from some row and O holds an inf / NaN.
    static bool run_pass(const Params& p, const WorkItem& it, const ItemContext& ctx, bool careful) {
        float* scratch = ctx.scratch;
        FA2CPU_CHECK(p.d <= kMaxHeadDim && p.dv <= kMaxHeadDim);  // the row buffer below
        const int64_t b = it.b, group = p.hq / p.hk, D = p.d, Dv = p.dv;
        const int64_t nq = seq_nq(p, b), nk = seq_nk(p, b);
        const int64_t nqi = it.i1 - it.i0, R = (it.g1 - it.g0) * nqi;
        const Layout L = layout(p, R);
        const int64_t M = L.M;
        float* q = scratch + L.q;
        float* o = scratch + L.o;
        float* kp = scratch + L.kp;
        float* vp = scratch + L.vp;
        float* s = scratch + L.s;
        float* pb = G::kPStore == PStore::bf16_pairs ? scratch + L.p : s;  // P (softmax_update)
        float* mrow = scratch + L.m;
        float* lrow = scratch + L.l;
        // Positions are int64 (exact beyond 2^24 keys); the epilogue turns them into small floats
        // relative to the current tile.
        int64_t* first_key = reinterpret_cast<int64_t*>(scratch + L.first_key);
        int64_t* last_key = reinterpret_cast<int64_t*>(scratch + L.last_key);
        int64_t* diagonal = reinterpret_cast<int64_t*>(scratch + L.diagonal);
        float* slope = scratch + L.slope;
        int64_t* mask_row_offset = reinterpret_cast<int64_t*>(scratch + L.mask_row_offset);
        float* mask_values = scratch + L.mask_values;
        int32_t* row_kv_head = reinterpret_cast<int32_t*>(scratch + L.row_kv_head);

        const bool use_softcap = p.softcap > 0.f;
        const float qscale = use_softcap ? p.scale / p.softcap : p.scale * kLog2e;
        const float cap_l2 = p.softcap * kLog2e;
        const DType dt = DType(p.dtype);
        const float pack_scale = G::kScaleAt == ScaleAt::packed_q ? qscale : 1.f;
        const float softmax_scale = G::kScaleAt == ScaleAt::softmax ? qscale : 1.f;
        const ItemOperands ops{q, o, M, D, Dv, G::kScaleAt == ScaleAt::qk_output ? qscale : 1.f};

        // Rows: pack Q (by blocks of 16 rows where the policy can), set per-row visible ranges
        // and bias parameters.
        int64_t lo_min = nk, hi_max = -1;
        alignas(64) float qrows[kBlockQ ? 16 * kMaxHeadDim : kMaxHeadDim];
        const bool block_q = kBlockQ && M % 16 == 0;
        for (int64_t r = 0; r < M; ++r) {
            if (r >= R) {  // padding lanes: computed, never stored, never decide a skip
                if (!block_q) G::zero_q_row(q, M, r, D);
                first_key[r] = 0; last_key[r] = nk; diagonal[r] = 0; slope[r] = 0.f; mask_row_offset[r] = 0;
                row_kv_head[r] = R > 0 ? row_kv_head[R - 1] : 0;  // padding rows read the last row's head
                if (block_q) pack_q_block(q, M, r, R, qrows, D, pack_scale);
                continue;
            }
            const int64_t h = it.kv_head * group + it.g0 + r / nqi, i = it.i0 + r % nqi;
            row_kv_head[r] = int32_t(h / group - it.kv_head);
            float* row = block_q ? qrows + (r % 16) * D : qrows;
            const int64_t q_at = q_row_offset(p, b, i, p.q_batch_stride, p.q_row_stride) + h * p.q_head_stride;
            V::load_row(row, elem_ptr(p.q, q_at, dt), D, p.q_dim_stride, dt);
            if (block_q) pack_q_block(q, M, r, R, qrows, D, pack_scale);
            else G::pack_q_row(q, M, r, row, D, pack_scale);
            int64_t lo, hi;
            visible_range(p, nq, nk, i, &lo, &hi);
            if (lo < it.kb) lo = it.kb;
            if (hi > it.ke - 1) hi = it.ke - 1;
            if (lo <= hi) { lo_min = lo < lo_min ? lo : lo_min; hi_max = hi > hi_max ? hi : hi_max; }
            first_key[r] = lo; last_key[r] = hi;
            diagonal[r] = nk + (i - nq);
            slope[r] = p.alibi ? -p.alibi[b * p.alibi_batch_stride + h * p.alibi_head_stride] * kLog2e : 0.f;
            mask_row_offset[r] = p.mask ? b * p.mask_batch_stride + h * p.mask_head_stride + i * p.mask_query_stride : 0;
        }
        for (int64_t r = 0; r < M; ++r) { mrow[r] = -INFINITY; lrow[r] = 0.f; }
        // Sinks start each row's online softmax as an already-seen logit with no value: running
        // max = the sink, running sum = 1 (nothing per key). A split item leaves it to the merge
        // (driver.cpp), which must count it once.
        if (p.sinks && it.part < 0)
            for (int64_t r = 0; r < R; ++r)
                start_with_sink(p.sinks[it.kv_head * group + it.g0 + r / nqi], mrow + r, lrow + r);
        for (int64_t j = 0; j < G::o_floats(Dv, M); ++j) o[j] = 0.f;
        const int64_t k_head = it.kv_head * p.k_head_stride, v_head = it.kv_head * p.v_head_stride;
        const bool block_tiles = G::kTilesEndAtBlocks && p.block_table != nullptr;
        // A paged tile of a policy with kRunKeys spans whole cache blocks of kRunKeys to
        // 2 kRunKeys - 1 keys (K / V read in place), one run of K / V per block, each its own
        // KvTile: the products take the runs one by one, the softmax the whole tile at once
        // (per-tile work paid once per BC keys, not once per block). int8 cache, block 16: 1.04-1.07x
        // faster (2-core Xeon with AMX, 2 threads); blocks of 32 and 64 gained nothing (bf16
        // block 64 0.96-0.98x, fp32 1.02x), and keep tiles of one block (bench/RESULTS.md,
        // session 51).
        const bool runs = block_tiles && kRunKeys > 0 && p.block_size >= kRunKeys && p.block_size < 2 * kRunKeys &&
                          p.k_dim_stride == 1 && p.v_dim_stride == 1;
        KvTile kts[kMaxRuns], vts[kMaxRuns];
        Hidden hidden(it);
        bool hid = false;  // some block hid keys from some row
        for (int64_t c0 = lo_min, nc = 0; c0 <= hi_max; c0 += nc) {
            nc = (hi_max + 1 - c0) < BC ? (hi_max + 1 - c0) : BC;
            int64_t run = nc;  // keys per run
            if (block_tiles) {
                const int64_t left = p.block_size - c0 % p.block_size;
                if (runs && left == p.block_size) run = p.block_size;  // whole blocks from c0 on
                else if (left < nc) nc = left;
            }
            const int nruns = int((nc + run - 1) / run);
            for (int i = 0; i < nruns; ++i) {
                const int64_t c = i * run, n = nc - c < run ? nc - c : run;
                SharedTiles* shared = nruns == 1 ? ctx.shared : nullptr;
                kts[i] = tile<0>(p, it, c0 + c, n, nk, k_head, kp, scratch + L.ks, shared);
                vts[i] = tile<1>(p, it, c0 + c, n, nk, v_head, vp, scratch + L.vs, shared);
            }
            for (int64_t r0 = 0; r0 < M; r0 += RB) {
                const int nv = int((M - r0) / W < RV ? (M - r0) / W : RV);
                const int64_t rend = (r0 + nv * W < R) ? r0 + nv * W : R;
                // Skip blocks with no visible key in this tile; find whether masking is needed.
                const BlockKeys bk = block_keys(first_key, last_key, r0, rend);
                const int64_t blo = bk.lo, bhi = bk.hi, blo_max = bk.lo_max, bhi_min = bk.hi_min;
                if (blo > c0 + nc - 1 || bhi < c0) continue;
                // Keys past every row's last visible key (the causal diagonal) are not computed.
                const int64_t ncb = bhi - c0 + 1 < nc ? bhi - c0 + 1 : nc;
                const bool range_mask = blo_max > c0 || bhi_min < c0 + ncb - 1;

                const RowBlock rows{r0, nv, int(rend - r0), row_kv_head + r0};
                // f(i, c, n): run i, keys [c, c + n) of the ncb computed
                auto each_run = [&](auto&& f) {
                    for (int i = 0; i < nruns && i * run < ncb; ++i) f(i, i * run, ncb - i * run < run ? ncb - i * run : run);
                };
                each_run([&](int i, int64_t c, int64_t n) { G::qk(ops, rows, kts[i], n, s + c * RB); });
                const bool biased = epilogue(p, nv, r0, c0, ncb, range_mask, use_softcap, cap_l2, softmax_scale,
                                             first_key, last_key, diagonal, slope, mask_row_offset, mask_values, s);
                softmax_update(ops, nv, ncb, s, pb, mrow + r0, lrow + r0, r0, biased ? 1.f : softmax_scale);
                // Some row of the block may not see some key: V's non-finite values stay out of it.
                const bool hides = range_mask || p.mask != nullptr;
                hid |= hides;
                const KvTile* clean = careful && hides && hidden.dirty(p, it, c0, nc, ncb, blo_max, bhi_min)
                                          ? hidden.clean_tile(p, it, c0, nc, M)
                                          : nullptr;
                if (clean) G::pv(ops, rows, pb, ncb, *clean);
                else each_run([&](int i, int64_t c, int64_t n) { G::pv(ops, rows, pb + c * RB, n, vts[i]); });
                if (clean) hidden.add_seen(p, it, c0, ncb, r0, rend, row_kv_head, first_key, last_key, mask_row_offset);
            }
        }
        if (hid && !careful && !finite(o, G::o_floats(Dv, M)) && leaked(o, M, Dv, R, lrow) &&
            hidden.any_nonfinite(p, it, lo_min, hi_max + 1))
            return false;
        finish(p, it, R, nqi, M, o, mrow, lrow, hidden.nf, ctx.parts);
        return true;
    }
    // Whether a row whose sum l is finite has an inf / NaN in O: only V can have put it there
    // (a NaN from q, k, a mask or a sink makes l NaN too, and then V need not be looked at).
    static bool leaked(const float* o, int64_t M, int64_t Dv, int64_t R, const float* lrow) {
        alignas(64) float rows[kBlockO ? 16 * kMaxHeadDim : kMaxHeadDim];
        int64_t gathered = -1;
        for (int64_t r = 0; r < R; ++r) {
            if (!std::isfinite(lrow[r])) continue;
            const float* row = rows;
            if constexpr (kBlockO) {
                if (M % 16 == 0) {  // 16 rows at a time, as finish reads them
                    if (gathered != r - r % 16) G::gather_o_rows(o, M, Dv, gathered = r - r % 16, rows);
                    row = rows + (r % 16) * Dv;
                } else {
                    for (int64_t j = 0; j < Dv; ++j) rows[j] = G::o_elem(o, M, Dv, r, j);
                }
            } else {
                for (int64_t j = 0; j < Dv; ++j) rows[j] = G::o_elem(o, M, Dv, r, j);
            }
            if (!finite(row, Dv)) return true;
        }
        return false;
    }
    static bool finite(const float* x, int64_t n) { return all_finite<V>(x, n); }

    // ---- non-finite V values of keys a row cannot see --------------------------------------
    // The policies' PV products take every key of a tile for every row of a block, with P = 0 for
    // keys a row cannot see (causal / window edges, masks), and 0 x inf = NaN would carry an inf /
    // NaN in such a key's V into rows that never see it (API.md: NaN / inf propagate into the
    // affected rows only). An item whose blocks hid keys, whose O then holds an inf / NaN in a
    // row with a finite sum (leaked: only V can have put it there) and whose V rows hold one
    // runs again, carefully (run_pass; the checks cost one pass over O per such item): the V
    // rows of the keys each block hides are scanned (dirty); where one holds an inf / NaN
    // (garbage in a padding slot), the block's PV reads a copy of the tile with those elements
    // (codes, scales) 0, and every row that sees such a key gets the element added to its
    // output after normalisation (nf): +-inf or NaN, what p x v is for any p > 0. Rows that do
    // not see it get the bits of a call whose V holds 0 there. The copy and nf live in
    // thread-local memory taken only then (kernel.h rare_memory). bench/RESULTS.md, session 49:
    // no cost measurable without such values; NaN q rows 1.04x, an inf in V at hidden keys 2.5x.
    struct Hidden {
        const int64_t kvh;            // kv heads of the item's rows
        int64_t scanned_c0 = -1;      // the tile whose non-finite keys are listed in bad
        int64_t clear_c0 = -1;        // a tile found to hold none (masks: scanned once per tile)
        int64_t clean_c0 = -1;        // the tile whose clean copy is built
        int64_t bad_count = 0;        // keys (c, h) of the scanned tile with a non-finite element
        int32_t* bad = nullptr;       // c * kvh + h, ascending
        float* nf = nullptr;          // [M][Dv] the rows' non-finite additions (null: none yet)
        KvTile clean{};
        explicit Hidden(const WorkItem& it) : kvh(it.kv_heads) {}

        // Whether keys [0, ncb) of tile c0 (nc keys) hold a non-finite V value of the item's heads
        // where the block hides some key: with a mask anywhere (the tile scanned once), else
        // outside [blo_max, bhi_min], the keys every row of the block sees (causal: the keys past
        // its first row's diagonal, scanned per block).
        bool dirty(const Params& p, const WorkItem& it, int64_t c0, int64_t nc, int64_t ncb, int64_t blo_max,
                   int64_t bhi_min) {
            if (scanned_c0 != c0) {
                if (p.mask) {
                    if (clear_c0 == c0) return false;
                    if (!any_nonfinite(p, it, c0, c0 + nc)) { clear_c0 = c0; return false; }
                } else {
                    const int64_t end = c0 + ncb;
                    const int64_t a = blo_max < c0 ? c0 : blo_max > end ? end : blo_max;
                    const int64_t z = bhi_min >= end ? end : bhi_min + 1 < a ? a : bhi_min + 1;
                    if (!any_nonfinite(p, it, c0, a) && !any_nonfinite(p, it, z, end)) return false;
                }
                scanned_c0 = c0;  // something there: the whole tile's list
                bad_count = 0;
                for (int64_t c = 0; c < nc; ++c)
                    for (int64_t h = 0; h < kvh; ++h)
                        if (v_row_nonfinite(p, it, c0 + c, h)) {
                            if (!bad) bad = static_cast<int32_t*>(rare_memory(RareSlot::hidden_keys, BC * kvh * sizeof(int32_t)));
                            if (!bad) return false;  // no memory: the products as they are
                            bad[bad_count++] = int32_t(c * kvh + h);
                        }
            }
            return bad_count > 0 && bad[0] / kvh < ncb;
        }
        // Whether V rows [from, to) of the item's heads hold an inf / NaN.
        bool any_nonfinite(const Params& p, const WorkItem& it, int64_t from, int64_t to) const {
            for (int64_t pos = from; pos < to; ++pos)
                for (int64_t h = 0; h < kvh; ++h)
                    if (v_row_nonfinite(p, it, pos, h)) return true;
            return false;
        }
        // The tile with its non-finite V values 0, as the policy reads it (built once per tile);
        // null without memory for it (then the products take the tile as it is).
        const KvTile* clean_tile(const Params& p, const WorkItem& it, int64_t c0, int64_t nc, int64_t M) {
            if (clean_c0 == c0) return &clean;
            const DType ct = kv_dtype(p);
            const int64_t Dv = p.dv, esize = int64_t(dtype_size(ct));
            const int64_t raw_bytes = round_up(BC * kvh * Dv * esize, 64), scale_bytes = round_up(BC * kvh * 4, 64);
            const int64_t own_bytes = round_up(G::v_floats(Dv) * 4, 64), stage_bytes = BC * Dv * 4;
            char* mem = static_cast<char*>(rare_memory(RareSlot::clean_tile, size_t(raw_bytes + scale_bytes + own_bytes + stage_bytes)));
            if (!nf) {
                nf = static_cast<float*>(rare_memory(RareSlot::hidden_sums, size_t(M * Dv) * 4));
                if (nf) for (int64_t j = 0; j < M * Dv; ++j) nf[j] = 0.f;
            }
            if (!mem || !nf) return nullptr;
            float* scales = reinterpret_cast<float*>(mem + raw_bytes);
            Params sp = p;  // one sequence of nc keys: [nc][kvh][Dv] elements, [nc][kvh] scales
            sp.v = mem;
            sp.v_batch_stride = 0; sp.v_row_stride = kvh * Dv; sp.v_head_stride = Dv; sp.v_dim_stride = 1;
            sp.block_table = nullptr;
            sp.cu_seqlens_k = nullptr;
            sp.seqlen_k = nullptr;
            if (p.v_scale) {
                sp.v_scale = scales;
                sp.v_scale_batch_stride = 0; sp.v_scale_row_stride = kvh; sp.v_scale_head_stride = 1;
            }
            for (int64_t c = 0; c < nc; ++c)
                for (int64_t h = 0; h < kvh; ++h)
                    copy_clean_row(p, it, c0 + c, h, mem + (c * kvh + h) * Dv * esize, scales + c * kvh + h);
            WorkItem one = it;
            one.b = 0;
            one.kv_head = 0;
            clean = tile<1>(sp, one, 0, nc, nc, 0, reinterpret_cast<float*>(mem + raw_bytes + scale_bytes),
                            reinterpret_cast<float*>(mem + raw_bytes + scale_bytes + own_bytes), nullptr);
            clean_c0 = c0;
            return &clean;
        }
        // nf of rows [r0, rend) += the non-finite values of keys [c0, c0 + ncb) each sees.
        void add_seen(const Params& p, const WorkItem& it, int64_t c0, int64_t ncb, int64_t r0, int64_t rend,
                      const int32_t* row_kv_head, const int64_t* first_key, const int64_t* last_key,
                      const int64_t* mask_row_offset) const {
            const int64_t Dv = p.dv;
            float x[kMaxHeadDim];
            for (int64_t e = 0; e < bad_count && bad[e] / kvh < ncb; ++e) {
                const int64_t key = c0 + bad[e] / kvh, h = bad[e] % kvh;
                v_row_floats(p, it, key, h, x);
                for (int64_t r = r0; r < rend; ++r) {
                    if (row_kv_head[r] != h || key < first_key[r] || key > last_key[r]) continue;
                    if (p.mask) {
                        const int64_t at = mask_row_offset[r] + key * p.mask_key_stride;
                        const bool seen = MaskKind(p.mask_kind) == MaskKind::boolean
                                              ? static_cast<const uint8_t*>(p.mask)[at] != 0
                                              : static_cast<const float*>(p.mask)[at] != -INFINITY;
                        if (!seen) continue;
                    }
                    for (int64_t d = 0; d < Dv; ++d)
                        if (!std::isfinite(x[d])) nf[r * Dv + d] += x[d];
                }
            }
        }
    };
    // Element offset of key pos's V row of the item's kv head h (relative), and its scale (1
    // without scales).
    static int64_t v_row_at(const Params& p, const WorkItem& it, int64_t pos, int64_t h) {
        return k_row_offset(p, it.b, pos, p.v_batch_stride, p.v_row_stride) + (it.kv_head + h) * p.v_head_stride;
    }
    static float v_row_scale(const Params& p, const WorkItem& it, int64_t pos, int64_t h) {
        WorkItem head = it;
        head.kv_head += int32_t(h);
        const float* sc = scale_at<1>(p, head, pos);
        return sc ? *sc : 1.f;
    }
    // V row (pos, h) as float32: codes times their scale as the staged tiles get them
    // (dequantize_row), float types converted (load_row_scalar).
    static void v_row_floats(const Params& p, const WorkItem& it, int64_t pos, int64_t h, float* out) {
        const DType ct = kv_dtype(p);
        if (is_code_dtype(ct)) dequantize_row(out, p.v, v_row_at(p, it, pos, h), p.dv, p.v_dim_stride, ct, v_row_scale(p, it, pos, h));
        else load_row_scalar(out, elem_ptr(p.v, v_row_at(p, it, pos, h), ct), p.dv, p.v_dim_stride, ct);
    }
    // Whether V row (pos, h) holds an inf / NaN: float types by their exponent bits (kernel.h),
    // codes through their values (caches only).
    static bool v_row_nonfinite(const Params& p, const WorkItem& it, int64_t pos, int64_t h) {
        const DType ct = kv_dtype(p);
        if (!is_code_dtype(ct)) return row_nonfinite(elem_ptr(p.v, v_row_at(p, it, pos, h), ct), p.dv, p.v_dim_stride, ct);
        float x[kMaxHeadDim];
        v_row_floats(p, it, pos, h, x);
        return !finite(x, p.dv);
    }
    // V row (pos, h) into dst ([Dv] elements of the cache's type) with the elements whose value is
    // not finite 0, and its scale (codes) into *scale, 0 if not finite.
    static void copy_clean_row(const Params& p, const WorkItem& it, int64_t pos, int64_t h, char* dst, float* scale) {
        const DType ct = kv_dtype(p);
        const int64_t at = v_row_at(p, it, pos, h), ds = p.v_dim_stride;
        const float sc = v_row_scale(p, it, pos, h);
        *scale = std::isfinite(sc) ? sc : 0.f;
        float x[kMaxHeadDim];
        v_row_floats(p, it, pos, h, x);
        const size_t esize = dtype_size(ct);
        for (int64_t d = 0; d < p.dv; ++d) {
            if (std::isfinite(x[d])) std::memcpy(dst + d * esize, elem_ptr(p.v, at + d * ds, ct), esize);
            else std::memset(dst + d * esize, 0, esize);
        }
    }
    // After row r (real or padding) is in qrows[(r % 16) * D ..]: the block's last row packs the
    // block's 16 rows (those at R and beyond are padding).
    static void pack_q_block(float* q, int64_t M, int64_t r, int64_t R, float* qrows, int64_t D, float scale) {
        if constexpr (kBlockQ) {
            if (r % 16 != 15) return;
            const int64_t r0 = r - 15, real = R - r0;
            G::pack_q_rows(q, M, r0, qrows, D, scale, int(real < 0 ? 0 : real > 16 ? 16 : real));
        }
    }

    static void start_with_sink(float sink, float* m, float* l) {
        if (std::isnan(sink)) { *l = NAN; return; }    // the row's output and LSE become NaN
        if (sink == -INFINITY) return;                   // no sink
        *m = sink * kLog2e;
        *l = 1.f;
        // An infinite sink takes all the weight: out 0, LSE +inf. Kept finite in m (with an
        // infinite sum) so that exp2(m_old - m_new) stays 1, not inf - inf, when other rows of
        // the vector move their max.
        if (*m == INFINITY) { *m = FLT_MAX; *l = INFINITY; }
    }

    // K (kWhich = 0) or V (1) tile [c0, c0 + nc) of the item's kv head: the shared slot when the
    // call shares this operand and the tile is a whole natural one (keys [t*BC, min((t+1)*BC, nk)):
    // a shorter tile padded from a longer slot would multiply real V values, maybe inf, by the
    // zero P of padding keys), else packed into the item's own buffer (or read in place).
    // A quantized cache's tile is first dequantized into `stage` (policies without kReadsCodes) or
    // gets its scales attached (policies with it).
    template <int kWhich>
    static KvTile tile(const Params& p, const WorkItem& it, int64_t c0, int64_t nc, int64_t nk, int64_t head,
                       float* own, float* stage, SharedTiles* shared) {
        // (slot: the tile goes to a shared slot, where V takes G's v_panels layout if it has one)
        auto fetch = [&](const Params& q, int64_t b, int64_t first, int64_t h, float* buf, bool slot) {
            if constexpr (kWhich == 1 && HasVPanels<G>::value)
                if (slot) return G::v_panels(q, b, first, nc, h, buf);
            return kWhich == 0 ? G::k_tile(q, b, first, nc, h, buf) : G::v_tile(q, b, first, nc, h, buf);
        };
        auto pack = [&](float* buf, bool slot) {
            if (!is_code_dtype(kv_dtype(p))) return fetch(p, it.b, c0, head, buf, slot);
            if constexpr (ReadsCodes<G>::value) {
                KvTile t = fetch(p, it.b, c0, head, buf, slot);
                if (const float* sc = scale_at<kWhich>(p, it, c0)) {
                    const ScaleStrides st = scale_strides<kWhich>(p);
                    // A paged cache's scales kScalePrefetchKeys keys on, into L2 (below)
                    if (p.block_table && c0 + kScalePrefetchKeys < seq_nk(p, it.b)) {
                        const char* a = reinterpret_cast<const char*>(scale_at<kWhich>(p, it, c0 + kScalePrefetchKeys));
                        const int64_t step = st.row * 4 > 64 ? st.row * 4 : 64;  // every line, or a line per key
                        for (int64_t x = 0; x < nc * st.row * 4; x += step) __builtin_prefetch(a + x, 0, 2);  // prefetcht1
                    }
                    t.scale = sc;
                    t.scale_ld = st.row;
                    t.scale_head_stride = st.head;
                }
                return t;
            } else {
                return fetch(dequantize_tile<kWhich>(p, it, c0, nc, stage), 0, 0, 0, buf, slot);
            }
        };
        if (!shared || shared->floats[kWhich] == 0 || it.kv_heads != 1 || c0 % BC != 0 || nc != (nk - c0 < BC ? nk - c0 : BC))
            return pack(own, false);
        const int64_t index = (int64_t(it.b) * p.hk + it.kv_head) * shared->tiles_per_seq + c0 / BC;
        SharedSlot& slot = shared->slots[kWhich][index];
        int state = slot.state.load(std::memory_order_acquire);
        if (state == 2) return slot.tile;
        if (state == 0 && slot.state.compare_exchange_strong(state, 1, std::memory_order_acq_rel)) {
            slot.tile = pack(shared->data[kWhich] + index * shared->floats[kWhich], true);
            slot.state.store(2, std::memory_order_release);
            return slot.tile;
        }
        // Another item is packing it (a few microseconds): wait that long, then do it ourselves.
        for (int spin = 0; spin < 4096; ++spin) {
            if (slot.state.load(std::memory_order_acquire) == 2) return slot.tile;
            cpu_relax();
        }
        return pack(own, false);
    }

    // The scale array of K (kWhich = 0) or V of a quantized cache: its strides, and the scale of
    // key position pos of the item's first kv head (nullptr without scales: every scale is 1).
    // Policies reading codes get key c0's pointer with the tile (a tile, or a run of one, never
    // crosses a cache block there: they have kTilesEndAtBlocks).
    struct ScaleStrides {
        int64_t batch, row, head;
    };
    template <int kWhich>
    static ScaleStrides scale_strides(const Params& p) {
        return kWhich == 0 ? ScaleStrides{p.k_scale_batch_stride, p.k_scale_row_stride, p.k_scale_head_stride}
                           : ScaleStrides{p.v_scale_batch_stride, p.v_scale_row_stride, p.v_scale_head_stride};
    }
    // A paged quantized cache's scales of the keys kScalePrefetchKeys further on are prefetched
    // into L2 when a tile is made (tile above; every line of the keys' span where rows are
    // shorter than a line, else each key's first line). Blocks are scattered, so no hardware
    // prefetcher finds them, and each tile's first use of its scales waited on memory: int8 block
    // 16 1.05-1.07x faster, block 64 1.02-1.04x, 256 1.00x (2-core Xeon with AMX, 2 threads; 32
    // keys ahead 1.05x at block 16; bench/RESULTS.md session 51). Contiguous caches' scales
    // stream in order (prefetching them measured noise, session 50).
    static constexpr int64_t kScalePrefetchKeys = 64;
    template <int kWhich>
    static const float* scale_at(const Params& p, const WorkItem& it, int64_t pos) {
        const float* sc = kWhich == 0 ? p.k_scale : p.v_scale;
        if (!sc) return nullptr;
        const ScaleStrides st = scale_strides<kWhich>(p);
        return sc + k_row_offset(p, it.b, pos, st.batch, st.row) + it.kv_head * st.head;
    }

    // Keys [c0, c0 + nc) of the item's kv head of a quantized cache, dequantized into `stage`
    // (float32), and a Params describing `stage` as K (kWhich = 0) or V of
    // one contiguous sequence with one kv head: the policy's k_tile / v_tile then reads it (b = 0,
    // c0 = 0, head offset 0) as it reads any float cache. One BC-key tile at a time: the cache
    // itself is never copied.
    template <int kWhich>
    static Params dequantize_tile(const Params& p, const WorkItem& it, int64_t c0, int64_t nc, float* stage) {
        const DType ct = kv_dtype(p);
        const void* codes = kWhich == 0 ? p.k : p.v;
        const int64_t n = kWhich == 0 ? p.d : p.dv;
        const int64_t bs = kWhich == 0 ? p.k_batch_stride : p.v_batch_stride;
        const int64_t rs = kWhich == 0 ? p.k_row_stride : p.v_row_stride;
        const int64_t ds = kWhich == 0 ? p.k_dim_stride : p.v_dim_stride;
        const int64_t hs = kWhich == 0 ? p.k_head_stride : p.v_head_stride;
        for (int64_t c = 0; c < nc; ++c) {
            const int64_t at = k_row_offset(p, it.b, c0 + c, bs, rs) + it.kv_head * hs;
            const float* sc = scale_at<kWhich>(p, it, c0 + c);
            dequantize_row(stage + c * n, codes, at, n, ds, ct, sc ? *sc : 1.f);
        }
        return staged_params<kWhich>(p, stage);
    }
    // The Params that describe a dequantized tile in `stage` (dequantize_tile); the routes also ask
    // it whether the policy packs such a tile (shared) or reads it in place (private to the item).
    template <int kWhich>
    static Params staged_params(const Params& p, const void* stage) {
        const int64_t n = kWhich == 0 ? p.d : p.dv;
        Params sp = p;
        sp.dtype = int(DType::f32);
        sp.kv_dtype = -1;
        sp.block_table = nullptr;
        sp.cu_seqlens_k = nullptr;
        if (kWhich == 0) {
            sp.k = stage; sp.k_batch_stride = 0; sp.k_row_stride = n; sp.k_head_stride = 0; sp.k_dim_stride = 1;
        } else {
            sp.v = stage; sp.v_batch_stride = 0; sp.v_row_stride = n; sp.v_head_stride = 0; sp.v_dim_stride = 1;
        }
        return sp;
    }

    static void dequantize_row(float* out, const void* codes, int64_t at, int64_t n, int64_t ds, DType ct, float scale) {
        if (ct == DType::i8) {
            const int8_t* c = static_cast<const int8_t*>(codes) + at;
            for (int64_t j = 0; j < n; ++j) out[j] = float(c[j * ds]) * scale;
        } else {
            const uint8_t* c = static_cast<const uint8_t*>(codes) + at;
            const float* value = f8e4m3_values();
            for (int64_t j = 0; j < n; ++j) out[j] = value[c[j * ds]] * scale;
        }
    }

    // Scores -> log2-domain logits with every bias and mask applied (only what is enabled), the
    // pending scale first. Returns false (and touches nothing) when nothing is enabled.
    static bool epilogue(const Params& p, int nv, int64_t r0, int64_t c0, int64_t nc, bool range_mask,
                         bool use_softcap, float cap_l2, float scale, const int64_t* first_key,
                         const int64_t* last_key, const int64_t* diagonal, const float* slope,
                         const int64_t* mask_row_offset, float* mask_values, float* s) {
        const bool alibi = p.alibi != nullptr;
        const MaskKind mk = p.mask ? MaskKind(p.mask_kind) : MaskKind::none;
        if (!use_softcap && !alibi && mk == MaskKind::none && !range_mask) return false;
        const vec ninf = V::set1(-INFINITY), sc = V::set1(scale);
        for (int v = 0; v < nv; ++v) {
            const int64_t rv = r0 + v * W;
            // Row bounds and diagonals relative to the tile's first key c0 (policy.h row_bounds).
            const RowBounds<V> rb = row_bounds<V>(first_key, last_key, diagonal, rv, c0, nc);
            const vec lo = rb.lo, hi = rb.hi, rl = rb.rl, sl = V::load(slope + rv);
            for (int64_t c = 0; c < nc; ++c) {
                float* sp = s + c * RB + v * W;
                vec x = V::load(sp);
                if (scale != 1.f) x = V::mul(x, sc);
                const float kc = float(c);
                if (use_softcap) x = V::mul(V::set1(cap_l2), V::tanh(x));
                if (alibi) x = V::fma(sl, V::abs(V::sub(rl, V::set1(kc))), x);
                if (mk != MaskKind::none) {
                    float* mv = mask_values + c * RB + v * W;
                    if (mk == MaskKind::boolean) {
                        // A False entry selects -inf (1 here, "outside" [-1, 0.5] below) rather than
                        // adding it: a NaN / inf score of a hidden key (garbage in a padding slot)
                        // must not reach the row (API.md: never NaN from masking).
                        const uint8_t* mb = static_cast<const uint8_t*>(p.mask);
                        for (int t = 0; t < W; ++t) mv[t] = mb[mask_row_offset[rv + t] + (c0 + c) * p.mask_key_stride] ? 0.f : 1.f;
                        x = V::mask_outside(x, V::load(mv), V::set1(-1.f), V::set1(0.5f), ninf);
                    } else {
                        const float* mf = static_cast<const float*>(p.mask);
                        for (int t = 0; t < W; ++t) mv[t] = mf[mask_row_offset[rv + t] + (c0 + c) * p.mask_key_stride] * kLog2e;
                        // -inf selects -inf, as a False entry does (x + -inf would be NaN for a
                        // NaN / +inf score); a NaN entry still makes the score NaN.
                        const vec mvv = V::load(mv);
                        x = V::mask_outside(V::add(x, mvv), mvv, V::set1(-FLT_MAX), V::set1(INFINITY), ninf);
                    }
                }
                if (range_mask) x = V::mask_outside(x, V::set1(kc), lo, hi, ninf);
                V::store(sp, x);
            }
        }
        return true;
    }

    // Online softmax for one row block: new max, p = exp2(scale*s - m), l and O rescaled only for
    // row vectors whose max moved. -inf - -inf is guarded: a row that has seen no visible key keeps
    // m = -inf, l = 0 and contributes p = 0. P goes to pb, where G::pv reads it: float32 over s
    // itself (pb == s), or for PStore::bf16_pairs G's pairs [ceil(nc/2)][RB] in a block of their
    // own. s then survives the exp pass, which lets the first try be one pass (softmax_block);
    // float32 P in a block of its own measured 0.98-0.99x (session 36), its softmax being ~7 %
    // of the fp32 forward.
    // The passes take the keys outer and the block's row vectors inner: s is read in address order
    // (one RB-float row per key) with nv independent max / sum chains, where one vector's column (a
    // line every RB floats, one vmaxps latency per key) made the AMX softmax ~13 cycles per 16
    // scores (bench/RESULTS.md, session 34).
    static void softmax_update(const ItemOperands& ops, int nv, int64_t nc, float* s, float* pb, float* m, float* l,
                               int64_t r0, float scale) {
        // Whole row blocks at once; a partial one (an item's last, decode items) vector by vector:
        // two instances per policy instead of one per vector count (library text 1.98 MB against
        // 2.16 MB, same speed).
        if (nv == RV) {
            softmax_block<RV>(ops, nc, s, pb, m, l, r0, scale);
            return;
        }
        for (int v = 0; v < nv; ++v) softmax_block<1>(ops, nc, s + v * W, pb + v * W, m + v * W, l + v * W, r0 + v * W, scale);
    }
    // Lazy rescaling, lane by lane: a row's running max moves to its tile max only when that
    // passes it by more than kRescaleLog2, else p = exp2(s - m) <= 2^kRescaleLog2 against the
    // stale max, which the final l and LSE share (the same result up to rounding). Rows whose max
    // stays get alpha = exp2(0) = 1 exactly, so a row's bits never depend on the rows beside it in
    // the vector. After a row's first tile the max almost always stays, so the block is first
    // tried in one pass: P against the running max, the tile max taken on the way (the same two
    // chains as the max pass). If no lane's tile max passes its running max by more than
    // kRescaleLog2, that is exactly the two-pass result (m_new = m_old, no rescale); else, or
    // with a row that has seen no key yet (m = -inf), or scale <= 0, the two passes redo the block
    // from s (bench/RESULTS.md, session 36: 1.04-1.06x on one core of the 2-core Xeon with AMX,
    // within +-3 % at 16 threads). Only where P has a block of its own: float32 P overwrites s.
    template <int NV>
    static void softmax_block(const ItemOperands& ops, int64_t nc, float* s, float* pb, float* m, float* l,
                              int64_t r0, float scale) {
        const vec ninf = V::set1(-INFINITY), sc = V::set1(scale), k_resc = V::set1(kRescaleLog2);
        vec mx[NV], my[NV], neg_m[NV], sum[NV];
        bool one_pass = G::kPStore == PStore::bf16_pairs && scale > 0.f;
#pragma GCC unroll 8
        for (int v = 0; v < NV; ++v)  // and no lane's running max at -inf
            one_pass = one_pass && !V::any_gt(V::set1(-FLT_MAX), V::load(m + v * W));
        if (one_pass) {
#pragma GCC unroll 8
            for (int v = 0; v < NV; ++v) {
                neg_m[v] = V::sub(V::zero(), V::load(m + v * W));
                mx[v] = my[v] = ninf;
                sum[v] = V::zero();
            }
            exp_pass<NV, true>(s, nc, pb, sc, neg_m, sum, mx, my);
            bool kept = true;
#pragma GCC unroll 8
            for (int v = 0; v < NV; ++v) {
                vec t = V::max(mx[v], my[v]);
                if (scale != 1.f) t = V::mul(t, sc);
                kept = kept && !V::any_gt(t, V::add(V::load(m + v * W), k_resc));
            }
            if (kept) {
#pragma GCC unroll 8
                for (int v = 0; v < NV; ++v) V::store(l + v * W, V::add(V::load(l + v * W), sum[v]));
                return;
            }
        }
        // max(scale*s) = scale*max(s) exactly for scale > 0 (rounding is monotone); two keys per
        // step, so at least two chains per vector. The max of non-NaN values does not depend on
        // the order; a NaN score's lane is NaN after the exp pass whatever its max.
#pragma GCC unroll 8
        for (int v = 0; v < NV; ++v) mx[v] = my[v] = ninf;
        auto at = [&](int64_t c, int v) { return scale > 0.f ? V::load(s + c * RB + v * W) : V::mul(V::load(s + c * RB + v * W), sc); };
        int64_t c = 0;
        for (; c + 2 <= nc; c += 2) {
#pragma GCC unroll 8
            for (int v = 0; v < NV; ++v) {
                mx[v] = V::max(mx[v], at(c, v));
                my[v] = V::max(my[v], at(c + 1, v));
            }
        }
        if (c < nc) {
#pragma GCC unroll 8
            for (int v = 0; v < NV; ++v) mx[v] = V::max(mx[v], at(c, v));
        }
        // (mask_outside as a select: lanes with mx > m_old + k take mx; the lower bound -inf never
        // applies; NaN compares false and keeps m_old.)
        vec m_new[NV];
#pragma GCC unroll 8
        for (int v = 0; v < NV; ++v) {
            vec t = V::max(mx[v], my[v]);
            if (scale > 0.f && scale != 1.f) t = V::mul(t, sc);
            const vec m_old = V::load(m + v * W);
            m_new[v] = V::mask_outside(m_old, t, ninf, V::add(m_old, k_resc), t);
            neg_m[v] = V::sub(V::zero(), V::zero_where_ninf(m_new[v]));
            sum[v] = V::zero();
        }
        exp_pass<NV, false>(s, nc, pb, sc, neg_m, sum, mx, my);
        for (int v = 0; v < NV; ++v) {
            const vec m_old = V::load(m + v * W);
            if (V::any_gt(m_new[v], m_old)) {
                const vec alpha = V::exp2(V::add(m_old, neg_m[v]));
                V::store(l + v * W, V::fma(V::load(l + v * W), alpha, sum[v]));
                G::rescale_o(ops.o, ops.M, ops.dv, r0 + v * W, alpha);
            } else {
                V::store(l + v * W, V::add(V::load(l + v * W), sum[v]));
            }
            V::store(m + v * W, m_new[v]);
        }
    }
    // P = exp2(scale * s + neg_m) into pb (which may be s: each key's P lands on its own row after
    // that row was read), its row sums added to sum; with kMax, the max of s over even keys into
    // mx and odd keys into my (the max pass's chains).
    template <int NV, bool kMax>
    static void exp_pass(const float* s, int64_t nc, float* pb, vec sc, const vec* neg_m, vec* sum, vec* mx, vec* my) {
        for (int64_t k = 0; k < nc; k += 2) {
#pragma GCC unroll 8
            for (int v = 0; v < NV; ++v) {
                const vec x0 = V::load(s + k * RB + v * W);
                if constexpr (kMax) mx[v] = V::max(mx[v], x0);
                const bool pair = k + 1 < nc;
                const vec x1 = pair ? V::load(s + (k + 1) * RB + v * W) : V::zero();
                if constexpr (kMax) if (pair) my[v] = V::max(my[v], x1);
                if constexpr (G::kPStore == PStore::bf16_pairs) {  // P rounded to bf16: V::exp2_bf16p
                    const vec e0 = V::exp2_bf16p(V::fma(x0, sc, neg_m[v]));
                    const vec e1 = pair ? V::exp2_bf16p(V::fma(x1, sc, neg_m[v])) : V::zero();
                    sum[v] = V::add(sum[v], V::add(e0, e1));
                    G::store_p_pair(pb, k / 2, v, e0, e1);
                } else {
                    const vec e0 = V::exp2(V::fma(x0, sc, neg_m[v]));
                    V::store(pb + k * RB + v * W, e0);
                    sum[v] = V::add(sum[v], e0);
                    if (pair) {
                        const vec e1 = V::exp2(V::fma(x1, sc, neg_m[v]));
                        V::store(pb + (k + 1) * RB + v * W, e1);
                        sum[v] = V::add(sum[v], e1);
                    }
                }
            }
        }
    }

    // Normalise once per item and write the output rows (or the split's partial rows).
    static void finish(const Params& p, const WorkItem& it, int64_t R, int64_t nqi, int64_t M,
                       const float* o, const float* mrow, const float* lrow, const float* nf, Partials parts) {
        const int64_t b = it.b, group = p.hq / p.hk, Dv = p.dv;
        FA2CPU_CHECK(Dv <= kMaxHeadDim);  // the row buffer below
        // Rows of O: 16 at a time from the policy's layout where it can (gather_o_rows), else element by element.
        alignas(64) float orows[kBlockO ? 16 * kMaxHeadDim : 1];
        const bool block_o = kBlockO && M % 16 == 0;
        for (int64_t r = 0; r < R; ++r) {
            const float l = lrow[r];
            const float inv = l == 0.f ? 0.f : 1.f / l;  // NaN stays NaN
            const float lse2 = l == 0.f ? -INFINITY : mrow[r] + std::log2(l);
            // The row gathered from G's O layout, normalised, then stored with V's conversions.
            alignas(64) float buf[kMaxHeadDim];
            float* row = it.part >= 0 ? parts.o + (it.part + r) * Dv : buf;
            if (block_o) {
                if constexpr (kBlockO)
                    if (r % 16 == 0) G::gather_o_rows(o, M, Dv, r, orows);
                const float* src = orows + (r % 16) * Dv;
                for (int64_t j = 0; j < Dv; ++j) row[j] = src[j] * inv;
            } else {
                for (int64_t j = 0; j < Dv; ++j) row[j] = G::o_elem(o, M, Dv, r, j) * inv;
            }
            if (nf)  // the inf / NaN values of V the row sees that its products took as 0 (Hidden)
                for (int64_t j = 0; j < Dv; ++j) row[j] += nf[r * Dv + j];
            if (it.part >= 0) {
                parts.lse[it.part + r] = lse2;
                continue;
            }
            const int64_t h = it.kv_head * group + it.g0 + r / nqi, i = it.i0 + r % nqi;
            const int64_t out_at = q_row_offset(p, b, i, p.out_batch_stride, p.out_row_stride) + h * p.out_head_stride;
            V::store_row(p.out, out_at, p.out_dim_stride, row, Dv, DType(p.dtype));
            if (p.lse) p.lse[q_row_offset(p, b, i, p.lse_batch_stride, p.lse_row_stride) + h * p.lse_head_stride] = lse2 * kLn2;
        }
    }
};

}  // namespace
}  // namespace fa2cpu
