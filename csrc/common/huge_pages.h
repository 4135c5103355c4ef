// Anonymous memory on a 2 MiB boundary, advised for transparent huge pages: the one way hf_zero maps it, for the
// optimizer states it allocates itself (adam/state_alloc.cpp) and the large-block host cache (alloc/host_cache.cpp).
// Linux only; callers guard with `defined(__linux__) && defined(MADV_HUGEPAGE)`.
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

namespace hf_zero {

constexpr size_t kHugePageBytes = size_t{2} << 20;

#if defined(__linux__) && defined(MADV_HUGEPAGE)
inline size_t round_up_to_page(size_t n) {
  static const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return (n + page - 1) / page * page;
}

// `length` bytes (page-rounded) of zero-filled memory starting on a 2 MiB boundary, MADV_HUGEPAGE advised; nullptr
// when the mapping fails. Free with munmap(p, length). Over-maps by one huge page, then unmaps the head before the
// first 2 MiB boundary and the tail after `length`, so exactly `length` bytes stay mapped: the tail past the last
// 2 MiB boundary is ordinary pages and no memory is added. Where THP is off ("never", or a kernel without it) the
// advice fails and the pages are ordinary ones: still correct memory.
inline void* map_huge_page_aligned(size_t length) {
  const size_t mapped = length + kHugePageBytes;
  void* raw = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) {
    return nullptr;
  }
  const uintptr_t begin = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t aligned = (begin + kHugePageBytes - 1) & ~(uintptr_t{kHugePageBytes} - 1);
  if (aligned > begin) {
    munmap(raw, aligned - begin);
  }
  const uintptr_t end = begin + mapped;
  if (end > aligned + length) {
    munmap(reinterpret_cast<void*>(aligned + length), end - (aligned + length));
  }
  void* data = reinterpret_cast<void*>(aligned);
  madvise(data, length, MADV_HUGEPAGE);
  return data;
}
#endif

}  // namespace hf_zero
