// Vendor rules relied on:
//  - the driver JIT-compiles PTX for the GPU it loads on (cuModuleLoadData docs), so PTX written for sm_50
//    runs on every GPU flexium moves; a module lives as long as its context.
//  - work on the legacy default stream (0) waits for the context's blocking streams and runs in issue order, and
//    cuMemcpyDtoH returns once the bytes are on the host: memset, kernels and the read of their sums need no
//    stream of their own.
#include "move_checksum.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <string>

#include "driver_error.h"
#include "vmm_driver.h"
#include "vmm_registry.h"

namespace flexium {
namespace {

// flexium_move_checksum(words, pairs, first_word, out): adds to *out the checksum of `pairs` pairs
// of 64-bit words at `words` (16-byte aligned), the first word numbered `first_word`. A grid-stride
// loop with one 16-byte load per pair, each thread's sum reduced over its warp by shuffles, one
// atomic add per warp: the order of additions never matters (mod 2^64).
constexpr char kChecksumPtx[] = R"PTX(
.version 6.0
.target sm_50
.address_size 64

.visible .entry flexium_move_checksum(
	.param .u64 param_words,
	.param .u64 param_pairs,
	.param .u64 param_first_word,
	.param .u64 param_out
)
{
	.reg .pred 	%p<4>;
	.reg .b32 	%r<12>;
	.reg .b64 	%rd<24>;

	ld.param.u64 	%rd1, [param_words];
	ld.param.u64 	%rd2, [param_pairs];
	ld.param.u64 	%rd3, [param_first_word];
	ld.param.u64 	%rd4, [param_out];
	cvta.to.global.u64 	%rd1, %rd1;
	cvta.to.global.u64 	%rd4, %rd4;
	mov.u32 	%r1, %ctaid.x;
	mov.u32 	%r2, %ntid.x;
	mov.u32 	%r3, %tid.x;
	mov.u32 	%r4, %nctaid.x;
	mul.wide.u32 	%rd5, %r1, %r2;
	cvt.u64.u32 	%rd6, %r3;
	add.u64 	%rd5, %rd5, %rd6;
	mul.wide.u32 	%rd7, %r4, %r2;
	mov.u64 	%rd8, 0;
	setp.ge.u64 	%p1, %rd5, %rd2;
	@%p1 bra 	REDUCE;
LOOP:
	shl.b64 	%rd9, %rd5, 4;
	add.u64 	%rd9, %rd1, %rd9;
	ld.global.nc.v2.u64 	{%rd10, %rd11}, [%rd9];
	shl.b64 	%rd12, %rd5, 1;
	add.u64 	%rd12, %rd12, %rd3;
	mul.lo.u64 	%rd13, %rd12, 0x9E3779B97F4A7C15U;
	xor.b64 	%rd13, %rd13, %rd10;
	shr.u64 	%rd14, %rd13, 31;
	xor.b64 	%rd13, %rd13, %rd14;
	mul.lo.u64 	%rd13, %rd13, 0xBF58476D1CE4E5B9U;
	shr.u64 	%rd14, %rd13, 29;
	xor.b64 	%rd13, %rd13, %rd14;
	add.u64 	%rd8, %rd8, %rd13;
	add.u64 	%rd15, %rd12, 1;
	mul.lo.u64 	%rd16, %rd15, 0x9E3779B97F4A7C15U;
	xor.b64 	%rd16, %rd16, %rd11;
	shr.u64 	%rd17, %rd16, 31;
	xor.b64 	%rd16, %rd16, %rd17;
	mul.lo.u64 	%rd16, %rd16, 0xBF58476D1CE4E5B9U;
	shr.u64 	%rd17, %rd16, 29;
	xor.b64 	%rd16, %rd16, %rd17;
	add.u64 	%rd8, %rd8, %rd16;
	add.u64 	%rd5, %rd5, %rd7;
	setp.lt.u64 	%p2, %rd5, %rd2;
	@%p2 bra 	LOOP;
REDUCE:
	mov.b64 	{%r5, %r6}, %rd8;
	shfl.sync.down.b32 	%r7, %r5, 16, 31, -1;
	shfl.sync.down.b32 	%r8, %r6, 16, 31, -1;
	mov.b64 	%rd18, {%r7, %r8};
	add.u64 	%rd8, %rd8, %rd18;
	mov.b64 	{%r5, %r6}, %rd8;
	shfl.sync.down.b32 	%r7, %r5, 8, 31, -1;
	shfl.sync.down.b32 	%r8, %r6, 8, 31, -1;
	mov.b64 	%rd18, {%r7, %r8};
	add.u64 	%rd8, %rd8, %rd18;
	mov.b64 	{%r5, %r6}, %rd8;
	shfl.sync.down.b32 	%r7, %r5, 4, 31, -1;
	shfl.sync.down.b32 	%r8, %r6, 4, 31, -1;
	mov.b64 	%rd18, {%r7, %r8};
	add.u64 	%rd8, %rd8, %rd18;
	mov.b64 	{%r5, %r6}, %rd8;
	shfl.sync.down.b32 	%r7, %r5, 2, 31, -1;
	shfl.sync.down.b32 	%r8, %r6, 2, 31, -1;
	mov.b64 	%rd18, {%r7, %r8};
	add.u64 	%rd8, %rd8, %rd18;
	mov.b64 	{%r5, %r6}, %rd8;
	shfl.sync.down.b32 	%r7, %r5, 1, 31, -1;
	shfl.sync.down.b32 	%r8, %r6, 1, 31, -1;
	mov.b64 	%rd18, {%r7, %r8};
	add.u64 	%rd8, %rd8, %rd18;
	and.b32 	%r9, %r3, 31;
	setp.ne.u32 	%p3, %r9, 0;
	@%p3 bra 	DONE;
	red.global.add.u64 	[%rd4], %rd8;
DONE:
	ret;
}
)PTX";

constexpr char kKernelName[] = "flexium_move_checksum";
constexpr unsigned int kThreadsPerBlock = 256;
constexpr std::size_t kMaxBlocks = 4096;  // enough to keep every SM of an H200 busy; the loop strides
constexpr std::size_t kPairBytes = 16;
constexpr std::size_t kHostSliceBytes = std::size_t{16} << 20;  // a multiple of 8: word numbers stay whole

constexpr std::uint64_t kPositionMultiplier = 0x9E3779B97F4A7C15ull;
constexpr std::uint64_t kMixMultiplier = 0xBF58476D1CE4E5B9ull;

std::uint64_t mix(std::uint64_t word, std::uint64_t number) {
  std::uint64_t x = word ^ (number * kPositionMultiplier);
  x = (x ^ (x >> 31)) * kMixMultiplier;
  return x ^ (x >> 29);
}

void require_checksum_driver(const DriverTable &d) {
#define FLEXIUM_REQUIRE_CHECKSUM(name, version, required) FLEXIUM_REQUIRE_FUNCTION(d, name);
  FLEXIUM_CHECKSUM_FUNCTIONS(FLEXIUM_REQUIRE_CHECKSUM)
#undef FLEXIUM_REQUIRE_CHECKSUM
}

// The kernel in the current context, loaded once per context: it lives as long as the context
// (the job's, which a checkpoint and restore keep), so the module is never unloaded.
CUfunction kernel_here(const DriverTable &d) {
  static std::mutex mutex;
  static std::map<CUcontext, CUfunction> loaded;
  CUcontext context = nullptr;
  FLEXIUM_CU_CALL(d, cuCtxGetCurrent, &context);
  std::lock_guard<std::mutex> guard(mutex);
  const auto found = loaded.find(context);
  if (found != loaded.end()) return found->second;
  CUmodule module = nullptr;
  FLEXIUM_CU_CALL(d, cuModuleLoadData, &module, kChecksumPtx);
  CUfunction function = nullptr;
  const CUresult got = d.cuModuleGetFunction(&function, module, kKernelName);
  if (got != CUDA_SUCCESS) {
    d.cuModuleUnload(module);
    throw DriverError("cuModuleGetFunction", got, kKernelName, __FILE__, __LINE__);
  }
  loaded[context] = function;
  return function;
}

// One 64-bit sum per range in memory of the current context's GPU, zeroed; freed at the end of the scope.
class DeviceSums {
 public:
  DeviceSums(const DriverTable &d, std::size_t count) : d_(d), count_(count) {
    FLEXIUM_CU_CALL(d_, cuMemAlloc, &address_, bytes());
    try {
      FLEXIUM_CU_CALL(d_, cuMemsetD8, address_, 0, bytes());
    } catch (...) {
      d_.cuMemFree(address_);
      throw;
    }
  }
  ~DeviceSums() { d_.cuMemFree(address_); }
  DeviceSums(const DeviceSums &) = delete;
  DeviceSums &operator=(const DeviceSums &) = delete;
  CUdeviceptr address() const { return address_; }
  // Waits for the kernels before it (legacy default stream) and reads their sums.
  std::vector<std::uint64_t> read() const {
    std::vector<std::uint64_t> sums(count_, 0);
    FLEXIUM_CU_CALL(d_, cuMemcpyDtoH, sums.data(), address_, bytes());
    return sums;
  }

