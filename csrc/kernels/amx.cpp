// Family "amx": Intel AMX-BF16 tiles for both GEMMs of bfloat16 attention, AVX-512 for the softmax.
// Built with the flags of its catalogue.def row. Routes, first serving wins: the AVX-512 decode
// route (<= 16 rows per kv head, gemm_decode.h), AMX for bf16 with >= kMinAmxRows rows per kv
// head, the AVX-512-BF16 kernels for shorter bf16 sequences (a 32-row tile block would be mostly
// padding), the float32 AVX-512 kernels for float32 / float16 (4 x 6 blocking: vec_avx512.h V512x46).
//
// Same "rows in lanes" tile loop as every family (tile_loop.h); the AMX GEMM policy computes
//   S^T[16 keys][16 rows] += K[16 keys][32 d] (A, bf16 rows)  x  Qpairs[16 pairs][16 rows] (B, VNNI)
//   O^T[16 dv][16 rows]   += V^T[16 dv][32 keys] (A, bf16)    x  Ppairs[16 pairs][16 rows] (B, VNNI)
// so P uses the bf16 pair layout of gemm_bf16.h, Q its pairs in tile blocks, K is packed as rows
// in tile blocks, and only V needs a transpose while packing. Every tile is 16 rows x 64 bytes
// (one configuration); operands are zero-padded to whole tiles: D and Dv to 32, keys to 32, rows
// to 32 (2 x 2 register blocking of C tiles: tmm0-3 accumulate, tmm4-5 hold A, tmm6-7 hold B).
// Q, K and V^T are packed "tile-blocked": each A / B tile one contiguous 1 KB block (64-byte row
// stride). A tile microbenchmark on the AMX test machine (bench/tools/amx_tile_bench.cpp;
// bench/RESULTS.md, "AMX operands packed in tile blocks") ran 2 x 2 blocks 1.3-1.7x faster from
// contiguous tiles than from rows 256 / 768 bytes apart.
#include <immintrin.h>

#include <algorithm>

#include "common/amx_tiles.h"
#include "common/backward_amx.h"
#include "common/gemm_bf16.h"
#include "common/gemm_decode.h"
#include "common/gemm_f32.h"
#include "common/probe.h"
#include "common/routes.h"
#include "common/tile_loop.h"
#include "common/vec_avx512.h"

namespace fa2cpu {
namespace {

constexpr int64_t kMinAmxRows = 32;

struct AmxGemm : TransposedO<V512> {
    static constexpr int W = 16;
    static constexpr int RV = V512::RV;
    static constexpr int RB = RV * W;      // 96 rows: 3 pairs of 16-row tiles
    // Keys per tile (FA2CPU_AMX_BC overrides it for experiments): C tiles of O^T are loaded and
    // stored once per tile, so longer tiles mean less tile traffic per tdpbf16ps.
#ifndef FA2CPU_AMX_BC
#define FA2CPU_AMX_BC 256
#endif
    static constexpr int64_t BC = FA2CPU_AMX_BC;
    static constexpr int64_t kMaxRows = V512::MAX_ROWS;
    static constexpr int64_t kRowAlign = 32;
    static constexpr ScaleAt kScaleAt = ScaleAt::softmax;    // tiles are stored unscaled
    static constexpr PStore kPStore = PStore::bf16_pairs;    // gemm_bf16.h's pair layout
    static constexpr bool kTilesEndAtBlocks = false;
    static_assert(RB % 32 == 0 && BC % 32 == 0, "whole 2x2 tile blocks");

    static int64_t d2p(int64_t D) { return round_up((D + 1) / 2, 16); }  // Q pair rows
    // Q pairs, tile-blocked: pair t of row r at q[((t/16) * (M/16) + r/16) * 256 + (t%16) * 16 + r%16]
    // (uint32), so the B tile of pairs [t, t+16) x rows [r, r+16) is one contiguous 1 KB block.
    static int64_t q_at(int64_t M, int64_t t, int64_t r) { return ((t / 16) * (M / 16) + r / 16) * 256 + (t % 16) * 16 + r % 16; }
    static int64_t o_rows(int64_t Dv) { return round_up(Dv, 32); }
    static int64_t o_floats(int64_t Dv, int64_t M) { return o_rows(Dv) * M; }
    static int64_t q_floats(int64_t D, int64_t M) { return d2p(D) * M; }
    static int64_t k_floats(int64_t D) { return BC * round_up(D, 32) / 2; }
    static int64_t v_floats(int64_t Dv) { return o_rows(Dv) * BC / 2; }

