// Bounded waits for the setup collectives of an NCCL communicator (docs/design.md, "Setup waits"): a peer that
// never arrives makes the call throw after a timeout instead of waiting forever.
//
// NCCL bounds nothing itself: a blocking communicator waits inside its calls (init, the lazy connection of the
// first collective, window registration) for as long as a peer takes. A nonblocking one (ncclConfig_t::blocking
// = 0) returns ncclInProgress from those calls and finishes them in the background; the caller polls
// ncclCommGetAsyncError, and may give up with ncclCommAbort (local: it never waits for a peer). So setup is
// bounded with nonblocking communicators: the ones the C API and the Python package create (init_nccl_comm), or a
// C++ caller's own. With a blocking one the waits below still work, but NCCL's own calls may wait first.
#pragma once

#include <chrono>
#include <span>
#include <stdexcept>
#include <string>

#include <cuda_runtime_api.h>
#include <nccl.h>

namespace mok::detail {

// A setup wait that timed out: the communicator is unusable (an operation on it is still pending, waiting for a
// peer); its owner must abort it (ncclCommAbort), not destroy it (ncclCommDestroy would wait for that operation).
class SetupTimeout : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

using SetupClock = std::chrono::steady_clock;

// Finishes an NCCL call on `comms`: ncclSuccess returns at once, ncclInProgress polls every communicator's
// ncclCommGetAsyncError until it leaves ncclInProgress. Throws std::runtime_error naming `call` on an NCCL error,
// SetupTimeout once `timeout_s` seconds have passed since `since`.
void finish_nccl(std::span<const ncclComm_t> comms, ncclResult_t result, const char* call, double timeout_s,
                 SetupClock::time_point since = SetupClock::now());

// A nonblocking communicator of `nranks` (rank `rank`, on the current device), its init bounded: SetupTimeout
// (the half-made communicator aborted) when the other ranks do not all arrive within `timeout_s` seconds.
ncclComm_t init_nccl_comm(int nranks, const ncclUniqueId& id, int rank, double timeout_s);

// Waits for the work issued so far on `streams[n]` (on `devices[n]`; an NCCL collective's kernel among it),
// polling, until `timeout_s` seconds have passed since `since`: SetupTimeout naming `what` after that.
void wait_streams(std::span<const int> devices, std::span<const cudaStream_t> streams, double timeout_s,
                  const std::string& what, SetupClock::time_point since = SetupClock::now());

// An NCCL group call that a throw cannot leave open: the destructor ends the group if end() was not reached (an
// open group would hold back this thread's later NCCL calls, a communicator's abort among them).
class NcclGroup {
 public:
  NcclGroup();
  ~NcclGroup();
  NcclGroup(const NcclGroup&) = delete;
  NcclGroup& operator=(const NcclGroup&) = delete;
  ncclResult_t end();  // ncclGroupEnd's result (ncclInProgress for a nonblocking communicator: finish_nccl it)

 private:
  bool open_ = true;
};

}  // namespace mok::detail
