// The checksum every fast move proves itself with (docs/fast-path.md, "Every move proves itself"):
// computed on the GPU over the bytes before they move and over what landed, compared before the
// job goes on. A small kernel loaded from PTX text through the driver table, so the build needs
// no CUDA toolkit; the simulated driver computes the same function on the host.
//
// The function, over the bytes of one range read as little-endian 64-bit words w[k] (a last
// partial word padded with zero bytes), the range's first word numbered `first_word`:
//   sum over k of mix(w[k], first_word + k)   (mod 2^64), where for a word w numbered i
//   x = w ^ (i * 0x9E3779B97F4A7C15);  z = (x ^ (x >> 31)) * 0xBF58476D1CE4E5B9;  mix = z ^ (z >> 29)
// mix is a bijection of w for each i, so any one changed word changes the sum; the position makes
// swapped words count. A segment's checksum is the sum over its live ranges, each numbered from
// its offset in the segment (offset / 8). python/flexium/engine/fast/checksum.py has it in Python.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <vector>

#include "cuda_driver_types.h"
#include "driver_table.h"
#include "vmm_relocate.h"

namespace flexium {

struct ChecksumRange {
  CUdeviceptr address = 0;
  std::size_t length = 0;
  std::uint64_t first_word = 0;
};

// The checksum of each range, in the current context (whose device must be able to read them).
// Throws DriverError naming the failed call, or for a driver without FLEXIUM_CHECKSUM_FUNCTIONS.
std::vector<std::uint64_t> checksum_ranges_here(const DriverTable &d, const std::vector<ChecksumRange> &ranges);

// The same in `device`'s primary context.
std::vector<std::uint64_t> checksum_ranges(int device, const std::vector<ChecksumRange> &ranges);

// Loads the kernel into `device`'s primary context now, if it is not loaded there yet: the driver compiles
// the PTX as it loads it (107 ms on an H200, fact `move-checksum-cost`), which a move's downtime should not
// carry. The context must be the job's own (active), as a module lives as long as its context.
void load_checksum_kernel(int device);

// The ranges of a segment's live bytes at `base` (the segment's address, or a copy's), each
// numbered from its offset in the segment.
std::vector<ChecksumRange> segment_ranges(const Segment &segment, CUdeviceptr base, const LiveRanges &live);

// The checksum of every backed segment of `device`: the sum of its live ranges' (mod 2^64).
std::map<CUdeviceptr, std::uint64_t> segment_checksums(int device, const LiveRanges &live = {});

// The function on bytes in host memory (what the kernel leaves to the host: a range's tail).
std::uint64_t checksum_host(const unsigned char *bytes, std::size_t length, std::uint64_t first_word);

}  // namespace flexium