    // Row r of Q as bf16 pairs (q_at): 32 elements (16 pairs) per step with vcvtne2ps2bf16 (round
    // to nearest even, like f32_to_bf16; its output is already pair-ordered) and a 16-lane scatter
    // at stride 16 within the pairs' tile block; the scalar path for the last D % 32 elements.
    static void pack_q_row(float* qbuf, int64_t M, int64_t r, const float* row, int64_t D, float) {
        uint32_t* q = reinterpret_cast<uint32_t*>(qbuf);
        const __m512i idx = _mm512_set_epi32(240, 224, 208, 192, 176, 160, 144, 128, 112, 96, 80, 64, 48, 32, 16, 0);
        int64_t t = 0;
        for (; 2 * t + 32 <= D; t += 16) {
            const __m512i pairs = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(row + 2 * t + 16), _mm512_loadu_ps(row + 2 * t));
            _mm512_i32scatter_epi32(q + q_at(M, t, r), idx, pairs, 4);
        }
        for (; 2 * t < D; ++t)
            q[q_at(M, t, r)] = uint32_t(f32_to_bf16(row[2 * t])) | uint32_t(2 * t + 1 < D ? f32_to_bf16(row[2 * t + 1]) : 0) << 16;
        for (; t < d2p(D); ++t) q[q_at(M, t, r)] = 0;
    }
    static void zero_q_row(float* qbuf, int64_t M, int64_t r, int64_t D) {
        uint32_t* q = reinterpret_cast<uint32_t*>(qbuf);
        for (int64_t t = 0; t < d2p(D); ++t) q[q_at(M, t, r)] = 0;
    }

    static bool packs_k(const Params&) { return true; }
    static bool packs_v(const Params&) { return true; }

    // K rows as A tiles, tile-blocked: key c's elements [32u, 32u+32) at
    // [((c/16) * (Dp/32) + u) * 512 + (c%16) * 32] (bf16), Dp = round_up(D, 32), zero past nc
    // keys (to a whole 32-key block) and D columns. The tile's ld is Dp.
    static KvTile k_tile(const Params& p, int64_t b, int64_t c0, int64_t nc, int64_t head, float* buf) {
        const int64_t D = p.d, Dp = round_up(D, 32), nu = Dp / 32;
        const uint16_t* k = static_cast<const uint16_t*>(p.k);
        uint16_t* out = reinterpret_cast<uint16_t*>(buf);
        for (int64_t c = 0; c < round_up(nc, 32); ++c) {
            uint16_t* o = out + (c / 16) * nu * 512 + (c % 16) * 32;
            const uint16_t* src = c < nc ? k + k_row_offset(p, b, c0 + c, p.k_batch_stride, p.k_row_stride) + head : nullptr;
            for (int64_t u = 0; u < nu; ++u, o += 512) {
                const int64_t d0 = 32 * u, n = src ? (D - d0 < 32 ? D - d0 : 32) : 0;
                if (n == 32 && p.k_dim_stride == 1) {
                    _mm512_storeu_si512(o, _mm512_loadu_si512(src + d0));
                    continue;
                }
                for (int64_t d = 0; d < 32; ++d) o[d] = d < n ? src[(d0 + d) * p.k_dim_stride] : 0;
            }
        }
        return {out, Dp, 0, 0};
    }

