// loongforge moe-plan: offline hot-expert replication planner and simulator (issue 6; docs/moe_plan.md).
#include <cstdio>
#include <nlohmann/json.hpp>

#include "loongforge/cli/commands.h"
#include "loongforge/core/error.h"
#include "loongforge/core/json.h"
#include "loongforge/parallel/moe_plan.h"

namespace lf::cli {
namespace {

struct MoePlanArgs {
  std::string input, out, planner = "both";
};

void run_moe_plan(const MoePlanArgs& a) {
  auto in = parallel::moe::parse_plan_input(read_json_file(a.input), a.input);
  bool eplb = a.planner != "topo", topo = a.planner != "eplb";
  auto doc = parallel::moe::run_plans(in, eplb, topo);
  // One line per top-level field and per layer: readable, and diffable layer by layer.
  std::string text = "{";
  bool first = true;
  for (auto it = doc.begin(); it != doc.end(); ++it) {
    text += first ? "\n " : ",\n ";
    first = false;
    text += nlohmann::json(it.key()).dump() + ": ";
    if (it.key() == "layers") {
      text += "[";
      for (size_t i = 0; i < it.value().size(); ++i) text += (i ? ",\n  " : "\n  ") + it.value()[i].dump();
      text += "\n ]";
    } else {
      text += it.value().dump();
    }
  }
  text += "\n}\n";
  write_file_atomic(a.out, text);
  const auto& s = doc["summary"];
  for (const char* name : {"topology_aware", "eplb"}) {
    if (!s.contains(name)) continue;
    const auto& x = s[name];
    std::printf("%-15s max overload %.4f  mean overload %.4f  intra-node %.4g B  inter-node %.4g B  %.2f ms\n", name,
                x["max_overload"].get<double>(), x["mean_overload"].get<double>(), x["intra_node_bytes"].get<double>(),
                x["inter_node_bytes"].get<double>(), x["planner_ms"].get<double>());
  }
}

}  // namespace

void add_moe_plan(CLI::App& app) {
  auto args = std::make_shared<MoePlanArgs>();
  auto* sub = app.add_subcommand(
      "moe-plan", "Plan hot-expert replication for expert parallelism (EPLB baseline, topology-aware) and simulate it");
  sub->footer(
      "IN.json: {\"loads\": [[tokens per expert] per layer], \"ranks\": R, \"ranks_per_node\": G, \"slots_per_rank\": S,\n"
      "          optional \"intra_node_gbps\" (450), \"inter_node_gbps\" (50), \"hidden_size\" (4096),\n"
      "          \"bytes_per_element\" (2), \"expert_params\" (0: no weight traffic), \"num_groups\" (EPLB; experts)}\n"
      "OUT.json: {\"layers\": [{\"slots\", \"tokens\", \"overload\", \"intra_node_bytes\", \"inter_node_bytes\",\n"
      "          \"planner_ms\", ..., \"baseline\": {the EPLB plan}}], \"summary\": {...}} (docs/moe_plan.md)");
  sub->add_option("--input", args->input, "IN.json: expert loads and the cluster shape")->required();
  sub->add_option("--out", args->out, "OUT.json: the plans (written atomically)")->required();
  sub->add_option("--planner", args->planner, "both: topology-aware with the EPLB baseline; eplb; topo")
      ->check(CLI::IsMember({"both", "eplb", "topo"}))
      ->capture_default_str();
  sub->callback([args] { run_moe_plan(*args); });
}

}  // namespace lf::cli
