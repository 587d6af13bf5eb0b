// Evicting one tensor's bytes from the CPU's caches, for timing a call as a decode step runs
// it: between two calls of one layer every other layer's weights pass through the caches, so
// its weights come from memory while its code, its buffers and the threads stay warm.
#include "kvserve_cpu.h"
#include "simd.h"

#include <immintrin.h>

#include <cstdint>

namespace kvserve {

void evict_from_caches(const at::Tensor& t) {
  TORCH_CHECK(t.is_contiguous(), "evict_from_caches: a contiguous tensor");
  const auto* first = static_cast<const char*>(t.data_ptr());
  const int64_t bytes = t.numel() * t.element_size();
  if (bytes == 0) return;
  for (int64_t offset = 0; offset < bytes; offset += simd::kCacheLineBytes)
    _mm_clflush(first + offset);
  _mm_clflush(first + bytes - 1);  // the last line, where the bytes do not start on one
  _mm_mfence();
}

}  // namespace kvserve
