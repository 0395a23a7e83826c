// The driver's process checkpoint API, on this process or another pid.
#pragma once

#include <string>
#include <vector>

#include "cuda_driver_types.h"
#include "room_check.h"

namespace flexium {

struct GpuPair {
  std::string old_uuid;  // the GPU the process is on now
  std::string new_uuid;  // where that GPU's state goes
};

// Single primitives; each throws DriverError.
CUprocessState process_state(int pid);
int restore_thread_id(int pid);
void lock_process(int pid, unsigned timeout_ms);
void checkpoint_process(int pid);
void restore_process(int pid, const std::vector<GpuPair> &pairs);  // empty: restore in place
void unlock_process(int pid);

// Recover: whatever brings the process back to RUNNING where it was, read from its state:
// CHECKPOINTED -> restore in place + unlock, LOCKED -> unlock, RUNNING -> nothing.
// A failed remapped restore leaves the process CHECKPOINTED and a plain restore brings it
// back on the source GPU (fact `failed-restore-stays-checkpointed`).
// RoomCheck: no driver call; fails (CUDA_ERROR_OUT_OF_MEMORY) when the GPU it asks about has less
// free memory than the restore after it needs (room_check.h).
enum class StepKind { Lock, Checkpoint, Restore, Unlock, Recover, RoomCheck };
const char *step_name(StepKind kind);

struct Step {
  StepKind kind = StepKind::Lock;
  unsigned timeout_ms = 0;                  // Lock only
  std::vector<CUcheckpointGpuPair> pairs;   // Restore only; empty restores in place
  RoomQuery room;                           // RoomCheck only
};
Step make_step(StepKind kind, unsigned timeout_ms, const std::vector<GpuPair> &pairs);
Step make_room_step(const RoomQuery &room);

struct StepOutcome {
  std::string step;
  bool rollback = false;
  CUresult code = CUDA_SUCCESS;
  std::string error_name;
  std::string error_text;
  double seconds = 0.0;
};

// Runs `steps` in order. When step i fails, runs rollbacks[i] (all of it, whatever fails) and stops.
// The whole locked section runs in one call on purpose: while the process is locked every CUDA
// call of any thread blocks (fact `locked-process-blocks-cuda`), so re-taking the GIL between lock and unlock can
// deadlock against a thread that holds the GIL inside a CUDA call. The caller releases the GIL.
std::vector<StepOutcome> run_steps(int pid, const std::vector<Step> &steps,
                                   const std::vector<std::vector<Step>> &rollbacks);

}  // namespace flexium
