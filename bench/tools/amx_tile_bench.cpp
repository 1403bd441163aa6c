// AMX tile-product microbenchmark (session 24): what a 2x2 C-tile block reaches with short
// contractions, stores, and operands from L1 / L2. g++ -O2 -mamx-tile -mamx-bf16 -mavx512f
#include <immintrin.h>
#include <x86intrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <initializer_list>

struct Cfg { uint8_t palette, start; uint8_t res[14]; uint16_t colsb[16]; uint8_t rows[16]; };
static void cfg() {
    Cfg c; std::memset(&c, 0, sizeof c); c.palette = 1;
    for (int t = 0; t < 8; ++t) { c.rows[t] = 16; c.colsb[t] = 64; }
    _tile_loadconfig(&c);
}
static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// `blocks` 2x2 blocks: C0..3 (+)= A0/A1 x B0/B1 over `depth` steps, A rows at stride lda bytes,
// B at ldb. kZero: zero the C tiles at a block's start (else load them from cbuf); kStore: store
// them to cbuf at its end. Prints GFLOP/s, flop per TSC cycle and TSC cycles per block.
template <int kStore, int kZero>
static void run(const char* name, const uint16_t* abuf, int64_t a_bytes, int64_t lda, const uint16_t* bbuf, int64_t b_bytes,
                  int64_t ldb, float* cbuf, int64_t c_bytes, int depth, int64_t blocks) {
    const int64_t a_step = 32 * lda, b_step = 16 * ldb;  // bytes between successive steps' tiles
    int64_t bo = 0, co = 0, arow = 0, acol = 0;
    const double t0 = now();
    const uint64_t c0 = __rdtsc();
    for (int64_t i = 0; i < blocks; ++i) {
        if (kZero) { _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3); }
        else {
            float* c = (float*)((char*)cbuf + co);
            _tile_loadd(0, c, 128); _tile_loadd(1, c + 16, 128); _tile_loadd(2, c + 512, 128); _tile_loadd(3, c + 528, 128);
        }
        for (int s = 0; s < depth; ++s) {
            const char* a = (const char*)abuf + arow + acol;
            const char* b = (const char*)bbuf + bo;
            _tile_loadd(4, a, lda); _tile_loadd(5, a + 16 * lda, lda);
            _tile_loadd(6, b, ldb); _tile_loadd(7, b + 64, ldb);
            _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
            // A: the next 64-byte column chunk of the same 32 rows; past the row's end, the next 32 rows
            if ((acol += 64) == lda) { acol = 0; arow += a_step; if (arow + a_step > a_bytes) arow = 0; }
            bo += b_step; if (bo + b_step > b_bytes) bo = 0;
        }
        if (kStore) {
            float* c = (float*)((char*)cbuf + co);
            _tile_stored(0, c, 128); _tile_stored(1, c + 16, 128); _tile_stored(2, c + 512, 128); _tile_stored(3, c + 528, 128);
            co += 4096; if (co + 4096 > c_bytes) co = 0;
        }
    }
    float out[256]; _tile_stored(0, out, 64);
    const double el = now() - t0;
    const double cyc = double(__rdtsc() - c0);
    const double flops = double(blocks) * depth * 4 * 2.0 * 16 * 16 * 32;
    std::printf("%-58s depth %2d: %7.0f GFLOP/s  %6.1f flop/TSC-cycle  %6.0f TSC cycles per block\n", name, depth,
                flops / el * 1e-9, flops / cyc, cyc / blocks);
}

int main() {
#ifndef ARCH_REQ_XCOMP_PERM
#define ARCH_REQ_XCOMP_PERM 0x1023
#endif
    syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, 18);
    cfg();
    const int64_t big = 64 << 20;
    uint16_t* A = (uint16_t*)aligned_alloc(64, big);
    uint16_t* B = (uint16_t*)aligned_alloc(64, big);
    float* C = (float*)aligned_alloc(64, big);
    for (int64_t i = 0; i < big / 2; ++i) { A[i] = 0x3f80; B[i] = 0x3380; }
    std::memset(C, 0, big);
    const int64_t N = 200000;
    // peak: no loads/stores in the loop
    {
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        _tile_loadd(4, A, 64); _tile_loadd(5, A, 64); _tile_loadd(6, B, 64); _tile_loadd(7, B, 64);
        const double t0 = now(); const uint64_t c0 = __rdtsc();
        for (int64_t i = 0; i < N * 4; ++i) { _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7); }
        float out[256]; _tile_stored(0, out, 64);
        const double el = now() - t0, cyc = double(__rdtsc() - c0), fl = N * 4 * 4 * 2.0 * 16 * 16 * 32;
        std::printf("%-58s          %7.0f GFLOP/s  %6.1f flop/TSC-cycle\n", "peak (tdpbf16ps only)", fl / el * 1e-9, fl / cyc);
    }
    for (int depth : {4, 8, 16, 64}) {
        const int64_t nb = N * 4 / depth;
        run<1, 1>("L1 operands (4 KB A, 4 KB B), zero + store C", A, 8192, 64, B, 8192, 128, C, 16384, depth, nb);
        run<0, 1>("L1 operands, zero C, no store", A, 8192, 64, B, 8192, 128, C, 16384, depth, nb);
        run<1, 0>("L1 operands, load + store C (4 KB C in L1)", A, 8192, 64, B, 8192, 128, C, 16384, depth, nb);
        run<1, 1>("A stride 256 B (K rows of D=128), B stride 768 B, L1-sized", A, 64 * 1024, 256, B, 48 * 1024, 768, C, 16384, depth, nb);
        run<1, 1>("L2 operands (256 KB A, 256 KB B), zero + store C to 96 KB", A, 256 << 10, 64, B, 256 << 10, 128, C, 96 << 10, depth, nb);
        run<1, 1>("L2 operands, A stride 256 B, B stride 768 B, C to 96 KB", A, 1 << 20, 256, B, 768 << 10, 768, C, 96 << 10, depth, nb);
    }
    return 0;
}
