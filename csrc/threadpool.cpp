#include "threadpool.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
static inline void cpu_relax() { _mm_pause(); }
#else
static inline void cpu_relax() { std::this_thread::yield(); }
#endif

namespace zen5 {

ThreadPool::ThreadPool(int n_threads) : n_threads_(n_threads < 1 ? 1 : n_threads) {
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

void ThreadPool::work(int thread) {
    for (int t; (t = next_.fetch_add(1)) < n_tasks_;) (*job_)(t, thread);
}

void ThreadPool::worker(int index) {
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
        work(index);
        done_.fetch_add(1, std::memory_order_acq_rel);
    }
}

void ThreadPool::run(int n_tasks, const Task& fn) {
    if (n_tasks <= 0) return;
    if (workers_.empty() || n_tasks == 1) {
        for (int t = 0; t < n_tasks; ++t) fn(t, 0);
        return;
    }
    job_ = &fn;
    n_tasks_ = n_tasks;
    next_.store(0);
    done_.store(0);
    {
        std::lock_guard<std::mutex> lock(mu_);
        generation_.fetch_add(1, std::memory_order_acq_rel);
    }
    cv_.notify_all();
    work(0);
    // Wait for the workers; yield after a short spin so a worker that lost its core (the
    // machine is shared) gets it back instead of us burning the rest of our time slice.
    const int n_workers = int(workers_.size());
    for (int i = 0; done_.load(std::memory_order_acquire) < n_workers; ++i) {
        if (i < 4000) cpu_relax();
        else std::this_thread::yield();
    }
}

}  // namespace zen5
