// The ISA-neutral half of the decode GEMM policies (gemm_decode.h for AVX-512, gemm_decode_avx2.h
// for AVX2): traits, scratch sizes, Q/O layouts, K/V tiles read in place, the per-key scales of a
// quantized cache and the outer loops over key blocks and row groups. The policies add the two
// two products (qk, pv) with their own vectors.
//
// Decode items hold at most kRowsPerHead query rows per kv head (decode, the GQA group of one new
// token, short chunks). There a row vector would be mostly padding, so these policies put the
// FEATURE axis in lanes instead: each K/V row is streamed once with full-width loads (converted to
// float32 in registers, whatever its dtype, so K/V are read in place unless paged or strided) and
// reused by every query row of the item (the whole GQA group) from registers.
// Layouts: q [M][Dp] float32 pre-scaled (Dp = D rounded up to 16, zero padded); O row-major
// [M][Dvp]; s [BC][RB] as in tile_loop.h (lanes past the item's rows are never read back).
#pragma once
#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "kernel.h"
#include "policy.h"

namespace fa2cpu {
namespace {

// E: the element type's traits (E::T stored type, E::kCodes quantized codes, E::kUnit factor
// applied with the scales); kRG: rows per group (the rows whose products share one K/V load).
template <class E, int kRG>
struct DecodeOperands {
    using T = typename E::T;
    static constexpr int64_t BC = 256;       // keys per tile: long streams, 64 KiB score block
    static constexpr int64_t kRowsPerHead = 16;  // sequences with more rows per kv head use the tile policies
    static constexpr int64_t kMaxRows = 64;      // rows of an item spanning kv heads
    static constexpr ScaleAt kScaleAt = ScaleAt::packed_q;
    static constexpr PStore kPStore = PStore::f32_in_scores;
    static constexpr bool kTilesEndAtBlocks = true;  // paged K/V read in place
    // ... and a paged tile spans whole cache blocks of 16-31 keys, each a run (tile_loop.h)
    static constexpr int64_t kRunKeys = 16;
    static constexpr bool kReadsCodes = E::kCodes;   // quantized K/V read in place too (tile_loop.h)
    static constexpr int RG = kRG;
    static constexpr int64_t KBLK = 16;      // keys per block of the outer loop (all row groups)
    // K/V rows of a KV cache are often one page apart (B, N, H, D layout), where hardware
    // prefetchers stop; rows prefetch_keys ahead are prefetched while the current ones are used,
    // into L2 (prefetcht1), not L1 (32 keys of an item spanning 8 kv heads are 128 KB of float32
    // rows, which a 32 KB L1 cannot hold beside the current block; on the 2-core Zen 4
    // prefetcht0 ran the float32 cache 2x slower than prefetcht1, no prefetch 1.2-2x slower).
    // The distance is kPrefetchKeys keys (32 for float caches, 64 for codes: tuned on a Zen 4)
    // but at most kPrefetchBytes of the stream: an item spanning 8 kv heads of a (B, N, H, D)
    // cache reads 4 KB (float32) / 2 KB / 1 KB (int8) per key, and there 32 KB ahead (8 / 16 / 32
    // keys instead of 32 / 32 / 64) measured 1.07-1.08x (float32), 1.03-1.05x (bf16), 1.01-1.02x
    // (int8) faster on the 2-core Xeon with AMX; 16-24 KB lost 5-22 % for bf16 and int8 (for bf16
    // less than one KBLK block ahead), 48 KB 0-2 %. One head per item (a head-major cache, 128-512
    // B per key) keeps its key counts: 32 KB ahead there measured 0.96-0.99x (in process,
    // bench/RESULTS.md session 50). Float32 caches go 64 KB ahead (16 keys at 8 kv heads): on a
    // 2-core Zen 5 1.26-1.32x (avx512bf16 family), 1.08-1.14x (avx512), 1.46-1.49x (avx2) faster
    // at 1 thread, 1.04-1.29x at 2, paged and head-major caches 0.98-1.14x; on the AMX test
    // machine 0.99-1.07x (amx and avx2 families, 1 / 2 / 16 threads); 128 KB the same as 64 on
    // the Zen 5, and 64 KB for bf16 / int8 there 0.95-1.03x (bench/RESULTS.md session 61).
    static constexpr int64_t kPrefetchKeys = sizeof(T) == 1 ? 64 : 32;
    static constexpr int64_t kPrefetchBytes = int64_t(sizeof(T) == 4 ? 64 : 32) << 10;
    static int64_t prefetch_keys(int64_t row_stride) {
        const int64_t row_bytes = std::max<int64_t>(1, std::llabs(row_stride) * int64_t(sizeof(T)));
        return std::max<int64_t>(1, std::min(kPrefetchKeys, kPrefetchBytes / row_bytes));
    }

