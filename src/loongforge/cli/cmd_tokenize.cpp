// PLACEHOLDER: being written.
#include "loongforge/cli/commands.h"
#include "loongforge/core/error.h"
namespace lf::cli {
void add_tokenize(CLI::App& app) {
  auto* sub = app.add_subcommand("tokenize", "(being written)");
  sub->callback([] { throw lf::Error("tokenize: not implemented yet"); });
}
}  // namespace lf::cli
