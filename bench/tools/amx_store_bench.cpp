// What tile stores cost the AMX products (session 36): 2 x 2 C-tile blocks of tdpbf16ps over
// `depth` 32-element steps with every operand in L1 (8 A and 8 B tiles, 16 KB), C zeroed (QK
// shape) or loaded (PV shape) at a block's start and stored at its end into a score-block-like
// buffer (384-byte rows, like the forward's 96-row S). One core; AMX CPUs only.
//
//   g++ -O2 -mamx-tile -mamx-bf16 -mavx512f bench/tools/amx_store_bench.cpp -o /tmp/amx_store
//   /tmp/amx_store [core/TSC clock ratio, default 1.44]
//
// Variants: stores after the block (as amx.cpp's qk), no stores (timing only), each store right
// after its tile's last tdpbf16ps, 2 x 1 blocks alternating between C tiles {0,1} and {2,3} (one
// set's stores beside the other set's products; 3 tile loads per 2 products), and the PV shape
// (C tiles loaded and stored). Figures: TSC cycles per tdpbf16ps and % of its 16-core-cycle rate.
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <x86intrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>

#include "../../csrc/kernels/common/amx_tiles.h"  // configure_full_tiles: the kernels' configuration
alignas(64) static uint16_t A[8][512], B[8][512];
alignas(64) static float S[32 * 96];

#define STEP(st)                                                                                        \
    _tile_loadd(4, A[(2 * (st)) & 7], 64); _tile_loadd(5, A[(2 * (st) + 1) & 7], 64);                  \
    _tile_loadd(6, B[(2 * (st)) & 7], 64); _tile_loadd(7, B[(2 * (st) + 1) & 7], 64)

enum Variant { kAfter, kNone, kInterleaved, kLoadStore };
template <int V>
__attribute__((noinline)) int64_t blocks(int64_t n, int depth) {
    for (int64_t i = 0; i < n; ++i) {
        if (V == kLoadStore) {
            _tile_loadd(0, S, 384); _tile_loadd(1, S + 16, 384); _tile_loadd(2, S + 16 * 96, 384); _tile_loadd(3, S + 16 * 96 + 16, 384);
        } else {
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        }
        const int full = V == kInterleaved ? depth - 1 : depth;
        for (int st = 0; st < full; ++st) {
            STEP(st);
            _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
        }
        if (V == kInterleaved) {
            STEP(full);
            _tile_dpbf16ps(0, 4, 6); _tile_stored(0, S, 384);
            _tile_dpbf16ps(1, 4, 7); _tile_stored(1, S + 16, 384);
            _tile_dpbf16ps(2, 5, 6); _tile_stored(2, S + 16 * 96, 384);
            _tile_dpbf16ps(3, 5, 7); _tile_stored(3, S + 16 * 96 + 16, 384);
        } else if (V != kNone) {
            _tile_stored(0, S, 384); _tile_stored(1, S + 16, 384); _tile_stored(2, S + 16 * 96, 384); _tile_stored(3, S + 16 * 96 + 16, 384);
        }
    }
    return n * 4 * depth;
}

// 2 x 1 blocks, C tiles {0,1} and {2,3} in turn.
__attribute__((noinline)) int64_t alternating(int64_t n, int depth) {
    for (int64_t i = 0; i < n; ++i) {
        const int c0 = (i & 1) ? 2 : 0, b = (i & 1) ? 7 : 6;
        if (c0 == 0) { _tile_zero(0); _tile_zero(1); } else { _tile_zero(2); _tile_zero(3); }
        for (int st = 0; st < depth; ++st) {
            _tile_loadd(4, A[(2 * st) & 7], 64); _tile_loadd(5, A[(2 * st + 1) & 7], 64);
            if (b == 6) {
                _tile_loadd(6, B[(2 * st) & 7], 64);
                _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 5, 6);
            } else {
                _tile_loadd(7, B[(2 * st) & 7], 64);
                _tile_dpbf16ps(2, 4, 7); _tile_dpbf16ps(3, 5, 7);
            }
        }
        if (c0 == 0) { _tile_stored(0, S, 384); _tile_stored(1, S + 16 * 96, 384); }
        else { _tile_stored(2, S + 16, 384); _tile_stored(3, S + 16 * 96 + 16, 384); }
    }
    return n * 2 * depth;
}

int main(int argc, char** argv) {
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) != 0) {
        std::puts("no AMX permission");
        return 1;
    }
    fa2cpu::configure_full_tiles();
    for (int i = 0; i < 8; ++i)
        for (int j = 0; j < 512; ++j) { A[i][j] = 0x3f80; B[i][j] = 0x3380; }
    const double ratio = argc > 1 ? std::atof(argv[1]) : 1.44;
    auto time = [&](const char* name, int depth, auto f) {
        double best = 1e30;
        int64_t tdp = 0;
        for (int r = 0; r < 7; ++r) {
            const uint64_t t0 = __rdtsc();
            tdp = f(20000, depth);
            best = std::min(best, double(__rdtsc() - t0));
        }
        const double per = best / double(tdp);
        std::printf("depth %d  %-40s %5.1f TSC cycles per tdpbf16ps, %3.0f %% of its rate\n", depth, name, per, 100 * 16 / (per * ratio));
    };
    for (int depth : {4, 8}) {
        time("2x2, C zeroed, stored after the block", depth, blocks<kAfter>);
        time("2x2, C zeroed, not stored", depth, blocks<kNone>);
        time("2x2, each store after its last product", depth, blocks<kInterleaved>);
        time("2x1, alternating C sets", depth, alternating);
        time("2x2, C loaded and stored (PV shape)", depth, blocks<kLoadStore>);
    }
    _tile_release();
    return 0;
}
