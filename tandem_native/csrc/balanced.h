// Passes over a weight split across torch's intra-op threads so that none waits on a slower one.
//
// `balanced_passes(passes, grain, body)` calls `body(pass, forward)` exactly once for every pass in [0, passes), on
// at most min(at::get_num_threads(), ceil(passes / grain)) threads (the calling thread alone inside a parallel
// region, or when one thread is all there is). Each thread owns a contiguous share, as a static split gives it,
// and walks it front to back (`forward` true); a thread done with its own share then takes passes from the back of
// the others' shares (`forward` false), one at a time, until none is left. A kernel whose passes write disjoint
// outputs therefore computes the same bits whichever thread runs a pass; `forward` only says which neighbour the
// thread reads next (pass + 1 or pass - 1), for its prefetches.
//
// Why: on a shared host one vCPU at times runs slower than the other (a busy hyperthread sibling, a neighbour on
// the memory bus); a static split then waits at the end of every projection for the slower thread
// (docs/benchmarks.md §45). Stealing from the back keeps each thread's reads one sequential stream for the hardware
// prefetcher, as interleaved dynamic chunks do not.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

namespace tandem_balanced {

// One share [front, back) as a single word (front in the low 32 bits), so the owner's claim at the front and a
// thief's at the back never both take the last pass.
struct alignas(64) Share {
  std::atomic<uint64_t> word;

  void set(uint32_t front, uint32_t back) { word.store(static_cast<uint64_t>(back) << 32 | front); }

  // Claims the front pass (forward) or the back one into `pass`; false once the share is empty.
  bool take(bool forward, int64_t& pass) {
    uint64_t v = word.load(std::memory_order_relaxed);
    for (;;) {
      const uint32_t front = static_cast<uint32_t>(v), back = static_cast<uint32_t>(v >> 32);
      if (front >= back) return false;
      const uint64_t next = forward ? (static_cast<uint64_t>(back) << 32 | (front + 1))
                                    : (static_cast<uint64_t>(back - 1) << 32 | front);
      if (word.compare_exchange_weak(v, next, std::memory_order_relaxed)) {
        pass = forward ? front : back - 1;
        return true;
      }
    }
  }
};

template <typename F>
void balanced_passes(int64_t passes, int64_t grain, const F& body) {
  if (passes <= 0) return;
  const int64_t most = at::in_parallel_region() ? 1 : static_cast<int64_t>(at::get_num_threads());
  const int64_t threads = std::max<int64_t>(1, std::min(most, (passes + grain - 1) / std::max<int64_t>(grain, 1)));
  if (threads == 1 || passes > static_cast<int64_t>(UINT32_MAX)) {
    for (int64_t p = 0; p < passes; ++p) body(p, true);
    return;
  }
  std::unique_ptr<Share[]> shares(new Share[threads]);
  const int64_t per = passes / threads, extra = passes % threads;  // the first `extra` shares hold one more
  for (int64_t t = 0, front = 0; t < threads; ++t) {
    const int64_t back = front + per + (t < extra ? 1 : 0);
    shares[t].set(static_cast<uint32_t>(front), static_cast<uint32_t>(back));
    front = back;
  }
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {  // one share a thread (all of them on one that runs the range alone)
      int64_t pass;
      while (shares[t].take(true, pass)) body(pass, true);
      for (int64_t o = 1; o < threads; ++o) {
        Share& other = shares[(t + o) % threads];
        while (other.take(false, pass)) body(pass, false);
      }
    }
  });
}

}  // namespace tandem_balanced
