// Family "avx512": AVX-512F/BW/VL/DQ + FMA, float32 micro-kernels with 16 rows per vector
// (vector traits and blocking in common/vec_avx512.h). Routes: the AVX-512 decode route (<= 16
// rows per kv head, gemm_decode.h), then the float32 tile loop for everything (bf16/fp16 inputs
// are converted to float32 while packing). Built with the flags of its catalogue.def row.
#include "common/gemm_decode.h"
#include "common/gemm_f32.h"
#include "common/probe.h"
#include "common/routes.h"
#include "common/tile_loop.h"
#include "common/vec_avx512.h"

namespace fa2cpu {
namespace {
double peak(int, double seconds) { return fma_peak_gflops<V512>(seconds); }
}  // namespace

extern const KernelTable kTable_avx512 =
    make_table(&peak, BackwardRoute<BackwardLoop<V512>>(),
               Avx512DecodeRoute::route("decode"), TileRoute<TileLoop<V512, F32Gemm<V512>>>::route("f32"));

}  // namespace fa2cpu
