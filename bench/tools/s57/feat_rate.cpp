// dV-shaped PairGemm rates (backward_bf16.h) on this core: a = row pairs [T][lda] (4-byte pairs),
// b = P^T [keys][ldb] bf16, out = dvall [NK][ldo] float32 accumulated, keys in 128-key tiles.
// args: T lda ldb NK ldo chunk(0: run_features, else NV for run<true> over all vectors)
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include "../../../csrc/kernels/common/backward_bf16.h"
using namespace fa2cpu;
static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
int main(int argc, char** argv) {
    const int64_t T = atoi(argv[1]), lda = atoi(argv[2]), ldb = atoi(argv[3]), NK = atoi(argv[4]), ldo = atoi(argv[5]);
    const int64_t BC = 128, F = 128;
    std::vector<uint32_t> a(T * lda, 0x3f803f80u);
    std::vector<uint16_t> b(BC * ldb, 0x3f80);
    std::vector<float> out(NK * ldo + 64);
    const double flops = 2.0 * BC * 2 * T * F * (NK / BC);
    double best = 0;
    for (int r = 0; r < 9; ++r) {
        double t0 = now();
        for (int i = 0; i < 20; ++i)
            for (int64_t ck = 0; ck < NK; ck += BC) PairGemm::run_features(F / 16, BC, a.data(), lda, b.data(), ldb, T, out.data() + ck * ldo, ldo);
        double t = now() - t0;
        best = std::max(best, 20 * flops / t * 1e-9);
    }
    printf("T=%ld lda=%ld ldb=%ld NK=%ld ldo=%ld: %.1f GFLOP/s\n", (long)T, (long)lda, (long)ldb, (long)NK, (long)ldo, best);
}