    // Per-key factors of a quantized cache for the RG rows of a group: row j's scales at
    // row[j][c*ld] (nullptr: 1), times E::kUnit.
    struct Scales {
        const float* const* row;
        int64_t ld;
        float factor(int j, int64_t c) const { return (row[j] ? row[j][c * ld] : 1.f) * E::kUnit; }
    };

    // Rows [r, r + RG) of a row block: each row's kv-head offset into tile t, and their scales.
    static Scales group(const int32_t* kv_head, int r, const KvTile& t, int64_t* off, const float** sc) {
        head_offsets(kv_head, r, t, off);
        for (int j = 0; j < RG; ++j) sc[j] = t.scale ? t.scale + kv_head[r + j] * t.scale_head_stride : nullptr;
        return Scales{sc, t.scale_ld};
    }
    static void head_offsets(const int32_t* kv_head, int r, const KvTile& t, int64_t* off) {
        for (int j = 0; j < RG; ++j) off[j] = kv_head[r + j] * t.head_stride;
    }
    // Rows of keys [c, c + KB) of a tile; past the nkb real ones, the last real row again (its
    // sums are never stored).
    template <class C, int KB>
    static void key_rows(const C* k, int64_t c, int64_t nkb, int64_t ldk, const C* (&kr)[KB]) {
        for (int i = 0; i < KB; ++i) kr[i] = k + (c + (i < nkb ? i : nkb - 1)) * ldk;
    }
    static int64_t dp(int64_t n) { return round_up(n, 16); }
    static int64_t q_floats(int64_t D, int64_t M) { return M * dp(D); }
    static int64_t k_floats(int64_t D) { return (BC * dp(D) * int64_t(sizeof(T)) + 3) / 4; }
    static int64_t v_floats(int64_t Dv) { return (BC * dp(Dv) * int64_t(sizeof(T)) + 3) / 4; }

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
    // Rows [r0, r0 + lanes of alpha) of O times their alpha lane; rows whose factor is 1 (their max
    // did not move: most rows of most tiles) are not touched. The row loop vectorizes (-O3).
    template <class Vec>
    static void rescale_o(float* o, int64_t, int64_t Dv, int64_t r0, Vec alpha) {
        constexpr int kLanes = int(sizeof(Vec) / sizeof(float));
        float a[kLanes];
        std::memcpy(a, &alpha, sizeof(Vec));
        const int64_t n = dp(Dv);
        for (int l = 0; l < kLanes; ++l) {
            if (a[l] == 1.f) continue;
            float* row = o + (r0 + l) * n;
            for (int64_t j = 0; j < n; ++j) row[j] *= a[l];
        }
    }

    // The outer loops of both products: for each block of KBLK keys [cb, ce) (outer, so that the
    // rows of all kv heads of an item for those keys, contiguous in a (B, N, H, D) cache, are read
    // together) and each group of RG rows r: f(cb, ce, r, off, scales, one_head, prefetch), where
    // one_head says the group's rows share one kv head's rows and scales (each K/V vector is then
    // loaded once, and scaled once, for all of them) and prefetch whether this group issues the
    // prefetches (the first group of its head; groups spanning heads always do).
    template <class F>
    static void for_groups(const RowBlock& block, const KvTile& t, int64_t nc, F&& f) {
        const int32_t* kv_head = block.kv_head;
        for (int64_t cb = 0; cb < nc; cb += KBLK) {
            const int64_t ce = cb + KBLK < nc ? cb + KBLK : nc;
            for (int r = 0; r < block.rows; r += RG) {
                int64_t off[RG];
                const float* sc[RG];
                const Scales scales = group(kv_head, r, t, off, sc);
                // One head: the same K/V rows and the same scales (kv heads may share storage,
                // head stride 0, and still carry their own scales: not one head then).
                const bool one = off[0] == off[RG - 1] && sc[0] == sc[RG - 1];
                f(cb, ce, r, static_cast<const int64_t*>(off), scales, one, !one || r == 0 || kv_head[r - 1] != kv_head[r]);
            }
        }
    }

