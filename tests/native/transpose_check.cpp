// Native check of transpose16x16_epi32 (used by the AMX V packing, which only runs on AMX machines):
// built and run by tests/test_native.py on any AVX-512 machine.
#include <cstdio>

#include "kernels/common/vec_avx512.h"

int main() {
    using namespace fa2cpu;
    alignas(64) int in[16][16], out[16][16];
    for (int i = 0; i < 16; ++i)
        for (int j = 0; j < 16; ++j) in[i][j] = i * 100 + j;
    __m512i r[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_load_si512(in[i]);
    transpose16x16_epi32(r);
    for (int i = 0; i < 16; ++i) _mm512_store_si512(out[i], r[i]);
    int bad = 0;
    for (int i = 0; i < 16; ++i)
        for (int j = 0; j < 16; ++j) bad += out[i][j] != in[j][i];
    std::printf("%s: %d mismatches\n", bad ? "FAIL" : "ok", bad);
    return bad != 0;
}
