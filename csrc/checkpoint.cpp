#include "checkpoint.h"

#include <chrono>
#include <stdexcept>

#include "driver_error.h"
#include "driver_table.h"
#include "slow_call_report.h"
#include "uuid.h"

namespace flexium {
namespace {

#define FLEXIUM_DRIVER_WITH(name, function)  \
  const DriverTable &name() {                \
    const DriverTable &d = require_driver(); \
    FLEXIUM_REQUIRE_FUNCTION(d, function);   \
    return d;                                \
  }
FLEXIUM_DRIVER_WITH(driver_with_lock, cuCheckpointProcessLock)
FLEXIUM_DRIVER_WITH(driver_with_checkpoint, cuCheckpointProcessCheckpoint)
FLEXIUM_DRIVER_WITH(driver_with_restore, cuCheckpointProcessRestore)
FLEXIUM_DRIVER_WITH(driver_with_unlock, cuCheckpointProcessUnlock)
#undef FLEXIUM_DRIVER_WITH

// Every checkpoint function: a step sequence (Recover) may call any of them.
const DriverTable &checkpoint_driver() {
  const DriverTable &d = require_driver();
#define FLEXIUM_REQUIRE_CHECKPOINT(name, version, required) FLEXIUM_REQUIRE_FUNCTION(d, name);
  FLEXIUM_CHECKPOINT_FUNCTIONS(FLEXIUM_REQUIRE_CHECKPOINT)
#undef FLEXIUM_REQUIRE_CHECKPOINT
  return d;
}

std::vector<CUcheckpointGpuPair> parse_pairs(const std::vector<GpuPair> &pairs) {
  std::vector<CUcheckpointGpuPair> parsed;
  parsed.reserve(pairs.size());
  for (const GpuPair &pair : pairs) {
    CUcheckpointGpuPair p{};
    p.oldUuid = parse_uuid(pair.old_uuid);
    p.newUuid = parse_uuid(pair.new_uuid);
    parsed.push_back(p);
  }
  return parsed;
}

CUresult call_step(const DriverTable &d, int pid, const Step &step) {
  switch (step.kind) {
    case StepKind::Lock: {
      CUcheckpointLockArgs args{};
      args.timeoutMs = step.timeout_ms;
      return d.cuCheckpointProcessLock(pid, &args);
    }
    case StepKind::Checkpoint: {
      CUcheckpointCheckpointArgs args{};
      return d.cuCheckpointProcessCheckpoint(pid, &args);
    }
    case StepKind::Restore: {
      if (step.pairs.empty()) return d.cuCheckpointProcessRestore(pid, nullptr);
      CUcheckpointRestoreArgs args{};
      // The driver wants every visible GPU in gpuPairs, a permutation (fact `restore-pairs-every-gpu`).
      args.gpuPairs = const_cast<CUcheckpointGpuPair *>(step.pairs.data());
      args.gpuPairsCount = static_cast<unsigned int>(step.pairs.size());
      return d.cuCheckpointProcessRestore(pid, &args);
    }
    case StepKind::Unlock: {
      CUcheckpointUnlockArgs args{};
      return d.cuCheckpointProcessUnlock(pid, &args);
    }
    case StepKind::Recover: break;    // expanded by run_step into the calls it needs
    case StepKind::RoomCheck: break;  // no driver call: room_outcome
  }
  return CUDA_ERROR_INVALID_VALUE;
}

const char *driver_call_name(StepKind kind) {
  switch (kind) {
    case StepKind::Lock: return "cuCheckpointProcessLock";
    case StepKind::Checkpoint: return "cuCheckpointProcessCheckpoint";
    case StepKind::Restore: return "cuCheckpointProcessRestore";
    case StepKind::Unlock: return "cuCheckpointProcessUnlock";
    case StepKind::Recover: break;
    case StepKind::RoomCheck: break;
  }
  return "a checkpoint call";
}

// The outcome of `step`, named and timed around `body`, which sets its code (and may say more);
// a failure without words of its own gets the driver's.
template <typename Body>
StepOutcome timed(const Step &step, bool rollback, Body body) {
  StepOutcome outcome;
  outcome.step = step_name(step.kind);
  outcome.rollback = rollback;
  const auto start = std::chrono::steady_clock::now();
  body(outcome);
  outcome.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (outcome.code != CUDA_SUCCESS) {
    outcome.error_name = error_name(outcome.code);
    if (outcome.error_text.empty()) outcome.error_text = error_text(outcome.code);
  }
  return outcome;
}

StepOutcome timed_step(const DriverTable &d, int pid, const Step &step, bool rollback) {
  return timed(step, rollback, [&](StepOutcome &outcome) {
    SlowCallReport report(driver_call_name(step.kind), pid);
    outcome.code = call_step(d, pid, step);
  });
}

StepOutcome room_outcome(const Step &step, bool rollback) {
  return timed(step, rollback, [&](StepOutcome &outcome) {
    const RoomAnswer answer = ask_free_memory(step.room);
    if (!answer.known) {
      outcome.error_text = "not checked: " + answer.why_unknown;  // as before this check existed
    } else if (answer.free_bytes < step.room.needed) {
      outcome.code = CUDA_ERROR_OUT_OF_MEMORY;
      outcome.error_text = step.room.uuid + " has " + std::to_string(answer.free_bytes >> 20) +
                           " MiB free, the restore needs " + std::to_string(step.room.needed >> 20) + " MiB";
    }
  });
}

// Appends the outcome of `step` (or, for Recover, of each call it makes); returns false on failure.
bool run_step(const DriverTable &d, int pid, const Step &step, bool rollback, std::vector<StepOutcome> &out) {
  if (step.kind == StepKind::RoomCheck) {
    out.push_back(room_outcome(step, rollback));
    return out.back().code == CUDA_SUCCESS;
  }
  if (step.kind != StepKind::Recover) {
    out.push_back(timed_step(d, pid, step, rollback));
    return out.back().code == CUDA_SUCCESS;
  }
  CUprocessState state = CU_PROCESS_STATE_CHECKPOINTED;
  if (d.cuCheckpointProcessGetState(pid, &state) != CUDA_SUCCESS) state = CU_PROCESS_STATE_CHECKPOINTED;
  if (state == CU_PROCESS_STATE_RUNNING) return true;
  bool ok = true;
  if (state == CU_PROCESS_STATE_CHECKPOINTED || state == CU_PROCESS_STATE_FAILED) {
    Step restore;
    restore.kind = StepKind::Restore;
    out.push_back(timed_step(d, pid, restore, rollback));
    ok = out.back().code == CUDA_SUCCESS;
  }
  Step unlock;
  unlock.kind = StepKind::Unlock;
  out.push_back(timed_step(d, pid, unlock, rollback));
  return ok && out.back().code == CUDA_SUCCESS;
}

void check_step(const DriverTable &d, int pid, const Step &step, const char *call) {
  const StepOutcome outcome = timed_step(d, pid, step, false);
  if (outcome.code != CUDA_SUCCESS)
    throw DriverError(call, outcome.code, "pid " + std::to_string(pid), __FILE__, __LINE__);
}

}  // namespace

const char *step_name(StepKind kind) {
  switch (kind) {
    case StepKind::Lock: return "lock";
    case StepKind::Checkpoint: return "checkpoint";
    case StepKind::Restore: return "restore";
    case StepKind::Unlock: return "unlock";
    case StepKind::Recover: return "recover";
    case StepKind::RoomCheck: return "room";
  }
  return "unknown";
}

Step make_step(StepKind kind, unsigned timeout_ms, const std::vector<GpuPair> &pairs) {
  if (kind != StepKind::Restore && !pairs.empty()) {
    throw std::invalid_argument(std::string("GPU pairs apply to restore only, not to ") + step_name(kind));
  }
  Step step;
  step.kind = kind;
  step.timeout_ms = timeout_ms;
  step.pairs = parse_pairs(pairs);
  return step;
}

Step make_room_step(const RoomQuery &room) {
  Step step;
  step.kind = StepKind::RoomCheck;
  step.room = room;
  return step;
}

CUprocessState process_state(int pid) {
  const DriverTable &d = require_driver();
  FLEXIUM_REQUIRE_FUNCTION(d, cuCheckpointProcessGetState);
  CUprocessState state = CU_PROCESS_STATE_RUNNING;
  FLEXIUM_CU_CALL(d, cuCheckpointProcessGetState, pid, &state);
  return state;
}

int restore_thread_id(int pid) {
  const DriverTable &d = require_driver();
  FLEXIUM_REQUIRE_FUNCTION(d, cuCheckpointProcessGetRestoreThreadId);
  int tid = 0;
  FLEXIUM_CU_CALL(d, cuCheckpointProcessGetRestoreThreadId, pid, &tid);
  return tid;
}

void lock_process(int pid, unsigned timeout_ms) {
  check_step(driver_with_lock(), pid, make_step(StepKind::Lock, timeout_ms, {}), "cuCheckpointProcessLock");
}

void checkpoint_process(int pid) {
  check_step(driver_with_checkpoint(), pid, make_step(StepKind::Checkpoint, 0, {}), "cuCheckpointProcessCheckpoint");
}

void restore_process(int pid, const std::vector<GpuPair> &pairs) {
  check_step(driver_with_restore(), pid, make_step(StepKind::Restore, 0, pairs), "cuCheckpointProcessRestore");
}

void unlock_process(int pid) {
  check_step(driver_with_unlock(), pid, make_step(StepKind::Unlock, 0, {}), "cuCheckpointProcessUnlock");
}

std::vector<StepOutcome> run_steps(int pid, const std::vector<Step> &steps,
                                   const std::vector<std::vector<Step>> &rollbacks) {
  const DriverTable &d = checkpoint_driver();
  std::vector<StepOutcome> outcomes;
  for (std::size_t i = 0; i < steps.size(); ++i) {
    if (run_step(d, pid, steps[i], false, outcomes)) continue;
    if (i < rollbacks.size()) {
      for (const Step &undo : rollbacks[i]) run_step(d, pid, undo, true, outcomes);
    }
    break;
  }
  return outcomes;
}

}  // namespace flexium
