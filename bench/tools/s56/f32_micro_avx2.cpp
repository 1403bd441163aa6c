// Throwaway harness (session 56): the avx2 family's float32 micro-kernels alone, flops per TSC tick, best of 5.
//   g++ -O3 -mavx2 -mfma -mf16c -fopenmp -Icsrc -Icsrc/include -Icsrc/kernels bench/tools/s56/f32_micro_avx2.cpp csrc/dispatch/cpu_features.cpp -o /tmp/mk && /tmp/mk
// Peak in flop/tick = the probe's GFLOP/s / the TSC GHz. Inlined into main, GCC folds pv's dS loads into FMAs: read pv with care.
// micro-kernel rates on V256: flops per TSC tick vs the FMA probe
#include "../../../csrc/kernels/avx2.cpp"
#include <x86intrin.h>
#include <cstdio>
#include <cstdlib>
using namespace fa2cpu;
using G = F32Gemm<V256>;
using P = F32Products<V256>;
static float* A(size_t n) { float* p = (float*)aligned_alloc(64, n * 4 + 64); for (size_t i = 0; i < n; ++i) p[i] = (i % 7) * 0.01f; return p; }
int main(int argc, char** argv) {
    const int64_t D = 128, RB = 16, BC = 128, lq = 144, reps = 2000;
    float *qT = A(D * 128), *kall = A(BC * lq), *s = A(8 * BC * RB), *dq = A(D * 128), *acc = A(BC * lq), *xr = A(128 * lq);
    // fma peak: register-only loop ticks
    double best[4] = {1e30, 1e30, 1e30, 1e30};
    for (int t = 0; t < 5; ++t) {
        uint64_t a = __rdtsc();
        for (int r = 0; r < reps; ++r) G::qk_nv<kMaxHeadDim>(2, qT, RB, kall, lq, D, BC, s);  // S^T for one row block, 128 keys
        uint64_t b = __rdtsc();
        for (int r = 0; r < reps; ++r) G::pv_nv(2, s, BC, kall, lq, D, dq, RB);  // dQ^T += K^T dS^T, one row block
        uint64_t c = __rdtsc();
        for (int r = 0; r < reps / 8; ++r) P::tn(BC, 128, s, xr, lq, D / 8, acc, lq);  // dV += P^T dO over 128 rows
        uint64_t d = __rdtsc();
        double f = 2.0 * 16 * 128 * D * reps;
        best[0] = std::min(best[0], (b - a) / f); best[1] = std::min(best[1], (c - b) / f); best[2] = std::min(best[2], (d - c) / (2.0 * BC * 128 * D * (reps / 8)));
    }
    printf("probe %.1f GFLOP/s\n", fa2cpu::peak(1, 0.3));
    printf("qk  %.2f flop/tick\npv  %.2f flop/tick\ntn  %.2f flop/tick\n", 1 / best[0], 1 / best[1], 1 / best[2]);
}
