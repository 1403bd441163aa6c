// What the driver's entry points (driver.cpp: forward, backward.cpp: backward) share. Built with
// no -m flags, like them.
#pragma once
#include <cstdint>

#include "fa2cpu/fa2cpu.h"

namespace fa2cpu {

// The invariants the Python layer promises for a Params, checked again so that a future caller
// of a C++ entry point cannot overrun a scratch buffer or divide by zero. Throws
// std::invalid_argument("fa2cpu::<entry>: ..."), which the Cython `except +` turns into ValueError.
void check_params(const Params& p, const char* entry);

// The calling thread's scratch of at least `floats` floats (64-byte aligned), reused across calls
// (the pool keeps its threads alive); nullptr when it cannot be allocated.
float* thread_scratch(int64_t floats);

}  // namespace fa2cpu
