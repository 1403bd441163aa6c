// Vector traits of the AVX-512 families (avx512, avx512bf16, amx): 16 float32 lanes.
// Included by each of those files, compiled with at least AVX-512F/BW/VL/DQ + FMA + F16C.
//
// Register blocking (tile_loop.h): RV x NK = 6 x 4 = 24 zmm accumulators for Q K^T and
// RV x ND = 6 x 4 for P V, plus 6 row loads and one broadcast: 31 of 32 zmm. Per reduction step
// 6 vector loads and 4 broadcasts feed 24 FMAs. Measured on Zen 5 (2 x 512-bit FMA pipes), 6 x 4
// beat 4 x 6 and 8 x 3 (fewer broadcasts per FMA; 8 x 3 reloads the accumulators too often).
//
// Every reduction step re-reads 6 row vectors (384 B) of Q^T (QK) or P (PV) per 24 FMAs: the
// whole 96-row block (48 KiB at D = 128 or 128 keys) would stream from L2 at 32 B per 12 cycles,
// which Intel's L2 does not sustain beside the K/V and O traffic. The products therefore run in
// passes of DC head-dim entries / CC keys (24 KiB slices that stay in a 48 KiB L1), storing and
// reloading the accumulators between passes (same summation order: results unchanged). Measured
// on a 2-core Sapphire-Rapids-class Xeon, one 192-row item x 2048 keys at D = 128: QK^T 49 -> 57-61
// and PV 49 -> 55-58 float32 flops per TSC cycle (probe peak 56-64); DC = CC = 32 is as good.
#pragma once
#include <immintrin.h>

#include "kernel.h"

namespace fa2cpu {
namespace {

// The mask of the first n of 16 lanes (none for n <= 0, all for n >= 16).
inline __mmask16 lanes_below(int64_t n) { return n >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n < 0 ? 0 : n)) - 1); }

struct V512 {
    using vec = __m512;
    static constexpr int W = 16, RV = 6, NK = 4, ND = 4;
    // 128-key tiles, up to 192 rows (2 row blocks of 96) per item: Q^T + O^T (96 KiB each at
    // D = 128), a 48 KiB score block and packed K/V tiles (64 KiB each) stay in a 1 MiB L2, and
    // one K/V tile is reused by 192 rows.
    static constexpr int64_t BC = 128, MAX_ROWS = 192;
    static constexpr int64_t DC = 64, CC = 64;  // reduction passes of gemm_f32.h (above)

