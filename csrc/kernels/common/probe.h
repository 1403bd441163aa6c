// Peak probe: how many multiply-adds per second one thread retires with the family's vector FMA.
// CHAINS independent accumulators hide the FMA latency (2 FMA pipes x 4 cycles = 8; 12 for margin).
#pragma once
#include <chrono>

namespace fa2cpu {
namespace {

template <class V, int CHAINS = 12>
double fma_peak_gflops(double seconds) {
    using vec = typename V::vec;
    vec acc[CHAINS];
    for (int c = 0; c < CHAINS; ++c) acc[c] = V::set1(float(c) * 1e-3f);
    const vec a = V::set1(0.999999f), b = V::set1(1e-7f);
    const int64_t inner = 1 << 14;
    int64_t iters = 0;
    const auto t0 = std::chrono::steady_clock::now();
    double el = 0;
    do {
        for (int64_t i = 0; i < inner; ++i)
#pragma GCC unroll 16
            for (int c = 0; c < CHAINS; ++c) acc[c] = V::fma(acc[c], a, b);
        iters += inner;
        el = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    } while (el < seconds);
    float sink[V::W];
    vec t = acc[0];
    for (int c = 1; c < CHAINS; ++c) t = V::add(t, acc[c]);
    V::store(sink, t);
    volatile float keep = sink[0];
    (void)keep;
    return 2.0 * V::W * CHAINS * double(iters) / el * 1e-9;
}

}  // namespace
}  // namespace fa2cpu
