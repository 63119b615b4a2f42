// A fixed pool of worker threads created with the model. `run(n_tasks, fn)` hands out task
// indices through an atomic counter; the calling thread works too, so `threads == 1` means no
// extra thread at all. Workers spin briefly before sleeping: a decoded token dispatches a few
// hundred small jobs, and a condition-variable wake-up per job would cost more than the job.
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
    void work(int thread);

    int n_threads_;
    std::vector<std::thread> workers_;
    const Task* job_ = nullptr;
    int n_tasks_ = 0;
    std::atomic<int> next_{0};
    std::atomic<int> done_{0};
    std::atomic<uint64_t> generation_{0};
    std::atomic<bool> stop_{false};
    std::mutex mu_;
    std::condition_variable cv_;
};

}  // namespace zen5
