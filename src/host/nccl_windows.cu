// Reads an NCCL symmetric window's peer pointers on the GPU, once at allocation time. Kernels then take the
// plain PeerPointers table, the same type the in-process peer groups fill, so no stage kernel depends on
// the kind of communicator.
#include "src/host/nccl_windows.h"

#include <stdexcept>

#include <nccl_device.h>

#include "mok/device_buffer.h"

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
  int device = 0;
  MOK_CHECK_CUDA(cudaGetDevice(&device));
  const DeviceBuffer device_table(device, sizeof(PeerPointers));
  window_peer_pointers_kernel<<<1, 128>>>(window, ep_size, static_cast<PeerPointers*>(device_table.get()));
  MOK_CHECK_CUDA(cudaGetLastError());
  PeerPointers table{};
  MOK_CHECK_CUDA(cudaMemcpy(&table, device_table.get(), sizeof(table), cudaMemcpyDeviceToHost));
  return table;
}

int lsa_team_size(ncclComm_t comm) { return ncclTeamLsa(comm).nRanks; }

}  // namespace mok::detail
