// Says on stderr that a driver call has not returned, while it runs: a restore of memory the driver
// cannot restore never returns (docs/facts.md fact 26), and the job then stops with no word of why.
#pragma once

#include <condition_variable>
#include <mutex>
#include <thread>

namespace flexium {

// Seconds between reports: FLEXIUM_DRIVER_CALL_REPORT_S (a whole number of seconds, at least 1), else 60.
int slow_call_report_seconds();

// Reports `call` (on process `pid`) every slow_call_report_seconds() until destroyed.
class SlowCallReport {
 public:
  SlowCallReport(const char *call, int pid);
  ~SlowCallReport();
  SlowCallReport(const SlowCallReport &) = delete;
  SlowCallReport &operator=(const SlowCallReport &) = delete;

 private:
  void watch(const char *call, int pid, int every_s);

  std::mutex mutex_;
  std::condition_variable returned_;
  bool done_ = false;
  std::thread watcher_;  // none when the thread could not be made
};

}  // namespace flexium
