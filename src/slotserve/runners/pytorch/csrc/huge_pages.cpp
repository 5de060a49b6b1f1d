// Memory for what every decode step streams end to end: the packed weights, read once each in
// address order, and the paged KV pool, whose blocks a long context's lone row reads one after
// another wherever they lie. On 4 KiB pages a stream crosses a page every 64 cache lines, where
// the hardware prefetchers stop and a TLB miss (two-level in a VM) is paid, and two threads read
// well below the box's rate. On 2 MiB pages (Linux's transparent huge pages, asked for with
// madvise; granted in its default `madvise` mode) they read near it. Only whole 2 MiB pages are
// asked for: a buffer's tail stays on small pages, so resident memory is what the buffer takes.

#include <ATen/ATen.h>

#include <cstdlib>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "cpu_kernels.h"

namespace cpu {

constexpr int64_t kHugePage = int64_t(2) << 20;

at::Tensor huge_page_buffer(at::IntArrayRef sizes, at::ScalarType dtype) {
    const auto options = at::TensorOptions().dtype(dtype);
    const int64_t bytes = c10::multiply_integers(sizes) * int64_t(c10::elementSize(dtype));
#if defined(__linux__)
    if (bytes >= kHugePage) {
        const int64_t whole = bytes / kHugePage * kHugePage;
        const int64_t rounded = (bytes + kHugePage - 1) / kHugePage * kHugePage;
        void* memory = std::aligned_alloc(kHugePage, size_t(rounded));
        TORCH_CHECK(memory != nullptr, "out of memory for ", bytes, " bytes");
        // Advice only: where the kernel declines (THP off, no free 2 MiB page), small pages serve.
        madvise(memory, size_t(whole), MADV_HUGEPAGE);
        return at::from_blob(memory, sizes, [](void* p) { std::free(p); }, options);
    }
#endif
    return at::empty(sizes, options);
}

}  // namespace cpu
