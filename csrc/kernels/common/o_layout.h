#pragma once
#include "kernel.h"

namespace fa2cpu {
namespace {

// The O accumulator layout of the "rows in lanes" GEMM policies: O^T [o_rows][M], row r's column
// j at o[j*M + r]; a policy inherits it (or provides the same four functions for another layout).
template <class V>
struct TransposedO {
    static int64_t o_rows(int64_t Dv) { return Dv; }
    static int64_t o_floats(int64_t Dv, int64_t M) { return Dv * M; }
    static float o_elem(const float* o, int64_t M, int64_t, int64_t r, int64_t j) { return o[j * M + r]; }
    static void rescale_o(float* o, int64_t M, int64_t Dv, int64_t r, typename V::vec alpha) {
        for (int64_t j = 0; j < Dv; ++j) V::store(o + j * M + r, V::mul(V::load(o + j * M + r), alpha));
    }
};

}  // namespace
}  // namespace fa2cpu
