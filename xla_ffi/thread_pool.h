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
#include <limits>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace pigjax {

class ThreadPool {
 public:
  using Task = std::function<void(int64_t index, int worker)>;

  // `num_threads` workers in all, the calling thread included (so num_threads - 1 are spawned).
  // Exception-safe: if starting worker w fails (no memory or address space for its stack, a
  // thread limit), the workers already started are stopped and joined and std::runtime_error is
  // thrown. Unwinding a vector of joinable std::threads would call std::terminate instead.
  explicit ThreadPool(int num_threads) {
    int w = 1;
    try {
      threads_.reserve(num_threads > 1 ? num_threads - 1 : 0);
      for (; w < num_threads; ++w) threads_.emplace_back([this, w] { WorkerLoop(w); });
    } catch (const std::exception& e) {
      StopAndJoin();
      throw std::runtime_error("could not start worker thread " + std::to_string(w) + " of " +
                               std::to_string(num_threads) + " (" + e.what() +
                               "); use fewer threads.");
    }
  }
  ~ThreadPool() { StopAndJoin(); }
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(threads_.size()) + 1; }

  // Runs task(i, worker) for every i in [0, n), worker in [0, size()), and returns when all are
  // done. Rethrows the first exception a task threw. One call at a time (callers serialise).
  // inline_only: run everything on the calling thread (work too small to pay for a wake-up).
  // The caller works too, and waits only for tasks that were started, never for a worker that
  // has not woken up yet: on a busy machine a wake-up can take a scheduler tick, far longer than
  // the tasks of one attend call.
  void ParallelFor(int64_t n, const Task& task, bool inline_only = false) {
    if (n <= 0) return;
    if (n == 1 || threads_.empty() || inline_only) {
      for (int64_t i = 0; i < n; ++i) task(i, 0);
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      task_ = &task;
      n_.store(n);
      done_.store(0);
      error_ = nullptr;
      next_.store(0);  // after task_ and n_: a worker that claims an index sees this call's task
      ++generation_;
    }
    start_cv_.notify_all();
    RunTasks(0);
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [this] { return done_.load() == n_; });
    next_.store(std::numeric_limits<int64_t>::max() / 2);  // late wakers find nothing to claim
    task_ = nullptr;
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void StopAndJoin() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    start_cv_.notify_all();
    for (auto& t : threads_) t.join();
  }

  void RunTasks(int worker) {
    for (int64_t i = next_.fetch_add(1); i < n_; i = next_.fetch_add(1)) {
      try {
        (*task_)(i, worker);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu_);
        if (!error_) error_ = std::current_exception();
      }
      if (done_.fetch_add(1) + 1 == n_) {
        std::lock_guard<std::mutex> lock(mu_);
        done_cv_.notify_one();
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
    }
  }

  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable start_cv_, done_cv_;
  const Task* task_ = nullptr;
  std::atomic<int64_t> n_{0};
  std::atomic<int64_t> next_{std::numeric_limits<int64_t>::max() / 2};
  std::atomic<int64_t> done_{0};
  uint64_t generation_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
};

}  // namespace pigjax

#endif  // PIGJAX_XLA_FFI_THREAD_POOL_H_
