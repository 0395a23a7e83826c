// Says on stderr that a driver call has not returned, while it runs: a checkpoint call that never
// returned would stop the job with no word of why (none is known to today; a failed restore of
// memory the driver cannot restore looked like one at first, fact `cumem-host-memory-unrestorable`).
#pragma once

#include <condition_variable>
#include <mutex>
#include <thread>

namespace flexium {

// FLEXIUM_DRIVER_CALL_REPORT_S: the seconds between reports, 60 when unset; 0 when it is not a whole
// number of seconds from 1 to 86400 (flexium.init() refuses that; a report then comes every 60 s).
int driver_call_report_setting();

// Reports `call` (on process `pid`) every driver_call_report_setting() seconds until destroyed.
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