    // Rows of a K/V tile: in place for unit feature stride (any dtype; a paged tile lies in one
    // block), else gathered into buf (rows of dp(n) elements, native dtype; then the item holds
    // one kv head: routes.h spans heads only for unit feature strides).
    static KvTile tile(const Params& p, const void* base, int64_t batch_stride, int64_t row_stride, int64_t dim_stride,
                       int64_t head_stride, int64_t n, int64_t b, int64_t c0, int64_t nc, int64_t head, float* buf) {
        const T* src = static_cast<const T*>(base);
        if (dim_stride == 1) {
            KvTile t{src + k_row_offset(p, b, c0, batch_stride, row_stride) + head, row_stride, head_stride, 0};
            // (paged: whole KBLK blocks ahead, so that the switch falls between key blocks; see aim)
            const int64_t far = p.block_table ? round_up(prefetch_keys(row_stride), KBLK) : prefetch_keys(row_stride);
            aim(p, batch_stride, row_stride, b, c0, far, t.prefetch, t.prefetch2, t.far_switch);
            aim(p, batch_stride, row_stride, b, c0, KBLK, t.prefetch_near, t.prefetch_near2, t.near_switch);
            return t;
        }
        T* out = reinterpret_cast<T*>(buf);
        const int64_t np = dp(n);
        for (int64_t c = 0; c < nc; ++c) {
            const T* r = src + k_row_offset(p, b, c0 + c, batch_stride, row_stride) + head;
            for (int64_t j = 0; j < n; ++j) out[c * np + j] = r[j * dim_stride];
        }
        KvTile t{out, np, 0, prefetch_keys(np) * np};
        t.prefetch_near = KBLK * np;
        return t;
    }
    // Prefetch distances (elements) of a tile starting at key c0: the rows `keys` further on in the
    // sequence (far: prefetch_keys; near: KBLK). Contiguous: keys * row_stride. Paged: where those
    // rows lie in the block table (blocks are scattered, out of reach of hardware prefetchers):
    // for the tile's first key `kf` blocks on, and from key `sw` of the tile on (if the tile
    // reaches it) one block further; a target past the sequence's last block gives 0 (only
    // validated block-table entries are read). The decode loops pick the distance per KBLK block
    // (KvTile::far_at / near_at), so a paged cache's far distance is rounded up to whole KBLK
    // blocks (float32 at 8 kv heads: 16 keys, 64 KB, not 8; with 8 the switch fell inside the
    // only key block of a 16-key block and its second half went unprefetched: 0.70x). An int8
    // cache of 16-key blocks (1 KB a key at 8 kv heads) is prefetched 2 blocks ahead; one of
    // 64-key blocks 32 keys on within the block, its last 32 rows in the next block. Before
    // (session 50: the same row of the next block, and within blocks of >= 8x prefetch_keys keys
    // no next block at all), in process on the 2-core Xeon with AMX, 2 threads, both load orders
    // (bench/RESULTS.md session 51): int8 blocks 32 / 64 / 256 1.10-1.11x / 1.15-1.21x /
    // 1.06-1.14x faster, bf16 blocks 32 / 64 / 256 1.04x / 1.05-1.09x / 1.02-1.05x, float32
    // blocks 64 / 256 1.07x / 1.00-1.04x; blocks of 16 (int8, bf16, float32) unchanged.
    static void aim(const Params& p, int64_t batch_stride, int64_t row_stride, int64_t b, int64_t c0, int64_t keys,
                    int64_t& first, int64_t& second, int64_t& sw) {
        if (!p.block_table) { first = keys * row_stride; return; }
        const int64_t bs = p.block_size, cur = c0 / bs, o = c0 % bs, kf = (o + keys) / bs;
        const int64_t last = (seq_nk(p, b) - 1) / bs;
        const int32_t* row = p.block_table + b * p.block_table_batch_stride;
        auto to = [&](int64_t k) {  // from row o of block cur to row o + keys - k*bs of block cur + k
            if (cur + k > last) return int64_t(0);
            return (int64_t(row[cur + k]) - int64_t(row[cur])) * batch_stride + (keys - k * bs) * row_stride;
        };
        first = to(kf);
        second = to(kf + 1);
        sw = (kf + 1) * bs - keys - o;
    }
    static KvTile k_tile(const Params& p, int64_t b, int64_t c0, int64_t nc, int64_t head, float* buf) {
        return tile(p, p.k, p.k_batch_stride, p.k_row_stride, p.k_dim_stride, p.k_head_stride, p.d, b, c0, nc, head, buf);
    }
    static KvTile v_tile(const Params& p, int64_t b, int64_t c0, int64_t nc, int64_t head, float* buf) {
        return tile(p, p.v, p.v_batch_stride, p.v_row_stride, p.v_dim_stride, p.v_head_stride, p.dv, b, c0, nc, head, buf);
    }
};

}  // namespace
}  // namespace fa2cpu
