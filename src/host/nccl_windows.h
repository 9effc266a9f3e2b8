// The one piece of the NCCL communicator that needs device code: reading a window's LSA peer pointers.
#pragma once

#include <nccl.h>

#include "mok/peer_group.h"

namespace mok::detail {

// Every rank's base address of `window` as seen from the current device (the window's local rank), read
// through the NCCL device API. Synchronous (setup only).
PeerPointers window_peer_pointers(ncclWindow_t window, int ep_size);

// Ranks of the communicator's LSA team (the ranks this one reaches by load/store over NVLink).
int lsa_team_size(ncclComm_t comm);

}  // namespace mok::detail
