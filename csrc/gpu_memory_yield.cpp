#include "gpu_memory_yield.h"

#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <string>
#include <thread>

namespace flexium {
namespace {

std::atomic<int> yielder{0};
std::atomic<std::size_t> yields{0};

// Its threads all gone: a killed CUDA process's leader is a zombie at once while its other threads
// still exit, and the driver gives the context's memory back only when the last one has (about 0.1 s
// on an H200). Our own child (the copier) is reaped here, which returns only then; Python's Popen
// reads a reaped child as finished. Another process counts as gone once its /proc entry is.
bool exited(int pid) {
  int status = 0;
  const pid_t reaped = ::waitpid(pid, &status, WNOHANG);
  if (reaped == pid) return true;
  if (reaped == 0) return false;
  return errno == ECHILD && ::access(("/proc/" + std::to_string(pid)).c_str(), F_OK) != 0;
}

}  // namespace

void set_gpu_memory_yielder(int pid) { yielder.store(pid > 0 ? pid : 0); }

int gpu_memory_yielder() { return yielder.load(); }

bool yield_gpu_memory(int wait_ms) {
  const int pid = yielder.exchange(0);
  if (pid <= 0) return false;
  if (::kill(pid, SIGKILL) != 0) return false;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(wait_ms);
  while (!exited(pid) && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  yields.fetch_add(1);
  return true;
}

std::size_t gpu_memory_yields() { return yields.load(); }

}  // namespace flexium
