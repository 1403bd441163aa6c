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

// tmm0-7 with rows[t] rows of colsb[t] bytes each.
inline void configure_tiles(const uint8_t (&rows)[8], const uint16_t (&colsb)[8]) {
    TileConfig cfg;
    std::memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; ++t) { cfg.rows[t] = rows[t]; cfg.colsb[t] = colsb[t]; }
    _tile_loadconfig(&cfg);
}

// Every tile 16 rows x 64 bytes (the bf16 forward and backward).
inline void configure_full_tiles() {
    const uint8_t rows[8] = {16, 16, 16, 16, 16, 16, 16, 16};
    const uint16_t colsb[8] = {64, 64, 64, 64, 64, 64, 64, 64};
    configure_tiles(rows, colsb);
}

}  // namespace
}  // namespace fa2cpu
