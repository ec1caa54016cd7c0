// Fuzz targets: one function per parser or decoder LoongForge owns, taking the raw bytes of a hostile input.
//
// The contract every target checks: a malformed input is an lf::Error (caught here and ignored); anything else —
// another exception type, a crash, an out-of-bounds access or undefined behaviour (seen under the sanitizers), a
// property of the result that does not hold — is a finding. The same functions run in two drivers:
//   - tests/fuzz/fuzz_main.cpp: libFuzzer with AddressSanitizer + UndefinedBehaviorSanitizer (scripts/fuzz.sh),
//   - tests/cpp/test_fuzz.cpp: a deterministic mutation smoke in CI (seed corpora + a few hundred mutations each).
// Seed corpora come from the tests' files and from the reference libraries (scripts/fuzz_seeds.py).
//
// Targets that read files write the input to a private temporary folder first (the parsers' entry points take
// paths, as users give them). Inputs that are several files are framed: see each target's comment in targets.cpp.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace lf::fuzz {

struct Target {
  const char* name;
  const char* what;  // the parser it drives
  void (*run)(const uint8_t* data, size_t size);
};

const std::vector<Target>& targets();
const Target* find_target(const std::string& name);

// Runs TARGET on the input; returns false (with WHY) when the run is a finding that was caught as an exception
// (crashes and sanitizer reports end the process instead).
bool run_checked(const Target& target, const uint8_t* data, size_t size, std::string* why);

// The folder targets write their temporary files in (created on first use, one per process).
const std::string& scratch_dir();

}  // namespace lf::fuzz
