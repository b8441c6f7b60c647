// How the decode attention's sequences are shared among threads, for the generic path and
// every vectorized variant: one sequence is one work item, taken longest first from a shared
// counter, so each thread stays busy until the last items (a static split of the batch into
// contiguous halves is off by as much as the longer half's extra rows, and ShareGPT's lengths
// differ tenfold within a batch). Where the batch has fewer sequences than threads (a single
// decode), the vectorized variants cut each sequence into parts: a long one along its rows
// (context parts, about two a thread: `context_split`), whose partial sums are merged after
// (flash-decoding's split), a short one into parts of its kv heads.
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

constexpr int64_t kMinPartRows = 128;  // the fewest rows a context part reads

// How many context parts a sequence may be cut into: 0 where the batch has as many sequences
// as threads (whole sequences, one item each), else about two items a thread.
inline int64_t context_split(int64_t B) {
  const int64_t threads = at::get_num_threads();
  return B >= threads ? 0 : (2 * threads + B - 1) / B;
}

// The context parts of a sequence reading n rows: up to `split`, each of kMinPartRows or more.
inline int64_t context_parts(int64_t n, int64_t split) {
  return std::clamp<int64_t>(n / kMinPartRows, 1, std::max<int64_t>(split, 1));
}

// One work item: sequence b's kv heads [kv0, kv1) over rows [r0, r1) of the n it reads, which
// is context part `part` of context_parts(n, split).
struct Part {
  int64_t b, kv0, kv1, r0, r1, part;
};

// fn(part, scratch) for every part of every sequence (`split` from context_split), each once,
// in parallel, the parts reading the most rows first. A sequence long enough is cut along its
// rows, every part reading whole rows (all kv heads: one stream through the cache, split-K as
// flash-decoding does); a shorter one into parts of whole kv heads, one a thread.
template <class Scratch, class F>
void for_each_part(const int32_t* lens, int64_t B, int64_t window, int64_t Hkv, int64_t split,
                   const F& fn) {
  if (split == 0) {
    for_each_sequence<Scratch>(lens, B, window, [&](int64_t b, Scratch& s) {
      fn(Part{b, 0, Hkv, 0, rows_read(lens, b, window), 0}, s);
    });
    return;
  }
  const int64_t threads = at::get_num_threads();
  const int64_t heads = std::min<int64_t>((threads + B - 1) / B, Hkv);
  std::vector<Part> parts;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = rows_read(lens, b, window), cp = context_parts(n, split);
    if (cp > 1) {
      for (int64_t p = 0; p < cp; ++p)
        parts.push_back({b, 0, Hkv, p * n / cp, (p + 1) * n / cp, p});
    } else {
      for (int64_t h = 0; h < heads; ++h)
        parts.push_back({b, h * Hkv / heads, (h + 1) * Hkv / heads, 0, n, 0});
    }
  }
  for_each_item<Scratch>(
      static_cast<int64_t>(parts.size()), [&](int64_t i) { return parts[i].r1 - parts[i].r0; },
      [&](int64_t i, Scratch& s) { fn(parts[i], s); });
}

}  // namespace pipellm::attention
