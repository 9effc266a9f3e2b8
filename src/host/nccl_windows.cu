// Reads an NCCL symmetric window's peer pointers on the GPU, once at allocation time. Kernels then take the
// plain PeerPointers table, the same type the in-process peer groups fill, so no stage kernel depends on
// the kind of communicator.
#include "src/host/nccl_windows.h"

#include <stdexcept>

#include <nccl_device.h>

#include "src/host/check.h"

namespace mok::detail {
namespace {

// ncclGetPeerPointer addresses world ranks (the group checked that the world is one LSA team).
__global__ void window_peer_pointers_kernel(ncclWindow_t window, int ep_size, PeerPointers* table) {
  for (int peer = threadIdx.x; peer < ep_size; peer += blockDim.x)
    table->base[peer] = ncclGetPeerPointer(window, 0, peer);
}

}  // namespace

PeerPointers window_peer_pointers(ncclWindow_t window, int ep_size) {
  if (window == nullptr) throw std::runtime_error("NCCL returned no window for a symmetric allocation");
  PeerPointers* device_table = nullptr;
  MOK_CHECK_CUDA(cudaMalloc(&device_table, sizeof(PeerPointers)));
  window_peer_pointers_kernel<<<1, 128>>>(window, ep_size, device_table);
  PeerPointers table{};
  cudaError_t error = cudaGetLastError();
  if (error == cudaSuccess) error = cudaMemcpy(&table, device_table, sizeof(table), cudaMemcpyDeviceToHost);
  cudaFree(device_table);
  MOK_CHECK_CUDA(error);
  return table;
}

int lsa_team_size(ncclComm_t comm) { return ncclTeamLsa(comm).nRanks; }

}  // namespace mok::detail
