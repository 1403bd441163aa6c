// Family "avx512": AVX-512F/BW/VL/DQ + FMA, float32 micro-kernels with 16 rows per vector
// (vector traits and blocking in common/vec_avx512.h). bf16/fp16 inputs are converted to float32
// while packing. Built with -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma -mf16c (setup.py).
#include "common/probe.h"
#include "common/tile_loop.h"
#include "common/vec_avx512.h"

namespace fa2cpu {
namespace {

double peak(int, double seconds) { return fma_peak_gflops<V512>(seconds); }

}  // namespace

extern const KernelTable kTableAvx512 = make_table<V512, F32Gemm<V512>>(Isa::avx512, &peak);

}  // namespace fa2cpu
