#include "room_check.h"

#include <poll.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <string>

namespace flexium {
namespace {

RoomAnswer unknown(const std::string &why) {
  RoomAnswer answer;
  answer.why_unknown = why;
  return answer;
}

int remaining_ms(std::chrono::steady_clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
  return left.count() > 0 ? static_cast<int>(left.count()) : 0;
}

}  // namespace

RoomAnswer ask_free_memory(const RoomQuery &query) {
  if (query.request_fd < 0 || query.reply_fd < 0) return unknown("no NVML reader");
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(query.timeout_ms);
  const std::string request = "free " + query.uuid + "\n";
  std::size_t sent = 0;
  while (sent < request.size()) {
    pollfd out{query.request_fd, POLLOUT, 0};
    if (poll(&out, 1, remaining_ms(deadline)) <= 0) return unknown("the NVML reader took no request in time");
    const ssize_t n = write(query.request_fd, request.data() + sent, request.size() - sent);
    if (n < 0 && errno != EINTR && errno != EAGAIN) return unknown("the NVML reader's pipe is closed");
    if (n > 0) sent += static_cast<std::size_t>(n);
  }
  std::string line;
  for (;;) {
    pollfd in{query.reply_fd, POLLIN, 0};
    if (poll(&in, 1, remaining_ms(deadline)) <= 0) return unknown("the NVML reader gave no answer in time");
    char c = 0;
    const ssize_t n = read(query.reply_fd, &c, 1);  // one byte at a time: nothing past the line is taken
    if (n == 0) return unknown("the NVML reader's pipe is closed");
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      return unknown("the NVML reader's pipe failed");
    }
    if (c == '\n') break;
    line.push_back(c);
    if (line.size() > 64) return unknown("the NVML reader's answer is not a number");
  }
  char *end = nullptr;
  errno = 0;
  const long long value = std::strtoll(line.c_str(), &end, 10);
  if (line.empty() || errno != 0 || end == nullptr || *end != '\0') {
    return unknown("the NVML reader's answer is not a number");
  }
  if (value < 0) return unknown("NVML cannot tell the GPU's free memory");
  RoomAnswer answer;
  answer.known = true;
  answer.free_bytes = static_cast<unsigned long long>(value);
  return answer;
}

}  // namespace flexium
