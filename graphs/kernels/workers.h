// Helper threads for the kernels' long calls (quant_linear.cc, paged_attention.cc). XLA's
// intra-op pool wakes a sleeping thread for each call it is handed, ~10 us on this VM, and a
// one-row decode step makes 121 linear calls of 10-60 us: with the pool, a step's linears read
// their 108 MB at 19 GB/s, with helpers that stay awake between calls at 26-28 GB/s
// (tools/bench_linear_stream.py).
// A helper spins on its slot for kSpinMicros after its last job (yielding the core after the
// first microsecond or two, so other threads that need it run), then sleeps until a call wakes it.
// One caller at a time holds the helpers; a concurrent caller (another device's step) is told no
// and uses XLA's pool.
#pragma once
#include <immintrin.h>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

// One set of helpers per library (every source of it shares them: an inline function's static),
// named for its ISA so that the avx2 and avx512 libraries in one process keep their own.
#define MAXJAX_WORKERS_NAMESPACE_(isa) maxjax_workers_##isa
#define MAXJAX_WORKERS_NAMESPACE(isa) MAXJAX_WORKERS_NAMESPACE_(isa)
namespace MAXJAX_WORKERS_NAMESPACE(MAXJAX_ISA) {

struct Job {            // what a call shares with its helpers; heap-held by shared_ptr
  virtual void work() = 0;     // claims pieces until none is left, counting each one `done`
  virtual ~Job() = default;
  std::atomic<int64_t> done{0};
  int64_t total = 0;           // pieces
};

class Workers {
 public:
  static constexpr int64_t kSpinMicros = 200;

  // the process's helpers, started on first use: `n` = the callers' thread count - 1
  static Workers& get(int n) {
    static Workers* w = new Workers(n);     // never destroyed: its threads outlive exit's order
    return *w;
  }
  int size() const { return static_cast<int>(slots_.size()); }

  // Hands `job` to `k` helpers (at most size()) and returns true, holding them until release();
  // false when another caller holds them.
  bool offer(const std::shared_ptr<Job>& job, int k) {
    if (!busy_.try_lock()) return false;
    for (int h = 0; h < std::min(k, size()); ++h) {
      Slot& s = *slots_[h];
      delete s.job.exchange(new std::shared_ptr<Job>(job));   // a job not yet taken is stale
      if (s.sleeping.load()) {
        std::lock_guard<std::mutex> lock(sleep_);
        wake_.notify_all();
      }
    }
    return true;
  }
  void release() { busy_.unlock(); }

 private:
  struct Slot {
    std::atomic<std::shared_ptr<Job>*> job{nullptr};
    std::atomic<bool> sleeping{false};
  };

  explicit Workers(int n) {
    for (int h = 0; h < n; ++h) {
      slots_.push_back(std::make_unique<Slot>());
      std::thread([this, s = slots_.back().get()] { loop(*s); }).detach();
    }
  }

  void loop(Slot& s) {
    using clock = std::chrono::steady_clock;
    for (;;) {
      const auto start = clock::now();
      std::shared_ptr<Job>* job = nullptr;
      for (int64_t spins = 0; (job = s.job.exchange(nullptr)) == nullptr; ++spins) {
        if (spins < 256) {
          _mm_pause();
          continue;
        }
        if (clock::now() - start < std::chrono::microseconds(kSpinMicros)) {
          std::this_thread::yield();
          continue;
        }
        // Sleep. `sleeping` is published before the slot is read again, and offer() stores the
        // slot before it reads `sleeping`: one of the two sees the other.
        std::unique_lock<std::mutex> lock(sleep_);
        s.sleeping.store(true);
        wake_.wait(lock, [&s] { return s.job.load() != nullptr; });
        s.sleeping.store(false);
        spins = -1;
      }
      (*job)->work();
      delete job;
    }
  }

  std::vector<std::unique_ptr<Slot>> slots_;
  std::mutex busy_, sleep_;
  std::condition_variable wake_;
};

// Runs `job` on this thread and `extra` more: the helpers when this caller gets them, tasks of
// XLA's `pool` otherwise and for any beyond the helpers. Returns once every piece is done; while
// it waits for pieces another thread claimed it spins `spin` pauses, then yields the core (on a
// busy machine that thread may be waiting for it).
template <class Pool>
void run_shared(Pool& pool, const std::shared_ptr<Job>& job, int64_t extra, int spin) {
  Workers* held = nullptr;
  if (extra > 0) {
    Workers& helpers = Workers::get(pool.num_threads() - 1);
    if (helpers.offer(job, extra)) held = &helpers;
    for (int64_t t = held ? helpers.size() : 0; t < extra; ++t)
      pool.Schedule([job] { job->work(); });
  }
  job->work();
  for (int spins = 0; job->done.load(std::memory_order_acquire) < job->total; ++spins)
    spins < spin ? _mm_pause() : std::this_thread::yield();
  if (held) held->release();
}

}  // namespace MAXJAX_WORKERS_NAMESPACE(MAXJAX_ISA)
using namespace MAXJAX_WORKERS_NAMESPACE(MAXJAX_ISA);
