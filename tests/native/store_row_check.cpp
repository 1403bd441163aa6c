// Native check of V512::store_row (the AVX-512 families' output rows) against kernel.h's scalar
// store_row: every bf16 / fp16 bit the same for random rows of 1-70 floats drawn from the cases
// that decide a conversion (NaNs with payloads, infinities, fp16 overflow near 65520, fp16
// subnormals, wide-range normals), and nothing written outside the row. Built and run by
// tests/test_native.py on any AVX-512 machine.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>

#include "kernels/common/vec_avx512.h"

namespace {

float from_bits(uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

float draw(std::mt19937& g) {
    const float sign = g() % 2 ? -1.f : 1.f;
    switch (g() % 8) {
    case 0: return std::ldexp(float(int(g() % 2000) - 1000), int(g() % 60) - 40);           // normals, ties
    case 1: return from_bits((g() & 0x80000000u) | 0x7f800000u | (g() % 4 ? g() & 0x7fffffu : 0));  // NaN / inf
    case 2: return sign * (65504.f + float(g() % 40));                                       // fp16 overflow edge
    case 3: return sign * std::ldexp(1.f + float(g() % 1024) / 1024.f, -int(g() % 20) - 14); // fp16 subnormals
    default: return from_bits(uint32_t(g()));                                                // any bits
    }
}

}  // namespace

int main() {
    using namespace fa2cpu;
    std::mt19937 g(1);
    constexpr int kPad = 3, kLen = 80;
    long bad = 0, total = 0;
    for (int trial = 0; trial < 50000; ++trial) {
        const int n = 1 + int(g() % 70);
        float src[kLen];
        for (int j = 0; j < n; ++j) src[j] = draw(g);
        for (DType dt : {DType::bf16, DType::f16}) {
            uint16_t want[kLen], got[kLen];
            std::memset(want, 0xab, sizeof want);
            std::memset(got, 0xab, sizeof got);
            store_row(want, kPad, 1, src, n, dt);
            V512::store_row(got, kPad, 1, src, n, dt);
            for (int j = 0; j < kLen; ++j, ++total) {
                if (want[j] == got[j]) continue;
                if (bad++ < 10)
                    std::printf("dtype %d, row of %d, element %d: scalar %04x, V512 %04x\n", int(dt), n, j - kPad, want[j], got[j]);
            }
        }
    }
    std::printf("%s: %ld of %ld outputs differ\n", bad ? "FAIL" : "ok", bad, total);
    return bad != 0;
}
