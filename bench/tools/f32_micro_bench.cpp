// fp32 QK micro-kernel shapes (gemm_f32.h qk_micro: NV row vectors x NKC keys, broadcast K elements)
// against a register-only FMA loop, flops per TSC tick, L1/L2-resident operands. Session 26.
//   g++ -O3 -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma bench/tools/f32_micro_bench.cpp -o /tmp/f32mk && /tmp/f32mk
#include <immintrin.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <x86intrin.h>
#include <initializer_list>
static double now() { return (double)__rdtsc(); }
template <int NV, int NKC>
__attribute__((noinline)) void micro(const float* qT, int64_t M, const float* kt, int64_t ldk, int64_t D, float* s, int64_t RB) {
    __m512 acc[NV][NKC];
    for (int v = 0; v < NV; ++v) for (int j = 0; j < NKC; ++j) acc[v][j] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; ++d) {
        __m512 q[NV];
#pragma GCC unroll 16
        for (int v = 0; v < NV; ++v) q[v] = _mm512_loadu_ps(qT + d * M + v * 16);
        const float* kd = kt + d;
#pragma GCC unroll 16
        for (int j = 0; j < NKC; ++j) {
            const __m512 kb = _mm512_set1_ps(kd[j * ldk]);
#pragma GCC unroll 16
            for (int v = 0; v < NV; ++v) acc[v][j] = _mm512_fmadd_ps(q[v], kb, acc[v][j]);
        }
    }
    for (int j = 0; j < NKC; ++j) for (int v = 0; v < NV; ++v) _mm512_storeu_ps(s + j * RB + v * 16, acc[v][j]);
}
template <int NV, int NKC>
double run(const char* name, float* qT, float* kt, float* s, int64_t M, int64_t nkeys, int64_t D, int reps, double peak) {
    double best = 1e30;
    for (int r = 0; r < reps; ++r) {
        double t0 = now();
        for (int it = 0; it < 200; ++it)
            for (int64_t c = 0; c + NKC <= nkeys; c += NKC) micro<NV, NKC>(qT, M, kt + c * 128, 128, D, s + c * NV * 16, NV * 16);
        double t = now() - t0; if (t < best) best = t;
    }
    double flops = 200.0 * (nkeys / NKC) * NKC * NV * 16 * 2 * D;
    printf("%-28s %6.1f flop/tsc  %5.1f %% of the FMA loop\n", name, flops / best, 100 * flops / best / peak);
    return flops / best;
}
int main() {
    // FMA peak: 24 independent register chains
    double best = 1e30;
    for (int r = 0; r < 5; ++r) {
        double t0 = now();
        for (long i = 0; i < 20000000; ++i)
            __asm__ volatile(
#define F(n) "vfmadd231ps %%zmm30, %%zmm31, %%zmm" #n "\n\t"
                F(0) F(1) F(2) F(3) F(4) F(5) F(6) F(7) F(8) F(9) F(10) F(11) F(12) F(13) F(14) F(15) F(16) F(17) F(18) F(19) F(20) F(21) F(22) F(23)
                ::: "xmm0","xmm1","xmm2","xmm3","xmm4","xmm5","xmm6","xmm7","xmm8","xmm9","xmm10","xmm11","xmm12","xmm13","xmm14","xmm15","xmm16","xmm17","xmm18","xmm19","xmm20","xmm21","xmm22","xmm23");
        double t = now() - t0; if (t < best) best = t;
    }
    double peak = 20000000.0 * 24 * 32 / best;
    printf("FMA loop: %.1f flop per TSC tick\n", peak);
    const int64_t M = 192, D = 64;
    for (int64_t nkeys : {int64_t(128), int64_t(16)}) {
        float* qT = (float*)aligned_alloc(64, M * 128 * 4);
        float* kt = (float*)aligned_alloc(64, 256 * 128 * 4);
        float* s = (float*)aligned_alloc(64, 256 * 192 * 4);
        for (int i = 0; i < M * 128; ++i) qT[i] = 1e-3f * (i % 7);
        for (int i = 0; i < 256 * 128; ++i) kt[i] = 1e-3f * (i % 5);
        printf("-- %ld keys per pass (K slice %ld KB), Q slice %ld KB\n", nkeys, nkeys * D * 4 / 1024, D * 96 * 4 / 1024);
        run<6, 4>("6x4 (current)", qT, kt, s, M, nkeys, D, 5, peak);
        run<4, 6>("4x6", qT, kt, s, M, nkeys, D, 5, peak);
        run<8, 3>("8x3", qT, kt, s, M, nkeys, D, 5, peak);
    }
}
