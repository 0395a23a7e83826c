#include "uuid.h"

#include <cctype>
#include <stdexcept>

namespace flexium {

std::string format_uuid(const CUuuid &uuid) {
  static const char *hex = "0123456789abcdef";
  std::string out = "GPU-";
  for (int i = 0; i < 16; ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) out += '-';
    const auto byte = static_cast<unsigned char>(uuid.bytes[i]);
    out += hex[byte >> 4];
    out += hex[byte & 0xf];
  }
  return out;
}

CUuuid parse_uuid(const std::string &text) {
  std::string digits;
  std::size_t start = text.rfind("GPU-", 0) == 0 ? 4 : 0;
  for (std::size_t i = start; i < text.size(); ++i) {
    const char c = text[i];
    if (c == '-') continue;
    if (!std::isxdigit(static_cast<unsigned char>(c))) {
      throw std::invalid_argument("not a GPU UUID: '" + text + "' (bad character '" + std::string(1, c) + "')");
    }
    digits += c;
  }
  if (digits.size() != 32) {
    throw std::invalid_argument("not a GPU UUID: '" + text + "' (expected 32 hex digits, got " +
                                std::to_string(digits.size()) + ")");
  }
  CUuuid uuid{};
  for (int i = 0; i < 16; ++i) {
    uuid.bytes[i] = static_cast<char>(std::stoi(digits.substr(static_cast<std::size_t>(2 * i), 2), nullptr, 16));
  }
  return uuid;
}

}  // namespace flexium