    // V^T [round_up(Dv,32)][BC] bf16 in tile blocks (the A tile of rows [16a, 16a+16) x keys
    // [32e, 32e+32) at pair offset (a * (BC/32) + e) * 256, rows 16 pairs apart), zero past nc
    // keys and Dv columns. Built from 16 x 16 blocks of key pairs: row i of a block is
    // (V[2i][j], V[2i+1][j]) for 16 columns j, as one uint32 each (the bf16 pair layout);
    // transposing the block in registers gives, per column j, 16 consecutive pairs = 32
    // consecutive keys of V^T row j.
    static KvTile v_tile(const Params& p, int64_t b, int64_t c0, int64_t nc, int64_t head, float* buf) {
        const int64_t Dv = p.dv, Dvp = o_rows(Dv), ncp = round_up(nc, 32);
        const uint16_t* v = static_cast<const uint16_t*>(p.v);
        uint32_t* out = reinterpret_cast<uint32_t*>(buf);  // [Dvp][BC / 2] pairs
        for (int64_t c2 = 0; c2 < ncp / 2; c2 += 16) {
            const uint16_t* rows[32];
            for (int i = 0; i < 32; ++i) {
                const int64_t c = 2 * c2 + i;
                rows[i] = c < nc ? v + k_row_offset(p, b, c0 + c, p.v_batch_stride, p.v_row_stride) + head : nullptr;
            }
            for (int64_t j = 0; j < Dvp; j += 16) {
                __m512i r[16];
                for (int i = 0; i < 16; ++i) {
                    const uint16_t* lo = rows[2 * i];
                    const uint16_t* hi = rows[2 * i + 1];
                    if (p.v_dim_stride == 1 && j + 16 <= Dv) {
                        const __m512i a = lo ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo + j)))
                                             : _mm512_setzero_si512();
                        const __m512i h = hi ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi + j)))
                                             : _mm512_setzero_si512();
                        r[i] = _mm512_or_si512(a, _mm512_slli_epi32(h, 16));
                    } else {  // column tail or strided V: gather the pairs one by one
                        alignas(64) uint32_t tmp[16];
                        for (int t = 0; t < 16; ++t) {
                            const int64_t col = j + t;
                            const uint16_t x = lo && col < Dv ? lo[col * p.v_dim_stride] : 0;
                            const uint16_t y = hi && col < Dv ? hi[col * p.v_dim_stride] : 0;
                            tmp[t] = uint32_t(x) | (uint32_t(y) << 16);
                        }
                        r[i] = _mm512_load_si512(tmp);
                    }
                }
                transpose16x16_epi32(r);
                uint32_t* blk = out + ((j / 16) * (BC / 32) + c2 / 16) * 256;  // j % 16 == 0, c2 % 16 == 0
                for (int t = 0; t < 16; ++t) _mm512_storeu_si512(blk + t * 16, r[t]);
            }
        }
        return {out, BC, 0, 0};
    }

    // S^T block (keys x rows) of nv 16-row vectors (nv even, M multiple of 32), unscaled.
    static void qk(const ItemOperands& x, const RowBlock& rows, const KvTile& kt, int64_t nc, float* s) {
        const uint32_t* q = reinterpret_cast<const uint32_t*>(x.q);
        const uint16_t* k = static_cast<const uint16_t*>(kt.data);
        const int64_t D2p = d2p(x.d), ncp = round_up(nc, 32), nu = kt.ld / 32, M = x.M, r0 = rows.r0;
        const int nv = rows.vectors;
        for (int64_t c = 0; c < ncp; c += 32) {
            const uint16_t* k0 = k + (c / 16) * nu * 512;
            for (int r = 0; r < nv * W; r += 32) {
                _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                for (int64_t t = 0; t < D2p; t += 16) {
                    const uint32_t* qb = q + q_at(M, t, r0 + r);
                    _tile_loadd(4, k0 + (t / 16) * 512, 64);
                    _tile_loadd(5, k0 + (nu + t / 16) * 512, 64);
                    _tile_loadd(6, qb, 64);
                    _tile_loadd(7, qb + 256, 64);  // rows r+16..: the next 16-row block of q_at
                    _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7);
                    _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
                }
                _tile_stored(0, s + c * RB + r, RB * 4);
                _tile_stored(1, s + c * RB + r + 16, RB * 4);
                _tile_stored(2, s + (c + 16) * RB + r, RB * 4);
                _tile_stored(3, s + (c + 16) * RB + r + 16, RB * 4);
            }
        }
    }

    // gemm_bf16.h's pair layout, indexed with that policy's RB: the two row blocks must agree
    // (session 34 tried a 64-row AMX block, no faster, and its pairs landed at a 96-row stride).
    static_assert(RB == Bf16Gemm<V512>::RB, "P pairs indexed with the vdpbf16ps policy's row block");
    static void store_p_pair(float* pbuf, int64_t c2, int v, __m512 e0, __m512 e1) {
        Bf16Gemm<V512>::store_p_pair(pbuf, c2, v, e0, e1);
    }

    // O^T += V^T P^T on 2 x 2 tile blocks, from the P pairs the softmax wrote (zero-padded here
    // to whole 32-key blocks).
    static void pv(const ItemOperands& x, const RowBlock& rows, float* s, int64_t nc, const KvTile& vt) {
        float* oT = x.o + rows.r0;
        uint32_t* pb = reinterpret_cast<uint32_t*>(s);  // P pairs (tile_loop.h's P block)
        const int64_t M = x.M, ldv = vt.ld, Dv = x.dv;
        const int nv = rows.vectors;
        const int64_t ncp = round_up(nc, 32);
        for (int64_t c2 = (nc + 1) / 2; c2 < ncp / 2; ++c2)
            for (int v = 0; v < nv; ++v) _mm512_storeu_si512(pb + c2 * RB + v * W, _mm512_setzero_si512());
        const uint16_t* vT = static_cast<const uint16_t*>(vt.data);
        const int64_t Dvp = o_rows(Dv);
        for (int64_t j = 0; j < Dvp; j += 32) {
            for (int r = 0; r < nv * W; r += 32) {
                float* o = oT + j * M + r;
                _tile_loadd(0, o, M * 4);
                _tile_loadd(1, o + 16, M * 4);
                _tile_loadd(2, o + 16 * M, M * 4);
                _tile_loadd(3, o + 16 * M + 16, M * 4);
                for (int64_t c = 0; c < ncp; c += 32) {
                    _tile_loadd(4, vT + ((j / 16) * (ldv / 32) + c / 32) * 512, 64);
                    _tile_loadd(5, vT + ((j / 16 + 1) * (ldv / 32) + c / 32) * 512, 64);
                    _tile_loadd(6, pb + (c / 2) * RB + r, RB * 4);
                    _tile_loadd(7, pb + (c / 2) * RB + r + 16, RB * 4);
                    _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7);
                    _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
                }
                _tile_stored(0, o, M * 4);
                _tile_stored(1, o + 16, M * 4);
                _tile_stored(2, o + 16 * M, M * 4);
                _tile_stored(3, o + 16 * M + 16, M * 4);
            }
        }
    }
};

