// hf_zero::zeros_hugepage: zero-filled CPU tensors on 2 MiB-aligned anonymous memory marked for transparent huge
// pages (madvise MADV_HUGEPAGE), for the optimizer states hf_zero allocates itself (CPUAdam's exp_avg/exp_avg_sq).
//
// Why: the CPU Adam step streams its four arrays once per step and is bound by how many cache misses one core keeps
// in flight (adam_cpu.cpp). On 4 KiB pages each array crosses a page every 1024 fp32 elements, and each crossing
// costs a TLB miss and a page walk (two-dimensional under a hypervisor). With the two state arrays on 2 MiB pages the
// fp32 step at 1 thread ran 2-8% faster than on torch.zeros states, both stepped in one process, interleaved
// (benchmarks/RESULTS.md; `bench_cpu_adam.py --states torch` shows the kernel without them). Linux's common default
// THP mode, "madvise", backs only regions that ask for it, so torch's allocator (which does not ask unless
// THP_MEM_ALLOC_ENABLE=1 is set for the whole process) gets 4 KiB pages. In mode "never" the advice is ignored and
// the tensor is an ordinary zero-filled one.
//
// The mapping is exactly the tensor's bytes rounded up to the page size (the alignment slack is unmapped again), so
// memory use is that of torch.zeros; the pages come zero-filled from the kernel and are faulted in on first touch.
// Below 2 MiB (no huge page fits) and off Linux it returns at::zeros.

#include <ATen/ATen.h>
#include <torch/library.h>

#include "huge_pages.h"

namespace hf_zero {
namespace {

at::Tensor zeros_hugepage(at::IntArrayRef size, at::ScalarType dtype) {
  const at::TensorOptions options = at::TensorOptions().dtype(dtype).device(at::kCPU);
  const int64_t numel = c10::multiply_integers(size);
  TORCH_CHECK(numel >= 0, "zeros_hugepage: negative size ", size);
  const size_t nbytes = static_cast<size_t>(numel) * c10::elementSize(dtype);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (nbytes >= kHugePageBytes) {
    const size_t length = round_up_to_page(nbytes);
    void* data = map_huge_page_aligned(length);
    if (data != nullptr) {
      return at::from_blob(
          data, size, [length](void* p) { munmap(p, length); }, options);
    }
  }
#endif
  return at::zeros(size, options);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hf_zero, m) {
  // Zero-filled CPU tensor on 2 MiB-aligned memory advised for transparent huge pages (at::zeros below 2 MiB or
  // off Linux). Optimizer states that hf_zero allocates itself; see hf_zero.ops.adam.zeros_state.
  m.def("zeros_hugepage(int[] size, ScalarType dtype) -> Tensor", &zeros_hugepage);
}

}  // namespace hf_zero
