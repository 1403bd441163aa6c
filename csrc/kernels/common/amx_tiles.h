// AMX tile configuration (palette 1), one copy for the AMX policies: the forward (amx.cpp) and
// the backward (backward_amx.h). Loading a configuration zeroes every tile; callers configure
// before their first tile instruction and release (_tile_release) when their item is done.
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace fa2cpu {
namespace {

struct TileConfig {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

// Every tile (tmm0-7) 16 rows x 64 bytes: the one shape of the bf16 forward and backward.
inline void configure_full_tiles() {
    TileConfig cfg;
    std::memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; ++t) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
    _tile_loadconfig(&cfg);
}

}  // namespace
}  // namespace fa2cpu
