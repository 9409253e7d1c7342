// ParallelFor: the kernels' one way to share their tasks with XLA's CPU threads.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>

#include "xla/ffi/api/ffi.h"

namespace jaxserve {

// Runs body(i) for every i in [0, n) on the caller and up to threads - 1 tasks of XLA's intra-op
// pool; returns when all n are done. Tasks are handed out one at a time to whoever asks next; a
// pool task that starts after the work is gone returns at once (it holds the shared counters,
// never a finished call's body), and the caller waits only for tasks already taken.
inline void ParallelFor(xla::ffi::ThreadPool& pool, int64_t threads, int64_t n,
                        const std::function<void(int64_t)>& body) {
  struct Shared {
    const std::function<void(int64_t)>* body;
    int64_t n;
    std::atomic<int64_t> next{0}, done{0};
    void Run() {
      for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) {
        (*body)(i);
        done.fetch_add(1, std::memory_order_release);
      }
    }
  };
  auto shared = std::make_shared<Shared>();
  shared->body = &body;
  shared->n = n;
  const int64_t helpers = std::min<int64_t>(threads, n) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([shared] { shared->Run(); });
  shared->Run();
  while (shared->done.load(std::memory_order_acquire) < n) _mm_pause();
}

}  // namespace jaxserve
