// Thread pool of the driver (contract and reasons in pool.h). Built with no -m flags.
#include "pool.h"
#include "driver.h"

#include <omp.h>
#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

namespace fa2cpu {
namespace {

// An idle helper spins this long for the next call before it sleeps: decode issues calls every
// ~50-300 us (two per layer per token), and waking a sleeping thread costs ~10-50 us. Bounded, so
// a process that stops calling leaves the cores to others soon after. FA2CPU_SPIN_US overrides
// it (read once, at load; 0 = sleep at once).
const std::chrono::microseconds kIdleSpin(env_count("FA2CPU_SPIN_US", 200, 10000000));
// A caller whose own items are done spins this long for helpers still finishing theirs, then
// yields its core between checks (a descheduled helper then costs the caller nothing but latency).
constexpr auto kWaitSpin = std::chrono::microseconds(100);
constexpr int kMaxHelpers = 1023;
// Calls that can use helpers at the same time (one slot each); a call that finds no free slot
// runs on its own thread.
constexpr int kSlots = 64;

struct Job {
    ItemFn body;
    void* ctx;
    int64_t n;
    int max_helpers;
    std::atomic<int64_t> next{0};
};

void run_items(Job& j) {
    for (int64_t i = j.next.fetch_add(1, std::memory_order_relaxed); i < j.n;
         i = j.next.fetch_add(1, std::memory_order_relaxed))
        j.body(i, j.ctx);
}

// The hot path takes no lock. A call owns a slot while it runs; helpers find jobs by scanning the
// slots. Lifetime protocol (all seq_cst): a helper first increments the slot's `users`, then
// reads `job` (and dereferences only that fresh pointer); the caller clears `job`, then waits for
// `users` to drop to 0 before it returns (its Job lives on its stack) and frees the slot. Either a
// helper's increment is seen by the caller's wait, or the helper reads a cleared (or newer) job.
struct Slot {
    std::atomic<bool> owned{false};
    std::atomic<Job*> job{nullptr};
    std::atomic<int> users{0};
    char pad[64 - sizeof(std::atomic<bool>) - sizeof(std::atomic<Job*>) - sizeof(std::atomic<int>)];
};

struct Pool {
    Slot slots[kSlots];
    std::atomic<uint32_t> epoch{0};  // bumped whenever a call publishes a job
    std::atomic<int> threads{0};     // helpers created
    std::atomic<int> sleepers{0};    // helpers blocked on `wake`
    std::mutex mu;                   // only for sleeping helpers and for creating helpers
    std::condition_variable wake;
    bool cannot_grow = false;        // thread creation failed once: stop trying (under mu)

    // One pass over the slots; true if some items were run.
    bool help_once() {
        bool worked = false;
        for (Slot& sl : slots) {
            if (!sl.job.load(std::memory_order_relaxed)) continue;  // cheap filter, no dereference
            const int before = sl.users.fetch_add(1);
            Job* j = sl.job.load();
            if (j && before < j->max_helpers && j->next.load(std::memory_order_relaxed) < j->n) {
                run_items(*j);
                worked = true;
            }
            sl.users.fetch_sub(1);
        }
        return worked;
    }

    void helper_main() {
        for (;;) {
            const uint32_t seen = epoch.load();
            if (help_once()) continue;
            bool more = false;
            const auto t0 = std::chrono::steady_clock::now();
            while (!more) {
                for (int k = 0; k < 32; ++k) cpu_relax();
                if (epoch.load(std::memory_order_relaxed) != seen) more = true;
                else if (std::chrono::steady_clock::now() - t0 > kIdleSpin) break;
            }
            if (more) continue;
            std::unique_lock<std::mutex> lk(mu);
            sleepers.fetch_add(1);
            wake.wait(lk, [&] { return epoch.load() != seen; });
            sleepers.fetch_sub(1);
        }
    }

