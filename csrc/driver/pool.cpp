// Thread pool of the driver (contract and reasons in pool.h). Built with no -m flags.
#include "pool.h"

#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
static inline void cpu_relax() { _mm_pause(); }
#else
static inline void cpu_relax() { std::this_thread::yield(); }
#endif

namespace fa2cpu {
namespace {

// An idle helper spins this long for the next call before it sleeps: decode issues calls every
// ~50-300 us (two per layer per token), and waking a sleeping thread costs ~10-50 us. Bounded, so
// a process that stops calling leaves the cores to others after 0.2 ms.
constexpr auto kIdleSpin = std::chrono::microseconds(200);
// A caller whose own items are done spins this long for helpers still finishing theirs, then sleeps.
constexpr auto kWaitSpin = std::chrono::microseconds(100);
constexpr int kMaxHelpers = 1023;

struct Job {
    ItemFn body;
    void* ctx;
    int64_t n;
    std::atomic<int64_t> next{0};
    std::atomic<int> running{0};  // helpers attached; written under Pool::mu, read lock-free too
    int max_helpers = 0;
};

void run_items(Job& j) {
    for (int64_t i = j.next.fetch_add(1, std::memory_order_relaxed); i < j.n;
         i = j.next.fetch_add(1, std::memory_order_relaxed))
        j.body(i, j.ctx);
}

struct Pool {
    std::mutex mu;
    std::condition_variable wake;      // helpers sleep here; signalled when a call is published
    std::condition_variable detached;  // callers sleep here for their attached helpers
    std::vector<Job*> jobs;            // calls that may still have unclaimed items (under mu)
    std::atomic<uint64_t> epoch{0};    // bumped under mu whenever a call is published
    std::atomic<int> threads{0};       // helpers created
    bool cannot_grow = false;          // thread creation failed once: stop trying (under mu)

    Job* attach_locked() {
        for (Job* j : jobs) {
            if (j->running.load(std::memory_order_relaxed) < j->max_helpers &&
                j->next.load(std::memory_order_relaxed) < j->n) {
                j->running.fetch_add(1, std::memory_order_relaxed);
                return j;
            }
        }
        return nullptr;
    }

    void helper_main() {
        std::unique_lock<std::mutex> lk(mu);
        for (;;) {
            if (Job* j = attach_locked()) {
                lk.unlock();
                run_items(*j);
                lk.lock();
                if (j->running.fetch_sub(1, std::memory_order_release) == 1) detached.notify_all();
                continue;
            }
            const uint64_t seen = epoch.load(std::memory_order_relaxed);
            lk.unlock();
            bool more = false;
            const auto t0 = std::chrono::steady_clock::now();
            while (!more) {
                for (int k = 0; k < 32; ++k) cpu_relax();
                if (epoch.load(std::memory_order_acquire) != seen) more = true;
                else if (std::chrono::steady_clock::now() - t0 > kIdleSpin) break;
            }
            lk.lock();
            if (!more) wake.wait(lk, [&] { return epoch.load(std::memory_order_relaxed) != seen; });
        }
    }

    // Under mu: make sure `want` helpers exist (fewer if the OS refuses to create more).
    void grow_locked(int want) {
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

void after_fork_in_child() { g_pool.store(nullptr, std::memory_order_release); }

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

int pool_threads() {
    Pool* p = g_pool.load(std::memory_order_acquire);
    return p ? p->threads.load() : 0;
}

void parallel_for(int64_t n, int threads, ItemFn body, void* ctx) {
    if (n <= 0) return;
    const int helpers = int(std::min<int64_t>({int64_t(threads) - 1, n - 1, int64_t(kMaxHelpers)}));
    if (helpers <= 0) {
        for (int64_t i = 0; i < n; ++i) body(i, ctx);
        return;
    }
    Pool& P = pool();
    Job job;
    job.body = body;
    job.ctx = ctx;
    job.n = n;
    job.max_helpers = helpers;
    {
        std::lock_guard<std::mutex> lk(P.mu);
        P.grow_locked(helpers);
        P.jobs.push_back(&job);
        P.epoch.fetch_add(1, std::memory_order_release);
    }
    P.wake.notify_all();
    run_items(job);
    std::unique_lock<std::mutex> lk(P.mu);
    P.jobs.erase(std::find(P.jobs.begin(), P.jobs.end(), &job));  // no helper attaches from now on
    if (job.running.load(std::memory_order_relaxed) > 0) {
        lk.unlock();
        const auto t0 = std::chrono::steady_clock::now();
        while (job.running.load(std::memory_order_acquire) > 0 && std::chrono::steady_clock::now() - t0 < kWaitSpin)
            for (int k = 0; k < 32; ++k) cpu_relax();
        lk.lock();
        P.detached.wait(lk, [&] { return job.running.load(std::memory_order_relaxed) == 0; });
    }
}

}  // namespace fa2cpu
