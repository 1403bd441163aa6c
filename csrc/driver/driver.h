// What the driver's entry points (driver.cpp: forward, backward.cpp: backward) share. Built with
// no -m flags, like them.
#pragma once
#include <cstddef>
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

// The environment variable `name` as a count: unset, empty or not a non-negative integer (whole
// string) gives `fallback`, larger values `max`. For settings read once, at load
// (FA2CPU_SPIN_US, FA2CPU_KEEP_GRADIENTS_MB): a bad value never fails an import.
int64_t env_count(const char* name, int64_t fallback, int64_t max);

// `bytes` of memory (64-byte aligned; nullptr when it cannot be allocated; free with std::free)
// for a call's large buffers (the backward's dq partials, the forward's shared K/V tiles). From
// 8 MB on they are 2 MB-aligned and Linux is asked for 2 MB pages (madvise; granted where the
// kernel's transparent huge pages allow it), so the first writes of fresh memory fault 512 times
// less often.
float* alloc_large(size_t bytes);

// A call's large buffer kept by the calling thread for its next call (freshly allocated memory
// faults and is zeroed by the kernel on its first write: fresh dq partials cost 3-5 % of a
// backward whose kv heads are split), unless the call needed more than keep_bytes: trim() then
// frees it. reserve(n) -> at least n floats from alloc_large (null: none). (driver.cpp)
struct ThreadFloats {
    int64_t keep_bytes = int64_t(64) << 20;
    float* data = nullptr;
    int64_t floats = 0;
    ~ThreadFloats();
    float* reserve(int64_t n);
    void trim();
};

}  // namespace fa2cpu
