// Shared-memory segments and the flags that order their use between the processes of one host
// (cgx2/comm/shm.py builds the transport on them).
#pragma once

#include <stddef.h>
#include <stdint.h>

#include <string>
#include <utility>
#include <vector>

namespace cgx2 {

// A shared-memory segment mapped into this process: an anonymous memory file (memfd) that has no
// name anywhere, so that nothing outlives the processes that map it, however they end. Its peers
// open it through its creator's /proc/<pid>/fd/<fd> while the creator keeps that open.
class Segment {
 public:
  // Makes one of `nbytes` (mode 0600 whatever the umask), its pages reserved up front so that a
  // full memory cgroup is an error here rather than a SIGBUS on first touch. Its descriptor
  // stays open, for peers to open, until release().
  static Segment *create(size_t nbytes);
  // Maps the segment that process `pid` holds open as descriptor `fd`: only a regular file of
  // this user's, open to no one else, of at least `nbytes`, and the inode its creator announced
  // (so that a reused descriptor or process ID is refused).
  static Segment *open(int64_t pid, int fd, size_t nbytes, uint64_t inode);

  Segment(void *address, size_t nbytes, int fd, uint64_t inode)
      : address_(address), nbytes_(nbytes), fd_(fd), inode_(inode) {}
  ~Segment();
  Segment(const Segment &) = delete;
  Segment &operator=(const Segment &) = delete;

  uintptr_t address() const { return reinterpret_cast<uintptr_t>(address_); }
  size_t nbytes() const { return nbytes_; }
  // The descriptor peers open (-1 once released or for a segment opened here).
  int fd() const { return fd_; }
  uint64_t inode() const { return inode_; }
  // Closes the descriptor: the mapping stays.
  void release();

 private:
  void *address_;
  size_t nbytes_;
  int fd_;
  uint64_t inode_;
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