// The AMX tile loop: tiles configured per item (cheap next to a 32+ row item, and robust to other
// tile users in the thread), released after it.
struct AmxLoop : TileLoop<V512, AmxGemm> {
    static void run_item(const Params& p, const WorkItem& it, const ItemContext& ctx) {
        configure_full_tiles();
        TileLoop<V512, AmxGemm>::run_item(p, it, ctx);
        _tile_release();
    }
};

// tdpbf16ps peak: 4 independent accumulator tiles, 16 x 16 x 32 multiply-adds per instruction.
double amx_peak(double seconds) {
    alignas(64) static thread_local uint16_t A[16 * 32], B[16 * 32];
    alignas(64) static thread_local float C[16 * 16];
    for (int i = 0; i < 16 * 32; ++i) { A[i] = 0x3f80; B[i] = 0x3380; }
    configure_full_tiles();
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    _tile_loadd(4, A, 64); _tile_loadd(5, A, 64); _tile_loadd(6, B, 64); _tile_loadd(7, B, 64);
    int64_t iters = 0;
    const auto t0 = std::chrono::steady_clock::now();
    double el = 0;
    do {
        for (int i = 0; i < 4096; ++i) {
            _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
        }
        iters += 4096;
        el = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    } while (el < seconds);
    _tile_stored(0, C, 64);
    _tile_release();
    volatile float keep = C[0];
    (void)keep;
    return 4.0 * 2 * 16 * 16 * 32 * double(iters) / el * 1e-9;
}

double peak(int dtype, double seconds) {
    return DType(dtype) == DType::bf16 ? amx_peak(seconds) : fma_peak_gflops<V512>(seconds);
}

}  // namespace

extern const KernelTable kTable_amx =
    make_table(&peak, BackwardRoute<AmxBackward>(),
               Avx512DecodeRoute::route("decode"), TileRoute<AmxLoop, Bf16Rows<kMinAmxRows>>::route("amx"),
               TileRoute<TileLoop<V512, Bf16Gemm<V512>>, Bf16Input>::route("bf16"),
               TileRoute<TileLoop<V512x46, F32Gemm<V512x46>>>::route("f32"));

}  // namespace fa2cpu
