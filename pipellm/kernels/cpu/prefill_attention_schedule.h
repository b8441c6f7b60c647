// How the prefill attention kernels share their work among threads: units taken longest first
// from a shared counter, each thread with its own scratch state. Included inside a kernel's
// target region, after isa_target.h.
#pragma once

namespace {

// A unit of work: a (sequence, KV head) to pack or a (sequence, head, block) to attend; cost
// orders them, longest first.
struct Item { int64_t s, h, i0, cost; };

// A call's work: a pack per (sequence with queries, KV head), costed by its keys, and a block
// per (sequence, head, `rows` queries from i0), costed by the keys its last row sees.
struct Work { std::vector<Item> packs, blocks; };

inline Work work_of(const pipellm::prefill::Args& a, int64_t rows) {
  Work w;
  for (int64_t s = 0; s < a.S; ++s) {
    const int64_t m = a.cu[s + 1] - a.cu[s], prefix = a.lens[s] - m;
    for (int64_t g = 0; g < a.Hkv && m > 0; ++g) w.packs.push_back({s, g, 0, a.lens[s]});
    for (int64_t i0 = 0; i0 < m; i0 += rows)
      for (int64_t h = 0; h < a.H; ++h) w.blocks.push_back({s, h, i0, prefix + i0 + rows});
  }
  return w;
}

// fn(item, state) for every item, taken longest first from a shared counter by every thread
// (its own State, default-made; done(state) when it runs out)
template <class State, class F, class Done = void (*)(State&)>
void for_each_item(std::vector<Item>& items, const F& fn, const Done& done = [](State&) {}) {
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& x, const Item& y) { return x.cost > y.cost; });
  std::atomic<int64_t> next{0};
  const int64_t total = static_cast<int64_t>(items.size());
  at::parallel_for(0, std::min<int64_t>(total, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    State state{};
    for (int64_t i = next.fetch_add(1); i < total; i = next.fetch_add(1)) fn(items[i], state);
    done(state);
  });
}

}  // namespace
