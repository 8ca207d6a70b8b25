// Shared-memory segments and the flags that order their use between the processes of one host
// (cgx2/comm/shm.py builds the transport on them).
#pragma once

#include <stddef.h>
#include <stdint.h>

#include <string>
#include <utility>
#include <vector>

namespace cgx2 {

// A POSIX shared-memory segment mapped into this process; unmapped when destroyed.
class Segment {
 public:
  // Creates `name` (O_EXCL, mode 0600 whatever the umask) of `nbytes`, its pages reserved up
  // front so that a full /dev/shm is an error here rather than a SIGBUS on first touch.
  static Segment *create(const std::string &name, size_t nbytes);
  // Maps the existing `name`: only a regular file of this user's, open to no one else, of at
  // least `nbytes`.
  static Segment *open(const std::string &name, size_t nbytes);
  // Removes `name`; mappings stay valid. False where it was already gone.
  static bool unlink(const std::string &name);

  Segment(void *address, size_t nbytes) : address_(address), nbytes_(nbytes) {}
  ~Segment();
  Segment(const Segment &) = delete;
  Segment &operator=(const Segment &) = delete;

  uintptr_t address() const { return reinterpret_cast<uintptr_t>(address_); }
  size_t nbytes() const { return nbytes_; }

 private:
  void *address_;
  size_t nbytes_;
};

// Stores `value` into the 32-bit flag at `address` (release) and wakes its waiters.
void signal_flag(uintptr_t address, uint32_t value);

// The flag's value (acquire).
uint32_t load_flag(uintptr_t address);

enum WaitResult { kReady = 0, kTimedOut = 1, kPeerGone = 2 };

// Waits until every flag in `addresses` has reached `target` (epochs compare modulo 2**32);
// the process of flag i is `pids[i]`, started at `starts[i]` (its /proc start time). Returns
// {kReady, -1}, or {kTimedOut or kPeerGone, i} for the first flag i that did not arrive.
std::pair<int, int> wait_flags(const std::vector<uintptr_t> &addresses, uint32_t target,
                               double timeout_s, const std::vector<int64_t> &pids,
                               const std::vector<uint64_t> &starts);

// The start time of process `pid` (field 22 of /proc/<pid>/stat), 0 where it is gone.
uint64_t process_start_time(int64_t pid);

// Whether `pid` still runs (not a zombie) and is the process that started at `start`.
bool process_alive(int64_t pid, uint64_t start);

}  // namespace cgx2
