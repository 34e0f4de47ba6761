// An allocator of storage aligned to a cache line (64 bytes), for the kernels' scratch vectors: they are read and
// written 16 fp32 lanes (one line) at a time, and a vector that starts off a line boundary (malloc aligns to 16)
// splits every such access across two lines.
#pragma once

#include <cstddef>
#include <cstdlib>
#include <new>
#include <vector>

namespace tandem_aligned {

template <typename T>
struct LineAligned {
  using value_type = T;
  LineAligned() = default;
  template <typename U>
  LineAligned(const LineAligned<U>&) {}
  T* allocate(std::size_t n) {
    void* p = std::aligned_alloc(64, (n * sizeof(T) + 63) / 64 * 64);
    if (p == nullptr) throw std::bad_alloc();
    return static_cast<T*>(p);
  }
  void deallocate(T* p, std::size_t) { std::free(p); }
  template <typename U>
  bool operator==(const LineAligned<U>&) const { return true; }
  template <typename U>
  bool operator!=(const LineAligned<U>&) const { return false; }
};

// A std::vector whose data() starts a cache line.
template <typename T>
using LineVector = std::vector<T, LineAligned<T>>;

}  // namespace tandem_aligned
