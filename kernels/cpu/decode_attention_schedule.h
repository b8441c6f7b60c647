// How the decode attention's sequences are shared among threads, for the generic path and
// every vectorized variant: one sequence is one work item, taken longest first from a shared
// counter, so each thread stays busy until the last items (a static split of the batch into
// contiguous halves is off by as much as the longer half's extra rows, and ShareGPT's lengths
// differ tenfold within a batch). The vectorized variants split a sequence further into parts
// of whole kv heads where the batch has fewer sequences than threads (a single decode).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <numeric>
#include <vector>

namespace pipellm::attention {

// The rows sequence b reads: its length, or the window where one is set and shorter.
inline int64_t rows_read(const int32_t* lens, int64_t b, int64_t window) {
  return window > 0 ? std::min<int64_t>(lens[b], window) : lens[b];
}

// fn(i, scratch) for every item i of [0, n), each once, in parallel: the items reading the
// most rows (rows(i)) first, from a shared counter; `Scratch` is one thread's buffers, made
// once per thread and reused for every item it runs.
template <class Scratch, class R, class F>
void for_each_item(int64_t n, const R& rows, const F& fn) {
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t x, int64_t y) { return rows(x) > rows(y); });
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(n, at::get_num_threads());
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    Scratch scratch;
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(order[i], scratch);
  });
}

// fn(b, scratch) for every sequence b of [0, B), each once, in parallel.
template <class Scratch, class F>
void for_each_sequence(const int32_t* lens, int64_t B, int64_t window, const F& fn) {
  for_each_item<Scratch>(B, [&](int64_t b) { return rows_read(lens, b, window); }, fn);
}

// fn(b, kv0, kv1, scratch) for the kv heads [kv0, kv1) of every sequence b, each once, in
// parallel: each sequence in min(threads / B rounded up, Hkv) parts of about equal heads.
template <class Scratch, class F>
void for_each_part(const int32_t* lens, int64_t B, int64_t window, int64_t Hkv, const F& fn) {
  const int64_t threads = at::get_num_threads();
  const int64_t parts = B >= threads ? 1 : std::min<int64_t>((threads + B - 1) / B, Hkv);
  for_each_item<Scratch>(
      B * parts, [&](int64_t i) { return rows_read(lens, i / parts, window); },
      [&](int64_t i, Scratch& s) {
        const int64_t p = i % parts;
        fn(i / parts, p * Hkv / parts, (p + 1) * Hkv / parts, s);
      });
}

}  // namespace pipellm::attention
