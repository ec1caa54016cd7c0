// Launch detection: which launcher started this process, and this process's place in the job.
//
// Ranks come from torchrun-style variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), from Open
// MPI's mpirun (OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK) or from Slurm's srun (SLURM_PROCID/NTASKS/LOCALID, the
// master being the first host of the step's node list unless MASTER_ADDR is set). Without any of them the world
// is one process. Torch-free: the communication layer (parallel/comm.h) starts from a LaunchEnv.
#pragma once
#include <map>
#include <string>

namespace lf::parallel {

struct LaunchEnv {
  int rank = 0, world = 1, local_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  std::string launcher = "single";  // single | torchrun | mpirun | srun
  bool master_port_set = false;     // MASTER_PORT given (else the MPI bootstrap picks a free port)
  bool master_unknown = false;      // mpirun over several nodes without MASTER_ADDR: only MPI can tell rank 0's host
};

// Reads the launcher's variables from `env` (the process environment when empty).
LaunchEnv detect_launch(const std::map<std::string, std::string>& env = {});
// The first host name of a Slurm node list ("node[03-05,9],gpu1" -> "node03").
std::string first_slurm_host(const std::string& nodelist);

}  // namespace lf::parallel
