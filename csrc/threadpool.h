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
    std::mutex mu_;
    std::condition_variable cv_;
};

}  // namespace zen5
