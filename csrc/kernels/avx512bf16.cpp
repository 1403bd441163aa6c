// Family "avx512bf16": AVX-512 + AVX512_BF16. Routes: the AVX-512 decode route (<= 16 rows per kv
// head, gemm_decode.h); bfloat16 inputs the vdpbf16ps micro-kernels (common/gemm_bf16.h); float32
// and float16 the float32 AVX-512 kernels (float16 is converted to float32 while packing, so its
// products keep float32 accuracy). Built with the flags of its catalogue.def row.
#include <chrono>

#include "common/backward_bf16.h"
#include "common/gemm_bf16.h"
#include "common/gemm_decode.h"
#include "common/gemm_f32.h"
#include "common/probe.h"
#include "common/routes.h"
#include "common/tile_loop.h"
#include "common/vec_avx512.h"

namespace fa2cpu {
namespace {

// vdpbf16ps peak: 12 independent accumulators, 64 flops (32 multiply-adds) per instruction.
double dpbf16_peak(double seconds) {
    __m512 acc[12];
    for (int c = 0; c < 12; ++c) acc[c] = _mm512_set1_ps(float(c));
    const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0x3380);
    int64_t iters = 0;
    const auto t0 = std::chrono::steady_clock::now();
    double el = 0;
    do {
        for (int i = 0; i < (1 << 14); ++i)
#pragma GCC unroll 12
            for (int c = 0; c < 12; ++c) acc[c] = _mm512_dpbf16_ps(acc[c], a, b);
        iters += 1 << 14;
        el = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    } while (el < seconds);
    __m512 t = acc[0];
    for (int c = 1; c < 12; ++c) t = _mm512_add_ps(t, acc[c]);
    volatile float keep = _mm512_reduce_add_ps(t);
    (void)keep;
    return 64.0 * 12 * double(iters) / el * 1e-9;
}

double peak(int dtype, double seconds) {
    return DType(dtype) == DType::bf16 ? dpbf16_peak(seconds) : fma_peak_gflops<V512>(seconds);
}

}  // namespace

extern const KernelTable kTable_avx512bf16 =
    make_table(&peak, BackwardRoute<Bf16Backward>(),
               Avx512DecodeRoute::route("decode"), TileRoute<TileLoop<V512, Bf16Gemm<V512>>, Bf16Input>::route("bf16"),
               TileRoute<TileLoop<V512, F32Gemm<V512>>>::route("f32"));

}  // namespace fa2cpu