 private:
  std::size_t bytes() const { return count_ * sizeof(std::uint64_t); }
  const DriverTable &d_;
  std::size_t count_;
  CUdeviceptr address_ = 0;
};

// A range the kernel cannot read with 16-byte loads, through the host in slices.
std::uint64_t checksum_through_host(const DriverTable &d, const ChecksumRange &range) {
  std::vector<unsigned char> slice(std::min(range.length, kHostSliceBytes));
  std::uint64_t sum = 0;
  for (std::size_t done = 0; done < range.length; done += slice.size()) {
    const std::size_t length = std::min(slice.size(), range.length - done);
    FLEXIUM_CU_CALL(d, cuMemcpyDtoH, slice.data(), range.address + done, length);
    sum += checksum_host(slice.data(), length, range.first_word + done / 8);
  }
  return sum;
}

}  // namespace

std::uint64_t checksum_host(const unsigned char *bytes, std::size_t length, std::uint64_t first_word) {
  std::uint64_t sum = 0;
  for (std::size_t k = 0; k * 8 < length; ++k) {
    std::uint64_t word = 0;
    const std::size_t here = std::min<std::size_t>(8, length - k * 8);
    for (std::size_t b = 0; b < here; ++b) word |= std::uint64_t{bytes[k * 8 + b]} << (8 * b);
    sum += mix(word, first_word + k);
  }
  return sum;
}

