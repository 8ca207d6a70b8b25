// NCCL point-to-point transfers (nccl.h).
#include "nccl.h"

#include <dlfcn.h>

#include <mutex>
#include <stdexcept>

namespace cgx2 {
namespace {

// The few NCCL entry points used, by their C signatures (nccl.h, stable since NCCL 2.7).
using Result = int;  // ncclResult_t: 0 is ncclSuccess
constexpr int kUint8 = 1;  // ncclUint8
using GroupFn = Result (*)();
using TransferFn = Result (*)(void *, size_t, int, int, void *, void *);
// ncclAllGather(const void* send, void* recv, size_t count, ncclDataType_t, ncclComm_t,
// cudaStream_t)
using AllGatherFn = Result (*)(const void *, void *, size_t, int, void *, void *);
using ErrorStringFn = const char *(*)(Result);
using LastErrorFn = const char *(*)(void *);
using VersionFn = Result (*)(int *);

struct Nccl {
  GroupFn group_start = nullptr, group_end = nullptr;
  TransferFn send = nullptr, recv = nullptr;
  AllGatherFn all_gather = nullptr;  // optional: callers fall back to transfers without it
  ErrorStringFn error_string = nullptr;
  LastErrorFn last_error = nullptr;
  VersionFn version = nullptr;
  std::string missing;
};

const Nccl &nccl() {
  static Nccl found;
  static std::once_flag once;
  std::call_once(once, [] {
    // The library torch loaded, not another copy: its communicators are that library's.
    void *handle = dlopen("libnccl.so.2", RTLD_NOW | RTLD_NOLOAD);
    if (handle == nullptr) {
      found.missing = "no NCCL library is loaded in this process (torch without CUDA?)";
      return;
    }
    found.group_start = reinterpret_cast<GroupFn>(dlsym(handle, "ncclGroupStart"));
    found.group_end = reinterpret_cast<GroupFn>(dlsym(handle, "ncclGroupEnd"));
    // ncclSend(const void*, size_t, ncclDataType_t, int peer, ncclComm_t, cudaStream_t)
    found.send = reinterpret_cast<TransferFn>(dlsym(handle, "ncclSend"));
    found.recv = reinterpret_cast<TransferFn>(dlsym(handle, "ncclRecv"));
    found.all_gather = reinterpret_cast<AllGatherFn>(dlsym(handle, "ncclAllGather"));
    found.error_string = reinterpret_cast<ErrorStringFn>(dlsym(handle, "ncclGetErrorString"));
    found.last_error = reinterpret_cast<LastErrorFn>(dlsym(handle, "ncclGetLastError"));
    found.version = reinterpret_cast<VersionFn>(dlsym(handle, "ncclGetVersion"));
    if (!found.group_start || !found.group_end || !found.send || !found.recv ||
        !found.error_string) {
      found.missing = "the loaded NCCL library lacks ncclSend/ncclRecv/ncclGroupStart";
    }
  });
  return found;
}

void check(const Nccl &lib, Result result, const char *what) {
  if (result == 0) return;
  std::string message = std::string("NCCL ") + what + " failed: " + lib.error_string(result);
  if (lib.last_error != nullptr) {
    const char *detail = lib.last_error(nullptr);
    if (detail != nullptr && *detail != '\0') message += std::string(" (") + detail + ")";
  }
  throw std::runtime_error(message);
}

}  // namespace

bool nccl_available(std::string *why) {
  const Nccl &lib = nccl();
  if (why != nullptr) *why = lib.missing;
  return lib.missing.empty();
}

int nccl_version() {
  const Nccl &lib = nccl();
  int version = 0;
  if (lib.missing.empty() && lib.version != nullptr) lib.version(&version);
  return version;
}

void nccl_transfers(uintptr_t comm, uintptr_t stream,
                    const std::vector<uintptr_t> &send_addresses,
                    const std::vector<size_t> &send_bytes, const std::vector<int> &send_peers,
                    const std::vector<uintptr_t> &recv_addresses,
                    const std::vector<size_t> &recv_bytes, const std::vector<int> &recv_peers) {
  const Nccl &lib = nccl();
  if (!lib.missing.empty()) throw std::runtime_error("cgx2: " + lib.missing);
  if (comm == 0) throw std::runtime_error("cgx2: the NCCL communicator is not made yet");
  if (send_addresses.size() != send_bytes.size() || send_bytes.size() != send_peers.size() ||
      recv_addresses.size() != recv_bytes.size() || recv_bytes.size() != recv_peers.size()) {
    throw std::invalid_argument("cgx2: transfers' addresses, sizes and peers differ in length");
  }
  void *c = reinterpret_cast<void *>(comm);
  void *s = reinterpret_cast<void *>(stream);
  check(lib, lib.group_start(), "ncclGroupStart");
  Result result = 0;
  for (size_t i = 0; i < send_addresses.size() && result == 0; i++) {
    result = lib.send(reinterpret_cast<void *>(send_addresses[i]), send_bytes[i], kUint8,
                      send_peers[i], c, s);
  }
  for (size_t i = 0; i < recv_addresses.size() && result == 0; i++) {
    result = lib.recv(reinterpret_cast<void *>(recv_addresses[i]), recv_bytes[i], kUint8,
                      recv_peers[i], c, s);
  }
  Result ended = lib.group_end();  // always closed, even after a failed call inside
  check(lib, result, "ncclSend/ncclRecv");
  check(lib, ended, "ncclGroupEnd");
}

bool nccl_has_all_gather() {
  const Nccl &lib = nccl();
  return lib.missing.empty() && lib.all_gather != nullptr;
}

void nccl_all_gather(uintptr_t comm, uintptr_t stream, uintptr_t send, uintptr_t recv,
                     size_t bytes) {
  const Nccl &lib = nccl();
  if (!lib.missing.empty()) throw std::runtime_error("cgx2: " + lib.missing);
  if (lib.all_gather == nullptr) throw std::runtime_error("cgx2: NCCL lacks ncclAllGather");
  if (comm == 0) throw std::runtime_error("cgx2: the NCCL communicator is not made yet");
  check(lib,
        lib.all_gather(reinterpret_cast<const void *>(send), reinterpret_cast<void *>(recv),
                       bytes, kUint8, reinterpret_cast<void *>(comm),
                       reinterpret_cast<void *>(stream)),
        "ncclAllGather");
}

}  // namespace cgx2
