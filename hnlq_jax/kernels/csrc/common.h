// What every native kernel shares: the XLA FFI namespace, argument checks, and the split of a
// call's tiles over threads (XLA's intra-op pool, or threads of its own for a direct call).

#ifndef HNLQ_COMMON_H_
#define HNLQ_COMMON_H_

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace hnlq {

inline ffi::Error check(bool ok, const char* kernel, const char* what) {
  return ok ? ffi::Error::Success()
            : ffi::Error::InvalidArgument(std::string(kernel) + ": " + what);
}

// The part of a call's state its threads share: the calling thread and up to threads - 1
// helpers claim tiles (next) until none is left. The calling thread waits only for helpers
// that hold a tile, never for one not yet started, so a busy or absent thread pool cannot
// deadlock the call. A kernel's state derives from it and adds `void (*work)(State&)`, which
// claims and runs tiles.
struct Tasks {
  int64_t tiles = 0;
  std::atomic<int64_t> next{0};
  std::mutex mu;
  std::condition_variable cv;
  int64_t busy = 0;
};

// Units of work (weights decoded, values rotated) worth waking one more thread for: below it
// the handover costs more than it saves (a 64 x 64 layer decodes in about 2 us).
constexpr int64_t kWorkPerThread = int64_t{1} << 16;

// Runs call->work on the calling thread and on up to threads - 1 helpers started by
// schedule(task), one per kWorkPerThread of work.
template <typename State, typename Schedule>
void run_shared(int64_t threads, Schedule schedule, const std::shared_ptr<State>& call,
                int64_t work) {
  const int64_t useful = std::max<int64_t>(1, (work + kWorkPerThread - 1) / kWorkPerThread);
  const int64_t helpers = std::min({threads, call->tiles, useful}) - 1;
  for (int64_t i = 0; i < helpers; ++i) {
    schedule([call] {
      {
        std::lock_guard<std::mutex> lock(call->mu);
        if (call->next.load() >= call->tiles) return;  // nothing left: touch nothing
        ++call->busy;
      }
      call->work(*call);
      std::lock_guard<std::mutex> lock(call->mu);
      if (--call->busy == 0) call->cv.notify_all();
    });
  }
  call->work(*call);
  std::unique_lock<std::mutex> lock(call->mu);
  call->cv.wait(lock, [&] { return call->busy == 0; });
}

// On XLA's intra-op thread pool (a kernel called by XLA).
template <typename State>
void run_on_pool(ffi::ThreadPool& pool, const std::shared_ptr<State>& call, int64_t work) {
  run_shared(pool.num_threads(), [&](std::function<void()> task) {
    pool.Schedule(std::move(task));
  }, call, work);
}

// On threads of its own, joined before it returns (a kernel called directly, without XLA).
template <typename State>
void run_on_threads(int64_t threads, const std::shared_ptr<State>& call, int64_t work) {
  std::vector<std::thread> helpers;
  run_shared(threads, [&](std::function<void()> task) { helpers.emplace_back(std::move(task)); },
             call, work);
  for (std::thread& t : helpers) t.join();
}

// rotate.cc's kernel called directly (module.cc: host buffers, no XLA), on `threads` threads;
// an empty string on success, else the error (as decode_rows.h's decode_direct).
std::string rotate_direct(const float* x, int64_t R, int64_t n, const float* s, const float* B,
                          int64_t k, int64_t m, bool inverse, float* y, int64_t threads);

}  // namespace hnlq

#endif  // HNLQ_COMMON_H_
