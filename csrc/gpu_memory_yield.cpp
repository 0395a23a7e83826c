#include "gpu_memory_yield.h"

#include <signal.h>
#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <string>
#include <thread>

namespace flexium {
namespace {

std::atomic<int> yielder{0};
std::atomic<std::size_t> yields{0};

// Gone or a zombie: a zombie's files are closed, so the driver has torn its context down.
bool exited(int pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!stat || !std::getline(stat, line)) return true;
  const std::size_t end = line.rfind(')');
  return end == std::string::npos || end + 2 >= line.size() || line[end + 2] == 'Z' || line[end + 2] == 'X';
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
