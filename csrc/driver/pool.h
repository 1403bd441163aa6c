// The driver's thread pool: a parallel-for over work items that stays fast on a machine whose
// cores are shared, and that keeps working in a process forked after use.
//
// Why not an OpenMP parallel region: an OpenMP region ends in a barrier that waits for EVERY thread
// of the team, including one the OS has not scheduled yet because another process holds its core;
// a 0.3 ms call then takes one scheduler slice (~4-8 ms). libgomp's thread pool is also not
// inherited by fork(): a child process that calls a parallel region after its parent used one
// hangs forever. Here:
//  - the calling thread always works; helpers join while unclaimed items remain, claiming items
//    one at a time (dynamic schedule, longest first as the driver ordered them);
//  - the caller waits only for helpers that attached to its call (they are running items); a
//    helper that wakes after the last item was claimed finds nothing and goes back to waiting;
//  - idle helpers spin for a bounded time (kSpinMicros) for the next call, then sleep on a
//    condition variable, so back-to-back calls (decode) find them awake and an idle process
//    leaves the cores alone;
//  - a child of fork() starts with a fresh, empty pool (pthread_atfork), created on its first call;
//  - a helper that cannot be created (thread limit, address space) is simply not used.
#pragma once
#include <cstdint>
#include <thread>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace fa2cpu {

// Runs body(i, ctx) for every i in [0, n) on the calling thread plus up to `threads - 1` helpers.
// body must not throw. Concurrent calls from several threads share the helpers. Every backend
// claims items one at a time in index order, and a claimed item runs at once on the thread that
// claimed it: an item may wait for items of lower index (backward.cpp's dq sums do).
using ItemFn = void (*)(int64_t i, void* ctx);
// One step of a spin-wait: the pause instruction (x86), else a yield.
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#else
    std::this_thread::yield();
#endif
}
void parallel_for(int64_t n, int threads, ItemFn body, void* ctx);

// Helper threads currently alive in this process (for tests and show_config).
int pool_threads();

// Backend of parallel_for. The pool (default) is described above. With the OpenMP backend the
// items run in an OpenMP parallel region of the process's OpenMP runtime instead (same dynamic
// claiming): chosen when fa2cpu runs inside PyTorch, whose libgomp is the one runtime of the
// process, so fa2cpu's calls use torch's already-running threads instead of a second pool
// competing with them for the cores. A child of fork() always goes back to the pool.
// gomp_parallel / max_threads, when not null, are another OpenMP runtime's `GOMP_parallel` and
// `omp_get_max_threads` (libgomp's ABI, also exported by LLVM's libomp): the runtime torch loaded,
// used even when this extension links a different copy (a wheel's bundled, renamed libgomp).
using GompParallelFn = void (*)(void (*fn)(void*), void* data, unsigned num_threads, unsigned flags);
using MaxThreadsFn = int (*)();
void set_openmp_backend(bool on, GompParallelFn gomp_parallel = nullptr, MaxThreadsFn max_threads = nullptr);
bool openmp_backend();
bool openmp_backend_is_foreign();  // true when the runtime given by set_openmp_backend is used
int backend_max_threads();          // that runtime's omp_get_max_threads(), else ours

// Cap applied to any requested thread count: the CPUs this process may run on (at least 1).
int max_useful_threads();

}  // namespace fa2cpu
