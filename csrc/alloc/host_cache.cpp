// hf_zero's caching allocator for large CPU tensors: torch's CPU allocator with the blocks of `min_bytes` and more
// kept when freed and handed out again to the next request of about the same size.
//
// Why: on a CPU run hf_zero fixes glibc's mmap threshold (comm/host_memory.py: 1 MiB at ZeRO-3, 2 MiB below) so
// that freed tensors go back to the kernel instead of staying as holes in the heap -- 200 MB less peak RSS per rank
// at ZeRO-3 on the 32M Llama. The price: every tensor of that size and more is a fresh mmap, each of its pages
// faulted in and zeroed by the kernel on first touch, and unmapped again when freed. A training step allocates the
// same sizes every iteration (activations, their gradients, the parameters' gradients), so a ZeRO-3 rank of the 32M
// Llama faulted ~100k pages (400 MB) per step, ~0.11 s of kernel time at the 1.1 us per fault measured here
// (benchmarks/bench_zero.py counts them). Keeping the freed blocks and reusing them for the next request of the same
// size removes most of those faults.
//
// Policy: a freed block goes to the cache. A request takes a cached block of the smallest size from its own to
// `kFitSlack` more (page-rounded; a much larger block would hold resident bytes nobody uses), the most recently freed
// of that size (its bytes may still be in the CPU's cache), else maps a new one. Two bounds: mapping a new block
// first unmaps the least recently freed cached blocks until live + cached bytes are within the most ever live at once
// (plus `headroom_bytes`, 0 by default), so the cache never raises the peak resident set; and at most `cap_bytes`
// stay cached (what stays mapped once live memory falls far below its peak). trim(), once per optimizer step, unmaps
// the blocks that stayed idle for a whole step: memory a run freed for good (the fp32 weights a cast replaced, a
// finished evaluation) goes back to the kernel within two steps. Below `min_bytes` requests go to the allocator
// registered before (c10's: glibc's heap), as they did before.
//
// Huge pages (`huge_pages`): a new block of 2 MiB or more starts on a 2 MiB boundary and is advised for transparent
// huge pages (MADV_HUGEPAGE; Linux's common THP mode, "madvise", gives them only to regions that ask). A 2 MiB page
// is one fault instead of 512 and one TLB entry instead of 512; the block's length stays page-rounded, so the tail
// past the last 2 MiB boundary is ordinary pages and no memory is added. ZeRO-3 on the 32M Llama: 42k -> 7k faults
// and 5-11% less CPU per step than the cache on 4 KiB pages, peak RSS unchanged (benchmarks/RESULTS.md).
//
// Installed once per process with c10::SetCPUAllocator and never uninstalled: blocks handed out through the raw
// interface (oneDNN's buffers) are freed through whatever allocator is registered at that time, so ours must stay.
// disable() empties the cache and stops caching (blocks freed later are unmapped, new ones mapped), which is what
// the glibc path did.

#include <ATen/ATen.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <torch/library.h>

#include <atomic>
#include <cstdint>
#include <list>
#include <map>
#include <mutex>
#include <new>
#include <string>
#include <unordered_map>
#include <vector>

#include "huge_pages.h"

#if defined(__linux__) && defined(MADV_HUGEPAGE)
#include <pthread.h>
#define HF_ZERO_HOST_CACHE 1
#endif

namespace hf_zero {
namespace {

#if defined(HF_ZERO_HOST_CACHE)

// A request may take a cached block up to this fraction larger than itself.
constexpr double kFitSlack = 0.25;

class HostCache final : public c10::Allocator {
 public:
  static HostCache& get() {
    // Leaked on purpose: tensors freed during interpreter shutdown still call raw_free.
    static HostCache* instance = new HostCache();
    return *instance;
  }

  c10::DataPtr allocate(size_t n) override {
    if (n < min_bytes_.load(std::memory_order_relaxed)) {
      return previous_->allocate(n);  // c10's default: its own deleter, its own profiler reports
    }
    void* p = map_or_reuse(n);
    if (c10::memoryProfilingEnabled()) {
      c10::reportMemoryUsageToProfiler(p, static_cast<int64_t>(n), 0, 0, c10::Device(c10::DeviceType::CPU));
    }
    return {p, p, &raw_free, c10::Device(c10::DeviceType::CPU)};
  }