    static vec zero() { return _mm512_setzero_ps(); }
    static vec set1(float a) { return _mm512_set1_ps(a); }
    static vec load(const float* p) { return _mm512_loadu_ps(p); }
    static void store(float* p, vec a) { _mm512_storeu_ps(p, a); }
    static vec fma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
    static vec add(vec a, vec b) { return _mm512_add_ps(a, b); }
    static vec sub(vec a, vec b) { return _mm512_sub_ps(a, b); }
    static vec mul(vec a, vec b) { return _mm512_mul_ps(a, b); }
    static vec max(vec a, vec b) { return _mm512_max_ps(a, b); }
    static vec abs(vec a) { return _mm512_abs_ps(a); }
    // exp2 as scalef(p(f), x): vscalefps multiplies by 2^floor(x), so p needs only the fraction
    // f = x - floor(x) in [0, 1] (vreduceps, one op; no clamps: reduce(+-inf) = 0, then scalef
    // gives inf / 0; NaN stays NaN; large |x| over- or underflows in scalef). p is a minimax fit of
    // 2^f for relative error on [0, 1] with p(0) = 1 exactly (Lawson iteration, float32 Horner):
    // degree 5, 1.6e-7 (exp2: float32 P, alpha, the backward); degree 4, 3.0e-6 (exp2_bf16p: P
    // rounded to bf16, 2^-9, for the bf16 GEMMs; its row sums use it unrounded). 7 and 6 vector ops
    // (before: clamp, round, subtract, degree 6 / 4 on [-0.5, 0.5], scalef: 10 and 8 ops, 2.4e-7
    // and 2.9e-6). exp2(0) = exp2_bf16p(0) = 1 and exp2(-inf) = exp2_bf16p(-inf) = 0 exactly.
    static vec exp2(vec x) {
        const vec f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
        vec p = _mm512_fmadd_ps(_mm512_set1_ps(0.0018671307f), f, _mm512_set1_ps(0.0090170288f));
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.055799913f));
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24016444f));
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.69315130f));
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
        return _mm512_scalef_ps(p, x);
    }
    static vec exp2_bf16p(vec x) {
        const vec f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
        vec p = _mm512_fmadd_ps(_mm512_set1_ps(0.013426689f), f, _mm512_set1_ps(0.052242465f));
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24128021f));
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.69304484f));
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
        return _mm512_scalef_ps(p, x);
    }
    static vec tanh(vec x) {  // 1 - 2 / (e^(2x) + 1): exact limits +-1, NaN kept
        const vec t = exp2(_mm512_mul_ps(x, _mm512_set1_ps(2.f * kLog2e)));
        return _mm512_sub_ps(_mm512_set1_ps(1.f), _mm512_div_ps(_mm512_set1_ps(2.f), _mm512_add_ps(t, _mm512_set1_ps(1.f))));
    }
    static vec mask_outside(vec x, vec kc, vec lo, vec hi, vec ninf) {
        const __mmask16 out = _mm512_cmp_ps_mask(kc, lo, _CMP_LT_OQ) | _mm512_cmp_ps_mask(kc, hi, _CMP_GT_OQ);
        return _mm512_mask_mov_ps(x, out, ninf);
    }
    static vec zero_where_ninf(vec m) {
        return _mm512_mask_mov_ps(m, _mm512_cmp_ps_mask(m, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ), _mm512_setzero_ps());
    }
    static bool any_gt(vec a, vec b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ) != 0; }
    static void load_row(float* dst, const void* src, int64_t n, int64_t stride, DType dt) {
        if (stride != 1 || dt == DType::f32) { load_row_scalar(dst, src, n, stride, dt); return; }
        const uint16_t* s = static_cast<const uint16_t*>(src);
        int64_t j = 0;
        for (; j + 16 <= n; j += 16) {
            const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + j));
            _mm512_storeu_ps(dst + j, dt == DType::f16 ? _mm512_cvtph_ps(h)
                                                         : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
        }
        if (j < n) load_row_scalar(dst + j, s + j, n - j, 1, dt);
    }
    // n floats from src to elements idx, idx + stride, ... of base (dtype dt): kernel.h's
    // store_row, 16 at a time for contiguous bf16 / fp16 with the same bits (round to nearest
    // even; a NaN becomes the scalar conversions' quiet NaN: bf16 (u >> 16) | 0x40, fp16
    // sign | 0x7e00).
    static void store_row(void* base, int64_t idx, int64_t stride, const float* src, int64_t n, DType dt) {
        if (stride != 1 || dt == DType::f32) { fa2cpu::store_row(base, idx, stride, src, n, dt); return; }
        uint16_t* d = static_cast<uint16_t*>(base) + idx;
        for (int64_t j = 0; j < n; j += 16) {
            const __mmask16 m = lanes_below(n - j);
            const __m512 x = _mm512_maskz_loadu_ps(m, src + j);
            const __m512i u = _mm512_castps_si512(x);
            const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
            __m256i h;
            if (dt == DType::bf16) {
                const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
                const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
                const __m512i q = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
                h = _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(r, nan, q));
            } else {
                const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x8000));
                const __m256i c = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                h = _mm256_mask_mov_epi16(c, nan, _mm512_cvtepi32_epi16(_mm512_or_si512(sign, _mm512_set1_epi32(0x7e00))));
            }
            _mm256_mask_storeu_epi16(d + j, m, h);
        }
    }
    // dst[i * ldd + j] = src[j * lds + i] for i, j < 16: a 16 x 16 float32 block transposed in
    // registers (backward_loop.h's panel <-> row copies; below transpose16x16_epi32).
    static void transpose16(const float* src, int64_t lds, float* dst, int64_t ldd);
};


// V512 with 4 x 6 register blocking (RV x NK = RV x ND = 4 x 6: 24 accumulators, 4 row loads and
// one broadcast, 29 of 32 zmm) for the amx family's float32 routes, forward and backward. AMX
// CPUs are Intel's, where 4 x 6 measured as fast or faster than 6 x 4 (session 36, in-process
// A/B, same bits: 2-core Xeon with AMX, causal forward 1.02-1.06x at 2 threads, full forward and
// backward within +-3 %; AMX test machine at 16 threads, forward 1.02-1.07x, backward 1.04-1.07x,
// one thread within +-2 %; bench/tools/f32_micro_bench.cpp 81-87 against 80-82 % of its FMA
// loop). Zen 5 preferred 6 x 4 (fewer broadcasts per FMA), so the avx512 and avx512bf16
// families, which AMD CPUs run, keep V512.
struct V512x46 : V512 {
    static constexpr int RV = 4, NK = 6, ND = 6;
};

