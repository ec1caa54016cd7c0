// The MPI engine under the communication layer (parallel.backend: mpi): a c10d::Backend whose collectives and
// point-to-point operations are Open MPI's non-blocking calls on CPU tensors (Group stages GPU tensors through the
// host, as under Gloo), and the MPI bootstrap of a job that mpirun started (rank 0's host and a free port for the
// rendezvous store, so mpirun over several nodes needs no MASTER_ADDR).
//
// MPI is initialized once per process (MPI_THREAD_MULTIPLE), on the first use, and finalized at exit; a process that
// fails calls abort_mpi_job, which ends every rank of the job at once (mpirun would otherwise keep the others waiting
// for this one in their next collective until the timeout). Waits poll the request and give up after the group's
// timeout with std::runtime_error, which Group turns into the error naming the silent ranks.
//
// Builds without MPI (LOONGFORGE_MPI=OFF, or no Open MPI found) keep the declarations: mpi_compiled() is false and
// the others throw lf::Error.
#pragma once
#include <c10/util/intrusive_ptr.h>

#include <string>
#include <vector>

namespace c10d {
class Backend;
}

namespace lf::parallel {

bool mpi_compiled();
// Throws lf::Error naming parallel.backend when this build has no MPI.
void require_mpi();

struct MpiBootstrap {
  std::string master_host;  // rank 0's host name
};
// Initializes MPI if needed and checks that MPI's world is the launcher's (rank, world): MPI ranks must be the job's
// ranks, i.e. the job was started by mpirun (or srun with an MPI plugin). Returns rank 0's host name (a collective
// over MPI_COMM_WORLD: every rank calls it).
MpiBootstrap mpi_bootstrap(int rank, int world);
// Broadcasts an integer from world rank 0 (e.g. the rendezvous store's port).
int mpi_broadcast_int(int value);
// A backend over the ranks `ranks` (world ranks, in group order; this process is one of them). Collective over those
// ranks: every member creates its groups in the same order.
c10::intrusive_ptr<c10d::Backend> make_mpi_backend(const std::vector<int>& ranks, int group_rank);
// Ends the whole job with `code` when MPI is running in this process with other ranks; otherwise does nothing.
void abort_mpi_job(int code);

}  // namespace lf::parallel