  // The raw interface (oneDNN's scratch buffers) frees every size through one function, which tells ours from the
  // previous allocator's by looking the pointer up.
  c10::DeleterFnPtr raw_deleter() const override {
    return &raw_free;
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  // Registers the cache as torch's CPU allocator (once); returns why not, or "" once it is.
  std::string install() {
    std::lock_guard<std::mutex> guard(mu_);
    if (!installed_) {
      c10::Allocator* current = c10::GetCPUAllocator();
      if (current->raw_deleter() == nullptr) {
        return "the registered CPU allocator has no raw interface to fall back on";
      }
      previous_ = current;
      c10::SetCPUAllocator(this, kPriority);
      installed_ = c10::GetCPUAllocator() == this;
      if (!installed_) {
        return "torch's CPU allocator was replaced at a higher priority than hf_zero registers at";
      }
    }
    return "";
  }

  void configure(int64_t min_bytes, int64_t cap_bytes, int64_t headroom_bytes, bool huge_pages) {
    TORCH_CHECK(min_bytes > 0 && cap_bytes >= 0 && headroom_bytes >= 0, "hf_zero host cache: min_bytes must be > 0, "
                "cap_bytes and headroom_bytes >= 0, got ", min_bytes, ", ", cap_bytes, " and ", headroom_bytes);
    std::vector<Block> victims;
    {
      std::lock_guard<std::mutex> guard(mu_);
      min_bytes_.store(static_cast<size_t>(min_bytes), std::memory_order_relaxed);
      cap_bytes_ = static_cast<size_t>(cap_bytes);
      headroom_bytes_ = static_cast<size_t>(headroom_bytes);
      huge_pages_.store(huge_pages, std::memory_order_relaxed);
      caching_ = true;
      evict_to(cap_bytes_, victims);
    }
    unmap(victims);
  }

  void disable() {
    std::vector<Block> victims;
    {
      std::lock_guard<std::mutex> guard(mu_);
      caching_ = false;
      evict_to(0, victims);
    }
    unmap(victims);
  }

  void empty_cache() {
    std::vector<Block> victims;
    {
      std::lock_guard<std::mutex> guard(mu_);
      evict_to(0, victims);
    }
    unmap(victims);
  }

  std::vector<int64_t> stats() {
    std::lock_guard<std::mutex> guard(mu_);
    return {installed_ ? 1 : 0, caching_ ? 1 : 0, static_cast<int64_t>(min_bytes_.load()),
            static_cast<int64_t>(cap_bytes_), static_cast<int64_t>(live_bytes_), static_cast<int64_t>(cached_bytes_),
            static_cast<int64_t>(peak_mapped_bytes_), hits_, misses_, evictions_};
  }

  // Unmap the blocks freed before the previous trim() and not reused since: a block idle for a whole interval
  // (the engine calls this once per optimizer step) is not part of the loop's working set.
  void trim() {
    std::vector<Block> victims;
    {
      std::lock_guard<std::mutex> guard(mu_);
      while (!lru_.empty() && lru_.front().generation < generation_) {
        evict_front(victims);
      }
      ++generation_;
    }
    unmap(victims);
  }

  void reset_peak() {
    std::lock_guard<std::mutex> guard(mu_);
    peak_mapped_bytes_ = live_bytes_ + cached_bytes_;
    hits_ = misses_ = evictions_ = 0;
  }

  // After fork() the child has one thread; a mutex another thread held at the fork would stay locked forever.
  void after_fork_in_child() {
    new (&mu_) std::mutex();
  }

 private:
  struct Block {
    void* ptr;
    size_t bytes;
    uint64_t generation = 0;  // generation_ when it was freed into the cache
  };
  // Above the default CPU allocator's registration (0), below what a deliberate replacement would use.
  static constexpr uint8_t kPriority = 1;

  HostCache() {
    pthread_atfork(nullptr, nullptr, [] { HostCache::get().after_fork_in_child(); });
  }

  void* map_or_reuse(size_t n) {
    const size_t bytes = round_up_to_page(n);
    std::vector<Block> victims;
    {
      std::lock_guard<std::mutex> guard(mu_);
      void* hit = take_cached(bytes);
      if (hit != nullptr) {
        return hit;
      }
      ++misses_;
      // counted as in use from now on (mapped outside the lock) so the peak is never under-reported
      live_bytes_ += bytes;
      live_peak_bytes_ = std::max(live_peak_bytes_, live_bytes_);
      // Mapping more would take what is mapped above the most tensors ever used at once (plus the headroom):
      // unmap the least recently freed blocks first, so the cache never raises the peak resident set by more
      // than the headroom.
      evict_to(live_peak_bytes_ + headroom_bytes_ - live_bytes_, victims);
      peak_mapped_bytes_ = std::max(peak_mapped_bytes_, live_bytes_ + cached_bytes_);
    }
    unmap(victims);
    void* p = map_block(bytes);
    std::lock_guard<std::mutex> guard(mu_);
    if (p == nullptr) {
      live_bytes_ -= bytes;
      TORCH_CHECK(false, "hf_zero host cache: out of memory mapping ", bytes, " bytes (", cached_bytes_,
                  " bytes cached, ", live_bytes_, " in use)");
    }
    live_.emplace(p, bytes);
    return p;
  }

  // Holding mu_: a cached block of the smallest size from `bytes` to `bytes` * (1 + kFitSlack), moved to live_;
  // else nullptr.
  void* take_cached(size_t bytes) {
    auto it = by_size_.lower_bound(bytes);
    if (!caching_ || it == by_size_.end() || it->first > bytes + static_cast<size_t>(kFitSlack * bytes)) {
      return nullptr;
    }
    // Of the blocks of that size, the most recently freed (the last inserted): its bytes may still be in cache.
    it = std::prev(by_size_.upper_bound(it->first));
    const Block block = *it->second;
    lru_.erase(it->second);
    by_size_.erase(it);
    cached_bytes_ -= block.bytes;
    live_.emplace(block.ptr, block.bytes);
    live_bytes_ += block.bytes;
    live_peak_bytes_ = std::max(live_peak_bytes_, live_bytes_);
    ++hits_;
    return block.ptr;
  }

  static void raw_free(void* p) {
    if (p != nullptr) {
      HostCache::get().release(p);
    }
  }

  void release(void* p) {
    std::vector<Block> victims;
    size_t freed = 0;
    {
      std::lock_guard<std::mutex> guard(mu_);
      auto found = live_.find(p);
      if (found != live_.end()) {
        const Block block{p, found->second};
        freed = block.bytes;
        live_.erase(found);
        live_bytes_ -= block.bytes;
        if (caching_ && block.bytes <= cap_bytes_) {
          lru_.push_back(Block{block.ptr, block.bytes, generation_});
          by_size_.emplace(block.bytes, std::prev(lru_.end()));
          cached_bytes_ += block.bytes;
          evict_to(cap_bytes_, victims);
        } else {
          victims.push_back(block);
        }
      }
    }
    if (freed == 0) {  // not ours: a small allocation through the raw interface
      previous_->raw_deleter()(p);
      return;
    }
    if (c10::memoryProfilingEnabled()) {
      c10::reportMemoryUsageToProfiler(p, -static_cast<int64_t>(freed), 0, 0, c10::Device(c10::DeviceType::CPU));
    }
    unmap(victims);  // outside the lock: munmap is the slow part (a TLB shootdown)
  }

  // Holding mu_: take the least recently freed blocks out until at most `keep` bytes stay cached.
  void evict_to(size_t keep, std::vector<Block>& victims) {
    while (cached_bytes_ > keep && !lru_.empty()) {
      evict_front(victims);
    }
  }

  // Holding mu_: take the least recently freed block out of the cache.
  void evict_front(std::vector<Block>& victims) {
    const Block block = lru_.front();
    auto range = by_size_.equal_range(block.bytes);
    for (auto it = range.first; it != range.second; ++it) {
      if (it->second == lru_.begin()) {
        by_size_.erase(it);
        break;
      }
    }
    lru_.pop_front();
    cached_bytes_ -= block.bytes;
    ++evictions_;
    victims.push_back(block);
  }

  static void unmap(const std::vector<Block>& victims) {
    for (const Block& block : victims) {
      munmap(block.ptr, block.bytes);
    }
  }

  // `bytes` (page-rounded) of fresh anonymous memory, nullptr where mapping fails. Blocks of 2 MiB and more sit on a
  // 2 MiB boundary advised for transparent huge pages where huge_pages_ is set (see configure()).
  void* map_block(size_t bytes) {
    if (huge_pages_.load(std::memory_order_relaxed) && bytes >= kHugePageBytes) {
      return map_huge_page_aligned(bytes);
    }
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? nullptr : p;
  }

  std::mutex mu_;
  c10::Allocator* previous_ = nullptr;  // the allocator registered before ours: every small request goes there
  bool installed_ = false;
  bool caching_ = false;
  std::atomic<size_t> min_bytes_{SIZE_MAX};  // nothing cached before configure()
  std::atomic<bool> huge_pages_{false};
  uint64_t generation_ = 0;  // trim() calls so far
  size_t cap_bytes_ = 0;
  std::list<Block> lru_;                                      // cached blocks, least recently freed first
  std::multimap<size_t, std::list<Block>::iterator> by_size_;  // the same blocks by size
  std::unordered_map<void*, size_t> live_;                    // blocks of min_bytes and more handed out
  size_t live_bytes_ = 0;
  size_t live_peak_bytes_ = 0;  // the most bytes ever in use at once
  size_t headroom_bytes_ = 0;
  size_t cached_bytes_ = 0;
  size_t peak_mapped_bytes_ = 0;
  int64_t hits_ = 0;
  int64_t misses_ = 0;
  int64_t evictions_ = 0;
};

std::string host_cache_enable(int64_t min_bytes, int64_t cap_bytes, int64_t headroom_bytes, bool huge_pages) {
  HostCache& cache = HostCache::get();
  cache.configure(min_bytes, cap_bytes, headroom_bytes, huge_pages);
  return cache.install();
}

void host_cache_disable() {
  HostCache::get().disable();
}

void host_cache_empty() {
  HostCache::get().empty_cache();
}

void host_cache_trim() {
  HostCache::get().trim();
}

std::vector<int64_t> host_cache_stats() {
  return HostCache::get().stats();
}

void host_cache_reset_peak() {
  HostCache::get().reset_peak();
}

#else  // not Linux: nothing is installed; stats report it

std::string host_cache_enable(int64_t, int64_t, int64_t, bool) {
  return "the host cache is built on Linux only";
}
void host_cache_disable() {}
void host_cache_empty() {}
void host_cache_trim() {}
std::vector<int64_t> host_cache_stats() {
  return {0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
}
void host_cache_reset_peak() {}

#endif

}  // namespace

TORCH_LIBRARY_FRAGMENT(hf_zero, m) {
  // The large-block cache of torch's CPU allocator (hf_zero.ops.host_cache): installed by the first enable().
  // returns "" once the cache is torch's CPU allocator, else why it is not
  m.def("host_cache_enable(int min_bytes, int cap_bytes, int headroom_bytes, bool huge_pages) -> str",
        &host_cache_enable);
  m.def("host_cache_disable() -> ()", &host_cache_disable);
  m.def("host_cache_empty() -> ()", &host_cache_empty);
  m.def("host_cache_trim() -> ()", &host_cache_trim);
  // installed, caching, min_bytes, cap_bytes, live_bytes, cached_bytes, peak_mapped_bytes, hits, misses, evictions
  m.def("host_cache_stats() -> int[]", &host_cache_stats);
  m.def("host_cache_reset_peak() -> ()", &host_cache_reset_peak);
}

}  // namespace hf_zero
