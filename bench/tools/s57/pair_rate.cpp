// Rates of backward_bf16.h's PairGemm at the shapes Bf16Products runs (D = 128, RB = 96, BC = 128):
// scores S^T (run<false>, 6 x 4), dV (run_features, 4 x 6 over 8 feature vectors), dQ^T (run<true>).
// Build: g++ -O3 -std=c++17 -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma -mf16c -mavx512bf16
//        -mavx512vnni -I../../../csrc -I../../../csrc/include pair_rate.cpp -o /tmp/pair_rate
#include <chrono>
#include <cstdio>
#include <vector>
#include "../../../csrc/kernels/common/backward_bf16.h"
using namespace fa2cpu;
static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
template <class F> double rate(double flops, F f) {
    double best = 0;
    for (int r = 0; r < 7; ++r) {
        const int n = 200;
        double t0 = now();
        for (int i = 0; i < n; ++i) f();
        double t = now() - t0;
        best = std::max(best, flops * n / t * 1e-9);
    }
    return best;
}
int main(int argc, char** argv) {
    const int64_t RB = 96, BC = 128, D = 128, GR = 192, ldo = 128, d2 = 64;
    const int64_t pad = argc > 1 ? atoi(argv[1]) : 0;  // extra uint32 per row of dorp / dvall
    std::vector<uint32_t> qp(d2 * GR, 0x3f803f80u), dorp(GR / 2 * (ldo + pad), 0x3f803f80u), dsp(BC / 2 * RB, 0x3f803f80u);
    std::vector<uint16_t> kb(BC * 2 * d2, 0x3f80), pT(BC * RB, 0x3f80), kT(D * (BC + 2), 0x3f80);
    std::vector<float> s(BC * RB), dv(BC * (ldo + pad)), dqT(D * RB);
    double f = 2.0 * BC * RB * D;
    printf("scores 6x4 : %.1f GFLOP/s\n", rate(f, [&] { PairGemm::run<false>(6, BC, qp.data(), GR, kb.data(), 2 * d2, d2, false, s.data(), RB); }));
    printf("dV features: %.1f GFLOP/s (pad %ld)\n", rate(f, [&] { PairGemm::run_features(8, BC, dorp.data(), ldo + pad, pT.data(), RB, RB / 2, dv.data(), ldo + pad); }), (long)pad);
    // dV and dK of an item of 2048 keys: the accumulators (2 x 1 MB) stream from beyond L2.
    const int64_t NK = argc > 2 ? atoi(argv[2]) : 2048;
    std::vector<float> dvall(NK * (ldo + pad)), dkall(NK * (ldo + pad));
    std::vector<uint32_t> qrp(GR / 2 * (ldo + pad), 0x3f803f80u);
    std::vector<uint16_t> dsT(BC * RB, 0x3f80);
    printf("dV+dK over %ld keys: %.1f GFLOP/s\n", (long)NK, rate(2 * f * NK / BC, [&] {
        for (int64_t ck = 0; ck < NK; ck += BC) {
            PairGemm::run_features(8, BC, dorp.data(), ldo + pad, pT.data(), RB, RB / 2, dvall.data() + ck * (ldo + pad), ldo + pad);
            PairGemm::run_features(8, BC, qrp.data(), ldo + pad, dsT.data(), RB, RB / 2, dkall.data() + ck * (ldo + pad), ldo + pad);
        }
    }));
    printf("dQ^T 6x4   : %.1f GFLOP/s\n", rate(f, [&] { PairGemm::run<true>(6, D, dsp.data(), RB, kT.data(), BC + 2, BC / 2, false, dqT.data(), RB); }));
}
