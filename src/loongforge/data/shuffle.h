// The seeded streams of the diffusion media folders (image_folder, video_folder): SplitMix64 from
// mix(a, b) = a * 6364136223846793005 + b * 1442695040888963407 + 1 mod 2^64, and the epoch order drawn with it
// (Fisher-Yates from the last position down, swapping i with next() mod (i + 1), state mix(seed, epoch)).
#pragma once
#include <cstdint>
#include <utility>
#include <vector>

namespace lf::data {

inline uint64_t mix(uint64_t seed, uint64_t k) {
  return seed * 6364136223846793005ULL + k * 1442695040888963407ULL + 1ULL;
}

// SplitMix64: the next value of the state x (advanced)
inline uint64_t splitmix64(uint64_t& x) {
  uint64_t z = (x += 0x9E3779B97F4A7C15ULL);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// The order in which epoch EPOCH visits N items.
inline std::vector<int64_t> epoch_order(int64_t n, uint64_t seed, int64_t epoch) {
  std::vector<int64_t> order(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) order[static_cast<size_t>(i)] = i;
  uint64_t state = mix(seed, static_cast<uint64_t>(epoch));
  for (int64_t i = n - 1; i > 0; --i)
    std::swap(order[static_cast<size_t>(i)], order[splitmix64(state) % static_cast<uint64_t>(i + 1)]);
  return order;
}

}  // namespace lf::data
