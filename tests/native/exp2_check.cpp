// Native check of V512::exp2 and exp2_bf16p (the AVX-512 families' softmax exponentials): relative
// error against std::exp2 in double over [-140, 10] (2.9 M points, results above the float32
// normal range's bottom) within the bounds vec_avx512.h states (1.6e-7 and 3.0e-6, checked at
// 2e-7 and 3.2e-6), and the exact special values the tile loops rely on: exp2(0) = 1,
// exp2(-inf) = 0, exp2(+inf) = inf, NaN stays NaN, underflow to 0, overflow to inf. Built and run
// by tests/test_native.py on any AVX-512 machine.
#include <cmath>
#include <cstdio>

#include "kernels/common/vec_avx512.h"

int main() {
    using namespace fa2cpu;
    double worst = 0, worst_bf16p = 0;
    alignas(64) float in[16], e[16], eb[16];
    for (double x0 = -140; x0 <= 10; x0 += 0.000731) {
        for (int i = 0; i < 16; ++i) in[i] = float(x0 + i * 0.0000457);
        V512::store(e, V512::exp2(V512::load(in)));
        V512::store(eb, V512::exp2_bf16p(V512::load(in)));
        for (int i = 0; i < 16; ++i) {
            const double ref = std::exp2(double(in[i]));
            if (ref < 1.2e-38) continue;  // float32 subnormal results: absolute, not relative, accuracy
            worst = std::fmax(worst, std::fabs(e[i] / ref - 1));
            worst_bf16p = std::fmax(worst_bf16p, std::fabs(eb[i] / ref - 1));
        }
    }
    int bad = worst > 2e-7 || worst_bf16p > 3.2e-6;
    alignas(64) const float x[8] = {0.f, -0.f, -INFINITY, INFINITY, NAN, -1e30f, 200.f, -1.f};
    alignas(64) const float want[8] = {1.f, 1.f, 0.f, INFINITY, NAN, 0.f, INFINITY, 0.5f};
    alignas(64) float v[16] = {}, r[16], rb[16];
    for (int i = 0; i < 8; ++i) v[i] = x[i];
    V512::store(r, V512::exp2(V512::load(v)));
    V512::store(rb, V512::exp2_bf16p(V512::load(v)));
    for (int i = 0; i < 8; ++i) {
        const bool ok = std::isnan(want[i]) ? std::isnan(r[i]) && std::isnan(rb[i]) : r[i] == want[i] && rb[i] == want[i];
        if (!ok) std::printf("exp2(%g) = %g, exp2_bf16p = %g, want %g\n", x[i], r[i], rb[i], want[i]);
        bad += !ok;
    }
    std::printf("%s: max relative error exp2 %.3g, exp2_bf16p %.3g\n", bad ? "FAIL" : "ok", worst, worst_bf16p);
    return bad != 0;
}
