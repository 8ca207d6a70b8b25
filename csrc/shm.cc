// Shared-memory segments and epoch flags (shm.h).
#include "shm.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstring>
#include <system_error>

namespace cgx2 {
namespace {

#ifdef MFD_NOEXEC_SEAL
constexpr unsigned kNoExecSeal = MFD_NOEXEC_SEAL;
#else
constexpr unsigned kNoExecSeal = 0x0008U;  // Linux 6.3's MFD_NOEXEC_SEAL
#endif

[[noreturn]] void fail(int error, const std::string &what) {
  throw std::system_error(error, std::generic_category(), what);
}

std::atomic<uint32_t> *flag_at(uintptr_t address) {
  return reinterpret_cast<std::atomic<uint32_t> *>(address);
}

// Epochs wrap: a flag has reached `target` when it is at most 2**31 - 1 past it.
bool reached(uint32_t value, uint32_t target) {
  return static_cast<int32_t>(value - target) >= 0;
}

long futex(uintptr_t address, int op, uint32_t value, const struct timespec *timeout) {
  // Not FUTEX_PRIVATE_FLAG: the waiters are in other processes.
  return syscall(SYS_futex, reinterpret_cast<uint32_t *>(address), op, value, timeout, nullptr, 0);
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Fields 3 (state) and 22 (start time) of /proc/<pid>/stat; false where it cannot be read.
bool read_stat(int64_t pid, char *state, uint64_t *start) {
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%lld/stat", static_cast<long long>(pid));
  FILE *f = std::fopen(path, "r");
  if (f == nullptr) return false;
  char line[1024];
  size_t n = std::fread(line, 1, sizeof line - 1, f);
  std::fclose(f);
  line[n] = '\0';
  const char *end = std::strrchr(line, ')');  // the command's name may hold spaces and ')'
  if (end == nullptr) return false;
  unsigned long long starttime = 0;
  // After ") ": state (3), then fields 4..21, then starttime (22).
  int got = std::sscanf(end + 2,
                        "%c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %*u %*u %*d %*d %*d %*d "
                        "%*d %*d %llu",
                        state, &starttime);
  if (got != 2) return false;
  *start = starttime;
  return true;
}

}  // namespace

Segment *Segment::create(size_t nbytes) {
  // Without MFD_NOEXEC_SEAL where the kernel predates it; with it where vm.memfd_noexec asks.
  int fd = memfd_create("cgx2-segment", MFD_CLOEXEC | kNoExecSeal);
  if (fd < 0 && errno == EINVAL) fd = memfd_create("cgx2-segment", MFD_CLOEXEC);
  if (fd < 0) fail(errno, "creating a shared-memory segment (memfd_create)");
  struct stat info;
  // The umask can only take bits away; this makes sure no one else has any.
  if (fchmod(fd, 0600) != 0 || ftruncate(fd, static_cast<off_t>(nbytes)) != 0 ||
      fstat(fd, &info) != 0) {
    int error = errno;
    close(fd);
    fail(error, "sizing a shared-memory segment");
  }
  int error = posix_fallocate(fd, 0, static_cast<off_t>(nbytes));
  if (error != 0) {
    close(fd);
    fail(error, "reserving " + std::to_string(nbytes) + " bytes of shared memory");
  }
  void *address = mmap(nullptr, nbytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (address == MAP_FAILED) {
    error = errno;
    close(fd);
    fail(error, "mapping a shared-memory segment");
  }
  return new Segment(address, nbytes, fd, static_cast<uint64_t>(info.st_ino));
}

Segment *Segment::open(int64_t pid, int fd, size_t nbytes, uint64_t inode) {
  const std::string name =
      "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(fd);
  int mine = ::open(name.c_str(), O_RDWR | O_CLOEXEC);
  if (mine < 0) fail(errno, "opening shared-memory segment " + name);
  struct stat info;
  if (fstat(mine, &info) != 0) {
    int error = errno;
    close(mine);
    fail(error, "inspecting shared-memory segment " + name);
  }
  const char *wrong = nullptr;
  if (!S_ISREG(info.st_mode)) {
    wrong = "is not a regular file";
  } else if (info.st_uid != geteuid()) {
    wrong = "is owned by another user";
  } else if ((info.st_mode & 077) != 0) {
    wrong = "is open to other users (its mode is not 0600)";
  } else if (static_cast<uint64_t>(info.st_ino) != inode) {
    wrong = "is not the file its creator announced";
  } else if (static_cast<size_t>(info.st_size) < nbytes) {
    wrong = "is smaller than its creator announced";
  }
  if (wrong != nullptr) {
    close(mine);
    fail(EPERM, "refusing shared-memory segment " + name + ": it " + wrong);
  }
  void *address = mmap(nullptr, nbytes, PROT_READ | PROT_WRITE, MAP_SHARED, mine, 0);
  int error = errno;
  close(mine);
  if (address == MAP_FAILED) fail(error, "mapping shared-memory segment " + name);
  return new Segment(address, nbytes, -1, inode);
}

void Segment::release() {
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
}

Segment::~Segment() {
  release();
  if (address_ != nullptr) munmap(address_, nbytes_);
}

void signal_flag(uintptr_t address, uint32_t value) {
  flag_at(address)->store(value, std::memory_order_release);
  futex(address, FUTEX_WAKE, INT_MAX, nullptr);
}

uint32_t load_flag(uintptr_t address) { return flag_at(address)->load(std::memory_order_acquire); }

uint64_t process_start_time(int64_t pid) {
  char state;
  uint64_t start;
  return read_stat(pid, &state, &start) ? start : 0;
}

bool process_alive(int64_t pid, uint64_t start) {
  char state;
  uint64_t now;
  if (!read_stat(pid, &state, &now)) return false;
  return state != 'Z' && state != 'X' && state != 'x' && now == start;
}

std::pair<int, int> wait_flags(const std::vector<uintptr_t> &addresses, uint32_t target,
                               double timeout_s, const std::vector<int64_t> &pids,
                               const std::vector<uint64_t> &starts) {
  using Clock = std::chrono::steady_clock;
  const auto begin = Clock::now();
  const auto deadline = begin + std::chrono::duration_cast<Clock::duration>(
                                    std::chrono::duration<double>(timeout_s));
  // How long a futex wait lasts before the peer's process is looked at again.
  constexpr auto kLivenessPeriod = std::chrono::milliseconds(20);
  for (size_t i = 0; i < addresses.size(); i++) {
    const uintptr_t address = addresses[i];
    // A short spin first: a peer a few microseconds behind costs no system call.
    bool ready = false;
    for (int k = 0; k < 256 && !ready; k++) {
      ready = reached(load_flag(address), target);
      if (!ready) cpu_relax();
    }
    while (!ready) {
      const uint32_t seen = load_flag(address);
      if (reached(seen, target)) break;
      const auto now = Clock::now();
      if (now >= deadline) return {kTimedOut, static_cast<int>(i)};
      if (i < pids.size() && !process_alive(pids[i], i < starts.size() ? starts[i] : 0)) {
        // It may have signalled just before exiting.
        if (reached(load_flag(address), target)) break;
        return {kPeerGone, static_cast<int>(i)};
      }
      auto wait = std::min<Clock::duration>(deadline - now, kLivenessPeriod);
      auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(wait).count();
      struct timespec timeout = {static_cast<time_t>(ns / 1000000000),
                                 static_cast<long>(ns % 1000000000)};
      futex(address, FUTEX_WAIT, seen, &timeout);  // returns at once if the flag moved on
      ready = reached(load_flag(address), target);
    }
  }
  return {kReady, -1};
}

}  // namespace cgx2
