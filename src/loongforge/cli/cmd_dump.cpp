// PLACEHOLDER: being written.
#include "loongforge/cli/commands.h"
#include "loongforge/core/error.h"
namespace lf::cli {
void add_dump(CLI::App& app) {
  auto* sub = app.add_subcommand("dump", "(being written)");
  sub->callback([] { throw lf::Error("dump: not implemented yet"); });
}
}  // namespace lf::cli
