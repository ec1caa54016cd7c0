// The fuzz targets (tests/fuzz/targets.h) in CI: each seed of a corpus, then deterministic mutations of it (bit
// flips, interesting bytes and numbers, deletions, duplications, truncations, splices with other seeds), must end
// in success or an lf::Error. libFuzzer with the sanitizers (scripts/fuzz.sh) runs the same targets for millions
// of executions; this is the short smoke that keeps every target alive and every fixed finding fixed.
//
// FuzzHook.Smoke does nothing (GTEST_SKIP) unless LF_FUZZ_CORPUS names a corpus folder (one subfolder per target,
// written by scripts/fuzz_seeds.py; tests/python/test_fuzz.py drives it). LF_FUZZ_TARGETS: a comma list (default:
// every subfolder that names a target); LF_FUZZ_MUTATIONS: mutations per seed (default 200); LF_FUZZ_FAILURES: a
// folder to save failing inputs in.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "../fuzz/targets.h"

namespace {

namespace fs = std::filesystem;

struct Rng {
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  size_t below(size_t n) { return n ? static_cast<size_t>(next() % n) : 0; }
};

const char* const kTokens[] = {"-1", "0", "1", "99999999999999999999", "1e308", "-2147483649", "4294967296",
                               "9223372036854775807", "null", "[]", "{}", "\"\"", "NaN", "{{", "{%", "%}", "}}",
                               "\xff\xfe", "\xc3", "\n", "  ", "..", "/", "\\u0000", "true", "[[[[[[[[", "~", ":"};
const unsigned char kBytes[] = {0, 0xff, 0x7f, 0x80, '"', '{', '[', ':', ',', '\n', 0x01, 0xfe};

std::string mutate(std::string s, const std::vector<std::string>& others, Rng& rng) {
  int rounds = 1 + static_cast<int>(rng.below(4));
  for (int r = 0; r < rounds; ++r) {
    switch (rng.below(8)) {
      case 0:  // flip a bit
        if (!s.empty()) s[rng.below(s.size())] ^= static_cast<char>(1u << rng.below(8));
        break;
      case 1:  // an interesting byte
        if (!s.empty()) s[rng.below(s.size())] = static_cast<char>(kBytes[rng.below(sizeof kBytes)]);
        break;
      case 2: {  // delete a range
        if (s.empty()) break;
        size_t a = rng.below(s.size()), len = 1 + rng.below(std::min<size_t>(s.size() - a, 64));
        s.erase(a, len);
        break;
      }
      case 3: {  // duplicate a range
        if (s.empty()) break;
        size_t a = rng.below(s.size()), len = 1 + rng.below(std::min<size_t>(s.size() - a, 64));
        s.insert(rng.below(s.size() + 1), s.substr(a, len));
        break;
      }
      case 4:  // truncate
        s.resize(rng.below(s.size() + 1));
        break;
      case 5:  // insert a token
        s.insert(rng.below(s.size() + 1), kTokens[rng.below(std::size(kTokens))]);
        break;
      case 6: {  // replace a run of digits by an interesting number
        std::vector<size_t> starts;
        for (size_t i = 0; i < s.size(); ++i)
          if (isdigit(static_cast<unsigned char>(s[i])) && (i == 0 || !isdigit(static_cast<unsigned char>(s[i - 1]))))
            starts.push_back(i);
        if (starts.empty()) break;
        size_t a = starts[rng.below(starts.size())], e = a;
        while (e < s.size() && isdigit(static_cast<unsigned char>(s[e]))) ++e;
        s.replace(a, e - a, kTokens[rng.below(8)]);
        break;
      }
      case 7: {  // splice with another seed
        if (others.empty()) break;
        const std::string& o = others[rng.below(others.size())];
        size_t a = rng.below(s.size() + 1), b = rng.below(o.size() + 1);
        s = s.substr(0, a) + o.substr(b);
        break;
      }
    }
  }
  return s;
}

std::string read_file(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string x; std::getline(ss, x, ',');)
    if (!x.empty()) out.push_back(x);
  return out;
}

}  // namespace

TEST(Fuzz, EveryTargetIsRegisteredOnce) {
  std::vector<std::string> names;
  for (const auto& t : lf::fuzz::targets()) names.push_back(t.name);
  std::sort(names.begin(), names.end());
  EXPECT_EQ(std::adjacent_find(names.begin(), names.end()), names.end());
  EXPECT_GE(names.size(), 16u);
  EXPECT_EQ(lf::fuzz::find_target("no such target"), nullptr);
}

TEST(FuzzHook, Smoke) {
  const char* corpus = std::getenv("LF_FUZZ_CORPUS");
  if (!corpus) GTEST_SKIP() << "LF_FUZZ_CORPUS not set";
  const char* m = std::getenv("LF_FUZZ_MUTATIONS");
  const int mutations = m ? std::atoi(m) : 200;
  const char* failures = std::getenv("LF_FUZZ_FAILURES");
  std::vector<std::string> names;
  if (const char* t = std::getenv("LF_FUZZ_TARGETS")) {
    names = split(t);
  } else {
    for (const auto& e : fs::directory_iterator(corpus))
      if (e.is_directory() && lf::fuzz::find_target(e.path().filename().string())) names.push_back(e.path().filename());
    std::sort(names.begin(), names.end());
  }
  ASSERT_FALSE(names.empty()) << corpus << " holds no target's corpus";
  int found = 0;
  for (const auto& name : names) {
    const auto* target = lf::fuzz::find_target(name);
    ASSERT_NE(target, nullptr) << "unknown target " << name;
    std::vector<fs::path> files;
    for (const auto& e : fs::directory_iterator(fs::path(corpus) / name))
      if (e.is_regular_file()) files.push_back(e.path());
    std::sort(files.begin(), files.end());
    ASSERT_FALSE(files.empty()) << "no seeds for " << name;
    std::vector<std::string> seeds;
    for (const auto& f : files) seeds.push_back(read_file(f));
    Rng rng{std::hash<std::string>{}(name)};
    size_t runs = 0;
    for (size_t i = 0; i < seeds.size(); ++i) {
      for (int k = -1; k < mutations; ++k) {
        std::string input = k < 0 ? seeds[i] : mutate(seeds[i], seeds, rng);
        std::string why;
        ++runs;
        if (!lf::fuzz::run_checked(*target, reinterpret_cast<const uint8_t*>(input.data()), input.size(), &why)) {
          ++found;
          std::string saved;
          if (failures) {
            fs::create_directories(failures);
            saved = std::string(failures) + "/" + name + "-" + std::to_string(i) + "-" + std::to_string(k) + ".bin";
            std::ofstream(saved, std::ios::binary).write(input.data(), static_cast<std::streamsize>(input.size()));
          }
          ADD_FAILURE() << name << ": seed " << files[i].filename() << " mutation " << k << ": " << why
                        << (saved.empty() ? "" : " (input saved as " + saved + ")");
          if (found > 20) return;
        }
      }
    }
    std::printf("fuzz smoke %s: %zu runs\n", name.c_str(), runs);
  }
}
