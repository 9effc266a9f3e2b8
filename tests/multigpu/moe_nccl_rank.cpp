// One rank of a multi-process NCCL test (spawned by test_moe_multigpu's NcclAcrossProcesses test, one
// process per GPU): builds the communicator from a unique id, runs the provenance forward for every hot
// slot on its rank and checks its output exactly. Exit status 0 when every output matched; otherwise a
// message on stderr.
//   moe_nccl_rank <rank> <ep_size> <unique id as 256 hex digits> [mismatch]
// With "mismatch", rank 1 asks for one token more than the others: every rank's workspace constructor must
// throw std::invalid_argument naming MoeShape.num_tokens (exit 0 when it does), and none may hang.
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <stdexcept>
#include <string>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "mok/moe.h"
#include "tests/common/moe_harness.h"

int main(int argc, char** argv) {
  const bool mismatch = argc == 5 && std::string(argv[4]) == "mismatch";
  if ((argc != 4 && !mismatch) || std::string(argv[3]).size() != 2 * sizeof(ncclUniqueId)) {
    std::fprintf(stderr, "usage: moe_nccl_rank <rank> <ep_size> <unique id hex> [mismatch]\n");
    return 2;
  }
  const int rank = std::atoi(argv[1]), ep_size = std::atoi(argv[2]);
  ncclUniqueId id;
  for (size_t b = 0; b < sizeof(id); ++b) id.internal[b] = static_cast<char>(std::stoi(std::string(argv[3] + 2 * b, 2), nullptr, 16));
  ncclComm_t comm = nullptr;
  try {
    if (cudaSetDevice(rank) != cudaSuccess) throw std::runtime_error("cudaSetDevice failed");
    if (ncclCommInitRank(&comm, ep_size, id, rank) != ncclSuccess) throw std::runtime_error("ncclCommInitRank failed");
    const mok::MoeShape shape = mok::testing::moe_shape(ep_size, 96, 4, 8 * ep_size, 256, 128);
    if (mismatch) {
      mok::MoeShape mine = shape;
      if (rank == 1) mine.num_tokens += 1;
      try {
        mok::MoeWorkspace workspace(mok::PeerGroup::nccl({comm}), mine);
      } catch (const std::invalid_argument& e) {
        const bool named = std::string(e.what()).find("MoeShape.num_tokens") != std::string::npos;
        std::printf("rank %d of %d: mismatched shapes rejected: %s\n", rank, ep_size, e.what());
        ncclCommDestroy(comm);
        return named ? 0 : 1;
      }
      throw std::runtime_error("a workspace was built on mismatched shapes");
    }
    {
      mok::testing::MoeHarness harness(mok::PeerGroup::nccl({comm}), shape);
      for (int hot = 0; hot < shape.top_k; ++hot) {
        const auto data = mok::testing::provenance_layer(shape, 300 + hot, 0.1, hot);
        harness.upload(data);
        harness.forward();
        const mok::StatusReport report = harness.status(rank);
        if (!report.ok()) throw std::runtime_error(report.describe(shape.num_tokens, shape.top_k, shape.num_experts));
        const std::string mismatch = mok::testing::check_provenance(data, rank, harness.out_bits(rank));
        if (!mismatch.empty()) throw std::runtime_error("hot slot " + std::to_string(hot) + ": " + mismatch);
      }
      harness.close();  // the collective teardown, explicitly on every rank, before the communicator goes
    }
    ncclCommDestroy(comm);
    std::printf("rank %d of %d: provenance exact for every hot slot\n", rank, ep_size);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
    return 1;
  }
}
