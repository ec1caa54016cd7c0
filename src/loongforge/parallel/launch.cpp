#include "loongforge/parallel/launch.h"

#include <stdexcept>

#include "loongforge/core/error.h"

extern char** environ;

namespace lf::parallel {

namespace {

std::map<std::string, std::string> process_env() {
  std::map<std::string, std::string> m;
  for (char** e = environ; e && *e; ++e) {
    std::string s(*e);
    auto eq = s.find('=');
    if (eq != std::string::npos) m[s.substr(0, eq)] = s.substr(eq + 1);
  }
  return m;
}

int to_int(const std::map<std::string, std::string>& env, const std::string& key, int fallback) {
  auto it = env.find(key);
  if (it == env.end() || it->second.empty()) return fallback;
  try {
    size_t pos = 0;
    int v = std::stoi(it->second, &pos);
    if (pos != it->second.size()) throw std::invalid_argument("trailing");
    return v;
  } catch (const std::exception&) {
    throw Error("environment: variable '" + key + "': not an integer: '" + it->second + "'");
  }
}

}  // namespace

std::string first_slurm_host(const std::string& nodelist) {
  // First entry up to a top-level comma; expand its first bracket range.
  int depth = 0;
  size_t end = nodelist.size();
  for (size_t i = 0; i < nodelist.size(); ++i) {
    if (nodelist[i] == '[') ++depth;
    else if (nodelist[i] == ']') --depth;
    else if (nodelist[i] == ',' && depth == 0) { end = i; break; }
  }
  std::string first = nodelist.substr(0, end);
  auto lb = first.find('[');
  if (lb == std::string::npos) return first;
  auto rb = first.find(']', lb);
  if (rb == std::string::npos) throw Error("environment: variable 'SLURM_JOB_NODELIST': malformed node list '" + nodelist + "'");
  std::string inside = first.substr(lb + 1, rb - lb - 1);
  std::string item = inside.substr(0, inside.find(','));
  std::string lo = item.substr(0, item.find('-'));
  return first.substr(0, lb) + lo + first.substr(rb + 1);
}

LaunchEnv detect_launch(const std::map<std::string, std::string>& env_in) {
  const auto env = env_in.empty() ? process_env() : env_in;
  LaunchEnv e;
  auto has = [&](const char* k) { return env.count(k) && !env.at(k).empty(); };
  if (has("RANK") && has("WORLD_SIZE")) {
    e.launcher = "torchrun";
    e.rank = to_int(env, "RANK", 0);
    e.world = to_int(env, "WORLD_SIZE", 1);
    e.local_rank = to_int(env, "LOCAL_RANK", 0);
  } else if (has("OMPI_COMM_WORLD_RANK") && has("OMPI_COMM_WORLD_SIZE")) {
    e.launcher = "mpirun";
    e.rank = to_int(env, "OMPI_COMM_WORLD_RANK", 0);
    e.world = to_int(env, "OMPI_COMM_WORLD_SIZE", 1);
    e.local_rank = to_int(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0);
    int local_size = to_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", e.world);
    e.master_unknown = !has("MASTER_ADDR") && local_size != e.world;  // Comm::init asks MPI, or says so
  } else if (has("SLURM_PROCID") && has("SLURM_NTASKS")) {
    e.launcher = "srun";
    e.rank = to_int(env, "SLURM_PROCID", 0);
    e.world = to_int(env, "SLURM_NTASKS", 1);
    e.local_rank = to_int(env, "SLURM_LOCALID", 0);
    if (!has("MASTER_ADDR")) {
      const char* keys[] = {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"};
      for (const char* k : keys)
        if (has(k)) { e.master_addr = first_slurm_host(env.at(k)); break; }
    }
  }
  if (has("MASTER_ADDR")) e.master_addr = env.at("MASTER_ADDR");
  e.master_port = to_int(env, "MASTER_PORT", 29500);
  e.master_port_set = has("MASTER_PORT");
  if (e.world < 1) throw Error("environment: world size " + std::to_string(e.world) + " is not positive");
  if (e.rank < 0 || e.rank >= e.world)
    throw Error("environment: rank " + std::to_string(e.rank) + " is outside world size " + std::to_string(e.world));
  return e;
}

}  // namespace lf::parallel
