// libFuzzer entry point for every target of targets.h: LF_FUZZ_TARGET names the one to run (scripts/fuzz.sh).
// Built only with -DLOONGFORGE_FUZZ=ON by clang with -fsanitize=fuzzer,address,undefined.
#include <cstdio>
#include <cstdlib>
#include <string>

#include "targets.h"

namespace {
const lf::fuzz::Target* target = nullptr;
}

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  const char* name = std::getenv("LF_FUZZ_TARGET");
  target = name ? lf::fuzz::find_target(name) : nullptr;
  if (!target) {
    std::fprintf(stderr, "set LF_FUZZ_TARGET to one of:");
    for (const auto& t : lf::fuzz::targets()) std::fprintf(stderr, " %s", t.name);
    std::fprintf(stderr, "\n");
    std::exit(2);
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string why;
  if (!lf::fuzz::run_checked(*target, data, size, &why)) {
    std::fprintf(stderr, "finding in %s: %s\n", target->name, why.c_str());
    std::abort();
  }
  return 0;
}
