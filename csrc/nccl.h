// Point-to-point transfers on an NCCL communicator that torch made: the NCCL library torch
// already loaded, looked up at run time (no CUDA or NCCL headers at build time).
#pragma once

#include <stddef.h>
#include <stdint.h>

#include <string>
#include <vector>

namespace cgx2 {

// Whether this process has an NCCL library loaded (torch's); `why` says what is missing.
bool nccl_available(std::string *why);

// The NCCL version (e.g. 22809 for 2.28.9), 0 where NCCL is not loaded.
int nccl_version();

// One grouped set of transfers on `comm`, queued on `stream`: send_bytes[i] bytes from
// send_addresses[i] to rank send_peers[i], and receive recv_bytes[i] bytes from rank
// recv_peers[i] into recv_addresses[i]. Throws std::runtime_error with NCCL's message.
void nccl_transfers(uintptr_t comm, uintptr_t stream,
                    const std::vector<uintptr_t> &send_addresses,
                    const std::vector<size_t> &send_bytes, const std::vector<int> &send_peers,
                    const std::vector<uintptr_t> &recv_addresses,
                    const std::vector<size_t> &recv_bytes, const std::vector<int> &recv_peers);

// Whether the loaded NCCL has ncclAllGather (every NCCL torch ships does).
bool nccl_has_all_gather();

// ncclAllGather of `bytes` bytes from every rank's `send` into `recv` (rank r's at offset
// r * bytes; in place where `send` is this rank's slot), queued on `stream`.
void nccl_all_gather(uintptr_t comm, uintptr_t stream, uintptr_t send, uintptr_t recv,
                     size_t bytes);

}  // namespace cgx2