    // Makes sure `want` helpers exist (fewer if the OS refuses to create more).
    void grow(int want) {
        if (threads.load(std::memory_order_relaxed) >= want) return;
        std::lock_guard<std::mutex> lk(mu);
        while (!cannot_grow && threads.load(std::memory_order_relaxed) < want) {
            try {
                std::thread(&Pool::helper_main, this).detach();
                threads.fetch_add(1, std::memory_order_relaxed);
            } catch (const std::system_error&) {
                cannot_grow = true;  // e.g. RLIMIT_NPROC or address space: run with what we have
            }
        }
    }
};

// The process's pool: created on first use, never destroyed (its detached helpers use it until
// the process exits). A child of fork() drops the parent's (its helpers do not exist there; its
// mutex may have been held by one of them) and creates its own.
std::atomic<Pool*> g_pool{nullptr};

Pool& pool() {
    Pool* p = g_pool.load(std::memory_order_acquire);
    if (p) return *p;
    Pool* fresh = new Pool();
    if (g_pool.compare_exchange_strong(p, fresh, std::memory_order_acq_rel)) return *fresh;
    delete fresh;  // another thread won the race
    return *p;
}

std::atomic<bool> g_openmp{false};
std::atomic<GompParallelFn> g_gomp_parallel{nullptr};  // another runtime's GOMP_parallel, or ours
std::atomic<MaxThreadsFn> g_max_threads{nullptr};

void after_fork_in_child() {
    g_pool.store(nullptr, std::memory_order_release);
    g_openmp.store(false);  // the parent's OpenMP threads do not exist here (libgomp would hang)
    g_gomp_parallel.store(nullptr);
}

struct AtForkRegistration {
    AtForkRegistration() { pthread_atfork(nullptr, nullptr, &after_fork_in_child); }
} g_atfork;

}  // namespace

int max_useful_threads() {
#if defined(__linux__)
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
#endif
    const unsigned hc = std::thread::hardware_concurrency();
    return hc ? int(hc) : 1;
}

void set_openmp_backend(bool on, GompParallelFn gomp_parallel, MaxThreadsFn max_threads) {
    g_gomp_parallel.store(on ? gomp_parallel : nullptr);
    g_max_threads.store(on ? max_threads : nullptr);
    g_openmp.store(on);
}
bool openmp_backend() { return g_openmp.load(); }
bool openmp_backend_is_foreign() { return g_openmp.load() && g_gomp_parallel.load() != nullptr; }
int backend_max_threads() {
    const MaxThreadsFn f = g_openmp.load() ? g_max_threads.load() : nullptr;
    return f ? f() : omp_get_max_threads();
}

namespace {
void run_job_region(void* job) { run_items(*static_cast<Job*>(job)); }
}  // namespace

int pool_threads() {
    Pool* p = g_pool.load(std::memory_order_acquire);
    return p ? p->threads.load() : 0;
}

void parallel_for(int64_t n, int threads, ItemFn body, void* ctx) {
    if (n <= 0) return;
    const int helpers = int(std::min<int64_t>({int64_t(threads) - 1, n - 1, int64_t(kMaxHelpers)}));
    if (helpers > 0 && g_openmp.load(std::memory_order_relaxed)) {
        // The whole team (`threads`), not one thread per item: a region of another size than the
        // one before makes libgomp re-dock its pool, and a decode call alternating 16 (items) and
        // 4 (merges) threads, between torch's 16-thread ops, took 600 us instead of 65-95 on the
        // AMX machine (bench/RESULTS.md, issue 9). Threads that find no item leave at once.
        const int team = int(std::min<int64_t>(int64_t(threads) - 1, int64_t(kMaxHelpers))) + 1;
        Job job{body, ctx, n, team - 1};
        if (const GompParallelFn gp = g_gomp_parallel.load()) {
            gp(&run_job_region, &job, unsigned(team), 0);  // that runtime serialises nesting itself
            return;
        }
        if (!omp_in_parallel()) {
#pragma omp parallel num_threads(team)
            run_items(job);
            return;
        }
    }
    Pool* P = helpers > 0 ? &pool() : nullptr;
    Slot* slot = nullptr;
    if (P) {
        for (Slot& sl : P->slots) {
            bool expected = false;
            if (sl.owned.compare_exchange_strong(expected, true)) { slot = &sl; break; }
        }
    }
    if (!slot) {  // one thread wanted, or every slot taken by concurrent calls
        for (int64_t i = 0; i < n; ++i) body(i, ctx);
        return;
    }
    P->grow(helpers);
    Job job{body, ctx, n, helpers};
    slot->job.store(&job);
    P->epoch.fetch_add(1);
    if (P->sleepers.load() > 0) {
        { std::lock_guard<std::mutex> lk(P->mu); }  // a helper between its check and its wait gets the signal
        P->wake.notify_all();
    }
    run_items(job);
    slot->job.store(nullptr);  // no helper attaches from now on
    const auto t0 = std::chrono::steady_clock::now();
    while (slot->users.load() > 0) {
        if (std::chrono::steady_clock::now() - t0 < kWaitSpin) {
            for (int k = 0; k < 32; ++k) cpu_relax();
        } else {
            std::this_thread::yield();
        }
    }
    slot->owned.store(false);
}

}  // namespace fa2cpu
