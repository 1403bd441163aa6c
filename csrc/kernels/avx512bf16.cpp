// Family "avx512bf16": AVX-512 + AVX512_BF16. bfloat16 inputs run the vdpbf16ps micro-kernels
// (common/gemm_bf16.h); float32 and float16 inputs run the float32 AVX-512 kernels (float16 is
// converted to float32 while packing, so its products keep float32 accuracy).
// Built with the avx512 flags plus -mavx512bf16 (setup.py).
#include <chrono>

#include "common/gemm_bf16.h"
#include "common/gemm_decode.h"
#include "common/probe.h"
#include "common/tile_loop.h"
#include "common/vec_avx512.h"

namespace fa2cpu {
namespace {

using LoopF32 = TileLoop<V512, F32Gemm<V512>>;
using LoopBf16 = TileLoop<V512, Bf16Gemm<V512>>;

int64_t scratch_floats(const Params& p, int64_t rows) {
    const int64_t a = DType(p.dtype) == DType::bf16 ? LoopBf16::scratch_floats(p, rows) : LoopF32::scratch_floats(p, rows);
    const int64_t b = decode_scratch_floats(p, rows);
    return a > b ? a : b;
}
void run_item(const Params& p, const WorkItem& it, float* scratch, Partials parts) {
    if (is_decode_item(it)) run_decode_item(p, it, scratch, parts);
    else if (DType(p.dtype) == DType::bf16) LoopBf16::run_item(p, it, scratch, parts);
    else LoopF32::run_item(p, it, scratch, parts);
}

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

extern const KernelTable kTableAvx512bf16 =
    KernelTable{Isa::avx512bf16, V512::MAX_ROWS, V512::BC, DecodeGemm<F32Elem>::kRowsPerHead, DecodeGemm<F32Elem>::kMaxRows, &scratch_floats, &run_item, &peak};

}  // namespace fa2cpu