std::vector<std::uint64_t> checksum_ranges_here(const DriverTable &d, const std::vector<ChecksumRange> &ranges) {
  std::vector<std::uint64_t> sums(ranges.size(), 0);
  if (ranges.empty()) return sums;
  require_checksum_driver(d);
  const CUfunction kernel = kernel_here(d);
  DeviceSums out(d, ranges.size());
  for (std::size_t k = 0; k < ranges.size(); ++k) {
    const ChecksumRange &range = ranges[k];
    if (range.address % kPairBytes != 0) {
      sums[k] += checksum_through_host(d, range);
      continue;
    }
    CUdeviceptr words = range.address;
    std::uint64_t pairs = range.length / kPairBytes;
    std::uint64_t first_word = range.first_word;
    CUdeviceptr slot = out.address() + k * sizeof(std::uint64_t);
    if (pairs > 0) {
      const std::size_t wanted = (pairs + kThreadsPerBlock - 1) / kThreadsPerBlock;
      const auto blocks = static_cast<unsigned int>(std::min(wanted, kMaxBlocks));
      void *arguments[] = {&words, &pairs, &first_word, &slot};
      FLEXIUM_CU_CALL(d, cuLaunchKernel, kernel, blocks, 1, 1, kThreadsPerBlock, 1, 1, 0, nullptr, arguments, nullptr);
    }
    const std::size_t tail = range.length - pairs * kPairBytes;
    if (tail > 0) {
      unsigned char bytes[kPairBytes] = {};
      FLEXIUM_CU_CALL(d, cuMemcpyDtoH, bytes, range.address + pairs * kPairBytes, tail);
      sums[k] += checksum_host(bytes, tail, range.first_word + 2 * pairs);
    }
  }
  const std::vector<std::uint64_t> on_device = out.read();
  for (std::size_t k = 0; k < ranges.size(); ++k) sums[k] += on_device[k];
  return sums;
}

std::vector<std::uint64_t> checksum_ranges(int device, const std::vector<ChecksumRange> &ranges) {
  const DriverTable &d = require_vmm_driver();
  ScopedContext context(d, device);
  return checksum_ranges_here(d, ranges);
}

void load_checksum_kernel(int device) {
  const DriverTable &d = require_vmm_driver();
  require_checksum_driver(d);
  ScopedContext context(d, device);
  kernel_here(d);
}

std::vector<ChecksumRange> segment_ranges(const Segment &segment, CUdeviceptr base, const LiveRanges &live) {
  std::vector<ChecksumRange> ranges;
  for (const auto &range : live_ranges_of(segment, live)) {
    ranges.push_back({base + range.first, range.second, range.first / 8});
  }
  return ranges;
}

std::map<CUdeviceptr, std::uint64_t> segment_checksums(int device, const LiveRanges &live) {
  const DriverTable &d = require_vmm_driver();
  RegistryLock lock(kRelocationLockTimeout);
  std::vector<ChecksumRange> ranges;
  std::vector<std::pair<CUdeviceptr, std::size_t>> owners;  // each segment and its number of ranges
  for (const auto &entry : lock.segments()) {
    const Segment &segment = entry.second;
    if (segment.device != device || !segment.mapped) continue;
    const std::vector<ChecksumRange> mine = segment_ranges(segment, segment.address, live);
    ranges.insert(ranges.end(), mine.begin(), mine.end());
    owners.emplace_back(segment.address, mine.size());
  }
  ScopedContext context(d, device);
  const std::vector<std::uint64_t> sums = checksum_ranges_here(d, ranges);
  std::map<CUdeviceptr, std::uint64_t> checksums;
  std::size_t next = 0;
  for (const auto &owner : owners) {
    std::uint64_t &sum = checksums[owner.first];
    for (std::size_t k = 0; k < owner.second; ++k) sum += sums[next++];
  }
  return checksums;
}

}  // namespace flexium
