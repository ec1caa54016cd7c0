// loongforge: one program, many subcommands.
#include <cstdio>
#include <exception>

#include "loongforge/cli/commands.h"
#include "loongforge/core/error.h"
#include "loongforge/parallel/mpi_backend.h"

int main(int argc, char** argv) {
  CLI::App app{"LoongForge: train and run Hugging Face models in C++ on LibTorch"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "loongforge 0.1.0");
  lf::cli::add_dump(app);
  lf::cli::add_tokenize(app);
  lf::cli::add_generate(app);
  lf::cli::add_sample(app);
  lf::cli::add_convert(app);
  lf::cli::add_train(app);
  lf::cli::add_eval(app);
  lf::cli::add_data(app);
  lf::cli::add_info(app);
  lf::cli::add_env(app);
  lf::cli::add_moe_plan(app);
  lf::cli::add_predict(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const lf::Error& e) {
    std::fprintf(stderr, "loongforge: error: %s\n", e.what());
    lf::parallel::abort_mpi_job(1);  // under the MPI backend: end the other ranks now, not at their timeout
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "loongforge: internal error: %s\n", e.what());
    lf::parallel::abort_mpi_job(2);
    return 2;
  }
  return 0;
}
