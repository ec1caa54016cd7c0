// The subcommands of the `loongforge` program. Each add_* registers one subcommand on the app, with its own --help
// and a callback that runs it; errors are thrown as lf::Error and printed by main as one line.
#pragma once
#include <CLI/CLI.hpp>

namespace lf::cli {

void add_dump(CLI::App& app);
void add_tokenize(CLI::App& app);
void add_generate(CLI::App& app);
void add_sample(CLI::App& app);
void add_convert(CLI::App& app);
void add_train(CLI::App& app);
void add_eval(CLI::App& app);
void add_data(CLI::App& app);
void add_data_encode(CLI::App& data);  // `data encode` (cli/data_encode.cpp)
void add_data_bench_loader(CLI::App& data);  // `data bench-loader` (cli/cmd_data_bench.cpp)
void add_data_export(CLI::App& data);  // `data export` (cli/cmd_data_export.cpp)
bool print_robot_dataset_info(const std::string& path);  // `info DATASET` (cli/cmd_data_export.cpp): false if not one
void add_data_stats(CLI::App& data);   // `data stats` (cli/cmd_data_stats.cpp)
void add_info(CLI::App& app);
void add_env(CLI::App& app);
void add_moe_plan(CLI::App& app);
void add_predict(CLI::App& app);  // `predict` (cli/cmd_predict.cpp)

}  // namespace lf::cli
