// Constants of the vectorised exp2 of the avx2 family (the AVX-512 families have vreduceps and
// vscalefps and their own fit on [0, 1]: vec_avx512.h).
//
// exp2(x) = 2^n * 2^f with n = round(x), f = x - n in [-0.5, 0.5]; 2^f = e^(f ln2) by its
// degree-6 Taylor polynomial: the first dropped term is (0.5 ln2)^7 / 7! = 1.2e-7 relative, at
// float32 rounding level, so no minimax fit is needed.
#pragma once

namespace fa2cpu {
namespace {
constexpr float kExp2C[7] = {1.0f, 0.693147180559945f, 0.240226506959101f, 0.0555041086648216f,
                             0.00961812910762848f, 0.00133335581464284f, 0.000154035303933816f};
}  // namespace
}  // namespace fa2cpu
