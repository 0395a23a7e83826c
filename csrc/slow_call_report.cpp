#include "slow_call_report.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>

namespace flexium {

namespace {
constexpr int kDefaultReportSeconds = 60;
}

int driver_call_report_setting() {
  const char *text = std::getenv("FLEXIUM_DRIVER_CALL_REPORT_S");
  if (text == nullptr || *text == '\0') return kDefaultReportSeconds;
  char *end = nullptr;
  const long seconds = std::strtol(text, &end, 10);
  if (*end != '\0' || seconds < 1 || seconds > 86400) return 0;
  return static_cast<int>(seconds);
}

SlowCallReport::SlowCallReport(const char *call, int pid) {
  const int setting = driver_call_report_setting();
  const int every_s = setting > 0 ? setting : kDefaultReportSeconds;
  try {
    watcher_ = std::thread([this, call, pid, every_s] { watch(call, pid, every_s); });
  } catch (const std::exception &) {  // std::system_error, std::bad_alloc
    // No thread to spare: the call runs unwatched. A locked section must never stop half way.
  }
}

SlowCallReport::~SlowCallReport() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    done_ = true;
  }
  returned_.notify_one();
  if (watcher_.joinable()) watcher_.join();
}

void SlowCallReport::watch(const char *call, int pid, int every_s) {
  std::unique_lock<std::mutex> lock(mutex_);
  for (long waited = every_s;; waited += every_s) {
    if (returned_.wait_for(lock, std::chrono::seconds(every_s), [this] { return done_; })) return;
    // Plain stderr, not Python's logging: the caller may hold the GIL for the whole call.
    std::fprintf(stderr,
                 "[flexium] %s (process %d) has not returned after %ld s: a driver call that never returns "
                 "leaves the process stuck; if it goes on, end the job (kill %d) and start it again from its "
                 "last checkpoint\n",
                 call, pid, waited, pid);
    std::fflush(stderr);
  }
}

}  // namespace flexium
