// Family "avx2": AVX2 + FMA (+F16C), float32 micro-kernels with 8 rows per vector. Routes: the
// AVX2 decode route (<= 16 rows per kv head, gemm_decode_avx2.h), then the float32 tile loop.
// Built with -mavx2 -mfma -mf16c (setup.py, per file).
//
// Register blocking (tile_loop.h): RV x NK = 2 x 6 = 12 ymm accumulators, 2 row loads and one
// broadcast register: 15 of the 16 ymm registers.
#include <immintrin.h>

#include "common/gemm_decode_avx2.h"
#include "common/gemm_f32.h"
#include "common/probe.h"
#include "common/routes.h"
#include "common/tile_loop.h"
#include "common/vecmath.h"

namespace fa2cpu {
namespace {

struct V256 {
    using vec = __m256;
    static constexpr int W = 8, RV = 2, NK = 6, ND = 6;
    static constexpr int64_t BC = 128, MAX_ROWS = 128;
    // One reduction pass per product (gemm_f32.h): a 16-row block's Q^T / P slices fit L1 whole.
    static constexpr int64_t DC = kMaxHeadDim, CC = BC;

    static vec zero() { return _mm256_setzero_ps(); }
    static vec set1(float a) { return _mm256_set1_ps(a); }
    static vec load(const float* p) { return _mm256_loadu_ps(p); }
    static void store(float* p, vec a) { _mm256_storeu_ps(p, a); }
    static vec fma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
    static vec add(vec a, vec b) { return _mm256_add_ps(a, b); }
    static vec sub(vec a, vec b) { return _mm256_sub_ps(a, b); }
    static vec mul(vec a, vec b) { return _mm256_mul_ps(a, b); }
    static vec max(vec a, vec b) { return _mm256_max_ps(a, b); }
    static vec abs(vec a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), a); }
    static vec exp2(vec x) {
        // Clamp keeps 2^n a normal float or exactly 0 (n = -127 gives a zero exponent field);
        // vmaxps/vminps return the second operand when either is NaN: x stays NaN.
        x = _mm256_min_ps(_mm256_set1_ps(127.f), _mm256_max_ps(_mm256_set1_ps(-127.f), x));
        const vec n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const vec f = _mm256_sub_ps(x, n);
        vec p = _mm256_set1_ps(kExp2C[6]);
        for (int i = 5; i >= 0; --i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2C[i]));
        const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
        return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
    }
    static vec tanh(vec x) {
        const vec t = exp2(_mm256_mul_ps(x, _mm256_set1_ps(2.f * kLog2e)));
        return _mm256_sub_ps(_mm256_set1_ps(1.f), _mm256_div_ps(_mm256_set1_ps(2.f), _mm256_add_ps(t, _mm256_set1_ps(1.f))));
    }
    static vec mask_outside(vec x, vec kc, vec lo, vec hi, vec ninf) {
        const vec out = _mm256_or_ps(_mm256_cmp_ps(kc, lo, _CMP_LT_OQ), _mm256_cmp_ps(kc, hi, _CMP_GT_OQ));
        return _mm256_blendv_ps(x, ninf, out);
    }
    static vec zero_where_ninf(vec m) {
        return _mm256_blendv_ps(m, _mm256_setzero_ps(), _mm256_cmp_ps(m, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ));
    }
    static bool any_gt(vec a, vec b) { return _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_GT_OQ)) != 0; }
    static void load_row(float* dst, const void* src, int64_t n, int64_t stride, DType dt) {
        if (stride != 1 || dt == DType::f32) { load_row_scalar(dst, src, n, stride, dt); return; }
        const uint16_t* s = static_cast<const uint16_t*>(src);
        int64_t j = 0;
        for (; j + 8 <= n; j += 8) {
            const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + j));
            _mm256_storeu_ps(dst + j, dt == DType::f16 ? _mm256_cvtph_ps(h)
                                                         : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
        }
        if (j < n) load_row_scalar(dst + j, s + j, n - j, 1, dt);
    }
    // n floats from src to elements idx, idx + stride, ... of base (dtype dt): kernel.h's
    // store_row, 8 at a time for contiguous bf16 / fp16 with the same bits (round to nearest
    // even; a NaN becomes the scalar conversions' quiet NaN: bf16 (u >> 16) | 0x40, fp16
    // sign | 0x7e00); the last n % 8 by the scalar code. Scalar, these stores were ~40 % of a
    // bf16 call of 16 rows and keys per head on Zen 1 (bench/RESULTS.md, session 45).
    static void store_row(void* base, int64_t idx, int64_t stride, const float* src, int64_t n, DType dt) {
        if (stride != 1 || dt == DType::f32) { fa2cpu::store_row(base, idx, stride, src, n, dt); return; }
        uint16_t* d = static_cast<uint16_t*>(base) + idx;
        int64_t j = 0;
        for (; j + 8 <= n; j += 8) {
            const __m256 x = _mm256_loadu_ps(src + j);
            const __m256i u = _mm256_castps_si256(x);
            const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
            const __m256i hi = _mm256_srli_epi32(u, 16);
            __m256i w;  // the 8 results as dwords < 2^16
            if (dt == DType::bf16) {
                const __m256i lsb = _mm256_and_si256(hi, _mm256_set1_epi32(1));
                const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
                w = _mm256_blendv_epi8(r, _mm256_or_si256(hi, _mm256_set1_epi32(0x40)), nan);
            } else {
                const __m256i c = _mm256_cvtepu16_epi32(_mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
                w = _mm256_blendv_epi8(c, _mm256_or_si256(_mm256_and_si256(hi, _mm256_set1_epi32(0x8000)), _mm256_set1_epi32(0x7e00)), nan);
            }
            const __m128i h = _mm_packus_epi32(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
            _mm_storeu_si128(reinterpret_cast<__m128i*>(d + j), h);
        }
        if (j < n) fa2cpu::store_row(base, idx + j, 1, src + j, n - j, dt);
    }
    // dst[i * ldd + j] = src[j * lds + i] for i, j < 16 (policy.h transpose16: the forward's Q
    // packing and output rows, the backward's panel <-> row copies), as four 8 x 8 transposes in
    // registers.
    static void transpose16(const float* src, int64_t lds, float* dst, int64_t ldd) {
        for (int a = 0; a < 16; a += 8)
            for (int b = 0; b < 16; b += 8) transpose8(src + b * lds + a, lds, dst + a * ldd + b, ldd);
    }
    // dst[i * ldd + j] = src[j * lds + i] for i, j < 8: 32-bit unpacks, 64-bit shuffles within
    // 128-bit lanes, then the lanes exchanged (row k's low half meets row k+4's).
    static void transpose8(const float* src, int64_t lds, float* dst, int64_t ldd) {
        __m256 r[8], t[8];
        for (int j = 0; j < 8; ++j) r[j] = _mm256_loadu_ps(src + j * lds);
        for (int j = 0; j < 8; j += 2) {
            t[j] = _mm256_unpacklo_ps(r[j], r[j + 1]);      // per lane: r_j0 r_j+1,0 r_j1 r_j+1,1
            t[j + 1] = _mm256_unpackhi_ps(r[j], r[j + 1]);  // per lane: r_j2 r_j+1,2 r_j3 r_j+1,3
        }
        for (int g = 0; g < 8; g += 4) {  // r[g + k]: column k (and 4 + k in the high lane) of rows g..g+3
            r[g + 0] = _mm256_shuffle_ps(t[g], t[g + 2], 0x44);
            r[g + 1] = _mm256_shuffle_ps(t[g], t[g + 2], 0xee);
            r[g + 2] = _mm256_shuffle_ps(t[g + 1], t[g + 3], 0x44);
            r[g + 3] = _mm256_shuffle_ps(t[g + 1], t[g + 3], 0xee);
        }
        for (int k = 0; k < 4; ++k) {
            _mm256_storeu_ps(dst + k * ldd, _mm256_permute2f128_ps(r[k], r[4 + k], 0x20));
            _mm256_storeu_ps(dst + (4 + k) * ldd, _mm256_permute2f128_ps(r[k], r[4 + k], 0x31));
        }
    }
};

double peak(int, double seconds) { return fma_peak_gflops<V256>(seconds); }

}  // namespace

extern const KernelTable kTable_avx2 =
    make_table(&peak, BackwardRoute<BackwardLoop<V256>>(), Avx2DecodeRoute<V256>::route("decode"),
               TileRoute<TileLoop<V256, F32Gemm<V256>>>::route("f32"));

}  // namespace fa2cpu