// In-register transpose of a 16 x 16 matrix of 32-bit elements: r[i] holds row i on entry and
// column i on return. Three stages: 32-bit and 64-bit unpacks within 128-bit lanes, then two
// rounds of 128-bit lane shuffles (0x88 takes lanes 0,2 of each source, 0xdd lanes 1,3).
inline void transpose16x16_epi32(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    // u[4g + k] holds columns {k, 4+k, 8+k, 12+k} (one per 128-bit lane) of rows 4g..4g+3
    for (int g = 0; g < 4; ++g) {
        u[4 * g + 0] = _mm512_unpacklo_epi64(t[4 * g + 0], t[4 * g + 2]);
        u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g + 0], t[4 * g + 2]);
        u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
        u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
    }
    // t[2k] = columns {k, 8+k} of rows 0..7, t[2k+1] = columns {4+k, 12+k} of rows 0..7; same for rows 8..15 in t[8+..]
    for (int k = 0; k < 4; ++k) {
        t[2 * k] = _mm512_shuffle_i32x4(u[k], u[4 + k], 0x88);
        t[2 * k + 1] = _mm512_shuffle_i32x4(u[k], u[4 + k], 0xdd);
        t[8 + 2 * k] = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0x88);
        t[8 + 2 * k + 1] = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0xdd);
    }
    for (int k = 0; k < 4; ++k) {
        r[k] = _mm512_shuffle_i32x4(t[2 * k], t[8 + 2 * k], 0x88);           // column k
        r[8 + k] = _mm512_shuffle_i32x4(t[2 * k], t[8 + 2 * k], 0xdd);       // column 8+k
        r[4 + k] = _mm512_shuffle_i32x4(t[2 * k + 1], t[8 + 2 * k + 1], 0x88);   // column 4+k
        r[12 + k] = _mm512_shuffle_i32x4(t[2 * k + 1], t[8 + 2 * k + 1], 0xdd);  // column 12+k
    }
}

// dst[d * ldd + c] = src[c * lds + d] for keys c < keys and features d < D, 16-bit elements
// (bf16 K rows -> K^T of the backward's dQ product; lds even): 16 keys x 32 features at a time as a
// 16 x 16 transpose of feature pairs, each pair then split into its two features' rows; the
// features past the last whole 32 and the last keys % 16 keys one by one. (Written element by
// element, K^T cost ~1.4 % of a 2-thread AMX backward and ~1 % of a 1-thread avx512bf16 one.)
inline void transpose_bf16_rows(const uint16_t* src, int64_t lds, int64_t keys, int64_t D, uint16_t* dst, int64_t ldd) {
    const uint32_t* s32 = reinterpret_cast<const uint32_t*>(src);
    const int64_t d32 = D / 32 * 32;
    int64_t c0 = 0;
    for (; c0 + 16 <= keys; c0 += 16) {
        for (int64_t t0 = 0; 2 * t0 < d32; t0 += 16) {
            __m512i r[16];
            for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(s32 + (c0 + i) * (lds / 2) + t0);
            transpose16x16_epi32(r);  // r[i]: the feature pair t0 + i of keys c0 .. c0 + 15
            for (int i = 0; i < 16; ++i) {
                uint16_t* even = dst + 2 * (t0 + i) * ldd + c0;
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(even), _mm512_cvtepi32_epi16(r[i]));
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(even + ldd), _mm512_cvtepi32_epi16(_mm512_srli_epi32(r[i], 16)));
            }
        }
        for (int64_t d = d32; d < D; ++d)
            for (int64_t c = c0; c < c0 + 16; ++c) dst[d * ldd + c] = src[c * lds + d];
    }
    for (int64_t c = c0; c < keys; ++c)
        for (int64_t d = 0; d < D; ++d) dst[d * ldd + c] = src[c * lds + d];
}

inline void V512::transpose16(const float* src, int64_t lds, float* dst, int64_t ldd) {
    __m512i r[16];
    for (int j = 0; j < 16; ++j) r[j] = _mm512_castps_si512(_mm512_loadu_ps(src + j * lds));
    transpose16x16_epi32(r);
    for (int i = 0; i < 16; ++i) _mm512_storeu_ps(dst + i * ldd, _mm512_castsi512_ps(r[i]));
}

}  // namespace
}  // namespace fa2cpu
