// PLACEHOLDER: being written.
#include "loongforge/cli/commands.h"
#include "loongforge/core/error.h"
namespace lf::cli {
void add_generate(CLI::App& app) {
  auto* sub = app.add_subcommand("generate", "(being written)");
  sub->callback([] { throw lf::Error("generate: not implemented yet"); });
}
}  // namespace lf::cli
