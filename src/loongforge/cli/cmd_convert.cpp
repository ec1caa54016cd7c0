// PLACEHOLDER: being written.
#include "loongforge/cli/commands.h"
#include "loongforge/core/error.h"
namespace lf::cli {
void add_convert(CLI::App& app) {
  auto* sub = app.add_subcommand("convert", "(being written)");
  sub->callback([] { throw lf::Error("convert: not implemented yet"); });
}
}  // namespace lf::cli
