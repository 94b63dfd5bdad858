// A small fork-join thread pool: the process's compute pool (quant_ffi.cc ComputePool: the
// quantized matmuls, the dense decode kernel and, by default, every host KV store), or a store's
// own when it asks for a thread count of its own.
//
// Not XLA's intra-op pool: a handler that blocks on tasks it scheduled there can starve it
// (docs/design.md, "Threading"). Pure C++: no XLA, no nanobind.
#ifndef PIGJAX_XLA_FFI_THREAD_POOL_H_
#define PIGJAX_XLA_FFI_THREAD_POOL_H_

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <functional>
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
  // done. Rethrows the first exception a task threw. Calls from several threads (two engines, a
  // store and a matmul of different executables) take turns; a task must not call ParallelFor
  // on the same pool. inline_only: run everything on the calling thread (work too small to pay
  // for a wake-up). The caller works too, and waits only for tasks that were started, never
  // for a worker that has not woken up yet: on a busy machine a wake-up can take a scheduler
  // tick, far longer than the tasks of one attend call.
  // Returns whether the call ran in parallel and, if so, how long it ran on the calling thread
  // alone before another worker started a task (the whole call if none did): how late the
  // workers woke up.
  struct CallStats {
    bool parallel = false;
    uint64_t alone_ns = 0;
  };
  CallStats ParallelFor(int64_t n, const Task& task, bool inline_only = false) {
    if (n <= 0) return {};
    // (More tasks than a claim can count never come from a real call: run them here too.)
    if (n == 1 || threads_.empty() || inline_only || n > int64_t{kMaxTasks}) {
      for (int64_t i = 0; i < n; ++i) task(i, 0);
      return {};
    }
    std::lock_guard<std::mutex> turn(call_mu_);
    const uint64_t t0 = Now();
    uint32_t gen;
    {
      std::lock_guard<std::mutex> lock(mu_);
      task_ = &task;
      n_.store(n);
      done_.store(0);
      error_ = nullptr;
      joined_ns_.store(0);
      gen = static_cast<uint32_t>(generation_.load() + 1);
      claim_.store(uint64_t{gen} << 32);  // this call's indices, from 0
      generation_.fetch_add(1, std::memory_order_release);
    }
    start_cv_.notify_all();
    RunTasks(0, gen, n, &task);
    // Every task has been claimed; the others finish theirs within a task's time. Polling for
    // that beats sleeping on done_cv_: a wake-up takes tens of microseconds on a VM, as long as
    // a whole decode matmul (2 threads ran 121 matmuls per SmolLM2 step slower than 1 did).
    for (const uint64_t until = Now() + kDonePollNs; done_.load() != n_ && Now() < until;) {
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#endif
    }
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [this] { return done_.load() == n_; });
    task_ = nullptr;
    // Until a second worker joined, the call ran on one core (the whole call if none did).
    const uint64_t joined = joined_ns_.load();
    const uint64_t alone = (joined ? std::max(joined, t0) : Now()) - t0;
    if (error_) std::rethrow_exception(error_);
    return {true, alone};
  }

 private:
  static uint64_t Now() {
    return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                     std::chrono::steady_clock::now().time_since_epoch())
                                     .count());
  }

  // How long a worker stays awake after its last task, polling for the next call before it
  // sleeps: a decode step calls the compute pool every few hundred microseconds (matmuls, the
  // store, the dense kernel), and a sleeping worker needs a wake-up (tens of microseconds, a
  // scheduler tick on a busy machine). 200 us cuts the store's time alone on the caller at 32k
  // from 6.4 ms (no spinning) to 1.5 ms per step (100 us: 3.3 ms); 500 us makes a 4k step slower,
  // the spinning worker holding a core that XLA's own threads want (BENCHMARKS.md, "Levers
  // measured").
  // PIGJAX_SPIN_US overrides it (0: sleep at once).
  static uint64_t SpinNs() {
    static const uint64_t ns = [] {
      const char* e = std::getenv("PIGJAX_SPIN_US");
      return uint64_t(e ? std::max(0, std::atoi(e)) : kDefaultSpinUs) * 1000;
    }();
    return ns;
  }
  static constexpr int kDefaultSpinUs = 200;
  // How long the caller polls for the other workers' last tasks before it sleeps.
  static constexpr uint64_t kDonePollNs = 200'000;

  void StopAndJoin() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_.store(true);
    }
    start_cv_.notify_all();
    for (auto& t : threads_) t.join();
  }

  // Claims the next index of call `gen` into *i; false once that call's indices are all claimed
  // or another call has begun. The generation is part of the claimed word: with a separate
  // index counter, a worker that drew an exhausted index of one call and was preempted before
  // comparing it with n could compare it with the next call's larger n and run that index a
  // second time. done_ then counted past n, and a caller that missed the moment it equalled n
  // waited forever (a decode step hung so, in a worker's cond-var wait, on the 2-vCPU VM).
  bool Claim(uint32_t gen, int64_t n, int64_t* i) {
    uint64_t c = claim_.load();
    while ((c >> 32) == gen && static_cast<int64_t>(c & kMaxTasks) < n) {
      if (claim_.compare_exchange_weak(c, c + 1)) {
        *i = static_cast<int64_t>(c & kMaxTasks);
        return true;
      }
    }
    return false;
  }

  void RunTasks(int worker, uint32_t gen, int64_t n, const Task* task) {
    bool first = worker != 0;
    for (int64_t i = 0; Claim(gen, n, &i);) {
      if (first) {
        uint64_t zero = 0;
        joined_ns_.compare_exchange_strong(zero, Now());
        first = false;
      }
      try {
        (*task)(i, worker);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu_);
        if (!error_) error_ = std::current_exception();
      }
      if (done_.fetch_add(1) + 1 == n) {
        std::lock_guard<std::mutex> lock(mu_);
        done_cv_.notify_one();
      }
    }
  }

  void WorkerLoop(int worker) {
    uint64_t seen = 0;
    while (true) {
      const uint64_t spin = SpinNs();
      if (spin > 0) {
        const uint64_t until = Now() + spin;
        while (generation_.load(std::memory_order_acquire) == seen && !stop_.load() &&
               Now() < until) {
#if defined(__x86_64__) || defined(__i386__)
          __builtin_ia32_pause();
#endif
        }
      }
      uint32_t gen;
      int64_t n;
      const Task* task;
      {
        std::unique_lock<std::mutex> lock(mu_);
        start_cv_.wait(lock, [&] { return stop_.load() || generation_.load() != seen; });
        if (stop_.load()) return;
        seen = generation_.load();
        // The call of that generation, as one snapshot (null when it has already returned).
        gen = static_cast<uint32_t>(seen);
        n = n_.load();
        task = task_;
      }
      if (task) RunTasks(worker, gen, n, task);
    }
  }

  std::vector<std::thread> threads_;
  std::mutex call_mu_;  // held for a whole ParallelFor: one call at a time
  std::mutex mu_;
  std::condition_variable start_cv_, done_cv_;
  const Task* task_ = nullptr;
  std::atomic<int64_t> n_{0};
  // Claims: (generation of the call) << 32 | (its next unclaimed index).
  static constexpr uint64_t kMaxTasks = 0xffffffffu;
  std::atomic<uint64_t> claim_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<uint64_t> generation_{0};
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> joined_ns_{0};
  std::exception_ptr error_;
};

}  // namespace pigjax

#endif  // PIGJAX_XLA_FFI_THREAD_POOL_H_
