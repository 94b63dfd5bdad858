// A small fork-join thread pool owned by each host KV store.
//
// The store does not use XLA's intra-op pool: a handler that blocks on tasks it scheduled there
// can starve it (DESIGN.md section 5). Pure C++: no XLA, no nanobind.
#ifndef PIGJAX_XLA_FFI_THREAD_POOL_H_
#define PIGJAX_XLA_FFI_THREAD_POOL_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace pigjax {

class ThreadPool {
 public:
  using Task = std::function<void(int64_t index, int worker)>;

  // `num_threads` workers in all, the calling thread included (so num_threads - 1 are spawned).
  explicit ThreadPool(int num_threads) {
    for (int w = 1; w < num_threads; ++w) threads_.emplace_back([this, w] { WorkerLoop(w); });
  }
  ~ThreadPool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    start_cv_.notify_all();
    for (auto& t : threads_) t.join();
  }
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(threads_.size()) + 1; }

  // Runs task(i, worker) for every i in [0, n), worker in [0, size()), and returns when all are
  // done. Rethrows the first exception a task threw. One call at a time (callers serialise).
  // inline_only: run everything on the calling thread (work too small to pay for a wake-up).
  void ParallelFor(int64_t n, const Task& task, bool inline_only = false) {
    if (n <= 0) return;
    if (n == 1 || threads_.empty() || inline_only) {
      for (int64_t i = 0; i < n; ++i) task(i, 0);
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      task_ = &task;
      n_ = n;
      next_.store(0);
      error_ = nullptr;
      active_ = static_cast<int>(threads_.size());
      ++generation_;
    }
    start_cv_.notify_all();
    RunTasks(0);
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [this] { return active_ == 0; });
    task_ = nullptr;
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void RunTasks(int worker) {
    for (int64_t i = next_.fetch_add(1); i < n_; i = next_.fetch_add(1)) {
      try {
        (*task_)(i, worker);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu_);
        if (!error_) error_ = std::current_exception();
      }
    }
  }

  void WorkerLoop(int worker) {
    uint64_t seen = 0;
    while (true) {
      {
        std::unique_lock<std::mutex> lock(mu_);
        start_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
      }
      RunTasks(worker);
      std::lock_guard<std::mutex> lock(mu_);
      if (--active_ == 0) done_cv_.notify_one();
    }
  }

  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable start_cv_, done_cv_;
  const Task* task_ = nullptr;
  int64_t n_ = 0;
  std::atomic<int64_t> next_{0};
  int active_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
};

}  // namespace pigjax

#endif  // PIGJAX_XLA_FFI_THREAD_POOL_H_
