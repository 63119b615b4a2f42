#include "threadpool.h"

#include <algorithm>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
static inline void cpu_relax() { _mm_pause(); }
#else
static inline void cpu_relax() { std::this_thread::yield(); }
#endif

namespace zen5 {

// The kernels run with flush-to-zero and denormals-are-zero (MXCSR FTZ | DAZ): on Intel an FMA
// that meets a denormal takes a microcode assist, and attention probabilities of far positions
// underflow into that range. An 8B Llama (random weights, head size 128) prefilled 512 tokens at
// 20.8 tok/s on one Xeon thread without, 28.9 with (perf had 27% of the time in the fp16 value
// sums). Workers keep the mode; the calling thread has it only inside run().
#if defined(__x86_64__) || defined(_M_X64)
static constexpr unsigned kFtzDaz = 0x8040;
static inline unsigned enter_ftz() {
    const unsigned saved = _mm_getcsr();
    _mm_setcsr(saved | kFtzDaz);
    return saved;
}
static inline void leave_ftz(unsigned saved) { _mm_setcsr(saved); }
#else
static inline unsigned enter_ftz() { return 0; }
static inline void leave_ftz(unsigned) {}
#endif

ThreadPool::ThreadPool(int n_threads) : n_threads_(n_threads < 1 ? 1 : n_threads), shares_(size_t(n_threads_)) {
    for (int i = 1; i < n_threads_; ++i) workers_.emplace_back([this, i] { worker(i); });
}

ThreadPool::~ThreadPool() {
    {
        std::lock_guard<std::mutex> lock(mu_);
        stop_ = true;
        generation_.fetch_add(1);
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
}

void ThreadPool::work(int thread, uint32_t gen) {
    for (;;) {
        uint64_t w = claim_.load();
        if (uint32_t(w >> 32) != gen) return;                      // a later run: not ours
        const uint32_t idx = uint32_t(w);
        if (idx == kClosed || idx >= uint32_t(n_tasks_.load())) return;  // all claimed
        if (!claim_.compare_exchange_weak(w, w + 1)) continue;
        (*job_.load())(int(idx), thread);  // our claim keeps the run (and job_) alive until done
        finished_.fetch_add(1, std::memory_order_acq_rel);
    }
}

void ThreadPool::worker(int index) {
    enter_ftz();
    uint64_t seen = 0;
    for (;;) {
        // Spin about 50 microseconds for the next job, then sleep until notified.
        for (int i = 0; i < 20000 && generation_.load(std::memory_order_acquire) == seen; ++i) {
            if (i < 4000) cpu_relax();
            else std::this_thread::yield();
        }
        if (generation_.load(std::memory_order_acquire) == seen) {
            std::unique_lock<std::mutex> lock(mu_);
            cv_.wait(lock, [&] { return generation_.load() != seen; });
        }
        seen = generation_.load(std::memory_order_acquire);
        if (stop_) return;
        work(index, uint32_t(seen));
    }
}

void ThreadPool::run(int n_tasks, const Task& fn) {
    if (n_tasks <= 0) return;
    struct Ftz {
        unsigned saved = enter_ftz();
        ~Ftz() { leave_ftz(saved); }
    } ftz;
    if (workers_.empty() || n_tasks == 1) {
        for (int t = 0; t < n_tasks; ++t) fn(t, 0);
        return;
    }
    const uint64_t gen = generation_.load() + 1;
    job_.store(&fn);
    n_tasks_.store(n_tasks);
    finished_.store(0);
    claim_.store(gen << 32);  // open: tasks 0.. of run `gen`
    {
        std::lock_guard<std::mutex> lock(mu_);
        generation_.store(gen, std::memory_order_release);
    }
    cv_.notify_all();
    work(0, uint32_t(gen));
    // Wait for the tasks other threads claimed; yield after a short spin so a worker that lost
    // its core (the machine is shared) gets it back instead of us burning our time slice.
    for (int i = 0; finished_.load(std::memory_order_acquire) < n_tasks; ++i) {
        if (i < 4000) cpu_relax();
        else std::this_thread::yield();
    }
    claim_.store((gen << 32) | kClosed);  // late workers find nothing to claim
}

void ThreadPool::run_shares(int64_t n_units, int64_t min_chunk, const Range& fn) {
    if (n_units <= 0) return;
    const int nt = int(std::min<int64_t>(n_threads_, n_units));
    if (nt == 1) return run(1, [&](int, int) { fn(0, n_units); });  // run() sets the FPU mode
    auto pack = [](uint64_t next, uint64_t end) { return next << 32 | end; };
    for (int t = 0; t < nt; ++t) shares_[t].span.store(pack(n_units * t / nt, n_units * (t + 1) / nt));
    run(nt, [&](int task, int) {
        std::atomic<uint64_t>& own = shares_[task].span;
        for (;;) {
            uint64_t s = own.load();
            while (uint32_t(s >> 32) < uint32_t(s)) {  // the front of our share
                const uint32_t next = uint32_t(s >> 32), end = uint32_t(s), left = end - next;
                const uint32_t take = std::min<uint32_t>(left, std::max<uint32_t>(uint32_t(min_chunk), left / 4));
                if (own.compare_exchange_weak(s, pack(next + take, end))) {
                    fn(next, next + take);
                    s = own.load();
                }
            }
            bool stole = false;  // the back half of the first share with units left
            for (int k = 1; k < nt && !stole; ++k) {
                std::atomic<uint64_t>& other = shares_[(task + k) % nt].span;
                uint64_t o = other.load();
                while (uint32_t(o >> 32) < uint32_t(o)) {
                    const uint32_t next = uint32_t(o >> 32), end = uint32_t(o), cut = end - (end - next + 1) / 2;
                    if (other.compare_exchange_weak(o, pack(next, cut))) {
                        own.store(pack(cut, end));  // ours is empty: nobody else writes it now
                        stole = true;
                        break;
                    }
                }
            }
            if (!stole) return;
        }
    });
}

void ThreadPool::run_items(int64_t n, const Range& fn) {
    if (n <= 0) return;
    // inline through run() too, so that the items see the same FPU mode whatever their count
    if (n < kMinItems || n_threads_ == 1) return run(1, [&](int, int) { fn(0, n); });
    run_shares(n, 1, fn);
}

void ThreadPool::run_rows(const Rows* jobs, int n_jobs, const RowRange& fn) {
    auto units = [&](int j) { return (jobs[j].hi - jobs[j].lo + jobs[j].gran - 1) / jobs[j].gran; };
    int64_t total = 0;
    for (int j = 0; j < n_jobs; ++j) total += units(j);
    run_shares(total, 1, [&](int64_t u0, int64_t u1) {
        int64_t start = 0;  // job j's first unit
        for (int j = 0; j < n_jobs && start < u1; ++j) {
            const Rows& r = jobs[j];
            const int64_t end = start + units(j), a = std::max(u0, start), b = std::min(u1, end);
            if (a < b) fn(j, r.lo + (a - start) * r.gran, std::min(r.hi, r.lo + (b - start) * r.gran));
            start = end;
        }
    });
}

}  // namespace zen5
