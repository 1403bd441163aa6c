// Family "avx512": AVX-512F/BW/VL/DQ + FMA, float32 micro-kernels with 16 rows per vector
// (vector traits and blocking in common/vec_avx512.h). bf16/fp16 inputs are converted to float32
// while packing. Built with -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma -mf16c (setup.py).
#include "common/gemm_decode.h"
#include "common/probe.h"
#include "common/tile_loop.h"
#include "common/vec_avx512.h"

namespace fa2cpu {
namespace {

using LoopF32 = TileLoop<V512, F32Gemm<V512>>;

int64_t scratch_floats(const Params& p, int64_t rows) {
    const int64_t a = LoopF32::scratch_floats(p, rows), b = decode_scratch_floats(p, rows);
    return a > b ? a : b;
}
void run_item(const Params& p, const WorkItem& it, float* scratch, Partials parts) {
    if (is_decode_item(it)) return run_decode_item(p, it, scratch, parts);
    LoopF32::run_item(p, it, scratch, parts);
}

double peak(int, double seconds) { return fma_peak_gflops<V512>(seconds); }

}  // namespace

extern const KernelTable kTableAvx512 = KernelTable{Isa::avx512, V512::MAX_ROWS, V512::BC, DecodeGemm<F32Elem>::kRowsPerHead, DecodeGemm<F32Elem>::kMaxRows, &scratch_floats, &run_item, &peak};

}  // namespace fa2cpu
