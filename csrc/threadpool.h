// A fixed pool of worker threads created with the model. `run(n_tasks, fn)` hands out task
// indices through an atomic claim word; the calling thread works too, so `threads == 1` means
// no extra thread at all. Workers spin briefly before sleeping: a decoded token dispatches a few
// hundred small jobs, and a condition-variable wake-up per job would cost more than the job.
// `run` returns when every task has finished, not when every worker has checked in: on a busy
// machine a worker that has lost its core simply misses the run (the caller does its share)
// instead of stalling the caller for a scheduler time slice per dispatch.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace zen5 {

class ThreadPool {
  public:
    using Task = std::function<void(int task, int thread)>;

    explicit ThreadPool(int n_threads);
    ~ThreadPool();
    ThreadPool(const ThreadPool&) = delete;
    ThreadPool& operator=(const ThreadPool&) = delete;

    int size() const { return n_threads_; }
    // Runs fn(task, thread) for task in [0, n_tasks); returns when all are done.
    void run(int n_tasks, const Task& fn);

    // Runs fn(u0, u1) over disjoint ranges that together cover [0, n_units); returns when all
    // are done. Every thread owns an equal contiguous share and takes it front to back, in
    // chunks of a quarter of what is left (at least min_chunk units), so its reads stay one
    // stream; a thread whose share is done takes the back half of what is left of another's
    // and carries on with it as its own. Equal fixed halves of a decode's matmuls (1.7B Q4_0,
    // 2 threads, Xeon VM) left the threads idle at the dispatch ends for 1.7-3.4% of their time
    // in a fast window of the VM and 9.2% in a slow one, where one core kept falling behind (the
    // memory does not serve two streams evenly); shares leave 0.4-0.5%.
    using Range = std::function<void(int64_t u0, int64_t u1)>;
    void run_shares(int64_t n_units, int64_t min_chunk, const Range& fn);

    // Per-item work of a prefill chunk (norms, RoPE, activation quantization, elementwise steps,
    // a token at a time): fn(i0, i1) over parts of [0, n) as run_shares, or on the caller alone
    // below kMinItems items or with one thread, where a dispatch would cost more than the work (a
    // decoded token); either way in run()'s FPU mode. Items must not depend on each other: any
    // split gives the same results.
    static constexpr int64_t kMinItems = 8;
    void run_items(int64_t n, const Range& fn);

    // run_shares over the rows of several matrices laid end to end in whole granules: job j's
    // rows [lo, hi) in granules of gran rows from lo (the last one may be short). fn(j, r0, r1)
    // runs a range's part of job j; a range may end one job and start the next.
    struct Rows {
        int64_t lo, hi, gran;
    };
    using RowRange = std::function<void(int job, int64_t r0, int64_t r1)>;
    void run_rows(const Rows* jobs, int n_jobs, const RowRange& fn);

  private:
    void worker(int index);
    void work(int thread, uint32_t gen);

    static constexpr uint32_t kClosed = 0xFFFFFFFFu;
    int n_threads_;
    std::vector<std::thread> workers_;
    // claim_ = (run generation << 32) | next task index (kClosed once the run is over). A task
    // is claimed by a compare-and-swap on the whole word, so a late worker can never take a task
    // of a run other than the one it saw.
    std::atomic<uint64_t> claim_{uint64_t(kClosed)};
    std::atomic<const Task*> job_{nullptr};
    std::atomic<int> n_tasks_{0};
    std::atomic<int> finished_{0};  // tasks of the current run completed
    std::atomic<uint64_t> generation_{0};  // wakes the workers
    std::atomic<bool> stop_{false};
    // run_shares: per task, (next unit << 32) | end of its share, one cache line each
    struct alignas(64) Share {
        std::atomic<uint64_t> span{0};
    };
    std::vector<Share> shares_;
    std::mutex mu_;
    std::condition_variable cv_;
};

}  // namespace zen5
